"""`moerl train +experiment=multidomain` through the real stages: six domains drawn by
weight, graded by their own rewards (and the terminal tasks in episodes on the
environment server), per-domain metrics, evaluation, table and plot, and a resume that
continues the mixture exactly where the run stopped."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from moerl.config import load_run_config
from moerl.data.mixture import MixtureStream
from moerl.data.prompt_sources import load_prompts
from moerl.rl.agent_collect import terminal_source

DOMAINS = ("code", "programs", "math", "documents", "tools", "terminal")
PER_STEP = 7  # one draw per unit of weight: code 2, the others 1
RUN = [
    "+experiment=multidomain", f"rl.prompts_per_step={PER_STEP}", "rl.group_size=2",
    "rl.agent.max_turns=1", "logger.wandb_mode=disabled", "checkpoint.save_interval=1",
    "checkpoint.keep_last=0",
    *(f"data.domains.{d}.eval_size=1" for d in DOMAINS),
    *(f"data.domains.{d}.sampling.max_tokens=16" for d in DOMAINS if d != "terminal"),
]  # fmt: skip

pytestmark = pytest.mark.timeout(900)


def _train(run: Path, steps: int) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "moerl.launchers.cli", "train", *RUN, f"rl.steps={steps}",
         f"run_dir={run}"], capture_output=True, text=True, timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, (done.stdout + done.stderr)[-5000:]
    return done.stdout + done.stderr


def _rows(run: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _prompts_state(run: Path, step: int) -> dict[str, Any]:
    state = json.loads((run / "checkpoints" / f"step_{step:08d}" / "state.json").read_text())
    prompts: dict[str, Any] = state["extra"]["rl"]["prompts"]
    return prompts


def _offline_draws(steps: int) -> tuple[list[collections.Counter[str]], dict[str, Any]]:
    """The domains each step draws and the stream's state after `steps`, computed here
    from the same config: what an uninterrupted run takes."""
    cfg = load_run_config(RUN, world_size=1)
    records, _, _ = load_prompts(cfg.data, {"terminal": terminal_source(cfg.rl.agent)})
    stream = MixtureStream.of(records, cfg.data.mixture, cfg.data.seed)
    draws = [collections.Counter(r.domain for r in stream.take(PER_STEP)) for _ in range(steps)]
    return draws, stream.state()


def test_six_domains_by_weight_with_per_domain_metrics_and_an_exact_resume(
        tmp_path: Path) -> None:
    run = tmp_path / "run"
    first = _train(run, steps=2)
    assert "per-domain evaluation" in first
    resumed = _train(run, steps=4)  # the same run, two steps more: resumes at step 2
    assert "resumed from" in resumed and "step_00000002" in resumed

    rows = _rows(run)
    steps = [r for r in rows if "domain_samples/code" in r]
    assert [r["step"] for r in steps] == [0, 1, 2, 3]
    draws, final_state = _offline_draws(4)
    weights = {"code": 2, "programs": 1, "math": 1, "documents": 1, "tools": 1, "terminal": 1}
    for row, drawn in zip(steps, draws, strict=True):
        for name in DOMAINS:  # prompts by weight, each giving a group of 2 samples
            assert drawn[name] == weights[name]
            assert row[f"domain_samples/{name}"] == 2 * weights[name], (name, row)
            for key in ("reward", "pass_rate", "length", "truncated", "infra_errors"):
                assert f"domain_{key}/{name}" in row
            assert row[f"domain_infra_errors/{name}"] == 0
        assert all(row[f"domain_reward_seconds/{n}"] > 0 for n in DOMAINS if n != "terminal")
        assert row["agent/episode_tokens"] > 0  # the terminal tasks ran as episodes
    # The resumed run went on with the mixture exactly where an uninterrupted one would.
    assert _prompts_state(run, 4) == final_state
    assert _prompts_state(run, 2)["mixture"]["draws"] == 2
    evals = [r for r in rows if "eval/pass_rate" in r]
    assert len(evals) >= 2 and all(f"eval_pass_rate/{n}" in evals[-1] for n in DOMAINS)
    assert (run / "domains.png").stat().st_size > 0
    table = resumed[resumed.index("per-domain evaluation"):]
    assert all(name in table for name in DOMAINS)
