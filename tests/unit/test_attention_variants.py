"""The attention changes of benchmarks/sft_sample_efficiency.py's diagnostic variants do
what they say on the built model: per-head q/k norms give each head's query and key an
RMS of 1 (times its learned gain, trained with the rest), and the logit scale multiplies
every layer's softmax scale."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"

CHECK = """
import sys
sys.path.insert(0, sys.argv[1])
import torch
from _attention_variants import HeadNormMLA, head_qk_norms, scale_attention_logits
from moerl.models.arch import TINY
from moerl.models.build import build_model
from moerl.models.mla_local import TPExactMLASelfAttention
from moerl.parallel.groups import init_parallel
from moerl.parallel.layout import ParallelLayout

arch = TINY.replace(mtp_num_layers=0, latent_norms=True)
init_parallel(ParallelLayout(), seed=0)
with head_qk_norms():
    (normed,) = build_model(arch, ParallelLayout())
(plain,) = build_model(arch, ParallelLayout())
heads = [m for m in normed.modules() if isinstance(m, TPExactMLASelfAttention)]
assert len(heads) == arch.num_layers and all(isinstance(m, HeadNormMLA) for m in heads)
assert not any(isinstance(m, HeadNormMLA) for m in plain.modules())

hidden = torch.randn(16, 2, arch.hidden_size) * 3  # [s, b, h]
attention = heads[0]
original = TPExactMLASelfAttention.get_query_key_value_tensors
with torch.no_grad():
    attention.k_head_gain.fill_(2.0)
    query, key, *_ = attention.get_query_key_value_tensors(hidden, None)
    raw_q, *_ = original(attention, hidden, None)
rms = lambda t: t.pow(2).mean(-1).sqrt()
assert torch.allclose(rms(query), torch.ones_like(rms(query)), atol=1e-3), rms(query)
assert torch.allclose(rms(key), torch.full_like(rms(key), 2.0), atol=2e-3), rms(key)
assert not torch.allclose(rms(raw_q), torch.ones_like(rms(raw_q)), atol=0.1)
# the direction of each head is kept: only its length changes
cos = torch.nn.functional.cosine_similarity(query, raw_q, dim=-1)
assert torch.allclose(cos, torch.ones_like(cos), atol=1e-4)

tokens = torch.randint(arch.vocab_size, (2, 16))
positions = torch.arange(16).expand(2, 16)
normed(tokens, positions, None, labels=tokens).mean().backward()
assert attention.q_head_gain.grad is not None and attention.q_head_gain.grad.abs().sum() > 0

before = [(m.softmax_scale, m.core_attention.softmax_scale) for m in plain.modules()
          if hasattr(m, "core_attention")]
scale_attention_logits([plain], 4.0)
after = [(m.softmax_scale, m.core_attention.softmax_scale) for m in plain.modules()
         if hasattr(m, "core_attention")]
assert len(after) == arch.num_layers
assert all(a == 4.0 * b and ca == 4.0 * cb for (a, ca), (b, cb) in zip(after, before))
print("ok")
"""


def test_head_qk_norms_and_logit_scale() -> None:
    done = subprocess.run([sys.executable, "-c", CHECK, str(BENCHMARKS)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
