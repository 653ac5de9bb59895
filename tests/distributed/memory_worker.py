"""Measure one rank's memory for the tiny MoE under a layout: what the memory model predicts.

Run under torchrun (or as one plain process). Builds the model and Megatron's
optimizer, takes one training step of a single micro-batch, and counts per rank:

    weights         unique parameter storages: numel x element size
    main_grads      every parameter's `main_grad` (a view into DDP's fp32 buffer):
                    numel x 4; the padding DDP adds around them is reported apart
    master_weights  fp32 copies the optimizer keeps of bf16 parameters (its shard)
    adam_states     exp_avg and exp_avg_sq of the optimizer's parameters (its shard)
    activations     the unique storages autograd saves during the step's forward
                    (saved_tensors_hooks), parameters excluded: one micro-batch

Each rank writes its numbers as JSON to `<out>/rank<r>.json`.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from moerl.data.synthetic import SyntheticCorpus
from moerl.models.arch import TINY
from moerl.models.build import build_model
from moerl.models.precision import ResolvedPrecision
from moerl.parallel.groups import destroy_parallel, init_parallel
from moerl.parallel.layout import ParallelLayout
from moerl.trainer.config import OptimConfig
from moerl.trainer.lm import batch_iterators
from moerl.trainer.optimizer import build_optimizer
from moerl.trainer.saved_activations import counting_saved_activations
from moerl.trainer.step import train_step


def _inner_optimizers(optimizer: Any) -> list[Any]:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def optimizer_bytes(optimizer: Any) -> tuple[int, int]:
    """(fp32 master copies, Adam moments) held by this rank's optimizer(s)."""
    master = adam = 0
    for opt in _inner_optimizers(optimizer):
        for state in opt.optimizer.state.values():
            adam += sum(v.numel() * v.element_size() for k, v in state.items()
                        if k != "step" and torch.is_tensor(v))
        # Float16OptimizerWithFloat16Params / DistributedOptimizer keep fp32 copies
        # of bf16 parameters; fp32 parameters are optimized in place (no copy).
        groups = getattr(opt, "shard_fp32_from_float16_groups", None)
        if groups is None:
            groups = getattr(opt, "fp32_from_float16_groups", [])
        master += sum(p.numel() * p.element_size() for group in groups for p in group)
    return master, adam


def static_bytes(model: list[Any]) -> dict[str, int]:
    params = {id(p): p for chunk in model for p in chunk.module.parameters()}
    grads = sum(p.main_grad.numel() * p.main_grad.element_size() for p in params.values())
    buffers = sum(buf.grad_data.numel() * buf.grad_data.element_size()
                  for chunk in model for buf in chunk.buffers + chunk.expert_parallel_buffers)
    return {
        "weights": sum(p.numel() * p.element_size() for p in params.values()),
        "main_grads": grads,
        "grad_buffer_padding": buffers - grads,
    }


def run(layout: ParallelLayout, bf16: bool, seq_length: int, micro_batch: int) -> dict[str, Any]:
    groups = init_parallel(layout, seed=1234)
    chunks = build_model(TINY, layout, precision=ResolvedPrecision(te=False, bf16=bf16),
                         qk_layernorm=True)
    trainable = build_optimizer(chunks, OptimConfig(), layout)
    corpus = SyntheticCorpus(TINY.vocab_size, seq_length, seed=7)
    batches = batch_iterators(corpus, 0, groups, micro_batch * layout.dp, micro_batch)
    with counting_saved_activations(trainable) as saved:
        metrics = train_step(
            trainable.model,
            trainable.optimizer,
            batches,
            num_microbatches=1,
            micro_batch_size=micro_batch,
            seq_length=seq_length,
        )
    activations = saved.total
    saved.seen.clear()
    master, adam = optimizer_bytes(trainable.optimizer)
    result: dict[str, Any] = {
        "rank": groups.rank, "pp_rank": groups.pp_rank, "loss": metrics.loss,
        **static_bytes(trainable.model),
        "master_weights": master, "adam_states": adam, "activations": activations,
    }
    dist.barrier()
    destroy_parallel()
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layout", default="{}", help="JSON of ParallelLayout degrees")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--seq-length", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=2)
    args = parser.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    layout = ParallelLayout.for_world(world, **json.loads(args.layout))
    result = run(layout, args.bf16, args.seq_length, args.micro_batch)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{result['rank']}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
