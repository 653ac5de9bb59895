"""Architecture presets, their YAML mirrors, and field validation."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from moerl.models.arch import PRESETS, TINY, ArchError, MoEArch, get_preset
from moerl.typed_config import from_dict

CONFIGS = Path(__file__).resolve().parents[3] / "configs" / "model"


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_yaml_matches_preset(name: str) -> None:
    data = yaml.safe_load((CONFIGS / f"{name}.yaml").read_text())
    assert from_dict(MoEArch, data, "model") == PRESETS[name]


def test_tiny_exercises_every_path_of_the_big_presets() -> None:
    assert TINY.attention == "mla" and TINY.q_lora_rank is not None
    assert 0 < TINY.first_k_dense < TINY.num_layers
    assert TINY.num_shared_experts >= 1 and TINY.router_score == "sigmoid"
    assert TINY.router_expert_bias and TINY.mtp_num_layers >= 1


def test_unknown_preset_lists_known_ones() -> None:
    with pytest.raises(ArchError, match="kimi-k2"):
        get_preset("kimi-k3")


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"first_k_dense": 9}, "first_k_dense"),
        ({"moe_router_topk": 5}, "moe_router_topk"),
        ({"router_num_groups": 3}, "router_num_groups"),
        ({"router_group_topk": 1, "moe_router_topk": 3}, "router_group_topk"),
        ({"hidden_size": 0}, "hidden_size"),
    ],
)
def test_invalid_arch_names_field(changes: dict[str, int], field: str) -> None:
    with pytest.raises(ArchError, match=rf"model\.{field}"):
        dataclasses.replace(TINY, **changes)
