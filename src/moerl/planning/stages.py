"""Which layers and parameters one pipeline rank holds, split by how they are sharded.

Layers are cut into S = pp * vpp chunks; rank r holds chunks r, r + pp, r + 2pp, ...
When S does not divide the layer count (61-layer DeepSeek-V3 and Kimi-K2), every
chunk gets floor(L/S) layers and the L mod S extra ones go to middle chunks, so the
first stage (embedding, most in-flight micro-batches) and the last (output head,
loss, MTP) stay light, as Megatron's uneven splits (`decoder_first_pipeline_num_layers`,
`account_for_loss_in_pipeline_split`) are used for these models.
The first stage holds the input embedding, the last the output head, final norm
and the MTP modules.

Norms and routers are counted apart as well (`ParamSplit.high_precision`, inside their
sharding kind): with FP8 primary weights Transformer Engine keeps only the weights of
its linear layers in one byte, and these, like the embeddings, stay in bf16.

Sharding on the GPU code path (Transformer Engine spec):
    replicated  norms, router, MLA down-projections (Megatron builds them "duplicated")
    tensor      MLA up/out projections, dense and shared-expert FFNs, MTP projection: /tp
    expert      routed experts: /(ep * etp)
    embedding   vocabulary tables: /tp
"""

from __future__ import annotations

from dataclasses import dataclass

from moerl.models.arch import MoEArch
from moerl.models.count import attention_params, dense_mlp_params
from moerl.parallel.layout import ParallelLayout


@dataclass(frozen=True)
class ParamSplit:
    """Parameters one rank holds, by sharding kind (already divided)."""

    replicated: float = 0.0
    tensor: float = 0.0
    expert: float = 0.0
    embedding: float = 0.0
    high_precision: float = 0.0
    """Norm and router weights, already counted in `replicated`: never FP8."""

    @property
    def total(self) -> float:
        return self.replicated + self.tensor + self.expert + self.embedding

    def __add__(self, other: ParamSplit) -> ParamSplit:
        return ParamSplit(
            self.replicated + other.replicated,
            self.tensor + other.tensor,
            self.expert + other.expert,
            self.embedding + other.embedding,
            self.high_precision + other.high_precision,
        )


def stage_chunks(arch: MoEArch, layout: ParallelLayout, rank: int) -> list[list[int]]:
    """0-based decoder layer indices of each virtual chunk held by pipeline `rank`."""
    chunks = layout.pp * layout.virtual_stages
    sizes = layout.layers_per_chunk(arch.num_layers)
    starts = [sum(sizes[:j]) for j in range(chunks)]
    mine = range(rank, chunks, layout.pp)
    return [list(range(starts[j], starts[j] + sizes[j])) for j in mine]


def attention_norms(arch: MoEArch) -> int:
    """Norm weights of one attention block: its input norm and MLA's two latent norms."""
    if arch.attention != "mla":
        return arch.hidden_size
    return arch.hidden_size + (arch.q_lora_rank or 0) + arch.kv_lora_rank


def attention_split(arch: MoEArch) -> tuple[int, int]:
    """(replicated, tensor-parallel) parameters of one attention block."""
    total = attention_params(arch)
    h = arch.hidden_size
    replicated = h  # input norm
    if arch.attention == "mla":
        if arch.q_lora_rank is not None:
            replicated += h * arch.q_lora_rank + arch.q_lora_rank
        replicated += h * (arch.kv_lora_rank + arch.qk_pos_emb_head_dim) + arch.kv_lora_rank
    return replicated, total - replicated


def layer_split(arch: MoEArch, layout: ParallelLayout, layer: int) -> ParamSplit:
    """One decoder layer's parameters on one rank, per sharding kind."""
    h, tp = arch.hidden_size, layout.tp
    rep, ten = attention_split(arch)
    norms = attention_norms(arch) + h  # + the pre-FFN norm
    if arch.is_moe_layer(layer):
        shared = 3 * h * arch.shared_expert_ffn_hidden_size
        routed = arch.num_experts * 3 * h * arch.moe_ffn_hidden_size
        router = h * arch.num_experts
        return ParamSplit(
            replicated=rep + router + h,
            tensor=(ten + shared) / tp,
            expert=routed / (layout.ep * layout.etp),
            high_precision=norms + router,
        )
    mlp = dense_mlp_params(arch)
    return ParamSplit(replicated=rep + h, tensor=(ten + mlp - h) / tp, high_precision=norms)


def mtp_split(arch: MoEArch, layout: ParallelLayout) -> ParamSplit:
    """MTP modules: 2 norms, the 2h -> h projection, one decoder layer, a final norm."""
    h = arch.hidden_size
    block = layer_split(arch, layout, arch.num_layers - 1)
    extra = ParamSplit(replicated=3 * h, tensor=2 * h * h / layout.tp, high_precision=3 * h)
    one = block + extra
    n = arch.mtp_num_layers
    return ParamSplit(replicated=n * one.replicated, tensor=n * one.tensor, expert=n * one.expert,
                      high_precision=n * one.high_precision)


def stage_params(arch: MoEArch, layout: ParallelLayout, rank: int) -> ParamSplit:
    """Everything pipeline `rank` holds: its layers, plus embedding / head / MTP."""
    split = ParamSplit()
    for chunk in stage_chunks(arch, layout, rank):
        for layer in chunk:
            split = split + layer_split(arch, layout, layer)
    table = arch.vocab_size * arch.hidden_size / layout.tp
    if rank == 0:
        split = split + ParamSplit(embedding=table)
    if rank == layout.pp - 1:
        head = table if arch.untie_embeddings or layout.pp > 1 else 0.0
        split = split + ParamSplit(replicated=arch.hidden_size, embedding=head,
                                   high_precision=arch.hidden_size)  # + the final norm
        split = split + mtp_split(arch, layout)
    return split
