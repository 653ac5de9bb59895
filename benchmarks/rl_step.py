"""Cost of one RL step, phase by phase: a real `moerl train` run (reward server with
the sandbox, rollout server, trainer; local processes), no SFT, fixed-size steps.

    .venv/bin/python benchmarks/rl_step.py [--steps 6] [--prompts 4] [--group 8]
    .venv/bin/python benchmarks/rl_step.py --before REV [--repeat N]   # also REV's code
    .venv/bin/python benchmarks/rl_step.py --smoke   # 2 steps of 2 x 2 samples
    .venv/bin/python benchmarks/rl_step.py [options] KEY=VALUE ...   # more overrides

Each step generates `prompts x group` samples of the demo's code task (no dynamic
sampling, one generation round, one update), so every step has the same size. The
table shows each phase's median over the steps after the first (the first warms up),
its share of the step, and "between phases": the step's wall time (`time/step`, from
the start of generation to the end of the weight push) less the phases, i.e. the
handing over of samples, advantages and metrics. With `--before REV` the same run is
made first with the code and configs of git revision REV (a temporary worktree, this
environment's packages), and both tables are printed with the ratio of each phase;
`--repeat N` runs each code N times, in turns, and takes the median of each figure.
A second table gives each stage's CPU seconds per step (its processes' user and system
time, read from /proc, over the steps after the first): on a machine others load, wall
times stretch with their load, CPU seconds far less.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from _cpu import Reading, per_stage, tree_cpu
from _smoke import parse_with_smoke

from moerl.parent_death import wrapped

TABLE_TITLE = "one RL step, phase by phase"
NEEDS_EXECUTABLES = ("bwrap",)
SMOKE = {"steps": 2, "prompts": 2, "group": 2, "max_tokens": 4}
PHASES = (("rollout", "generation (rollout server)"), ("reward", "rewards (sandbox)"),
          ("train", "policy update"), ("sync", "weight push to rollout"))  # fmt: skip
# Each stage's processes, by what their command lines hold (the sandboxed programs count
# in the reward server's, which waits for them).
STAGES = {"trainer": "launchers.cli trainer", "rollout server": "serve rollout",
          "reward server": "serve reward"}


def add_run_arguments(parser: argparse.ArgumentParser, steps: int) -> None:
    """The size of the runs `run` starts (shared with benchmarks/async_speedup.py)."""
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--threads", type=int, default=0,
                        help="OMP_NUM_THREADS of every stage (0: leave as is)")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_run_arguments(parser, steps=6)
    parser.add_argument("--before", metavar="REV", default=None,
                        help="also measure git revision REV's code, first, in the same run")
    parser.add_argument("--repeat", type=int, default=1,
                        help="runs of each code, taken in turns (load that drifts during a "
                        "run then falls on both); each figure is their median")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="more `moerl train` overrides, e.g. model.mtp_num_layers=0")
    return parse_with_smoke(parser, SMOKE, argv)


def run(args: argparse.Namespace, run_dir: Path, extra: Sequence[str] = (),
        src: Path | None = None, cpu: dict[str, float] | None = None) -> list[dict[str, float]]:
    """The steps' metric rows of one `moerl train` run; `extra`: more overrides; `src`:
    another checkout's src/ to run instead of this one's; `cpu`: filled with each
    stage's CPU seconds per step over the steps after the first (`_cpu.per_stage`)."""
    argv = [sys.executable, "-m", "moerl.launchers.cli", "train", "+experiment=demo", "sft.steps=0",
            f"run_dir={run_dir}", "checkpoint.dir=null", "logger.wandb_mode=disabled",
            f"rl.steps={args.steps}", f"rl.prompts_per_step={args.prompts}",
            f"rl.group_size={args.group}", "rl.max_generation_rounds=1",
            "rl.dynamic_sampling=false", "rl.updates_per_step=1", "rl.eval_interval=0",
            "data.eval_size=2",
            f"rl.sampling.max_tokens={args.max_tokens}", *extra]  # fmt: skip
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    if src is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(src), env.get("PYTHONPATH")]))
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    log = run_dir.parent / "train.log"
    with open(log, "wb") as out:
        # The launcher ends with this process on any exit and takes its stages with it.
        proc = subprocess.Popen(wrapped(argv), stdout=out, stderr=subprocess.STDOUT, env=env)
        readings = _watch(proc, run_dir / "metrics.jsonl", (1, args.steps))
    if proc.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
        raise SystemExit(f"moerl train failed ({proc.returncode}):\n{tail}")
    if cpu is not None and len(readings) == 2 and args.steps > 1:
        spent = per_stage(readings[1], readings[args.steps], STAGES)
        cpu.update({k: v / (args.steps - 1) for k, v in spent.items()})
    if (run_dir / "sft").exists():  # `sft=none` beside the demo experiment still ran its SFT
        raise SystemExit(f"{run_dir}: the run did an SFT warm-up; these runs measure a fresh "
                         "model (sft.steps=0)")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "time/step" in r]


def _watch(proc: subprocess.Popen[bytes], metrics: Path, at: tuple[int, ...]
           ) -> dict[int, Reading]:
    """Wait for `proc`; the CPU seconds of its processes (`_cpu.tree_cpu`) when the
    metrics file first holds each number of step rows in `at`."""
    readings: dict[int, Reading] = {}
    while proc.poll() is None:
        lines = metrics.read_text().splitlines() if metrics.exists() else []
        steps = sum('"time/step"' in line for line in lines)
        for count in at:
            if count not in readings and steps >= count:
                readings[count] = tree_cpu(proc.pid)
        time.sleep(0.05)
    return readings


