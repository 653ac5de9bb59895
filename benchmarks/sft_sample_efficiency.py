"""SFT sample efficiency: held-out greedy pass rate after N SFT steps, for the tiny
preset, variants that each change one thing, and a Hugging Face Qwen3-MoE of the same
parameter count trained the same way (`qwen3_moe`: same rows in the same order, steps,
batch, optimizer and schedule; a character tokenizer; see `_hf_side.py`), each in one
process, on 3 seeds.

Tasks (`--task`, see `_sft_tasks.py`): `copy`, whose answers copy multi-digit numbers
from the prompt ("Return n plus 4817." -> `return n + 4817`, "Return the list [3, 91,
27] reversed." -> `return [27, 91, 3]`), held-out prompts never trained on; `demo`, the
demo's rows (single-digit constants), every demonstration correct.

A held-out task counts when the first line of its greedy completion passes the task's
unit tests (run in a fresh `python3 -I`); "digit" is the mean loss on the digits of
the held-out references (ln 10 = 2.30 is a guess among digits).

    .venv/bin/python benchmarks/sft_sample_efficiency.py [--task copy] [--steps 21,42,63] \
        [--variants preset,qwen3_moe,...] [--seeds 0,1,2] [--lr 3e-3]
    .venv/bin/python benchmarks/sft_sample_efficiency.py --smoke   # 2 steps, 4 tasks
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from typing import Any

from _hf_side import HF_MODELS
from _sft_tasks import Task, digit_positions, load_tasks
from _smoke import parse_with_smoke

TABLE_TITLE = "SFT sample efficiency: held-out greedy pass rate / digit loss"
NEEDS_MODULES = ("transformers",)
SMOKE = {"steps": "1,2", "variants": "preset,qwen3_moe", "eval_size": 4, "train_size": 64,
         "seeds": "0"}
QWEN = "qwen3_moe"
# The Hugging Face side and its diagnostic variants.
QWEN_VARIANTS = tuple(HF_MODELS)


@dataclass(frozen=True)
class Variant:
    """One change from the preset: arch fields, and the SFT learning-rate schedule."""

    arch: dict[str, object]
    lr: float | None = None  # None: --lr
    cosine: bool = True  # False: constant after warm-up
    init_std: float | None = None  # None: --init-std, or the model's own
    optim: dict[str, float] = field(default_factory=dict)  # OptimConfig fields
    megatron: dict[str, object] = field(default_factory=dict)  # TransformerConfig fields
    logit_scale: float = 1.0  # attention softmax scale multiplied by this after building
    head_qk_norms: bool = False  # MLA with per-head q/k RMSNorms (`_attention_variants`)


VARIANTS: dict[str, Variant] = {
    "preset": Variant({}),
    "gqa": Variant({"attention": "gqa", "num_query_groups": 2, "kv_channels": 32}),
    # Qwen3's attention: per-head RMSNorms of queries and keys.
    "gqa_qk_norm": Variant({"attention": "gqa", "num_query_groups": 2, "kv_channels": 32},
                           megatron={"qk_layernorm": True}),
    "qwen_like": Variant({"attention": "gqa", "num_query_groups": 4, "kv_channels": 32,
                          "mtp_num_layers": 0, "router_score": "softmax",
                          "router_expert_bias": False, "router_num_groups": None,
                          "router_group_topk": None}, megatron={"qk_layernorm": True}),
    # MLA with per-head q/k norms; the preset's attention logits 4x and 16x larger.
    "head_qk_norm": Variant({}, head_qk_norms=True),
    "logits_x4": Variant({}, logit_scale=4.0),
    "logits_x16": Variant({}, logit_scale=16.0),
    "no_mtp": Variant({"mtp_num_layers": 0}),
    "no_aux": Variant({"aux_loss_coeff": 0.0}),
    "no_bias": Variant({"router_expert_bias": False}),
    "softmax": Variant({"router_score": "softmax", "router_expert_bias": False,
                        "router_num_groups": None, "router_group_topk": None}),
    "rope32": Variant({"qk_pos_emb_head_dim": 32}),
    "rope64": Variant({"qk_pos_emb_head_dim": 64}),
    "dense0": Variant({"first_k_dense": 0}),
    "no_latent_norms": Variant({"latent_norms": False}),
    "base100": Variant({"rotary_base": 100.0}),
    "tied": Variant({"untie_embeddings": False}),
    "heads8": Variant({"num_attention_heads": 8}),
    "wide": Variant({"hidden_size": 256}),
    "lr1e-3": Variant({}, lr=1e-3),
    "lr6e-3": Variant({}, lr=6e-3),
    "beta2_999": Variant({}, optim={"adam_beta2": 0.999}),
    "const_lr": Variant({}, cosine=False),
    "std0.006": Variant({}, init_std=0.006),
    "std0.05": Variant({}, init_std=0.05),
}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--task", choices=("copy", "demo"), default="copy")
    parser.add_argument("--max-constant", type=int, default=10_000,
                        help="copy task: numbers below this (constants from 10)")
    parser.add_argument("--steps", default="21,42,63", help="evaluate after these steps")
    parser.add_argument("--variants", default=f"preset,{QWEN}",
                        help=f"comma-separated, from: {', '.join([*VARIANTS, *QWEN_VARIANTS])}")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated data/init seeds")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument("--train-size", type=int, default=2016, help="63 steps of 32 rows")
    parser.add_argument("--eval-size", type=int, default=60)
    parser.add_argument("--init-std", type=float, default=None,
                        help="override the init std of every moerl variant")
    return parse_with_smoke(parser, SMOKE, argv)


@dataclass(frozen=True)
class Setup:
    """What both sides share for one seed."""

    train: list[Task]
    held: list[Task]
    seed: int
    checkpoints: list[int]
    seq_length: int  # tokens per row: [BOS] prompt response [EOS] fits in seq_length + 1
    max_tokens: int  # greedy tokens generated per held-out prompt

    @classmethod
    def make(cls, args: argparse.Namespace, seed: int, checkpoints: list[int]) -> Setup:
        train, held = load_tasks(args.task, args.train_size, args.eval_size, seed,
                                 args.max_constant)
        longest = max(len(t.prompt) + len(t.reference) for t in [*train, *held])
        return cls(train, held, seed, checkpoints, seq_length=-(-(longest + 2) // 8) * 8,
                   max_tokens=max(len(t.reference) for t in held) + 8)


def optim_config(variant: Variant, args: argparse.Namespace, setup: Setup) -> tuple[Any, Any]:
    """(SFTConfig, OptimConfig) of a run: moerl's SFT schedule, changed by `variant`."""
    from moerl.trainer.config import OptimConfig, SFTConfig
    from moerl.trainer.sft import sft_optim

    steps = setup.checkpoints[-1]
    lr = variant.lr or args.lr
    cfg = SFTConfig(steps=steps, global_batch=args.global_batch, micro_batch=8,
                    seq_length=setup.seq_length, lr=lr, warmup_steps=min(10, steps - 1))
    optim = sft_optim(cfg)
    if not variant.cosine:
        optim = OptimConfig(lr=lr, min_lr=lr, warmup_steps=optim.warmup_steps,
                            decay_steps=optim.decay_steps)
    return cfg, replace(optim, **variant.optim)


