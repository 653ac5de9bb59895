"""The run's configuration: Hydra composes YAML, this module makes it typed.

`load_config(overrides)` is the only place a DictConfig exists; it is turned into
dataclasses at once (unknown keys and wrong types fail here, naming the field),
and only typed sub-configs travel inward.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from moerl.agent.server_config import EnvironmentStageConfig
from moerl.checkpoint.config import CheckpointConfig
from moerl.data.domain_config import DomainConfig
from moerl.data.prompts import DataConfig
from moerl.data.tokenizer import TokenizerConfig
from moerl.models.arch import MoEArch
from moerl.models.precision import PrecisionConfig, RecomputeConfig
from moerl.observability import LoggerConfig
from moerl.parallel.layout import ParallelLayout
from moerl.rewards.config import RewardStageConfig
from moerl.rl.config import RLConfig
from moerl.rollout.config import RolloutStageConfig, server_ranks
from moerl.trainer.config import OptimConfig, SFTConfig
from moerl.typed_config import ConfigError, defaults_of, from_dict

# SLURM's --mem-per-cpu: a number with an optional unit.
MEM_PER_CPU = re.compile(r"^\d+[KMGT]?$")

_REPO_CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def config_dir() -> Path:
    """configs/ of this checkout, or $MOERL_CONFIG_DIR."""
    path = Path(os.environ.get("MOERL_CONFIG_DIR", _REPO_CONFIGS))
    if not (path / "config.yaml").is_file():
        raise ConfigError(
            f"config directory {path} has no config.yaml; set MOERL_CONFIG_DIR to the "
            "project's configs/ folder"
        )
    return path


SCHEMA_NODE = "schema"  # what each root YAML lists first in its defaults
DOMAIN_SCHEMA_NODE = "domain_schema"  # what each configs/domain file lists for its entry


def compose(overrides: list[str], config_name: str = "config",
            schema: type | None = None) -> dict[str, Any]:
    """Hydra composition of configs/<config_name>.yaml with command-line overrides.

    The root YAML starts from the dataclass defaults of `schema` (RunConfig unless
    given), registered as the config `schema`, and each domain of configs/domain from
    DomainConfig's (`domain_schema`): the YAML files hold only what differs from them,
    and every field can still be overridden by name (an unknown one is refused by
    Hydra, a mistyped one when the result is typed)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.config_store import ConfigStore
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise ConfigError(f"{bad[0]!r}: overrides look like key=value (e.g. parallel.tp=2)")
    store = ConfigStore.instance()
    store.store(name=SCHEMA_NODE, node=defaults_of(schema or RunConfig))
    store.store(name=DOMAIN_SCHEMA_NODE, node=defaults_of(DomainConfig))
    try:
        with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
            cfg = hydra_compose(config_name=config_name, overrides=overrides)
    except (HydraException, OmegaConfBaseException) as err:
        # Hydra's message names the key and, for a group, lists the available options.
        message = " ".join(line.strip() for line in str(err).splitlines() if line.strip())
        raise ConfigError(message) from err
    data = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(data, dict)
    return {str(k): v for k, v in data.items()}


def load_model_config(overrides: list[str]) -> tuple[MoEArch, int]:
    """The model architecture and the sequence length for counting."""
    data = compose(overrides)
    arch = from_dict(MoEArch, data.get("model"), "model")
    seq_length = data.get("seq_length", 4096)
    if not isinstance(seq_length, int) or seq_length < 1:
        raise ConfigError(f"seq_length: expected a positive integer, got {seq_length!r}")
    return arch, seq_length


MODEL_FILE = "model.json"  # an imported checkpoint's architecture (`moerl hf import`)


def apply_model_from(data: dict[str, Any]) -> None:
    """`model_from=DIR`: the architecture `moerl hf import` wrote there replaces the
    `model` group (a model of no preset, e.g. a locally made DeepSeek-V3-family one)."""
    source = data.get("model_from")
    if source is None:
        return
    path = Path(source) / MODEL_FILE
    if not path.is_file():
        raise ConfigError(f"model_from: {source} has no {MODEL_FILE}; give the weights "
                          "directory `moerl hf import` wrote")
    import json

    data["model"] = json.loads(path.read_text())


