"""A short language-model training run of an `MoEArch` on the synthetic corpus.

This is the demo of the trainer: build the groups and the model for a layout,
then Adam steps over Megatron's pipeline schedule, printing the falling loss (a
rich progress bar on the rank that holds the loss).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch.distributed as dist
from megatron.core import parallel_state as ps
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from moerl.data.synthetic import Batch, SyntheticCorpus, step_batches
from moerl.models.arch import MoEArch
from moerl.models.build import build_model, te_available
from moerl.parallel.context import split_batch
from moerl.parallel.groups import ParallelGroups, destroy_parallel, init_parallel
from moerl.parallel.layout import ParallelLayout
from moerl.trainer.optimizer import OptimConfig, build_optimizer
from moerl.trainer.step import StepMetrics, train_step


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
) -> list[float]:
    """Train for `steps` optimizer steps; the loss of each step (on every rank)."""
    groups = init_parallel(layout, seed=seed)
    try:
        layout.check(arch, groups.world_size, groups.backend, te_available())
        chunks = build_model(arch, layout, te=te_available(), backend=groups.backend)
        trainable = build_optimizer(chunks, optim, layout)
        corpus = SyntheticCorpus(arch.vocab_size, seq_length, seed=seed)
        num_micro = global_batch // (micro_batch * layout.dp)
        show = progress and groups.is_logging_rank
        losses: list[float] = []
        with Progress(
            TextColumn("[bold]{task.description}"), BarColumn(),
            TextColumn("{task.completed}/{task.total}"), TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(), disable=not show,
        ) as bar:
            task = bar.add_task(f"{arch.name} {layout.describe()}", total=steps, info="")
            for step in range(steps):
                metrics: StepMetrics = train_step(
                    trainable.model,
                    trainable.optimizer,
                    batch_iterators(corpus, step, groups, global_batch, micro_batch),
                    num_microbatches=num_micro,
                    micro_batch_size=micro_batch,
                    seq_length=seq_length // layout.cp,  # this rank's share
                    scheduler=trainable.scheduler,
                )
                losses.append(metrics.loss)
                info = f"loss {metrics.loss:.4f}  grad {metrics.grad_norm:.3f}"
                bar.update(task, advance=1, info=info)
                if show:
                    bar.console.print(f"step {step + 1:3d}  {info}  lr {metrics.lr:.2e}")
        return losses
    finally:
        if dist.is_initialized():
            dist.barrier()
        destroy_parallel()
