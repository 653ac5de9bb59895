"""moerl against TRL on the default demo's task: the same tiny MoE architecture, the
same SFT rows and steps, then GRPO with the same prompts per step, in one run on one
machine. Prints seconds per RL step, samples/s, and the held-out greedy pass rate over
wall time from the start of SFT.

    .venv/bin/pip install -e '.[bench]'   # TRL and what it needs; not a runtime dependency
    .venv/bin/python benchmarks/learning_vs_trl.py [--rl-steps 24] [--prompts 16] [--group 8] \
        [--sft-steps 400] [--eval-interval 8] [--threshold 0.5]
    .venv/bin/python benchmarks/learning_vs_trl.py --smoke   # 2 SFT and 2 RL steps of 2 x 2

Sizes and hyperparameters are `moerl train +experiment=demo` with the options above as
overrides; the TRL side (benchmarks/_trl_side.py, its own process) reads the same
composed config. moerl: one `moerl train` run (reward server with the sandbox, rollout
server, trainer). TRL 1.x: SFTTrainer on the same rows in the same order (sequential
sampling), its model saved, then GRPOTrainer from it (loss_type "grpo", beta = moerl's
KL coefficient, the same clip range, learning rate, Adam settings, group size, prompts
in moerl's order, max tokens, temperature; transformers generation), on
DeepseekV3ForCausalLM built from moerl's architecture and moerl's byte tokenizer;
transformers' model has no MTP head, so moerl runs the preset without one too
(`model.mtp_num_layers=0`; `--mtp` keeps it: about a fifth more compute a step). Its
reward runs the unit tests in a fresh `python -I -S` per completion, as many at once
as moerl's reward server (rewards.max_concurrency). The runs go one after the other
(moerl first), each with this process's OMP_NUM_THREADS (1 unless set), so measure on
an otherwise idle machine: other load skews one run and not the other. --seed sets
both systems' initial weights (not to the same values) and sampling; one seed's
learning curve is one sample.

Times count from the start of SFT (the optimizer loop; model building and imports
are start-up, shown on their own). moerl's SFT start is its progress bar's elapsed
time before the line that ends SFT; its evaluation times are when each `eval/pass_rate`
row appeared in metrics.jsonl (polled every 0.25 s). Evaluations (greedy, the held-out
set) follow RL steps 0, every --eval-interval and the last, in both; their time counts.
An RL step is moerl's `time/step` (generation to weight push), and TRL's
`--updates` optimizer steps, generation included; the median leaves out the first.
Both train on every group they generate (the demo samples no groups away). The threshold (default:
halfway from the better after-SFT pass rate to the best rate either reached) is met
at the first evaluation at or above it.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from _smoke import parse_with_smoke

from moerl.parent_death import wrapped

TABLE_TITLE = "learning vs TRL: same task, SFT then GRPO, held-out greedy pass rate"
NEEDS_EXECUTABLES = ("bwrap",)
NEEDS_MODULES = ("trl",)
SMOKE = {"sft_steps": 2, "rl_steps": 2, "prompts": 2, "group": 2, "updates": 1,
         "max_tokens": 4, "eval_size": 4, "eval_interval": 1}
HERE = Path(__file__).resolve().parent
# The bar's last render ends with its elapsed time (h:mm:ss); the next line ends SFT.
_BAR = re.compile(r"SFT .*\b(\d+):(\d\d):(\d\d)\s*$")
_SFT_END = re.compile(r"SFT: loss .* over \d+ steps")


@dataclass
class Trace:
    """What one system did; times in seconds from its SFT start."""

    params: int
    startup_s: float  # launch to SFT start
    sft_s: float
    step_s: list[float]
    reward_s: list[float]  # of each step, in the reward function or server
    samples_per_step: int
    evals: list[tuple[int, float, float]]  # (RL step, time, pass rate)
    rewards: list[float]  # mean reward of each RL step's samples
    note: str = ""

    def rate_at(self, t: float) -> float | None:
        seen = [rate for _, when, rate in self.evals if when <= t]
        return seen[-1] if seen else None

    def reached(self, threshold: float) -> float | None:
        return next((when for _, when, rate in self.evals if rate >= threshold), None)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sft-steps", type=int, default=400)
    parser.add_argument("--rl-steps", type=int, default=24)
    parser.add_argument("--prompts", type=int, default=16, help="prompts per RL step")
    parser.add_argument("--group", type=int, default=8, help="samples per prompt")
    parser.add_argument("--updates", type=int, default=2, help="optimizer steps per RL step")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--eval-size", type=int, default=64, help="held-out tasks")
    parser.add_argument("--eval-interval", type=int, default=8, help="RL steps")
    parser.add_argument("--seed", type=int, default=0, help="rl.seed: initial weights, sampling")
    parser.add_argument("--mtp", action="store_true",
                        help="keep the tiny preset's MTP head on the moerl side (TRL's model has "
                        "none; without this flag both run the same architecture)")
    parser.add_argument("--threshold", type=float, default=None,
                        help="held-out pass rate to reach (default: see the docstring)")
    return parse_with_smoke(parser, SMOKE, argv)


def overrides(args: argparse.Namespace) -> list[str]:
    return ["+experiment=demo", f"sft.steps={args.sft_steps}", f"rl.steps={args.rl_steps}",
            f"rl.prompts_per_step={args.prompts}", f"rl.group_size={args.group}",
            f"rl.updates_per_step={args.updates}", f"rl.sampling.max_tokens={args.max_tokens}",
            f"data.eval_size={args.eval_size}", f"rl.eval_interval={args.eval_interval}",
            f"rl.seed={args.seed}", *([] if args.mtp else ["model.mtp_num_layers=0"])]


def run_moerl(args: argparse.Namespace, tmp: Path, samples: int, params: int) -> Trace:
    run_dir, log = tmp / "moerl", tmp / "moerl.log"
    argv = [sys.executable, "-u", "-m", "moerl.launchers.cli", "train", *overrides(args),
            f"run_dir={run_dir}", "checkpoint.dir=null", "logger.wandb_mode=disabled"]
    lines: list[tuple[float, str]] = []
    rows: list[tuple[float, dict[str, float]]] = []
    started = time.time()
    # Through the parent-death wrapper: the run ends with this process on any exit.
    proc = subprocess.Popen(wrapped(argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.stdout is not None
    reader = threading.Thread(target=lambda: lines.extend(
        (time.time(), line) for line in proc.stdout or ()), daemon=True)
    reader.start()
    metrics = run_dir / "metrics.jsonl"
    while True:
        running = proc.poll() is None
        done = metrics.read_text().splitlines() if metrics.exists() else []
        rows += [(time.time(), json.loads(x)) for x in done[len(rows):] if x.endswith("}")]
        if not running:
            break
        time.sleep(0.25)
    reader.join()
    log.write_text("".join(line for _, line in lines))
    if proc.returncode != 0:
        tail = "".join(line for _, line in lines[-40:])
        raise SystemExit(f"moerl train failed ({proc.returncode}):\n{tail}")
    t0, sft_s = sft_window(lines)
    steps = [r for _, r in rows if "time/step" in r]
    kept = statistics.fmean(r.get("rollout/informative_groups", 0.0) for r in steps)
    return Trace(params, t0 - started, sft_s, [r["time/step"] for r in steps],
                 [r.get("time/reward", 0.0) for r in steps], samples,
                 [(int(r["step"]), t - t0, r["eval/pass_rate"]) for t, r in rows
                  if "eval/pass_rate" in r], [r["reward/mean"] for r in steps],
                 note=f"moerl: {kept:.1f} of {args.prompts} groups a step on average had "
                      "rewards that differ (the rest add only the KL term)")


def sft_window(lines: list[tuple[float, str]]) -> tuple[float, float]:
    """(SFT start, SFT seconds) of `moerl train`, from its output lines and their times."""
    ends = [t for t, line in lines if _SFT_END.search(line)]
    bars = [match for _, line in lines if (match := _BAR.search(line))]
    if not ends or not bars:
        raise SystemExit("moerl train printed no SFT progress; its output format changed?")
    h, m, s = (int(x) for x in bars[-1].groups())
    seconds = h * 3600 + m * 60 + s + 0.5  # the bar shows whole seconds
    return ends[0] - seconds, seconds


def run_trl(tmp: Path, spec: dict[str, object]) -> Trace:
    spec_file, result, log = tmp / "trl-spec.json", tmp / "trl-result.json", tmp / "trl.log"
    spec_file.write_text(json.dumps(spec))
    started = time.time()
    with open(log, "w") as out:
        argv = wrapped([sys.executable, "-u", str(HERE / "_trl_side.py"), str(spec_file),
                        str(result)])
        done = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT,
                              env={**os.environ, "PYTHONWARNINGS": "ignore"}, check=False)
    if done.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
        raise SystemExit(f"the TRL side failed ({done.returncode}):\n{tail}")
    r = json.loads(result.read_text())
    return Trace(r["params"], r["sft_start"] - started, r["sft_s"], r["step_s"], r["reward_s"],
                 r["samples_per_step"], [tuple(e) for e in r["evals"]], r["rewards"])


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if importlib.util.find_spec("trl") is None:
        raise SystemExit("TRL is not installed: pip install -e '.[bench]'")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from moerl.config import load_run_config
    from moerl.models.count import count_params
    from moerl.typed_config import to_dict

    cfg = load_run_config(overrides(args))
    if cfg.rl.objective != "grpo":
        raise SystemExit(f"the TRL side mirrors rl.objective=grpo, not {cfg.rl.objective}")
    samples = cfg.rl.prompts_per_step * cfg.rl.group_size
    spec = {**{k: to_dict(getattr(cfg, k)) for k in ("model", "data", "sft", "optim", "rl")},
            "reward_workers": cfg.rewards.max_concurrency}
    with tempfile.TemporaryDirectory(prefix="moerl-vs-trl-") as name:
        tmp = Path(name)
        moerl = run_moerl(args, tmp, samples, count_params(cfg.model, include_mtp=True)[0])
        trl = run_trl(tmp, spec)
    report(args, cfg.model.mtp_num_layers > 0, {"moerl": moerl, "TRL": trl})


def report(args: argparse.Namespace, mtp: bool, runs: dict[str, Trace]) -> None:
    moerl, trl = runs["moerl"], runs["TRL"]
    threshold = args.threshold
    if threshold is None:
        start = max(t.evals[0][2] for t in runs.values())
        threshold = (start + max(r for t in runs.values() for _, _, r in t.evals)) / 2
    equal = min(t.evals[-1][1] for t in runs.values())  # the faster one's last evaluation

    def median_step(t: Trace) -> float:
        return statistics.median(t.step_s[1:] or t.step_s)

    def seconds(x: float | None) -> str:
        return "not reached" if x is None else f"{x:.1f}"

    def rate(x: float | None) -> str:
        return "-" if x is None else f"{x:.3f}"

    table = [
        ("parameters" + (" (moerl: with its MTP head)" if mtp else ""),
         lambda t: f"{t.params:,}"),
        ("start-up s (launch to SFT start)", lambda t: f"{t.startup_s:.1f}"),
        (f"SFT s ({args.sft_steps} steps)", lambda t: f"{t.sft_s:.1f}"),
        ("RL s/step (median after the 1st)", lambda t: f"{median_step(t):.2f}"),
        ("  of which rewards s (median)",
         lambda t: f"{statistics.median(t.reward_s[1:] or t.reward_s):.2f}"),
        ("samples/s", lambda t: f"{t.samples_per_step / median_step(t):.1f}"),
        ("train reward, 1st -> last RL step",
         lambda t: f"{t.rewards[0]:.2f} -> {t.rewards[-1]:.2f}" if t.rewards else "-"),
        ("pass rate after SFT", lambda t: rate(t.evals[0][2])),
        ("pass rate at the end", lambda t: rate(t.evals[-1][2])),
        ("best pass rate", lambda t: rate(max(r for _, _, r in t.evals))),
        (f"s from SFT start to pass rate {threshold:.3f}", lambda t: seconds(t.reached(threshold))),
        (f"pass rate at {equal:.0f} s after SFT start (-: none yet)",
         lambda t: rate(t.rate_at(equal))),
    ]
    print(TABLE_TITLE)
    print(f"demo task, SFT {args.sft_steps} steps, RL {args.rl_steps} steps of {args.prompts} "
          f"prompts x {args.group} samples ({args.updates} updates), {args.eval_size} held-out "
          f"tasks, OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}")
    print(f"{'':<48}{'moerl':>14}{'TRL':>14}")
    for label, cell in table:
        print(f"{label:<48}{cell(moerl):>14}{cell(trl):>14}")
    print(f"moerl step / TRL step: {median_step(moerl) / median_step(trl):.2f}")
    to_m, to_t = moerl.reached(threshold), trl.reached(threshold)
    ratio = f"{to_m / to_t:.2f}" if to_m is not None and to_t else "n/a (not reached by both)"
    print(f"moerl time to threshold / TRL time to threshold: {ratio}")
    print(moerl.note)
    print("held-out pass rate at each evaluation (RL step: rate @ s from SFT start)")
    for name, t in runs.items():
        print(f"  {name:<6}" + "  ".join(f"{s}: {r:.3f} @ {w:.0f}" for s, w, r in t.evals))


if __name__ == "__main__":
    main()
