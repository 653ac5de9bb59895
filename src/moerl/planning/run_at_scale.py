"""The run's settings a recipe names beside its layout, and their checks against the plan.

The planner sizes a step as `run.global_batch_size` sequences of `run.seq_length`
tokens in micro-batches of `run.micro_batch_size`. A recipe's RL run must be that run:

    samples per update   rl.prompts_per_step * rl.group_size / rl.updates_per_step
                         = global_batch_size
    sample length        data.max_prompt_tokens + rl.sampling.max_tokens (and an agent
                         episode, rl.agent.max_episode_tokens) <= seq_length
    micro-batch          rl.token_budget // seq_length rows = micro_batch_size, so
                         M = global_batch_size / (dp * micro_batch_size) per DP rank;
                         Megatron's interleaved schedule needs M a multiple of pp, and
                         the pipeline idles (pp - 1) / (vpp * M) of the step (the bubble)
    CPU nodes            a reward server's sandboxes (rewards.max_concurrency) and an
                         environment server's sessions use its node's cores
                         (`cpu_node_cores`, two left to the server itself); the agent
                         runs as many episodes at once as the environment servers hold
    weights, tokenizer   a 1T run starts from imported weights (`moerl hf import`), with
                         the model's own tokenizer

`train_settings` writes these as `moerl train` keys (the recipe's `train` block);
`check_run` reads them back from a composed run and names what differs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from moerl.parallel.layout import ParallelLayout

SERVER_CORES = 2  # of a CPU node: the HTTP server and its verifier workers


@dataclass
class RecipeSettings:
    """`moerl plan --recipe`: what the recipe's `train` block is made from."""

    init_weights: str | None = None
    """Megatron weights the policy and the reference start from (`moerl hf import`
    output on the shared filesystem); null: a fresh model (not a post-training run)."""
    tokenizer: str = "byte"
    """The `tokenizer` group (configs/tokenizer), e.g. kimi_k2."""
    tokenizer_path: str | None = None
    """Its files: the imported weights directory holds copies."""
    group_size: int = 8
    updates_per_step: int = 1
    max_prompt_tokens: int = 1024
    cpu_node_cores: int = 32
    """Cores of a reward or environment node given to its server."""

    def __post_init__(self) -> None:
        if min(self.group_size, self.updates_per_step, self.max_prompt_tokens) < 1:
            raise ValueError("recipe.group_size, recipe.updates_per_step and "
                             "recipe.max_prompt_tokens: must be >= 1")
        if self.cpu_node_cores <= SERVER_CORES:
            raise ValueError(f"recipe.cpu_node_cores: must be > {SERVER_CORES} (the server's "
                             "own cores)")


