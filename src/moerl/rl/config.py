"""Typed configs of the RL loop: the `rl` group, which the loop, the policy update and the
critic read as it is (no field is copied into another config)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from moerl.rl.critic_config import GAE_DEFAULTS, CriticConfig
from moerl.rl.objective_config import AggregationMode, ObjectiveConfig, objective_config_class
from moerl.rollout.types import SamplingParams

AdvantageKind = Literal["grpo", "grpo_no_std", "rloo", "reinforce_pp", "gae"]

# Stands for "the objective's own defaults" until RLConfig knows its objective.
_OBJECTIVE_DEFAULTS = ObjectiveConfig()


@dataclass
class SamplingConfig:
    max_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop: list[str] = field(default_factory=list)
    # Every completion runs to max_tokens: neither EOS nor the tokenizer's end-of-turn
    # ids stop it (fixed lengths, e.g. to measure steps or long generations).
    ignore_eos: bool = False

    def params(self, n: int, seed: int | None, stop_token_ids: tuple[int, ...] = (),
               routed_experts: bool = False) -> SamplingParams:
        return SamplingParams(
            max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
            top_k=self.top_k, n=n, stop=tuple(self.stop), seed=seed,
            stop_token_ids=() if self.ignore_eos else stop_token_ids,
            ignore_eos=self.ignore_eos, return_routed_experts=routed_experts,
        )


@dataclass
class AgentTasksConfig:
    """`rl.agent`: multi-step terminal episodes as the RL data (`rl.task_source=agent`).

    Tasks come from the shipped suite (moerl.agent.suite) and the directories in
    `task_dirs` (a user's tasks, in the same YAML format); each RL step runs
    `rl.prompts_per_step` tasks `rl.group_size` times each. Token limits bound one
    episode: the whole sequence (prompt, model turns, observations) is what the trainer
    forwards, so `max_episode_tokens` must fit the model's positions.
    """

    tasks: list[str] = field(default_factory=list)  # id globs, e.g. ["files-*"]; []: all
    categories: list[str] = field(default_factory=list)  # files, fix-test, c, logs, git, ...
    task_dirs: list[str] = field(default_factory=list)  # directories of a user's task files
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
    # That objective's config, of its own class (rl/objective_config.py: GRPOConfig, ...),
    # typed when the run's config is read; unset: the objective's defaults.
    objective_args: ObjectiveConfig = field(default_factory=lambda: _OBJECTIVE_DEFAULTS)
    # grpo / grpo_no_std / rloo: one advantage per sample from its group's rewards;
    # reinforce_pp: per-token returns whitened over the step (`rl.token_returns`);
    # gae: PPO with a critic, GAE(gae_gamma, gae_lambda) from its values (`rl.critic`).
    advantage: AdvantageKind = "grpo"
    # KL penalty in the reward: r_t -= kl_in_reward * (log pi_old - log pi_ref) per token
    # (0: none); with reinforce_pp or gae only (a group baseline compares whole rewards:
    # use the objective's KL loss term there).
    kl_in_reward: float = 0.0
    gae_gamma: float = 1.0  # gae: discount per generated token
    gae_lambda: float = 0.95  # gae: bias/variance trade-off of the advantage estimate
    critic: CriticConfig = field(default_factory=CriticConfig)  # gae only
    # DAPO dynamic sampling: keep only groups whose rewards differ, generating up to
    # this many rounds of prompts to fill the step.
    dynamic_sampling: bool = True
    max_generation_rounds: int = 3
    # Online difficulty filter: a prompt whose last group was all solved or all failed
    # sits out this many epochs of the prompt stream (0: off; prompts, not agent tasks).
    difficulty_filter_epochs: int = 0
    # Soft overlong penalty: the last `overlong_buffer` tokens before max_tokens cost
    # up to `overlong_penalty` reward (0 disables).
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0
    mode: Literal["sync", "async"] = "sync"
    max_staleness: int = 1  # async: samples more weight versions old than this are dropped
    updates_per_step: int = 1  # optimizer steps (minibatches) per RL step
    token_budget: int = 2048  # tokens per micro-batch of the policy update (B * T)
    # pi_old recomputed with the weights the step starts from; false: the rollout
    # engine's logprobs stand for it.
    recompute_old_logprobs: bool = True
    # A frozen reference model (the policy as RL starts) for the objective's KL term, the
    # KL in the reward and the KL metric; false needs both KL coefficients at 0.
    use_reference: bool = True
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    eval_interval: int = 10  # steps between held-out evaluations (0: only first and last)
    eval_temperature: float = 0.0  # greedy
    keep_weight_versions: int = 2  # published weight dirs kept on disk
    # How each new version reaches moerl rollout servers: `disk` (published, then
    # loaded by every server) or `memory` (streamed over a process group the servers
    # join; the first version and any failed stream still go through disk).
    weight_sync: Literal["disk", "memory"] = "disk"
    # memory: the staging memory each rank (trainer and server alike) may hold beyond
    # its weights while a version streams, as two buffers of half this (bytes).
    weight_sync_staging_bytes: int = 256 << 20
    # memory: the bound on every wait of one version's stream (forming the group, each
    # message, the servers' replies); past it the version goes by disk.
    weight_sync_timeout_s: float = 600.0
    # Keep training the MoE balance loss and the MTP head (DeepSeek-V3's MTP objective)
    # alongside the policy, e.g. so MTP drafts stay accepted by a moving policy.
    aux_losses: bool = False
    seed: int = 0
    # prompts: single-shot completions of data prompts, scored by the reward servers;
    # agent: multi-step terminal episodes (rl.agent), scored by the tasks' verifiers.
    task_source: Literal["prompts", "agent"] = "prompts"
    # Routing replay: the rollout engine returns the experts each MoE layer chose for
    # every position, and the update's forwards route through them, so a router that
    # moved since the rollout (its expert bias, its weights) does not change which
    # experts a token's logprob comes from. moerl engines only; prompts, not episodes.
    routing_replay: bool = False
    agent: AgentTasksConfig = field(default_factory=AgentTasksConfig)

    @staticmethod
    def field_types(data: dict[str, Any]) -> dict[str, Any]:
        """`objective_args` is read as the config class of `objective` (typed_config)."""
        return {"objective_args": _objective_class(data.get("objective", RLConfig.objective))}

    @property
    def max_response_tokens(self) -> int:
        """The most tokens one sample's loss can cover: a completion, or the model's
        turns of an agent episode."""
        if self.task_source == "agent":
            return self.agent.max_turns * self.agent.max_new_tokens
        return self.sampling.max_tokens

    def __post_init__(self) -> None:
        self.objective_args = self._typed_objective_args()
        if not self.use_reference and (self.objective_args.kl_coef or self.kl_in_reward):
            raise ValueError(
                f"rl.use_reference=false with rl.objective_args.kl_coef="
                f"{self.objective_args.kl_coef} and rl.kl_in_reward={self.kl_in_reward}: a KL "
                "term needs the reference model; set rl.use_reference=true, or both to 0")
        if self.token_budget < 1:
            raise ValueError("rl.token_budget: must be >= 1")
        if self.group_size < 2:
            raise ValueError("rl.group_size: group advantages need at least 2 samples a prompt")
        if min(self.steps, self.prompts_per_step, self.max_generation_rounds) < 1:
            raise ValueError("rl.steps, rl.prompts_per_step, rl.max_generation_rounds: >= 1")
        if self.max_staleness < 0:
            raise ValueError("rl.max_staleness: must be >= 0")
        if self.difficulty_filter_epochs < 0:
            raise ValueError("rl.difficulty_filter_epochs: must be >= 0 (0: off)")
        if self.difficulty_filter_epochs and self.task_source == "agent":
            raise ValueError("rl.difficulty_filter_epochs: filters the prompt stream; agent "
                             "tasks (rl.task_source=agent) are drawn without it, set it to 0")
        if self.kl_in_reward < 0:
            raise ValueError(f"rl.kl_in_reward: must be >= 0, got {self.kl_in_reward}")
        if self.kl_in_reward and self.advantage not in ("reinforce_pp", "gae"):
            raise ValueError(
                f"rl.kl_in_reward={self.kl_in_reward} with rl.advantage={self.advantage}: the "
                "KL penalty goes into per-token returns, which only rl.advantage=reinforce_pp "
                "or gae computes; set rl.advantage=reinforce_pp (or gae), or "
                "rl.kl_in_reward=0 and the objective's kl_coef (rl.objective_args.kl_coef) "
                "for a KL loss term")
        check_gae(self)
        if self.mode == "async" and self.max_staleness == 0:
            raise ValueError(
                "rl.max_staleness=0 with rl.mode=async: a batch collected while the previous "
                "step trains is one weight version old, so every sample would be dropped; "
                "set rl.max_staleness>=1, or rl.mode=sync for on-policy steps")
        if self.weight_sync_staging_bytes < 2 << 20:
            raise ValueError(f"rl.weight_sync_staging_bytes: {self.weight_sync_staging_bytes} "
                             "is below 2 MiB (two staging buffers of 1 MiB); raise it, e.g. "
                             "268435456 (256 MiB)")
        if self.weight_sync_timeout_s <= 0:
            raise ValueError("rl.weight_sync_timeout_s: must be > 0 seconds")
        if self.overlong_buffer >= self.sampling.max_tokens and self.overlong_buffer:
            raise ValueError("rl.overlong_buffer: must be smaller than rl.sampling.max_tokens")
        if self.routing_replay and self.task_source == "agent":
            raise ValueError("rl.routing_replay with rl.task_source=agent: an episode's "
                             "turns are generated apart, their routing is not returned; set "
                             "rl.routing_replay=false")
        if self.task_source == "agent":
            from moerl.agent.suite import SuiteError, select_tasks

            try:
                select_tasks(self.agent.tasks, self.agent.categories, self.agent.task_dirs)
            except SuiteError as err:
                raise ValueError(f"rl.agent.tasks / rl.agent.categories / rl.agent.task_dirs: "
                                 f"{err}") from err

    def _typed_objective_args(self) -> ObjectiveConfig:
        """The objective's config: its class's defaults when unset; Dr.GRPO's L (norm_len),
        when its aggregation needs one and none is given, the longest response."""
        cls = _objective_class(self.objective)
        args = cls() if self.objective_args is _OBJECTIVE_DEFAULTS else self.objective_args
        if type(args) is not cls:
            raise ValueError(f"rl.objective_args: rl.objective={self.objective} takes "
                             f"{cls.__name__}, got {type(args).__name__}")
        if args.aggregation is AggregationMode.SEQ_MEAN_TOKEN_SUM_NORM and args.norm_len is None:
            return replace(args, norm_len=float(self.max_response_tokens))
        return args


def _objective_class(name: Any) -> type[ObjectiveConfig]:
    try:
        return objective_config_class(name)
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"rl.objective: {err}") from None


def check_gae(rl: RLConfig) -> None:
    """GAE's fields: in range, set only with rl.advantage=gae, a warm-up that ends."""
    for name in GAE_DEFAULTS:
        value = getattr(rl, name)
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"rl.{name}: must be in [0, 1], got {value}")
    if rl.advantage != "gae":
        changed = [f"rl.{name}" for name, default in GAE_DEFAULTS.items()
                   if getattr(rl, name) != default]
        default = CriticConfig()
        changed += [f"rl.critic.{f.name}" for f in dataclasses.fields(CriticConfig)
                    if getattr(rl.critic, f.name) != getattr(default, f.name)]
        if changed:
            raise ValueError(
                f"{', '.join(changed)} set with rl.advantage={rl.advantage}: only "
                "rl.advantage=gae has a critic and GAE; set rl.advantage=gae, or leave "
                "them at their defaults")
        return
    if rl.critic.warmup_steps >= rl.steps:
        raise ValueError(
            f"rl.critic.warmup_steps={rl.critic.warmup_steps} with rl.steps={rl.steps}: the "
            "policy would never move; set rl.critic.warmup_steps below rl.steps")
