"""Agent episodes on the real terminal environment over the real sandbox, and one driven
by a real rollout server (tiny random model on 127.0.0.1).

A scripted policy solves one task of each family in several steps (verifier: 1); a
policy that prints PASSED, exits 0 or forges a verdict gets 0; a work dir deleted
between steps (an environment fault) is restored from its snapshot and the episode
goes on, and a fault on every step ends as an unscored infra failure; the random model's
junk becomes well-formed observations and the episode ends within its limits with
correct masks.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from local_servers import rollout_server

from moerl.agent.environment import Observation
from moerl.agent.scheduler import AgentScheduler, SchedulerConfig
from moerl.agent.tasks import SUBMIT, ScriptedPolicy, TaskCase, generate_tasks, tagged
from moerl.agent.terminal import TerminalEnvironment
from moerl.agent.tools import ToolCall
from moerl.agent.trajectory import Trajectory
from moerl.data.rl_batch import pack, plan_microbatches
from moerl.data.tokenizer import ByteTokenizer
from moerl.rollout.client import RolloutClient
from moerl.sandbox import Limits, Sandbox, SandboxConfig

pytestmark = pytest.mark.sandbox
TOK = ByteTokenizer()


@pytest.fixture(scope="module")
def sandbox() -> Sandbox:
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed")
    return Sandbox(SandboxConfig(max_limits=Limits(wall_time_s=10, cpu_time_s=10, memory_mb=512)))


def _run(
    sandbox: Sandbox,
    scripts: dict[str, Sequence[ToolCall]],
    cases: Sequence[TaskCase],
    env_factory=None,
    **cfg: object,
) -> list[Trajectory]:
    factory = env_factory or (lambda: TerminalEnvironment(sandbox))
    config = SchedulerConfig(max_concurrency=4, **cfg)  # type: ignore[arg-type]
    return AgentScheduler(ScriptedPolicy(scripts, TOK), factory, TOK, config).run(
        [tagged(c.task) for c in cases]
    )


def test_scripted_policy_solves_every_family(sandbox: Sandbox) -> None:
    cases = generate_tasks(4, seed=3)
    trajs = _run(sandbox, {c.task.id: c.solution for c in cases}, cases)
    for traj, case in zip(trajs, cases, strict=True):
        assert traj.status == "submitted", (traj.task_id, traj.infra_error)
        assert traj.reward == 1.0 and traj.env_faults == 0, traj.task_id
        assert traj.model_turns == len(case.solution)
    records = [t.to_record() for t in trajs]
    assert all(r.reward == 1.0 for r in records)
    fix = TOK.decode(list(records[1].completion_ids))
    assert "SyntaxError" in fix and "exit code: 1" in fix  # the failed step was observed


FORGER = """import glob, json, os
fake = json.dumps({"nonce": "0" * 32, "score": 1.0}).encode()
for path in glob.glob("/proc/*/fd/*"):
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        os.write(fd, fake)
    except OSError:
        pass
for fd in range(3, 64):
    try:
        os.write(fd, fake)
    except OSError:
        pass
