"""Activation bytes per layer and micro-batch, Korthikanti et al. style, for MLA and MoE.

Korthikanti et al. (2022) count the tensors autograd saves per token of one layer
(34 h bytes for a GPT layer with sequence parallelism, flash attention dropping
the 5as/h score term) and divide by tp. The same accounting here, in bf16 elements
per token of the rank (T = s * b / cp tokens; sequence-parallel regions hold T / tp):

MLA attention block
    sequence-parallel:  norm input h, norm output h, q latent + its norm 2*q_lora,
                        kv latent + rotary key (kv_lora + rope), its norm kv_lora
    per head (/tp):     Q and K: heads * (qk + rope) each, V and O: heads * v,
                        softmax statistics 2 * heads (fp32)
Dense SwiGLU FFN       norm in/out 2h (sequence-parallel); fc1 out 2F + act out F (/tp)
MoE FFN                norm in/out 2h and router logits + scores 4E (fp32), sequence-
                       parallel; shared expert 3 Fs (/tp); each token's k routed copies:
                       fc1 input etp*h, fc1 out 2 Fe, act out Fe, expert output h
                       (saved to weight by the router probability), times the capacity
                       factor when one is set.

Recompute:
    none       everything above
    selective  Megatron's recompute modules `layernorm`, `mla_up_proj`, `moe_act`:
               norm outputs, Q/K/V and the routed act output are rebuilt in backward
    full       only each layer's input (h per sequence-parallel token) is kept; one
               layer's complete set is alive while it is recomputed (`working` below)
"""

from __future__ import annotations

from typing import Literal

from moerl.models.arch import MoEArch
from moerl.parallel.layout import ParallelLayout

Recompute = Literal["none", "selective", "full"]
BF16 = 2


def tokens_per_rank(layout: ParallelLayout, seq_length: int, micro_batch_size: int) -> float:
    """Tokens of one micro-batch in a rank's sequence-parallel region: s*b/(cp*tp_sp)."""
    sp = layout.tp if layout.resolved_sequence_parallel() else 1
    return seq_length * micro_batch_size / (layout.cp * sp)


def _attention_elements(arch: MoEArch, tp: int, sp: int, recompute: Recompute) -> float:
    """Saved elements per (cp-local) token of one attention block."""
    h, heads = arch.hidden_size, arch.num_attention_heads
    selective = recompute == "selective"
    norm_out = 0 if selective else h
    if arch.attention == "mla":
        q_lat = arch.q_lora_rank or 0
        latents = 2 * q_lat + (arch.kv_lora_rank + arch.qk_pos_emb_head_dim) + arch.kv_lora_rank
        if selective:  # normed latents feed the up-projections, rebuilt in backward
            latents -= q_lat + arch.kv_lora_rank
        qk = heads * (arch.qk_head_dim + arch.qk_pos_emb_head_dim)
        qkv = 0 if selective else 2 * qk + heads * arch.v_head_dim
        per_head = qkv + heads * arch.v_head_dim + 2 * heads
        return (h + norm_out + latents) / sp + per_head / tp
    kv_channels = arch.kv_channels or h // heads
    groups = arch.num_query_groups or heads
    qkv = kv_channels * (heads + 2 * groups)
    return (h + norm_out) / sp + (qkv + heads * kv_channels + 2 * heads) / tp


def _ffn_elements(
    arch: MoEArch, layout: ParallelLayout, layer: int, capacity: float, recompute: Recompute
) -> float:
    """Saved elements per (cp-local) token of one dense or MoE feed-forward block."""
    h, tp = arch.hidden_size, layout.tp
    sp = tp if layout.resolved_sequence_parallel() else 1
    selective = recompute == "selective"
    norms = h + (0 if selective else h)
    if not arch.is_moe_layer(layer):
        return norms / sp + 3 * arch.ffn_hidden_size / tp
    router = 4 * arch.num_experts  # fp32 logits and scores, in bf16 elements
    shared = 3 * arch.shared_expert_ffn_hidden_size / tp
    fe = arch.moe_ffn_hidden_size
    act = 0 if selective else fe
    routed = arch.moe_router_topk * capacity * (layout.etp * h + 2 * fe + act + h)
    return (norms + router + routed) / sp + shared


def layer_activation_bytes(
    arch: MoEArch,
    layout: ParallelLayout,
    seq_length: int,
    micro_batch_size: int,
    capacity_factor: float | None,
    layer: int,
    recompute: Recompute,
) -> tuple[float, float]:
    """(bytes kept per micro-batch until backward, bytes alive while recomputing).

    The second value is the layer's full activation set (no recompute), which full
    recompute rebuilds one layer at a time.
    """
    tokens = seq_length * micro_batch_size / layout.cp
    tp = layout.tp
    sp = tp if layout.resolved_sequence_parallel() else 1
    capacity = capacity_factor or 1.0  # dropless: balanced routing on average

    def elements(mode: Recompute) -> float:
        return _attention_elements(arch, tp, sp, mode) + _ffn_elements(
            arch, layout, layer, capacity, mode
        )

    whole = elements("none") * tokens * BF16
    if recompute == "full":
        return arch.hidden_size / sp * tokens * BF16, whole
    return elements(recompute) * tokens * BF16, whole


def logits_bytes(
    arch: MoEArch, layout: ParallelLayout, seq_length: int, micro_batch_size: int
) -> float:
    """Output logits of one micro-batch on the last stage: bf16 plus the fp32 softmax.

    s*b/cp tokens * vocab/tp * (2 + 4) bytes, once per MTP depth as well.
    """
    tokens = seq_length * micro_batch_size / layout.cp
    return tokens * arch.vocab_size / layout.tp * 6.0 * (1 + arch.mtp_num_layers)
