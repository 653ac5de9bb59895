"""One critic parity run: PPO with GAE (`rl.advantage=gae`) on the shared tiny weights.

Loads the policy's weights under a layout, builds the critic from them (a random head
drawn from a fixed seed, so its trunk gets gradients), computes the critic's values of
fixed samples, takes one policy update of two minibatches (two critic steps on the
clipped value loss, two policy steps on the GAE advantages) and the values after it.
With `--record DIR` it writes the critic's whole gradient at each of its two steps as
weights; with `--against DIR` every rank compares its shards of its own gradients with
those (`parity_checks.compare_with_checkpoint`). Rank 0 writes the results as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.transformer.moe import moe_logging
from parity_checks import (
    PARITY_OPTIM,
    RoutingMargins,
    compare_with_checkpoint,
    record_gradients,
    save_as_weights,
)

from moerl.data.rl_batch import RLSample
from moerl.models.arch import TINY
from moerl.models.build import build_model
from moerl.models.weights import save_weights
from moerl.parallel.groups import destroy_parallel, init_parallel
from moerl.parallel.layout import ParallelLayout
from moerl.rl.config import RLConfig
from moerl.rl.critic import Critic
from moerl.rl.critic_config import CriticConfig
from moerl.rl.loop import update
from moerl.rl.peers import Peers
from moerl.rl.policy import Policy

# The critic's own lr, below the policy's: at 1e-2 its first step moved the values past
# their returns (by ~2), so the second step's clip never bound; eps 0.005 then binds on
# ~20% of the tokens.
CRITIC = CriticConfig(head_init_std=0.05, value_clip=0.005, lr=1e-3)


def samples(n: int = 8) -> list[RLSample]:
    gen = torch.Generator().manual_seed(31)
    out = []
    for i in range(n):
        p, c = 3 + i % 4, 5 + (3 * i) % 7
        out.append(RLSample(
            prompt_ids=torch.randint(TINY.vocab_size, (p,), generator=gen),
            completion_ids=torch.randint(TINY.vocab_size, (c,), generator=gen),
            advantage=0.0, reward=float(i % 3 == 0),
            rollout_logprobs=-3 * torch.rand(c, generator=gen), group_id=i // 4,
        ))
    return out


def completion_values(policy: Policy, critic: Critic, batch: list[RLSample]) -> list[float]:
    """The critic's value at every completion token of every sample, in order."""
    micro = policy.pack(batch)
    mine = []
    for mb, values in zip(micro, critic.values(micro), strict=True):
        for row, index in enumerate(mb.sample_index):
            start = batch[index].prompt_ids.numel() - 1
            mine.append((index, values[row, start : start + batch[index].completion_ids.numel()]))
    gathered: list[Any] = [None] * policy.groups.layout.dp
    dist.all_gather_object(gathered, mine, group=policy.groups.dp_group)
    ordered = dict(pair for part in gathered for pair in part)
    return torch.cat([ordered[i] for i in range(len(batch))]).tolist()


def run(args: argparse.Namespace, layout: ParallelLayout) -> dict[str, Any]:
    groups = init_parallel(layout, seed=1234)
    layout.check(TINY, groups.world_size, groups.backend)
    if args.save:
        save_weights(build_model(TINY, layout), args.ckpt)
        moe_logging.destroy_moe_metrics_tracker()
    torch.manual_seed(99)  # the loaded weights must not depend on this
    cfg = RLConfig(objective="ppo_clip", token_budget=48, advantage="gae", kl_in_reward=0.05,
                   gae_gamma=0.99, gae_lambda=0.9, critic=CRITIC, seed=5)  # the head's seed
    peers = Peers.build(TINY, layout, PARITY_OPTIM, groups, cfg, weights=args.ckpt)
    policy, critic = peers.policy, peers.need_critic()
    model = list(critic.trainable.model)
    grads = record_gradients(critic.trainable.optimizer, model)
    margins = RoutingMargins()
    margins.install()
    batch = samples()
    before = completion_values(policy, critic, batch)
    metrics = update(cfg, peers, batch, num_minibatches=2)
    after = completion_values(policy, critic, batch)
    result: dict[str, Any] = {
        "layout": layout.describe(), "rank": groups.rank, "values": before,
        "values_after": after, "margin": margins.global_smallest(),
        "metrics": {k: v for k, v in metrics.items() if not k.startswith("moe/")},
    }
    if args.record:
        for step, tensors in enumerate(grads, start=1):
            save_as_weights(model, tensors, args.record / f"grads{step}")
    if args.against:
        result["checks"] = {
            f"grads{step}": compare_with_checkpoint(model, args.against / f"grads{step}", own)
            for step, own in enumerate(grads, start=1)}
    dist.barrier()
    destroy_parallel()
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt", type=Path, required=True, help="the policy's weights")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layout", default="{}", help="JSON of ParallelLayout degrees")
    parser.add_argument("--save", action="store_true", help="first write --ckpt from a seed")
    parser.add_argument("--record", type=Path, help="write the critic's gradients here")
    parser.add_argument("--against", type=Path, help="compare the critic's gradients with")
    args = parser.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    result = run(args, ParallelLayout.for_world(world, **json.loads(args.layout)))
    if result["rank"] == 0:
        args.out.write_text(json.dumps(result))


if __name__ == "__main__":  # dist_checkpointing's save starts a multiprocessing Manager
    main()
