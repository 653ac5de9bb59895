"""The tiny MoE builds and trains in one process; the precision and recompute groups
reach Megatron's config; what needs a GPU or Transformer Engine fails clearly on CPU."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch
from megatron.core.transformer.identity_op import IdentityOp

from moerl.models.arch import PRESETS, TINY, MoEArch
from moerl.models.build import BuildError, build_layer_spec, build_transformer_config
from moerl.models.features import resolve_precision
from moerl.models.mla_local import MLADotProductAttention, TPExactMLASelfAttention
from moerl.models.precision import (
    PrecisionConfig,
    PrecisionUnavailable,
    RecomputeConfig,
    ResolvedPrecision,
)
from moerl.parallel.layout import ParallelLayout

FORWARD_BACKWARD = """
import torch
from moerl.models.arch import TINY
from moerl.models.build import build_model
from moerl.parallel.groups import init_parallel
from moerl.parallel.layout import ParallelLayout

init_parallel(ParallelLayout(), seed=0)
(model,) = build_model(TINY, ParallelLayout())
tokens = torch.randint(TINY.vocab_size, (2, 16))  # [b, s]
positions = torch.arange(16).expand(2, 16)
losses = model(tokens, positions, None, labels=tokens, loss_mask=torch.ones(2, 16))
assert losses.shape == (2, 16), losses.shape  # per-token LM loss
assert abs(losses.mean().item() - torch.log(torch.tensor(float(TINY.vocab_size))).item()) < 0.5
losses.mean().backward()
grads = {n: p.grad for n, p in model.named_parameters()}
assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
assert any("mtp" in n for n in grads)  # the MTP layer is built and trained
assert any("shared_experts" in n for n in grads)
assert any("expert_bias" in n for n, _ in model.named_buffers())
# MLA's q and kv latent norms, in every decoder layer and the MTP layer, in the graph.
modules = dict(model.named_modules())
attentions = [n for n in modules if n.endswith("self_attention")]
assert len(attentions) == TINY.num_layers + TINY.mtp_num_layers, attentions
for name in attentions:
    for norm, width in (("q_layernorm", TINY.q_lora_rank), ("kv_layernorm", TINY.kv_lora_rank)):
        assert type(modules[f"{name}.{norm}"]).__name__ == "RMSNorm", (name, norm)
        assert grads[f"{name}.{norm}.weight"].shape == (width,)
        assert grads[f"{name}.{norm}.weight"].abs().sum() > 0, (name, norm)
