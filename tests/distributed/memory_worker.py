"""Measure one rank's memory for the tiny MoE under a layout: what the memory model predicts.

Run under torchrun (or as one plain process). Builds the model and Megatron's
optimizer, takes one training step of a single micro-batch, and counts per rank what
`moerl.trainer.memory_census` counts (weights, main_grads and the DDP padding apart,
master_weights, adam_states: Adam's moments exist after the step) and

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

import torch.distributed as dist

from moerl.data.synthetic import SyntheticCorpus
from moerl.models.arch import TINY
from moerl.models.build import build_model
from moerl.models.precision import ResolvedPrecision
from moerl.parallel.groups import destroy_parallel, init_parallel
from moerl.parallel.layout import ParallelLayout
from moerl.trainer.config import OptimConfig
from moerl.trainer.lm import batch_iterators
from moerl.trainer.memory_census import trainable_bytes
from moerl.trainer.optimizer import Trainable, build_optimizer
from moerl.trainer.saved_activations import counting_saved_activations
from moerl.trainer.step import train_step


def build_trainable(layout: ParallelLayout, bf16: bool) -> Trainable:
    """The tiny model and Megatron's optimizer in `layout` (the process groups exist)."""
    chunks = build_model(TINY, layout, precision=ResolvedPrecision(te=False, bf16=bf16),
                         qk_layernorm=True)
    return build_optimizer(chunks, OptimConfig(), layout)


def run(layout: ParallelLayout, bf16: bool, seq_length: int, micro_batch: int) -> dict[str, Any]:
    groups = init_parallel(layout, seed=1234)
    trainable = build_trainable(layout, bf16)
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
    result: dict[str, Any] = {
        "rank": groups.rank, "pp_rank": groups.pp_rank, "loss": metrics.loss,
        **trainable_bytes(trainable.model, trainable.optimizer), "activations": activations,
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
