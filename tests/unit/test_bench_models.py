"""The transformers models of benchmarks/learning_vs_trl.py follow moerl's architecture:
the DeepSeek-V3 config is the arch's, whatever its dimensions, and the Qwen3-MoE beside
it has the same parameter count (to within one step of its experts' width)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from _hf_models import ALIGN, build, count, deepseek_config, qwen3_config
from transformers import DeepseekV3ForCausalLM, Qwen3MoeForCausalLM

from moerl.models.arch import TINY, MoEArch
from moerl.models.count import count_params

ARCHS = [
    TINY.replace(latent_norms=True, mtp_num_layers=0),
    # another shape: wider, more experts and groups, two dense layers, no q-LoRA
    TINY.replace(latent_norms=True, mtp_num_layers=0, hidden_size=96, num_layers=5,
                 first_k_dense=2, num_experts=8, router_num_groups=4, router_group_topk=2,
                 q_lora_rank=None, moe_ffn_hidden_size=96),
]


@pytest.mark.parametrize("arch", ARCHS, ids=["tiny", "other"])
def test_deepseek_config_is_the_arch(arch: MoEArch) -> None:
    config = deepseek_config(arch)
    assert (config.hidden_size, config.num_hidden_layers, config.first_k_dense_replace,
            config.n_routed_experts, config.q_lora_rank) == (
        arch.hidden_size, arch.num_layers, arch.first_k_dense, arch.num_experts, arch.q_lora_rank)
    # transformers' model holds exactly the parameters moerl counts for the arch
    assert count(config, DeepseekV3ForCausalLM) == count_params(arch)[0]


@pytest.mark.parametrize("arch", ARCHS, ids=["tiny", "other"])
def test_qwen3_moe_has_the_same_parameter_count(arch: MoEArch) -> None:
    target = count(deepseek_config(arch), DeepseekV3ForCausalLM)
    config = qwen3_config(arch, target)
    params = count(config, Qwen3MoeForCausalLM)
    per_width = 3 * arch.hidden_size * arch.num_experts * arch.num_moe_layers
    assert abs(params - target) <= ALIGN * per_width / 2
    assert config.moe_intermediate_size % ALIGN == 0
    assert (config.num_experts, config.num_experts_per_tok, config.mlp_only_layers) == (
        arch.num_experts, arch.moe_router_topk, list(range(arch.first_k_dense)))


def test_unknown_model_is_refused() -> None:
    with pytest.raises(ValueError, match="qwen3_moe"):
        build("llama", TINY)
