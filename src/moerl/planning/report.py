"""`moerl plan` input and output: overrides -> `PlanConfig`, results -> tables or JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from moerl.models.arch import get_preset
from moerl.planning.checkpoint_time import interval_minutes, save_plan
from moerl.planning.memory import GiB
from moerl.planning.plan import Candidate, PlanConfig, search_layouts
from moerl.planning.recipe import existing_notes, recipe_text
from moerl.planning.rollout_fit import EngineFit, KVBytes, rollout_options
from moerl.planning.run_at_scale import PlannedStep
from moerl.typed_config import ConfigError, from_dict, to_dict

_ABSENT = object()


def load_plan_config(overrides: list[str]) -> PlanConfig:
    """`key=value` overrides on top of the dataclass defaults; unknown keys fail by name."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise ConfigError(f"{bad[0]!r}: overrides look like key=value (e.g. cluster.nodes=64)")
    base = OmegaConf.create(to_dict(PlanConfig()))
    for override in overrides:
        key = override.split("=", 1)[0]
        if OmegaConf.select(base, key, default=_ABSENT) is _ABSENT:
            section = key.rsplit(".", 1)[0] if "." in key else ""
            known = OmegaConf.select(base, section, default=None) if section else base
            names = ", ".join(sorted(known)) if hasattr(known, "keys") else "(none)"
            raise ConfigError(f"{key}: unknown key for moerl plan; known keys there: {names}")
        try:
            base = OmegaConf.merge(base, OmegaConf.from_dotlist([override]))
        except OmegaConfBaseException as err:
            raise ConfigError(f"{key}: {str(err).splitlines()[0]}") from None
    data = OmegaConf.to_container(base, resolve=True)
    assert isinstance(data, dict)
    config = from_dict(PlanConfig, {str(k): v for k, v in data.items()})
    try:
        config.trainer_cluster()
    except ValueError as err:
        raise ConfigError(str(err)) from None
    return config


def candidate_dict(candidate: Candidate) -> dict[str, Any]:
    time = candidate.time
    return {
        "layout": to_dict(candidate.layout),
        "name": candidate.layout.describe(),
        "uneven_pipeline": candidate.uneven_pipeline,
        "fits": candidate.fits,
        "reason": candidate.reason,
        "memory_gib": {**candidate.memory.gib(), "total": candidate.memory.total / GiB},
        "peak_pipeline_rank": candidate.memory.pipeline_rank,
        "step_seconds": {
            "total": time.total, "compute": time.compute, "bubble": time.bubble,
            "tp": time.tp, "cp": time.cp, "ep": time.ep, "pp": time.pp, "dp": time.dp,
        },
        "tokens_per_gpu_second": time.tokens_per_gpu_second,
        "bubble_share": time.bubble / time.total if time.total else 0.0,
    }


def _layouts_table(config: PlanConfig, best: list[Candidate], considered: int) -> Table:
    cluster = config.trainer_cluster()
    peak = cluster.peak_fp8_tflops if config.run.precision == "fp8" else cluster.peak_bf16_tflops
    table = Table(title=f"{config.model}: trainer on {cluster.nodes} x {cluster.gpus_per_node} "
                        f"GPUs (rollout on {config.rollout.nodes} more nodes): {len(best)} "
                        f"shown of the fitting layouts ({considered} valid)")
    columns = ("#", "layout", "pp split", "GiB", "step s", "compute s", "bubble s", "comm s",
               "tok/s/GPU", "MFU")
    for column in columns:
        table.add_column(column, justify="left" if column == "layout" else "right",
                         no_wrap=True)
    for i, c in enumerate(best, 1):
        t = c.time
        table.add_row(str(i), c.layout.describe(), "uneven" if c.uneven_pipeline else "even",
                      f"{c.memory.total / GiB:.1f}", f"{t.total:.2f}", f"{t.compute:.2f}",
                      f"{t.bubble:.2f}", f"{t.communication:.2f}",
                      f"{t.tokens_per_gpu_second:,.0f}", f"{t.mfu(peak):.1%}")
    return table


