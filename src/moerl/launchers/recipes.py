"""The shipped trillion-scale recipes as SLURM scripts: planner recipe YAML -> sbatch.

    python -m moerl.launchers.recipes            print every rendered script
    python -m moerl.launchers.recipes --write    regenerate slurm/<name>.sbatch

A recipe (configs/experiment/kimi_k2_h100.yaml and the like) is the planner's
output: cluster sizes, the chosen layout, run and rollout settings. It is not a
`moerl train` config (its `run`/`rollout` keys are the planner's), so the stages are
built here: the trainer on `cluster.trainer_nodes` x 8 GPUs (one torchrun rank per
GPU) started with the `moerl train` overrides the recipe implies (model, layout,
sizes), the rollout servers one per rollout node with its GPUs, the reward servers
on CPU nodes. The cluster side is configs/cluster/h100.yaml (partitions gpu/gpu/cpu,
USR1 before the limit, requeue). Paths assume a checkout on a filesystem every node
shares, at SHARED.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from moerl.config import ClusterConfig, load_run_config
from moerl.launchers.cluster import slurm_config, with_cluster_ports
from moerl.launchers.plan import rollout_precision_argv
from moerl.launchers.slurm import SlurmConfig, render_sbatch
from moerl.launchers.stages import RunPlan, StageSpec
from moerl.planning.memory import RunSettings
from moerl.planning.run_fields import run_overrides
from moerl.typed_config import ConfigError, from_dict

REPO = Path(__file__).resolve().parents[3]
SHARED = Path("/shared/moerl")
# recipe file stem -> rendered script name (slurm/<name>.sbatch)
RECIPES = {
    "kimi_k2_h100": "kimi_k2_grpo_h100",
    "deepseek_v3_h100": "deepseek_v3_grpo_h100",
    "kimi_k2_long_context_h100": "kimi_k2_long_context_grpo_h100",
}
_PARALLEL_KEYS = ("tp", "pp", "vpp", "ep", "etp", "cp", "dp", "use_distributed_optimizer")
REWARD_CPUS = 32  # per reward server: sandboxes are CPU-bound


@dataclass(frozen=True)
class Recipe:
    """The parts of a planner recipe a launch needs."""

    name: str
    model: str
    seq_length: int
    trainer_nodes: int
    rollout_nodes: int
    reward_nodes: int
    gpus_per_node: int
    parallel: dict[str, Any]
    run: RunSettings
    """The planner's run settings: precision, layer spec, recompute, sizes."""


def load_recipe(path: Path) -> Recipe:
    data = yaml.safe_load(path.read_text())
    try:
        model = next(
            d["override /model"]
            for d in data["defaults"]
            if isinstance(d, dict) and "override /model" in d
        )
        cluster = data["cluster"]
        return Recipe(
            path.stem,
            model,
            int(data["seq_length"]),
            int(cluster["trainer_nodes"]),
            int(cluster["rollout_nodes"]),
            int(cluster["reward_nodes"]),
            int(cluster["gpus_per_node"]),
            dict(data["parallel"]),
            from_dict(RunSettings, data["run"], "run"),
        )
    except (KeyError, StopIteration, TypeError) as err:
        raise ConfigError(f"{path}: not a planner recipe (missing {err})") from None


def trainer_overrides(recipe: Recipe) -> list[str]:
    """What `moerl trainer` composes its config from: model, layout, the precision and
    recompute the plan assumed (`planning.run_fields`), and stage sizes."""
    p = recipe.parallel
    out = [f"model={recipe.model}", f"seq_length={recipe.seq_length}", *run_overrides(recipe.run)]
    out += [f"parallel.{k}={str(p[k]).lower()}" for k in _PARALLEL_KEYS if p.get(k) is not None]
    if p.get("stage_layers"):
        out.append("parallel.stage_layers=[" + ",".join(map(str, p["stage_layers"])) + "]")
    out += [
        "launcher=slurm", "cluster=h100", f"launcher.trainer_nodes={recipe.trainer_nodes}",
        f"launcher.trainer_ranks={recipe.gpus_per_node}",
        f"launcher.gpus_per_node={recipe.gpus_per_node}", f"launcher.python={_python()}",
        f"rollout.servers={recipe.rollout_nodes}", f"rollout.nodes={recipe.rollout_nodes}",
        f"rollout.gpus_per_node={recipe.gpus_per_node}", f"rewards.servers={recipe.reward_nodes}",
        f"rewards.nodes={recipe.reward_nodes}", f"rewards.cpus={REWARD_CPUS}",
    ]  # fmt: skip
    return out


