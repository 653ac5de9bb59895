"""The TRL side of benchmarks/learning_vs_trl.py, run there as its own process:

    python benchmarks/_trl_side.py <spec.json> <result.json>

spec: the run config that `moerl train` composed (model, data, sft, optim, rl), the
transformers model to train (`kind`: deepseek_v3 or qwen3_moe, benchmarks/_hf_models.py),
the Hugging Face directory it starts from (`init`; none: a fresh model drawn with
`rl.seed`), the reward server's URL, and where to save the model after SFT (`save`).

SFT is TRL's SFTTrainer on moerl's SFT rows in moerl's order with moerl's SFT optimizer
(`trainer.sft.sft_optim`: Adam settings, warm-up, cosine to a tenth), then TRL's
GRPOTrainer from the saved SFT model with moerl's RL optimizer (`optim`), prompts in
moerl's order, group size, updates per step, sampling, clip range and KL coefficient.
Rewards and held-out grades go to a moerl reward server (`moerl serve reward`, the
sandbox), as moerl's do: the same reward code at the same cost per item.
result: seconds of each RL step and of its rewards, and the held-out greedy pass rates
with their times.
"""

from __future__ import annotations

import time

STARTED = time.time()  # before the imports: they are part of the start-up

import hashlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from _hf_models import BytesTokenizer, build  # noqa: E402
from datasets import Dataset  # noqa: E402
from datasets.table import InMemoryTable  # noqa: E402
from transformers import AutoModelForCausalLM, TrainerCallback, set_seed  # noqa: E402
from trl import GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer  # noqa: E402

from moerl.data.prompt_sources import load_prompts  # noqa: E402
from moerl.data.prompts import DataConfig, PromptRecord, PromptStream  # noqa: E402
from moerl.models.arch import MoEArch  # noqa: E402
from moerl.rewards.client import RewardClient, RewardClientConfig, ScoreItem  # noqa: E402
from moerl.rl.objective_config import GRPOConfig as GRPOObjective  # noqa: E402
from moerl.trainer.config import OptimConfig  # noqa: E402
from moerl.trainer.config import SFTConfig as MoerlSFT  # noqa: E402
from moerl.trainer.sft import sft_optim  # noqa: E402
from moerl.typed_config import from_dict  # noqa: E402


class Grader:
    """Rewards of completions from the reward server; `busy_s`: wall time spent there."""

    def __init__(self, url: str, batch_size: int, seed: int) -> None:
        self.client = RewardClient(RewardClientConfig(batch_size=batch_size), urls=(url,),
                                   seed=seed)
        self.busy_s = 0.0
        self.calls = 0  # the client's cache is per call, as moerl's is per step

    def many(self, records: list[PromptRecord], completions: list[str]) -> list[float]:
        started = time.perf_counter()
        items = [ScoreItem(r.reward, c, r.spec) for r, c in zip(records, completions, strict=True)]
        self.calls += 1
        report = self.client.score(items, step=self.calls)
        self.busy_s += time.perf_counter() - started
        return [0.0 if r.reward is None else r.reward for r in report.results]


def rows_dataset(rows: list[dict[str, Any]]) -> Dataset:
    """A Dataset fingerprinted by a hash of its rows. Left to itself, datasets hashes the
    table with dill, which copies modules found outside a site-packages folder by value
    and fails on pyarrow's (`pip install --target`, PYTHONPATH)."""
    digest = hashlib.sha256(json.dumps(rows).encode()).hexdigest()[:16]
    return Dataset(InMemoryTable.from_pylist(rows), fingerprint=digest)


