"""Async against sync RL with the real stages: seconds per step and samples/s of
`rl.mode=async` (the next step's samples are generated and scored while the current
one trains) and `rl.mode=sync`, two `moerl train` runs of the same size in one run,
for responses of one length and for long-tailed lengths.

    .venv/bin/python benchmarks/async_speedup.py [--steps 8] [--prompts 4] [--group 8] \
        [--lengths fixed,long-tail]
    .venv/bin/python benchmarks/async_speedup.py --smoke  # long-tail only: 2 steps of 2 x 2 samples

The runs are those of benchmarks/rl_step.py (no SFT, fixed-size steps, a model fresh
from initialisation). "fixed": every response runs to `--max-tokens`. "long-tail": a
response ends at the first of the letters a-z it writes (`rl.sampling.stop`), up to
`--tail-max-tokens`; a fresh model picks each of its 512 ids about equally often, so
lengths are close to geometric (mean ~20 tokens) and a step's longest response is
several times its median; the table shows both, measured. Async trains on samples one
weight version old (`rl.max_staleness=1`); its table also shows the staleness the
trained samples had. Both modes run with a learning rate of 1e-12 and no router
expert bias: every update costs what it costs at any rate, but the weights stay where
initialisation put them, so the two modes sample the same responses (sampling is
seeded per step and sample), of the same lengths. A model that learns drifts
differently in each mode (async trains on older samples), and its lengths with it: in
one such pair of runs the async steps' median response was 15 tokens against sync's
9, which measured the drift, not the overlap. On one machine the stages share its
cores, so the overlap gains less than on a cluster, where generation and training have
their own.
"""

from __future__ import annotations

import argparse
import statistics
import string
import tempfile
from collections.abc import Sequence
from pathlib import Path

from _smoke import parse_with_smoke
from rl_step import add_run_arguments, run

TABLE_TITLE = "async against sync RL steps"
NEEDS_EXECUTABLES = ("bwrap",)
SMOKE = {"steps": 2, "prompts": 2, "group": 2, "max_tokens": 4, "tail_max_tokens": 8,
         "lengths": "long-tail"}
LENGTHS = ("fixed", "long-tail")
# The same samples in both modes: the weights stay put (the router's expert bias too:
# its update is not scaled by the learning rate).
FROZEN = ("optim.lr=1e-12", "optim.min_lr=1e-12", "model.router_expert_bias=false")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_run_arguments(parser, steps=8)
    parser.add_argument("--lengths", default=",".join(LENGTHS),
                        help=f"comma-separated, of {', '.join(LENGTHS)}")
    parser.add_argument("--tail-max-tokens", type=int, default=160)
    args = parse_with_smoke(parser, SMOKE, argv)
    args.lengths = args.lengths.split(",")
    if unknown := sorted(set(args.lengths) - set(LENGTHS)):
        parser.error(f"--lengths: unknown {unknown}; choose from {', '.join(LENGTHS)}")
    return args


def length_overrides(lengths: str, args: argparse.Namespace) -> list[str]:
    if lengths == "fixed":
        return []
    stops = ",".join(string.ascii_lowercase)
    return [f"rl.sampling.max_tokens={args.tail_max_tokens}", f"rl.sampling.stop=[{stops}]"]


def measure(args: argparse.Namespace, lengths: str, mode: str) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix=f"moerl-{mode}-") as tmp:
        rows = run(args, Path(tmp) / "run", [f"rl.mode={mode}", "rl.max_staleness=1",
                                             *FROZEN, *length_overrides(lengths, args)])
    measured = rows[1:] or rows
    return {
        "step": statistics.median(r["time/step"] for r in measured),
        "stale": max(r.get("async/staleness_max_trained", 0.0) for r in measured),
        "p50": statistics.median(r.get("rollout/response_length_p50", 0.0) for r in measured),
        "max": statistics.median(r.get("rollout/response_length_max", 0.0) for r in measured),
    }


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    results = {(lengths, mode): measure(args, lengths, mode)
               for lengths in args.lengths for mode in ("sync", "async")}
    samples = args.prompts * args.group
    print(TABLE_TITLE)
    print(f"{samples} samples a step, median over {max(args.steps - 1, 1)} steps; response "
          "length: a step's median and longest, median over the steps")
    print(f"{'lengths':<10} {'mode':<6} {'s/step':>7} {'samples/s':>10} {'len p50':>8} "
          f"{'len max':>8} {'staleness':>10}")
    for (lengths, mode), r in results.items():
        print(f"{lengths:<10} {mode:<6} {r['step']:>7.3f} {samples / r['step']:>10.1f} "
              f"{r['p50']:>8.0f} {r['max']:>8.0f} {r['stale']:>10.0f}")
    for lengths in args.lengths:
        ratio = results[(lengths, "sync")]["step"] / results[(lengths, "async")]["step"]
        print(f"{lengths}: async / sync samples/s x{ratio:.2f}")


if __name__ == "__main__":
    main()
