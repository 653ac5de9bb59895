"""One parity run: load the shared tiny weights under a layout, take 3 Adam steps.

Run under torchrun (or as one plain process). With `--save` it first builds the
model from a seed and writes it with Megatron dist_checkpointing (torch_dist), so
every layout starts from exactly these weights, resharded on load. The rank-0
process writes the per-step losses and gradient norms as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core.transformer.moe import moe_logging

from moerl.data.synthetic import SyntheticCorpus
from moerl.models.arch import TINY
from moerl.models.build import build_model
from moerl.models.weights import load_weights, save_weights
from moerl.parallel.groups import destroy_parallel, init_parallel
from moerl.parallel.layout import ParallelLayout
from moerl.trainer.config import OptimConfig
from moerl.trainer.lm import batch_iterators
from moerl.trainer.optimizer import build_optimizer
from moerl.trainer.step import train_step

GLOBAL_BATCH, MICRO_BATCH, SEQ_LENGTH, STEPS = 8, 2, 32, 3


def run(layout: ParallelLayout, ckpt: Path, save: bool) -> dict[str, object]:
    groups = init_parallel(layout, seed=1234)
    layout.check(TINY, groups.world_size, groups.backend)
    if save:
        save_weights(build_model(TINY, layout), ckpt)
        moe_logging.destroy_moe_metrics_tracker()
    torch.manual_seed(99)  # the loaded weights must not depend on this
    chunks = build_model(TINY, layout)
    load_weights(chunks, ckpt)  # resharded from the single-process save
    trainable = build_optimizer(chunks, OptimConfig(lr=1e-2, clip_grad=1.0), layout)
    corpus = SyntheticCorpus(TINY.vocab_size, SEQ_LENGTH, seed=7)
    losses, norms = [], []
    for step in range(STEPS):
        metrics = train_step(
            trainable.model,  # type: ignore[arg-type]
            trainable.optimizer,
            batch_iterators(corpus, step, groups, GLOBAL_BATCH, MICRO_BATCH),
            num_microbatches=GLOBAL_BATCH // (MICRO_BATCH * layout.dp),
            micro_batch_size=MICRO_BATCH,
            seq_length=SEQ_LENGTH,
            scheduler=trainable.scheduler,
        )
        losses.append(metrics.loss)
        norms.append(metrics.grad_norm)
    dist.barrier()
    result = {"layout": layout.describe(), "losses": losses, "grad_norms": norms,
              "rank": groups.rank}
    destroy_parallel()
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layout", default="{}", help="JSON of ParallelLayout degrees")
    parser.add_argument("--save", action="store_true")
    args = parser.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    layout = ParallelLayout.for_world(world, **json.loads(args.layout))
    result = run(layout, args.ckpt, args.save)
    if result["rank"] == 0:
        args.out.write_text(json.dumps(result))


if __name__ == "__main__":  # dist_checkpointing's save starts a multiprocessing Manager
    main()
