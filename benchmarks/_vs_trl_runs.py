"""The runs of benchmarks/learning_vs_trl.py: the shared initial model, one `moerl train`,
one TRL side (benchmarks/_trl_side.py) with its reward server, and what each did.

Not a benchmark (the leading underscore keeps it out of the smoke test's list).
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from _cpu import StepCpu

from moerl.parent_death import wrapped
from moerl.rendezvous import discover

HERE = Path(__file__).resolve().parent
# The bar's last render ends with its elapsed time (h:mm:ss); the next line ends SFT.
_BAR = re.compile(r"SFT .*\b(\d+):(\d\d):(\d\d)\s*$")
_SFT_END = re.compile(r"SFT: loss .* over \d+ steps")
_QUIET = {**os.environ, "PYTHONWARNINGS": "ignore"}

Eval = tuple[int, float, float, float]  # (RL step, s from SFT start at its end, rate, its s)


@dataclass
class Trace:
    """What one system did in one run; times in seconds from its SFT start."""

    params: int
    startup_s: float  # launch to SFT start
    sft_s: float
    step_s: list[float]  # of each RL step, generation to weight push
    reward_s: list[float]  # of each step, in the reward server
    samples_per_step: int
    evals: list[Eval]
    rewards: list[float]  # mean reward of each RL step's samples
    # CPU seconds of each RL step (the first one measured may be missing), all the run's
    # processes and of them the reward server's (`_cpu.StepCpu`)
    cpu_s: list[float] = field(default_factory=list)
    reward_cpu_s: list[float] = field(default_factory=list)

    def median_cpu(self, rewards: bool = True) -> float | None:
        """Median CPU seconds of an RL step after the first, without the reward server's
        when `rewards` is False; None when no step was measured."""
        steps = [c - (0.0 if rewards else r) for c, r in zip(self.cpu_s, self.reward_cpu_s,
                                                            strict=True)]
        return statistics.median(steps[1:] or steps) if steps else None

    def median_step(self, rewards: bool = True) -> float:
        """Median over the steps after the first (which warms up); without the rewards'
        seconds when `rewards` is False."""
        steps = [s - (0.0 if rewards else r) for s, r in zip(self.step_s, self.reward_s,
                                                             strict=True)]
        return statistics.median(steps[1:] or steps)

    def median_reward_s(self) -> float:
        return statistics.median(self.reward_s[1:] or self.reward_s)

    def training_s(self) -> list[float]:
        """For each evaluation: seconds from SFT start to its end, less the time of it and
        of every evaluation before it (evaluation is not training, and the two systems
        generate and grade the held-out set at different speeds)."""
        spent, out = 0.0, []
        for _, when, _, took in self.evals:
            spent += took
            out.append(when - spent)
        return out

    def reached(self, threshold: float) -> float | None:
        """Training seconds to the first evaluation at or above `threshold`."""
        return next((t for t, (_, _, rate, _) in zip(self.training_s(), self.evals, strict=True)
                     if rate >= threshold), None)


def shared_init(out: Path, seed: int, overrides: Sequence[str]) -> None:
    """moerl's initial model for `seed` as Megatron weights and as a HF directory."""
    argv = [sys.executable, str(HERE / "_shared_init.py"), str(out), str(seed), *overrides]
    done = subprocess.run(wrapped(argv), capture_output=True, text=True, env=_QUIET,
                          check=False)
    if done.returncode != 0:
        raise SystemExit(f"the shared initial model failed:\n{done.stdout[-2000:]}"
                         f"{done.stderr[-3000:]}")
    print(done.stdout.strip().splitlines()[-1], flush=True)


