"""The shipped trillion-scale recipes as SLURM scripts: planner recipe YAML -> sbatch.

    python -m moerl.launchers.recipes            print every rendered script
    python -m moerl.launchers.recipes --write    regenerate slurm/<name>.sbatch

A recipe (configs/experiment/kimi_k2_h100.yaml and the like) is the planner's
output: cluster sizes, the chosen layout, run and rollout settings, and in its `train`
block the run's own `moerl train` settings (init weights, tokenizer, RL batch sizes
and lengths, sandboxes per CPU node). It is not a `moerl train` config (its
`run`/`rollout` keys are the planner's), so the stages are built here: the trainer
on `cluster.trainer_nodes` x `gpus_per_node` GPUs (one torchrun rank per GPU)
started with the `moerl train` overrides the recipe implies (model, layout, sizes,
weights streamed to the rollout engines in memory, the `train` block); the
rollout engines with the planner's layout (`rollout.tp/ep`), each one
`moerl serve rollout` under torchrun on its GPUs, across whole nodes when it is larger
than one; the reward servers, and the environment servers of agent tasks, on CPU
nodes. The cluster side is a `Site`: for the shipped scripts a checkout on a
filesystem every node shares, at SHARED, and configs/cluster/h100.yaml (partitions
gpu/gpu/cpu, USR1 before the limit, requeue).

A miniature (configs/experiment/kimi_k2_mini.yaml) is a recipe at toy size, written
by hand: the same stages, sizes and layout kinds on a few (fake) nodes, CPU precision.
Rendered for a local SLURM cluster it runs end to end on one machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from moerl.config import ClusterConfig, RunConfig, load_run_config
from moerl.launchers.cluster import slurm_config, with_cluster_ports
from moerl.launchers.plan import rollout_precision_argv, rollout_tokenizer_argv
from moerl.launchers.slurm import SlurmConfig, render_sbatch
from moerl.launchers.stages import RunPlan, StageSpec
from moerl.planning.memory import RunSettings
from moerl.planning.run_fields import run_overrides
from moerl.rollout.config import server_ranks_layout
from moerl.typed_config import ConfigError, from_dict

REPO = Path(__file__).resolve().parents[3]
SHARED = Path("/shared/moerl")
# recipe file stem -> rendered script name (slurm/<name>.sbatch)
RECIPES = {
    "kimi_k2_h100": "kimi_k2_grpo_h100",
    "deepseek_v3_h100": "deepseek_v3_grpo_h100",
    "kimi_k2_long_context_h100": "kimi_k2_long_context_grpo_h100",
}
# a recipe at toy size (written by hand, CPU precision) -> the recipe whose structure it keeps
MINIATURES = {"kimi_k2_mini": "kimi_k2_h100"}
_PARALLEL_KEYS = ("tp", "pp", "vpp", "ep", "etp", "cp", "dp", "use_distributed_optimizer")


@dataclass(frozen=True)
class Site:
    """Where a recipe runs: the checkout every node mounts, its Python, the `cluster`
    group (partitions, ports, limits) and the CPUs a node grants per GPU and per server."""

    root: Path
    python: str
    cluster_name: str
    cluster: ClusterConfig
    cpus_per_gpu: int = 8
    """trainer and rollout nodes: data loading and NCCL proxy threads beside each rank."""
    server_cpus: int = 32
    """per reward or environment server: sandboxes are CPU-bound."""


def h100_site() -> Site:
    """The shipped scripts' site: a checkout at SHARED, configs/cluster/h100.yaml."""
    return Site(SHARED, str(SHARED / ".venv" / "bin" / "python"), "h100", h100_cluster())


