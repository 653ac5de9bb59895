"""A mixture run's launch and report: reward plug-ins reach the reward servers, prompts
graded by an unserved reward are refused at start-up, and the per-domain table and
plot come from metrics.jsonl."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rich.console import Console

from moerl.config import load_run_config
from moerl.data.prompts import PromptRecord
from moerl.launchers.domain_report import check_reward_names, domain_plot, domain_table
from moerl.launchers.plan import build_run_plan
from moerl.rewards.config import RewardStageConfig
from moerl.rewards.registry import BUILTIN
from moerl.rewards.server import _parse_args, _reward_paths
from moerl.typed_config import ConfigError

MIXTURE = ["domain=[code,terminal]", "data.source=mixture", "+data.mixture={code:1,terminal:1}"]


def test_reward_plugins_are_served_beside_the_built_in_rewards(tmp_path: Path) -> None:
    overrides = [*MIXTURE, "+rewards.plugins.mine=mypkg.rewards:Mine"]
    cfg = load_run_config(overrides, world_size=1)
    plan = build_run_plan(tmp_path, overrides, cfg.launcher, cfg.rollout, cfg.rewards,
                          tmp_path / "arch.json", environments=cfg.environments)
    (reward,) = [s for s in plan.stages if s.name == "reward"]
    args = _parse_args(reward.argv("127.0.0.1", 0, 0)[5:])
    assert _reward_paths(args.reward) == {**BUILTIN, "mine": "mypkg.rewards:Mine"}
    # the terminal domain brings the environment servers
    assert "environment" in [s.name for s in plan.stages]
    with pytest.raises(ConfigError, match=r"rewards\.plugins\.bad: 'nocolon'"):
        load_run_config([*MIXTURE, "+rewards.plugins.bad=nocolon"], world_size=1)


def test_a_prompt_graded_by_an_unserved_reward_is_refused_naming_its_domain() -> None:
    records = [PromptRecord("mine/1", "p", "mine", domain="mine")]
    with pytest.raises(ConfigError, match=r"data.domains.mine: .* rewards.plugins.mine="):
        check_reward_names(records, RewardStageConfig())
    check_reward_names(records, RewardStageConfig(plugins={"mine": "mypkg.rewards:Mine"}))


def test_the_per_domain_table_and_plot(tmp_path: Path) -> None:
    rows = [
        {"step": 0, "eval/pass_rate": 0.1, "eval_pass_rate/code": 0.25, "eval_reward/code": 0.5},
        {"step": 0, "reward/mean": 0.2, "domain_samples/code": 8, "domain_reward/code": 0.125,
         "domain_samples/math": 4, "domain_reward/math": 0.0},
        {"step": 1, "reward/mean": 0.4, "domain_samples/code": 8, "domain_reward/code": 0.75,
         "domain_samples/math": 4, "domain_reward/math": 0.5},
        {"step": 2, "eval/pass_rate": 0.3, "eval_pass_rate/code": 0.875, "eval_reward/code": 0.9},
    ]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    console = Console(record=True, width=160)
    console.print(domain_table(metrics))
    lines = {line.split("│")[1].strip(): line for line in console.export_text().splitlines()
             if line.count("│") > 2}
    assert [c.strip() for c in lines["code"].split("│")[2:-1]] == [
        "0.250", "0.875", "0.500", "0.900", "0.125", "0.750"]
    assert [c.strip() for c in lines["math"].split("│")[2:-1]] == [
        "-", "-", "-", "-", "0.000", "0.500"]
    plot = domain_plot(metrics, tmp_path)
    assert plot is not None and plot.stat().st_size > 0
    metrics.write_text(json.dumps({"step": 0, "reward/mean": 0.1}) + "\n")
    assert domain_plot(metrics, tmp_path / "none") is None  # not a mixture
