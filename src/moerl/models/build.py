"""`MoEArch` + `ParallelLayout` -> Megatron `TransformerConfig`, layer specs, `GPTModel`s.

The run's `precision` and `recompute` groups (`models.precision`) decide the layer
spec (Transformer Engine or local), the dtype, FP8, recompute and offloading; the
local spec gets every flag a CPU run needs. The model
code never decides parallelism: it reads the layout it is given, and the process
groups must already exist (`parallel.groups.init_parallel`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from megatron.core import parallel_state as ps
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_mtp_block_spec,
)
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

from moerl.models import packed_mtp
from moerl.models.arch import MoEArch
from moerl.models.features import te_available
from moerl.models.mla_local import MLADotProductAttention, TPExactMLASelfAttention
from moerl.models.precision import RecomputeConfig, ResolvedPrecision, local_fp32
from moerl.models.ring_attention import ring_attention_spec_patch
from moerl.models.routers import count_only_real_tokens
from moerl.parallel.layout import ParallelLayout


class BuildError(ValueError):
    """A model that cannot be built here; the message names the feature and why."""


def build_transformer_config(
    arch: MoEArch,
    layout: ParallelLayout,
    *,
    precision: ResolvedPrecision | None = None,
    recompute: RecomputeConfig | None = None,
    backend: str = "gloo",
    **overrides: Any,
) -> TransformerConfig:
    """The Megatron config for `arch` split by `layout`.

    `precision`: the run's, resolved for this machine (`PrecisionConfig.resolve`);
    None: the local spec in fp32, as on CPU. `overrides` are passed to the config
    last, for experiments.
    """
    precision = precision or local_fp32()
    recompute = recompute or RecomputeConfig()
    if precision.te and not te_available():
        raise BuildError("precision.transformer_impl: the Transformer Engine spec needs "
                         "transformer_engine on a GPU; set precision.transformer_impl=local")
    try:
        recompute.check(precision.config, te=precision.te)
    except ValueError as err:
        raise BuildError(str(err)) from err
    if (recompute.granularity == "selective" and "mla_up_proj" in recompute.modules
            and arch.attention != "mla"):
        raise BuildError(f"recompute.modules: mla_up_proj needs multi-latent attention, and "
                         f"model {arch.name!r} has {arch.attention!r}; remove it")
    te, bf16 = precision.te, precision.bf16
    cuda = torch.cuda.is_available()
    kwargs: dict[str, Any] = dict(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_attention_heads,
        ffn_hidden_size=arch.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=arch.norm_epsilon,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,  # expert biases break an in-place op on the local path
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=0.02,
        # Loss = sum over tokens / tokens in the global batch (see trainer.step).
        calculate_per_token_loss=True,
        # Parallelism.
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
        sequence_parallel=layout.resolved_sequence_parallel(),
        batch_p2p_comm=layout.resolved_batch_p2p_comm(backend),
        # Precision and device.
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        pipeline_dtype=torch.bfloat16 if bf16 else torch.float32,
        use_cpu_initialization=not cuda,
        perform_initialization=True,
        # Fused kernels exist only for CUDA (and some only with TE).
        bias_dropout_fusion=cuda,
        masked_softmax_fusion=cuda,
        persist_layer_norm=te,
        # Megatron's fused MLA RoPE is YaRN-only, training-only and experimental.
        apply_rope_fusion=te and arch.attention != "mla",
        bias_activation_fusion=cuda,
        gradient_accumulation_fusion=te,
        moe_permute_fusion=te,
        cross_entropy_loss_fusion=cuda,
    )
    kwargs.update(_moe_kwargs(arch, layout, te))
    if layout.stage_layers is not None:
        kwargs["pipeline_model_parallel_layout"] = pipeline_layer_layout(arch, layout)
    if arch.mtp_num_layers:
        kwargs.update(mtp_num_layers=arch.mtp_num_layers, mtp_loss_scaling_factor=0.1)
    kwargs.update(precision.transformer_kwargs())
    kwargs.update(recompute.transformer_kwargs())
    if arch.attention == "mla":
        kwargs["qk_layernorm"] = arch.latent_norms  # see MoEArch.latent_norms
    kwargs.update(overrides)
    if arch.attention == "mla":
        return MLATransformerConfig(
            **kwargs,
            q_lora_rank=arch.q_lora_rank,
            kv_lora_rank=arch.kv_lora_rank,
            qk_head_dim=arch.qk_head_dim,
            qk_pos_emb_head_dim=arch.qk_pos_emb_head_dim,
            v_head_dim=arch.v_head_dim,
            rotary_base=arch.rotary_base,
            **_rope_kwargs(arch),
        )
    return TransformerConfig(
        **kwargs,
        num_query_groups=arch.num_query_groups,
        kv_channels=arch.kv_channels,
    )


def _yarn_get_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _rope_kwargs(arch: MoEArch) -> dict[str, Any]:
    """MLA's RoPE: plain, or YaRN with the checkpoint's `rope_scaling` (see `MoEArch`).

    The YaRN mscales. DeepSeek-V3 (and transformers' `DeepseekV3Attention`) apply two
    factors, with m(s) = 0.1 * s * ln(factor) + 1 (1 when factor <= 1):
    - the softmax scale is multiplied by m(mscale_all_dim)^2 (by 1 when mscale_all_dim
      is 0); Megatron's MLA multiplies it by m(mscale_all_dim)^2 too, the same number;
    - cos and sin are multiplied by an "attention factor": transformers' YaRN uses
      m(mscale) / m(mscale_all_dim) when both are non-zero, else m(1) = 0.1 ln(factor) + 1.
      Megatron always uses m(mscale') / m(mscale_all_dim) for the mscale' it is given.
    So Megatron gets the checkpoint's mscale_all_dim, and an mscale' with
    m(mscale') = attention factor * m(mscale_all_dim): the checkpoint's own mscale when
    both are non-zero (DeepSeek-V3, Kimi-K2: 1.0 and 1.0), 1 when mscale_all_dim is 0,
    and otherwise solved for.
    """
    if arch.rope_scaling != "yarn":
        # Megatron scales the softmax by m(mscale_all_dim)^2 whatever the rope type;
        # mscale_all_dim 0 makes that 1.
        return dict(rope_type="rope", mscale_all_dim=0.0)
    factor, mscale, all_dim = arch.yarn_factor, arch.yarn_mscale, arch.yarn_mscale_all_dim
    megatron_mscale = mscale  # both non-zero, or factor <= 1 (every m is 1)
    if not (mscale and all_dim) and factor > 1:
        # m(mscale') = m(1) * m(mscale_all_dim)
        target = _yarn_get_mscale(factor, 1.0) * _yarn_get_mscale(factor, all_dim)
        megatron_mscale = (target - 1.0) / (0.1 * math.log(factor))
    return dict(
        rope_type="yarn",
        rotary_scaling_factor=factor,
        original_max_position_embeddings=arch.yarn_original_max_position_embeddings,
        beta_fast=arch.yarn_beta_fast,
        beta_slow=arch.yarn_beta_slow,
        mscale=megatron_mscale,
        mscale_all_dim=all_dim,
    )


def pipeline_layer_layout(arch: MoEArch, layout: ParallelLayout) -> list[list[str]]:
    """Megatron's per-chunk layer list for an explicit (uneven) split.

    Chunk j (model order; it runs on pipeline rank j % pp) holds `stage_layers[j]`
    decoder layers; the first also holds the embedding, the last the MTP layers and
    the loss.
    """
    split = layout.layers_per_chunk(arch.num_layers)
    chunks: list[list[str]] = [["decoder"] * n for n in split]
    chunks[0].insert(0, "embedding")
    chunks[-1] += ["mtp"] * arch.mtp_num_layers + ["loss"]
    return chunks


def _moe_kwargs(arch: MoEArch, layout: ParallelLayout, te: bool) -> dict[str, Any]:
    """DeepSeek-V3 style MoE: sigmoid router with expert bias, group-limited top-k."""
    return dict(
        num_moe_experts=arch.num_experts,
        moe_layer_freq=arch.moe_layer_pattern(),
        moe_ffn_hidden_size=arch.moe_ffn_hidden_size,
        moe_shared_expert_intermediate_size=arch.shared_expert_ffn_hidden_size or None,
        moe_router_topk=arch.moe_router_topk,
        moe_router_score_function=arch.router_score,
        moe_router_enable_expert_bias=arch.router_expert_bias,
        moe_router_num_groups=arch.router_num_groups,
        moe_router_group_topk=arch.router_group_topk,
        moe_router_topk_scaling_factor=arch.router_topk_scaling_factor,
        moe_router_pre_softmax=arch.router_score == "softmax",
        moe_router_dtype="fp32",
        # Sequence-wise balance loss as in DeepSeek-V3 (the bias does the main balancing).
        moe_router_load_balancing_type="seq_aux_loss",
        moe_aux_loss_coeff=arch.aux_loss_coeff,
        moe_token_dispatcher_type="alltoall",
        # TE: the experts as one grouped GEMM (TEGroupedMLP), which `moe_act` recompute
        # needs; the local spec would silently build SequentialMLP anyway.
        moe_grouped_gemm=te,
    )


def build_layer_spec(
    config: TransformerConfig, *, te: bool, vp_stage: int | None = None,
    packed_rows: bool = False,
) -> tuple[TransformerBlockSubmodules, ModuleSpec | None]:
    """Decoder block spec for this pipeline stage and the MTP block spec (or None).

    Dense layers where `moe_layer_freq` has 0, MoE elsewhere. The local spec gets
    the two MLA fixes of `models.mla_local`, and the ring attention under context
    parallelism or for `packed_rows` (rows of several documents: Megatron's local
    attention takes no document boundaries; the ring is exact at CP = 1).
    """
    block = get_gpt_decoder_block_spec(
        config, use_transformer_engine=te, normalization="RMSNorm", vp_stage=vp_stage
    )
    if not te and config.multi_latent_attention:
        for layer in block.layer_specs:
            _patch_local_mla(layer)
    if not te and (config.context_parallel_size > 1 or packed_rows):
        # Without TE's attention, context parallelism and packed rows run on the
        # project's ring attention (the MTP layer reuses the last layer's spec).
        ring_attention_spec_patch(block)
    mtp = None
    if config.mtp_num_layers:
        mtp = get_gpt_mtp_block_spec(config, block, use_transformer_engine=te, vp_stage=vp_stage)
    return block, mtp


def _patch_local_mla(layer: ModuleSpec) -> None:
    attention = layer.submodules.self_attention
    attention.module = TPExactMLASelfAttention
    attention.submodules.core_attention = MLADotProductAttention


def build_model(
    arch: MoEArch,
    layout: ParallelLayout,
    *,
    precision: ResolvedPrecision | None = None,
    recompute: RecomputeConfig | None = None,
    backend: str = "gloo",
    packed_rows: bool = False,
    model_cls: Callable[..., GPTModel] = GPTModel,
    **overrides: Any,
) -> list[GPTModel]:
    """One `GPTModel` per virtual pipeline stage held by this rank (1 without vpp).

    `packed_rows`: batches will carry document boundaries (`Batch.cu_seqlens`).
    `model_cls`: GPTModel or a subclass taking its arguments (models.value.ValueModel).
    """
    precision = precision or local_fp32()
    te = precision.te
    if packed_rows and te:
        raise ValueError(
            "packed rows (sft.pack=true) run on the local spec's ring attention; with "
            "Transformer Engine they would need THD batches, which are not built yet: "
            "set sft.pack=false"
        )
    config = build_transformer_config(
        arch, layout, precision=precision, recompute=recompute, backend=backend, **overrides
    )
    if packed_rows and arch.mtp_num_layers:
        packed_mtp.install()
    count_only_real_tokens()
    chunks = []
    for vp in range(layout.virtual_stages):
        vp_stage = vp if layout.vpp else None
        block, mtp = build_layer_spec(config, te=te, vp_stage=vp_stage, packed_rows=packed_rows)
        model = model_cls(
            config=config,
            transformer_layer_spec=block,
            vocab_size=arch.vocab_size,
            max_sequence_length=arch.max_position_embeddings,
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            parallel_output=True,
            share_embeddings_and_output_weights=not arch.untie_embeddings,
            position_embedding_type="rope",
            rotary_base=int(arch.rotary_base),
            mtp_block_spec=mtp,
            vp_stage=vp_stage,
        )
        if torch.cuda.is_available():
            model.cuda(torch.cuda.current_device())
        chunks.append(model)
    return chunks
