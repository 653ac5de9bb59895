"""Hugging Face DeepSeek-V3 <-> Megatron in one process: configs, logits, exact round trips.

The checkpoint is a tiny DeepSeek-V3 built and saved with `transformers` (the
builder lives beside the distributed parity test, which runs it under TP2 / EP2).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest
import torch
from megatron.core.transformer.moe import moe_logging

from moerl.models.arch import DEEPSEEK_V3, KIMI_K2, MOONLIGHT_16B_A3B, TINY, ArchError, MoEArch
from moerl.models.build import build_model
from moerl.models.hf import export_hf, gather_megatron
from moerl.models.hf_files import HFCheckpoint, dequantize_blocks
from moerl.models.hf_import import import_hf
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


def test_fp8_blocks_are_read_and_dequantised_by_slice(tmp_path: Path) -> None:
    """A slice of an FP8 weight, whose edges cut through its 128 x 128 blocks, reads
    only its bytes and the scales covering it, and equals the whole tensor dequantised
    then sliced."""
    from safetensors.torch import save_file

    weight = torch.randn(300, 260).to(torch.float8_e4m3fn)
    scale = torch.rand(3, 3) + 0.5  # blocks of 128 x 128, the last ones partial
    save_file({"w": weight, "w_scale_inv": scale, "norm": torch.randn(260)},
              str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text("{}")
    ckpt = HFCheckpoint(tmp_path)
    part = ckpt.read("w", slice(100, 250), slice(130, 200))
    assert torch.equal(part, dequantize_blocks(weight, scale)[100:250, 130:200])
    assert ckpt.bytes_read == 150 * 70 + 2 * 1 * 4  # fp8 bytes, then scale rows 0-1, col 1
    assert torch.equal(ckpt.read("norm", slice(5, 9)), ckpt("norm")[5:9])
    # DeepSeek-V3's kv_a_proj_with_mqa: 576 rows in five 128-row blocks, the last half full.
    whole = torch.randn(576, 8)
    blocks = dequantize_blocks(whole, torch.arange(1.0, 6.0).reshape(5, 1))
    assert torch.equal(blocks[512:], whole[512:] * 5) and torch.equal(blocks[:128], whole[:128])


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
    arch, chunks, _ = import_hf(hf_dir, ParallelLayout())
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
def test_import_builds_the_model_at_the_dtype_asked(tmp_path: Path) -> None:
    """dtype=bfloat16: every matrix is built in bf16 (norms and the router bias as
    Megatron's local spec keeps them), every tensor equals the float32 import rounded;
    another dtype is refused naming it."""
    from moerl.models.hf import local_tensors
    from moerl.models.hf_files import HFError
    from moerl.models.hf_import import weights_precision

    hf_dir = WORKER.tiny_hf_checkpoint(tmp_path / "hf")
    moe_logging.destroy_moe_metrics_tracker()
    arch, fp32, _ = import_hf(hf_dir, ParallelLayout())
    moe_logging.destroy_moe_metrics_tracker()
    _, bf16, _ = import_hf(hf_dir, ParallelLayout(), torch.bfloat16)
    want = dict(local_tensors(fp32[0], arch))
    got = dict(local_tensors(bf16[0], arch))
    assert sorted(got) == sorted(want)
    matrices = [k for k in got if got[k].dim() == 2]
    assert len(matrices) > len(got) // 2
    assert all(got[k].dtype == torch.bfloat16 for k in matrices)
    assert all(torch.equal(got[k], want[k].to(got[k].dtype)) for k in got)
    with pytest.raises(HFError, match=r"dtype=torch\.float16"):
        weights_precision(torch.float16)


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


# YaRN. The published values (config.json of each release, also in Megatron-Bridge's
# DeepSeekV3ModelProvider / KimiK2Provider): DeepSeek-V3 rope_theta 10000 with
# {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
# "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}; Kimi-K2-Instruct rope_theta 50000
# with {"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
# "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}; Moonlight
# has no RoPE scaling.
PUBLISHED_ROPE: dict[str, tuple[float, dict[str, object] | None]] = {
    "deepseek-v3": (10000, {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                            "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                            "mscale_all_dim": 1.0}),
    "kimi-k2": (50000.0, {"type": "yarn", "factor": 32.0,
                          "original_max_position_embeddings": 4096, "beta_fast": 1.0,
                          "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}),
    "moonlight-16b-a3b": (50000.0, None),
}
PRESET_OF = {"deepseek-v3": DEEPSEEK_V3, "kimi-k2": KIMI_K2, "moonlight-16b-a3b": MOONLIGHT_16B_A3B}


@pytest.mark.parametrize("type_key", ["type", "rope_type"])
@pytest.mark.parametrize("name", sorted(PUBLISHED_ROPE))
def test_presets_carry_the_published_rope(name: str, type_key: str) -> None:
    preset = PRESET_OF[name]
    theta, scaling = PUBLISHED_ROPE[name]
    if scaling is not None:
        scaling = {(type_key if k == "type" else k): v for k, v in scaling.items()}
    # The release's config.json (legacy keys), as transformers 4 wrote it.
    config = hf_config_from_arch(preset)
    for key in ("rope_parameters", "rope_scaling", "rope_theta"):
        config.pop(key)
    config.update(rope_theta=theta, rope_scaling=scaling)
    assert arch_from_hf_config(config, name=name) == preset.replace(aux_loss_coeff=1e-4)


YARN_CASES = {
    # DeepSeek-V3's mscales: cos/sin unscaled, softmax scaled by m(1)^2.
    "deepseek": {"mscale": 1.0, "mscale_all_dim": 1.0},
    # No mscale: transformers scales cos/sin by m(1) and the softmax by m(1)^2, which
    # Megatron reaches only with a solved-for mscale (models.build._rope_kwargs).
    "no_mscale": {"mscale_all_dim": 1.0},
}


def _yarn(case: str) -> dict[str, object]:
    # Positions 0..11 of the test rows run past original_max_position_embeddings = 4.
    return {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4,
            "beta_fast": 32.0, "beta_slow": 1.0, **YARN_CASES[case]}


@pytest.mark.usefixtures("single_process")
@pytest.mark.parametrize("case", sorted(YARN_CASES))
def test_yarn_import_matches_transformers(case: str, tmp_path: Path) -> None:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    assert WORKER.SEQ > 4
    hf_dir = WORKER.tiny_hf_checkpoint(tmp_path / "hf", rope_scaling=_yarn(case),
                                       max_position_embeddings=16)
    base = json.loads((hf_dir / "config.json").read_text())
    with torch.no_grad():
        want = DeepseekV3ForCausalLM.from_pretrained(hf_dir).eval()(WORKER.tokens()).logits
    moe_logging.destroy_moe_metrics_tracker()
    arch, chunks, _ = import_hf(hf_dir, ParallelLayout())
    assert arch.rope_scaling == "yarn" and arch.yarn_factor == 4.0
    got = WORKER.megatron_logits(chunks[0], WORKER.tokens())
    diff = (got - want).abs().max().item()
    print(f"yarn {case}: max |megatron - transformers| logit {diff:.2e}")
    assert diff < LOGIT_TOLERANCE

    # The config round-trips, and transformers reads the written one as the original.
    config = hf_config_from_arch(arch, base)
    assert arch_from_hf_config(json.loads(json.dumps(config)), name=arch.name) == arch
    written = DeepseekV3Config(**config).rope_parameters
    original = DeepseekV3Config(**base).rope_parameters
    keys = ("rope_type", "rope_theta", "factor", "original_max_position_embeddings",
            "beta_fast", "beta_slow")
    assert {k: written[k] for k in keys} == {k: original[k] for k in keys}
    for key in ("mscale", "mscale_all_dim"):
        assert float(written.get(key) or 0) == float(original.get(key) or 0)


@pytest.mark.parametrize(
    ("rope", "match"),
    [
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, r"rope_scaling\.rope_type"),
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}},
         r"rope_parameters\.rope_type"),
        ({"rope_scaling": {"type": "yarn", "factor": 4.0, "attention_factor": 0.5}},
         r"rope_scaling\.attention_factor"),
        ({"rope_scaling": {"type": "yarn", "factor": 4.0, "truncate": False}},
         r"rope_scaling\.truncate"),
        ({"rope_scaling": {"type": "yarn", "factor": 4.0, "low_freq_factor": 1.0}},
         r"rope_scaling\.low_freq_factor"),
    ],
)
def test_unsupported_rope_scaling_is_refused(rope: dict[str, object], match: str) -> None:
    config = hf_config_from_arch(DEEPSEEK_V3)
    for key in ("rope_parameters", "rope_scaling"):
        config.pop(key)
    config.update(rope)
    with pytest.raises(ArchError, match=match):
        arch_from_hf_config(config)


def test_invalid_yarn_names_field() -> None:
    with pytest.raises(ArchError, match=r"model\.yarn_factor"):
        DEEPSEEK_V3.replace(yarn_factor=0.5)
    with pytest.raises(ArchError, match=r"model\.rope_scaling"):
        DEEPSEEK_V3.replace(attention="gqa")
