"""One job of the parallel checkpoint test (`test_parallel_checkpoint.py`); rank 0 writes JSON.

- `save` (8 ranks, TP2 EP2 DP4): two steps, then an asynchronous save after step 2
  whose writers wait for a gate file; step 3 runs while every rank's write is in
  flight; then the gate opens and the save is published. Each rank reports whether
  its write was running before and after step 3, its resident memory before the save
  and after step 3, the bytes its write staged, and the loss of step 3.
- `resume` (4 ranks, TP2 EP2 DP2: the optimizer resharded over data parallelism):
  loads that checkpoint, then runs step 3 and reports its loss.

Both write the state at step 2 to --canonical in a layout-free form (`canonical`).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
from pathlib import Path
from typing import Any

import psutil
import torch.distributed as dist
from megatron.core import dist_checkpointing

from moerl.checkpoint.checkpointer import Checkpointer
from moerl.checkpoint.config import CheckpointConfig, Fingerprints
from moerl.checkpoint.digest_write import HOLD_ENV
from moerl.checkpoint.sharded import sharded_state
from moerl.data.synthetic import SyntheticCorpus
from moerl.models.arch import TINY
from moerl.models.build import build_model
from moerl.parallel.groups import ParallelGroups, destroy_parallel, init_parallel
from moerl.parallel.layout import ParallelLayout
from moerl.trainer.config import OptimConfig
from moerl.trainer.lm import batch_iterators
from moerl.trainer.optimizer import Trainable, build_optimizer
from moerl.trainer.step import train_step

# Wider than the tiny preset, so that a rank's shard (about 28 MB here) stands well
# clear of the allocator's noise in the memory measurement.
ARCH = TINY.replace(hidden_size=256, ffn_hidden_size=1024, moe_ffn_hidden_size=512,
                    num_experts=8)
OPTIM = OptimConfig(lr=1e-2)
GLOBAL_BATCH, MICRO_BATCH, SEQ = 8, 1, 32
SAVED_STEP = 2


def _step(trainable: Trainable, corpus: SyntheticCorpus, groups: ParallelGroups,
          step: int) -> float:
    layout = groups.layout
    metrics = train_step(
        trainable.model,  # type: ignore[arg-type]
        trainable.optimizer,
        batch_iterators(corpus, step, groups, GLOBAL_BATCH, MICRO_BATCH),
        num_microbatches=GLOBAL_BATCH // (MICRO_BATCH * layout.dp),
        micro_batch_size=MICRO_BATCH, seq_length=SEQ, scheduler=trainable.scheduler)
    return float(metrics.loss)


def _gather(value: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def canonical(trainable: Trainable, directory: Path) -> None:
    """The model and optimizer in Megatron's fully_reshardable form: every tensor whole,
    in its parameter's shape, keyed by name, so two layouts' states compare directly
    (the dp_reshardable form holds per-layout bucket padding of no value)."""
    state = sharded_state(trainable, with_optimizer=True, loading=False,
                          fmt="fully_reshardable")
    if dist.get_rank() == 0:
        directory.mkdir(parents=True)
    dist.barrier()
    dist_checkpointing.save(state, str(directory))


def save(args: argparse.Namespace, groups: ParallelGroups, trainable: Trainable,
         corpus: SyntheticCorpus, ckpt: Checkpointer) -> dict[str, Any]:
    for step in range(SAVED_STEP):
        _step(trainable, corpus, groups, step)
    me = psutil.Process()
    canonical(trainable, args.canonical)
    before = me.memory_info().rss
    os.environ[HOLD_ENV] = str(args.gate)
    ckpt.save(SAVED_STEP, trainable, {"data": {"next_step": SAVED_STEP}})
    writing_before = ckpt.writing()
    loss = _step(trainable, corpus, groups, SAVED_STEP)  # the step the save overlaps
    ckpt.poll()  # as a training loop does after its step: nothing can finish yet
    writing_after = ckpt.writing()
    during = me.memory_info().rss
    published_during = (Path(args.root) / "latest").exists()
    dist.barrier()
    if groups.rank == 0:
        Path(args.gate).touch()
    ckpt.wait()
    return {"writing_before_step": writing_before, "writing_after_step": writing_after,
            "published_during_step": published_during, "extra_rss": during - before,
            "staged": ckpt.last_staged_bytes(), "loss": loss}


def resume(args: argparse.Namespace, groups: ParallelGroups, trainable: Trainable,
           corpus: SyntheticCorpus, ckpt: Checkpointer) -> dict[str, Any]:
    resumed = ckpt.load(trainable)
    assert resumed is not None and resumed.step == SAVED_STEP
    canonical(trainable, args.canonical)
    return {"loss": _step(trainable, corpus, groups, SAVED_STEP)}


def _exact_resident_memory() -> None:
    """glibc raises its mmap threshold when a large block is freed, after which freed
    memory stays in the heap and a later allocation reuses it unseen by the resident
    size. A fixed threshold (64 KiB) maps every large tensor on its own and unmaps it
    on free, so the resident size follows the live tensors."""
    ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 16)  # M_MMAP_THRESHOLD


def main() -> None:
    _exact_resident_memory()
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["save", "resume"])
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--gate", type=Path)
    parser.add_argument("--canonical", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    layout = ParallelLayout.for_world(int(os.environ["WORLD_SIZE"]), tp=2, ep=2)
    groups = init_parallel(layout, seed=3)
    trainable = build_optimizer(build_model(ARCH, layout), OPTIM, layout)
    corpus = SyntheticCorpus(ARCH.vocab_size, SEQ, seed=3)
    cfg = CheckpointConfig(dir=str(args.root), async_save=True,
                           resume="auto" if args.mode == "resume" else "none")
    ckpt = Checkpointer(cfg, Fingerprints.of(ARCH, corpus, OPTIM))
    report = (save if args.mode == "save" else resume)(args, groups, trainable, corpus, ckpt)
    ckpt.close()
    reports = _gather(report)
    if groups.rank == 0:
        args.out.write_text(json.dumps(reports))
    destroy_parallel()


if __name__ == "__main__":
    main()
