"""From a run config to the processes that run it (`RunPlan`): trainer, rollout
servers and reward servers, with the same commands locally and on SLURM."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

from moerl.agent.server_config import EnvironmentStageConfig
from moerl.config import LaunchConfig
from moerl.data.tokenizer import TokenizerConfig
from moerl.launchers.stages import RunPlan, StageSpec
from moerl.models.precision import PrecisionConfig
from moerl.rewards.config import RewardStageConfig
from moerl.rewards.registry import BUILTIN
from moerl.rollout.backends import check_engine, engine_argv, launch_env
from moerl.rollout.config import RolloutStageConfig, ServerRanks, server_ranks_layout


def _cli(cfg: LaunchConfig, *args: str) -> tuple[str, ...]:
    return (cfg.python or sys.executable, "-m", "moerl.launchers.cli", *args)


def rollout_tokenizer_argv(tokenizer: TokenizerConfig) -> list[str]:
    """`moerl serve rollout` flags for the run's tokenizer (bytes: none)."""
    if tokenizer.kind == "byte":
        return []
    assert tokenizer.path is not None
    argv = ["--tokenizer", str(Path(tokenizer.path).resolve())]
    if tokenizer.kind == "tiktoken":
        argv += ["--tokenizer-kind", "tiktoken"]
    for flag, value in (("--eos-token", tokenizer.eos_token), ("--pad-token", tokenizer.pad_token),
                        ("--bos-token", tokenizer.bos_token),
                        ("--end-of-turn-token", tokenizer.end_of_turn_token)):
        argv += [flag, value] if value else []
    return argv


def rollout_precision_argv(precision: PrecisionConfig) -> list[str]:
    """`moerl serve rollout` flags for the run's precision, FP8 primary weights included
    (they halve the serving weights: Kimi-K2 at TP1/EP32 holds 43.4B parameters a GPU,
    80.9 GiB in bf16); inference has no recompute or offloading. The server's defaults
    (auto) are left out."""
    argv = []
    if precision.transformer_impl != "auto":
        argv += ["--transformer-impl", precision.transformer_impl]
    if precision.params_dtype != "auto":
        argv += ["--params-dtype", precision.params_dtype]
    argv += ["--fp8", precision.fp8] if precision.fp8 else []
    return argv + (["--fp8-param"] if precision.fp8_param else [])


def reward_flags(plugins: dict[str, str]) -> list[str]:
    """`--reward` flags serving the built-in rewards plus `rewards.plugins` (none: the
    server's default, the built-in ones)."""
    if not plugins:
        return []
    served = {**BUILTIN, **plugins}
    return [arg for name, path in served.items() for arg in ("--reward", f"{name}={path}")]


def build_run_plan(
    run_dir: Path, overrides: list[str], launch: LaunchConfig, rollout: RolloutStageConfig,
    rewards: RewardStageConfig, arch_file: Path, config_dir: Path | None = None,
    precision: PrecisionConfig | None = None, tokenizer: TokenizerConfig | None = None,
    environments: EnvironmentStageConfig | None = None,
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
    precision = precision or PrecisionConfig()
    ranks = ServerRanks(1, 1, ())
    if check_engine(rollout.engine) == "moerl":
        ranks = server_ranks_layout(rollout)
        backend = ["--backend", rollout.backend] if not ranks.flags else []
        rollout_command = _cli(
            launch, "serve", "rollout", "--host", "{host}", "--port", "{port}",
            "--arch-file", str(arch_file), "--max-batch", str(rollout.max_batch),
            "--kv-cache-gb", str(rollout.kv_cache_gb), "--prefill-chunk",
            str(rollout.prefill_chunk), *backend, "--speculative", rollout.speculative,
            *(["--partial-rollouts"] if rollout.partial_rollouts else []),
            "--num-draft-tokens", str(rollout.num_draft_tokens), *ranks.flags,
            *rollout_precision_argv(precision),
            *rollout_tokenizer_argv(tokenizer or TokenizerConfig()),
        )
    else:
        # The wrapper announces the engine in the rendezvous dir once it is healthy.
        python = launch.python or sys.executable
        rollout_command = (python, "-m", "moerl.rollout.backends", "--",
                           *engine_argv(rollout, python))
    rollout_stage = StageSpec(
        name="rollout",
        command=rollout_command,
        replicas=rollout.servers,
        nodes=rollout.nodes,
        gpus_per_node=rollout.gpus_per_node,
        env={"OMP_NUM_THREADS": "1", **launch_env(rollout.engine)},
        binds_any_port=rollout.engine == "moerl",  # vLLM / SGLang need a port to bind
        ranks_per_node=ranks.ranks_per_node,
        span=ranks.span,
    )
    reward_stage = StageSpec(
        name="reward",
        command=_cli(
            launch, "serve", "reward", "--host", "{host}", "--port", "{port}",
            "--max-concurrency", str(rewards.max_concurrency), "--isolation", rewards.isolation,
            *(["--warm-slots", str(rewards.warm_slots)] if rewards.warm_slots is not None else []),
            *reward_flags(rewards.plugins),
        ),
        replicas=rewards.servers,
        nodes=rewards.nodes,
        cpus=rewards.cpus,
        binds_any_port=True,
    )
    stages: tuple[StageSpec, ...] = (trainer, rollout_stage, reward_stage)
    if environments is not None and environments.servers > 0:
        stages += (StageSpec(
            name="environment",
            command=_cli(
                launch, "serve", "env", "--host", "{host}", "--port", "{port}",
                "--max-sessions", str(environments.max_sessions),
                "--idle-timeout", str(environments.idle_timeout_s),
                "--isolation", environments.isolation,
            ),
            replicas=environments.servers,
            nodes=environments.nodes,
            cpus=environments.cpus,
            binds_any_port=True,
        ),)
    return RunPlan(
        stages=stages,
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
