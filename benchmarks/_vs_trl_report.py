"""The table of benchmarks/learning_vs_trl.py: every figure as the median over the seeds
with its range, the ratios of moerl to each TRL side per seed, the other reward variant's
step times, and each seed's held-out curves.

Not a benchmark (the leading underscore keeps it out of the smoke test's list).
"""

from __future__ import annotations

import argparse
import os
import statistics
from collections.abc import Callable, Sequence

from _vs_trl_runs import Trace

Runs = dict[int, dict[str, Trace]]  # seed -> side -> what it did
COLUMN = 24


def spread(values: Sequence[float | None], spec: str) -> str:
    """'median [min-max]' of the values given (one value: itself); a count when some
    are missing (a threshold not reached), "-" when all are."""
    there = [v for v in values if v is not None]
    if not there:
        return "-"
    text = format(there[0], spec) if len(there) == 1 else (
        f"{format(statistics.median(there), spec)} "
        f"[{format(min(there), spec)}-{format(max(there), spec)}]")
    return text if len(there) == len(values) else f"{text} ({len(there)}/{len(values)})"


def threshold(args: argparse.Namespace, sides: dict[str, Trace]) -> float:
    """--threshold, or halfway from the best after-SFT pass rate to the best rate any
    side reached in this seed."""
    if args.threshold is not None:
        return float(args.threshold)
    start = max(t.evals[0][2] for t in sides.values())
    return (start + max(r for t in sides.values() for _, _, r, _ in t.evals)) / 2


def rows(args: argparse.Namespace) -> list[tuple[str, Callable[[Trace, float], float | None],
                                                 str]]:
    """(label, figure of one run given its seed's threshold, format)."""
    return [
        ("parameters", lambda t, _: float(t.params), ",.0f"),
        ("start-up s (launch to SFT start)", lambda t, _: t.startup_s, ".1f"),
        (f"SFT s ({args.sft_steps} steps)", lambda t, _: t.sft_s, ".1f"),
        ("RL s/step", lambda t, _: t.median_step(), ".2f"),
        ("RL s/step without rewards", lambda t, _: t.median_step(rewards=False), ".2f"),
        ("  rewards s/step", lambda t, _: t.median_reward_s(), ".2f"),
        ("samples/s", lambda t, _: t.samples_per_step / t.median_step(), ".1f"),
        ("CPU s/RL step, all processes", lambda t, _: t.median_cpu(), ".2f"),
        ("  without the reward server's", lambda t, _: t.median_cpu(rewards=False), ".2f"),
        ("train reward, last RL step", lambda t, _: t.rewards[-1] if t.rewards else None, ".2f"),
        ("pass rate after SFT", lambda t, _: t.evals[0][2], ".3f"),
        ("pass rate at the end", lambda t, _: t.evals[-1][2], ".3f"),
        ("best pass rate", lambda t, _: max(r for _, _, r, _ in t.evals), ".3f"),
        ("training s to threshold", lambda t, x: t.reached(x), ".1f"),
    ]


def print_table(args: argparse.Namespace, names: dict[str, str], runs: Runs) -> None:
    print(f"{'':<36}" + "".join(f"{label:>{COLUMN}}" for label in names))
    limits = {seed: threshold(args, sides) for seed, sides in runs.items()}
    for label, figure, spec in rows(args):
        cells = [spread([figure(runs[seed][key], limits[seed]) for seed in runs], spec)
                 for key in names.values()]
        print(f"{label:<36}" + "".join(f"{c:>{COLUMN}}" for c in cells))


def print_ratios(args: argparse.Namespace, names: dict[str, str], runs: Runs) -> None:
    """moerl's figure over each TRL side's, per seed; median [range] over the seeds."""
    others = {label: key for label, key in names.items() if key != "moerl"}
    if "moerl" not in names.values() or not others:
        return
    figures: list[tuple[str, Callable[[Trace, float], float | None]]] = [
        ("RL step", lambda t, _: t.median_step()),
        ("RL step without rewards", lambda t, _: t.median_step(rewards=False)),
        ("CPU per RL step", lambda t, _: t.median_cpu()),
        ("CPU per RL step without rewards", lambda t, _: t.median_cpu(rewards=False)),
        ("SFT", lambda t, _: t.sft_s),
        ("training time to threshold", lambda t, x: t.reached(x)),
    ]
    print("moerl / TRL (per seed; median [range]; below 1: moerl is faster)")
    print(f"{'':<36}" + "".join(f"{label:>{COLUMN}}" for label in others))
    for label, figure in figures:
        cells = []
        for key in others.values():
            ratios: list[float | None] = []
            for sides in runs.values():
                x = threshold(args, sides)
                mine, theirs = figure(sides["moerl"], x), figure(sides[key], x)
                ratios.append(mine / theirs if mine is not None and theirs else None)
            cells.append(spread(ratios, ".2f"))
        print(f"{label:<36}" + "".join(f"{c:>{COLUMN}}" for c in cells))


def print_variant(args: argparse.Namespace, names: dict[str, str],
                  variant: dict[str, Trace]) -> None:
    other = "cold" if args.rewards == "warm" else "warm"
    print(f"rewards {other}: {args.variant_steps} RL steps from seed {args.seed_list[0]}'s "
          "SFT model (medians after the first step)")
    figures: list[tuple[str, Callable[[Trace], float | None]]] = [
        ("RL s/step", lambda t: t.median_step()),
        ("RL s/step without rewards", lambda t: t.median_step(False)),
        ("  rewards s/step", lambda t: t.median_reward_s()),
        ("CPU s/RL step, all processes", lambda t: t.median_cpu()),
        ("  without the reward server's", lambda t: t.median_cpu(False))]
    for label, figure in figures:
        cells = [spread([figure(variant[key])], ".2f") for key in names.values()]
        print(f"{label:<36}" + "".join(f"{c:>{COLUMN}}" for c in cells))


def print_report(args: argparse.Namespace, names: dict[str, str], runs: Runs,
                 variant: dict[str, Trace]) -> None:
    """`names`: column label -> side key, in the order the sides ran (the caller
    prints the title line first)."""
    print(f"demo task; SFT {args.sft_steps} steps; RL {args.rl_steps} steps of {args.prompts} "
          f"prompts x {args.group} samples ({args.updates} updates); {args.eval_size} held-out "
          f"tasks every {args.eval_interval} steps; rewards {args.rewards}; seeds {args.seeds}; "
          f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}; cells: median [min-max] over seeds; "
          "training s to threshold: '-' where never reached")
    print_table(args, names, runs)
    print_ratios(args, names, runs)
    if variant:
        print_variant(args, names, variant)
    print("held-out pass rate at each evaluation (RL step: rate @ training s from SFT start)")
    for seed, sides in runs.items():
        print(f" seed {seed}, threshold {threshold(args, sides):.3f}")
        for label, key in names.items():
            t = sides[key]
            print(f"  {label:<16}" + "  ".join(
                f"{step}: {rate:.3f} @ {when:.0f}"
                for (step, _, rate, _), when in zip(t.evals, t.training_s(), strict=True)))
