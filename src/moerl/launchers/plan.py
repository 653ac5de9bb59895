"""From a run config to the processes that run it (`RunPlan`): trainer, rollout
servers and reward servers, with the same commands locally and on SLURM."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from moerl.launchers.stages import RunPlan, StageSpec
from moerl.rl.rollout.backends import check_engine, engine_argv, launch_env


@dataclass
class RolloutStageConfig:
    """The `rollout` group: the generation servers."""

    servers: int = 1
    max_batch: int = 64  # rows (prompt x sample) per engine call
    backend: Literal["auto", "static", "dynamic"] = "auto"
    nodes: int = 1
    gpus_per_node: int = 0
    request_timeout_s: float = 600.0
    speculative: Literal["none", "ngram", "mtp"] = "none"  # draft-and-verify decoding
    num_draft_tokens: int = 4
    engine: str = "moerl"  # moerl | vllm | sglang (see rl.rollout.backends)
    # vllm / sglang only: they serve Hugging Face weights (`moerl hf export`).
    hf_model_dir: str | None = None
    tensor_parallel: int = 1
    expert_parallel: int = 1
    dtype: str = "bfloat16"
    max_model_len: int | None = None
    served_model_name: str | None = None
    gpu_memory_utilization: float = 0.85


@dataclass
class RewardStageConfig:
    """The `rewards` group: the reward servers and how the trainer calls them."""

    servers: int = 1
    max_concurrency: int = 2  # sandboxed executions at once per server
    isolation: Literal["strict", "no-cgroups"] = "strict"
    batch_size: int = 64
    timeout_s: float = 300.0
    nodes: int = 1
    cpus: int = 2


@dataclass
class LaunchConfig:
    """The `launcher` group."""

    kind: Literal["local", "slurm"] = "local"
    trainer_ranks: int = 1  # torchrun processes per trainer node
    trainer_nodes: int = 1
    gpus_per_node: int = 0
    startup_timeout_s: float = 300.0
    python: str | None = None  # the interpreter every stage runs; None: this one


def _cli(cfg: LaunchConfig, *args: str) -> tuple[str, ...]:
    return (cfg.python or sys.executable, "-m", "moerl.launchers.cli", *args)


def build_run_plan(
    run_dir: Path, overrides: list[str], launch: LaunchConfig, rollout: RolloutStageConfig,
    rewards: RewardStageConfig, arch_file: Path, config_dir: Path | None = None,
) -> RunPlan:
    """The three stages; the trainer gets the user's overrides plus the run directory.

    The trainer composes its config again from the same overrides: `config_dir`
    (absolute) makes it read the very YAML files the launcher read, wherever it runs.
    """
    trainer_env = {"OMP_NUM_THREADS": "1"}
    if config_dir is not None:
        trainer_env["MOERL_CONFIG_DIR"] = str(config_dir)
    trainer = StageSpec(
        name="trainer",
        command=_cli(launch, "trainer", *overrides, f"run_dir={run_dir}"),
        nodes=launch.trainer_nodes,
        gpus_per_node=launch.gpus_per_node,
        ranks_per_node=launch.trainer_ranks,
        cpus=max(launch.trainer_ranks, 1),
        env=trainer_env,
    )
    if check_engine(rollout.engine) == "moerl":
        rollout_command = _cli(
            launch, "serve", "rollout", "--host", "{host}", "--port", "{port}",
            "--arch-file", str(arch_file), "--max-batch", str(rollout.max_batch),
            "--backend", rollout.backend, "--speculative", rollout.speculative,
            "--num-draft-tokens", str(rollout.num_draft_tokens),
        )
    else:
        # The wrapper announces the engine in the rendezvous dir once it is healthy.
        python = launch.python or sys.executable
        rollout_command = (python, "-m", "moerl.rl.rollout.backends", "--",
                           *engine_argv(rollout, python))
    rollout_stage = StageSpec(
        name="rollout",
        command=rollout_command,
        replicas=rollout.servers,
        nodes=rollout.nodes,
        gpus_per_node=rollout.gpus_per_node,
        env={"OMP_NUM_THREADS": "1", **launch_env(rollout.engine)},
    )
    reward_stage = StageSpec(
        name="reward",
        command=_cli(
            launch, "serve", "reward", "--host", "{host}", "--port", "{port}",
            "--max-concurrency", str(rewards.max_concurrency), "--isolation", rewards.isolation,
        ),
        replicas=rewards.servers,
        nodes=rewards.nodes,
        cpus=rewards.cpus,
    )
    return RunPlan(
        stages=(trainer, rollout_stage, reward_stage),
        rendezvous_dir=run_dir / "rendezvous",
        log_dir=run_dir / "logs",
    )


@dataclass
class RunLayout:
    """Where a run keeps its files."""

    root: Path
    weights: Path = field(init=False)
    sft_weights: Path = field(init=False)

    def __post_init__(self) -> None:
        self.weights = self.root / "weights"
        self.sft_weights = self.root / "sft"
