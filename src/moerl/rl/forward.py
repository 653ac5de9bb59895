"""Passes of RL micro-batches through Megatron's pipeline schedule.

`run_schedule` drives `get_forward_backward_func()` (no pipelining, 1F1B or interleaved)
over a list of same-shape micro-batches: each stage embeds / transforms / projects, and
on the last stage `on_logits` turns the vocab-parallel logits of one micro-batch into
(loss, loss-token count, report). `forward_logprobs` is the forward-only use of it; the
policy update passes a loss. `broadcast_from_last_stage` makes a result of the last
pipeline stage known on every stage.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.pipeline_parallel import get_forward_backward_func

from moerl.data.rl_batch import RLMicroBatch
from moerl.rl.logprobs import vocab_parallel_logprobs
from moerl.rl.routing import ExpertLoad, RoutingReplay

# (k, micro-batch, logits (B, T, V/tp)) -> (loss, token count, report)
OnLogits = Callable[
    [int, RLMicroBatch, torch.Tensor], tuple[torch.Tensor, torch.Tensor, dict[str, Any]]
]


@dataclass
class ForwardHooks:
    """Per-micro-batch router set-up: replay recorded routing, count expert load."""

    replay: RoutingReplay | None = None
    load: ExpertLoad | None = None

    armed: bool = False

    def before(self, mb: RLMicroBatch, chunk: torch.nn.Module) -> None:
        # Packing gives routing to all micro-batches of a call or to none.
        if self.replay is not None and mb.routed_experts is not None:
            self.replay.arm(mb.routed_experts, chunk)
            self.armed = True
        if self.load is not None:
            self.load.set_tokens(mb.valid)

    def after(self) -> None:
        if self.replay is not None and self.armed:
            self.replay.disarm()
            self.armed = False
        if self.load is not None:
            self.load.set_tokens(None)


def run_schedule(
    chunks: Sequence[torch.nn.Module],
    micro: Sequence[RLMicroBatch],
    on_logits: OnLogits,
    *,
    forward_only: bool,
    device: torch.device,
    hooks: ForwardHooks | None = None,
) -> list[dict[str, Any]]:
    """Run the schedule; the reports of the micro-batches, in order, on the last stage."""
    hooks = hooks or ForwardHooks()
    b, t = micro[0].shape
    if any(mb.shape != (b, t) for mb in micro):
        raise ValueError("all micro-batches of one schedule call must share (B, T)")

    def forward_step(
        data_iterator: Iterator[tuple[int, RLMicroBatch]], model: torch.nn.Module
    ) -> tuple[torch.Tensor, Callable[[torch.Tensor], Any]]:
        k, mb = next(data_iterator)
        hooks.before(mb, model)
        # Every stage gets the whole micro-batch; only the first reads the tokens.
        output = model(mb.tokens.to(device), mb.position_ids.to(device), None)

        def loss_func(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
            return on_logits(k, mb, logits)  # logits (B, T, V/tp) on the last stage

        return output, loss_func

    def items() -> Iterator[tuple[int, RLMicroBatch]]:
        return iter(list(enumerate(micro)))

    data: Any = [items() for _ in chunks] if len(chunks) > 1 else items()
    try:
        reports = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=data,
            model=list(chunks),
            num_microbatches=len(micro),
            seq_length=t,
            micro_batch_size=b,
            forward_only=forward_only,
        )
    finally:
        hooks.after()
    return list(reports) if ps.is_pipeline_last_stage(ignore_virtual=True) else []


def forward_logprobs(
    chunks: Sequence[torch.nn.Module],
    micro: Sequence[RLMicroBatch],
    *,
    tp_group: dist.ProcessGroup | None,
    device: torch.device,
    hooks: ForwardHooks | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(logprobs, entropy), each (B, T) on the CPU, per micro-batch, on every rank."""

    def on_logits(
        k: int, mb: RLMicroBatch, logits: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        lp, ent = vocab_parallel_logprobs(logits, mb.labels.to(device), tp_group)
        assert ent is not None
        zero = torch.zeros((), device=device)
        return zero, torch.zeros((), dtype=torch.int), {"lp": lp, "ent": ent}

    was_training = [c.training for c in chunks]
    for c in chunks:
        c.eval()
    try:
        with torch.no_grad():
            reports = run_schedule(
                chunks, micro, on_logits, forward_only=True, device=device, hooks=hooks
            )
    finally:
        for c, mode in zip(chunks, was_training, strict=True):
            c.train(mode)
    b, t = micro[0].shape
    stacked = torch.zeros(len(micro), 2, b, t, dtype=torch.float32, device=device)
    for k, r in enumerate(reports):
        stacked[k, 0], stacked[k, 1] = r["lp"], r["ent"]
    stacked = broadcast_from_last_stage(stacked)
    return [(s[0].cpu(), s[1].cpu()) for s in stacked]


def broadcast_from_last_stage(x: torch.Tensor) -> torch.Tensor:
    """The last pipeline stage's `x` on every stage (no-op without pipelining)."""
    if ps.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast(
            x,
            src=ps.get_pipeline_model_parallel_last_rank(),
            group=ps.get_pipeline_model_parallel_group(),
        )
    return x
