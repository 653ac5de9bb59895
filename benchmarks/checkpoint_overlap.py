"""Asynchronous checkpoints: the time of an optimizer step while a save is written,
against a step without one, side by side in one run (one rank in this process, or
8 ranks under torchrun: TP2 x PP2 x EP2 x DP2, one thread each).

    .venv/bin/python benchmarks/checkpoint_overlap.py [--size wide] [--repeats 4]
    .venv/bin/python benchmarks/checkpoint_overlap.py --ranks 8 [--size wide]
    .venv/bin/python benchmarks/checkpoint_overlap.py --smoke   # tiny, 2 repeats

Each repeat times three things on the same model: a plain step; an asynchronous save
(`checkpoint.async_save=true`: this rank's shard copied, then written by a thread)
followed by the next step, the write running meanwhile; and a synchronous save
followed by the next step. With 8 ranks a step's time is its slowest rank's, and the
save is every rank's shard, written by every rank's own thread. The ratios divide by
the plain step's median. The issue's
target is a step at most 1.3x a plain one while a save is in flight; on a shared CPU
machine the writer thread takes a core from the step, so the figure here is an upper
bound for a GPU rank, whose step does not run on the host.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
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
RANKS = {1: {}, 8: {"tp": 2, "pp": 2, "ep": 2, "dp": 2}}
WORKER_FLAG = "--torchrun-worker"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="wide", choices=list(SIZES))
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--threads", type=int, default=0,
                        help="the step's threads (0: torch's default, every core); a GPU "
                             "rank's step leaves the host's cores to the writer, which "
                             "--threads 1 on 2 cores imitates")
    parser.add_argument("--ranks", type=int, default=1, choices=sorted(RANKS),
                        help="1: this process; 8: a torchrun job (TP2 PP2 EP2 DP2), "
                             "each rank on one thread")
    parser.add_argument(WORKER_FLAG, action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint-dir", default=None, help=argparse.SUPPRESS)
    return parse_with_smoke(parser, SMOKE, argv)


def measure(size: str, repeats: int, threads: int = 0, ranks: int = 1,
            directory: str | None = None) -> dict[str, list[float]]:
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
    arch, layout = SIZES[size], ParallelLayout(**RANKS[ranks])
    groups = init_parallel(layout, seed=0)
    trainable = build_optimizer(build_model(arch, layout), OptimConfig(), layout)
    corpus = SyntheticCorpus(arch.vocab_size, SEQ, seed=0)
    step = 0

    def one_step() -> float:
        nonlocal step
        start = time.perf_counter()
        train_step(trainable.model, trainable.optimizer,  # type: ignore[arg-type]
                   batch_iterators(corpus, step, groups, GLOBAL_BATCH, MICRO_BATCH),
                   num_microbatches=GLOBAL_BATCH // (MICRO_BATCH * layout.dp),
                   micro_batch_size=MICRO_BATCH,
                   seq_length=SEQ, scheduler=trainable.scheduler)
        step += 1
        return _slowest(time.perf_counter() - start)

    times: dict[str, list[float]] = {k: [] for k in (
        "plain", "stage", "step_in_flight", "still_writing", "steps_spanned", "every_in_flight",
        "sync_save", "step_after_sync")}
    with tempfile.TemporaryDirectory() as own:
        tmp = directory or own
        ckpts = {mode: Checkpointer(CheckpointConfig(dir=str(Path(tmp) / mode), keep_last=1,
                                                     async_save=mode == "async"),
                                    Fingerprints("m", "d", "c"))
                 for mode in ("async", "sync")}
        one_step()  # warm-up: allocations, Adam's state
        for _ in range(repeats):
            times["plain"].append(one_step())
            start = time.perf_counter()
            ckpts["async"].save(step, trainable, {"data": {}})
            times["stage"].append(_slowest(time.perf_counter() - start))
            times["step_in_flight"].append(one_step())
            times["still_writing"].append(_slowest(float(ckpts["async"].writing())))
            spanned = [times["step_in_flight"][-1]]
            while _slowest(float(ckpts["async"].writing())):  # the steps it still slows
                spanned.append(one_step())
            times["steps_spanned"].append(float(len(spanned)))
            times["every_in_flight"] += spanned
            ckpts["async"].wait()
            start = time.perf_counter()
            ckpts["sync"].save(step, trainable, {"data": {}})
            times["sync_save"].append(_slowest(time.perf_counter() - start))
            times["step_after_sync"].append(one_step())
        for ckpt in ckpts.values():
            ckpt.close()
    destroy_parallel()
    return times


def _slowest(value: float) -> float:
    """The largest of `value` over the ranks (this one's without torch.distributed)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    box = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(box, op=dist.ReduceOp.MAX)
    return float(box.item())


def table(size: str, times: dict[str, list[float]], threads: int, ranks: int = 1) -> str:
    med = {k: statistics.median(v) for k, v in times.items()}
    plain = med["plain"]
    rows = [
        ("plain step", plain, 1.0),
        ("async: save() call (plan, copy of the shard)", med["stage"], med["stage"] / plain),
        ("async: the step, write in flight", med["step_in_flight"],
         med["step_in_flight"] / plain),
        ("async: save() call + step", med["stage"] + med["step_in_flight"],
         (med["stage"] + med["step_in_flight"]) / plain),
        ("async: every step the write spans (median)", med["every_in_flight"],
         med["every_in_flight"] / plain),
        ("sync: save + step", med["sync_save"] + med["step_after_sync"],
         (med["sync_save"] + med["step_after_sync"]) / plain),
    ]
    where = (f"the step on {threads} of {os.cpu_count()} cores" if ranks == 1 else
             f"{ranks} ranks {RANKS[ranks]} on {os.cpu_count()} cores, one thread each")
    lines = [f"{TABLE_TITLE} ({size}, {where}; "
             "write still running at the step's end in "
             f"{sum(times['still_writing']):.0f} of {len(times['still_writing'])} repeats; "
             f"the write spans {med['steps_spanned']:.0f} step(s), median)",
             f"{'':46} {'seconds':>9} {'x plain':>8}"]
    lines += [f"{name:46} {seconds:9.3f} {ratio:8.2f}" for name, seconds, ratio in rows]
    return "\n".join(lines)


def _torchrun(args: argparse.Namespace, argv: Sequence[str] | None) -> int:
    """This benchmark again as `args.ranks` torchrun ranks; rank 0 prints the table."""
    given = list(sys.argv[1:] if argv is None else argv)
    with tempfile.TemporaryDirectory() as shared:  # every rank's shard goes here
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc-per-node={args.ranks}", __file__, *given, WORKER_FLAG,
                   "--checkpoint-dir", shared]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        return subprocess.run(command, env=env, check=False).returncode


def main(argv: Sequence[str] | None = None) -> Any:
    args = parse_args(argv)
    if args.ranks > 1 and not args.torchrun_worker:
        code = _torchrun(args, argv)
        if code:
            raise SystemExit(code)
        return None
    threads = 1 if args.ranks > 1 else args.threads
    times = measure(args.size, args.repeats, threads, args.ranks, args.checkpoint_dir)
    if int(os.environ.get("RANK", "0")) == 0:
        print(table(args.size, times, threads or torch.get_num_threads(), args.ranks))
    return None


if __name__ == "__main__":  # the checkpoint writer's helper needs the guard
    main()
