"""RL on agent episodes through the loop.

The agent collect against a real rollout server (tiny random model) and the real
sandbox gives groups of training sequences whose packed loss mask covers exactly the
model's tokens; then `moerl train rl.task_source=agent` runs two RL steps through the
real stages (reward server, rollout server, trainer) on the simplest tasks, and the
trainer's own counts show it trained on the model's tokens only, with its logprobs
matching the engine's on them.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from local_servers import rollout_server
from sandbox_owners import SandboxOwners

from moerl.data.prompts import PromptStream
from moerl.data.rl_batch import pack, plan_microbatches
from moerl.data.tokenizer import ByteTokenizer
from moerl.rl.agent_collect import agent_task_records, build_agent_collector
from moerl.rl.config import AgentTasksConfig, RLConfig
from moerl.rl.domains import Generation
from moerl.rl.loop import collect
from moerl.rollout.client import RolloutClient
from moerl.sandbox import Sandbox, SandboxConfig

pytestmark = pytest.mark.sandbox
TOK = ByteTokenizer()
SIMPLE = ["files-create-greeting", "logs-count-errors"]
USER_TASKS = Path(__file__).with_name("user_tasks")  # a task of a user's own


@pytest.fixture(scope="module")
def rollout(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RolloutClient]:
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed")
    with rollout_server(tmp_path_factory.mktemp("rendezvous"), seed=3) as client:
        yield client


def test_agent_collect_trains_only_on_model_tokens(rollout: RolloutClient) -> None:
    agent = AgentTasksConfig(tasks=SIMPLE, max_turns=2, max_new_tokens=32,
                             max_observation_tokens=128, max_episode_tokens=1024)  # fmt: skip
    cfg = RLConfig(prompts_per_step=2, group_size=2, dynamic_sampling=False, seed=1,
                   task_source="agent", agent=agent)  # fmt: skip
    collector = build_agent_collector(cfg, 1024, TOK, Sandbox(SandboxConfig()))
    ctl: Any = SimpleNamespace(
        prompts=PromptStream(agent_task_records(agent), seed=1), episodes=collector,
        generation=lambda: Generation(rollout, cast(Any, None), lambda r: [], (), {}, collector))
    batch = collect(ctl, cfg, step=0)  # the loop's own collect
    trajs = [t for g in collector.last_groups for t in g]
    assert len(batch.samples) == len(trajs) == 4
    assert sorted({t.task_id for t in trajs}) == sorted(SIMPLE)  # 2 tasks x 2 episodes
    assert [s.group_id for s in batch.samples] == [0, 0, 1, 1]
    assert batch.metrics["reward/infra_errors"] == 0.0 and batch.metrics["agent/turns"] >= 1
    # Seeds differ per episode: the two episodes of a group are not copies.
    assert trajs[0].segments[0].token_ids != trajs[1].segments[0].token_ids
    expected: list[int] = []
    for sample, traj in zip(batch.samples, trajs, strict=True):
        model = [i for s in traj.segments if s.role == "model" and not s.context_truncated
                 for i in s.token_ids]  # fmt: skip
        observed = [i for s in traj.segments if s.role == "observation" for i in s.token_ids]
        on = sample.loss_mask.bool()
        assert sample.completion_ids[on].tolist() == model and model and observed
        assert sample.reward == traj.reward == 0.0 and sample.advantage == 0.0
        assert all(lp < 0 for lp in sample.rollout_logprobs[on].tolist())
        expected += model
    # Packed into micro-batches: the positions that carry loss hold exactly those tokens.
    packed = pack(batch.samples, plan_microbatches(batch.samples, token_budget=2048))
    trained = [i for mb in packed for row in range(mb.shape[0])
               for i in mb.labels[row][mb.loss_mask[row].bool()].tolist()]  # fmt: skip
    assert sorted(trained) == sorted(expected)
    assert sum(int(mb.loss_mask.sum()) for mb in packed) == len(expected)


def test_rl_run_on_agent_tasks_through_the_stages(tmp_path: Path) -> None:
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed")
    run = tmp_path / "run"
    # One shipped task and one of a user's own (its directory given by rl.agent.task_dirs):
    # two steps of one task each take both, in some order.
    argv = [sys.executable, "-m", "moerl.launchers.cli", "train", "sft.steps=0",
            "rl.task_source=agent", f"rl.agent.tasks=[{SIMPLE[0]},kitchen-copy]",
            f"rl.agent.task_dirs=[{shutil.copytree(USER_TASKS, tmp_path / 'mine')}]",
            "rl.steps=2",
            "rl.prompts_per_step=1", "rl.group_size=2", "rl.dynamic_sampling=false",
            "rl.eval_interval=0", "rl.agent.max_turns=2", "rl.agent.max_new_tokens=24",
            "rl.agent.max_observation_tokens=128", "rl.agent.max_episode_tokens=900",
            "data.train_size=8", "data.eval_size=2", f"run_dir={run}"]  # fmt: skip
    start = time.monotonic()
    with SandboxOwners() as sandboxes:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=600,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    print(f"2 agent RL steps through the stages: {time.monotonic() - start:.0f}s")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    # Every episode ran on the environment server, and no sandbox descended from the
    # trainer's processes.
    assert "environment server: 4 sessions opened" in proc.stdout + proc.stderr
    assert sandboxes.stages.get("environment") and "trainer" not in sandboxes.stages, (
        sandboxes.stages)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "train/tokens" in r]
    assert [r["step"] for r in steps] == [0, 1]
    for r in steps:
        assert r["reward/infra_errors"] == 0.0 and r["train/sequences"] == 2.0
        # Loss tokens are the model's tokens (no context was cut at 900 tokens), far
        # fewer than the episode's tokens, and the trainer's logprobs on them are the
        # engine's: positions line up.
        assert r["train/tokens"] == r["rollout/response_length"] * 2 > 0
        assert r["train/tokens"] < r["agent/episode_tokens"]
        assert r["train/logprob_gap/max_abs"] < 1e-3
