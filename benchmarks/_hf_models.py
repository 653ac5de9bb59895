"""The transformers models of benchmarks/learning_vs_trl.py, derived from moerl's `MoEArch`,
and moerl's byte tokenizer for them.

- DeepSeek-V3 (`DeepseekV3ForCausalLM`): the config is `models.hf_mapping.hf_config_from_arch`
  of the arch moerl trains, so a change of the preset (dimensions, latent norms, experts)
  reaches this side by itself. Its weights come from moerl's initial ones
  (benchmarks/_shared_init.py writes both).
- Qwen3-MoE (`Qwen3MoeForCausalLM`): what a TRL user picks at this size, with the arch's
  depth, width, heads, vocabulary, dense first layers, routed experts and top-k, and no
  shared expert; its routed experts' width is solved so that the parameter count is the
  DeepSeek-V3 side's (the closest multiple of 8). Its own initial weights.

Not a benchmark (the leading underscore keeps it out of the smoke test's list).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import (
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizer,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from moerl.data.tokenizer import ByteTokenizer
from moerl.models.arch import MoEArch
from moerl.models.hf_mapping import hf_config_from_arch

MODELS = ("deepseek_v3", "qwen3_moe")
ALIGN = 8  # the routed experts' width is a multiple of this


class BytesTokenizer(PreTrainedTokenizer):
    """moerl's ByteTokenizer for transformers: UTF-8 bytes are ids 0..255, then BOS, EOS
    and PAD at moerl's ids; a text is encoded as [BOS] bytes, like moerl's prompts."""

    model_input_names = ["input_ids", "attention_mask"]  # noqa: RUF012 (the base's type)

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                         special_tokens_pattern="bos", **kwargs)
        byte = ByteTokenizer()
        assert (self.bos_token_id, self.eos_token_id, self.pad_token_id) == (
            byte.bos_id, byte.eos_id, byte.pad_id), "special ids differ from moerl's"

    @property
    def vocab_size(self) -> int:
        return 256

    def get_vocab(self) -> dict[str, int]:
        return {**{chr(i): i for i in range(256)}, **self.added_tokens_encoder}

    def _tokenize(self, text: str, **kwargs: Any) -> list[str]:
        return [chr(b) for b in text.encode("utf-8")]

    def _convert_token_to_id(self, token: str) -> int:
        return ord(token)

    def _convert_id_to_token(self, index: int) -> str:
        return chr(index) if index < 256 else ""

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        return bytes(ord(t) for t in tokens if len(t) == 1).decode("utf-8", errors="replace")


def token_ids() -> dict[str, int]:
    """The special ids a config.json carries (moerl's byte tokenizer's)."""
    byte = ByteTokenizer()
    return {"bos_token_id": byte.bos_id, "eos_token_id": byte.eos_id,
            "pad_token_id": byte.pad_id}


def deepseek_config(arch: MoEArch) -> DeepseekV3Config:
    """transformers' DeepSeek-V3 config of `arch` (MLA: it always has the latent norms)."""
    config = hf_config_from_arch(arch, token_ids())
    for key in ("architectures", "model_type"):
        config.pop(key)
    return DeepseekV3Config(**config)


def _qwen3_config(arch: MoEArch, moe_width: int) -> Qwen3MoeConfig:
    heads = arch.num_attention_heads
    return Qwen3MoeConfig(
        vocab_size=arch.vocab_size, hidden_size=arch.hidden_size,
        num_hidden_layers=arch.num_layers, num_attention_heads=heads,
        num_key_value_heads=arch.num_query_groups or heads,
        head_dim=arch.kv_channels or arch.hidden_size // heads,
        max_position_embeddings=arch.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": arch.rotary_base},
        rms_norm_eps=arch.norm_epsilon, tie_word_embeddings=not arch.untie_embeddings,
        intermediate_size=arch.ffn_hidden_size, mlp_only_layers=list(range(arch.first_k_dense)),
        num_experts=arch.num_experts, num_experts_per_tok=arch.moe_router_topk,
        moe_intermediate_size=moe_width, norm_topk_prob=True, decoder_sparse_step=1,
        output_router_logits=False, router_aux_loss_coef=0.0, **token_ids())


def count(config: Any, cls: type[PreTrainedModel]) -> int:
    """Parameters of the model `config` describes, built on the meta device (no memory)."""
    with torch.device("meta"):
        return sum(p.numel() for p in cls(config).parameters())


def qwen3_config(arch: MoEArch, params: int) -> Qwen3MoeConfig:
    """A Qwen3-MoE of `arch`'s shape whose parameter count is closest to `params`: the
    count is linear in the routed experts' width, so two counts give the width."""
    one, two = (count(_qwen3_config(arch, w), Qwen3MoeForCausalLM) for w in (1, 2))
    width = (params - one) / (two - one) + 1
    # A multiple of 8: transformers' grouped expert GEMM needs 16-byte-aligned strides.
    return _qwen3_config(arch, max(ALIGN, ALIGN * round(width / ALIGN)))


def build(kind: str, arch: MoEArch) -> PreTrainedModel:
    """A freshly initialised model of `kind` (torch's global RNG draws its weights)."""
    if kind == "deepseek_v3":
        return DeepseekV3ForCausalLM(deepseek_config(arch))
    if kind == "qwen3_moe":
        params = count(deepseek_config(arch), DeepseekV3ForCausalLM)
        return Qwen3MoeForCausalLM(qwen3_config(arch, params))
    raise ValueError(f"model {kind!r}: choose one of {', '.join(MODELS)}")
