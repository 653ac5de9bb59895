"""One optimizer step over Megatron's pipeline schedule, with the loss per token.

`get_forward_backward_func()` picks the schedule for the layout (no pipelining,
1F1B, or interleaved 1F1B with virtual stages). The config runs with
`calculate_per_token_loss`: each micro-batch returns its summed loss and token
count, and `finalize_model_grads` divides every gradient by the number of loss
tokens in the whole global batch (all micro-batches, all data-parallel ranks), so
the gradient is that of the mean over tokens, independent of how the batch is cut.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.pipeline_parallel import get_forward_backward_func

from moerl.data.synthetic import Batch

# (per-token losses [b, s], batch) -> (loss sum, token count, {name: [sum, count]})
LossFn = Callable[[torch.Tensor, Batch], tuple[torch.Tensor, torch.Tensor, dict[str, Any]]]


@dataclass(frozen=True)
class StepMetrics:
    loss: float  # mean LM loss over the loss tokens of the global batch
    grad_norm: float  # before clipping
    lr: float
    num_tokens: int  # loss tokens in the global batch
    skipped: bool  # the optimizer refused the step (non-finite grads)


def lm_loss(per_token: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, torch.Tensor,
                                                            dict[str, Any]]:
    """Masked sum of the language-model loss; the schedule divides by the token count."""
    mask = batch.loss_mask.to(per_token.dtype)  # [b, s]
    loss_sum = (per_token.float() * mask).sum()
    num_tokens = mask.sum().to(torch.int)
    report = torch.stack([loss_sum.detach(), num_tokens.float()])  # [2]
    return loss_sum, num_tokens, {"lm loss": report}


def _forward_step(
    loss_fn: LossFn, data_iterator: Iterator[Batch], model: torch.nn.Module
) -> tuple[torch.Tensor, Callable[..., Any]]:
    batch = next(data_iterator)
    # Every stage takes the whole batch: the first uses tokens and positions, the
    # last labels (its output is then per-token losses [b, s]) and the MTP layers
    # the tokens again.
    packed = None
    if batch.cu_seqlens is not None:  # document boundaries (see `Batch.cu_seqlens`)
        # The whole row's length (before the CP split): the rotary table's length.
        row = batch.tokens.size(1) * ps.get_context_parallel_world_size()
        packed = PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=batch.cu_seqlens,
                                 cu_seqlens_kv=batch.cu_seqlens, max_seqlen_q=row,
                                 max_seqlen_kv=row)
    output = model(batch.tokens, batch.position_ids, None, labels=batch.labels,
                   loss_mask=batch.loss_mask, packed_seq_params=packed)

    def reduce(per_token: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        return loss_fn(per_token, batch)

    return output, reduce


def train_step(
    model_chunks: list[torch.nn.Module],
    optimizer: Any,
    data_iterator: Iterator[Batch] | list[Iterator[Batch]],
    *,
    num_microbatches: int,
    micro_batch_size: int,
    seq_length: int,
    loss_fn: LossFn = lm_loss,
    scheduler: Any = None,
) -> StepMetrics:
    """Forward/backward over `num_microbatches`, then one optimizer (and LR) step.

    With virtual stages `data_iterator` is a list with one iterator per chunk
    (each chunk draws its own copy of every micro-batch). `seq_length` is the whole
    row's length even under context parallelism: the pipeline schedule sizes the
    activations it sends between stages as seq_length / CP (/ TP with sequence
    parallelism), so this rank's share there would make the stages disagree.
    """
    for chunk in model_chunks:
        chunk.zero_grad_buffer()  # type: ignore[operator]
    optimizer.zero_grad()
    reports = get_forward_backward_func()(
        forward_step_func=partial(_forward_step, loss_fn),
        data_iterator=data_iterator,
        model=model_chunks,
        num_microbatches=num_microbatches,
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        forward_only=False,
    )
    ok, grad_norm, _ = optimizer.step()
    if ok and scheduler is not None:
        scheduler.step(increment=1)
    loss_sum, tokens = _global_loss(reports)
    return StepMetrics(
        loss=loss_sum / max(tokens, 1.0),
        grad_norm=float(grad_norm) if grad_norm is not None else float("nan"),
        lr=float(optimizer.param_groups[0]["lr"]),
        num_tokens=int(tokens),
        skipped=not ok,
    )


def _global_loss(reports: list[dict[str, torch.Tensor]]) -> tuple[float, float]:
    """(loss sum, token count) over the global batch, known on every rank.

    Only the last pipeline stage has reports; sum them over data parallel ranks
    there, then broadcast along the pipeline.
    """
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    total = torch.zeros(2, dtype=torch.float64, device=device)  # [loss sum, tokens]
    if ps.is_pipeline_last_stage(ignore_virtual=True):
        for report in reports:
            total += report["lm loss"].detach().to(device, torch.float64)
        dist.all_reduce(total, group=ps.get_data_parallel_group(with_context_parallel=True))
    if ps.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast(
            total,
            src=ps.get_pipeline_model_parallel_last_rank(),
            group=ps.get_pipeline_model_parallel_group(),
        )
    return float(total[0]), float(total[1])
