"""What the trainer's policy gives each sampled token, per sample: the tests' probe of a
Policy (the update computes the same logprobs inside its own micro-batches)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from moerl.data.rl_batch import RLSample
from moerl.rl.policy import Policy


def completion_logprobs(policy: Policy, samples: Sequence[RLSample]) -> list[torch.Tensor]:
    """log pi(completion token) per sample, (C_i,) each, in order, on every rank."""
    micro = policy.pack(samples)
    mine: list[tuple[int, torch.Tensor]] = []
    for mb, (lp, _) in zip(micro, policy.logprobs(micro), strict=True):
        for row, index in enumerate(mb.sample_index):
            s = samples[index]
            start = s.prompt_ids.numel() - 1  # label position of the first completion token
            mine.append((index, lp[row, start : start + s.completion_ids.numel()].clone()))
    dp = policy.groups.layout.dp
    gathered: list[Any] = [mine]
    if dp > 1:  # small test batches: every rank's share to every rank
        gathered = [None] * dp
        dist.all_gather_object(gathered, mine, group=policy.groups.dp_group)
    ordered = dict(pair for part in gathered for pair in part)
    return [ordered[i] for i in range(len(samples))]
