"""Async against sync RL with the real stages: seconds per step and samples/s of
`rl.mode=async` (the next step's samples are generated and scored while the current
one trains) and `rl.mode=sync`, two `moerl train` runs of the same size in one run.

    .venv/bin/python benchmarks/async_speedup.py [--steps 8] [--prompts 4] [--group 8]
    .venv/bin/python benchmarks/async_speedup.py --smoke   # 2 steps of 2 x 2 samples each

The runs are those of benchmarks/rl_step.py (no SFT, fixed-size steps). Async trains
on samples one weight version old (`rl.max_staleness=1`); its table also shows the
staleness the trained samples had. On one machine the stages share its cores, so the
overlap gains less than on a cluster, where generation and training have their own.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from collections.abc import Sequence
from pathlib import Path

from _smoke import parse_with_smoke
from rl_step import add_run_arguments, run

TABLE_TITLE = "async against sync RL steps"
NEEDS_EXECUTABLES = ("bwrap",)
SMOKE = {"steps": 2, "prompts": 2, "group": 2, "max_tokens": 4}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_run_arguments(parser, steps=8)
    return parse_with_smoke(parser, SMOKE, argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    results: dict[str, tuple[float, float]] = {}
    for mode in ("sync", "async"):
        with tempfile.TemporaryDirectory(prefix=f"moerl-{mode}-") as tmp:
            rows = run(args, Path(tmp) / "run", [f"rl.mode={mode}", "rl.max_staleness=1"])
        measured = rows[1:] or rows
        step = statistics.median(r["time/step"] for r in measured)
        stale = max(r.get("async/staleness_max_trained", 0.0) for r in measured)
        results[mode] = (step, stale)
    samples = args.prompts * args.group
    print(TABLE_TITLE)
    print(f"{samples} samples a step, median over {max(args.steps - 1, 1)} steps")
    print(f"{'mode':<6} {'s/step':>7} {'samples/s':>10} {'staleness':>10}")
    for mode, (step, stale) in results.items():
        print(f"{mode:<6} {step:>7.3f} {samples / step:>10.1f} {stale:>10.0f}")
    print(f"async / sync samples/s: x{results['sync'][0] / results['async'][0]:.2f}")


if __name__ == "__main__":
    main()
