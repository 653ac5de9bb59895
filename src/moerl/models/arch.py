"""MoE architectures: one typed description and the presets the project ships.

`MoEArch` describes a DeepSeek-V3-family decoder (multi-latent attention, a few
leading dense layers, then MoE layers with routed + shared experts and a sigmoid
router with expert bias) or a GQA MoE. It says nothing about parallelism: that is
`parallel.layout.ParallelLayout`, combined with an arch only in `models.build`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

AttentionKind = Literal["mla", "gqa"]
RouterScore = Literal["sigmoid", "softmax"]
RopeScaling = Literal["none", "yarn"]


class ArchError(ValueError):
    """An architecture whose fields contradict each other."""


@dataclass(frozen=True)
class MoEArch:
    """A Mixture-of-Experts decoder-only transformer."""

    name: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    vocab_size: int
    max_position_embeddings: int = 4096

    # Attention. MLA (DeepSeek-V2/V3, Kimi-K2) or grouped-query attention.
    attention: AttentionKind = "mla"
    q_lora_rank: int | None = 1536  # None: queries projected directly from the hidden state
    kv_lora_rank: int = 512
    qk_head_dim: int = 128  # the "nope" part of each query/key head
    qk_pos_emb_head_dim: int = 64  # the rotary part, shared by all heads of a token
    v_head_dim: int = 128
    num_query_groups: int | None = None  # GQA only
    kv_channels: int | None = None  # GQA only; defaults to hidden_size / heads
    rotary_base: float = 10000.0
    # RoPE scaling (MLA only). "yarn": YaRN context extension with the parameters of the
    # checkpoint's `rope_scaling` (DeepSeek-V3, Kimi-K2); the yarn_* fields mean what
    # the same keys of that dict mean, and are unused with "none" (plain RoPE).
    rope_scaling: RopeScaling = "none"
    yarn_factor: float = 1.0
    yarn_original_max_position_embeddings: int = 4096
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_mscale: float = 1.0
    yarn_mscale_all_dim: float = 0.0
    latent_norms: bool = False
    """MLA's RMSNorms on the q and kv latents (`qk_layernorm` in Megatron's MLA).
    DeepSeek-V3 family checkpoints have them, and every shipped preset and Hugging Face
    import sets this; False is for architectures without them (the HF export refuses
    those). The parity suite runs them at every layout: its Adam eps of 1e-3
    (tests/distributed/parity_checks.py) keeps the ~1e-8 gradient entries they produce
    from turning fp32 summation order into +-lr in the weights."""

    # Feed-forward. Layers [0, first_k_dense) are dense SwiGLU, the rest MoE.
    ffn_hidden_size: int = 18432  # dense layers
    first_k_dense: int = 3
    num_experts: int = 256
    moe_ffn_hidden_size: int = 2048  # each routed expert
    moe_router_topk: int = 8
    num_shared_experts: int = 1  # shared FFN width = num_shared_experts * moe_ffn_hidden_size

    # Router (DeepSeek-V3 style: sigmoid scores, bias-based load balancing,
    # node/group-limited routing, scaled top-k weights).
    router_score: RouterScore = "sigmoid"
    router_num_groups: int | None = 8
    router_group_topk: int | None = 4
    router_topk_scaling_factor: float = 2.5
    router_expert_bias: bool = True
    aux_loss_coeff: float = 1e-4

    # Multi-token prediction layers (DeepSeek-V3 has one).
    mtp_num_layers: int = 0

    norm_epsilon: float = 1e-6
    untie_embeddings: bool = True

    def __post_init__(self) -> None:
        self.validate()

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.first_k_dense

    @property
    def shared_expert_ffn_hidden_size(self) -> int:
        return self.num_shared_experts * self.moe_ffn_hidden_size

    def is_moe_layer(self, layer_index: int) -> bool:
        """Whether 0-based decoder layer `layer_index` has an MoE feed-forward."""
        return layer_index >= self.first_k_dense

    def moe_layer_pattern(self) -> list[int]:
        """Megatron's `moe_layer_freq` list: 1 for an MoE layer, 0 for a dense one."""
        return [int(self.is_moe_layer(i)) for i in range(self.num_layers)]

    def validate(self) -> None:
        def need(cond: bool, field: str, fix: str) -> None:
            if not cond:
                raise ArchError(f"model.{field}: {fix}")

        for name in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size"):
            need(getattr(self, name) > 0, name, "must be a positive integer")
        need(0 <= self.first_k_dense <= self.num_layers, "first_k_dense",
             f"must be between 0 and num_layers ({self.num_layers})")
        need(self.num_experts >= 1, "num_experts", "must be at least 1")
        need(1 <= self.moe_router_topk <= self.num_experts, "moe_router_topk",
             f"must be between 1 and num_experts ({self.num_experts})")
        if self.router_num_groups is not None:
            groups = self.router_num_groups
            need(self.num_experts % groups == 0, "router_num_groups",
                 f"num_experts ({self.num_experts}) must be divisible by it ({groups})")
            group_topk = self.router_group_topk or groups
            need(1 <= group_topk <= groups, "router_group_topk",
                 f"must be between 1 and router_num_groups ({groups})")
            need(group_topk * (self.num_experts // groups) >= self.moe_router_topk,
                 "router_group_topk",
                 "the selected groups must hold at least moe_router_topk experts")
        if self.attention == "gqa":
            groups = self.num_query_groups or self.num_attention_heads
            need(self.num_attention_heads % groups == 0, "num_query_groups",
                 "num_attention_heads must be divisible by num_query_groups")
            if self.kv_channels is None:
                need(self.hidden_size % self.num_attention_heads == 0, "kv_channels",
                     "set it, or make hidden_size divisible by num_attention_heads")
        need(self.mtp_num_layers >= 0, "mtp_num_layers", "must be >= 0")
        need(self.rope_scaling in ("none", "yarn"), "rope_scaling",
             f"unknown value {self.rope_scaling!r}; choose 'none' (plain RoPE) or 'yarn'")
        if self.rope_scaling == "yarn":
            need(self.attention == "mla", "rope_scaling",
                 "'yarn' is implemented for MLA only; set attention=mla or rope_scaling=none")
            need(self.yarn_factor >= 1.0, "yarn_factor",
                 f"must be >= 1 (got {self.yarn_factor}); 1 is plain RoPE")
            need(self.yarn_original_max_position_embeddings > 0,
                 "yarn_original_max_position_embeddings",
                 "must be positive: the context length before extension")
            for name in ("yarn_beta_fast", "yarn_beta_slow"):
                need(getattr(self, name) > 0, name, "must be positive")
            for name in ("yarn_mscale", "yarn_mscale_all_dim"):
                need(getattr(self, name) >= 0, name, "must be >= 0")

    def replace(self, **changes: object) -> MoEArch:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


# Tiny: every code path of the big presets (MLA with q-LoRA and latent norms, a dense
# first layer, shared expert, sigmoid group-limited routing with expert bias, MTP) at a
# few million parameters, so it trains on CPU in seconds. Four layers divide by
# pipeline x virtual stages = 2 x 2; four experts divide by EP 2 and 4.
# On the demo's rows (single-digit constants) it learns as a standard MoE of its size
# does: none of 20 one-change variants (standard attention, no MTP, softmax router,
# init, learning rates, Adam settings, tied embeddings, rotary base) nor a Hugging
# Face Mixtral of its size class trained by a plain torch loop beats it at 100 steps
# (benchmarks/sft_sample_efficiency.py --task demo). Where answers copy multi-digit
# numbers from the prompt (--task copy), neither it nor a Qwen3-MoE of its size
# passes a held-out prompt after 63 steps of 32 rows, but the Qwen3-MoE starts
# copying sooner: its per-head RMSNorms of queries and keys, which DeepSeek-V3's MLA
# does not have, made the difference on one seed (README, "SFT sample efficiency").
TINY = MoEArch(
    name="tiny",
    latent_norms=True,
    num_layers=4,
    hidden_size=128,
    num_attention_heads=4,
    vocab_size=512,  # 256 bytes + special tokens, padded for tp up to 8
    max_position_embeddings=1024,
    q_lora_rank=64,
    kv_lora_rank=64,
    qk_head_dim=32,
    qk_pos_emb_head_dim=16,
    v_head_dim=32,
    ffn_hidden_size=512,
    first_k_dense=1,
    num_experts=4,
    moe_ffn_hidden_size=256,
    moe_router_topk=2,
    num_shared_experts=1,
    router_num_groups=2,
    router_group_topk=2,
    router_topk_scaling_factor=1.0,
    mtp_num_layers=1,
)

# Moonlight-16B-A3B (Moonshot AI): DeepSeek-V3 architecture, no q-LoRA. Plain RoPE: its
# config.json has no RoPE scaling (Megatron-Bridge's MoonlightModelProvider16B sets
# rotary_scaling_factor 1, the same function).
MOONLIGHT_16B_A3B = MoEArch(
    name="moonlight-16b-a3b",
    latent_norms=True,
    num_layers=27,
    hidden_size=2048,
    num_attention_heads=16,
    vocab_size=163840,
    max_position_embeddings=8192,
    q_lora_rank=None,
    ffn_hidden_size=11264,
    first_k_dense=1,
    num_experts=64,
    moe_ffn_hidden_size=1408,
    moe_router_topk=6,
    num_shared_experts=2,
    router_num_groups=1,
    router_group_topk=1,
    router_topk_scaling_factor=2.446,
    rotary_base=50000.0,
)

DEEPSEEK_V3 = MoEArch(
    name="deepseek-v3",
    latent_norms=True,
    num_layers=61,
    hidden_size=7168,
    num_attention_heads=128,
    vocab_size=129280,
    max_position_embeddings=163840,
    q_lora_rank=1536,
    ffn_hidden_size=18432,
    first_k_dense=3,
    num_experts=256,
    moe_ffn_hidden_size=2048,
    moe_router_topk=8,
    num_shared_experts=1,
    router_num_groups=8,
    router_group_topk=4,
    router_topk_scaling_factor=2.5,
    mtp_num_layers=1,
    # config.json of deepseek-ai/DeepSeek-V3: rope_scaling = {"type": "yarn", "factor": 40,
    # "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
    # "mscale": 1.0, "mscale_all_dim": 1.0}, rope_theta 10000.
    rope_scaling="yarn",
    yarn_factor=40.0,
    yarn_original_max_position_embeddings=4096,
    yarn_beta_fast=32.0,
    yarn_beta_slow=1.0,
    yarn_mscale=1.0,
    yarn_mscale_all_dim=1.0,
)

KIMI_K2 = MoEArch(
    name="kimi-k2",
    latent_norms=True,
    num_layers=61,
    hidden_size=7168,
    num_attention_heads=64,
    vocab_size=163840,
    max_position_embeddings=131072,
    q_lora_rank=1536,
    ffn_hidden_size=18432,
    first_k_dense=1,
    num_experts=384,
    moe_ffn_hidden_size=2048,
    moe_router_topk=8,
    num_shared_experts=1,
    router_num_groups=1,
    router_group_topk=1,
    router_topk_scaling_factor=2.827,
    rotary_base=50000.0,
    mtp_num_layers=0,
    # config.json of moonshotai/Kimi-K2-Instruct: rope_scaling = {"type": "yarn", "factor": 32.0,
    # "original_max_position_embeddings": 4096, "beta_fast": 1.0, "beta_slow": 1.0,
    # "mscale": 1.0, "mscale_all_dim": 1.0}, rope_theta 50000 (Megatron-Bridge's
    # KimiK2Provider carries the same numbers). The 0905 and Thinking releases use factor 64
    # with max_position_embeddings 262144; import those from their config.json.
    rope_scaling="yarn",
    yarn_factor=32.0,
    yarn_original_max_position_embeddings=4096,
    yarn_beta_fast=1.0,
    yarn_beta_slow=1.0,
    yarn_mscale=1.0,
    yarn_mscale_all_dim=1.0,
)

# Kimi-K2 at toy size, for the recipe in miniature (configs/experiment/kimi_k2_mini.yaml):
# its choices (latent norms, one dense first layer, one shared expert, sigmoid routing
# over one group with its scaling factor, no MTP, YaRN over 8x the original context,
# rotary base 50000) at tiny's widths, with eight experts (two per rank at EP 4) and
# four layers (two per stage at PP 2).
KIMI_K2_MINI = dataclasses.replace(
    KIMI_K2,
    name="kimi-k2-mini",
    num_layers=4,
    hidden_size=128,
    num_attention_heads=4,
    vocab_size=512,  # 256 bytes + special tokens, as tiny's
    max_position_embeddings=4096,
    q_lora_rank=64,
    kv_lora_rank=64,
    qk_head_dim=32,
    qk_pos_emb_head_dim=16,
    v_head_dim=32,
    ffn_hidden_size=512,
    num_experts=8,
    moe_ffn_hidden_size=128,
    moe_router_topk=2,
    yarn_factor=8.0,
    yarn_original_max_position_embeddings=512,
)

PRESETS: dict[str, MoEArch] = {
    arch.name: arch for arch in (TINY, MOONLIGHT_16B_A3B, DEEPSEEK_V3, KIMI_K2, KIMI_K2_MINI)
}


def get_preset(name: str) -> MoEArch:
    """The preset called `name`, or an error listing the ones that exist."""
    try:
        return PRESETS[name]
    except KeyError:
        known = ", ".join(sorted(PRESETS))
        raise ArchError(f"model: unknown preset {name!r}; choose one of: {known}") from None