def check_init_weights(path: str | None) -> None:
    """A weights dir to start from must be complete; refused at start-up otherwise."""
    if path is None:
        return
    from moerl.models.weights_marker import is_complete

    if not is_complete(path):
        raise ConfigError(
            f"init_weights: {path} is not a complete weights directory; give the output "
            "of `moerl sft` (<out_dir>/weights) or `moerl hf import`"
        )


def check_recompute(precision: PrecisionConfig, recompute: RecomputeConfig) -> None:
    """The recompute settings against the precision, as far as they can be checked
    before the machine is known (`precision.transformer_impl=auto` may give TE)."""
    try:
        recompute.check(precision, te=precision.transformer_impl != "local")
    except ValueError as err:
        raise ConfigError(str(err)) from err


@dataclass
class LaunchConfig:
    """The `launcher` group."""

    kind: Literal["local", "slurm"] = "local"
    trainer_ranks: int = 1  # torchrun processes per trainer node
    trainer_nodes: int = 1
    gpus_per_node: int = 0
    startup_timeout_s: float = 300.0
    python: str | None = None  # the interpreter every stage runs; None: this one


@dataclass
class ClusterConfig:
    """The `cluster` group (SLURM only)."""

    trainer_partition: str | None = None
    """None: the cluster's default partition (likewise below)."""
    rollout_partition: str | None = None
    reward_partition: str | None = None
    account: str | None = None
    time: str = "04:00:00"
    mem_per_cpu: str | None = None
    """e.g. "4G" for every component; None: the cluster's default."""
    signal_seconds: int = 600
    """USR1 this long before the time limit (checkpoint, then requeue); 0: none. It must
    cover a step and a save (`launchers.save_cadence`, checked at start-up)."""
    checkpoint_write_gbps: float | None = None
    """GB/s the shared filesystem takes from all nodes at once, for the time of a save;
    None: unknown (the SIGUSR1 lead is then checked against the step alone)."""
    requeue: bool = True
    job_name: str | None = None
    """None: the name of the run directory."""
    rollout_port: int = 8000
    """replica i of a stage listens on port + i; fixed, as servers on one node share it."""
    reward_port: int = 8100
    environment_port: int = 8200
    master_port: int = 29500
    rollout_master_port: int = 29600
    """torchrun port of a rollout server across ranks (+ replica): its ranks' own group."""
    master_addr: str | None = None
    """None: the first trainer node by name; set it where node names do not resolve."""
    advertise_host: str | None = None
    """address servers announce; None: each node's hostname."""
    torchrun: list[str] = field(default_factory=list)
    """the torchrun command; empty: `<launcher.python> -m torch.distributed.run`."""
    setup: list[str] = field(default_factory=list)
    """shell lines run in the batch script before any step (module load, ...)."""
    grace_s: int = 30
    """seconds between SIGTERM and SIGKILL when the job's steps are stopped."""
    # The cluster's size, which a job's nodes must fit (`moerl rehearse` checks a
    # recipe's trainer + rollout nodes and its reward + environment nodes against it).
    gpu_nodes: int | None = None
    """GPU nodes the partitions hold; None: not checked."""
    cpu_nodes: int | None = None
    """CPU nodes of the reward partition; None: not checked."""
    # -- Links of one GPU (the weight sync's projection, benchmarks/weight_sync.py);
    # None: not known, the projection asks for them --
    nvlink_gbps: float | None = None
    """GB/s each way between two GPUs of a node over NVLink, achievable."""
    ib_gbps: float | None = None
    """GB/s each way through one GPU's InfiniBand NIC, achievable."""
    pcie_gbps: float | None = None
    """GB/s each way between one GPU and host memory, achievable."""
    message_latency_us: float | None = None
    """per point-to-point message between nodes (NCCL send/recv), start to finish."""

    def __post_init__(self) -> None:
        if min(self.gpu_nodes or 1, self.cpu_nodes or 1) < 1:
            raise ValueError("cluster.gpu_nodes and cluster.cpu_nodes: >= 1, or null")
        for name in ("nvlink_gbps", "ib_gbps", "pcie_gbps", "message_latency_us"):
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                raise ValueError(f"cluster.{name}: must be > 0, or null (not known)")
        for name in ("rollout_port", "reward_port", "environment_port", "master_port",
                     "rollout_master_port"):
            if not 0 < getattr(self, name) < 65536:
                raise ValueError(f"cluster.{name}: expected a port in 1..65535")
        # The SLURM script's own rules, at start-up rather than at submission.
        if self.mem_per_cpu is not None and not MEM_PER_CPU.match(self.mem_per_cpu):
            raise ValueError(f"cluster.mem_per_cpu={self.mem_per_cpu!r}: expected e.g. 4000, 4G")
        if self.signal_seconds < 0 or self.grace_s < 0:
            raise ValueError("cluster.signal_seconds and cluster.grace_s must be >= 0")
        if self.checkpoint_write_gbps is not None and self.checkpoint_write_gbps <= 0:
            raise ValueError("cluster.checkpoint_write_gbps: > 0 (GB/s), or null")

    def partition(self, stage: str) -> str | None:
        """The partition of a stage's het group (None: the cluster's default); the
        environment servers run on the reward servers' CPU nodes."""
        return {"trainer": self.trainer_partition, "rollout": self.rollout_partition,
                "reward": self.reward_partition, "environment": self.reward_partition}[stage]