print("ok")
"""


def test_tiny_forward_backward() -> None:
    # A process of its own: Megatron keeps process-global state (memoised rotary
    # tables, the MoE loss tracker) that other tests' models share.
    proc = subprocess.run([sys.executable, "-c", FORWARD_BACKWARD], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


@pytest.mark.usefixtures("single_process")
def test_spec_has_dense_first_layer_and_mla_fixes() -> None:
    config = build_transformer_config(TINY, ParallelLayout())
    assert config.moe_layer_freq == [0, 1, 1, 1]
    block, mtp = build_layer_spec(config, te=False)
    assert mtp is not None
    attention = block.layer_specs[0].submodules.self_attention
    assert attention.module is TPExactMLASelfAttention
    assert attention.submodules.core_attention is MLADotProductAttention


@pytest.mark.usefixtures("single_process")
@pytest.mark.parametrize("arch", [a for a in PRESETS.values() if a.attention == "mla"],
                         ids=lambda a: a.name)
def test_presets_build_mla_latent_norms(arch: MoEArch) -> None:
    """Every shipped MLA preset has RMSNorms on the q and kv latents, as DeepSeek-V3
    family checkpoints do; the decoder and MTP layer specs build them."""
    assert arch.latent_norms
    config = build_transformer_config(arch, ParallelLayout())
    assert config.qk_layernorm
    block, mtp = build_layer_spec(config, te=False)
    specs = [*block.layer_specs, *(mtp.layer_specs if mtp is not None else [])]
    for spec in specs:
        attention = (spec.submodules.mtp_model_layer if hasattr(spec.submodules, "mtp_model_layer")
                     else spec).submodules.self_attention.submodules
        assert attention.q_layernorm is not IdentityOp and attention.kv_layernorm is not IdentityOp


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU error")
@pytest.mark.parametrize(("precision", "field"), [
    (PrecisionConfig(transformer_impl="transformer_engine"), "precision.transformer_impl"),
    (PrecisionConfig(fp8="delayed"), "precision.fp8"),
    (PrecisionConfig(transformer_impl="transformer_engine", fp8="mxfp8"),
     "precision.transformer_impl"),
    (PrecisionConfig(params_dtype="bf16"), "precision.params_dtype"),
    (PrecisionConfig(offload_optimizer=True), "precision.offload_optimizer"),
    (PrecisionConfig(offload_activations_layers=1), "precision.offload_activations_layers"),
])  # fmt: skip
def test_what_needs_a_gpu_is_refused_on_cpu_naming_the_field(
        precision: PrecisionConfig, field: str) -> None:
    with pytest.raises(PrecisionUnavailable, match=rf"^{re.escape(field)}"):
        resolve_precision(precision)


def test_cpu_resolves_to_the_local_spec_in_fp32() -> None:
    if torch.cuda.is_available():
        pytest.skip("checks the CPU default")
    assert resolve_precision(PrecisionConfig()) == ResolvedPrecision(te=False, bf16=False)
    assert resolve_precision(PrecisionConfig(transformer_impl="local", params_dtype="fp32")).te \
        is False


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"fp8_param": True}, "precision.fp8_param"),
    ({"fp8": "delayed", "transformer_impl": "local"}, "precision.fp8"),
    ({"fp8": "delayed", "params_dtype": "fp32"}, "precision.fp8"),
])  # fmt: skip
def test_impossible_precision_combinations(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=rf"^{re.escape(field)}"):
        PrecisionConfig(**kwargs)  # type: ignore[arg-type]


@pytest.mark.usefixtures("single_process")
def test_precision_and_recompute_reach_the_transformer_config() -> None:
    """What the groups say is what Megatron's config holds, field by field."""
    fp8 = ResolvedPrecision(te=True, bf16=True, config=PrecisionConfig(
        fp8="blockwise", fp8_param=True, fp8_bf16_layers_at_start=1, fp8_bf16_layers_at_end=2,
        offload_activations_layers=2))
    assert fp8.transformer_kwargs() == {
        "fp8": "e4m3", "fp8_recipe": "blockwise", "fp8_param": True,
        "first_last_layers_bf16": True, "num_layers_at_start_in_bf16": 1,
        "num_layers_at_end_in_bf16": 2, "cpu_offloading": True, "cpu_offloading_num_layers": 2,
        "cpu_offloading_activations": True, "cpu_offloading_weights": False}
    assert ResolvedPrecision(te=True, bf16=True, config=PrecisionConfig(
        fp8="tensorwise")).transformer_kwargs()["fp8"] == "hybrid"
    full = build_transformer_config(TINY, ParallelLayout(), recompute=RecomputeConfig(
        granularity="full", method="block", num_layers=2))
    assert (full.recompute_granularity, full.recompute_method, full.recompute_num_layers) == (
        "full", "block", 2)
    selective = build_transformer_config(TINY, ParallelLayout(), recompute=RecomputeConfig(
        granularity="selective", modules=["core_attn", "moe"]))
    assert selective.recompute_granularity == "selective"
    assert selective.recompute_modules == ["core_attn", "moe"]
    plain = build_transformer_config(TINY, ParallelLayout())
    assert plain.recompute_granularity is None and plain.params_dtype == torch.float32
    assert plain.fp8 is None


def test_recompute_modules_the_local_spec_cannot_recompute_are_refused() -> None:
    with pytest.raises(BuildError, match=r"recompute\.modules.*moe_act"):
        build_transformer_config(TINY, ParallelLayout(), recompute=RecomputeConfig(
            granularity="selective", modules=["moe_act"]))
    with pytest.raises(ValueError, match=r"recompute\.modules: unknown \['attention'\]"):
        RecomputeConfig(granularity="selective", modules=["attention"])
