"""GPU smoke test: a small MoE on the Transformer Engine spec, bf16 and FP8; the rollout
backends.

Builds the `tiny` architecture scaled up to GPU-sized matrices with the TE spec
on one GPU from the run config's `precision` and `recompute` groups, runs timed
forward/backward steps in bf16 (without recompute, with the H100 recipes' selective
recompute, with full recompute) and in each FP8 recipe the installed Transformer
Engine supports, and prints step time and model FLOPs
utilisation (MFU, from moerl.models.count). Then serves the `tiny` model through
our rollout server on Megatron's dynamic inference engine (CUDA graphs, continuous
batching) and compares its greedy tokens with the continuous engine's
(`gpu_smoke_rollout.py`), and prints the vLLM and
SGLang command lines the launcher would run. `--check` only imports everything and
prints those command lines (this is what runs on machines without a GPU).
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback

import torch
from gpu_smoke_rollout import dynamic_engine_check, print_engine_commands

from moerl.models.arch import TINY, MoEArch
from moerl.models.build import build_model
from moerl.models.count import train_flops_per_token
from moerl.models.features import resolve_precision, te_available
from moerl.models.precision import FP8_RECIPES, PrecisionConfig, RecomputeConfig
from moerl.parallel.groups import destroy_parallel, init_parallel
from moerl.parallel.layout import ParallelLayout

# Dense bf16 peak of one H100/H200 SXM (TFLOP/s); FP8 doubles it.
PEAK_BF16_TFLOPS = 989.0

SMOKE_ARCH: MoEArch = TINY.replace(
    name="smoke",
    hidden_size=2048,
    num_attention_heads=16,
    q_lora_rank=512,
    kv_lora_rank=256,
    qk_head_dim=128,
    qk_pos_emb_head_dim=64,
    v_head_dim=128,
    ffn_hidden_size=8192,
    num_experts=8,
    moe_ffn_hidden_size=1024,
    vocab_size=32768,
    max_position_embeddings=4096,
)


def time_steps(fp8: str | None, steps: int, seq: int, batch: int,
               recompute: RecomputeConfig | None = None) -> float:
    """Median seconds per forward+backward step, built from the run config's groups."""
    layout = ParallelLayout()
    init_parallel(layout, seed=0)
    try:
        precision = resolve_precision(PrecisionConfig(
            transformer_impl="transformer_engine", params_dtype="bf16", fp8=fp8))  # type: ignore[arg-type]
        (model,) = build_model(SMOKE_ARCH, layout, precision=precision, recompute=recompute,
                               backend="nccl")
        tokens = torch.randint(0, SMOKE_ARCH.vocab_size, (batch, seq), device="cuda")
        position_ids = torch.arange(seq, device="cuda").expand(batch, seq)
        times = []
        for _ in range(steps + 2):  # two warm-up steps
            torch.cuda.synchronize()
            start = time.perf_counter()
            loss = model(tokens, position_ids, None, labels=tokens).float().mean()
            loss.backward()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        return sorted(times[2:])[len(times[2:]) // 2]
    finally:
        destroy_parallel()


def te_modes(steps: int, seq: int, batch: int) -> list[str]:
    """Time bf16 and every FP8 recipe; the names of the modes that could not run."""
    if not te_available():
        print("gpu_smoke: Transformer Engine is not importable; the TE spec and FP8 cannot run")
        return ["bf16", "bf16+sel", "bf16+full", *FP8_RECIPES]
    flops = train_flops_per_token(SMOKE_ARCH, seq) * seq * batch
    failures = []
    # bf16 with the H100 recipes' selective recompute and with full recompute, then FP8.
    modes: list[tuple[str, str | None, RecomputeConfig | None]] = [
        ("bf16", None, None),
        ("bf16+sel", None, RecomputeConfig("selective", ["layernorm", "mla_up_proj", "moe_act"])),
        ("bf16+full", None, RecomputeConfig("full")),
        *[(recipe, recipe, None) for recipe in FP8_RECIPES],
    ]
    for name, mode, recompute in modes:
        peak = PEAK_BF16_TFLOPS * (2 if mode else 1)
        try:
            seconds = time_steps(mode, steps, seq, batch, recompute)
        except Exception as err:  # report every mode, then fail at the end
            failures.append(name)
            print(f"{name:>10}: could not run: {type(err).__name__}: {err}")
            traceback.print_exc(limit=3)
            continue
        mfu = flops / seconds / (peak * 1e12)
        print(f"{name:>10}: {seconds * 1e3:8.1f} ms/step  MFU {mfu:6.1%} (of {peak:.0f} TFLOP/s)")
    return failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--only", choices=("all", "te", "rollout"), default="all")
    parser.add_argument("--check", action="store_true", help="import-check only")
    args = parser.parse_args()
    print_engine_commands()
    if args.check:
        import fastapi.testclient  # noqa: F401  (what the rollout check serves through)

        import moerl.rollout.server  # noqa: F401

        print("gpu_smoke: imports ok")
        return 0
    if not torch.cuda.is_available():
        print("gpu_smoke: no GPU here; nothing run (use --check to import-check)")
        return 1
    failures = te_modes(args.steps, args.seq, args.batch) if args.only != "rollout" else []
    # Some FP8 recipes need newer GPUs (mxfp8: Blackwell): those are reported; the TE part
    # fails when bf16, with or without recompute, could not run.
    te_failed = any(name.startswith("bf16") for name in failures)
    rollout_failed = args.only != "te" and not dynamic_engine_check()
    if rollout_failed:
        failures.append("rollout-dynamic")
    if failures:
        print(f"gpu_smoke: not run or failed: {', '.join(failures)}")
    return 1 if te_failed or rollout_failed else 0


if __name__ == "__main__":
    sys.exit(main())
