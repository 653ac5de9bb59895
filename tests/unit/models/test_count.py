"""Parameter and FLOP counts against published figures and independent sums."""

from __future__ import annotations

import json

import pytest

from moerl.launchers.cli import main
from moerl.models.arch import DEEPSEEK_V3, KIMI_K2, TINY
from moerl.models.count import count_params, model_counts, train_flops_per_token


def rel(a: float, b: float) -> float:
    return abs(a - b) / b


def test_deepseek_v3_total_params_match_671b() -> None:
    assert rel(model_counts(DEEPSEEK_V3).total_params, 671e9) < 0.01


def test_deepseek_v3_active_params_match_37b() -> None:
    # The report rounds 37.5B down to "37B": hold the count to 1.5% of it.
    assert rel(model_counts(DEEPSEEK_V3).active_params, 37e9) < 0.015


def test_kimi_k2_params() -> None:
    counts = model_counts(KIMI_K2)
    assert rel(counts.active_params, 32.6e9) < 0.01
    # The stated 1.04T is rounded from the published safetensors; the architecture in
    # its config sums to 1.026T.
    assert rel(counts.total_params, 1.04e12) < 0.015


@pytest.mark.parametrize(
    ("arch", "include_mtp", "published_gflop"),
    [(DEEPSEEK_V3, True, 260.6), (DEEPSEEK_V3, False, 249.7), (KIMI_K2, True, 204.6)],
)
def test_train_flops_per_token_at_4096(arch, include_mtp: bool, published_gflop: float) -> None:
    flops = train_flops_per_token(arch, 4096, include_mtp=include_mtp)
    assert rel(flops / 1e9, published_gflop) < 0.01


def test_active_equals_total_minus_unrouted_experts() -> None:
    total, active = count_params(DEEPSEEK_V3)
    unrouted = DEEPSEEK_V3.num_experts - DEEPSEEK_V3.moe_router_topk
    expert = 3 * DEEPSEEK_V3.hidden_size * DEEPSEEK_V3.moe_ffn_hidden_size
    assert total - active == DEEPSEEK_V3.num_moe_layers * unrouted * expert


def test_attention_flops_grow_linearly_with_sequence() -> None:
    short, long = (train_flops_per_token(TINY, s) for s in (1024, 2048))
    longer = train_flops_per_token(TINY, 3072)
    assert long > short
    assert longer - long == pytest.approx(long - short)


def test_model_info_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["model-info", "model=kimi-k2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {"total_params", "active_params", "train_flops_per_token"} <= set(data)
    assert data["total_params"] == model_counts(KIMI_K2).total_params