def run_moerl(name: str, variant: Variant, args: argparse.Namespace,
              setup: Setup) -> list[tuple[float, float]]:
    """(pass rate, digit loss) after each checkpoint step of one SFT run of moerl's."""
    import torch
    from _attention_variants import head_qk_norms, scale_attention_logits

    from moerl.data.sft import encode_example, sft_batch
    from moerl.data.tokenizer import ByteTokenizer
    from moerl.models.arch import TINY
    from moerl.models.build import build_model
    from moerl.parallel.groups import destroy_parallel, init_parallel
    from moerl.parallel.layout import ParallelLayout
    from moerl.rollout.engine import EngineOptions, MegatronEngine
    from moerl.rollout.types import GenerationRequest, SamplingParams
    from moerl.trainer.config import SFTConfig
    from moerl.trainer.optimizer import build_optimizer
    from moerl.trainer.sft import run_sft

    arch = TINY.replace(name=f"tiny-{name}", **variant.arch)
    tok = ByteTokenizer(arch.vocab_size)
    examples = [encode_example(tok, t.prompt, t.reference) for t in setup.train]
    cfg, optim = optim_config(variant, args, setup)
    layout = ParallelLayout()
    groups = init_parallel(layout, seed=setup.seed)
    init_std = variant.init_std or args.init_std
    overrides = dict(variant.megatron)
    if init_std is not None:
        overrides["init_method_std"] = init_std
    try:
        with head_qk_norms() if variant.head_qk_norms else nullcontext():
            chunks = build_model(arch, layout, **overrides)
        if variant.logit_scale != 1.0:
            scale_attention_logits(chunks, variant.logit_scale)
        trainable = build_optimizer(chunks, optim, layout)
        model = chunks[0]
        held = [encode_example(tok, t.prompt, t.reference) for t in setup.held]
        eval_batch = sft_batch(held, cfg.seq_length, tok.pad_id)
        greedy = SamplingParams(max_tokens=setup.max_tokens, temperature=0.0, stop=("\n",))
        results: list[tuple[float, float]] = []
        done = 0
        for stop in setup.checkpoints:
            run_sft(trainable, groups, examples, SFTConfig(**{**cfg.__dict__, "steps": stop}),
                    tok.pad_id, start_step=done)
            done = stop
            model.eval()
            with torch.no_grad():
                per_token = model(eval_batch.tokens, eval_batch.position_ids, None,
                                  labels=eval_batch.labels)  # [b, s]
            digits = [float(per_token[row, len(ex.prompt_ids) - 1 + i])
                      for row, (ex, t) in enumerate(zip(held, setup.held, strict=True))
                      for i in digit_positions(t)]
            engine = MegatronEngine(model, tok, arch.max_position_embeddings,
                                    EngineOptions(max_batch=64, backend="static"))
            samples = engine.generate([GenerationRequest(list(e.prompt_ids), greedy)
                                       for e in held])
            ok = sum(t.passes(s.text) for t, (s,) in zip(setup.held, samples, strict=True))
            results.append((ok / len(held), statistics.fmean(digits)))
            model.train()
        return results
    finally:
        destroy_parallel()


