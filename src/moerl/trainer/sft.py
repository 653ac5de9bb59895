"""Supervised fine-tuning: the warm-up before RL, on the same model and layout.

Batches come from (prompt, response) pairs (data.sft): loss on response tokens
only. Every data-parallel rank takes its contiguous share of each global batch;
with virtual pipeline stages each chunk reads its own copy of the micro-batches.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from moerl.data.sft import SFTExample, sft_batch
from moerl.data.synthetic import Batch
from moerl.parallel.groups import ParallelGroups
from moerl.rl.config import SFTConfig
from moerl.trainer.optimizer import Trainable
from moerl.trainer.step import train_step


def _rank_batches(
    examples: Sequence[SFTExample], step: int, cfg: SFTConfig, groups: ParallelGroups,
    pad_id: int,
) -> Iterator[Batch]:
    per_rank = cfg.global_batch // groups.layout.dp
    start = (step * cfg.global_batch + groups.dp_rank * per_rank) % len(examples)
    mine = [examples[(start + i) % len(examples)] for i in range(per_rank)]
    for first in range(0, per_rank, cfg.micro_batch):
        yield sft_batch(mine[first : first + cfg.micro_batch], cfg.seq_length, pad_id)


def run_sft(
    trainable: Trainable,
    groups: ParallelGroups,
    examples: Sequence[SFTExample],
    cfg: SFTConfig,
    pad_id: int,
    on_step: Callable[[int, float], None] | None = None,
) -> list[float]:
    """`cfg.steps` optimizer steps over `examples` (cycled); the loss of each step."""
    layout = groups.layout
    if cfg.global_batch % (cfg.micro_batch * layout.dp):
        raise ValueError(
            f"sft.global_batch: {cfg.global_batch} must be a multiple of sft.micro_batch * dp "
            f"= {cfg.micro_batch * layout.dp}"
        )
    num_micro = cfg.global_batch // (cfg.micro_batch * layout.dp)
    losses: list[float] = []
    with Progress(TextColumn("[bold]SFT"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TextColumn("{task.fields[info]}"), TimeElapsedColumn(),
                  disable=not groups.is_logging_rank) as bar:
        task = bar.add_task("sft", total=cfg.steps, info="")
        for step in range(cfg.steps):
            def make() -> Iterator[Batch]:
                return _rank_batches(examples, step, cfg, groups, pad_id)  # noqa: B023

            data = [make() for _ in range(layout.vpp)] if layout.vpp else make()
            metrics = train_step(
                trainable.model, trainable.optimizer, data, num_microbatches=num_micro,
                micro_batch_size=cfg.micro_batch, seq_length=cfg.seq_length,
                scheduler=trainable.scheduler,
            )
            losses.append(metrics.loss)
            bar.update(task, advance=1, info=f"loss {metrics.loss:.4f}")
            if on_step is not None:
                on_step(step, metrics.loss)
    return losses
