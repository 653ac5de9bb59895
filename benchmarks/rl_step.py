"""Cost of one RL step, phase by phase: a real `moerl train` run (reward server with
the sandbox, rollout server, trainer; local processes), no SFT, fixed-size steps.

    .venv/bin/python benchmarks/rl_step.py [--steps 6] [--prompts 4] [--group 8]
    .venv/bin/python benchmarks/rl_step.py --smoke   # 2 steps of 2 x 2 samples

Each step generates `prompts x group` samples of the demo's code task (no dynamic
sampling, one generation round, one update), so every step has the same size. The
table shows each phase's median over the steps after the first (the first warms up),
its share of the step, and "between phases": the step's wall time (`time/step`, from
the start of generation to the end of the weight push) less the phases, i.e. the
handing over of samples, advantages and metrics.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from _smoke import parse_with_smoke

from moerl.parent_death import wrapped

TABLE_TITLE = "one RL step, phase by phase"
NEEDS_EXECUTABLES = ("bwrap",)
SMOKE = {"steps": 2, "prompts": 2, "group": 2, "max_tokens": 4}
PHASES = (("rollout", "generation (rollout server)"), ("reward", "rewards (sandbox)"),
          ("train", "policy update"), ("sync", "weight push to rollout"))  # fmt: skip


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
    return parse_with_smoke(parser, SMOKE, argv)


def run(args: argparse.Namespace, run_dir: Path, extra: Sequence[str] = ()
        ) -> list[dict[str, float]]:
    """The steps' metric rows of one `moerl train` run; `extra`: more overrides."""
    argv = [sys.executable, "-m", "moerl.launchers.cli", "train", "+experiment=demo", "sft=none",
            f"run_dir={run_dir}", "checkpoint.dir=null", "logger.wandb_mode=disabled",
            f"rl.steps={args.steps}", f"rl.prompts_per_step={args.prompts}",
            f"rl.group_size={args.group}", "rl.max_generation_rounds=1",
            "rl.dynamic_sampling=false", "rl.updates_per_step=1", "rl.eval_interval=0",
            "data.eval_size=2",
            f"rl.sampling.max_tokens={args.max_tokens}", *extra]  # fmt: skip
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    log = run_dir.parent / "train.log"
    with open(log, "wb") as out:
        # The launcher ends with this process on any exit and takes its stages with it.
        done = subprocess.run(wrapped(argv), stdout=out, stderr=subprocess.STDOUT, env=env,
                              check=False)
    if done.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
        raise SystemExit(f"moerl train failed ({done.returncode}):\n{tail}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "time/step" in r]


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="moerl-rl-step-") as tmp:
        started = time.perf_counter()
        steps = run(args, Path(tmp) / "run")
        wall = time.perf_counter() - started
    measured = steps[1:] or steps
    step = statistics.median(r["time/step"] for r in measured)
    samples = args.prompts * args.group
    print(TABLE_TITLE)
    print(f"{samples} samples a step ({args.prompts} prompts x {args.group}), "
          f"median of {len(measured)} steps; whole run {wall:.0f} s with start-up")  # fmt: skip
    print(f"{'phase':<30} {'s':>7} {'share':>6}")
    accounted = 0.0
    for key, label in PHASES:
        seconds = statistics.median(r.get(f"time/{key}", 0.0) for r in measured)
        accounted += seconds
        print(f"{label:<30} {seconds:>7.3f} {seconds / step:>6.0%}")
    print(f"{'between phases':<30} {max(step - accounted, 0.0):>7.3f} "
          f"{max(step - accounted, 0.0) / step:>6.0%}")  # fmt: skip
    print(f"{'whole step':<30} {step:>7.3f} {1:>6.0%}")
    print(f"samples/s: {samples / step:.1f}")


if __name__ == "__main__":
    main()
