"""The TRL side of benchmarks/learning_vs_trl.py, run there as its own process:

    python benchmarks/_trl_side.py <spec.json> <result.json>

spec: the run config that `moerl train` composed (model, data, sft, optim, rl, reward
concurrency). The model is transformers' DeepseekV3ForCausalLM with moerl's
architecture (models.hf_mapping.hf_config_from_arch: the same layers, MLA, routed and
shared experts, sigmoid router; no MTP head, and the router's expert bias is not
updated); the tokenizer is moerl's byte-level one behind a PreTrainedTokenizer. SFT is
TRL's SFTTrainer on the same rows in the same order, then TRL's GRPOTrainer starts from
the saved SFT model with the same prompts per step. Rewards and held-out grades run
each program's unit tests in a fresh `python -I -S` with a timeout, never in moerl's
sandbox. result: seconds of each RL step and held-out greedy pass rates, with times.
"""

from __future__ import annotations

import time

STARTED = time.time()  # before the imports: they are part of the start-up

import hashlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from datasets.table import InMemoryTable  # noqa: E402
from transformers import (  # noqa: E402
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    PreTrainedTokenizer,
    TrainerCallback,
    set_seed,
)
from trl import GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer  # noqa: E402

from moerl.data.prompts import DataConfig, PromptRecord, PromptStream, load_prompts  # noqa: E402
from moerl.data.tokenizer import ByteTokenizer  # noqa: E402
from moerl.models.arch import MoEArch  # noqa: E402
from moerl.models.hf_mapping import hf_config_from_arch  # noqa: E402
from moerl.rl.objective_config import GRPOConfig as GRPOObjective  # noqa: E402
from moerl.typed_config import from_dict  # noqa: E402

# Runs each top-level statement of `check` that holds an assert as one test (the rule
# moerl's reward uses) and prints "passed total" last.
GRADER = """
import ast, json, sys
spec = json.loads(sys.stdin.read())
passed = total = 0
try:
    scope = {}
    exec(compile(spec["program"], "<candidate>", "exec"), scope)
    candidate = scope[spec["entry_point"]]
except BaseException:
    candidate = None
tests = ast.parse(spec["test"])
check = next(n for n in tests.body if isinstance(n, ast.FunctionDef) and n.name == "check")
where = {}
exec(compile(ast.Module([n for n in tests.body if n is not check], []), "<tests>", "exec"), where)
for stmt in check.body:
    if not any(isinstance(x, ast.Assert) for x in ast.walk(stmt)):
        continue
    total += 1
    if candidate is None:
        continue
    try:
        exec(compile(ast.Module([stmt], []), "<test>", "exec"), {**where, "candidate": candidate})
        passed += 1
    except BaseException:
        pass
print()
print(passed, total)
"""


class Grader:
    """Fraction of unit tests passed per program, `workers` interpreters at a time."""

    def __init__(self, workers: int, timeout_s: float = 5.0) -> None:
        self.pool = ThreadPoolExecutor(max_workers=workers)
        self.timeout_s = timeout_s
        self.busy_s = 0.0  # wall time spent in `many`

    def one(self, program: str, test: str, entry_point: str) -> float:
        spec = json.dumps({"program": program, "test": test, "entry_point": entry_point})
        try:
            done = subprocess.run([sys.executable, "-I", "-S", "-c", GRADER], input=spec,
                                  capture_output=True, text=True, timeout=self.timeout_s)
            passed, total = (int(x) for x in done.stdout.splitlines()[-1].split())
        except (subprocess.TimeoutExpired, ValueError, IndexError):
            return 0.0
        return passed / total if total else 0.0

    def many(self, programs: list[str], tests: list[str], entry_points: list[str]) -> list[float]:
        started = time.perf_counter()
        scores = list(self.pool.map(self.one, programs, tests, entry_points))
        self.busy_s += time.perf_counter() - started
        return scores


class BytesTokenizer(PreTrainedTokenizer):
    """moerl's ByteTokenizer for transformers: UTF-8 bytes are ids 0..255, then BOS, EOS
    and PAD at moerl's ids; a text is encoded as [BOS] bytes, like moerl's prompts."""

    model_input_names = ["input_ids", "attention_mask"]  # noqa: RUF012 (the base's type)

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                         special_tokens_pattern="bos", **kwargs)
        byte = ByteTokenizer()
        assert (self.bos_token_id, self.eos_token_id, self.pad_token_id) == (
            byte.bos_id, byte.eos_id, byte.pad_id), "special ids differ from moerl's"

    @property
    def vocab_size(self) -> int:
        return 256

    def get_vocab(self) -> dict[str, int]:
        return {**{chr(i): i for i in range(256)}, **self.added_tokens_encoder}

    def _tokenize(self, text: str, **kwargs: Any) -> list[str]:
        return [chr(b) for b in text.encode("utf-8")]

    def _convert_token_to_id(self, token: str) -> int:
        return ord(token)

    def _convert_id_to_token(self, index: int) -> str:
        return chr(index) if index < 256 else ""

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        return bytes(ord(t) for t in tokens if len(t) == 1).decode("utf-8", errors="replace")