@dataclass
class RunConfig:
    """Everything one RL run (`moerl train`, `moerl demo`) is configured by."""

    model: MoEArch
    parallel: ParallelLayout
    optim: OptimConfig
    rl: RLConfig
    sft: SFTConfig
    data: DataConfig
    rollout: RolloutStageConfig
    rewards: RewardStageConfig
    logger: LoggerConfig
    launcher: LaunchConfig
    environments: EnvironmentStageConfig = field(default_factory=EnvironmentStageConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)  # SLURM only
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    run_dir: str = "runs/default"
    seq_length: int = 4096  # for FLOP counts (model-info)
    init_weights: str | None = None  # weights dir the run starts from (moerl sft / hf import)
    model_from: str | None = None  # a `moerl hf import` dir whose model.json replaces `model`

    @property
    def runs_episodes(self) -> bool:
        """Agent episodes in this run: rl.task_source=agent, or a mixture's weighted
        terminal domain (the launcher then starts the environment servers)."""
        data = self.data
        return self.rl.task_source == "agent" or (data.source == "mixture" and any(
            data.domains[n].source == "terminal" and w > 0 for n, w in data.mixture.items()))

    def __post_init__(self) -> None:
        check_init_weights(self.init_weights)
        check_recompute(self.precision, self.recompute)
        if self.rollout.engine != "moerl" and self.tokenizer.kind == "byte":
            raise ConfigError(
                f"tokenizer: rollout.engine={self.rollout.engine} serves "
                "rollout.hf_model_dir with its own tokenizer, so the trainer must encode with "
                "it too: set tokenizer=hf tokenizer.path=<the model's directory>")
        check_domains(self)
        check_routing_replay(self)
        check_partial_rollouts(self)
        if self.rl.advantage == "gae":
            try:  # the critic's architecture: the model's with rl.critic.model replaced
                self.rl.critic.arch(self.model)
            except (TypeError, ValueError) as err:
                raise ConfigError(f"rl.critic.model: {err}") from err
        if self.rl.sampling.max_tokens + self.data.max_prompt_tokens > (
                self.model.max_position_embeddings):
            raise ConfigError(
                f"rl.sampling.max_tokens + data.max_prompt_tokens = "
                f"{self.rl.sampling.max_tokens + self.data.max_prompt_tokens} exceeds "
                f"model.max_position_embeddings ({self.model.max_position_embeddings})"
            )


def check_routing_replay(cfg: RunConfig) -> None:
    """`rl.routing_replay` needs an engine that returns the experts it routed to: a
    moerl server on the continuous or static decoder, each layer's routers on one rank."""
    if not cfg.rl.routing_replay:
        return
    rollout = cfg.rollout
    why = None
    if rollout.engine != "moerl":
        why = (f"rollout.engine={rollout.engine} does not return the experts it routed to; "
               "use rollout.engine=moerl")
    elif rollout.backend == "dynamic" or rollout.speculative != "none":
        why = ("the continuous (or static) decoder without speculation returns them; set "
               "rollout.backend=continuous rollout.speculative=none")
    elif rollout.pipeline_parallel > 1:
        why = ("with rollout.pipeline_parallel > 1 no rank holds every layer's router; set "
               "rollout.pipeline_parallel=1")
    elif cfg.runs_episodes:
        why = "agent episodes (the terminal domain) do not return their routing"
    if why is not None:
        raise ConfigError(f"rl.routing_replay=true: {why}")


