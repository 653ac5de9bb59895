"""moerl against TRL on the default demo's task, matched: the same model, initial weights,
router, optimizer settings, data, reward code and reward cost; SFT then GRPO, over several
seeds, one run after another on one machine. Prints, side by side, each system's RL step
with and without the rewards' seconds, its SFT, held-out greedy pass rates and the training
time to a pass-rate threshold: the median over the seeds and their range, then the ratios.

    .venv/bin/pip install -e '.[bench]'   # TRL and what it needs (scripts/setup.sh does it)
    .venv/bin/python benchmarks/learning_vs_trl.py [--seeds 0,1,2] [--rewards warm|cold] \
        [--sides moerl,deepseek_v3,qwen3_moe] [--rl-steps 24] [--prompts 16] [--group 8] \
        [--sft-steps 400] [--eval-interval 2] [--variant-steps 6] [--threshold X]
    .venv/bin/python benchmarks/learning_vs_trl.py --smoke   # 2 SFT and 2 RL steps of 2 x 2

Sides. moerl: one `moerl train +experiment=demo` (reward server with the sandbox,
rollout server, trainer) with the options above as overrides. TRL 1.x
(benchmarks/_trl_side.py, its own process, reading the same composed config): SFTTrainer
on the same rows in the same order, its model saved, then GRPOTrainer from it (loss_type
"grpo", beta = moerl's KL coefficient, the same clip range, group size, updates per step,
prompts in moerl's order, max tokens, temperature; transformers' generation), on
  - deepseek_v3: transformers' DeepseekV3ForCausalLM of moerl's architecture
    (`hf_config_from_arch` of the composed `model`, so it follows the preset), starting
    from moerl's initial weights for the seed (benchmarks/_shared_init.py writes them in
    both formats and checks that both models give the same logits);
  - qwen3_moe: Qwen3MoeForCausalLM of the same depth, width, experts and top-k and the
    same parameter count (benchmarks/_hf_models.py), its own initial weights: what a
    TRL user at this size would pick.

Matched settings. transformers' models have no MTP head, MLA latent norms always, and
neither an expert-bias update nor a balance loss: moerl runs `model.mtp_num_layers=0
model.latent_norms=true model.router_expert_bias=false model.aux_loss_coeff=0`. SFT on
both sides uses moerl's SFT optimizer (`trainer.sft.sft_optim`: Adam's betas, eps, weight
decay, clipping, warm-up, cosine to a tenth of sft.lr), RL moerl's `optim`. Rewards:
TRL's reward function and held-out grading post to a `moerl serve reward` started like
moerl's own (rewards.max_concurrency, isolation), so each completion costs the same on
both sides. `--rewards warm` (default): both servers keep sandbox launches ready
(`rewards.warm_slots`: the concurrency); `cold`: both launch each on demand
(`warm_slots=0`). After the seeds, `--variant-steps` RL steps of each system under the
other variant, from its seed-0 SFT model, give that variant's step times.

Times. Each run with this process's OMP_NUM_THREADS (1 unless set); measure on an idle
machine: other load skews one run and not another. Start-up (imports, model building)
is shown on its own; times count from the start of SFT (moerl: its progress bar's
elapsed time before the line that ends SFT). An RL step is moerl's `time/step`
(generation to weight push) and TRL's `--updates` optimizer steps with their generation;
medians leave out each run's first step. Evaluations (greedy, the held-out set) follow
RL steps 0, every --eval-interval and the last; their time is taken out of the training
time to the threshold (moerl: `time/eval`), which is met at the first evaluation at or
above it. The threshold (default, per seed: halfway from the best after-SFT pass rate to
the best rate any side reached) is printed with each seed's curves.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

from _smoke import parse_with_smoke
from _vs_trl_report import print_report
from _vs_trl_runs import Trace, reward_server, run_moerl, run_trl, shared_init

TABLE_TITLE = "learning vs TRL: matched model, init, optimizer and reward cost"
NEEDS_EXECUTABLES = ("bwrap",)
NEEDS_MODULES = ("trl",)
SMOKE = {"sft_steps": 2, "rl_steps": 2, "prompts": 2, "group": 2, "updates": 1,
         "max_tokens": 4, "eval_size": 4, "eval_interval": 1, "seeds": "0",
         "variant_steps": 0}
SIDES = {"moerl": "moerl", "deepseek_v3": "TRL DeepSeek-V3", "qwen3_moe": "TRL Qwen3-MoE"}
# What transformers' DeepSeek-V3 computes; `++` also adds a field a preset's YAML lacks.
MATCHED = ("model.mtp_num_layers=0", "++model.latent_norms=true",
           "model.router_expert_bias=false", "model.aux_loss_coeff=0")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", default="0,1,2", help="rl.seed of each run: weights, sampling")
    parser.add_argument("--sides", default=",".join(SIDES))
    parser.add_argument("--rewards", choices=("warm", "cold"), default="warm")
    parser.add_argument("--sft-steps", type=int, default=400)
    parser.add_argument("--rl-steps", type=int, default=24)
    parser.add_argument("--prompts", type=int, default=16, help="prompts per RL step")
    parser.add_argument("--group", type=int, default=8, help="samples per prompt")
    parser.add_argument("--updates", type=int, default=2, help="optimizer steps per RL step")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--eval-size", type=int, default=64, help="held-out tasks")
    parser.add_argument("--eval-interval", type=int, default=2, help="RL steps")
    parser.add_argument("--variant-steps", type=int, default=6,
                        help="RL steps of each system under the other reward variant (0: none)")
    parser.add_argument("--threshold", type=float, default=None,
                        help="held-out pass rate to reach (default: see the docstring)")
    args = parse_with_smoke(parser, SMOKE, argv)
    args.seed_list = [int(s) for s in args.seeds.split(",")]
    args.side_list = args.sides.split(",")
    unknown = [s for s in args.side_list if s not in SIDES]
    if unknown or not args.side_list:
        parser.error(f"--sides: {','.join(unknown) or 'none given'}; choose from {','.join(SIDES)}")
    return args


def overrides(args: argparse.Namespace, warm: bool) -> list[str]:
    """`moerl train` overrides of these options, matched to transformers' models."""
    return ["+experiment=demo", f"sft.steps={args.sft_steps}", f"rl.steps={args.rl_steps}",
            f"rl.prompts_per_step={args.prompts}", f"rl.group_size={args.group}",
            f"rl.updates_per_step={args.updates}", f"rl.sampling.max_tokens={args.max_tokens}",
            f"data.eval_size={args.eval_size}", f"rl.eval_interval={args.eval_interval}",
            *MATCHED, *([] if warm else ["rewards.warm_slots=0"])]


