"""Activation bytes per layer and micro-batch, Korthikanti et al. style, for MLA and MoE.

Korthikanti et al. (2022) count the tensors autograd saves per token of one layer
(34 h bytes for a GPT layer with sequence parallelism, flash attention dropping
the 5as/h score term) and divide by tp. The same accounting here, in activation elements
per token of the rank (T = s * b / cp tokens; sequence-parallel regions hold T / tp):

MLA attention block
    sequence-parallel:  norm input h, norm output h, q latent + its norm 2*q_lora,
                        kv latent + rotary key (kv_lora + rope), its norm kv_lora
    per head (/tp):     Q and K: heads * (qk + rope) each, V and O: heads * v,
                        softmax statistics heads (fp32, see below)
Dense SwiGLU FFN       norm in/out 2h (sequence-parallel); fc1 out 2F + act out F (/tp)
MoE FFN                norm in/out 2h and router logits + scores 2E (fp32), sequence-
                       parallel; shared expert 3 Fs (/tp); each token's k routed copies:
                       fc1 input etp*h, fc1 out 2 Fe, act out Fe, expert output h
                       (saved to weight by the router probability), times the capacity
                       factor when one is set.

Layer spec: with TE, attention is flash attention (the log-sum-exp, one fp32 value per
head, is kept). Megatron's local spec (CPU) runs unfused kernels that keep more, as
measured (tests/distributed/test_memory_measured.py): its `DotProductAttention` keeps
the softmax output, heads/tp * s fp32 values per token (plus a copy in the activation
dtype when that is narrower; with cp > 1 ring attention replaces it and keeps the
log-sum-exp); each torch RMSNorm keeps its normalised input as well (+1 element per
normalised element, latent norms included); each unfused SwiGLU keeps the gate's
activation and a copy of the other half as well (+2F per token and FFN).

Element width: 2 bytes (bf16 training, also with fp8 GEMMs) or 4 (fp32 runs on CPU);
router scores, softmax statistics and probabilities are fp32 whatever the width.

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
LayerSpec = Literal["te", "local"]
BF16 = 2
FP32 = 4


def tokens_per_rank(layout: ParallelLayout, seq_length: int, micro_batch_size: int) -> float:
    """Tokens of one micro-batch in a rank's sequence-parallel region: s*b/(cp*tp_sp)."""
    sp = layout.tp if layout.resolved_sequence_parallel() else 1
    return seq_length * micro_batch_size / (layout.cp * sp)


def _attention_bytes(
    arch: MoEArch, tp: int, sp: int, recompute: Recompute, width: int,
    spec: LayerSpec, kv_tokens: float,
) -> float:
    """Saved bytes per (cp-local) token of one attention block."""
    h, heads = arch.hidden_size, arch.num_attention_heads
    selective = recompute == "selective"
    local = spec == "local"
    norm_out = (0 if selective else h) + (h if local else 0)
    if not local or kv_tokens == 0:  # flash or ring attention: log-sum-exp per head
        softmax = heads / tp * FP32
    else:  # probabilities over every key, fp32, and a copy for the value matmul
        softmax = heads / tp * kv_tokens * (FP32 + (width if width < FP32 else 0))
    if arch.attention == "mla":
        q_lat = arch.q_lora_rank or 0
        latents = 2 * q_lat + (arch.kv_lora_rank + arch.qk_pos_emb_head_dim) + arch.kv_lora_rank
        if selective:  # normed latents feed the up-projections, rebuilt in backward
            latents -= q_lat + arch.kv_lora_rank
        if local:  # the torch norms of the two latents
            latents += q_lat + arch.kv_lora_rank
        qk = heads * (arch.qk_head_dim + arch.qk_pos_emb_head_dim)
        qkv = 0 if selective else 2 * qk + heads * arch.v_head_dim
        per_head = qkv + heads * arch.v_head_dim
        return ((h + norm_out + latents) / sp + per_head / tp) * width + softmax
    kv_channels = arch.kv_channels or h // heads
    groups = arch.num_query_groups or heads
    qkv = kv_channels * (heads + 2 * groups)
    return ((h + norm_out) / sp + (qkv + heads * kv_channels) / tp) * width + softmax


