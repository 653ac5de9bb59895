"""Speculative decoding on the tiny MoE: acceptance as the MTP head goes stale, and speed.

    .venv/bin/python benchmarks/speculative_acceptance.py [--warmup 30] [--stale 0 10 20 40]
    .venv/bin/python benchmarks/speculative_acceptance.py --smoke   # 1 + 1 steps, 4 tokens

The tiny model (one MTP layer) is first trained with moerl's trainer on the
synthetic corpus (`x[t+1] = x[t] + stride`), MTP loss included (Megatron's GPTModel
adds DeepSeek-V3's MTP loss when mtp_num_layers > 0). Then the policy moves on to a
new task (the same sequences run backwards) for up to `--stale` more steps, twice
from the same start: once with the MTP head trained alongside, once with the MTP
layer's own weights frozen at the start (the shared embedding and output layer
still move with the policy). After each block of steps, greedy and sampled (T=1)
rollouts of prompts from the new task report the MTP drafter's acceptance.
Last, tokens/s and policy forward passes per generated token, with and without
speculation, in the same run, on the task's prompts and on repetitive agent-like
byte prompts (where n-gram lookup is the drafter that pays).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from _smoke import parse_with_smoke

from moerl.data.synthetic import SyntheticCorpus
from moerl.models.arch import TINY
from moerl.models.build import build_model
from moerl.parallel.groups import ParallelGroups, destroy_parallel, init_parallel
from moerl.parallel.layout import ParallelLayout
from moerl.rollout.sampling import RowSampling
from moerl.rollout.speculative.config import SpeculativeConfig
from moerl.rollout.speculative_decode import SpeculativeDecoder
from moerl.rollout.static_decode import DecodeRow, StaticDecoder
from moerl.rollout.types import SamplingParams, SpeculationStats
from moerl.trainer.config import OptimConfig
from moerl.trainer.lm import batch_iterators
from moerl.trainer.optimizer import build_optimizer
from moerl.trainer.step import train_step

SEQ, GLOBAL, MICRO = 32, 16, 8
TABLE_TITLE = "MTP drafter acceptance"
SMOKE = {"warmup": 1, "stale": [0, 1], "new_tokens": 4, "prompts": 2, "speed_batches": [1, 2]}


@dataclass(frozen=True)
class BackwardCorpus(SyntheticCorpus):
    """The new task: the corpus's sequences read backwards (x[t+1] = x[t] - stride)."""

    def sample(self, index: int) -> torch.Tensor:
        return super().sample(index).flip(0)


def prompts(corpus: SyntheticCorpus, count: int, length: int = 8) -> list[list[int]]:
    return [corpus.sample(10**6 + i)[:length].tolist() for i in range(count)]


def agent_prompts(count: int) -> list[list[int]]:
    text = "Observation: file saved\nAction: run tests\nObservation: 3 passed\nAction: run"
    return [list((text + f" {i}\n" + text).encode()) for i in range(count)]


def decode(model: torch.nn.Module, batch: list[list[int]], temperature: float,
           spec: SpeculativeConfig | None, new_tokens: int) -> tuple[list[DecodeRow], float, int]:
    """(rows, seconds, policy forward passes) for one batch."""
    params = SamplingParams(max_tokens=new_tokens, temperature=temperature, ignore_eos=True)
    rows = [DecodeRow(p, RowSampling.make(params, 7, i)) for i, p in enumerate(batch)]
    calls = [0]
    hook = model.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    decoder = (StaticDecoder(model, None, lambda _: "") if spec is None
               else SpeculativeDecoder(model, None, lambda _: "", spec))
    start = time.perf_counter()
    decoder.decode(rows)
    elapsed = time.perf_counter() - start
    hook.remove()
    return rows, elapsed, calls[0]


def pooled(rows: list[DecodeRow]) -> tuple[float, float]:
    stats = [r.speculation for r in rows if isinstance(r.speculation, SpeculationStats)]
    drafted, steps = sum(s.drafted for s in stats), sum(s.steps for s in stats)
    return (sum(s.accepted for s in stats) / max(drafted, 1),
            sum(s.tokens for s in stats) / max(steps, 1))


MTP = SpeculativeConfig(mode="mtp", num_draft_tokens=3)
NGRAM = SpeculativeConfig(mode="ngram", num_draft_tokens=4)


