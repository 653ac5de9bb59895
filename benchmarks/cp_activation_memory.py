"""Per-rank activation memory under context parallelism: CP1, CP2 and CP4 on CPU.

    .venv/bin/python benchmarks/cp_activation_memory.py [--lengths 256 512 1024 2048]
    .venv/bin/python benchmarks/cp_activation_memory.py --smoke   # 64 tokens, CP1 and CP2

For each CP size one job (torchrun, gloo; CP1 one plain process) builds the tiny MoE
(MTP off) and, for each sequence length, takes one training step of one sequence while
counting the unique storages autograd saves on each rank (parameters and gradient
buffers excluded): the activation memory of one micro-batch. The table shows the
largest rank's bytes, its share of the CP1 bytes at the same length, and CP4 against
CP2.

Each rank holds 1/CP of the sequence. CP1 runs Megatron's local attention, which saves
the T x T softmax; the ring attention saves only queries, keys, values, output and the
log-sum-exp, so against CP1 the share falls below 1/CP as T grows (the quadratic term
is gone), while CP4 against CP2 (both ring) shows the 1/2 of the split itself.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from itertools import pairwise
from pathlib import Path
from typing import Any

from _smoke import parse_with_smoke

TABLE_TITLE = "saved activations per rank, one sequence (tiny MoE, fp32, CPU)"
# CP4 alone costs more than the rest of the smoke run (four ranks starting on a small
# machine); CP2 already runs the ring against the CP1 baseline.
SMOKE = {"lengths": [64], "cp_sizes": [1, 2]}


def measure(lengths: list[int]) -> dict[int, int]:
    """This rank's saved-activation bytes per sequence length (inside torchrun)."""
    from moerl.data.synthetic import SyntheticCorpus
    from moerl.models.arch import TINY
    from moerl.models.build import build_model
    from moerl.parallel.groups import destroy_parallel, init_parallel
    from moerl.parallel.layout import ParallelLayout
    from moerl.trainer.config import OptimConfig
    from moerl.trainer.lm import batch_iterators
    from moerl.trainer.optimizer import build_optimizer
    from moerl.trainer.saved_activations import counting_saved_activations
    from moerl.trainer.step import train_step

    cp = int(os.environ.get("WORLD_SIZE", "1"))
    layout = ParallelLayout(cp=cp, use_distributed_optimizer=False)
    groups = init_parallel(layout, seed=0)
    arch = TINY.replace(mtp_num_layers=0, max_position_embeddings=max(lengths))
    trainable = build_optimizer(build_model(arch, layout), OptimConfig(), layout)
    out = {}
    for length in lengths:
        corpus = SyntheticCorpus(arch.vocab_size, length, seed=1)
        with counting_saved_activations(trainable) as saved:
            train_step(trainable.model, trainable.optimizer,  # type: ignore[arg-type]
                       batch_iterators(corpus, 0, groups, 1, 1), num_microbatches=1,
                       micro_batch_size=1, seq_length=length // cp)
        out[length] = saved.total
    destroy_parallel()
    return out


def _command(cp: int, lengths: list[int], out: Path) -> list[str]:
    # One rank needs no torchrun: its agent would only add start-up time.
    launcher = [] if cp == 1 else ["-m", "torch.distributed.run", "--standalone",
                                   f"--nproc-per-node={cp}"]
    return [sys.executable, *launcher, __file__, "--worker", str(out),
            "--lengths", *map(str, lengths)]


def _launch(cp: int, lengths: list[int], out: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    src = str(Path(__file__).resolve().parents[1] / "src")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    proc = subprocess.run(_command(cp, lengths, out), env=env, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"CP{cp} run failed:\n" + "\n".join(proc.stderr.splitlines()[-30:]))


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 512, 1024, 2048])
    parser.add_argument("--cp-sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = parse_with_smoke(parser, SMOKE, argv)
    if 1 not in args.cp_sizes:
        parser.error("--cp-sizes must include 1: the ratios are taken against CP1")
    args.cp_sizes = sorted(set(args.cp_sizes))
    return args


def measure_all(cp_sizes: list[int], lengths: list[int]) -> dict[int, dict[int, int]]:
    """Largest rank's saved bytes, per CP size and sequence length."""
    results: dict[int, dict[int, int]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for cp in cp_sizes:
            out = Path(tmp) / f"cp{cp}"
            out.mkdir()
            _launch(cp, lengths, out)
            ranks: list[dict[str, Any]] = [json.loads(f.read_text()) for f in out.glob("*.json")]
            results[cp] = {n: max(int(r[str(n)]) for r in ranks) for n in lengths}
    return results


def print_table(results: dict[int, dict[int, int]], lengths: list[int]) -> None:
    from rich.console import Console
    from rich.table import Table

    sizes = sorted(results)
    # Consecutive ring sizes (CP4/CP2): both hold no T x T term, so this is the split alone.
    rings = [(a, b) for a, b in pairwise(sizes) if a > 1]
    table = Table()
    table.add_column("tokens", justify="right")
    for cp in sizes:
        table.add_column(f"CP{cp} MiB", justify="right")
        if cp > 1:
            table.add_column(f"CP{cp}/CP1 (1/CP = {1 / cp:.2f})", justify="right")
    for a, b in rings:
        table.add_column(f"CP{b}/CP{a}", justify="right")
    for n in lengths:
        row = [str(n)]
        for cp in sizes:
            row.append(f"{results[cp][n] / 2**20:.2f}")
            if cp > 1:
                row.append(f"{results[cp][n] / results[1][n]:.3f}")
        row += [f"{results[b][n] / results[a][n]:.3f}" for a, b in rings]
        table.add_row(*row)
    print(TABLE_TITLE)  # a plain line: a table title would wrap to the table's width
    Console().print(table)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        rank = int(os.environ.get("RANK", "0"))
        (args.worker / f"rank{rank}.json").write_text(json.dumps(measure(args.lengths)))
        return
    print_table(measure_all(args.cp_sizes, args.lengths), args.lengths)


if __name__ == "__main__":
    main()
