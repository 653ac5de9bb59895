"""Long-context planning for Kimi-K2 on 128 trainer and 32 rollout H100 nodes (full
recompute, fp8, CP).

128K fits with CP > 1, trainer and rollout engines both; at 256K the trainer fits but no
rollout engine holds a sequence (the engine caches MLA's per-head keys and values);
at 1M the trainer does not fit, and the reason names the largest memory term of the
closest layout. The shipped long-context recipe is the longest length both stages fit.
"""

from __future__ import annotations

from functools import cache

import yaml

from moerl.launchers.recipes import REPO
from moerl.models.arch import get_preset
from moerl.planning.cost import ClusterSpec
from moerl.planning.memory import RunSettings
from moerl.planning.plan import PlanResult, SearchSettings, search_layouts
from moerl.planning.rollout_fit import RolloutSettings, rollout_options
from moerl.rollout.kv_layout import kv_bytes_per_token_layer

K = 1024
LENGTHS = (128 * K, 256 * K, 1024 * K)


@cache
def _plan(seq_length: int) -> PlanResult:
    run = RunSettings(
        seq_length=seq_length, global_batch_size=128, precision="fp8", recompute="full"
    )
    return search_layouts(get_preset("kimi-k2"), ClusterSpec(nodes=128), run, SearchSettings())


def _rollout_fits(seq_length: int) -> bool:
    rollout = RolloutSettings(nodes=32, concurrent_sequences=4, context_length=seq_length)
    return any(o.fits for o in rollout_options(get_preset("kimi-k2"), rollout, 8, 80.0,
                                               kv_bytes_per_token_layer))


def test_128k_fits_with_context_parallelism() -> None:
    result = _plan(128 * K)
    assert result.fitting, result.closest_miss
    best = result.fitting[0]
    assert best.layout.cp > 1
    assert best.memory.total <= 80 * 0.9 * 1024**3
    assert _rollout_fits(128 * K)


def test_1m_names_the_largest_term_of_the_closest_layout() -> None:
    result = _plan(1024 * K)
    miss = result.closest_miss
    assert not result.fitting and miss is not None and not miss.fits
    largest = max(miss.memory.gib().items(), key=lambda kv: kv[1])[0]
    assert f"largest: {largest} " in miss.reason, miss.reason


def test_verdicts() -> None:
    assert [bool(_plan(s).fitting) for s in LENGTHS] == [True, True, False]
    assert [_rollout_fits(s) for s in LENGTHS] == [True, False, False]


def test_recipe_is_the_longest_length_both_stages_fit() -> None:
    data = yaml.safe_load((REPO / "configs/experiment/kimi_k2_long_context_h100.yaml").read_text())
    longest = max(s for s in LENGTHS if _plan(s).fitting and _rollout_fits(s))
    assert data["seq_length"] == data["run"]["seq_length"] == longest
    assert data["rollout"]["context_length"] == longest
    layout = data["parallel"]
    names = {c.layout.describe() for c in _plan(longest).fitting}
    best = _plan(longest).fitting[0].layout
    assert (
        layout["tp"],
        layout["pp"],
        layout["vpp"],
        layout["ep"],
        layout["cp"],
        layout["dp"],
    ) == (best.tp, best.pp, best.vpp, best.ep, best.cp, best.dp), names
