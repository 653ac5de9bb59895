"""A mixture run's per-domain report: start-up checks of the reward names its domains
use, and at the end a table and a plot of every domain's held-out evaluation and
training reward."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from rich.table import Table

from moerl.data.prompts import PromptRecord
from moerl.observability import plot_panels, read_metrics
from moerl.rewards.config import RewardStageConfig
from moerl.rewards.registry import BUILTIN
from moerl.rl.agent_collect import EPISODE
from moerl.typed_config import ConfigError


def check_reward_names(records: Sequence[PromptRecord], rewards: RewardStageConfig) -> None:
    """Every record's reward is served (built in, or `rewards.plugins`); otherwise the
    run stops here, naming the domain, rather than score its samples as errors."""
    served = set(BUILTIN) | set(rewards.plugins) | {EPISODE}
    for record in records:
        if record.reward not in served:
            where = f"data.domains.{record.domain}" if record.domain else "data"
            raise ConfigError(
                f"{where}: prompt {record.uid} is graded by reward {record.reward!r}, which "
                f"the reward servers do not serve (built in: {', '.join(sorted(BUILTIN))}); "
                f"add it as rewards.plugins.{record.reward}=package.module:Factory")


def _domains(rows: list[dict[str, float]], prefix: str) -> list[str]:
    return sorted({k.split("/", 1)[1] for r in rows for k in r if k.startswith(prefix)})


def domain_table(metrics_file: Path) -> Table:
    """Per domain: held-out pass rate and mean reward before and after RL (the first
    and last evaluations), and the training reward of the first and last steps."""
    rows = read_metrics(metrics_file)
    evals = [r for r in rows if "eval/pass_rate" in r]
    steps = [r for r in rows if "reward/mean" in r]
    table = Table(title="per-domain evaluation (held-out, greedy) and training reward")
    table.add_column("domain", no_wrap=True)
    for column in ("pass rate before", "pass rate after", "reward before", "reward after",
                   "train reward first", "train reward last"):
        table.add_column(column)

    def cell(row: dict[str, float] | None, key: str) -> str:
        return f"{row[key]:.3f}" if row is not None and key in row else "-"

    for name in _domains(rows, "domain_samples/"):
        first, last = (evals[0], evals[-1]) if evals else (None, None)
        table.add_row(name, cell(first, f"eval_pass_rate/{name}"),
                      cell(last, f"eval_pass_rate/{name}"), cell(first, f"eval_reward/{name}"),
                      cell(last, f"eval_reward/{name}"),
                      cell(steps[0] if steps else None, f"domain_reward/{name}"),
                      cell(steps[-1] if steps else None, f"domain_reward/{name}"))
    return table


def domain_plot(metrics_file: Path, run_dir: Path) -> Path | None:
    """domains.png: each domain's training reward by step, and its held-out pass rate at
    every evaluation; None outside a mixture."""
    if not metrics_file.exists():
        return None
    rows = read_metrics(metrics_file)
    names = _domains(rows, "domain_samples/")
    if not names:
        return None
    return plot_panels(metrics_file, {
        "training reward": tuple(f"domain_reward/{n}" for n in names),
        "held-out pass rate": tuple(f"eval_pass_rate/{n}" for n in names),
    }, run_dir / "domains.png")