def check_partial_rollouts(cfg: RunConfig) -> None:
    """`rollout.partial_rollouts` needs async steps and a moerl server whose updates can
    land between two decode steps: the continuous decoder (any ranks without pipeline
    stages) or the static one on one process."""
    rollout = cfg.rollout
    if not rollout.partial_rollouts:
        return
    why = None
    if cfg.rl.mode != "async":
        why = "a sync step updates the weights only after its generation; set rl.mode=async"
    elif rollout.engine != "moerl":
        why = f"rollout.engine={rollout.engine} has no such update; use rollout.engine=moerl"
    elif rollout.backend == "dynamic" or rollout.speculative != "none":
        why = ("the continuous decoder runs them; set rollout.backend=continuous "
               "rollout.speculative=none")
    elif rollout.pipeline_parallel > 1 or (rollout.backend == "static"
                                           and server_ranks(rollout) > 1):
        why = ("a server with pipeline stages, or on the static decoder across ranks, "
               "updates between batches only; set rollout.pipeline_parallel=1 and "
               "rollout.backend=continuous")
    if why is not None:
        raise ConfigError(f"rollout.partial_rollouts=true: {why}")


def check_domains(cfg: RunConfig) -> None:
    """A mixture's domains fit the model, and the run draws prompts from it."""
    data, rl = cfg.data, cfg.rl
    if data.source != "mixture":
        return
    if rl.task_source == "agent":
        raise ConfigError("rl.task_source=agent with data.source=mixture: the mixture "
                          "draws the prompts; put the agent tasks in it as a domain "
                          "(domain=[...,terminal] data.mixture.terminal=1.0) and leave "
                          "rl.task_source=prompts")
    positions = cfg.model.max_position_embeddings
    for name in data.mixture:
        domain = data.domains[name]
        if domain.source == "terminal":
            continue  # episodes are bounded by rl.agent.max_episode_tokens
        tokens = domain.sampling.max_tokens or rl.sampling.max_tokens
        prompt = domain.max_prompt_tokens or data.max_prompt_tokens
        if tokens + prompt > positions:
            raise ConfigError(
                f"data.domains.{name}: sampling.max_tokens ({tokens}) + max_prompt_tokens "
                f"({prompt}) exceeds model.max_position_embeddings ({positions}); lower "
                f"data.domains.{name}.max_prompt_tokens or its sampling.max_tokens")


def load_run_config(overrides: list[str], world_size: int | None = None) -> RunConfig:
    """The typed run config; dp is derived from `world_size` (default: the launcher's
    trainer ranks) unless `parallel.dp` is given."""
    return typed_run_config(compose(overrides), world_size)


def typed_run_config(composed: dict[str, Any], world_size: int | None = None) -> RunConfig:
    """A composed configuration (`compose`) as the typed run config: every group checked
    (unknown keys, wrong types, each schema's own rules), nothing started."""
    data = dict(composed)
    apply_model_from(data)
    # `resume=...` is a shorthand the YAML copies into checkpoint.resume (an interpolation).
    data.pop("resume", None)
    raw_parallel = data.pop("parallel")
    launch = from_dict(LaunchConfig, data.get("launcher", {}), "launcher")
    world = world_size or launch.trainer_ranks * launch.trainer_nodes
    if raw_parallel.get("dp") is None:
        degrees = from_dict(ParallelLayout, {k: v for k, v in raw_parallel.items() if k != "dp"},
                            "parallel")
        layout = ParallelLayout.for_world(world, **vars(degrees))
    else:
        layout = from_dict(ParallelLayout, raw_parallel, "parallel")
    cfg = from_dict(RunConfig, {**data, "parallel": {}}, "")
    cfg.parallel = layout
    if cfg.sft.steps:
        try:
            cfg.sft.check_layout(layout, cfg.model.mtp_num_layers)
        except ValueError as err:
            raise ConfigError(str(err)) from err
    return cfg
