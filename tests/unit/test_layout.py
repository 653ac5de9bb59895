"""One test per rule of `ParallelLayout.check` and `for_world`: each names its field."""

from __future__ import annotations

import pytest

from moerl.models.arch import TINY
from moerl.parallel.layout import LayoutError, ParallelLayout


def _fails(layout: ParallelLayout, field: str, arch: object = TINY, **kwargs: object) -> None:
    with pytest.raises(LayoutError, match=rf"parallel\.{field}\b|^parallel: .*parallel\.{field}"):
        layout.check(arch, **kwargs)  # type: ignore[arg-type]


def test_valid_layouts_pass() -> None:
    for layout, world in [
        (ParallelLayout(), 1),
        (ParallelLayout(tp=2), 2),
        (ParallelLayout(pp=2, vpp=2), 2),
        (ParallelLayout(tp=2, ep=2, dp=2), 4),
    ]:
        layout.check(TINY, world)


@pytest.mark.parametrize("field", ["tp", "pp", "ep", "etp", "cp", "dp"])
def test_degrees_must_be_positive(field: str) -> None:
    _fails(ParallelLayout(**{field: 0}), field)


def test_vpp_must_be_at_least_two() -> None:
    _fails(ParallelLayout(pp=2, vpp=1), "vpp")


def test_world_size_must_match() -> None:
    with pytest.raises(LayoutError, match=r"parallel\.dp=2"):
        ParallelLayout(tp=2).check(TINY, world_size=4)


def test_experts_divisible_by_ep() -> None:
    _fails(ParallelLayout(ep=3, dp=3), "ep")


def test_expert_group_divides_dense_ranks() -> None:
    _fails(ParallelLayout(ep=2), "ep")


def test_expert_ffn_divisible_by_etp() -> None:
    _fails(ParallelLayout(etp=3, dp=3), "etp")


def test_vpp_needs_pipeline() -> None:
    _fails(ParallelLayout(vpp=2), "vpp")


def test_layers_divisible_by_stages() -> None:
    _fails(ParallelLayout(pp=3), "pp")
    _fails(ParallelLayout(pp=2, vpp=4), "pp")


def test_uneven_split_is_suggested_and_checked() -> None:
    with pytest.raises(LayoutError, match=r"parallel\.stage_layers=\[1, 2, 1\]"):
        ParallelLayout(pp=3).check(TINY)
    ParallelLayout(pp=3, stage_layers=[1, 2, 1]).check(TINY)
    _fails(ParallelLayout(pp=2, stage_layers=[1, 2]), "stage_layers")  # sums to 3, not 4
    _fails(ParallelLayout(pp=2, stage_layers=[1, 1, 2]), "stage_layers")  # 3 chunks, not 2
    _fails(ParallelLayout(pp=2, stage_layers=[0, 4]), "stage_layers")  # an empty stage


def test_vpp_on_gloo_needs_unbatched_p2p() -> None:
    _fails(ParallelLayout(pp=2, vpp=2, batch_p2p_comm=True), "batch_p2p_comm", backend="gloo")
    ParallelLayout(pp=2, vpp=2, batch_p2p_comm=True).check(TINY, backend="nccl")
    assert ParallelLayout(pp=2, vpp=2).resolved_batch_p2p_comm("gloo") is False


def test_heads_divisible_by_tp() -> None:
    _fails(ParallelLayout(tp=3), "tp")


def test_query_groups_divisible_by_tp() -> None:
    gqa = TINY.replace(attention="gqa", num_query_groups=1)
    _fails(ParallelLayout(tp=2), "tp", arch=gqa)


def test_ffn_divisible_by_tp() -> None:
    _fails(ParallelLayout(tp=2), "tp", arch=TINY.replace(ffn_hidden_size=127))


def test_vocab_divisible_by_tp() -> None:
    _fails(ParallelLayout(tp=2), "tp", arch=TINY.replace(vocab_size=255))


def test_moe_with_tp_needs_sequence_parallel() -> None:
    _fails(ParallelLayout(tp=2, sequence_parallel=False), "sequence_parallel")


def test_sequence_parallel_needs_tp() -> None:
    _fails(ParallelLayout(sequence_parallel=True), "sequence_parallel")


def test_context_parallel_runs_without_te() -> None:
    # Ring attention stands in for TE's attention on CPU.
    ParallelLayout(cp=2).check(TINY, world_size=2, te_available=False)
    ParallelLayout(cp=2).check(TINY, world_size=2, te_available=True)


def test_for_world_fills_dp() -> None:
    assert ParallelLayout.for_world(8, tp=2, pp=2).dp == 2


def test_for_world_rejects_indivisible_world() -> None:
    with pytest.raises(LayoutError, match=r"tp/pp/cp"):
        ParallelLayout.for_world(3, tp=2)
