"""A short language-model training run of an `MoEArch` on the synthetic corpus.

This is the demo of the trainer: build the groups and the model for a layout,
then Adam steps over Megatron's pipeline schedule, printing the falling loss (a
rich progress bar on the rank that holds the loss).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch.distributed as dist
from megatron.core import parallel_state as ps
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from moerl.checkpoint.checkpointer import Checkpointer
from moerl.checkpoint.config import CheckpointConfig, Fingerprints
from moerl.data.synthetic import Batch, SyntheticCorpus, step_batches
from moerl.models.arch import MoEArch
from moerl.models.build import build_model
from moerl.models.features import resolve_precision
from moerl.models.precision import PrecisionConfig, RecomputeConfig
from moerl.parallel.context import split_batch
from moerl.parallel.groups import ParallelGroups, destroy_parallel, init_parallel
from moerl.parallel.layout import ParallelLayout
from moerl.signals import STOP_SIGNALS, StopOnSignal
from moerl.trainer.config import OptimConfig
from moerl.trainer.optimizer import build_optimizer
from moerl.trainer.step import StepMetrics, train_step


@dataclass
class LMRun:
    """What `train_lm` did: the loss of each step run, and whether a stop signal
    ended it early (the checkpoint is saved; the caller exits for requeue)."""

    losses: list[float] = field(default_factory=list)
    stopped: bool = False


def batch_iterators(
    corpus: SyntheticCorpus, step: int, groups: ParallelGroups, global_batch: int, micro_batch: int
) -> Iterator[Batch] | list[Iterator[Batch]]:
    """This rank's micro-batches of `step`: one iterator, or one per virtual stage."""

    def one() -> Iterator[Batch]:
        batches = step_batches(
            corpus, step, global_batch=global_batch, micro_batch=micro_batch,
            dp_rank=groups.dp_rank, dp_size=groups.layout.dp,
        )
        if groups.layout.cp == 1:
            return batches
        # Each context-parallel rank keeps its two load-balanced sequence chunks.
        cp_rank = ps.get_context_parallel_rank()
        return (split_batch(b, cp_rank, groups.layout.cp) for b in batches)

    if groups.layout.vpp:
        return [one() for _ in range(groups.layout.vpp)]
    return one()


def train_lm(
    arch: MoEArch,
    layout: ParallelLayout,
    optim: OptimConfig,
    steps: int,
    global_batch: int,
    micro_batch: int,
    seq_length: int,
    seed: int = 0,
    progress: bool = True,
    checkpoint: CheckpointConfig | None = None,
    precision: PrecisionConfig | None = None,
    recompute: RecomputeConfig | None = None,
) -> LMRun:
    """Train for `steps` optimizer steps; the loss of each step run (on every rank).

    With `checkpoint`: resume as it says, save on its interval and at the end, and
    on SIGTERM/SIGUSR1 save and stop (`LMRun.stopped`).
    """
    groups = init_parallel(layout, seed=seed)
    try:
        resolved = resolve_precision(precision)
        layout.check(arch, groups.world_size, groups.backend, resolved.te)
        chunks = build_model(arch, layout, precision=resolved, recompute=recompute,
                             backend=groups.backend)
        trainable = build_optimizer(chunks, optim, layout,
                                    offload=resolved.config.offload_optimizer)
        corpus = SyntheticCorpus(arch.vocab_size, seq_length, seed=seed)
        num_micro = global_batch // (micro_batch * layout.dp)
        ckpt = None
        if checkpoint is not None and checkpoint.enabled:
            run = (optim, global_batch, micro_batch)
            ckpt = Checkpointer(checkpoint, Fingerprints.of(arch, corpus, run))
        resumed = ckpt.load(trainable, require=("data",)) if ckpt else None
        start = resumed.step if resumed else 0  # the corpus is indexed by step
        show = progress and groups.is_logging_rank
        result = LMRun()
        losses = result.losses
        with StopOnSignal(STOP_SIGNALS if ckpt else ()) as stop, Progress(
            TextColumn("[bold]{task.description}"), BarColumn(),
            TextColumn("{task.completed}/{task.total}"), TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(), disable=not show,
        ) as bar:
            task = bar.add_task(f"{arch.name} {layout.describe()}", total=steps, info="",
                                completed=start)
            for step in range(start, steps):
                metrics: StepMetrics = train_step(
                    trainable.model,
                    trainable.optimizer,
                    batch_iterators(corpus, step, groups, global_batch, micro_batch),
                    num_microbatches=num_micro,
                    micro_batch_size=micro_batch,
                    seq_length=seq_length,  # the whole row (see train_step)
                    scheduler=trainable.scheduler,
                )
                losses.append(metrics.loss)
                info = f"loss {metrics.loss:.4f}  grad {metrics.grad_norm:.3f}"
                bar.update(task, advance=1, info=info)
                if show:
                    bar.console.print(f"step {step + 1:3d}  {info}  lr {metrics.lr:.2e}")
                if ckpt:
                    data = {"next_step": step + 1, "samples_consumed": (step + 1) * global_batch}
                    if ckpt.end_of_step(step + 1, trainable, {"data": data}, stop,
                                        step + 1 == steps):
                        result.stopped = True
                        break
        if ckpt:
            ckpt.close()
        return result
    finally:
        if dist.is_initialized():
            dist.barrier()
        destroy_parallel()
