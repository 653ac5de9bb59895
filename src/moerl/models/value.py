"""A value model on Megatron-Core: the GPT trunk with a scalar head instead of the vocabulary.

    V_t = w . h_t + b          h_t: the final (normed) hidden state at position t

`ValueModel` is Megatron's `GPTModel` (same layer specs, so the same TP/SP, EP, PP, VPP
and CP layouts as the policy) whose last stage ends in `ValueHead`, a (1, H) weight and a
bias, in place of the (V/tp, H) output layer; the forward returns values (B, T/CP), fp32.
No MTP and no tied embeddings (there is no output layer to tie to).

Tensor parallelism. The head is replicated on every TP rank. Without sequence
parallelism every rank holds the whole hidden states and computes the same values. With
it, each rank projects its own S/tp positions and the values (S, B) are gathered over
TP: the gather's backward hands each rank its own positions' gradient (the loss on the
gathered values is the same on every TP rank), the head's weight and bias gradients are
then partial sums over those positions, and their `sequence_parallel` tag makes
Megatron's `finalize_model_grads` all-reduce them over TP, as for the layer norms. So
TP gives the values and gradients of one rank.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any, cast

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from moerl.models.arch import MoEArch
from moerl.models.build import build_model
from moerl.models.precision import RecomputeConfig, ResolvedPrecision
from moerl.parallel.layout import ParallelLayout


class ValueHead(torch.nn.Module):
    """(S_local, B, H) hidden states -> (B, S) values in fp32 (see the module docstring)."""

    def __init__(self, config: TransformerConfig, tp_group: Any, init_std: float = 0.0,
                 seed: int = 0) -> None:
        super().__init__()
        hidden = config.hidden_size
        weight = torch.zeros(1, hidden, dtype=torch.float32)
        if init_std > 0:  # the same numbers on every rank, whatever the layout
            gen = torch.Generator().manual_seed(seed)
            weight = torch.randn(1, hidden, generator=gen) * init_std
        self.weight = torch.nn.Parameter(weight.to(config.params_dtype))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=config.params_dtype))
        self.sequence_parallel = config.sequence_parallel
        self.tp_group = tp_group
        for p in (self.weight, self.bias):
            p.sequence_parallel = self.sequence_parallel  # type: ignore[attr-defined]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        values = hidden.float() @ self.weight.float()[0] + self.bias.float()  # (S_local, B)
        if self.sequence_parallel:
            values = gather_from_sequence_parallel_region(
                values, tensor_parallel_output_grad=False, group=self.tp_group)  # (S, B)
        return values.t().contiguous()  # (B, S)


class ValueModel(GPTModel):
    """`GPTModel` whose last stage returns values (B, S) from a `ValueHead`."""

    def __init__(self, *args: Any, head_init_std: float = 0.0, head_seed: int = 0,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.share_embeddings_and_output_weights or self.config.mtp_num_layers:
            raise ValueError("a value model has no output layer to tie and no MTP head")
        if self.post_process:
            del self.output_layer  # (V/tp, H): replaced by the (1, H) head
            self.value_head = ValueHead(self.config, self.pg_collection.tp, head_init_std,
                                        head_seed)

    def _postprocess(self, hidden_states: torch.Tensor, **_: Any) -> torch.Tensor:
        if not self.post_process:
            return hidden_states
        return self.value_head(hidden_states)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple[Any, ...] = (),
                           metadata: dict[str, Any] | None = None) -> dict[str, Any]:
        # GPTModel's and LanguageModule's versions tie or pad the output layer, which a
        # value model does not have; every module below keeps its own sharding.
        return MegatronModule.sharded_state_dict(self, prefix, sharded_offsets, metadata)


def value_arch(arch: MoEArch) -> MoEArch:
    """`arch` as a value model: untied (no output layer to tie) and without MTP."""
    return dataclasses.replace(arch, untie_embeddings=True, mtp_num_layers=0)


def build_value_model(
    arch: MoEArch,
    layout: ParallelLayout,
    *,
    precision: ResolvedPrecision | None = None,
    recompute: RecomputeConfig | None = None,
    backend: str = "gloo",
    head_init_std: float = 0.0,
    head_seed: int = 0,
) -> list[ValueModel]:
    """One `ValueModel` per virtual pipeline stage of this rank (see `build_model`).

    The critic trains no MoE load-balancing loss (its router's expert bias still
    balances the load), so its coefficient is 0 in its own config."""
    chunks = build_model(
        value_arch(arch), layout, precision=precision, recompute=recompute, backend=backend,
        model_cls=partial(ValueModel, head_init_std=head_init_std, head_seed=head_seed),
        moe_aux_loss_coeff=0.0,
    )
    return cast(list[ValueModel], chunks)