@dataclass(frozen=True)
class Recipe:
    """The parts of a planner recipe a launch needs."""

    name: str
    model: str
    seq_length: int
    trainer_nodes: int
    rollout_nodes: int
    reward_nodes: int
    environment_nodes: int
    """CPU nodes of environment servers; > 0 trains on agent tasks (rl.task_source=agent)."""
    gpus_per_node: int
    parallel: dict[str, Any]
    run: RunSettings
    """The planner's run settings: precision, layer spec, recompute, sizes."""
    rollout_tp: int
    rollout_ep: int
    rollout_replicas: int
    gpu_memory_gb: float = 80.0
    rollout: dict[str, Any] = dataclasses.field(default_factory=dict)
    """The planner's rollout section as written (engine shape, load, weight dtype)."""
    train: dict[str, Any] = dataclasses.field(default_factory=dict)
    """`moerl train` keys of the run (the recipe's `train` block), applied last."""

    @property
    def engine_ranks(self) -> int:
        """Ranks of one rollout engine (one `moerl serve rollout` under torchrun)."""
        return math.lcm(self.rollout_tp, self.rollout_ep)

    @property
    def engine_span(self) -> int:
        """Nodes one rollout engine spans (1: it fits one node)."""
        return max(self.engine_ranks // self.gpus_per_node, 1)


def load_recipe(path: Path) -> Recipe:
    return recipe_of(yaml.safe_load(path.read_text()), path)


def recipe_of(data: dict[str, Any], path: Path) -> Recipe:
    """The recipe in `data` (a recipe file's contents, read from `path`)."""
    try:
        model = next(
            d["override /model"]
            for d in data["defaults"]
            if isinstance(d, dict) and "override /model" in d
        )
        cluster, rollout = data["cluster"], data["rollout"]
        recipe = Recipe(
            path.stem, model, int(data["seq_length"]), int(cluster["trainer_nodes"]),
            int(cluster["rollout_nodes"]), int(cluster["reward_nodes"]),
            int(cluster.get("environment_nodes", 0)), int(cluster["gpus_per_node"]),
            dict(data["parallel"]), from_dict(RunSettings, data["run"], "run"),
            int(rollout["tp"]), int(rollout["ep"]), int(rollout["replicas"]),
            float(cluster.get("gpu_memory_gb", 80)), dict(rollout), dict(data.get("train") or {}),
        )  # fmt: skip
    except (KeyError, StopIteration, TypeError) as err:
        raise ConfigError(f"{path}: not a planner recipe (missing {err})") from None
    _check_engines(recipe, path, int(rollout.get("engine_gpus", recipe.engine_ranks)))
    return recipe


def train_overrides(recipe: Recipe) -> list[str]:
    """The recipe's `train` block as `moerl train` overrides."""
    def word(value: Any) -> str:
        return "null" if value is None else str(value).lower() if isinstance(value, bool) \
            else str(value)

    return [f"{key}={word(value)}" for key, value in recipe.train.items()]


def _check_engines(recipe: Recipe, path: Path, engine_gpus: int) -> None:
    ranks, gpus = recipe.engine_ranks, recipe.gpus_per_node
    if engine_gpus != ranks:
        raise ConfigError(f"{path}: rollout.engine_gpus={engine_gpus}, but an engine of "
                          f"tp={recipe.rollout_tp}, ep={recipe.rollout_ep} runs lcm = {ranks}")
    if ranks > gpus and ranks % gpus:
        raise ConfigError(f"{path}: a rollout engine of {ranks} GPUs spans whole nodes of "
                          f"{gpus} (cluster.gpus_per_node)")
    if recipe.rollout_nodes != recipe.rollout_replicas * recipe.engine_span:
        raise ConfigError(
            f"{path}: cluster.rollout_nodes={recipe.rollout_nodes}, but "
            f"{recipe.rollout_replicas} engines (rollout.replicas) of {ranks} GPUs on nodes of "
            f"{gpus} need {recipe.rollout_replicas * recipe.engine_span}")


def trainer_overrides(recipe: Recipe, site: Site) -> list[str]:
    """What `moerl trainer` composes its config from: model, layout, the precision and
    recompute the plan assumed (`planning.run_fields`), stage sizes, the rollout
    engines' layout (their weights stream to them in memory), and agent tasks when the
    recipe has environment servers."""
    p = recipe.parallel
    out = [f"model={recipe.model}", f"seq_length={recipe.seq_length}", *run_overrides(recipe.run)]
    out += [f"parallel.{k}={str(p[k]).lower()}" for k in _PARALLEL_KEYS if p.get(k) is not None]
    if p.get("stage_layers"):
        out.append("parallel.stage_layers=[" + ",".join(map(str, p["stage_layers"])) + "]")
    gpus, envs = recipe.gpus_per_node, recipe.environment_nodes
    out += [
        "launcher=slurm", f"cluster={site.cluster_name}",
        f"launcher.trainer_nodes={recipe.trainer_nodes}", f"launcher.trainer_ranks={gpus}",
        f"launcher.gpus_per_node={gpus}", f"launcher.python={site.python}",
        f"rollout.servers={recipe.rollout_replicas}", f"rollout.nodes={recipe.rollout_nodes}",
        f"rollout.gpus_per_node={min(gpus, recipe.engine_ranks)}",
        f"rollout.tensor_parallel={recipe.rollout_tp}",
        f"rollout.expert_parallel={recipe.rollout_ep}", "rollout.backend=static",
        "rl.weight_sync=memory", f"rewards.servers={recipe.reward_nodes}",
        f"rewards.nodes={recipe.reward_nodes}", f"rewards.cpus={site.server_cpus}",
    ]  # fmt: skip
    if envs:
        out += [f"environments.servers={envs}", f"environments.nodes={envs}",
                f"environments.cpus={site.server_cpus}", "rl.task_source=agent"]
    return out + train_overrides(recipe)


def compose_here(overrides: Sequence[str]) -> RunConfig:
    """The run config of `overrides` composed on this machine: `init_weights` names a
    directory on the cluster's filesystem, which the trainer checks where it starts;
    nothing here reads it, so it is left out (`cfg.init_weights` keeps the name)."""
    given = [o for o in overrides if o.startswith("init_weights=")]
    cfg = load_run_config([o for o in overrides if not o.startswith("init_weights=")])
    if given:
        value = given[-1].split("=", 1)[1]
        cfg.init_weights = None if value == "null" else value
    return cfg


def _cli(site: Site, *args: str) -> tuple[str, ...]:
    return (site.python, "-m", "moerl.launchers.cli", *args)


def run_plan(recipe: Recipe, run_dir: Path, site: Site | None = None,
             extra: Sequence[str] = ()) -> RunPlan:
    """The recipe's stages; `extra`: further `moerl trainer` overrides (last wins)."""
    site = site or h100_site()
    gpus = recipe.gpus_per_node
    overrides = [*trainer_overrides(recipe, site), *extra]
    cfg = compose_here(overrides)
    trainer = StageSpec(
        name="trainer",
        command=_cli(site, "trainer", *overrides, f"run_dir={run_dir}"),
        nodes=recipe.trainer_nodes, gpus_per_node=gpus, ranks_per_node=gpus,
        cpus=gpus * site.cpus_per_gpu,
        env={"OMP_NUM_THREADS": "1", "MOERL_CONFIG_DIR": str(site.root / "configs")},
    )  # fmt: skip
    # One engine per `span` nodes, its ranks under torchrun (`rollout.config.ServerRanks`),
    # computing as the trainer does: the same composed precision.
    ranks = server_ranks_layout(cfg.rollout)
    rollout = StageSpec(
        name="rollout",
        command=_cli(site, "serve", "rollout", "--host", "{host}", "--port", "{port}",
                     "--arch-file", str(run_dir / "arch.json"), "--max-batch",
                     str(cfg.rollout.max_batch), *ranks.flags,
                     *rollout_precision_argv(cfg.precision),
                     *rollout_tokenizer_argv(cfg.tokenizer)),
        replicas=recipe.rollout_replicas, nodes=recipe.rollout_nodes,
        gpus_per_node=cfg.rollout.gpus_per_node,
        cpus=cfg.rollout.gpus_per_node * site.cpus_per_gpu, env={"OMP_NUM_THREADS": "1"},
        ranks_per_node=ranks.ranks_per_node, span=ranks.span,
    )  # fmt: skip
    reward = StageSpec(
        name="reward",
        command=_cli(site, "serve", "reward", "--host", "{host}", "--port", "{port}",
                     "--max-concurrency", str(cfg.rewards.max_concurrency),
                     "--isolation", cfg.rewards.isolation),
        replicas=recipe.reward_nodes, nodes=recipe.reward_nodes, cpus=cfg.rewards.cpus,
    )  # fmt: skip
    stages: tuple[StageSpec, ...] = (trainer, rollout, reward)
    if recipe.environment_nodes:
        stages += (StageSpec(
            name="environment",
            command=_cli(site, "serve", "env", "--host", "{host}", "--port", "{port}",
                         "--max-sessions", str(cfg.environments.max_sessions),
                         "--idle-timeout", str(cfg.environments.idle_timeout_s),
                         "--isolation", cfg.environments.isolation),
            replicas=recipe.environment_nodes, nodes=recipe.environment_nodes,
            cpus=cfg.environments.cpus,
        ),)  # fmt: skip
    return RunPlan(stages, run_dir / "rendezvous", run_dir / "logs")


def h100_cluster() -> ClusterConfig:
    data = yaml.safe_load((REPO / "configs" / "cluster" / "h100.yaml").read_text())
    return from_dict(ClusterConfig, data, "cluster")


def script_name(stem: str) -> str:
    return RECIPES.get(stem, stem)


def recipe_path(stem: str) -> Path:
    return REPO / "configs" / "experiment" / f"{stem}.yaml"


def render_recipe(stem: str, site: Site | None = None, run_dir: Path | None = None,
                  extra: Sequence[str] = ()) -> str:
    """The sbatch script of recipe `stem` at `site` (default: the shipped H100 one,
    slurm/<RECIPES[stem]>.sbatch as it should read)."""
    site = site or h100_site()
    recipe = load_recipe(recipe_path(stem))
    name = script_name(stem)
    run_dir = run_dir or site.root / "runs" / name
    cfg: SlurmConfig = slurm_config(site.cluster, name, 1800, site.python)
    # The rollout servers read the architecture from the run directory, which
    # `moerl train` would have written; here the batch shell writes it first.
    write_arch = (
        f"mkdir -p {run_dir} && {site.python} -c 'import dataclasses, json, sys; "
        "from moerl.models.arch import get_preset; "
        f"json.dump(dataclasses.asdict(get_preset(sys.argv[1])), sys.stdout)' "
        f"{recipe.model} > {run_dir / 'arch.json'}"
    )
    setup = [*cfg.cluster.setup, write_arch]
    cfg = dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster, setup=setup))
    plan = run_plan(recipe, run_dir, site, extra)
    script = render_sbatch(with_cluster_ports(plan, site.cluster), cfg)
    # sbatch reads #SBATCH lines up to the first command, so a comment may go first.
    note = (
        f"# Rendered from configs/experiment/{stem}.yaml by\n"
        "# `python -m moerl.launchers.recipes --write`; edit the recipe, not this file."
    )
    shebang, rest = script.split("\n", 1)
    return f"{shebang}\n{note}\n{rest}"


def script_path(stem: str) -> Path:
    return REPO / "slurm" / f"{script_name(stem)}.sbatch"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="regenerate slurm/*.sbatch")
    args = parser.parse_args(argv)
    for stem in [*RECIPES, *MINIATURES]:
        text = render_recipe(stem)
        if args.write:
            script_path(stem).write_text(text)
            print(f"wrote {script_path(stem).relative_to(REPO)}")
        else:
            sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