class Bench:
    """The composed config and the temporary directory every run of this process shares."""

    def __init__(self, args: argparse.Namespace, tmp: Path) -> None:
        from moerl.config import load_run_config
        from moerl.typed_config import to_dict

        self.args, self.tmp = args, tmp
        self.cfg = load_run_config(overrides(args, True))
        if self.cfg.rl.objective != "grpo":
            raise SystemExit(f"the TRL side mirrors rl.objective=grpo, not {self.cfg.rl.objective}")
        self.samples = self.cfg.rl.prompts_per_step * self.cfg.rl.group_size
        self.spec = {k: to_dict(getattr(self.cfg, k)) for k in ("model", "data", "sft", "optim",
                                                               "rl")}
        rewards = self.cfg.rewards
        self.warm_slots = (rewards.max_concurrency if rewards.warm_slots is None
                           else rewards.warm_slots)

    def moerl(self, seed: int, warm: bool, extra: Sequence[str], name: str) -> Trace:
        from moerl.models.count import count_params

        argv = [*overrides(self.args, warm), f"rl.seed={seed}", *extra]
        return run_moerl(argv, self.tmp / name, self.samples, count_params(self.cfg.model)[0])

    def trl(self, kind: str, seed: int, warm: bool, name: str, init: Path | None,
            save: Path | None = None, rl: dict[str, int] | None = None) -> Trace:
        run = self.tmp / name
        run.mkdir()
        spec = {**self.spec, "kind": kind, "init": str(init) if init else None,
                "save": str(save) if save else None,
                "reward_batch": self.cfg.rewards.client.batch_size,
                "rl": {**self.spec["rl"], "seed": seed, **(rl or {})}}
        if rl is not None:  # a variant run: no SFT
            spec["sft"] = {**self.spec["sft"], "steps": 0}
        rewards = self.cfg.rewards
        with reward_server(run, rewards.max_concurrency, self.warm_slots if warm else 0,
                           rewards.isolation) as (url, pid):
            return run_trl(run, {**spec, "reward_url": url}, pid)

    def seed_runs(self, seed: int, turn: int) -> dict[str, Trace]:
        """Every side of one seed, with the default reward variant; the `turn`-th seed
        starts with the `turn`-th side, so that load that drifts over the hours falls
        on every side in turn."""
        warm, out = self.args.rewards == "warm", {}
        init = self.tmp / f"init-{seed}"
        if {"moerl", "deepseek_v3"} & set(self.args.side_list):
            shared_init(init, seed, overrides(self.args, warm))
        sides = self.args.side_list
        for side in sides[turn % len(sides):] + sides[:turn % len(sides)]:
            print(f"seed {seed}: {SIDES[side]} ...", flush=True)
            if side == "moerl":
                out[side] = self.moerl(seed, warm, [f"init_weights={init / 'megatron'}"],
                                       f"moerl-{seed}")
            else:
                out[side] = self.trl(side, seed, warm, f"{side}-{seed}",
                                     init / "hf" if side == "deepseek_v3" else None,
                                     save=self.tmp / f"{side}-{seed}-sft")
        return out

    def variant_runs(self, seed: int) -> dict[str, Trace]:
        """`--variant-steps` RL steps of each side under the other reward variant, from
        its SFT model of `seed` (evaluated at the start and the end only)."""
        warm, steps, out = self.args.rewards == "cold", self.args.variant_steps, {}
        rl = {"steps": steps, "eval_interval": 0}
        for side in self.args.side_list:
            name = f"{side}-{seed}-{'warm' if warm else 'cold'}"
            if side == "moerl":
                out[side] = self.moerl(seed, warm, [
                    "sft.steps=0", f"init_weights={self.tmp / f'moerl-{seed}' / 'sft'}",
                    f"rl.steps={steps}", "rl.eval_interval=0"], name)
            else:
                out[side] = self.trl(side, seed, warm, name, self.tmp / f"{side}-{seed}-sft",
                                     rl=rl)
        return out


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if importlib.util.find_spec("trl") is None:
        raise SystemExit("TRL is not installed: pip install -e '.[bench]'")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory(prefix="moerl-vs-trl-") as name:
        bench = Bench(args, Path(name))
        runs = {seed: bench.seed_runs(seed, turn) for turn, seed in enumerate(args.seed_list)}
        variant = bench.variant_runs(args.seed_list[0]) if args.variant_steps else {}
    print(TABLE_TITLE)
    print_report(args, {SIDES[k]: k for k in args.side_list}, runs, variant)


if __name__ == "__main__":
    main()