def rows_dataset(rows: list[dict[str, str]]) -> Dataset:
    """A Dataset fingerprinted by a hash of its rows. Left to itself, datasets hashes the
    table with dill, which copies modules found outside a site-packages folder by value
    and fails on pyarrow's (`pip install --target`, PYTHONPATH)."""
    digest = hashlib.sha256(json.dumps(rows).encode()).hexdigest()[:16]
    return Dataset(InMemoryTable.from_pylist(rows), fingerprint=digest)


def build_model(arch: MoEArch, tok: BytesTokenizer) -> DeepseekV3ForCausalLM:
    config = hf_config_from_arch(arch, {"bos_token_id": tok.bos_token_id,
                                        "eos_token_id": tok.eos_token_id,
                                        "pad_token_id": tok.pad_token_id})
    for key in ("architectures", "model_type"):
        config.pop(key)
    return DeepseekV3ForCausalLM(DeepseekV3Config(**config))


def greedy_pass_rate(model: Any, tok: BytesTokenizer, held_out: list[PromptRecord],
                     max_tokens: int, grader: Grader) -> float:
    """Share of held-out tasks whose greedy completion passes every test."""
    was_training = model.training
    model.eval()
    tok.padding_side = "left"
    batch = tok([r.prompt for r in held_out], padding=True, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**batch, do_sample=False, max_new_tokens=max_tokens,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model.train(was_training)
    texts = tok.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
    scores = grader.many([r.prompt + t for r, t in zip(held_out, texts, strict=True)],
                         [r.spec["test"] for r in held_out],
                         [r.spec["entry_point"] for r in held_out])
    return sum(s == 1.0 for s in scores) / len(scores)


class Clock(TrainerCallback):
    """Times each RL step (`updates` optimizer steps: one generation and its updates)
    and evaluates after steps 0, every `interval` and the last, like `moerl train`."""

    def __init__(self, updates: int, steps: int, interval: int,
                 evaluate: Any, grader: Grader, t0: float) -> None:
        self.updates, self.steps, self.interval = updates, steps, interval
        self.evaluate, self.grader, self.t0 = evaluate, grader, t0
        self.step_s: list[float] = []
        self.reward_s: list[float] = []  # of which in the reward function
        self.rewards: list[float] = []  # mean reward of each RL step's samples
        self.evals: list[tuple[int, float, float]] = []  # (RL step, s since SFT start, rate)
        self._begun = self._graded = 0.0

    def _eval(self, step: int, model: Any) -> None:
        rate = self.evaluate(model)
        self.evals.append((step, time.time() - self.t0, rate))
        print(f"eval at step {step}: pass rate {rate:.3f}", flush=True)

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None,
               **kwargs: Any) -> None:
        if logs and "reward" in logs and "train_runtime" not in logs:
            self.rewards.append(float(logs["reward"]))

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._eval(0, kwargs["model"])

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step % self.updates == 0:
            self._begun, self._graded = time.perf_counter(), self.grader.busy_s

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step % self.updates:
            return
        self.step_s.append(time.perf_counter() - self._begun)
        self.reward_s.append(self.grader.busy_s - self._graded)
        step = state.global_step // self.updates
        print(f"RL step {step}/{self.steps}  {self.step_s[-1]:.2f} s, rewards "
              f"{self.reward_s[-1]:.2f} s", flush=True)
        if step == self.steps or (self.interval and step % self.interval == 0):
            self._eval(step, kwargs["model"])


def schedule(optim: dict[str, Any]) -> dict[str, Any]:
    """moerl's learning-rate schedule (warm-up, cosine to min_lr) in Trainer arguments."""
    lr, min_lr = optim["lr"], optim["min_lr"]
    if min_lr == lr:
        return {"learning_rate": lr, "lr_scheduler_type": "constant_with_warmup",
                "warmup_steps": optim["warmup_steps"]}
    return {"learning_rate": lr, "lr_scheduler_type": "cosine_with_min_lr",
            "lr_scheduler_kwargs": {"min_lr": min_lr}, "warmup_steps": optim["warmup_steps"]}