def run_qwen(name: str, args: argparse.Namespace, setup: Setup) -> list[tuple[float, float]]:
    """The same, for the Qwen3-MoE side (`_hf_side.py`)."""
    from _hf_side import CharTokenizer, build_adam, evaluate, train_steps

    from moerl.data.sft import encode_example

    tok = CharTokenizer()
    cfg, optim = optim_config(Variant({}), args, setup)
    model = HF_MODELS[name](tok, setup.seed)
    adam, scheduler = build_adam(model, optim)
    rows = [encode_example(tok, t.prompt, t.reference) for t in setup.train]  # type: ignore[arg-type]
    results, done = [], 0
    for stop in setup.checkpoints:
        train_steps(model, adam, scheduler, rows, done, stop, cfg.global_batch, cfg.seq_length,
                    tok.pad_id, optim.clip_grad)
        done = stop
        results.append(evaluate(model, tok, setup.held, setup.max_tokens, cfg.seq_length))
    return results


Row = tuple[str, int, list[tuple[float, float]], float]


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    checkpoints = sorted(int(s) for s in args.steps.split(","))
    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS and n not in QWEN_VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; choose from {[*VARIANTS, *QWEN_VARIANTS]}")
    rows: list[Row] = []
    for seed in (int(s) for s in args.seeds.split(",")):
        setup = Setup.make(args, seed, checkpoints)
        for name in names:
            start = time.perf_counter()
            results = (run_qwen(name, args, setup) if name in QWEN_VARIANTS
                       else run_moerl(name, VARIANTS[name], args, setup))
            rows.append((name, seed, results, time.perf_counter() - start))
            _print_row(*rows[-1])
            sys.stdout.flush()
    print(f"{TABLE_TITLE} ({args.task} task, {args.eval_size} held-out prompts)")
    print(_header(checkpoints))
    for row in rows:
        _print_row(*row)
    _print_summary(rows, names, checkpoints[-1])


def _header(checkpoints: list[int]) -> str:
    cells = "".join(f"{f'step {s}':>15}" for s in checkpoints)
    return f"{'variant':<16}{'seed':>5}{cells}{'s':>7}"


def _print_row(name: str, seed: int, results: list[tuple[float, float]],
               seconds: float) -> None:
    cells = "".join(f"{rate:>8.0%} {digit:>5.2f} " for rate, digit in results)
    print(f"{name:<16}{seed:>5}{cells}{seconds:>7.0f}")


def _print_summary(rows: list[Row], names: list[str], last: int) -> None:
    print(f"pass rate after {last} steps, per seed (median):")
    for name in names:
        rates = [results[-1][0] for n, _, results, _ in rows if n == name]
        cells = " ".join(f"{r:.0%}" for r in rates)
        print(f"  {name:<16}{cells}  ({statistics.median(rates):.0%})")


if __name__ == "__main__":
    main()
