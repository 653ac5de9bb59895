"""Supervised fine-tuning: `moerl sft`, and the warm-up before RL, on the same model
and layout.

Batches come from (prompt, response) examples (data.sft): loss on response tokens
only. The examples are first laid out in rows — one per row, or several per row
with `sft.pack` (document boundaries keep attention inside each) — and every step
takes the next `global_batch` rows, cycling. Each data-parallel rank takes its
contiguous share of a step's rows; each context-parallel rank its two
load-balanced chunks of every row; with virtual pipeline stages each chunk reads
its own copy of the micro-batches.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from megatron.core import parallel_state as ps
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from moerl.data.sft import SFTExample, pack_examples, packed_batch, row_slots, sft_batch
from moerl.data.synthetic import Batch
from moerl.models.arch import MoEArch
from moerl.models.build import build_model
from moerl.models.features import resolve_precision
from moerl.models.precision import RecomputeConfig, ResolvedPrecision
from moerl.models.weights import load_weights
from moerl.parallel.context import split_batch
from moerl.parallel.groups import ParallelGroups
from moerl.parallel.layout import ParallelLayout
from moerl.trainer.config import OptimConfig, SFTConfig
from moerl.trainer.optimizer import Trainable, build_optimizer
from moerl.trainer.step import StepMetrics, train_step


def sft_rows(examples: Sequence[SFTExample], cfg: SFTConfig) -> list[list[int]]:
    """Example indices of every row: packed, or one example a row."""
    if cfg.pack:
        return pack_examples(examples, cfg.seq_length)
    return [[i] for i in range(len(examples))]


def sft_optim(cfg: SFTConfig) -> OptimConfig:
    """SFT's own schedule: warm-up, then cosine to a tenth of `sft.lr`."""
    return OptimConfig(lr=cfg.lr, min_lr=cfg.lr / 10, warmup_steps=cfg.warmup_steps,
                       decay_steps=max(cfg.steps, cfg.warmup_steps + 1))


def build_sft_trainable(
    arch: MoEArch, layout: ParallelLayout, cfg: SFTConfig, groups: ParallelGroups,
    init_weights: str | Path | None = None, precision: ResolvedPrecision | None = None,
    recompute: RecomputeConfig | None = None,
) -> Trainable:
    """The model (fresh, or from `init_weights`) and its optimizer for SFT;
    `precision`: the run's, resolved (None: this machine's default)."""
    cfg.check_layout(layout, arch.mtp_num_layers)
    precision = precision or resolve_precision()
    chunks = build_model(arch, layout, precision=precision, recompute=recompute,
                         backend=groups.backend, packed_rows=cfg.pack)
    if init_weights is not None:
        load_weights(list(chunks), init_weights)
    return build_optimizer(chunks, sft_optim(cfg), layout,
                           offload=precision.config.offload_optimizer)


def _rank_batches(
    examples: Sequence[SFTExample], rows: Sequence[Sequence[int]], step: int, cfg: SFTConfig,
    groups: ParallelGroups, pad_id: int,
) -> Iterator[Batch]:
    layout = groups.layout
    per_rank = cfg.global_batch // layout.dp
    start = (step * cfg.global_batch + groups.dp_rank * per_rank) % len(rows)
    mine = [[examples[i] for i in rows[(start + k) % len(rows)]] for k in range(per_rank)]
    for first in range(0, per_rank, cfg.micro_batch):
        chunk = mine[first : first + cfg.micro_batch]
        if cfg.pack:
            batch = packed_batch(chunk, cfg.seq_length, pad_id)
        else:
            batch = sft_batch([row[0] for row in chunk], cfg.seq_length, pad_id)
        if layout.cp > 1:
            batch = split_batch(batch, ps.get_context_parallel_rank(), layout.cp)
        yield batch


def run_sft(
    trainable: Trainable,
    groups: ParallelGroups,
    examples: Sequence[SFTExample],
    cfg: SFTConfig,
    pad_id: int,
    on_step: Callable[[int, StepMetrics], bool] | None = None,
    start_step: int = 0,
) -> list[float]:
    """Optimizer steps `start_step` .. `cfg.steps - 1` over `examples` (cycled); the
    loss of each step run. `on_step(step, metrics)` follows every step; when it
    returns True (a stop signal, the checkpoint saved) no further step runs."""
    layout = groups.layout
    rows = sft_rows(examples, cfg)
    num_micro = cfg.global_batch // (cfg.micro_batch * layout.dp)
    losses: list[float] = []
    with Progress(TextColumn("[bold]SFT"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TextColumn("{task.fields[info]}"), TimeElapsedColumn(),
                  disable=not groups.is_logging_rank) as bar:
        if cfg.pack:
            used = sum(row_slots(e) for e in examples)
            bar.console.print(f"SFT: {len(examples)} examples packed into {len(rows)} rows of "
                              f"{cfg.seq_length} ({used / (len(rows) * cfg.seq_length):.0%} full)")
        task = bar.add_task("sft", total=cfg.steps, info="", completed=start_step)
        log_lines = groups.is_logging_rank and not bar.console.is_terminal
        every = max(1, cfg.steps // 20)
        for step in range(start_step, cfg.steps):
            def make() -> Iterator[Batch]:
                return _rank_batches(examples, rows, step, cfg, groups, pad_id)  # noqa: B023

            data = [make() for _ in range(layout.vpp)] if layout.vpp else make()
            metrics = train_step(
                trainable.model, trainable.optimizer, data, num_microbatches=num_micro,
                micro_batch_size=cfg.micro_batch, seq_length=cfg.seq_length,
                scheduler=trainable.scheduler,
            )
            losses.append(metrics.loss)
            bar.update(task, advance=1, info=f"loss {metrics.loss:.4f}")
            if log_lines and (step + 1) % every == 0:  # a log file gets no progress bar
                bar.console.print(f"SFT step {step + 1}/{cfg.steps}  loss {metrics.loss:.4f}  "
                                  f"lr {metrics.lr:.2e}")
            if on_step is not None and on_step(step, metrics):
                break
    return losses
