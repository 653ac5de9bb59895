"""One policy parity run: load the shared tiny weights under a layout, compute logprobs of
fixed samples, take one GRPO update, recompute the logprobs.

Run under torchrun (or as one plain process). With `--save` it first builds the model
from a seed and writes it with save_weights, so every layout starts from these weights.
Rank 0 writes the results as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core.transformer.moe import moe_logging

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the policy probe
from policy_logprobs import completion_logprobs

from moerl.data.rl_batch import RLSample
from moerl.models.arch import TINY
from moerl.models.build import build_model
from moerl.models.weights import save_weights
from moerl.parallel.groups import destroy_parallel, init_parallel
from moerl.parallel.layout import ParallelLayout
from moerl.rl.config import RLConfig
from moerl.rl.loop import update
from moerl.rl.losses import GRPOConfig
from moerl.rl.peers import Peers
from moerl.trainer.config import OptimConfig


def samples(n: int = 8) -> list[RLSample]:
    gen = torch.Generator().manual_seed(17)
    out = []
    for i in range(n):
        p, c = 3 + i % 4, 5 + (3 * i) % 7
        out.append(RLSample(
            prompt_ids=torch.randint(TINY.vocab_size, (p,), generator=gen),
            completion_ids=torch.randint(TINY.vocab_size, (c,), generator=gen),
            advantage=float(torch.randn((), generator=gen)),
            group_id=i // 4,
        ))
    return out


def run(layout: ParallelLayout, ckpt: Path, save: bool) -> dict[str, object]:
    groups = init_parallel(layout, seed=1234)
    layout.check(TINY, groups.world_size, groups.backend)
    if save:
        save_weights(build_model(TINY, layout), ckpt)
        moe_logging.destroy_moe_metrics_tracker()
    torch.manual_seed(99)  # the loaded weights must not depend on this
    cfg = RLConfig(objective_args=GRPOConfig(kl_coef=0.04, entropy_coef=0.01), token_budget=48)
    peers = Peers.build(TINY, layout, OptimConfig(lr=1e-3, clip_grad=1.0), groups, cfg,
                        weights=ckpt)
    policy = peers.policy
    batch = samples()
    before = completion_logprobs(policy, batch)
    metrics = update(cfg, peers, batch)
    after = completion_logprobs(policy, batch)
    dist.barrier()
    result = {
        "layout": layout.describe(), "rank": groups.rank,
        "logprobs": torch.cat(before).tolist(), "logprobs_after": torch.cat(after).tolist(),
        "metrics": {k: v for k, v in metrics.items() if not k.startswith("moe/")},
        "moe": {k: v for k, v in metrics.items() if k.startswith("moe/")},
    }
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
