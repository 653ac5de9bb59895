"""`moerl rehearse +experiment=NAME [overrides]`: every distinct rank of a recipe's job built
at the model's real size before a GPU is asked for, and set beside the plan.

    moerl rehearse +experiment=kimi_k2_h100
    moerl rehearse +experiment=kimi_k2_h100 rollout.tp=1 precision.fp8_param=false --only rollout

The recipe (configs/experiment/NAME.yaml) is read as `moerl.launchers.recipes` renders
it; an override whose key the recipe has (cluster.*, parallel.*, run.*, rollout.*,
seq_length) changes the recipe, any other is a `moerl train` override of its run. Then:

1. the job's nodes against the cluster's (`cluster` group of the site: gpu_nodes for
   trainer + rollout nodes, cpu_nodes for reward + environment nodes);
2. the run's settings against the plan's step (`planning.run_at_scale`): samples per
   update, sample length, micro-batches and the pipeline schedule, sandboxes per core,
   init weights and tokenizer;
3. each distinct trainer rank, built by the trainer's own `build_peers` (policy,
   reference, critic, DDP buffers, distributed optimizer state) on a fake rank of the
   job's world size, and each distinct rollout rank, built as the server's command line
   would build it (its layout, precision, `--max-batch`) with the KV cache its
   attention layers allocate (`rehearsal.build`);
4. built against planned bytes per term, and each rank against its GPU
   (`rehearsal.verdict`).

Exit 0 when nothing is refused, 1 otherwise (each refusal names the rank and term).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import yaml

from moerl.config import RunConfig, config_dir
from moerl.launchers.recipes import (
    Recipe,
    Site,
    compose_here,
    h100_site,
    recipe_of,
    run_plan,
    trainer_overrides,
)
from moerl.launchers.save_cadence import cadence_problems, checkpoint_line
from moerl.planning.memory import RunSettings, memory_breakdown, rank_memory
from moerl.planning.plan import SearchSettings
from moerl.planning.rollout_fit import RolloutSettings, engine_rank_terms
from moerl.planning.run_at_scale import PlannedStep, RunAtScale, check_run
from moerl.planning.run_fields import settings_of_run
from moerl.rehearsal.verdict import GiB, Rehearsed, judge
from moerl.rollout.kv_layout import kv_bytes_per_token_layer
from moerl.typed_config import ConfigError

_RECIPE_SECTIONS = ("cluster", "parallel", "run", "rollout")


@dataclass
class Rehearsal:
    """What one rehearsal found."""

    recipe: Recipe
    problems: list[str] = field(default_factory=list)  # of the job as a whole
    ranks: list[Rehearsed] = field(default_factory=list)
    checkpoint: str = ""  # one save and the SIGUSR1 lead (`launchers.save_cadence`)

    @property
    def refusals(self) -> list[str]:
        return [*self.problems, *(p for r in self.ranks for p in r.problems)]


def load_experiment(overrides: list[str]) -> tuple[Recipe, list[str]]:
    """The recipe `+experiment=NAME` with its overrides applied, and the rest of
    `overrides` (the run's `moerl train` overrides)."""
    named = [o for o in overrides if o.lstrip("+").startswith("experiment=")]
    if len(named) != 1:
        raise ConfigError("moerl rehearse: name one recipe, e.g. +experiment=kimi_k2_h100")
    path = config_dir() / "experiment" / f"{named[0].split('=', 1)[1]}.yaml"
    if not path.is_file():
        raise ConfigError(f"experiment: no recipe {path}")
    data = yaml.safe_load(path.read_text())
    extra = []
    for override in overrides:
        if override in named:
            continue
        if "=" not in override:
            raise ConfigError(f"{override!r}: overrides look like key=value")
        key, value = override.split("=", 1)
        section, _, name = key.partition(".")
        if section in _RECIPE_SECTIONS and name in (data.get(section) or {}):
            data[section][name] = yaml.safe_load(value)
        elif key == "seq_length":
            data[key] = yaml.safe_load(value)
        else:
            extra.append(override)
    return recipe_of(data, path), extra


def _node_problems(recipe: Recipe, site: Site) -> list[str]:
    cluster, out = site.cluster, []
    gpu = recipe.trainer_nodes + recipe.rollout_nodes
    if cluster.gpu_nodes is not None and gpu > cluster.gpu_nodes:
        out.append(f"the job asks {recipe.trainer_nodes} trainer + {recipe.rollout_nodes} "
                   f"rollout = {gpu} GPU nodes; cluster {site.cluster_name} has "
                   f"{cluster.gpu_nodes} (cluster.gpu_nodes)")
    cpu = recipe.reward_nodes + recipe.environment_nodes
    if cluster.cpu_nodes is not None and cpu > cluster.cpu_nodes:
        out.append(f"the job asks {recipe.reward_nodes} reward + {recipe.environment_nodes} "
                   f"environment = {cpu} CPU nodes; cluster {site.cluster_name} has "
                   f"{cluster.cpu_nodes} (cluster.cpu_nodes)")
    return out


def _sample_tokens(cfg: RunConfig) -> int:
    """The longest sequence a sample (and a rollout row) may reach."""
    tokens = cfg.data.max_prompt_tokens + cfg.rl.sampling.max_tokens
    if cfg.runs_episodes:
        tokens = max(tokens, cfg.rl.agent.max_episode_tokens, cfg.rl.agent.context_tokens)
    return tokens


def _run_checks(recipe: Recipe, cfg: RunConfig, run: RunSettings) -> list[str]:
    rl = cfg.rl
    at_scale = RunAtScale(
        samples_per_update=rl.prompts_per_step * rl.group_size / rl.updates_per_step,
        sample_tokens=_sample_tokens(cfg), token_budget=rl.token_budget,
        init_weights=cfg.init_weights, tokenizer=cfg.tokenizer.kind,
        reward_sandboxes=cfg.rewards.max_concurrency, reward_cpus=cfg.rewards.cpus,
        agent_episodes=rl.agent.max_concurrency if cfg.runs_episodes else 0,
        agent_sessions=cfg.environments.servers * cfg.environments.max_sessions)
    step = PlannedStep(run.global_batch_size, run.seq_length, run.micro_batch_size,
                       cfg.parallel)
    problems = check_run(at_scale, step)
    for name in ("reference", "critic"):
        if getattr(run, name) != getattr(recipe.run, name):
            problems.append(f"run.{name}: the run builds {'a' if getattr(run, name) else 'no'} "
                            f"{name} model, the recipe's plan counted "
                            f"{'one' if getattr(recipe.run, name) else 'none'}")
    return problems


def planned_run(recipe: Recipe, cfg: RunConfig) -> tuple[RunSettings, list[str]]:
    """The planner's settings for what `cfg` runs, and where they differ from the
    recipe's `run` section."""
    fields = settings_of_run(cfg.precision, cfg.recompute)
    run = dataclasses.replace(recipe.run, precision=fields.precision,
                              layer_spec=fields.layer_spec, recompute=fields.recompute,
                              reference=True, critic=cfg.rl.advantage == "gae")
    problems = [f"run.{name}: the run computes with {getattr(run, name)}, the recipe planned "
                f"{getattr(recipe.run, name)}"
                for name in ("precision", "layer_spec", "recompute")
                if getattr(run, name) != getattr(recipe.run, name)]
    return run, problems


def _trainer_ranks(cfg: RunConfig, run: RunSettings, budget: float, busiest: bool
                   ) -> list[Rehearsed]:
    from moerl.launchers.trainer_stage import build_peers
    from moerl.models.precision import RecomputeConfig
    from moerl.rehearsal.build import trainer_rank_bytes
    from moerl.rehearsal.stages import distinct_stages
    from moerl.rehearsal.stand_in import stand_in_precision

    stages = distinct_stages(cfg.model, cfg.parallel)
    if busiest:
        peak = memory_breakdown(cfg.model, cfg.parallel, run).pipeline_rank
        stages = [s for s in stages if peak in s.same_as]
    precision = stand_in_precision(cfg.precision)
    out = []
    for stage in stages:
        pp_rank, built = trainer_rank_bytes(
            cfg.parallel, stage.rank,
            lambda groups: build_peers(cfg, groups, None, None, precision, RecomputeConfig()),
            fp8=cfg.precision.fp8_param)
        assert pp_rank == stage.pp_rank, (pp_rank, stage)
        planned = rank_memory(cfg.model, cfg.parallel, run, pp_rank).terms
        out.append(judge(Rehearsed("trainer", stage.rank, pp_rank, stage.same_as, built,
                                   planned, budget)))
    return out


def _rollout_ranks(recipe: Recipe, cfg: RunConfig, site: Site, extra: list[str]
                   ) -> list[Rehearsed]:
    from moerl.rehearsal.build import rollout_rank_bytes
    from moerl.rehearsal.stages import distinct_stages
    from moerl.rehearsal.stand_in import stand_in_precision
    from moerl.rollout.ranks import serving_layout
    from moerl.rollout.server import _parse, precision_of

    stage = next(s for s in run_plan(recipe, site.root / "runs" / recipe.name, site, extra).stages
                 if s.name == "rollout")
    argv = [a.format(host="h", port=0) for a in stage.command]
    args = _parse(argv[argv.index("rollout") + 1:])
    precision = precision_of(args)
    arch = cfg.model
    layout = serving_layout(arch, args.pp * math.lcm(args.tp, args.ep), args.tp, args.ep,
                            args.pp)
    settings = RolloutSettings(**{k: v for k, v in recipe.rollout.items()
                                  if k in {f.name for f in dataclasses.fields(RolloutSettings)}},
                               nodes=recipe.rollout_nodes)
    rows = math.ceil(settings.concurrent_sequences / recipe.rollout_replicas)
    planned = engine_rank_terms(arch, settings, args.tp, args.ep, rows,
                                kv_bytes_per_token_layer)
    budget = recipe.gpu_memory_gb * GiB * settings.memory_utilization
    out = []
    for pipe in distinct_stages(arch, layout):
        pp_rank, built = rollout_rank_bytes(arch, layout, pipe.rank,
                                            stand_in_precision(precision), precision.fp8_param,
                                            args.max_batch, _sample_tokens(cfg))
        rank = judge(Rehearsed("rollout", pipe.rank, pp_rank, pipe.same_as, built, planned,
                               budget))
        if args.pp > 1:
            rank.problems.append("rollout.pipeline_parallel: the planner sizes engines "
                                 "without pipeline stages")
        out.append(rank)
    return out


def rehearse(overrides: list[str], only: str | None = None, busiest: bool = False,
             site: Site | None = None) -> Rehearsal:
    """Rehearse the recipe `overrides` name (see the module docstring). `only`: trainer
    or rollout ranks alone; `busiest`: of the trainer, only the stage the planner finds
    most loaded."""
    site = site or h100_site()
    recipe, extra = load_experiment(overrides)
    result = Rehearsal(recipe, _node_problems(recipe, site))
    if result.problems:  # nothing is built for a job the cluster cannot hold
        return result
    cfg = compose_here([*trainer_overrides(recipe, site), *extra])
    run, differences = planned_run(recipe, cfg)
    result.problems += differences + _run_checks(recipe, cfg, run)
    result.problems += cadence_problems(cfg, None)
    result.checkpoint = checkpoint_line(cfg)
    budget = recipe.gpu_memory_gb * GiB * (1 - SearchSettings().safety_margin)
    if only in (None, "trainer"):
        result.ranks += _trainer_ranks(cfg, run, budget, busiest)
    if only in (None, "rollout"):
        result.ranks += _rollout_ranks(recipe, cfg, site, extra)
    return result


def rehearse_main(overrides: list[str], only: str | None, busiest: bool) -> int:
    """`moerl rehearse`: print each stage's table and every refusal; 0 when none."""
    from rich.console import Console

    from moerl.rehearsal.table import stage_table

    result = rehearse(overrides, only, busiest)
    console = Console() if Console().is_terminal else Console(width=160)
    recipe = result.recipe
    for stage in ("trainer", "rollout"):
        ranks = [r for r in result.ranks if r.stage == stage]
        if ranks:
            nodes = recipe.trainer_nodes if stage == "trainer" else recipe.rollout_nodes
            console.print(stage_table(ranks, f"{stage}: {nodes} x {recipe.gpus_per_node} GPUs"))
    if result.checkpoint:
        console.print(result.checkpoint, markup=False)
    for problem in result.refusals:
        console.print(f"refused: {problem}", markup=False)
    if not result.refusals:
        console.print(f"{recipe.name}: every rehearsed rank fits and agrees with the plan "
                      "within 5% per term", markup=False)
    return 0 if not result.refusals else 1
