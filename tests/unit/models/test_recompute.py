"""Activation recompute from the `recompute` group on the local spec (CPU): the
checkpointed blocks really run twice, and the gradients equal those of the model
without recompute, for every setting the local spec allows."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

SCRIPT = """
import json, torch
from moerl.models.arch import TINY
from moerl.models.build import build_model
from moerl.models.precision import RecomputeConfig
from moerl.parallel.groups import init_parallel
from moerl.parallel.layout import ParallelLayout

init_parallel(ParallelLayout(), seed=0)
tokens = torch.randint(TINY.vocab_size, (2, 16))
positions = torch.arange(16).expand(2, 16)

def run(model):
    calls = {"layer": [0] * TINY.num_layers, "core_attn": 0}
    hooks = [layer.register_forward_hook(lambda *_, i=i: calls["layer"].__setitem__(i,
             calls["layer"][i] + 1)) for i, layer in enumerate(model.decoder.layers)]
    hooks += [layer.self_attention.core_attention.register_forward_hook(
        lambda *_: calls.__setitem__("core_attn", calls["core_attn"] + 1))
        for layer in model.decoder.layers]
    model.zero_grad()
    loss = model(tokens, positions, None, labels=tokens, loss_mask=torch.ones(2, 16)).mean()
    loss.backward()
    for hook in hooks:
        hook.remove()
    return calls, {n: p.grad.clone() for n, p in model.named_parameters()}

(base,) = build_model(TINY, ParallelLayout())
base_calls, base_grads = run(base)
out = {"none": {"calls": base_calls, "diff": 0.0}}
for name, cfg in [
    ("full_uniform", RecomputeConfig("full", method="uniform", num_layers=1)),
    ("full_block_2", RecomputeConfig("full", method="block", num_layers=2)),
    ("selective_core_attn", RecomputeConfig("selective", modules=["core_attn"])),
    ("selective_rest", RecomputeConfig("selective",
                                       modules=["mla_up_proj", "mlp", "moe", "shared_experts"])),
]:
    (model,) = build_model(TINY, ParallelLayout(), recompute=cfg)
    model.load_state_dict(base.state_dict())
    calls, grads = run(model)
    diff = max((grads[n] - base_grads[n]).abs().max().item() for n in base_grads)
    out[name] = {"calls": calls, "diff": diff}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def measured() -> dict[str, dict[str, object]]:
    # A process of its own: Megatron keeps process-global state between models.
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          timeout=300, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result: dict[str, dict[str, object]] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def test_without_recompute_each_block_runs_once(measured: dict[str, dict[str, object]]) -> None:
    assert measured["none"]["calls"] == {"layer": [1, 1, 1, 1], "core_attn": 4}


def test_full_recompute_reruns_the_layers_it_says(measured: dict[str, dict[str, object]]) -> None:
    assert measured["full_uniform"]["calls"] == {"layer": [2, 2, 2, 2], "core_attn": 8}
    # block: the first num_layers layers of the stage only
    assert measured["full_block_2"]["calls"] == {"layer": [2, 2, 1, 1], "core_attn": 6}


def test_selective_recompute_reruns_the_attention_core_only(
        measured: dict[str, dict[str, object]]) -> None:
    assert measured["selective_core_attn"]["calls"] == {"layer": [1, 1, 1, 1], "core_attn": 8}


@pytest.mark.parametrize("name", ["full_uniform", "full_block_2", "selective_core_attn",
                                  "selective_rest"])
def test_recompute_leaves_every_gradient_unchanged(
        measured: dict[str, dict[str, object]], name: str) -> None:
    assert measured[name]["diff"] == pytest.approx(0.0, abs=1e-6)
