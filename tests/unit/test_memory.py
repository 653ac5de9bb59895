"""The per-GPU memory model: static bytes against independent counts, and the
directions activation, pipeline, optimizer and KV terms must move in."""

from __future__ import annotations

import dataclasses

import pytest

from moerl.models.arch import DEEPSEEK_V3, KIMI_K2, TINY, MoEArch
from moerl.models.count import count_params
from moerl.parallel.layout import ParallelLayout, uneven_split
from moerl.planning.activations import layer_activation_bytes
from moerl.planning.memory import (
    GiB,
    RunSettings,
    dispatch_bytes,
    in_flight_micro_batches,
    memory_breakdown,
    rank_memory,
)
from moerl.planning.stages import stage_chunks, stage_params

LAYOUTS = [
    ParallelLayout(tp=1, pp=1, ep=1, dp=8),
    ParallelLayout(tp=2, pp=2, ep=4, dp=4),
    ParallelLayout(tp=4, pp=4, vpp=2, ep=8, etp=2, dp=8),
    ParallelLayout(tp=8, pp=8, ep=32, cp=2, dp=4),
]


@pytest.mark.parametrize("arch", [TINY, DEEPSEEK_V3, KIMI_K2], ids=lambda a: a.name)
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: lay.describe())
def test_shards_over_all_ranks_add_up_to_the_model(arch: MoEArch, layout: ParallelLayout) -> None:
    # Undo each kind's sharding and sum over pipeline ranks: the whole model, MTP included.
    stages = layout.pp * layout.virtual_stages
    if arch.num_layers < stages:
        pytest.skip("more stages than layers")
    if arch.num_layers % stages:
        layout = dataclasses.replace(layout, stage_layers=uneven_split(arch.num_layers, stages))
    whole = 0.0
    for rank in range(layout.pp):
        s = stage_params(arch, layout, rank)
        whole += s.replicated + s.tensor * layout.tp + s.embedding * layout.tp
        whole += s.expert * layout.ep * layout.etp
    total, _ = count_params(arch, include_mtp=True)
    assert whole == pytest.approx(total, rel=1e-12)


def test_weight_and_grad_bytes_are_params_times_width() -> None:
    layout = ParallelLayout(tp=2, pp=2, ep=4, dp=4)
    bf16 = rank_memory(DEEPSEEK_V3, layout, RunSettings(precision="bf16"), rank=1)
    assert bf16.terms["weights"] == pytest.approx(bf16.params * 2)
    assert bf16.terms["main_grads"] == pytest.approx(bf16.params * 4)
    # FP8 primary weights: one byte for the linear layers; the output head (vocab/tp x h,
    # and MTP's copy of the embedding at pp > 1), norms and routers stay in bf16.
    fp8 = rank_memory(DEEPSEEK_V3, layout, RunSettings(precision="fp8"), rank=1)
    split = stage_params(DEEPSEEK_V3, layout, 1)
    wide = 2 * DEEPSEEK_V3.vocab_size * DEEPSEEK_V3.hidden_size / 2 + split.high_precision
    assert fp8.terms["weights"] == pytest.approx(fp8.params + wide)
    assert 0 < split.high_precision < 0.01 * split.total
    assert fp8.terms["main_grads"] == pytest.approx(fp8.params * 4)


def test_reference_and_critic_terms() -> None:
    """The reference holds the policy's weights again; the critic is the policy's trunk
    with a (1, h) head for the output layer and no MTP, with gradients and optimizer."""
    layout = ParallelLayout(tp=2, pp=2, ep=4, dp=4)
    run = RunSettings(precision="bf16", critic=True)
    first, last = (rank_memory(DEEPSEEK_V3, layout, run, rank=r) for r in (0, 1))
    for m in (first, last):
        assert m.terms["reference_weights"] == m.terms["weights"]
    # First stage: the same layers and embedding as the policy's.
    assert first.terms["critic_weights"] == first.terms["weights"]
    assert first.terms["critic_adam_states"] == first.terms["adam_states"]
    # Last stage: no MTP layer, no output layer nor MTP's embedding copy, plus the head.
    h, v = DEEPSEEK_V3.hidden_size, DEEPSEEK_V3.vocab_size
    mtp = stage_params(DEEPSEEK_V3, layout, 1).total - stage_params(
        dataclasses.replace(DEEPSEEK_V3, mtp_num_layers=0), layout, 1).total
    assert last.params - (last.terms["critic_weights"] / 2) == pytest.approx(
        mtp + 2 * v * h / 2 - (h + 1))
    off = rank_memory(DEEPSEEK_V3, layout, RunSettings(reference=False), rank=0)
    assert off.terms["reference_weights"] == 0 and "critic_weights" not in off.terms


