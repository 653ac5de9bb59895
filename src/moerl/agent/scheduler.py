"""Runs many agent episodes concurrently against a policy-side generator.

Per turn: fit the context (trajectory.fit_context), ask the generator for the next
action, parse it into a tool call, let the environment execute it, and append the
observation. The generator is anything with `RolloutClient.generate`'s signature.

What can go wrong, and what happens:

- a malformed call or a failed command: the model sees the error and may retry or
  revise; after `max_retries` failed actions in a row the episode ends (a model failure,
  still verified and scored);
- the environment itself fails (`Observation.fault`, or a step outlives
  `step_timeout_s`): the work dir is restored from the last snapshot, the actions since
  that snapshot are replayed, and the episode goes on; after `max_env_faults` faults, or
  when the generator or the verifier cannot run, the episode is an infra failure with
  reward None, never scored as the model's failure;
- the context fills up: older turns are left out (see trajectory.py); per-turn and
  per-episode token limits cut what they must and record it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol, TypeVar

from moerl.agent.environment import AgentTask, Environment, Observation, VerifyResult
from moerl.agent.tools import CALL_CLOSE, ToolCall, ToolCallError, parse_tool_call, tools_prompt
from moerl.agent.trajectory import (
    EpisodeStatus,
    Segment,
    Trajectory,
    cut_tokens,
    fit_context,
)
from moerl.data.tokenizer import Tokenizer
from moerl.rollout.types import Sample, SamplingParams

T = TypeVar("T")
log = logging.getLogger(__name__)


class Generator(Protocol):
    def generate(self, prompts: Sequence[Sequence[int]], n: int = 1,
                 sampling: SamplingParams | None = None) -> list[list[Sample]]: ...  # fmt: skip


@dataclass(frozen=True)
class SchedulerConfig:
    max_turns: int = 16
    max_concurrency: int = 8
    context_tokens: int = 4096
    """The model's context: prompt + max_new_tokens never exceed it."""
    max_new_tokens: int = 256
    """Per model turn."""
    max_observation_tokens: int = 512
    """Per observation; the middle is cut with a marker."""
    max_episode_tokens: int = 16384
    """The whole training sequence (prompt + every segment)."""
    max_retries: int = 3
    """Failed actions in a row (malformed call, failed command) before the episode ends."""
    max_env_faults: int = 2
    """Environment faults recovered per episode; one more makes it an infra failure."""
    step_timeout_s: float = 120.0
    """The environment's own deadline for one operation (above any command's limit)."""
    temperature: float = 1.0
    seed: int | None = None
    """Turn t of the i-th task of a `run` samples with seed + 1009 * i + t: episodes of
    the same task (a GRPO group) get different samples, reproducibly."""
    compact_tools: bool = False
    """Describe tools in one line each instead of full schemas (small contexts)."""

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_concurrency", "max_new_tokens", "max_observation_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"SchedulerConfig.{name} must be >= 1")
        if self.context_tokens <= self.max_new_tokens:
            raise ValueError("SchedulerConfig.context_tokens must exceed max_new_tokens")
        if self.max_retries < 0 or self.max_env_faults < 0 or self.step_timeout_s <= 0:
            raise ValueError("SchedulerConfig: retries/faults must be >= 0, timeout > 0")


class _InfraFailure(Exception):
    pass


def _observation_text(text: str) -> str:
    return f"\n<tool_response>\n{text}\n</tool_response>\n"