def _ffn_bytes(
    arch: MoEArch, layout: ParallelLayout, layer: int, capacity: float, recompute: Recompute,
    width: int, spec: LayerSpec,
) -> float:
    """Saved bytes per (cp-local) token of one dense or MoE feed-forward block."""
    h, tp = arch.hidden_size, layout.tp
    sp = tp if layout.resolved_sequence_parallel() else 1
    selective = recompute == "selective"
    local = spec == "local"
    norms = h + (0 if selective else h) + (h if local else 0)
    swiglu = 5 if local else 3  # saved multiples of F: fc1 out 2F + act out F (+2F local)
    if not arch.is_moe_layer(layer):
        return (norms / sp + swiglu * arch.ffn_hidden_size / tp) * width
    router = 2 * arch.num_experts * FP32  # logits and scores, fp32
    shared = swiglu * arch.shared_expert_ffn_hidden_size / tp
    fe = arch.moe_ffn_hidden_size
    act = (0 if selective else fe) + (2 * fe if local else 0)
    routed = arch.moe_router_topk * capacity * (layout.etp * h + 2 * fe + act + h)
    return ((norms + routed) / sp + shared) * width + router / sp


def layer_activation_bytes(
    arch: MoEArch,
    layout: ParallelLayout,
    seq_length: int,
    micro_batch_size: int,
    capacity_factor: float | None,
    layer: int,
    recompute: Recompute,
    *,
    width: int = BF16,
    spec: LayerSpec = "te",
) -> tuple[float, float]:
    """(bytes kept per micro-batch until backward, bytes alive while recomputing).

    The second value is the layer's full activation set (no recompute), which full
    recompute rebuilds one layer at a time.
    """
    tokens = seq_length * micro_batch_size / layout.cp
    tp = layout.tp
    sp = tp if layout.resolved_sequence_parallel() else 1
    capacity = capacity_factor or 1.0  # dropless: balanced routing on average
    # Keys whose probabilities the unfused local attention keeps; 0 under ring attention.
    kv_tokens = seq_length if layout.cp == 1 else 0

    def per_token(mode: Recompute) -> float:
        return _attention_bytes(arch, tp, sp, mode, width, spec, kv_tokens) + _ffn_bytes(
            arch, layout, layer, capacity, mode, width, spec
        )

    whole = per_token("none") * tokens
    if recompute == "full":
        return arch.hidden_size / sp * tokens * width, whole
    return per_token(recompute) * tokens, whole


def head_bytes(
    arch: MoEArch, layout: ParallelLayout, seq_length: int, micro_batch_size: int,
    width: int = BF16, spec: LayerSpec = "te",
) -> float:
    """The last stage's final norm (input and output, the output head's input) and, per
    MTP depth, its extra norms (2 x input and output) and the 2h -> h projection's
    input: (2 + 6 * mtp) h per sequence-parallel token, and h more per norm with the
    local spec's torch norms. The MTP decoder layers themselves are counted as layers."""
    sp = layout.tp if layout.resolved_sequence_parallel() else 1
    tokens = seq_length * micro_batch_size / (layout.cp * sp)
    norms = 1 + 3 * arch.mtp_num_layers
    per_token = 2 + 6 * arch.mtp_num_layers + (norms if spec == "local" else 0)
    return tokens * arch.hidden_size * per_token * width


def logits_bytes(
    arch: MoEArch, layout: ParallelLayout, seq_length: int, micro_batch_size: int,
    width: int = BF16,
) -> float:
    """Output logits of one micro-batch on the last stage and their fp32 softmax.

    s*b/cp tokens * vocab/tp * (width + 4) bytes, once per MTP depth as well; fp32
    logits are turned into the softmax in place (4 bytes, not 8).
    """
    tokens = seq_length * micro_batch_size / layout.cp
    per_value = FP32 if width >= FP32 else width + FP32
    return tokens * arch.vocab_size / layout.tp * per_value * (1 + arch.mtp_num_layers)
