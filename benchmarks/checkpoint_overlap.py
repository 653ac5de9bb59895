"""Asynchronous checkpoints: the time of an optimizer step while a save is written,
against a step without one, side by side in one run (one rank, this process).

    .venv/bin/python benchmarks/checkpoint_overlap.py [--size wide] [--repeats 4]
    .venv/bin/python benchmarks/checkpoint_overlap.py --smoke   # tiny, 2 repeats

Each repeat times three things on the same model: a plain step; an asynchronous save
(`checkpoint.async_save=true`: this rank's shard copied, then written by a thread)
followed by the next step, the write running meanwhile; and a synchronous save
followed by the next step. The ratios divide by the plain step's median. The issue's
target is a step at most 1.3x a plain one while a save is in flight; on a shared CPU
machine the writer thread takes a core from the step, so the figure here is an upper
bound for a GPU rank, whose step does not run on the host.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from _smoke import parse_with_smoke

from moerl.models.arch import TINY

TABLE_TITLE = "checkpoint overlap: step time with a save in flight"
SMOKE = {"size": "tiny", "repeats": 2}
SIZES = {
    "tiny": TINY,
    # About 60M parameters: a save of ~1 GB (weights, fp32 master, Adam moments).
    "wide": TINY.replace(hidden_size=512, ffn_hidden_size=2048, moe_ffn_hidden_size=1024,
                         num_experts=16, num_layers=6),
}
GLOBAL_BATCH, MICRO_BATCH, SEQ = 8, 2, 64


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="wide", choices=list(SIZES))
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--threads", type=int, default=0,
                        help="the step's threads (0: torch's default, every core); a GPU "
                             "rank's step leaves the host's cores to the writer, which "
                             "--threads 1 on 2 cores imitates")
    return parse_with_smoke(parser, SMOKE, argv)


def measure(size: str, repeats: int, threads: int = 0) -> dict[str, list[float]]:
    from moerl.checkpoint.checkpointer import Checkpointer
    from moerl.checkpoint.config import CheckpointConfig, Fingerprints
    from moerl.data.synthetic import SyntheticCorpus
    from moerl.models.build import build_model
    from moerl.parallel.groups import destroy_parallel, init_parallel
    from moerl.parallel.layout import ParallelLayout
    from moerl.trainer.config import OptimConfig
    from moerl.trainer.lm import batch_iterators
    from moerl.trainer.optimizer import build_optimizer
    from moerl.trainer.step import train_step

    if threads:
        torch.set_num_threads(threads)
    arch, layout = SIZES[size], ParallelLayout()
    groups = init_parallel(layout, seed=0)
    trainable = build_optimizer(build_model(arch, layout), OptimConfig(), layout)
    corpus = SyntheticCorpus(arch.vocab_size, SEQ, seed=0)
    step = 0

    def one_step() -> float:
        nonlocal step
        start = time.perf_counter()
        train_step(trainable.model, trainable.optimizer,  # type: ignore[arg-type]
                   batch_iterators(corpus, step, groups, GLOBAL_BATCH, MICRO_BATCH),
                   num_microbatches=GLOBAL_BATCH // MICRO_BATCH, micro_batch_size=MICRO_BATCH,
                   seq_length=SEQ, scheduler=trainable.scheduler)
        step += 1
        return time.perf_counter() - start

    times: dict[str, list[float]] = {k: [] for k in (
        "plain", "stage", "step_in_flight", "still_writing", "sync_save", "step_after_sync")}
    with tempfile.TemporaryDirectory() as tmp:
        ckpts = {mode: Checkpointer(CheckpointConfig(dir=str(Path(tmp) / mode), keep_last=1,
                                                     async_save=mode == "async"),
                                    Fingerprints("m", "d", "c"))
                 for mode in ("async", "sync")}
        one_step()  # warm-up: allocations, Adam's state
        for _ in range(repeats):
            times["plain"].append(one_step())
            start = time.perf_counter()
            ckpts["async"].save(step, trainable, {"data": {}})
            times["stage"].append(time.perf_counter() - start)
            times["step_in_flight"].append(one_step())
            times["still_writing"].append(float(ckpts["async"].writing()))
            ckpts["async"].wait()
            start = time.perf_counter()
            ckpts["sync"].save(step, trainable, {"data": {}})
            times["sync_save"].append(time.perf_counter() - start)
            times["step_after_sync"].append(one_step())
        for ckpt in ckpts.values():
            ckpt.close()
    destroy_parallel()
    return times


def table(size: str, times: dict[str, list[float]], threads: int) -> str:
    med = {k: statistics.median(v) for k, v in times.items()}
    plain = med["plain"]
    rows = [
        ("plain step", plain, 1.0),
        ("async: save() call (plan, copy of the shard)", med["stage"], med["stage"] / plain),
        ("async: the step, write in flight", med["step_in_flight"],
         med["step_in_flight"] / plain),
        ("async: save() call + step", med["stage"] + med["step_in_flight"],
         (med["stage"] + med["step_in_flight"]) / plain),
        ("sync: save + step", med["sync_save"] + med["step_after_sync"],
         (med["sync_save"] + med["step_after_sync"]) / plain),
    ]
    lines = [f"{TABLE_TITLE} ({size}, the step on {threads} of {os.cpu_count()} cores; "
             "write still running at the step's end in "
             f"{sum(times['still_writing']):.0f} of {len(times['still_writing'])} repeats)",
             f"{'':46} {'seconds':>9} {'x plain':>8}"]
    lines += [f"{name:46} {seconds:9.3f} {ratio:8.2f}" for name, seconds, ratio in rows]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> Any:
    args = parse_args(argv)
    print(table(args.size, measure(args.size, args.repeats, args.threads),
                args.threads or torch.get_num_threads()))


if __name__ == "__main__":  # the checkpoint writer's helper needs the guard
    main()
