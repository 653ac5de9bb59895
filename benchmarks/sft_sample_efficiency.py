"""SFT sample efficiency of the tiny MoE: held-out greedy answers after N SFT steps, for
variants of the preset that each change one thing, trained in one process on the same
demo rows (data.sft_correct_fraction=1.0: every demonstration is right, so the only
question is whether the model learns to copy the argument and the constant).

A held-out task counts when the first line of its greedy completion passes the
task's unit tests (run in a fresh `python3 -I`); "digit" is the mean loss on the
constant's token of the held-out references (ln 10 = 2.30 is a guess among digits).

    .venv/bin/python benchmarks/sft_sample_efficiency.py [--steps 50,100,150] \
        [--variants preset,gqa,no_mtp,...] [--lr 3e-3] [--seed 0]
    .venv/bin/python benchmarks/sft_sample_efficiency.py --smoke   # 2 steps, 4 tasks
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from _smoke import parse_with_smoke

TABLE_TITLE = "SFT sample efficiency: held-out greedy pass rate / digit loss"
SMOKE = {"steps": "1,2", "variants": "preset", "eval_size": 4, "train_size": 64}


@dataclass(frozen=True)
class Variant:
    """One change from the preset: arch fields, and the SFT learning-rate schedule."""

    arch: dict[str, object]
    lr: float | None = None  # None: --lr
    cosine: bool = True  # False: constant after warm-up
    init_std: float | None = None  # None: --init-std, or the model's own
    optim: dict[str, float] = field(default_factory=dict)  # OptimConfig fields


VARIANTS: dict[str, Variant] = {
    "preset": Variant({}),
    "gqa": Variant({"attention": "gqa", "num_query_groups": 2, "kv_channels": 32}),
    "no_mtp": Variant({"mtp_num_layers": 0}),
    "no_aux": Variant({"aux_loss_coeff": 0.0}),
    "no_bias": Variant({"router_expert_bias": False}),
    "softmax": Variant({"router_score": "softmax", "router_expert_bias": False,
                        "router_num_groups": None, "router_group_topk": None}),
    "rope32": Variant({"qk_pos_emb_head_dim": 32}),
    "rope64": Variant({"qk_pos_emb_head_dim": 64}),
    "dense0": Variant({"first_k_dense": 0}),
    "latent_norms": Variant({"latent_norms": True}),
    "base100": Variant({"rotary_base": 100.0}),
    "base100_rope32": Variant({"rotary_base": 100.0, "qk_pos_emb_head_dim": 32}),
    "tied": Variant({"untie_embeddings": False}),
    "heads8": Variant({"num_attention_heads": 8}),
    "wide": Variant({"hidden_size": 256}),
    "lr1e-3": Variant({}, lr=1e-3),
    "lr2e-3": Variant({}, lr=2e-3),
    "eps1e-15": Variant({}, optim={"adam_eps": 1e-15}),
    "beta2_999": Variant({}, optim={"adam_beta2": 0.999}),
    "lr6e-3": Variant({}, lr=6e-3),
    "const_lr": Variant({}, cosine=False),
    "std0.006": Variant({}, init_std=0.006),
    "std0.05": Variant({}, init_std=0.05),
}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", default="50,100,150", help="evaluate after these steps")
    parser.add_argument("--variants", default="preset,gqa,no_mtp,tied,lr1e-3,const_lr",
                        help=f"comma-separated, from: {', '.join(VARIANTS)}")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument("--train-size", type=int, default=2000)
    parser.add_argument("--eval-size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--init-std", type=float, default=None,
                        help="override the init std of every variant")
    return parse_with_smoke(parser, SMOKE, argv)


def passes(program: str, tests: str, entry_point: str, timeout: float = 5.0) -> bool:
    """Whether `program` passes `tests` in a fresh isolated interpreter."""
    source = f"{program}\n{tests}\ncheck({entry_point})\n"
    try:
        done = subprocess.run([sys.executable, "-I", "-c", source], capture_output=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return False
    return done.returncode == 0


def run_variant(name: str, variant: Variant, args: argparse.Namespace,
                checkpoints: list[int]) -> list[tuple[float, float]]:
    """(pass rate, digit loss) after each checkpoint step of one SFT run."""
    import torch

    from moerl.data.code_tasks import make_tasks
    from moerl.data.prompts import DataConfig, load_prompts
    from moerl.data.sft import encode_example, instruction_examples, sft_batch
    from moerl.data.tokenizer import ByteTokenizer
    from moerl.models.arch import TINY
    from moerl.models.build import build_model
    from moerl.parallel.groups import destroy_parallel, init_parallel
    from moerl.parallel.layout import ParallelLayout
    from moerl.rollout.engine import EngineOptions, MegatronEngine
    from moerl.rollout.types import GenerationRequest, SamplingParams
    from moerl.trainer.config import OptimConfig, SFTConfig
    from moerl.trainer.optimizer import build_optimizer
    from moerl.trainer.sft import run_sft, sft_optim

    arch = TINY.replace(name=f"tiny-{name}", **variant.arch)
    data = DataConfig(train_size=args.train_size, eval_size=args.eval_size, seed=args.seed,
                      sft_correct_fraction=1.0)
    train, _, _ = load_prompts(data)
    # The held-out prompts of the demo, with their tests.
    tasks = make_tasks(args.eval_size, data.seed + 1_000_003, "eval")
    tok = ByteTokenizer(arch.vocab_size)
    examples = instruction_examples(tok, None, train)
    lr = variant.lr or args.lr
    cfg = SFTConfig(steps=checkpoints[-1], global_batch=args.global_batch, micro_batch=8,
                    seq_length=72, lr=lr, warmup_steps=min(10, checkpoints[-1] - 1))
    optim = sft_optim(cfg)
    if not variant.cosine:
        optim = OptimConfig(lr=lr, min_lr=lr, warmup_steps=optim.warmup_steps,
                            decay_steps=optim.decay_steps)
    optim = replace(optim, **variant.optim)
    layout = ParallelLayout()
    groups = init_parallel(layout, seed=args.seed)
    init_std = variant.init_std or args.init_std
    overrides = {} if init_std is None else {"init_method_std": init_std}
    try:
        chunks = build_model(arch, layout, **overrides)
        trainable = build_optimizer(chunks, optim, layout)
        model = chunks[0]
        held = [encode_example(tok, t.prompt, t.reference) for t in tasks]
        digit_at = [len(e.prompt_ids) + len(tok.encode(t.reference.rstrip("\n"))) - 2
                    for e, t in zip(held, tasks, strict=True)]  # input position predicting it
        eval_batch = sft_batch(held, cfg.seq_length, tok.pad_id)
        results: list[tuple[float, float]] = []
        done = 0
        for stop in checkpoints:
            cfg_to = SFTConfig(**{**cfg.__dict__, "steps": stop})
            run_sft(trainable, groups, examples, cfg_to, tok.pad_id, start_step=done)
            done = stop
            model.eval()
            with torch.no_grad():
                per_token = model(eval_batch.tokens, eval_batch.position_ids, None,
                                  labels=eval_batch.labels)  # [b, s]
            digit = float(per_token[torch.arange(len(held)), torch.tensor(digit_at)].mean())
            engine = MegatronEngine(model, tok, arch.max_position_embeddings,
                                    EngineOptions(max_batch=64, backend="static"))
            greedy = SamplingParams(max_tokens=24, temperature=0.0, stop=("\n",))
            samples = engine.generate([GenerationRequest(list(e.prompt_ids), greedy)
                                       for e in held])
            ok = 0
            for task, (sample,) in zip(tasks, samples, strict=True):
                line = sample.text.split("\n")[0] + "\n"
                ok += passes(task.program(line), task.tests, task.entry_point)
            results.append((ok / len(tasks), digit))
            model.train()
        return results
    finally:
        destroy_parallel()


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    checkpoints = sorted(int(s) for s in args.steps.split(","))
    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    rows: list[tuple[str, list[tuple[float, float]], float]] = []
    for name in names:
        start = time.perf_counter()
        rows.append((name, run_variant(name, VARIANTS[name], args, checkpoints),
                     time.perf_counter() - start))
        _print_row(*rows[-1])
        sys.stdout.flush()
    print(TABLE_TITLE)
    print(_header(checkpoints))
    for row in rows:
        _print_row(*row)


def _header(checkpoints: list[int]) -> str:
    cells = "".join(f"{f'step {s}':>15}" for s in checkpoints)
    return f"{'variant (pass, digit loss)':<16}{cells}{'s':>7}"


def _print_row(name: str, results: list[tuple[float, float]], seconds: float) -> None:
    cells = "".join(f"{rate:>8.0%} {digit:>5.2f} " for rate, digit in results)
    print(f"{name:<16}{cells}{seconds:>7.0f}")


if __name__ == "__main__":
    main()