class AgentScheduler:
    """`run(tasks)` -> one Trajectory per task, in order. Each episode gets its own
    environment from `env_factory` (closed at the end)."""

    def __init__(self, generator: Generator, env_factory: Callable[[], Environment],
                 tokenizer: Tokenizer, config: SchedulerConfig | None = None,
                 shaping: Callable[[Observation], float] | None = None) -> None:  # fmt: skip
        self.generator = generator
        self.env_factory = env_factory
        self.tokenizer = tokenizer
        self.config = config or SchedulerConfig()
        self.shaping = shaping
        self._pool: ThreadPoolExecutor | None = None

    def run(self, tasks: Sequence[AgentTask]) -> list[Trajectory]:
        return asyncio.run(self.run_async(tasks))

    async def run_async(self, tasks: Sequence[AgentTask]) -> list[Trajectory]:
        gate = asyncio.Semaphore(self.config.max_concurrency)
        # Two threads per episode: one may be stuck in an abandoned environment step.
        with ThreadPoolExecutor(2 * self.config.max_concurrency + 1,
                                thread_name_prefix="agent") as pool:  # fmt: skip
            self._pool = pool

            async def one(task: AgentTask, index: int) -> Trajectory:
                async with gate:
                    return await self.episode(task, index)

            try:
                return list(await asyncio.gather(*(one(t, i) for i, t in enumerate(tasks))))
            finally:
                self._pool = None

    async def _call(self, fn: Callable[[], T], timeout: float | None = None) -> T:
        """Run blocking `fn` in the pool; TimeoutError past `timeout` (the thread is left to
        finish on its own: a sandbox run always ends at its wall-clock limit)."""
        future = asyncio.get_running_loop().run_in_executor(self._pool, fn)
        return await asyncio.wait_for(future, timeout)

    async def _env_call(self, fn: Callable[[], T], timeout: float, failed: T) -> tuple[T, str]:
        """An environment operation: (result, "") or (`failed`, why) when it raised or
        outlived `timeout`; either is a fault of the environment, not of the model."""
        try:
            return await self._call(fn, timeout), ""
        except TimeoutError:
            return failed, f"environment operation exceeded {timeout}s"
        except Exception as exc:
            return failed, f"environment raised {type(exc).__name__}: {exc}"

    async def episode(self, task: AgentTask, index: int = 0) -> Trajectory:
        env = self.env_factory()
        try:
            return await _Episode(self, env, task, index).run()
        finally:
            _, why = await self._env_call(env.close, 60.0, None)
            if why:
                log.warning("closing the environment of %s: %s", task.id, why)