def _memory_table(best: Candidate, budget_gib: float, run: PlanConfig) -> Table:
    memory = best.memory
    step = PlannedStep(run.run.global_batch_size, run.run.seq_length, run.run.micro_batch_size,
                       best.layout)
    table = Table(title=f"memory of {best.layout.describe()}, pipeline rank "
                        f"{memory.pipeline_rank} ({memory.in_flight:g} micro-batches in flight; "
                        f"{step.micro_batches} per DP rank a step, bubble {step.bubble:.1%})")
    table.add_column("term")
    table.add_column("GiB", justify="right")
    table.add_column("share", justify="right")
    for name, gib in memory.gib().items():
        table.add_row(name, f"{gib:.2f}", f"{gib * GiB / memory.total:.0%}")
    table.add_row("total", f"{memory.total / GiB:.2f}", f"budget {budget_gib:.1f}")
    return table


def _rollout_table(options: list[EngineFit], config: PlanConfig) -> Table:
    rollout = config.rollout
    table = Table(title=f"rollout engines on {rollout.nodes} nodes ({rollout.weight_dtype} "
                        f"weights, {rollout.concurrent_sequences} sequences of "
                        f"{rollout.context_length:,} tokens at once)")
    for column in ("GPUs/engine", "TP", "EP", "replicas", "weights GiB/GPU", "KV tokens",
                   "rows", "needed", "fits"):
        table.add_column(column, justify="right")
    shown = [o for o in options if o.fits][:6] or options[:3]
    for o in shown:
        table.add_row(str(o.gpus), str(o.tp), str(o.ep), str(o.replicas), f"{o.weights_gb:.1f}",
                      f"{o.kv_tokens:,}", str(o.rows), str(o.needed_rows),
                      "yes" if o.fits else "no")
    return table


def report(config: PlanConfig, as_json: bool, kv_bytes: KVBytes, recipe: Path | None = None,
           overrides: list[str] | None = None) -> int:
    """Run the search and print the result; 1 when no layout fits. With `recipe`,
    write the best layout and rollout engine shape there (`planning.recipe`).
    `kv_bytes`: the rollout engine's cache per token and layer (`rollout.kv_layout`)."""
    arch = get_preset(config.model)
    cluster, search = config.trainer_cluster(), config.search
    result = search_layouts(arch, cluster, config.run, search)
    fitting, considered, miss = result.fitting, result.considered, result.closest_miss
    best = fitting[: search.top]
    options = rollout_options(arch, config.rollout, cluster.gpus_per_node, cluster.gpu_memory_gb,
                              kv_bytes)
    save = save_plan(arch, config.run, cluster.checkpoint_write_gbps)
    if as_json:
        print(json.dumps({
            "config": to_dict(config),
            "considered": considered,
            "fitting": len(fitting),
            "closest_miss": candidate_dict(miss) if miss is not None and not fitting else None,
            "best": [candidate_dict(c) for c in best],
            "rollout": [to_dict(o) for o in options],
            "checkpoint": {"bytes": save.bytes, "seconds": save.seconds,
                           "write_gbps": save.write_gbps,
                           "interval_minutes": interval_minutes(save)},
        }, indent=2))
        return 0 if fitting else 1
    console = Console()
    if not console.is_terminal:
        console = Console(width=132)
    if not best:
        console.print(f"no layout of {considered} fits {cluster.gpu_memory_gb:g} GiB with a "
                      f"{search.safety_margin:.0%} margin; add nodes or recompute more")
        if miss is not None:
            console.print(f"closest: {miss.layout.describe()}: {miss.reason}")
        return 1
    if recipe is not None:
        engines = [o for o in options if o.fits]
        if not engines:
            console.print(f"no rollout engine fits {config.rollout.nodes} rollout nodes; "
                          "no recipe written")
            return 1
        notes = existing_notes(recipe)
        recipe.write_text(recipe_text(config, overrides or [], recipe, best[0], engines[0],
                                      notes))
        console.print(f"wrote {recipe}", markup=False)
    console.print(_layouts_table(config, best, considered))
    console.print(_memory_table(best[0], cluster.gpu_memory_gb * (1 - search.safety_margin),
                                config))
    console.print(_rollout_table(options, config))
    console.print(f"one checkpoint: {save.describe()}; checkpoint.interval_minutes="
                  f"{interval_minutes(save)}", markup=False)
    return 0
