"""`moerl plan ... --recipe PATH`: the chosen layout, precision, recompute and rollout
engines written as a recipe (configs/experiment/*_h100.yaml), which
`moerl.launchers.recipes` renders into an sbatch script, with the run's own settings in
its `train` block (`planning.run_at_scale`: init weights, tokenizer, RL batch sizes and
lengths of the planned step, sandboxes per CPU node), which `moerl rehearse` checks.

The file is generated: its header names the command that produced it and what the
planner predicted; the comment lines below the notes marker are the authors' and
survive a rewrite. `tests/unit/test_plan_recipes.py` regenerates every shipped recipe
from its own header and checks that nothing but comments differs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from moerl.models.arch import get_preset
from moerl.planning.checkpoint_time import interval_minutes, save_plan
from moerl.planning.memory import GiB
from moerl.planning.plan import Candidate, PlanConfig
from moerl.planning.rollout_fit import EngineFit
from moerl.planning.run_at_scale import PlannedStep, train_settings

NOTES_MARKER = "# Notes (kept when `moerl plan --recipe` rewrites this file):"
_PRECISION_NOTE = {
    "fp8": "Transformer Engine FP8, FP8 primary weights, fp32 master weights (precision=fp8)",
    "bf16": "bf16 weights, fp32 master weights (precision=bf16)",
    "fp32": "fp32 weights and math",
}
_RECOMPUTE_NOTE = {
    "selective": "layernorm, mla_up_proj, moe_act (recompute=selective)",
    "full": "every layer, one at a time (recompute=full)",
    "none": "every activation kept",
}


def existing_notes(path: Path) -> list[str]:
    """The authors' comment lines of a recipe written before (below the marker)."""
    if not path.is_file():
        return []
    lines = path.read_text().splitlines()
    if NOTES_MARKER not in lines:
        return []
    notes = []
    for line in lines[lines.index(NOTES_MARKER) + 1:]:
        if not line.startswith("#"):
            break
        notes.append(line)
    return notes


def _wrapped_command(overrides: list[str], path: Path) -> list[str]:
    words = ["moerl", "plan", *overrides, "--recipe", str(path)]
    lines, line = [], "# Produced by:"
    for word in words:
        if len(line) + 1 + len(word) > 88 and line.strip() != "#":
            lines.append(line)
            line = "#  "
        line += " " + word
    return [*lines, line]


def _value(value: Any) -> str:
    if value is None:
        return "null"
    return str(value).lower() if isinstance(value, bool) else str(value)


def recipe_text(config: PlanConfig, overrides: list[str], path: Path, best: Candidate,
                engine: EngineFit, notes: list[str]) -> str:
    """The recipe for the planner's best layout and rollout engine shape."""
    cluster, run, rollout, layout = config.cluster, config.run, config.rollout, best.layout
    budget = cluster.gpu_memory_gb * (1 - config.search.safety_margin)
    chunks = layout.pp * (layout.vpp or 1)
    step = PlannedStep(run.global_batch_size, run.seq_length, run.micro_batch_size, layout)
    train = train_settings(step, config.recipe, config.reward_nodes, config.environment_nodes,
                           engine.needed_rows)
    save = save_plan(get_preset(config.model), run, cluster.checkpoint_write_gbps)
    train["checkpoint.interval_minutes"] = interval_minutes(save)
    header = [
        "# @package _global_",
        *_wrapped_command(overrides, path),
        f"# Predicted: {best.memory.total / GiB:.1f} GiB on the busiest rank (budget "
        f"{budget:.1f} = {cluster.gpu_memory_gb:g} less {config.search.safety_margin:.0%}), "
        f"{best.time.total:.2f} s per step",
        f"# of {run.global_batch_size} x {run.seq_length} tokens, {step.micro_batches} "
        f"micro-batches per DP rank (pipeline bubble {step.bubble:.1%});",
        f"# rollout engines of {engine.gpus} GPUs (TP{engine.tp}, EP{engine.ep}), "
        f"{engine.replicas} of them, {engine.needed_rows} "
        f"row{'s' if engine.needed_rows != 1 else ''} each.",
        f"# One checkpoint: {save.bytes / 1e12:.2f} TB, {save.seconds:.0f} s at "
        f"{save.write_gbps:g} GB/s (cluster.checkpoint_write_gbps);",
        f"# one every {train['checkpoint.interval_minutes']} minutes "
        "(checkpoint.interval_minutes).",
    ]
    if best.uneven_pipeline:
        header.append(f"# {get_preset(config.model).num_layers} layers over pp*vpp = {chunks} "
                      "chunks: an "
                      "uneven split, given as parallel.stage_layers.")
    header += [NOTES_MARKER, *notes]
    stage_layers = ("[" + ", ".join(map(str, layout.stage_layers)) + "]"
                    if layout.stage_layers else "null")
    body = [
        "defaults:",
        f"  - override /model: {config.model}",
        "  - _self_",
        "",
        f"seq_length: {run.seq_length}",
        "",
        "cluster:",
        f"  trainer_nodes: {config.trainer_cluster().nodes}",
        f"  rollout_nodes: {rollout.nodes}",
        f"  reward_nodes: {config.reward_nodes}  # CPU nodes: sandboxes and verifiers",
        f"  environment_nodes: {config.environment_nodes}  # CPU nodes: agent tasks' sandboxes",
        f"  gpus_per_node: {cluster.gpus_per_node}",
        f"  gpu_memory_gb: {cluster.gpu_memory_gb:g}",
        "",
        "parallel:",
        *[f"  {key}: {_value(getattr(layout, key))}" for key in ("tp", "pp", "vpp", "ep", "etp",
                                                                 "cp", "dp")],
        "  sequence_parallel: null  # on when tp > 1",
        f"  use_distributed_optimizer: {str(layout.use_distributed_optimizer).lower()}",
        f"  stage_layers: {stage_layers}",
        "",
        "run:",
        f"  seq_length: {run.seq_length}",
        f"  micro_batch_size: {run.micro_batch_size}",
        f"  global_batch_size: {run.global_batch_size}",
        f"  precision: {run.precision}  # {_PRECISION_NOTE[run.precision]}",
        f"  layer_spec: {run.layer_spec}",
        f"  recompute: {run.recompute}  # {_RECOMPUTE_NOTE[run.recompute]}",
        "  moe_capacity_factor: "
        + ("null  # dropless" if run.moe_capacity_factor is None else f"{run.moe_capacity_factor}"),
        f"  reference: {_value(run.reference)}  # the frozen reference model",
        f"  critic: {_value(run.critic)}  # PPO's value model (rl.advantage=gae)",
        "",
        "rollout:",
        f"  engine_gpus: {engine.gpus}",
        f"  tp: {engine.tp}",
        f"  ep: {engine.ep}",
        f"  replicas: {engine.replicas}",
        f"  weight_dtype: {rollout.weight_dtype}",
        f"  concurrent_sequences: {rollout.concurrent_sequences}",
        f"  context_length: {rollout.context_length}",
        "",
        "train:  # `moerl train` settings of the run beside its layout (moerl rehearse checks)",
        *[f"  {key}: {_value(value)}" for key, value in train.items()],
    ]
    return "\n".join([*header, *body]) + "\n"
