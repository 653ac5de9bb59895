"""Scheduler logic against a scripted fake policy and a fake environment (no sandbox):
bounded retries, fault -> restore -> replay -> continue, repeated faults -> infra
failure (unscored), timeouts of the environment itself, context truncation, concurrency."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import pytest

from moerl.agent.environment import AgentTask, Observation, VerifyResult
from moerl.agent.scheduler import AgentScheduler, SchedulerConfig
from moerl.agent.tools import ToolCall, ToolSpec
from moerl.data.tokenizer import ByteTokenizer
from moerl.rl.agent_collect import episode_samples
from moerl.rl.config import RLConfig
from moerl.rollout.types import Sample, SamplingParams

TOK = ByteTokenizer()
TOOLS = (
    ToolSpec("add", "add n to the counter", {"n": {"type": "integer"}}, required=("n",)),
    ToolSpec("fail", "a command that fails"),
    ToolSpec("submit", "done"),
)


def call(name: str, **args: object) -> str:
    return ToolCall(name, args).to_text()


class ScriptedPolicy:
    """Replies per task from a fixed script (the task id is found in the prompt)."""

    def __init__(self, scripts: dict[str, list[str]], delay_s: float = 0.0) -> None:
        self.scripts = {k: list(v) for k, v in scripts.items()}
        self.delay_s = delay_s
        self.prompts: dict[str, list[list[int]]] = {k: [] for k in scripts}
        self.live = self.peak = 0
        self._lock = threading.Lock()

    def generate(
        self, prompts: Sequence[Sequence[int]], n: int = 1, sampling: SamplingParams | None = None
    ) -> list[list[Sample]]:
        assert sampling is not None and n == 1 and len(prompts) == 1
        text = TOK.decode(list(prompts[0]))
        task = next(k for k in self.scripts if f"[{k}]" in text)
        with self._lock:
            self.live += 1
            self.peak = max(self.peak, self.live)
        time.sleep(self.delay_s)
        with self._lock:
            self.live -= 1
            self.prompts[task].append(list(prompts[0]))
            reply = self.scripts[task].pop(0) if self.scripts[task] else "no more ideas"
        ids = TOK.encode(reply)[: sampling.max_tokens]
        lps = [-0.25] * len(ids)
        reason = "length" if len(ids) == sampling.max_tokens else "stop"
        return [[Sample(tuple(prompts[0]), tuple(ids), tuple(lps), reason, 3, reply)]]  # type: ignore[arg-type]


class CounterEnv:
    """State is a counter; the task is solved when it reaches 3. `faults` lists step
    numbers whose first attempt is an environment fault; `hang` makes those steps hang."""

    def __init__(
        self, faults: Sequence[int] = (), hang: bool = False, restorable: bool = True
    ) -> None:
        self.value = self.saved = 0
        self.steps = 0
        self.faults, self.hang, self.restorable = set(faults), hang, restorable
        self.restores = 0
        self.log: list[str] = []

    @property
    def tools(self) -> Sequence[ToolSpec]:
        return TOOLS

    def reset(self, task: AgentTask) -> Observation:
        self.value = self.saved = 0
        return Observation("counter=0")

    def step(self, c: ToolCall) -> Observation:
        self.steps += 1
        if self.steps in self.faults:
            self.faults.discard(self.steps)
            if self.hang:
                time.sleep(1.0)
            self.value = -99  # the fault corrupts the state
            return Observation("", fault="sandbox_error: injected")
        self.log.append(c.name)
        if c.name == "submit":
            return Observation("submitted", done=True)
        if c.name == "fail":
            return Observation("exit code: 1\nstderr: boom", error=True)
        self.value += int(c.arguments["n"])
        return Observation(f"counter={self.value}")

    def verify(self) -> VerifyResult:
        return VerifyResult(1.0 if self.value == 3 else 0.0)

    def snapshot(self) -> bool:
        self.saved = self.value
        return True

    def restore(self) -> bool:
        self.restores += 1
        self.value = self.saved
        return self.restorable

    def close(self) -> None:
        pass


def _task(name: str) -> AgentTask:
    return AgentTask(name, f"[{name}] bring the counter to 3")


def _run(scripts: dict[str, list[str]], env_factory, **cfg: object) -> tuple[list, ScriptedPolicy]:
    policy = ScriptedPolicy(scripts)
    config = SchedulerConfig(**{"context_tokens": 4096, "max_new_tokens": 128, **cfg})  # type: ignore[arg-type]
    sched = AgentScheduler(policy, env_factory, TOK, config)
    return sched.run([_task(k) for k in scripts]), policy


SOLVE = [call("add", n=1), call("fail"), call("add", n=2), call("submit")]


def test_errors_are_observed_and_a_solution_is_scored() -> None:
    script = ["garbage", '<tool_call>{"name": "add", "arguments": {"n": "x"}}</tool_call>', *SOLVE]
    (traj,), policy = _run({"a": script}, CounterEnv, max_retries=3)
    assert traj.status == "submitted" and traj.reward == 1.0 and traj.env_faults == 0
    seen = TOK.decode(policy.prompts["a"][-1])
    assert "no tool call found" in seen and "must be a JSON integer" in seen and "boom" in seen
    assert "failed attempt 2 of 4" in seen


def test_retries_stop_at_their_bound_and_are_scored_as_model_failure() -> None:
    (traj,), policy = _run({"a": [call("fail")] * 10}, CounterEnv, max_retries=2)
    assert traj.status == "retries_exhausted" and traj.reward == 0.0
    assert traj.model_turns == 3 and len(policy.prompts["a"]) == 3


def test_environment_fault_is_restored_replayed_and_the_episode_continues() -> None:
    envs: list[CounterEnv] = []

    def factory() -> CounterEnv:
        env = CounterEnv(faults=[3])
        envs.append(env)
        return env

    (traj,), _ = _run({"a": SOLVE}, factory)
    assert traj.status == "submitted" and traj.reward == 1.0
    assert traj.env_faults == 1 and envs[0].restores == 1
    # the faulted step ran again from the restored state; nothing leaked into the context
    assert envs[0].log == ["add", "fail", "add", "submit"]
    assert "injected" not in TOK.decode(
        traj.prompt_ids + [i for s in traj.segments for i in s.token_ids]
    )


def test_environment_timeout_counts_as_a_fault() -> None:
    (traj,), _ = _run({"a": SOLVE}, lambda: CounterEnv(faults=[2], hang=True), step_timeout_s=0.3)
    assert traj.status == "submitted" and traj.reward == 1.0 and traj.env_faults == 1


def test_an_environment_that_raises_is_a_fault_not_a_crash() -> None:
    class Raising(CounterEnv):
        def step(self, c: ToolCall) -> Observation:
            if self.steps == 1 and not self.restores:
                self.steps += 1
                raise OSError("disk vanished")
            return super().step(c)

    (traj,), _ = _run({"a": SOLVE}, Raising)
    assert traj.status == "submitted" and traj.reward == 1.0
    assert traj.faults == ["environment raised OSError: disk vanished"]


def test_repeated_faults_make_an_unscored_infra_failure() -> None:
    (traj,), _ = _run({"a": SOLVE}, lambda: CounterEnv(faults=[1, 2, 3]), max_env_faults=2)
    assert (
        traj.status == "infra_failure"
        and traj.reward is None
        and "3 environment faults" in (traj.infra_error or "")
    )
    assert episode_samples([traj, traj], RLConfig(), False, group_id=0) == []  # not trained on
    (traj,), _ = _run({"a": SOLVE}, lambda: CounterEnv(faults=[1], restorable=False))
    assert traj.status == "infra_failure" and "cannot restore" in (traj.infra_error or "")


def test_generator_failure_is_infra() -> None:
    class Down:
        def generate(self, *a: object, **k: object) -> list[list[Sample]]:
            raise ConnectionError("refused")

    traj = AgentScheduler(Down(), CounterEnv, TOK).run([_task("a")])[0]
    assert traj.status == "infra_failure" and "refused" in (traj.infra_error or "")


def test_context_overflow_is_truncated_keeping_task_and_latest_turn() -> None:
    script = [call("add", n=0) + " " * 40] * 8 + [call("add", n=3), call("submit")]
    (traj,), policy = _run(
        {"a": script}, CounterEnv, context_tokens=1400, max_new_tokens=100, max_turns=12
    )
    assert traj.status == "submitted" and traj.reward == 1.0
    assert any("older turns left out" in t for t in traj.truncations)
    last = policy.prompts["a"][-1]
    assert len(last) <= 1300 and last[: len(traj.prompt_ids)] == traj.prompt_ids
    assert "earlier turns omitted]" in TOK.decode(last) and "counter=3" in TOK.decode(last)
    record = traj.to_record()
    truncated_turns = sum(s.context_truncated for s in traj.segments)
    assert truncated_turns > 0 and sum(record.loss_mask) < sum(
        len(s.token_ids) for s in traj.segments if s.role == "model"
    )


def test_per_turn_and_episode_limits_are_recorded() -> None:
    (traj,), _ = _run(
        {"a": ["x" * 500] * 3},
        CounterEnv,
        max_new_tokens=32,
        max_episode_tokens=1100,
        max_retries=10,
        max_observation_tokens=64,
    )
    assert traj.status == "episode_length" and traj.num_tokens <= 1100
    assert any("episode" in t for t in traj.truncations)
    assert any("max_tokens=32" in t for t in traj.truncations)
    assert all(len(s.token_ids) <= 64 for s in traj.segments)


def test_many_episodes_run_concurrently_within_the_bound() -> None:
    scripts = {f"t{i}": SOLVE for i in range(8)}
    policy = ScriptedPolicy(scripts, delay_s=0.05)
    sched = AgentScheduler(policy, CounterEnv, TOK, SchedulerConfig(max_concurrency=4))
    start = time.monotonic()
    trajs = sched.run([_task(k) for k in scripts])
    assert [t.task_id for t in trajs] == list(scripts)
    assert all(t.reward == 1.0 for t in trajs)
    assert 2 <= policy.peak <= 4
    assert time.monotonic() - start < 8 * 4 * 0.05


def test_config_is_checked() -> None:
    with pytest.raises(ValueError, match="context_tokens"):
        SchedulerConfig(context_tokens=10, max_new_tokens=10)