@contextmanager
def worktree(rev: str) -> Iterator[Path]:
    """A temporary checkout of `rev` from this repository."""
    repo = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory(prefix="moerl-before-") as tmp:
        path = Path(tmp) / "tree"
        subprocess.run(["git", "-C", str(repo), "worktree", "add", "--detach", "-q", str(path),
                        rev], check=True)  # fmt: skip
        try:
            yield path
        finally:
            subprocess.run(["git", "-C", str(repo), "worktree", "remove", "--force", str(path)],
                           check=False)  # fmt: skip


def phases(steps: list[dict[str, float]]) -> dict[str, float]:
    """Median seconds of each phase over the steps after the first, "between phases"
    and the whole step."""
    measured = steps[1:] or steps
    out = {key: statistics.median(r.get(f"time/{key}", 0.0) for r in measured)
           for key, _ in PHASES}  # fmt: skip
    out["step"] = statistics.median(r["time/step"] for r in measured)
    out["between"] = max(out["step"] - sum(out[key] for key, _ in PHASES), 0.0)
    return out


def print_table(columns: dict[str, dict[str, float]]) -> None:
    """One column per run (the last is this code's); its share of the step; with two
    runs, the ratio of the first to the second."""
    labels = [*PHASES, ("between", "between phases"), ("step", "whole step")]
    now = list(columns.values())[-1]
    pair = len(columns) == 2
    print(f"{'phase':<30}" + "".join(f" {name:>12}" for name in columns)
          + f" {'share':>6}" + (" before/after" if pair else ""))  # fmt: skip
    for key, label in labels:
        values = [c[key] for c in columns.values()]
        line = f"{label:<30}" + "".join(f" {v:>12.3f}" for v in values)
        line += f" {now[key] / now['step']:>6.0%}"
        if pair and values[1] > 0:
            line += f" {values[0] / values[1]:>12.2f}x"
        print(line)


def print_cpu(columns: dict[str, dict[str, float]]) -> None:
    """Each stage's CPU seconds per step, one column per run."""
    names = list(columns)
    print("CPU seconds per step, by stage (the sandboxed programs count in the reward "
          "server's)")
    print(f"{'stage':<30}" + "".join(f" {name:>12}" for name in names)
          + (" before/after" if len(names) == 2 else ""))
    for stage in [*STAGES, "other", "all"]:
        values = [sum(c.values()) if stage == "all" else c[stage] for c in columns.values()]
        line = f"{stage:<30}" + "".join(f" {v:>12.3f}" for v in values)
        if len(values) == 2 and values[1] > 0:
            line += f" {values[0] / values[1]:>12.2f}x"
        print(line)


def _median_of(runs: list[dict[str, float]]) -> dict[str, float]:
    return {key: statistics.median(r[key] for r in runs) for key in runs[0]}


def measure(args: argparse.Namespace, tmp: Path) -> tuple[
        dict[str, dict[str, float]], dict[str, dict[str, float]], float]:
    """(phases, CPU per stage) of each column, the median over `--repeat` rounds (each
    round runs REV's code, then this code's), and this code's last run's wall seconds."""
    names = [args.before[:10]] if args.before else []
    phase_runs: dict[str, list[dict[str, float]]] = {name: [] for name in [*names, "this code"]}
    cpu_runs: dict[str, list[dict[str, float]]] = {name: [] for name in phase_runs}
    wall = 0.0
    with contextlib.ExitStack() as stack:
        tree = stack.enter_context(worktree(args.before)) if args.before else None
        for round_ in range(args.repeat):
            for name in phase_runs:
                run_dir = tmp / f"{round_}-{name.replace(' ', '-')}" / "run"
                run_dir.parent.mkdir(parents=True)
                cpu: dict[str, float] = {}
                started = time.perf_counter()
                src = tree / "src" if tree is not None and name != "this code" else None
                phase_runs[name].append(phases(run(args, run_dir, args.overrides, src=src,
                                                   cpu=cpu)))
                wall = time.perf_counter() - started
                if cpu:
                    cpu_runs[name].append(cpu)
    cpu_columns = {n: _median_of(c) for n, c in cpu_runs.items() if c}
    return {n: _median_of(p) for n, p in phase_runs.items()}, cpu_columns, wall


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="moerl-rl-step-") as tmp:
        columns, cpu, wall = measure(args, Path(tmp))
    samples = args.prompts * args.group
    step = columns["this code"]["step"]
    print(TABLE_TITLE)
    print(f"{samples} samples a step ({args.prompts} prompts x {args.group}), median of "
          f"{max(args.steps - 1, 1)} steps" + (f", then of {args.repeat} runs taken in turns"
                                               if args.repeat > 1 else "")
          + f"; this code's last run took {wall:.0f} s with start-up")
    print_table(columns)
    print(f"samples/s: {samples / step:.1f}"
          + "".join(f"; {name}: {samples / c['step']:.1f}" for name, c in columns.items()
                    if name != "this code"))
    if len(cpu) == len(columns):
        print_cpu(cpu)


if __name__ == "__main__":
    main()
