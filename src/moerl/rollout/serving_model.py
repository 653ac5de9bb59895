"""The trainer's `GPTModel`, run one continuous step at a time over a paged KV cache.

Megatron's static inference context keeps one contiguous cache per batch and feeds every
row the same positions; a continuous step holds tokens of many sequences at their own
positions ([T] flat, `step_plan`). This forward walks the model's own modules in the
order `TransformerLayer` runs them: the embedding, per layer the input norm, attention
(`mla_serving` / `gqa_serving`: the only part written here, because it reads the paged
cache), the residual, the pre-MLP norm, the MLP or MoE layer (Megatron's, with its router
and expert-parallel token dispatch: every rank of an expert-parallel group runs this
forward together), the residual; then the final norm and the output layer on the tokens
whose next token is wanted. Nothing is converted: the parameters are the trainer's.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

from moerl.rollout.gqa_serving import GQAServing
from moerl.rollout.lean_modules import LeanMLP, norm
from moerl.rollout.mla_serving import MLAServing
from moerl.rollout.paged_cache import PagedKVCache
from moerl.rollout.rope_table import RopeTable
from moerl.rollout.serving_moe import ServingMoE
from moerl.rollout.step_plan import StepPlan


class ServingUnavailable(ValueError):
    """A model this forward cannot serve; the message says which backend can."""


def check_servable(model: GPTModel) -> None:
    config = model.config
    why = None
    if not (model.pre_process and model.post_process):
        why = "it is one pipeline stage of several (the static decoder serves pipelines)"
    elif getattr(config, "use_mup", False):
        why = "MuP output scaling is not applied here"
    elif getattr(config, "fp8", None):
        why = "FP8 weights cannot be absorbed here (Megatron's dynamic engine serves them)"
    if why is not None:
        raise ServingUnavailable(f"the continuous backend cannot serve this model: {why}; "
                                 "use --backend static")


class ServingModel:
    """Forward of one step over `cache` (this rank's shard of the model, every layer)."""

    def __init__(self, model: GPTModel, cache: PagedKVCache) -> None:
        check_servable(model)
        config = model.config
        self.model = model
        self.cache = cache
        self.layers: list[Any] = list(model.decoder.layers)
        if len(self.layers) != cache.layers:
            raise ValueError(f"the cache holds {cache.layers} layers, the model {len(self.layers)}")
        positions = model.max_sequence_length
        self.attention: list[MLAServing | GQAServing]
        if config.multi_latent_attention:
            first = self.layers[0].self_attention
            self.rope = RopeTable(first.rotary_pos_emb, positions, mla=True)
            self.attention = [MLAServing(layer.self_attention, self.rope) for layer in self.layers]
        else:
            self.rope = RopeTable(model.rotary_pos_emb, positions, mla=False,
                                  interleaved=config.rotary_interleaved)
            self.attention = [GQAServing(layer.self_attention, self.rope) for layer in self.layers]
        self.mlps = [_serving_mlp(layer.mlp) for layer in self.layers]
        self.dtype = next(model.parameters()).dtype

    def forward(self, plan: StepPlan, logits_at: torch.Tensor) -> torch.Tensor:
        """Run `plan`'s tokens through every layer (writing their cache rows); logits
        [R, vocab] (gathered over tensor-parallel ranks) at token indices `logits_at` [R]."""
        model = self.model
        self.rope.at(plan.positions, self.dtype)
        hidden = model.embedding(input_ids=plan.token_ids[None],
                                 position_ids=plan.positions[None])  # [T, 1, H]
        for number, layer in enumerate(self.layers):
            attention = self.attention[number]
            normed = norm(layer.input_layernorm, hidden)
            hidden = hidden + attention(normed, plan, self.cache.layer(number))  # type: ignore[arg-type]
            hidden = hidden + self.mlps[number](norm(layer.pre_mlp_layernorm, hidden))
        if logits_at.numel() == 0:
            return hidden.new_empty(0, 0)
        hidden = hidden.index_select(0, logits_at)  # [R, 1, H]
        final = model.decoder.final_layernorm
        if final is not None:
            hidden = norm(final, hidden)
        return self._logits(hidden)[:, 0, :]  # [R, V]

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[R, 1, H] -> [R, 1, V], the vocabulary gathered over tensor-parallel ranks."""
        model = self.model
        layer = model.output_layer
        weight = model.shared_embedding_or_output_weight() \
            if model.share_embeddings_and_output_weights else None
        if type(layer) is not ColumnParallelLinear or layer.bias is not None:
            return layer(hidden, weight=weight, runtime_gather_output=True)[0]
        logits = F.linear(hidden, layer.weight if weight is None else weight)
        if layer.tp_group.size() > 1:  # [R, 1, V / TP] -> [R, 1, V]
            logits = gather_from_tensor_model_parallel_region(logits, group=layer.tp_group)
        return logits


def _serving_mlp(mlp: Any) -> Any:
    """The layer's feed-forward as a call [T, 1, H] -> [T, 1, H]."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    return ServingMoE(mlp) if isinstance(mlp, MoELayer) else LeanMLP(mlp)