def run_moerl(overrides: Sequence[str], run_dir: Path, samples: int, params: int) -> Trace:
    """One `moerl train` run; its metrics rows are timed as they appear (every 0.25 s)."""
    argv = [sys.executable, "-u", "-m", "moerl.launchers.cli", "train", *overrides,
            f"run_dir={run_dir}", "checkpoint.dir=null", "logger.wandb_mode=disabled"]
    lines: list[tuple[float, str]] = []
    rows: list[tuple[float, dict[str, float]]] = []
    started = time.time()
    # Through the parent-death wrapper: the run ends with this process on any exit.
    proc = subprocess.Popen(wrapped(argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=_QUIET)
    reader = threading.Thread(target=lambda: lines.extend(
        (time.time(), line) for line in proc.stdout or ()), daemon=True)
    reader.start()
    metrics, cpu = run_dir / "metrics.jsonl", StepCpu()
    while True:
        running = proc.poll() is None
        done = metrics.read_text().splitlines() if metrics.exists() else []
        new = [(time.time(), json.loads(x)) for x in done[len(rows):] if x.endswith("}")]
        if new and running:
            cpu.mark([proc.pid], [_kind(r) for _, r in new])
        rows += new
        if not running:
            break
        time.sleep(0.1)
    reader.join()
    (run_dir.parent / f"{run_dir.name}.log").write_text("".join(line for _, line in lines))
    if proc.returncode != 0:
        tail = "".join(line for _, line in lines[-40:])
        raise SystemExit(f"moerl train failed ({proc.returncode}):\n{tail}")
    t0, sft_s = sft_window(lines) if (run_dir / "sft").exists() else (started, 0.0)
    steps = [r for _, r in rows if "time/step" in r]
    evals = [(int(r["step"]), t - t0, r["eval/pass_rate"], r["time/eval"]) for t, r in rows
             if "eval/pass_rate" in r]
    return Trace(params, t0 - started, sft_s, [r["time/step"] for r in steps],
                 [r.get("time/reward", 0.0) for r in steps], samples, evals,
                 [r["reward/mean"] for r in steps], cpu.total, cpu.reward)


def _kind(row: dict[str, float]) -> str:
    return "step" if "time/step" in row else "eval" if "eval/pass_rate" in row else "other"


def sft_window(lines: list[tuple[float, str]]) -> tuple[float, float]:
    """(SFT start, SFT seconds) of `moerl train`, from its output lines and their times."""
    ends = [t for t, line in lines if _SFT_END.search(line)]
    bars = [match for _, line in lines if (match := _BAR.search(line))]
    if not ends or not bars:
        raise SystemExit("moerl train printed no SFT progress; its output format changed?")
    h, m, s = (int(x) for x in bars[-1].groups())
    seconds = h * 3600 + m * 60 + s + 0.5  # the bar shows whole seconds
    return ends[0] - seconds, seconds


@contextmanager
def reward_server(tmp: Path, concurrency: int, warm_slots: int, isolation: str
                  ) -> Iterator[tuple[str, int]]:
    """A `moerl serve reward` as `moerl train` starts one; (its URL, its pid) while the
    block runs."""
    rendezvous = tmp / "rendezvous"
    argv = [sys.executable, "-m", "moerl.launchers.cli", "serve", "reward", "--host",
            "127.0.0.1", "--port", "0", "--max-concurrency", str(concurrency), "--isolation",
            isolation, "--warm-slots", str(warm_slots), "--rendezvous-dir", str(rendezvous)]
    with open(tmp / "reward.log", "w") as log:
        proc = subprocess.Popen(wrapped(argv), stdout=log, stderr=subprocess.STDOUT, env=_QUIET)

    def alive() -> None:
        if proc.poll() is not None:
            raise SystemExit(f"the reward server exited ({proc.returncode}): "
                             f"{(tmp / 'reward.log').read_text()[-2000:]}")

    try:
        yield "http://" + discover(rendezvous, "reward", 1, timeout=120, check=alive)[0], proc.pid
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def run_trl(tmp: Path, spec: dict[str, object], reward_pid: int) -> Trace:
    """One TRL side in its own process, `spec` as benchmarks/_trl_side.py reads it; the
    CPU of its steps counts its reward server's (`reward_pid`)."""
    spec_file, result, log = tmp / "spec.json", tmp / "result.json", tmp / "trl.log"
    spec_file.write_text(json.dumps(spec))
    started, cpu, seen = time.time(), StepCpu(), 0
    with open(log, "w") as out:
        argv = wrapped([sys.executable, "-u", str(HERE / "_trl_side.py"), str(spec_file),
                        str(result)])
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=_QUIET)
        while proc.poll() is None:
            lines = log.read_text(errors="replace").splitlines()
            kinds = [k for line in lines[seen:] if (k := _line_kind(line))]
            seen = len(lines)
            if kinds:
                cpu.mark([proc.pid, reward_pid], kinds)
            time.sleep(0.1)
    if proc.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
        raise SystemExit(f"the TRL side failed ({proc.returncode}):\n{tail}")
    r = json.loads(result.read_text())
    return Trace(r["params"], r["sft_start"] - started, r["sft_s"], r["step_s"], r["reward_s"],
                 r["samples_per_step"], [tuple(e) for e in r["evals"]], r["rewards"],
                 cpu.total, cpu.reward)


def _line_kind(line: str) -> str | None:
    """What a line of the TRL side reports (benchmarks/_trl_side.py's Clock prints them)."""
    return "step" if line.startswith("RL step ") else "eval" if line.startswith(
        "eval at step ") else None