def test_deepseek_v3_expert_weights_per_gpu_by_hand() -> None:
    # ep 64, pp 1: 58 MoE layers * 4 local experts * 3 * h * 2048 params, 2 bytes each.
    layout = ParallelLayout(tp=1, pp=1, ep=64, dp=64)
    expert = stage_params(DEEPSEEK_V3, layout, 0).expert
    assert expert == 58 * 4 * 3 * 7168 * 2048 + 4 * 3 * 7168 * 2048  # + the MTP layer


def test_doubling_tp_halves_tensor_parallel_weights() -> None:
    a = stage_params(KIMI_K2, ParallelLayout(tp=2, pp=4, ep=8, dp=8), 0)
    b = stage_params(KIMI_K2, ParallelLayout(tp=4, pp=4, ep=8, dp=8), 0)
    assert b.tensor == pytest.approx(a.tensor / 2)
    assert b.embedding == pytest.approx(a.embedding / 2)
    assert b.replicated == a.replicated
    assert b.expert == a.expert


def test_distributed_optimizer_divides_optimizer_state_by_dp() -> None:
    run = RunSettings()
    dist = ParallelLayout(tp=1, pp=1, ep=1, dp=8)
    plain = ParallelLayout(tp=1, pp=1, ep=1, dp=8, use_distributed_optimizer=False)
    a, b = rank_memory(TINY, dist, run, 0), rank_memory(TINY, plain, run, 0)
    for term in ("master_weights", "adam_states"):
        assert a.terms[term] == pytest.approx(b.terms[term] / 8)
    assert b.terms["adam_states"] == pytest.approx(8 * b.params)
    assert a.terms["main_grads"] == b.terms["main_grads"]  # the grad buffer is never sharded


def test_expert_optimizer_state_shards_over_expert_dp_only() -> None:
    # ep = dp = 8: each expert lives on one rank, so its state cannot be sharded.
    layout = ParallelLayout(tp=1, pp=1, ep=4, dp=8)  # expert-dp = 2
    split = stage_params(TINY, layout, 0)
    m = rank_memory(TINY, layout, RunSettings(), 0)
    dense = split.total - split.expert
    assert m.terms["adam_states"] == pytest.approx(8 * (dense / 8 + split.expert / 2))


@pytest.mark.parametrize("arch", [DEEPSEEK_V3, KIMI_K2], ids=lambda a: a.name)
@pytest.mark.parametrize("layer", [0, 10])  # dense, MoE
def test_recompute_orders_activations(arch: MoEArch, layer: int) -> None:
    layout = ParallelLayout(tp=4, pp=1, ep=8, dp=2)

    def saved(mode: str) -> float:
        return layer_activation_bytes(arch, layout, 4096, 1, None, layer, mode)[0]  # type: ignore[arg-type]

    assert saved("full") < saved("selective") < saved("none")


def test_full_recompute_keeps_only_layer_inputs() -> None:
    layout = ParallelLayout(tp=4, pp=1, ep=8, dp=2)  # sequence parallel: h * s / tp per layer
    kept, whole = layer_activation_bytes(KIMI_K2, layout, 4096, 2, None, 5, "full")
    assert kept == 7168 * 4096 * 2 / 4 * 2
    assert whole == layer_activation_bytes(KIMI_K2, layout, 4096, 2, None, 5, "none")[0]


