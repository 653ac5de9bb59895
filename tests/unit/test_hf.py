"""Hugging Face DeepSeek-V3 <-> Megatron in one process: configs, logits, exact round trips.

The checkpoint is a tiny DeepSeek-V3 built and saved with `transformers` (the
builder lives beside the distributed parity test, which runs it under TP2 / EP2).
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch
from megatron.core.transformer.moe import moe_logging

from moerl.models.arch import DEEPSEEK_V3, KIMI_K2, MOONLIGHT_16B_A3B, TINY, ArchError, MoEArch
from moerl.models.build import build_model
from moerl.models.hf import dequantize_blocks, export_hf, gather_megatron, import_hf
from moerl.models.hf_mapping import (
    arch_from_hf_config,
    hf_config_from_arch,
    hf_to_megatron,
    megatron_to_hf,
)
from moerl.parallel.layout import ParallelLayout

pytest.importorskip("transformers")
LOGIT_TOLERANCE = 1e-4


def _worker() -> ModuleType:
    path = Path(__file__).parents[1] / "distributed" / "hf_parity_worker.py"
    spec = importlib.util.spec_from_file_location("hf_parity_worker", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


WORKER = _worker()


@pytest.fixture(scope="module")
def single_process() -> Iterator[None]:
    from moerl.parallel.groups import destroy_parallel, init_parallel

    init_parallel(ParallelLayout(), seed=0)
    yield
    destroy_parallel()


@pytest.mark.parametrize("arch", [DEEPSEEK_V3, KIMI_K2, MOONLIGHT_16B_A3B])
def test_arch_round_trips_through_hf_config(arch: MoEArch) -> None:
    back = arch_from_hf_config(json.loads(json.dumps(hf_config_from_arch(arch))), name=arch.name)
    assert back == arch.replace(aux_loss_coeff=back.aux_loss_coeff)


def test_group_score_that_hf_computes_differently_is_refused() -> None:
    # TINY scores a group by its top 1 expert (topk 2 // 2 groups); HF always uses 2.
    with pytest.raises(ArchError, match="topk_group"):
        arch_from_hf_config(hf_config_from_arch(TINY))


def test_fp8_blocks_dequantise() -> None:
    weight = torch.randn(5, 3)
    scale = torch.tensor([[2.0, 3.0], [5.0, 7.0]])  # blocks of 3 x 2 (the last ones partial)
    got = dequantize_blocks(weight, scale)
    assert torch.equal(got[:3, :2], weight[:3, :2] * 2)
    assert torch.equal(got[3:, 2:], weight[3:, 2:] * 7)


@pytest.mark.usefixtures("single_process")
@pytest.mark.parametrize("rope_interleave", [True, False])
def test_import_matches_transformers_and_round_trips(rope_interleave: bool,
                                                     tmp_path: Path) -> None:
    from safetensors.torch import load_file
    from transformers import DeepseekV3ForCausalLM

    hf_dir = WORKER.tiny_hf_checkpoint(tmp_path / "hf", rope_interleave=rope_interleave)
    with torch.no_grad():
        want = DeepseekV3ForCausalLM.from_pretrained(hf_dir).eval()(WORKER.tokens()).logits
    moe_logging.destroy_moe_metrics_tracker()
    arch, chunks = import_hf(hf_dir, ParallelLayout())
    got = WORKER.megatron_logits(chunks[0], WORKER.tokens())
    diff = (got - want).abs().max().item()
    print(f"rope_interleave={rope_interleave}: max |megatron - transformers| logit {diff:.2e}")
    assert diff < LOGIT_TOLERANCE

    base = json.loads((hf_dir / "config.json").read_text())
    export_hf(chunks, arch, tmp_path / "out", base_config=base)
    before = load_file(hf_dir / "model.safetensors")
    after = load_file(tmp_path / "out" / "model.safetensors")
    assert sorted(after) == sorted(before)
    assert all(torch.equal(after[k], before[k]) for k in before)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert arch_from_hf_config(config, name=arch.name) == arch


@pytest.mark.usefixtures("single_process")
@pytest.mark.parametrize("rope_interleave", [True, False])
def test_every_megatron_tensor_maps_both_ways_with_mtp(rope_interleave: bool) -> None:
    # transformers drops MTP layers, so the MTP names are checked on a Megatron model.
    arch = arch_from_hf_config(hf_config_from_arch(TINY.replace(
        num_experts=8, router_num_groups=2, router_group_topk=1, first_k_dense=1)))
    assert arch.mtp_num_layers == 1
    moe_logging.destroy_moe_metrics_tracker()
    chunks = list(build_model(arch, ParallelLayout(), qk_layernorm=True))
    meg = gather_megatron(chunks, arch)
    hf = megatron_to_hf(meg, arch, rope_interleave)
    assert "model.layers.4.eh_proj.weight" in hf and "model.layers.4.embed_tokens.weight" in hf
    back = hf_to_megatron(hf.__getitem__, arch, rope_interleave)
    assert sorted(back) == sorted(meg)
    assert all(torch.equal(back[k], meg[k]) for k in meg)
