"""The tiny MoE builds and trains in one process; TE-only features fail clearly on CPU."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from moerl.models.arch import TINY
from moerl.models.build import BuildError, build_layer_spec, build_model, build_transformer_config
from moerl.models.mla_local import MLADotProductAttention, TPExactMLASelfAttention
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
    config = build_transformer_config(TINY, ParallelLayout(), te=False)
    assert config.moe_layer_freq == [0, 1, 1, 1]
    block, mtp = build_layer_spec(config, te=False)
    assert mtp is not None
    attention = block.layer_specs[0].submodules.self_attention
    assert attention.module is TPExactMLASelfAttention
    assert attention.submodules.core_attention is MLADotProductAttention


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU error")
@pytest.mark.parametrize(("te", "fp8", "feature"), [
    (True, None, "model.te"),
    (False, "delayed", "model.fp8"),
    (True, "mxfp8", "model.te"),
])
def test_te_and_fp8_need_transformer_engine(te: bool, fp8: str | None, feature: str) -> None:
    with pytest.raises(BuildError, match=rf"{feature}.*Transformer Engine"):
        build_model(TINY, ParallelLayout(), te=te, fp8=fp8)


def test_unknown_fp8_recipe() -> None:
    with pytest.raises(BuildError, match=r"model\.fp8: unknown recipe"):
        build_transformer_config(TINY, ParallelLayout(), te=True, fp8="e5m2")
