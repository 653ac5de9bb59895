"""Reduce the objective's per-micro-batch metric reports to global-batch values.

Reports live on the last pipeline stage, one per micro-batch. Each metric is either an
additive share (already divided by a global count: summing over micro-batches and
data-parallel ranks gives the global value) or, for keys ending in `_max`, a maximum
(see rl.losses.protocol). The result is broadcast to every pipeline stage.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps


def reduce_reports(reports: list[dict[str, Any]], dp_group: dist.ProcessGroup) -> dict[str, float]:
    """Global-batch metrics, the same dict on every rank."""
    result: list[dict[str, float] | None] = [None]
    if ps.is_pipeline_last_stage(ignore_virtual=True):
        keys = sorted(reports[0]) if reports else []
        sums = [k for k in keys if not k.endswith("_max")]
        maxes = [k for k in keys if k.endswith("_max")]
        total = torch.zeros(len(sums), dtype=torch.float64)
        top = torch.full((len(maxes),), float("-inf"), dtype=torch.float64)
        for r in reports:
            if sums:
                total += torch.stack([r[k].detach().cpu().double() for k in sums])
            if maxes:
                top = torch.maximum(top, torch.stack([r[k].detach().cpu().double() for k in maxes]))
        if dist.is_initialized() and dist.get_world_size(dp_group) > 1:
            device = _device(dp_group)
            total, top = total.to(device), top.to(device)
            dist.all_reduce(total, group=dp_group)
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=dp_group)
        result[0] = {
            **{k: float(v) for k, v in zip(sums, total.tolist(), strict=True)},
            **{k: float(v) for k, v in zip(maxes, top.tolist(), strict=True)},
        }
    if ps.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast_object_list(
            result,
            src=ps.get_pipeline_model_parallel_last_rank(),
            group=ps.get_pipeline_model_parallel_group(),
        )
    assert result[0] is not None
    return result[0]


def _device(group: dist.ProcessGroup) -> torch.device:
    if dist.get_backend(group) == dist.Backend.NCCL:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


_GAP = "logprob_gap/"


def gap_report(rollout: torch.Tensor, trainer: torch.Tensor, mask: torch.Tensor
               ) -> dict[str, torch.Tensor]:
    """One micro-batch's share of how far the engine's logprobs are from the trainer's
    for the same tokens (loss-mask tokens only), as sums and a maximum that
    `reduce_reports` adds up over micro-batches and data-parallel ranks. Computed on the
    trainer's device without a host sync: it runs inside the pipeline schedule."""
    device = trainer.device
    keep = mask.detach().to(device) > 0
    r64, t64 = rollout.detach().to(device, torch.float64), trainer.detach().double()
    diff = torch.where(keep, (r64 - t64).abs(), 0.0)
    return {
        f"{_GAP}abs_sum": diff.sum(),
        f"{_GAP}prob_sum": torch.where(keep, r64.exp() - t64.exp(), 0.0).sum(),
        f"{_GAP}tokens": keep.sum().double(),
        f"{_GAP}abs_max": diff.max() if diff.numel() else diff.new_zeros(()),
    }


def gap_metrics(reduced: dict[str, float]) -> dict[str, float]:
    """Replace the reduced `gap_report` sums in `reduced` by the global metrics: mean and
    max of |rollout - trainer|, and the mean of exp(rollout) - exp(trainer) (its sign
    says which side gives the sampled tokens more probability). None when no token
    counted (or the samples carried no rollout logprobs)."""
    raw = {k: reduced.pop(f"{_GAP}{k}") for k in ("abs_sum", "prob_sum", "tokens", "abs_max")
           if f"{_GAP}{k}" in reduced}  # fmt: skip
    if not raw.get("tokens"):
        return reduced
    reduced.update({f"{_GAP}mean_abs": raw["abs_sum"] / raw["tokens"],
                    f"{_GAP}max_abs": raw["abs_max"],
                    f"{_GAP}prob_diff": raw["prob_sum"] / raw["tokens"]})  # fmt: skip
    return reduced