def _python() -> str:
    return str(SHARED / ".venv" / "bin" / "python")


def _cli(*args: str) -> tuple[str, ...]:
    return (_python(), "-m", "moerl.launchers.cli", *args)


def run_plan(recipe: Recipe, run_dir: Path) -> RunPlan:
    gpus = recipe.gpus_per_node
    overrides = trainer_overrides(recipe)
    # The rollout servers compute as the trainer does: the same composed precision.
    precision = load_run_config(overrides).precision
    trainer = StageSpec(
        name="trainer",
        command=_cli("trainer", *overrides, f"run_dir={run_dir}"),
        nodes=recipe.trainer_nodes, gpus_per_node=gpus, ranks_per_node=gpus,
        cpus=gpus * 8,  # per node: data loading and NCCL proxy threads beside each rank
        env={"OMP_NUM_THREADS": "1", "MOERL_CONFIG_DIR": str(SHARED / "configs")},
    )  # fmt: skip
    rollout = StageSpec(
        name="rollout",
        command=_cli("serve", "rollout", "--host", "{host}", "--port", "{port}",
                     "--arch-file", str(run_dir / "arch.json"), *rollout_precision_argv(precision)),
        replicas=recipe.rollout_nodes, nodes=recipe.rollout_nodes, gpus_per_node=gpus,
        cpus=gpus * 8, env={"OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    reward = StageSpec(
        name="reward",
        command=_cli("serve", "reward", "--host", "{host}", "--port", "{port}"),
        replicas=recipe.reward_nodes, nodes=recipe.reward_nodes, cpus=REWARD_CPUS,
    )  # fmt: skip
    return RunPlan((trainer, rollout, reward), run_dir / "rendezvous", run_dir / "logs")


def h100_cluster() -> ClusterConfig:
    data = yaml.safe_load((REPO / "configs" / "cluster" / "h100.yaml").read_text())
    return from_dict(ClusterConfig, data, "cluster")


def render_recipe(stem: str) -> str:
    """slurm/<RECIPES[stem]>.sbatch as it should read."""
    recipe = load_recipe(REPO / "configs" / "experiment" / f"{stem}.yaml")
    run_dir = SHARED / "runs" / RECIPES[stem]
    cluster = h100_cluster()
    cfg: SlurmConfig = slurm_config(cluster, RECIPES[stem], 1800, _python())
    # The rollout servers read the architecture from the run directory, which
    # `moerl train` would have written; here the batch shell writes it first.
    write_arch = (
        f"mkdir -p {run_dir} && {_python()} -c 'import dataclasses, json, sys; "
        "from moerl.models.arch import get_preset; "
        f"json.dump(dataclasses.asdict(get_preset(sys.argv[1])), sys.stdout)' "
        f"{recipe.model} > {run_dir / 'arch.json'}"
    )
    cfg = dataclasses.replace(cfg, setup=(*cfg.setup, write_arch))
    script = render_sbatch(with_cluster_ports(run_plan(recipe, run_dir), cluster), cfg)
    # sbatch reads #SBATCH lines up to the first command, so a comment may go first.
    note = (
        f"# Rendered from configs/experiment/{stem}.yaml by\n"
        "# `python -m moerl.launchers.recipes --write`; edit the recipe, not this file."
    )
    shebang, rest = script.split("\n", 1)
    return f"{shebang}\n{note}\n{rest}"


def script_path(stem: str) -> Path:
    return REPO / "slurm" / f"{RECIPES[stem]}.sbatch"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="regenerate slurm/*.sbatch")
    args = parser.parse_args(argv)
    for stem in RECIPES:
        text = render_recipe(stem)
        if args.write:
            script_path(stem).write_text(text)
            print(f"wrote {script_path(stem).relative_to(REPO)}")
        else:
            sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
