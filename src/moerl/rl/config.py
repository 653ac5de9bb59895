"""Typed configs of the RL loop (`rl` and `sft` groups)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from moerl.rl.rollout.types import SamplingParams

if TYPE_CHECKING:
    from moerl.parallel.layout import ParallelLayout

AdvantageKind = Literal["grpo", "grpo_no_std", "rloo"]


@dataclass
class SamplingConfig:
    max_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop: list[str] = field(default_factory=list)

    def params(self, n: int, seed: int | None) -> SamplingParams:
        return SamplingParams(
            max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
            top_k=self.top_k, n=n, stop=tuple(self.stop), seed=seed,
        )


@dataclass
class AgentTasksConfig:
    """`rl.agent`: multi-step terminal episodes as the RL data (`rl.task_source=agent`).

    Tasks come from the shipped suite (moerl.rl.agent.suite); each RL step runs
    `rl.prompts_per_step` tasks `rl.group_size` times each. Token limits bound one
    episode: the whole sequence (prompt, model turns, observations) is what the trainer
    forwards, so `max_episode_tokens` must fit the model's positions.
    """

    tasks: list[str] = field(default_factory=list)  # id globs, e.g. ["files-*"]; []: all
    categories: list[str] = field(default_factory=list)  # files, fix-test, c, logs, git
    max_turns: int = 4
    context_tokens: int = 1024  # what the model sees per turn (prompt + new tokens)
    max_new_tokens: int = 64  # per model turn
    max_observation_tokens: int = 256
    max_episode_tokens: int = 1024
    max_concurrency: int = 4  # episodes at once (each runs commands in the sandbox)
    compact_tools: bool = True  # one line per tool: small contexts
    isolation: Literal["strict", "no-cgroups"] = "strict"
    loss_on_truncated_context: bool = False

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_new_tokens", "max_observation_tokens", "max_concurrency"):
            if getattr(self, name) < 1:
                raise ValueError(f"rl.agent.{name}: must be >= 1")
        if self.context_tokens <= self.max_new_tokens:
            raise ValueError("rl.agent.context_tokens: must exceed rl.agent.max_new_tokens")


@dataclass
class RLConfig:
    """The `rl` group: what one RL step does, and how many."""

    steps: int = 30
    prompts_per_step: int = 16
    group_size: int = 8
    objective: str = "grpo"  # ppo_clip, grpo, dapo, gspo, cispo, dr_grpo
    objective_args: dict[str, Any] = field(default_factory=dict)  # that objective's config
    advantage: AdvantageKind = "grpo"
    # DAPO dynamic sampling: keep only groups whose rewards differ, generating up to
    # this many rounds of prompts to fill the step.
    dynamic_sampling: bool = True
    max_generation_rounds: int = 3
    # Soft overlong penalty: the last `overlong_buffer` tokens before max_tokens cost
    # up to `overlong_penalty` reward (0 disables).
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0
    mode: Literal["sync", "async"] = "sync"
    max_staleness: int = 1  # async: samples more weight versions old than this are dropped
    updates_per_step: int = 1  # optimizer steps (minibatches) per RL step
    token_budget: int = 2048  # tokens per micro-batch of the policy update
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    eval_interval: int = 10  # steps between held-out evaluations (0: only first and last)
    eval_temperature: float = 0.0  # greedy
    keep_weight_versions: int = 2  # published weight dirs kept on disk
    # Keep training the MoE balance loss and the MTP head (DeepSeek-V3's MTP objective)
    # alongside the policy, e.g. so MTP drafts stay accepted by a moving policy.
    aux_losses: bool = False
    seed: int = 0
    # prompts: single-shot completions of data prompts, scored by the reward servers;
    # agent: multi-step terminal episodes (rl.agent), scored by the tasks' verifiers.
    task_source: Literal["prompts", "agent"] = "prompts"
    agent: AgentTasksConfig = field(default_factory=AgentTasksConfig)

    def __post_init__(self) -> None:
        if self.group_size < 2:
            raise ValueError("rl.group_size: group advantages need at least 2 samples a prompt")
        if min(self.steps, self.prompts_per_step, self.max_generation_rounds) < 1:
            raise ValueError("rl.steps, rl.prompts_per_step, rl.max_generation_rounds: >= 1")
        if self.max_staleness < 0:
            raise ValueError("rl.max_staleness: must be >= 0")
        if self.overlong_buffer >= self.sampling.max_tokens and self.overlong_buffer:
            raise ValueError("rl.overlong_buffer: must be smaller than rl.sampling.max_tokens")
        if self.task_source == "agent":
            from moerl.rl.agent.suite import SuiteError, select_tasks

            try:
                select_tasks(self.agent.tasks, self.agent.categories)
            except SuiteError as err:
                raise ValueError(f"rl.agent.tasks / rl.agent.categories: {err}") from err


@dataclass
class SFTConfig:
    """The `sft` group: supervised fine-tuning (`moerl sft`, or the warm-up before RL)
    on instruction data, loss on the responses only."""

    steps: int = 0  # 0: no SFT
    global_batch: int = 32  # rows per step (with `pack`, each row holds several examples)
    micro_batch: int = 8
    seq_length: int = 96
    lr: float = 3e-3
    warmup_steps: int = 10
    pack: bool = False  # several examples per row, attention kept inside each
    # JSONL of {"prompt": ..., "response": ...}; null: the `data` group's reference
    # completions (the prompts' `reference` field)
    data_path: str | None = None

    def __post_init__(self) -> None:
        for name in ("global_batch", "micro_batch", "seq_length"):
            if getattr(self, name) < 1:
                raise ValueError(f"sft.{name}: must be >= 1")
        if self.steps < 0 or self.warmup_steps < 0:
            raise ValueError("sft.steps and sft.warmup_steps: must be >= 0")
        if self.global_batch % self.micro_batch:
            raise ValueError(f"sft.global_batch: {self.global_batch} is not a multiple of "
                             f"sft.micro_batch ({self.micro_batch})")

    def check_layout(self, layout: ParallelLayout, mtp_layers: int) -> None:
        """The batch-shape rules of a layout, naming the sft field to change."""
        if self.global_batch % (self.micro_batch * layout.dp):
            raise ValueError(
                f"sft.global_batch: {self.global_batch} must be a multiple of sft.micro_batch "
                f"* dp = {self.micro_batch * layout.dp}"
            )
        split = layout.sequence_multiple()
        if self.seq_length % split:
            raise ValueError(
                f"sft.seq_length: {self.seq_length} must be a multiple of {split} "
                "(2*cp for the context-parallel split, times tp under sequence parallelism)"
            )
        if self.pack and layout.cp > 1 and mtp_layers:
            raise ValueError(
                "sft.pack: multi-token prediction over packed rows under context parallelism "
                "is not supported; set sft.pack=false, model.mtp_num_layers=0 or parallel.cp=1"
            )