class Run:
    """One tiny model with its optimizer; `freeze_mtp` pins the MTP layer's weights."""

    def __init__(self, groups: ParallelGroups, freeze_mtp: bool) -> None:
        (self.model,) = build_model(TINY, groups.layout)
        self.trainable = build_optimizer([self.model], OptimConfig(use_distributed_optimizer=False),
                                         groups.layout)  # plain Adam: pinned weights stay put
        self.groups = groups
        self.step = 0
        self.loss = float("nan")
        self.freeze_mtp = freeze_mtp
        self.snapshot: dict[str, torch.Tensor] | None = None

    def train(self, corpus: SyntheticCorpus, steps: int) -> float:
        """`steps` Adam steps on `corpus`; the last LM loss (of any step so far)."""
        self.model.train()
        for _ in range(steps):
            self.loss = train_step(
                self.trainable.model, self.trainable.optimizer,
                batch_iterators(corpus, self.step, self.groups, GLOBAL, MICRO),
                num_microbatches=GLOBAL // MICRO, micro_batch_size=MICRO, seq_length=SEQ,
                scheduler=self.trainable.scheduler).loss
            self.step += 1
            if self.freeze_mtp and self.snapshot is not None:
                with torch.no_grad():
                    for name, param in self.model.mtp.named_parameters():
                        param.copy_(self.snapshot[name])
        return self.loss

    def pin(self) -> None:
        """From now on (if freezing) the MTP layer keeps its present weights."""
        self.snapshot = {k: v.detach().clone() for k, v in self.model.mtp.named_parameters()}


def staleness(args: argparse.Namespace, freeze: bool) -> list[tuple[float, ...]]:
    groups = init_parallel(ParallelLayout(), seed=0)
    try:
        run = Run(groups, freeze)
        old = SyntheticCorpus(TINY.vocab_size, SEQ)
        new = BackwardCorpus(TINY.vocab_size, SEQ)
        run.train(old, args.warmup)
        run.pin()
        rows: list[tuple[float, ...]] = []
        done = 0
        for target in args.stale:
            loss = run.train(new, target - done)
            done = target
            batch = prompts(new, args.prompts)
            greedy = pooled(decode(run.model, batch, 0.0, MTP, args.new_tokens)[0])
            sampled = pooled(decode(run.model, batch, 1.0, MTP, args.new_tokens)[0])
            rows.append((target, loss, *greedy, *sampled))
        if not freeze:
            count = max(args.speed_batches)
            speed(run.model, prompts(new, count), agent_prompts(count), args)
        return rows
    finally:
        destroy_parallel()


def speed(model: torch.nn.Module, task: list[list[int]], agent: list[list[int]],
          args: argparse.Namespace) -> None:
    new_tokens = args.new_tokens
    print(f"\nspeed (greedy, {new_tokens} new tokens; fwd/tok = policy forward passes per "
          "generated token of one sample)")
    print(f"{'prompts':8} {'batch':>5} | {'plain tok/s':>11} | {'ngram tok/s':>11} {'x':>5} "
          f"{'fwd/tok':>7} | {'mtp tok/s':>9} {'x':>5} {'fwd/tok':>7}")
    decode(model, task[:2], 0.0, None, new_tokens)  # warm-up
    for name, batch_prompts in (("task", task), ("agent", agent)):
        for size in args.speed_batches:
            batch = batch_prompts[:size]
            line = f"{name:8} {size:5d} |"
            _, base, base_calls = decode(model, batch, 0.0, None, new_tokens)
            tokens = size * new_tokens
            line += f" {tokens / base:11.0f} |"
            for spec in (NGRAM, MTP):
                _, took, calls = decode(model, batch, 0.0, spec, new_tokens)
                line += f" {tokens / took:{11 if spec is NGRAM else 9}.0f} {base / took:5.2f}"
                line += f" {calls / new_tokens:7.2f} |"
            print(line + f"  (plain: {base_calls / new_tokens:.2f} fwd/tok)")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--stale", type=int, nargs="+", default=[0, 10, 20, 40])
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--prompts", type=int, default=16, help="prompts per acceptance batch")
    parser.add_argument("--speed-batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--threads", type=int, default=1)
    return parse_with_smoke(parser, SMOKE, argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    results = {}
    for freeze in (False, True):
        results[freeze] = staleness(args, freeze)
    print(f"\n{TABLE_TITLE} ({MTP.num_draft_tokens} drafts) after {args.warmup} steps on the "
          "old task, then N steps on the new one")
    print(f"{'N':>4} | {'MTP':7} {'loss':>6} {'greedy acc':>10} {'len':>5} {'T=1 acc':>8} "
          f"{'len':>5}")
    for trained, frozen in zip(results[False], results[True], strict=True):
        for label, row in (("trained", trained), ("frozen", frozen)):
            n, loss, g_acc, g_len, s_acc, s_len = row
            print(f"{int(n):4d} | {label:7} {loss:6.3f} {g_acc:10.2f} {g_len:5.2f} "
                  f"{s_acc:8.2f} {s_len:5.2f}")
        ratio = frozen[2] / trained[2] if trained[2] else float("nan")
        print(f"{'':4} | frozen/trained greedy acceptance: {ratio:.2f}")


if __name__ == "__main__":
    main()