class _Episode:
    """The state of one episode; methods are the steps of `run`."""

    def __init__(self, owner: AgentScheduler, env: Environment, task: AgentTask,
                 index: int = 0) -> None:  # fmt: skip
        self.s, self.env, self.task, self.cfg = owner, env, task, owner.config
        self.seed = None if self.cfg.seed is None else self.cfg.seed + 1009 * index
        self.traj = Trajectory(task.id, [])
        self.since_snapshot: list[ToolCall] = []
        self.failures = 0

    def _encode(self, text: str) -> list[int]:
        return self.s.tokenizer.encode(text)

    async def run(self) -> Trajectory:
        try:
            first = await self._env(lambda: self.env.reset(self.task), reset=True)
            self.traj.prompt_ids = self._prompt_ids(first.text)
            self.traj.status = await self._turns()
            result = await self._verify()
            self.traj.reward, self.traj.verify_details = result.reward, result.details
        except _InfraFailure as exc:
            self.traj.status, self.traj.reward = "infra_failure", None
            self.traj.infra_error = str(exc)
        return self.traj

    def _prompt_ids(self, first_observation: str) -> list[int]:
        tools = self.env.tools
        if self.cfg.compact_tools:
            described = "\n".join(f"{t.name}({', '.join(t.parameters)}): {t.description}"
                                  for t in tools)  # fmt: skip
            tools_text = (
                f"Tools:\n{described}\nCall one per reply: "
                f'<tool_call>{{"name": ..., "arguments": {{...}}}}</tool_call>\n'
            )
        else:
            tools_text = tools_prompt(tools)
        text = (f"You work in a Linux terminal sandbox.\n{tools_text}Task: {self.task.instruction}"
                f"\n{_observation_text(first_observation)}")  # fmt: skip
        bos = self.s.tokenizer.bos_id
        return ([bos] if bos is not None else []) + self._encode(text)

    async def _turns(self) -> EpisodeStatus:
        max_turns = self.task.max_turns or self.cfg.max_turns
        for turn in range(max_turns):
            sample = await self._generate(turn)
            if isinstance(sample, str):
                return sample
            text = self.s.tokenizer.decode(list(sample.token_ids))
            parsed = parse_tool_call(text, self.env.tools)
            if isinstance(parsed, ToolCallError):
                obs = Observation(f"error: {parsed.message}", error=True)
            else:
                obs = await self._act(parsed)
            step_reward = self.s.shaping(obs) if self.s.shaping is not None else 0.0
            self.traj.step_rewards.append(step_reward)
            self.failures = self.failures + 1 if obs.error else 0
            if obs.done:
                return "submitted"
            if not self._append_observation(turn, obs.text + self._retry_note(obs)):
                return "episode_length"
            if self.failures > self.cfg.max_retries:
                return "retries_exhausted"
        return "max_turns"

    def _retry_note(self, obs: Observation) -> str:
        if not obs.error:
            return ""
        if self.failures > self.cfg.max_retries:
            return f"\n(failed {self.failures} times in a row: the episode ends)"
        return f"\n(failed attempt {self.failures} of {self.cfg.max_retries + 1}; retry or revise)"

    async def _generate(self, turn: int) -> Sample | EpisodeStatus:
        """The model's next turn, or why the episode ends (context or episode budget)."""
        room = self.cfg.max_episode_tokens - self.traj.num_tokens
        budget = self.cfg.context_tokens - self.cfg.max_new_tokens
        omitted = lambda k: self._encode(_observation_text(f"[{k} earlier turns omitted]"))  # noqa: E731
        fitted = fit_context(self.traj.prompt_ids, self.traj.segments, budget, omitted)
        if room < 1:
            self.traj.truncations.append(f"turn {turn}: episode token limit reached")
            return "episode_length"
        if fitted is None:
            self.traj.truncations.append(f"turn {turn}: task + latest turn exceed the context")
            return "context_exhausted"
        context, dropped = fitted
        if dropped:
            self.traj.truncations.append(
                f"turn {turn}: {dropped} older turns left out of the context"
            )
        sampling = SamplingParams(
            max_tokens=min(self.cfg.max_new_tokens, room), temperature=self.cfg.temperature,
            stop=(CALL_CLOSE,), seed=None if self.seed is None else self.seed + turn,
            stop_token_ids=self.s.tokenizer.stop_ids,  # the tokenizer's end of turn too
        )  # fmt: skip
        try:
            (group,) = await self.s._call(
                lambda: self.s.generator.generate([context], n=1, sampling=sampling)
            )
            (sample,) = group
        except Exception as exc:  # the rollout service, not the model, failed
            raise _InfraFailure(f"generation failed at turn {turn}: {exc}") from exc
        truncated = sample.finish_reason == "length"
        if truncated:
            self.traj.truncations.append(
                f"turn {turn}: completion hit max_tokens={sampling.max_tokens}"
            )
        self.traj.segments.append(Segment(
            "model", list(sample.token_ids), list(sample.logprobs), truncated=truncated,
            context_truncated=dropped > 0, weight_version=sample.weight_version))  # fmt: skip
        return sample

    def _append_observation(self, turn: int, text: str) -> bool:
        """Append the observation within its limits; False when the episode is full.
        Cuts apply to the text inside the tags, so the observation stays well-formed."""
        opening, closing = _observation_text("").split("\n\n", 1)
        head, tail = self._encode(opening + "\n"), self._encode("\n" + closing)
        marker = self._encode("\n[... observation truncated ...]\n")
        wrap = len(head) + len(tail)
        room = self.cfg.max_episode_tokens - self.traj.num_tokens
        limit = min(self.cfg.max_observation_tokens, room) - wrap
        body, cut = cut_tokens(self._encode(text), max(limit, 0), marker)
        full = (room <= self.cfg.max_observation_tokens and cut) or room <= wrap
        if cut:
            why = "the episode limit" if full else f"{self.cfg.max_observation_tokens} tokens"
            self.traj.truncations.append(f"turn {turn}: observation cut to {why}")
        if room > wrap:
            self.traj.segments.append(Segment("observation", head + body + tail, truncated=cut))
        return not full

    async def _env(self, fn: Callable[[], Observation], reset: bool = False) -> Observation:
        """One environment operation with the environment's own deadline; a fault or a
        timeout is recovered (restore + replay) or becomes an infra failure."""
        while True:
            obs, why = await self.s._env_call(fn, self.cfg.step_timeout_s, Observation(""))
            fault = why or obs.fault
            if fault is None:
                return obs
            await self._recover(fault, reset)

    async def _recover(self, fault: str, reset: bool) -> None:
        self.traj.faults.append(fault)
        if self.traj.env_faults > self.cfg.max_env_faults:
            raise _InfraFailure(f"{self.traj.env_faults} environment faults; last: {fault}")
        if reset:
            return  # a failed reset is simply tried again
        restored, _ = await self.s._env_call(self.env.restore, self.cfg.step_timeout_s, False)
        if not restored:
            raise _InfraFailure(f"cannot restore the environment after: {fault}")
        for call in list(self.since_snapshot):  # redo what the snapshot does not hold
            await self._env(lambda c=call: self.env.step(c))  # type: ignore[misc]

    async def _act(self, call: ToolCall) -> Observation:
        obs = await self._env(lambda: self.env.step(call))
        if obs.done:
            return obs
        saved, _ = await self.s._env_call(self.env.snapshot, self.cfg.step_timeout_s, False)
        self.since_snapshot = [] if saved else [*self.since_snapshot, call]
        return obs

    async def _verify(self) -> VerifyResult:
        while True:
            failed = VerifyResult(None, infra_error="verifier did not run")
            result, why = await self.s._env_call(self.env.verify, self.cfg.step_timeout_s, failed)
            fault = why or result.infra_error
            if fault is None:
                return result
            self.traj.faults.append(fault)
            if self.traj.env_faults > self.cfg.max_env_faults:
                raise _InfraFailure(f"verification failed: {fault}")