@dataclass(frozen=True)
class PlannedStep:
    """What the plan assumed of one step."""

    global_batch_size: int
    seq_length: int
    micro_batch_size: int
    layout: ParallelLayout

    @property
    def micro_batches(self) -> int:
        """Per data-parallel rank and optimizer step."""
        return max(self.global_batch_size // (self.micro_batch_size * self.layout.dp), 1)

    @property
    def bubble(self) -> float:
        """Share of a step the pipeline idles: (pp - 1) / (vpp * M)."""
        return (self.layout.pp - 1) / (self.layout.virtual_stages * self.micro_batches)

    def schedule_problem(self) -> str | None:
        """Why Megatron's schedule would refuse M micro-batches, or None."""
        pp, m = self.layout.pp, self.micro_batches
        if self.layout.vpp and (m < pp or m % pp):
            return (f"{m} micro-batches per data-parallel rank on an interleaved pipeline of "
                    f"pp={pp}: Megatron needs a multiple of pp")
        return None


def train_settings(step: PlannedStep, recipe: RecipeSettings, reward_nodes: int,
                   environment_nodes: int, engine_rows: int) -> dict[str, Any]:
    """The `moerl train` keys of a recipe's run (its `train` block)."""
    samples = step.global_batch_size * recipe.updates_per_step
    if samples % recipe.group_size:
        raise ValueError(f"recipe.group_size={recipe.group_size}: the step's {samples} "
                         "samples are not whole groups")
    if recipe.max_prompt_tokens >= step.seq_length:
        raise ValueError(f"recipe.max_prompt_tokens={recipe.max_prompt_tokens}: leaves no "
                         f"room for a response within run.seq_length={step.seq_length}")
    sandboxes = recipe.cpu_node_cores - SERVER_CORES
    out: dict[str, Any] = {
        "init_weights": recipe.init_weights,
        "tokenizer": recipe.tokenizer,
    }
    if recipe.tokenizer_path is not None:
        out["tokenizer.path"] = recipe.tokenizer_path
    out.update({
        "rl.prompts_per_step": samples // recipe.group_size,
        "rl.group_size": recipe.group_size,
        "rl.updates_per_step": recipe.updates_per_step,
        "rl.token_budget": step.micro_batch_size * step.seq_length,
        "rl.sampling.max_tokens": step.seq_length - recipe.max_prompt_tokens,
        "data.max_prompt_tokens": recipe.max_prompt_tokens,
        "rollout.max_batch": engine_rows,
        "rewards.max_concurrency": sandboxes,
        "rewards.cpus": recipe.cpu_node_cores,
    })
    if environment_nodes:  # the recipe trains on agent episodes
        out.update({
            "environments.max_sessions": sandboxes,
            "environments.cpus": recipe.cpu_node_cores,
            "rl.agent.max_concurrency": sandboxes * environment_nodes,
            "rl.agent.context_tokens": step.seq_length,
            "rl.agent.max_episode_tokens": step.seq_length,
        })
    return out


@dataclass(frozen=True)
class RunAtScale:
    """A composed run's numbers that the plan depends on."""

    samples_per_update: float
    sample_tokens: int  # the longest a sample may be (prompt + response, or an episode)
    token_budget: int
    init_weights: str | None
    tokenizer: str
    reward_sandboxes: int
    reward_cpus: int
    agent_episodes: int = 0  # episodes at once (agent runs)
    agent_sessions: int = 0  # sessions the environment servers hold in all


def check_run(run: RunAtScale, step: PlannedStep) -> list[str]:
    """What in `run` differs from the step the plan sized, each naming the field."""
    problems = []
    if run.samples_per_update != step.global_batch_size:
        problems.append(
            f"rl.prompts_per_step x rl.group_size / rl.updates_per_step = "
            f"{run.samples_per_update:g} samples per update, but the plan sized "
            f"{step.global_batch_size} (run.global_batch_size)")
    if run.sample_tokens > step.seq_length:
        problems.append(f"a sample may reach {run.sample_tokens} tokens (prompt + "
                        f"response), more than the planned run.seq_length={step.seq_length}")
    if run.token_budget // step.seq_length != step.micro_batch_size:
        problems.append(f"rl.token_budget={run.token_budget} packs "
                        f"{run.token_budget // step.seq_length} rows of {step.seq_length} "
                        f"tokens, the plan {step.micro_batch_size} (run.micro_batch_size)")
    if (why := step.schedule_problem()) is not None:
        problems.append(why)
    if run.init_weights is None:
        problems.append("init_weights: none, so the run trains a fresh model; give the "
                        "`moerl hf import` output of the released checkpoint")
    if run.tokenizer == "byte":
        problems.append("tokenizer: bytes; give the model's own (e.g. tokenizer=kimi_k2)")
    if not run.reward_cpus // 2 <= run.reward_sandboxes <= run.reward_cpus:
        problems.append(f"rewards.max_concurrency={run.reward_sandboxes} sandboxes on "
                        f"{run.reward_cpus} cores (rewards.cpus): size it to the cores")
    if run.agent_episodes > run.agent_sessions:
        problems.append(f"rl.agent.max_concurrency={run.agent_episodes} episodes, but the "
                        f"environment servers hold {run.agent_sessions} sessions")
    return problems
