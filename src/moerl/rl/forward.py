"""Passes of RL micro-batches through Megatron's pipeline schedule.

`run_schedule` drives `get_forward_backward_func()` (no pipelining, 1F1B or interleaved)
over a list of same-shape micro-batches: each stage embeds / transforms / projects, and
on the last stage `on_logits` turns the vocab-parallel logits of one micro-batch into
(loss, loss-token count, report). `forward_logprobs` is the forward-only use of it; the
policy update passes a loss. `broadcast_from_last_stage` makes a result of the last
pipeline stage known on every stage.

Context parallelism. Every CP rank holds the same whole rows; the model reads only this
rank's share of each row (`cp_share`: Megatron's load-balanced split into 2·CP chunks),
so the logits are (B, T/CP, V/tp). `token_logprobs` turns them into per-token logprobs
of the whole row, gathered over the CP group, so the objective (which has sequence-level
terms: per-sequence means, GSPO's sequence ratio) sees whole sequences and gives the same
loss on every CP rank; the gather's backward keeps this rank's tokens' gradient, and
Megatron's gradient all-reduce over DP x CP adds the CP ranks' parts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.pipeline_parallel import get_forward_backward_func

from moerl.data.rl_batch import RLMicroBatch
from moerl.models.weights import unwrap_model
from moerl.parallel.context import gather_from_cp, split_for_cp_rank
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


def _cp(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if group is None or not dist.is_initialized():
        return 0, 1
    return group.rank(), group.size()


def cp_share(mb: RLMicroBatch, group: dist.ProcessGroup | None) -> RLMicroBatch:
    """This CP rank's positions of every (B, T) tensor of `mb` (`mb` itself at CP = 1)."""
    rank, size = _cp(group)
    if size == 1:
        return mb

    def mine(t: torch.Tensor | None, dim: int = 1) -> Any:
        return None if t is None else split_for_cp_rank(t, rank, size, dim=dim)

    return replace(
        mb, tokens=mine(mb.tokens), labels=mine(mb.labels), position_ids=mine(mb.position_ids),
        loss_mask=mine(mb.loss_mask), valid=mine(mb.valid),
        advantages=mine(mb.advantages) if mb.advantages.dim() == 2 else mb.advantages,
        rollout_logprobs=mine(mb.rollout_logprobs), routed_experts=mine(mb.routed_experts, 2),
    )


def token_logprobs(
    logits: torch.Tensor,
    mb: RLMicroBatch,
    tp_group: dist.ProcessGroup | None,
    cp_group: dist.ProcessGroup | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T/CP, V/tp) logits of this rank -> (logprobs, entropy) of the whole rows, (B, T)."""
    labels = cp_share(mb, cp_group).labels.to(logits.device)
    lp, ent = vocab_parallel_logprobs(logits, labels, tp_group)
    assert ent is not None
    return gather_from_cp(lp, cp_group), gather_from_cp(ent, cp_group)


@contextmanager
def without_mtp(model: torch.nn.Module) -> Iterator[None]:
    """The model's forward without its multi-token-prediction layers, for a pass that
    uses only the main head's logits (the MTP loss is then scaled by 0: its layers would
    cost a decoder layer and an output projection per token, and add exact zeros to every
    gradient). Set around the model call only: the gradient finalisation after the
    backward still sees the MTP layers (its embedding-copy all-reduce across pipeline
    stages). Their routers count no tokens, so their expert biases stay as they are."""
    inner = unwrap_model(model)
    config = inner.config
    saved = (getattr(inner, "mtp_process", False), config.mtp_num_layers)
    inner.mtp_process, config.mtp_num_layers = False, None
    try:
        yield
    finally:
        inner.mtp_process, config.mtp_num_layers = saved


def _padding_mask(model: torch.nn.Module, valid: torch.Tensor) -> torch.Tensor:
    """(B, T) True at padding. GPTModel cuts it for sequence parallelism on the first
    pipeline stage only; a later stage's hidden states hold this TP rank's T / tp
    positions, so it gets that slice here."""
    inner = unwrap_model(model)
    if inner.config.sequence_parallel and not inner.pre_process:
        tp = ps.get_tensor_model_parallel_world_size()
        return (~valid).chunk(tp, dim=1)[ps.get_tensor_model_parallel_rank()]
    return ~valid


def run_schedule(
    chunks: Sequence[torch.nn.Module],
    micro: Sequence[RLMicroBatch],
    on_logits: OnLogits,
    *,
    forward_only: bool,
    device: torch.device,
    hooks: ForwardHooks | None = None,
    cp_group: dist.ProcessGroup | None = None,
    mtp: bool = True,
) -> list[dict[str, Any]]:
    """Run the schedule; the reports of the micro-batches, in order, on the last stage.

    `on_logits` gets the whole micro-batch and this CP rank's logits (see `cp_share`).
    `mtp=False`: the model's MTP layers do not run (`without_mtp`).
    """
    hooks = hooks or ForwardHooks()
    b, t = micro[0].shape
    if any(mb.shape != (b, t) for mb in micro):
        raise ValueError("all micro-batches of one schedule call must share (B, T)")
    _, cp_size = _cp(cp_group)
    if cp_size > 1 and t % (2 * cp_size):
        raise ValueError(f"micro-batch length {t} must be a multiple of 2*cp = {2 * cp_size}")

    def forward_step(
        data_iterator: Iterator[tuple[int, RLMicroBatch]], model: torch.nn.Module
    ) -> tuple[torch.Tensor, Callable[[torch.Tensor], Any]]:
        k, mb = next(data_iterator)
        local = cp_share(mb, cp_group)
        hooks.before(local, model)
        # Every stage gets the whole micro-batch; only the first reads the tokens.
        with nullcontext() if mtp else without_mtp(model):
            # padding_mask: padding rows' tokens reach no router's token counts, so the
            # expert-bias update does not depend on how a layout pads its micro-batches.
            output = model(local.tokens.to(device), local.position_ids.to(device), None,
                           padding_mask=_padding_mask(model, local.valid).to(device))

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
            seq_length=t,  # the whole row: Megatron divides by CP (and TP with SP)
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
    cp_group: dist.ProcessGroup | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(logprobs, entropy), each (B, T) on the CPU, per micro-batch, on every rank."""

    def on_logits(
        k: int, mb: RLMicroBatch, logits: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        lp, ent = token_logprobs(logits, mb, tp_group, cp_group)
        zero = torch.zeros((), device=device)
        return zero, torch.zeros((), dtype=torch.int), {"lp": lp, "ent": ent}

    was_training = [c.training for c in chunks]
    for c in chunks:
        c.eval()
    try:
        with torch.no_grad():
            reports = run_schedule(chunks, micro, on_logits, forward_only=True, device=device,
                                   hooks=hooks, cp_group=cp_group, mtp=False)
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
