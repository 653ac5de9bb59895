"""Parameter counts and training FLOPs per token for an `MoEArch`.

FLOPs follow Megatron-LM's `num_floating_point_operations` (megatron/training/
training.py): every GEMM is counted three times (forward, weight-grad, data-grad)
at 2 FLOPs per multiply-add; causal attention costs half the full score matrix.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from moerl.models.arch import MoEArch

# Megatron counts only half of the causal score matrix.
_CAUSAL_ATTENTION_RATIO = 0.5


@dataclass(frozen=True)
class ModelCounts:
    total_params: int
    active_params: int
    train_flops_per_token: float
    mtp_params: int

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def attention_params(arch: MoEArch) -> int:
    """Weights of one self-attention block, its input norm included."""
    h, heads = arch.hidden_size, arch.num_attention_heads
    if arch.attention == "mla":
        qk = arch.qk_head_dim + arch.qk_pos_emb_head_dim
        if arch.q_lora_rank is None:
            q = h * heads * qk
        else:  # down-projection, its norm, up-projection
            q = h * arch.q_lora_rank + arch.q_lora_rank + arch.q_lora_rank * heads * qk
        # down-projection to the latent plus the shared rotary key, norm, up-projection
        kv = (
            h * (arch.kv_lora_rank + arch.qk_pos_emb_head_dim)
            + arch.kv_lora_rank
            + arch.kv_lora_rank * heads * (arch.qk_head_dim + arch.v_head_dim)
        )
        out = heads * arch.v_head_dim * h
        return q + kv + out + h
    kv_channels = arch.kv_channels or h // heads
    groups = arch.num_query_groups or heads
    return h * kv_channels * (heads + 2 * groups) + heads * kv_channels * h + h


def dense_mlp_params(arch: MoEArch) -> int:
    """SwiGLU dense feed-forward (gate, up, down) plus its pre-norm."""
    return 3 * arch.hidden_size * arch.ffn_hidden_size + arch.hidden_size


def moe_params(arch: MoEArch, experts: int) -> int:
    """An MoE feed-forward with `experts` routed experts counted, plus router, shared, norm."""
    h = arch.hidden_size
    routed = experts * 3 * h * arch.moe_ffn_hidden_size
    shared = 3 * h * arch.shared_expert_ffn_hidden_size
    router = h * arch.num_experts
    return routed + shared + router + h


def _decoder_params(arch: MoEArch, experts: int) -> int:
    per_attention = attention_params(arch)
    dense = arch.first_k_dense * (per_attention + dense_mlp_params(arch))
    moe = arch.num_moe_layers * (per_attention + moe_params(arch, experts))
    return dense + moe


def _mtp_params(arch: MoEArch, experts: int) -> int:
    """One MTP module: two norms, the 2h->h projection, one decoder layer, a final norm.

    It shares the embedding and output head with the main model.
    """
    h = arch.hidden_size
    last_is_moe = arch.is_moe_layer(arch.num_layers - 1)
    ffn = moe_params(arch, experts) if last_is_moe else dense_mlp_params(arch)
    layer = attention_params(arch) + ffn
    return arch.mtp_num_layers * (2 * h + 2 * h * h + layer + h)


def embedding_params(arch: MoEArch) -> int:
    tables = 2 if arch.untie_embeddings else 1
    return tables * arch.vocab_size * arch.hidden_size + arch.hidden_size  # + final norm


def count_params(arch: MoEArch, include_mtp: bool = False) -> tuple[int, int]:
    """(total, active) parameters; active counts top-k routed experts per token."""
    total = _decoder_params(arch, arch.num_experts) + embedding_params(arch)
    active = _decoder_params(arch, arch.moe_router_topk) + embedding_params(arch)
    if include_mtp:
        total += _mtp_params(arch, arch.num_experts)
        active += _mtp_params(arch, arch.moe_router_topk)
    return total, active


def _attention_flops_per_layer(arch: MoEArch, seq_length: int) -> float:
    """Multiply-adds per token of one attention block (before the x6 for fwd+bwd)."""
    h, heads = arch.hidden_size, arch.num_attention_heads
    ratio = _CAUSAL_ATTENTION_RATIO
    if arch.attention == "mla":
        qk = arch.qk_head_dim + arch.qk_pos_emb_head_dim
        if arch.q_lora_rank is None:
            q_term = h * heads * qk
        else:
            q_term = arch.q_lora_rank * (h + heads * qk + 1)
        kv_term = arch.kv_lora_rank * (h + heads * (arch.qk_head_dim + arch.v_head_dim) + 1)
        kv_term += h * arch.qk_pos_emb_head_dim
        out_term = heads * arch.v_head_dim * h
        core = seq_length * heads * qk * ratio + seq_length * heads * arch.v_head_dim * ratio
        return q_term + kv_term + out_term + core
    kv_channels = arch.kv_channels or h // heads
    groups = arch.num_query_groups or heads
    projection_ratio = kv_channels * heads / h
    # Megatron's MHA/GQA term is written with a 12x factor; return it per 6x.
    return 2 * h * h * (1 + groups / heads + seq_length / h * ratio) * projection_ratio


def train_flops_per_token(arch: MoEArch, seq_length: int, include_mtp: bool = True) -> float:
    """Training FLOPs (forward + backward) per token at `seq_length`."""
    mtp = arch.mtp_num_layers if include_mtp else 0
    last_is_moe = arch.is_moe_layer(arch.num_layers - 1)
    dense_layers = arch.first_k_dense + (0 if last_is_moe else mtp)
    moe_layers = arch.num_moe_layers + (mtp if last_is_moe else 0)
    layers = arch.num_layers + mtp
    h, swiglu = arch.hidden_size, 1.5

    mlp = 12 * h * swiglu * (
        arch.ffn_hidden_size * dense_layers
        + arch.moe_ffn_hidden_size * arch.moe_router_topk * moe_layers
        + arch.shared_expert_ffn_hidden_size * moe_layers
    )
    attention = 6 * layers * _attention_flops_per_layer(arch, seq_length)
    mtp_extra = 6 * mtp * (3 * h + 2 * h * h)
    logits = 6 * h * arch.vocab_size * (mtp + 1)
    return float(mlp + attention + mtp_extra + logits)


def model_counts(arch: MoEArch, seq_length: int = 4096) -> ModelCounts:
    """Published-style counts: params without MTP, FLOPs with MTP where the arch has it."""
    total, active = count_params(arch, include_mtp=False)
    with_mtp, _ = count_params(arch, include_mtp=True)
    return ModelCounts(
        total_params=total,
        active_params=active,
        train_flops_per_token=train_flops_per_token(arch, seq_length),
        mtp_params=with_mtp - total,
    )
