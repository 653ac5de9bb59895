"""Metrics: W&B (offline unless asked), a local JSONL file, timers and a reward plot.

Every step's metrics go to `<run_dir>/metrics.jsonl` (one JSON object a line,
always) and to W&B. W&B runs offline by default, so a run never needs network or
an account; `logger.wandb_mode=online` with WANDB_API_KEY set streams them live.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

WandbMode = Literal["offline", "online", "disabled"]
METRICS_FILE = "metrics.jsonl"  # in the run directory


@dataclass
class LoggerConfig:
    """The `logger` config group."""

    project: str = "moerl"
    run_name: str | None = None
    wandb_mode: WandbMode = "offline"
    plot: bool = True  # write reward.png at the end of a run


@dataclass
class StepTimer:
    """Wall time per named phase of a step (rollout / reward / train / sync)."""

    seconds: dict[str, float] = field(default_factory=dict)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def as_metrics(self) -> dict[str, float]:
        """`time/<phase>` for each phase; the step's own wall time (`time/step`) is the
        loop's to measure, since phases may overlap (async) or leave gaps."""
        return {f"time/{k}": v for k, v in self.seconds.items()}


class MetricsLogger:
    """Writes metrics to JSONL and W&B; only the logging rank should make one."""

    def __init__(self, cfg: LoggerConfig, run_dir: Path, config: dict[str, Any]) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / METRICS_FILE
        self._wandb: Any = None
        if cfg.wandb_mode != "disabled":
            import wandb

            self._wandb = wandb.init(
                project=cfg.project,
                name=cfg.run_name,
                mode=cfg.wandb_mode,
                dir=str(run_dir),
                config=config,
                reinit="finish_previous",
            )

    def log(self, step: int, metrics: dict[str, float]) -> None:
        row = {"step": step, **{k: float(v) for k, v in metrics.items()}}
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        if self._wandb is not None:
            self._wandb.log(metrics, step=step)

    def drop_from(self, step: int) -> None:
        """Forget the JSONL rows of steps >= `step`: a run resumed at `step` writes
        them again (a killed run may have logged steps past its last checkpoint)."""
        if self.path.exists():
            kept = [r for r in read_metrics(self.path) if r["step"] < step]
            tmp = self.path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
            tmp.replace(self.path)

    def close(self, plot_keys: tuple[str, ...] = ("reward/mean",)) -> Path | None:
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
        if self.cfg.plot and self.path.exists():
            return plot_metrics(self.path, plot_keys, self.run_dir / "reward.png")
        return None


def read_metrics(path: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_metrics(path: Path, keys: tuple[str, ...], out: Path) -> Path | None:
    """Line plot of `keys` over steps; None when no row has any of them."""
    rows = read_metrics(path)
    series = {k: [(r["step"], r[k]) for r in rows if k in r] for k in keys}
    series = {k: v for k, v in series.items() if v}
    if not series:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for key, points in series.items():
        steps, values = zip(*points, strict=True)
        ax.plot(steps, values, marker="o", markersize=3, label=key)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def plot_panels(path: Path, panels: dict[str, tuple[str, ...]], out: Path) -> Path | None:
    """One panel per title, each a line plot of its keys over steps (the key's last
    part, after '/', labels its line); None when no row has any key."""
    rows = read_metrics(path)
    series = {title: {k: [(r["step"], r[k]) for r in rows if k in r] for k in keys}
              for title, keys in panels.items()}
    series = {t: {k: v for k, v in ks.items() if v} for t, ks in series.items()}
    series = {t: ks for t, ks in series.items() if ks}
    if not series:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(series), figsize=(5.5 * len(series), 3.5), squeeze=False)
    for ax, (title, keys) in zip(axes[0], series.items(), strict=True):
        for key, points in keys.items():
            steps, values = zip(*points, strict=True)
            ax.plot(steps, values, marker="o", markersize=3, label=key.rsplit("/", 1)[-1])
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