print("PASSED")
print("[0, 0, 0]")
os._exit(0)
"""


def test_policies_that_fake_success_get_zero(sandbox: Sandbox) -> None:
    cases = generate_tasks(4, seed=5)
    fake = ToolCall("run", {"command": "echo PASSED; echo 'OK'; exit 0"})
    scripts = {
        cases[0].task.id: [fake, SUBMIT],
        cases[1].task.id: [
            ToolCall("write_file", {"path": "report.py", "content": "print('PASSED')\n"}),
            SUBMIT,
        ],
        cases[2].task.id: [
            ToolCall("write_file", {"path": "mathlib.py", "content": FORGER}),
            SUBMIT,
        ],
        cases[3].task.id: [ToolCall("run", {"command": "echo 'PASSED 1/1'; exit 0"}), SUBMIT],
    }
    trajs = _run(sandbox, scripts, cases)
    assert [t.status for t in trajs] == ["submitted"] * 4
    assert [t.reward for t in trajs] == [0.0] * 4


class DeletingEnvironment(TerminalEnvironment):
    """Deletes its own work dir from the host before the given step numbers: the sandbox
    then cannot start the command (a fault of the environment, not of the model)."""

    def __init__(self, sandbox: Sandbox, before_steps: set[int]) -> None:
        super().__init__(sandbox)
        self.before_steps, self.steps = before_steps, 0

    def step(self, call: ToolCall) -> Observation:
        self.steps += 1
        if self.steps in self.before_steps and self.work_dir is not None:
            shutil.rmtree(self.work_dir)
        return super().step(call)


def test_deleted_work_dir_is_restored_and_the_episode_continues(sandbox: Sandbox) -> None:
    (case,) = generate_tasks(3, seed=9)[2:]
    envs: list[DeletingEnvironment] = []

    def factory() -> DeletingEnvironment:
        envs.append(DeletingEnvironment(sandbox, {4}))  # after the fix, before re-running tests
        return envs[-1]

    (traj,) = _run(sandbox, {case.task.id: case.solution}, [case], factory)
    assert traj.status == "submitted" and traj.reward == 1.0 and traj.env_faults == 1
    assert "Can't find source path" in traj.faults[0]
    out = TOK.decode(list(traj.segments[-2].token_ids))  # the re-run tests, after restore
    assert "ok" in out and "exit code: 0" in out


def test_faults_on_every_step_end_as_infra_failure(sandbox: Sandbox) -> None:
    (case,) = generate_tasks(1, seed=9)
    factory = lambda: DeletingEnvironment(sandbox, set(range(1, 50)))  # noqa: E731
    (traj,) = _run(sandbox, {case.task.id: case.solution}, [case], factory, max_env_faults=2)
    assert traj.status == "infra_failure" and traj.reward is None and traj.env_faults == 3
    with pytest.raises(ValueError, match="infra failure"):
        traj.to_record()  # no reward: never a training sample


@pytest.fixture(scope="module")
def rollout(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RolloutClient]:
    with rollout_server(tmp_path_factory.mktemp("rendezvous"), seed=11) as client:
        yield client


def test_random_model_episode_stays_within_limits_with_right_masks(
    sandbox: Sandbox, rollout: RolloutClient
) -> None:
    cases = generate_tasks(2, seed=1)
    config = SchedulerConfig(max_turns=3, context_tokens=1024, max_new_tokens=48,
                             max_observation_tokens=160, max_episode_tokens=1024,
                             compact_tools=True, seed=5, max_concurrency=2)  # fmt: skip
    sched = AgentScheduler(rollout, lambda: TerminalEnvironment(sandbox), TOK, config)
    trajs = sched.run([c.task for c in cases])
    for traj in trajs:
        assert traj.status in (
            "max_turns",
            "retries_exhausted",
            "episode_length",
            "context_exhausted",
        )
        assert traj.reward == 0.0 and traj.env_faults == 0
        assert traj.num_tokens <= config.max_episode_tokens and 1 <= traj.model_turns <= 3
        rec = traj.to_record(loss_on_truncated_context=True)
        sample = rec.to_rl_sample()
        (mb,) = pack([sample], plan_microbatches([sample], token_budget=2048))
        on = mb.loss_mask[0].bool()
        model_ids = [i for s in traj.segments if s.role == "model" for i in s.token_ids]
        assert mb.labels[0][on].tolist() == model_ids  # packed: loss only on model tokens
        expected_mask = [int(s.role == "model") for s in traj.segments for _ in s.token_ids]
        assert list(rec.loss_mask) == expected_mask
        assert len(rec.completion_ids) == len(rec.rollout_logprobs) == len(rec.loss_mask)
        for m, lp in zip(rec.loss_mask, rec.rollout_logprobs, strict=True):
            assert (lp < 0.0) if m else lp == 0.0
        for seg in traj.segments:
            if seg.role == "model":
                assert len(seg.token_ids) <= 48 and seg.weight_version == 0
            else:
                assert len(seg.token_ids) <= 160
                text = TOK.decode(seg.token_ids)
                assert text.startswith("\n<tool_response>\n") and text.endswith(
                    "</tool_response>\n"
                )
                assert "error:" in text or "exit code" in text