def adam(optim: dict[str, Any]) -> dict[str, Any]:
    return {"weight_decay": optim["weight_decay"], "adam_beta1": optim["adam_beta1"],
            "adam_beta2": optim["adam_beta2"], "adam_epsilon": optim["adam_eps"],
            "max_grad_norm": optim["clip_grad"]}


# Both trainers on this machine's CPU in float32, like moerl here; no activation
# recomputation (TRL turns it on by default; the tiny model does not need it).
COMMON = {"use_cpu": True, "bf16": False, "gradient_checkpointing": False,
          "report_to": "none", "save_strategy": "no", "disable_tqdm": True}


def main(spec_path: str, result_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    arch = from_dict(MoEArch, spec["model"], "model")
    data = from_dict(DataConfig, spec["data"], "data")
    sft, optim, rl = spec["sft"], spec["optim"], spec["rl"]
    objective = from_dict(GRPOObjective, rl["objective_args"], "rl.objective_args")
    records, held_out, _ = load_prompts(data)
    tok = BytesTokenizer()
    set_seed(rl["seed"])  # the initial weights
    model = build_model(arch, tok)
    grader = Grader(spec["reward_workers"])
    out = Path(tempfile.mkdtemp(prefix="trl-side-"))

    rows = rows_dataset([{"prompt": r.prompt, "completion": r.reference} for r in records
                         if r.reference])
    sft_args = SFTConfig(
        output_dir=str(out / "sft"), max_steps=sft["steps"],
        per_device_train_batch_size=sft["global_batch"], max_length=sft["seq_length"] + 1,
        completion_only_loss=True, shuffle_dataset=False, train_sampling_strategy="sequential",
        logging_steps=max(1, sft["steps"] // 20), seed=rl["seed"], **COMMON,
        **adam(optim), **schedule({**optim, "lr": sft["lr"], "min_lr": sft["lr"] / 10,
                                   "warmup_steps": sft["warmup_steps"]}))
    sft_trainer = SFTTrainer(model=model, args=sft_args, train_dataset=rows,
                             processing_class=tok)
    t0 = time.time()
    sft_trainer.train()
    sft_s = time.time() - t0
    sft_trainer.save_model(str(out / "sft-model"))

    prompts = PromptStream(records, seed=data.seed).take(rl["steps"] * rl["prompts_per_step"])
    dataset = rows_dataset([{"prompt": r.prompt, "test": r.spec["test"],
                            "entry_point": r.spec["entry_point"]} for r in prompts])

    def reward(prompts: list[str], completions: list[str], test: list[str],
               entry_point: list[str], **_: Any) -> list[float]:
        return grader.many([p + c for p, c in zip(prompts, completions, strict=True)],
                           test, entry_point)

    samples = rl["prompts_per_step"] * rl["group_size"]
    sampling = rl["sampling"]
    grpo_args = GRPOConfig(
        output_dir=str(out / "grpo"), max_steps=rl["steps"] * rl["updates_per_step"],
        per_device_train_batch_size=samples // rl["updates_per_step"],
        steps_per_generation=rl["updates_per_step"], num_generations=rl["group_size"],
        max_completion_length=sampling["max_tokens"], temperature=sampling["temperature"],
        top_p=sampling["top_p"], top_k=sampling["top_k"], num_iterations=1,
        beta=objective.kl_coef, epsilon=objective.eps_low, epsilon_high=objective.eps_high,
        loss_type="grpo", scale_rewards="group", shuffle_dataset=False,
        logging_steps=rl["updates_per_step"], seed=rl["seed"], **COMMON,
        **adam(optim), **schedule(optim))
    clock = Clock(rl["updates_per_step"], rl["steps"], rl["eval_interval"],
                  lambda m: greedy_pass_rate(m, tok, held_out, sampling["max_tokens"], grader),
                  grader, t0)
    grpo = GRPOTrainer(model=str(out / "sft-model"), reward_funcs=reward, args=grpo_args,
                       train_dataset=dataset, processing_class=tok, callbacks=[clock])
    grpo.train()
    result = {"started": STARTED, "sft_start": t0, "sft_s": sft_s,
              "params": sum(p.numel() for p in model.parameters()),
              "samples_per_step": samples, "step_s": clock.step_s, "reward_s": clock.reward_s,
              "evals": clock.evals, "rewards": clock.rewards}
    Path(result_path).write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