def test_activations_scale_with_tokens_and_shrink_with_tp_and_cp() -> None:
    base = ParallelLayout(tp=2, pp=1, ep=2, dp=2)
    one = layer_activation_bytes(KIMI_K2, base, 4096, 1, None, 5, "selective")[0]
    assert layer_activation_bytes(KIMI_K2, base, 8192, 1, None, 5, "selective")[0] == \
        pytest.approx(2 * one)
    tp4 = ParallelLayout(tp=4, pp=1, ep=2, dp=1)
    assert layer_activation_bytes(KIMI_K2, tp4, 4096, 1, None, 5, "selective")[0] == \
        pytest.approx(one / 2)
    cp2 = ParallelLayout(tp=2, pp=1, ep=2, cp=2, dp=1)
    assert layer_activation_bytes(KIMI_K2, cp2, 4096, 1, None, 5, "selective")[0] == \
        pytest.approx(one / 2)


def test_1f1b_first_stage_holds_pp_micro_batches() -> None:
    layout = ParallelLayout(tp=1, pp=8, dp=1)
    assert [in_flight_micro_batches(layout, r, 64) for r in range(8)] == [8, 7, 6, 5, 4, 3, 2, 1]
    assert in_flight_micro_batches(layout, 0, 3) == 3  # fewer micro-batches than stages


def test_interleaved_adds_the_documented_extra() -> None:
    # Rank 0 holds pp * (1 + (pp - 1) / (pp * vpp)) micro-batches of its layers.
    layout = ParallelLayout(tp=1, pp=8, vpp=4, dp=1)
    assert in_flight_micro_batches(layout, 0, 64) == pytest.approx(8 * (1 + 7 / 32))


def test_first_stage_activations_are_pp_times_one_micro_batch() -> None:
    layout = ParallelLayout(tp=1, pp=4, ep=1, dp=1)
    arch = TINY.replace(num_layers=8, first_k_dense=0, mtp_num_layers=0)
    run = RunSettings(seq_length=256, global_batch_size=16, recompute="none")
    per_layer = layer_activation_bytes(arch, layout, 256, 1, None, 0, "none")[0]
    first = rank_memory(arch, layout, run, 0)
    assert first.terms["activations"] == pytest.approx(4 * 2 * per_layer)


def test_uneven_split_keeps_first_and_last_stage_light() -> None:
    sizes = uneven_split(61, 16)
    assert sum(sizes) == 61 and sizes[0] == sizes[-1] == 3 and max(sizes) == 4
    layout = ParallelLayout(tp=1, pp=4, vpp=2, dp=1, stage_layers=uneven_split(61, 8))
    chunks = [c for r in range(4) for c in stage_chunks(KIMI_K2, layout, r)]
    held = [layer for chunk in chunks for layer in chunk]
    assert sorted(held) == list(range(61))


def test_mla_kv_cache_is_latent_plus_rope_key_and_replicated_over_tp() -> None:
    run = RunSettings(kv_cache_tokens=100_000)
    for tp in (1, 8):
        layout = ParallelLayout(tp=tp, pp=1, ep=8, dp=8 // tp)
        m = rank_memory(KIMI_K2, layout, run, 0)
        assert m.terms["kv_cache"] == 100_000 * 61 * (512 + 64) * 2


def test_dropless_dispatch_worst_case_exceeds_capacity_factor() -> None:
    layout = ParallelLayout(tp=1, pp=16, ep=64, dp=128)
    dropless = dispatch_bytes(DEEPSEEK_V3, layout, RunSettings())
    capped = dispatch_bytes(DEEPSEEK_V3, layout, RunSettings(moe_capacity_factor=1.0))
    # send + receive of 4096 tokens * top-8 * h bf16 at capacity factor 1
    assert capped == 2 * 2 * 4096 * 8 * 7168
    # worst case: all 64 ranks send min(8, 4 local experts) copies of every token here
    assert dropless == 2 * (4096 * 8 * 7168 + 4096 * 64 * 4 * 7168)


def test_deepseek_v3_does_not_fit_one_node() -> None:
    m = memory_breakdown(DEEPSEEK_V3, ParallelLayout(tp=8, pp=1, ep=8, dp=1),
                         RunSettings(recompute="full"))
    assert m.total > 80 * GiB
