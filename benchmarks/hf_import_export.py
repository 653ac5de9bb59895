"""`moerl hf import` and `moerl hf export` of a DeepSeek-V3 of about 1.3B parameters at
TP2 x EP2: the bytes each rank reads, each rank's peak memory, and transformers' logits
from the export against the original's.

    .venv/bin/python benchmarks/hf_import_export.py            # 1.3B, bf16 (~2.7 GB)
    .venv/bin/python benchmarks/hf_import_export.py --smoke    # a tiny model

The parent builds a random DeepSeek-V3 with transformers (no download) in bf16, saves
it in files of at most 1 GB (as releases are split), and computes its logits on a few
tokens. Then the real commands run on 4 ranks (torchrun, gloo): `moerl hf import ...
tp=2 ep=2 dtype=bfloat16`, which reports the bytes of tensors each rank read, and
`moerl hf export ... tp=2 ep=2 dtype=bfloat16`, every rank writing its own files.
transformers loads the export and its logits are compared with the original's (the
same bf16 weights: the difference should be 0). Peak memory is the largest RSS of any
process of each command (getrusage of the children), so it bounds every rank's.
`tests/distributed/test_hf_parity.py` checks the same at a tiny size.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from _smoke import parse_with_smoke

TABLE_TITLE = "hf import / export at TP2 x EP2"
SMOKE = {"size": "tiny"}
RANKS, LAYOUT = 4, ["tp=2", "ep=2"]
COMMON: dict[str, Any] = dict(
    n_shared_experts=1, routed_scaling_factor=2.5, n_group=2, topk_group=1,
    num_experts_per_tok=2, first_k_dense_replace=1, max_position_embeddings=256,
    rms_norm_eps=1e-6)
SIZES: dict[str, dict[str, Any]] = {
    "tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=128,
                 moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=4, n_routed_experts=8, kv_lora_rank=32, q_lora_rank=48,
                 qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16),
    # ~1.3B: embeddings 131M, 8 layers of MLA (15M each), 7 with 16 routed experts + 1
    # shared (147M each), the first dense (35M).
    "1b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
               moe_intermediate_size=1408, num_hidden_layers=8, num_attention_heads=16,
               num_key_value_heads=16, n_routed_experts=16, kv_lora_rank=512,
               q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128),
}


def build_checkpoint(size: str, out: Path) -> tuple[int, int]:
    """A random bf16 DeepSeek-V3 saved to `out`; (parameters, bytes on disk)."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    config = DeepseekV3Config(**COMMON, **SIZES[size])
    model = DeepseekV3ForCausalLM(config).to(torch.bfloat16).eval()
    for module in model.modules():  # a non-zero router bias, kept in float32 as releases do
        bias = getattr(module, "e_score_correction_bias", None)
        if isinstance(bias, torch.Tensor):
            module.e_score_correction_bias = 0.05 * torch.randn(bias.shape)
    model.save_pretrained(out, max_shard_size="1GB")
    params = sum(p.numel() for p in model.parameters())
    del model
    # The logits of the checkpoint as transformers loads it, as the export is loaded.
    reference = DeepseekV3ForCausalLM.from_pretrained(out, dtype=torch.bfloat16).eval()
    torch.save(logits(reference), out.parent / "logits.pt")
    return params, sum(f.stat().st_size for f in out.glob("*.safetensors"))


def logits(model: Any) -> Any:
    import torch

    ids = torch.randint(model.config.vocab_size, (2, 16),
                        generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        return model(ids).logits.float()


def run_ranks(args: list[str]) -> tuple[str, float, int]:
    """`moerl <args>` on RANKS ranks; (its output, seconds, peak RSS of any of its
    processes in bytes)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    src = str(Path(__file__).resolve().parents[1] / "src")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    # A wrapper of its own, so the peak RSS it reports is this command's alone.
    wrapper = ("import resource, subprocess, sys; rc = subprocess.run(sys.argv[1:]).returncode;"
               " print('PEAK_RSS_KB', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss);"
               " sys.exit(rc)")
    command = [sys.executable, "-c", wrapper, sys.executable, "-m", "torch.distributed.run",
               "--standalone", f"--nproc-per-node={RANKS}", "-m", "moerl.launchers.cli", *args]
    start = time.perf_counter()
    proc = subprocess.run(command, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if proc.returncode:
        sys.exit(f"moerl {' '.join(args)} failed:\n" + "\n".join(
            (proc.stdout + proc.stderr).splitlines()[-30:]))
    peak = re.search(r"PEAK_RSS_KB (\d+)", proc.stdout)
    return proc.stdout, seconds, int(peak[1]) * 1024 if peak else 0


def measure(size: str, tmp: Path) -> dict[str, Any]:
    import torch
    from transformers import DeepseekV3ForCausalLM

    hf_dir, weights, exported = tmp / "hf", tmp / "megatron", tmp / "exported"
    params, on_disk = build_checkpoint(size, hf_dir)
    out, import_s, import_rss = run_ranks(
        ["hf", "import", str(hf_dir), str(weights), *LAYOUT, "dtype=bfloat16"])
    read = re.search(r"read (\d+) bytes of tensors .*, at most (\d+) on one", out)
    assert read, f"the import's report is missing:\n{out}"
    _, export_s, export_rss = run_ranks(
        ["hf", "export", str(weights), str(exported), *LAYOUT, "dtype=bfloat16",
         f"model={weights / 'hf_config.json'}"])
    index = json.loads((exported / "model.safetensors.index.json").read_text())["weight_map"]
    writers = {re.sub(r"-\d+\.safetensors$", "", f) for f in index.values()}
    reloaded = DeepseekV3ForCausalLM.from_pretrained(exported, dtype=torch.bfloat16).eval()
    diff = (logits(reloaded) - torch.load(tmp / "logits.pt")).abs().max().item()
    return {"params": params, "on_disk": on_disk, "read_total": int(read[1]),
            "read_max": int(read[2]), "import_s": import_s, "import_rss": import_rss,
            "export_s": export_s, "export_rss": export_rss, "writers": len(writers),
            "logit_diff": diff}


def table(size: str, m: dict[str, Any]) -> str:
    gb = 1e9
    rows = [
        ("parameters (M)", f"{m['params'] / 1e6:.1f}"),
        ("checkpoint on disk (MB, bf16)", f"{m['on_disk'] / 1e6:.1f}"),
        ("import: MB read, all ranks", f"{m['read_total'] / 1e6:.1f}"),
        ("import: MB read, largest rank", f"{m['read_max'] / 1e6:.1f}"),
        ("import: largest rank's read / checkpoint", f"{m['read_max'] / m['on_disk']:.2f}"),
        ("import: seconds (4 ranks, start-up included)", f"{m['import_s']:.1f}"),
        ("import: peak RSS of any process (GB)", f"{m['import_rss'] / gb:.2f}"),
        ("export: seconds (4 ranks, start-up included)", f"{m['export_s']:.1f}"),
        ("export: peak RSS of any process (GB)", f"{m['export_rss'] / gb:.2f}"),
        ("export: ranks that wrote files", f"{m['writers']} of {RANKS}"),
        ("max |logit| difference, export vs original", f"{m['logit_diff']:.2e}"),
    ]
    lines = [f"{TABLE_TITLE} ({size})"]
    lines += [f"{name:46} {value:>12}" for name, value in rows]
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="1b", choices=list(SIZES))
    return parse_with_smoke(parser, SMOKE, argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        print(table(args.size, measure(args.size, Path(tmp))))


if __name__ == "__main__":
    main()