def greedy_pass_rate(model: Any, tok: BytesTokenizer, held_out: list[PromptRecord],
                     max_tokens: int, grader: Grader) -> float:
    """Share of held-out tasks whose greedy completion passes every test (reward 1)."""
    was_training = model.training
    model.eval()
    tok.padding_side = "left"
    batch = tok([r.prompt for r in held_out], padding=True, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**batch, do_sample=False, max_new_tokens=max_tokens,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model.train(was_training)
    texts = tok.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
    return sum(s == 1.0 for s in grader.many(held_out, texts)) / len(held_out)


class Clock(TrainerCallback):
    """Times each RL step (`updates` optimizer steps: one generation and its updates)
    and evaluates after steps 0, every `interval` and the last, like `moerl train`."""

    def __init__(self, updates: int, steps: int, interval: int,
                 evaluate: Any, grader: Grader, t0: float) -> None:
        self.updates, self.steps, self.interval = updates, steps, interval
        self.evaluate, self.grader, self.t0 = evaluate, grader, t0
        self.step_s: list[float] = []
        self.reward_s: list[float] = []  # of which in the reward server
        self.rewards: list[float] = []  # mean reward of each RL step's samples
        # (RL step, s since SFT start at its end, pass rate, s it took)
        self.evals: list[tuple[int, float, float, float]] = []
        self._begun = self._graded = 0.0

    def _eval(self, step: int, model: Any) -> None:
        started = time.perf_counter()
        rate = self.evaluate(model)
        self.evals.append((step, time.time() - self.t0, rate, time.perf_counter() - started))
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


def schedule(optim: OptimConfig, steps: int) -> dict[str, Any]:
    """moerl's learning-rate schedule (warm-up from 0, cosine from lr to min_lr over
    `decay_steps`) in Trainer arguments, for a run of `steps` optimizer steps."""
    if optim.min_lr == optim.lr:
        return {"learning_rate": optim.lr, "lr_scheduler_type": "constant_with_warmup",
                "warmup_steps": optim.warmup_steps}
    if steps > optim.warmup_steps and optim.decay_steps != steps:
        raise SystemExit(f"moerl's cosine decays over {optim.decay_steps} steps, this run "
                         f"takes {steps}: Trainer's cosine_with_min_lr cannot match it")
    return {"learning_rate": optim.lr, "lr_scheduler_type": "cosine_with_min_lr",
            "lr_scheduler_kwargs": {"min_lr": optim.min_lr}, "warmup_steps": optim.warmup_steps}


def adam(optim: OptimConfig) -> dict[str, Any]:
    return {"weight_decay": optim.weight_decay, "adam_beta1": optim.adam_beta1,
            "adam_beta2": optim.adam_beta2, "adam_epsilon": optim.adam_eps,
            "max_grad_norm": optim.clip_grad}


# Both trainers on this machine's CPU in float32, like moerl here; no activation
# recomputation (TRL turns it on by default; the tiny model does not need it); no MoE
# balance loss (TRL adds Qwen3-MoE's own otherwise; moerl runs without one).
COMMON = {"use_cpu": True, "bf16": False, "gradient_checkpointing": False,
          "report_to": "none", "save_strategy": "no", "disable_tqdm": True,
          "router_aux_loss_coef": 0.0}


def run_sft(spec: dict[str, Any], model: Any, tok: BytesTokenizer,
            records: list[PromptRecord], out: Path) -> float:
    """moerl's SFT rows, order and optimizer through TRL's SFTTrainer; its seconds."""
    sft = from_dict(MoerlSFT, spec["sft"], "sft")
    rows = rows_dataset([{"prompt": r.prompt, "completion": r.reference} for r in records
                         if r.reference])
    args = SFTConfig(
        output_dir=str(out / "sft"), max_steps=sft.steps,
        per_device_train_batch_size=sft.global_batch, max_length=sft.seq_length + 1,
        completion_only_loss=True, shuffle_dataset=False, train_sampling_strategy="sequential",
        logging_steps=max(1, sft.steps // 20), seed=spec["rl"]["seed"], **COMMON,
        **adam(sft_optim(sft)), **schedule(sft_optim(sft), sft.steps))
    trainer = SFTTrainer(model=model, args=args, train_dataset=rows, processing_class=tok)
    started = time.time()
    trainer.train()
    return time.time() - started


def main(spec_path: str, result_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    arch = from_dict(MoEArch, spec["model"], "model")
    data = from_dict(DataConfig, spec["data"], "data")
    optim = from_dict(OptimConfig, spec["optim"], "optim")
    rl = spec["rl"]
    objective = from_dict(GRPOObjective, rl["objective_args"], "rl.objective_args")
    records, held_out, _ = load_prompts(data)
    tok = BytesTokenizer()
    set_seed(rl["seed"])  # a fresh model's weights; sampling
    model = (AutoModelForCausalLM.from_pretrained(spec["init"]) if spec["init"]
             else build(spec["kind"], arch))
    grader = Grader(spec["reward_url"], spec["reward_batch"], rl["seed"])
    out = Path(tempfile.mkdtemp(prefix="trl-side-"))
    t0 = time.time()
    sft_s = run_sft(spec, model, tok, records, out) if spec["sft"]["steps"] else 0.0
    start = spec["save"] or str(out / "sft-model")
    model.save_pretrained(start)

    prompts = PromptStream(records, seed=data.seed).take(rl["steps"] * rl["prompts_per_step"])
    by_index = {i: r for i, r in enumerate(prompts)}
    dataset = rows_dataset([{"prompt": r.prompt, "index": i} for i, r in by_index.items()])

    def reward(completions: list[str], index: list[int], **_: Any) -> list[float]:
        return grader.many([by_index[i] for i in index], completions)

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
        **adam(optim), **schedule(optim, rl["steps"] * rl["updates_per_step"]))
    clock = Clock(rl["updates_per_step"], rl["steps"], rl["eval_interval"],
                  lambda m: greedy_pass_rate(m, tok, held_out, sampling["max_tokens"], grader),
                  grader, t0)
    grpo = GRPOTrainer(model=start, reward_funcs=reward, args=grpo_args,
                       train_dataset=dataset, processing_class=tok, callbacks=[clock])
    grpo.train()
    result = {"started": STARTED, "sft_start": t0, "sft_s": sft_s,
              "params": sum(p.numel() for p in model.parameters()),
              "samples_per_step": samples, "step_s": clock.step_s, "reward_s": clock.reward_s,
              "evals": clock.evals, "rewards": clock.rewards}
    Path(result_path).write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
