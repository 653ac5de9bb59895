"""The planner's run settings and a run's `precision` and `recompute` groups, both ways.

The memory model counts bytes for a precision (`fp8`: one-byte primary weights,
`bf16`, `fp32`), a layer spec (`te`, `local`) and a recompute mode (`none`,
`selective` with Megatron's `layernorm`, `mla_up_proj`, `moe_act`, `full`). A recipe
runs what it planned through `run_overrides`; `settings_of_run` reads a composed run
config back into those terms (and refuses what the memory model has no term for), so
a test can check that what a recipe launches is what its plan assumed.
"""

from __future__ import annotations

from dataclasses import dataclass

from moerl.models.precision import PrecisionConfig, RecomputeConfig
from moerl.planning.activations import LayerSpec, Recompute
from moerl.planning.memory import Precision, RunSettings

# The modules `selective` means in planning.activations.
SELECTIVE_MODULES = ("layernorm", "mla_up_proj", "moe_act")
_PRECISION_GROUP = {"fp8": "fp8", "bf16": "bf16", "fp32": "cpu"}


@dataclass(frozen=True)
class PlannedFields:
    """What the memory model reads of a run."""

    precision: Precision
    layer_spec: LayerSpec
    recompute: Recompute


def run_overrides(run: RunSettings) -> list[str]:
    """`moerl train` overrides that run what `run` plans: the precision and recompute
    groups (configs/precision, configs/recompute) and the layer spec."""
    if run.precision == "fp8" and run.layer_spec != "te":
        raise ValueError("run.precision=fp8 needs run.layer_spec=te (FP8 runs through "
                         "Transformer Engine)")
    impl = "transformer_engine" if run.layer_spec == "te" else "local"
    out = [f"precision={_PRECISION_GROUP[run.precision]}", f"precision.transformer_impl={impl}",
           f"recompute={run.recompute}"]
    if run.recompute == "selective" and run.layer_spec != "te":
        raise ValueError("run.recompute=selective: the planned modules "
                         f"({', '.join(SELECTIVE_MODULES)}) need run.layer_spec=te")
    return out


def settings_of_run(precision: PrecisionConfig, recompute: RecomputeConfig) -> PlannedFields:
    """The memory model's terms for a run's groups; ValueError naming the field when
    the memory model has none (so a plan cannot describe another run than this one)."""
    if precision.transformer_impl == "auto" or precision.params_dtype == "auto":
        raise ValueError("precision.transformer_impl / precision.params_dtype: auto depends on "
                         "the machine; a planned run names both")
    if precision.offload_activations_layers or precision.offload_optimizer:
        raise ValueError("precision.offload_*: the memory model has no term for offloading")
    # FP8 GEMMs with bf16 primary weights keep bf16's bytes.
    planned: Precision = ("fp8" if precision.fp8 is not None and precision.fp8_param
                          else "bf16" if precision.params_dtype == "bf16" else "fp32")
    layer_spec: LayerSpec = "te" if precision.transformer_impl == "transformer_engine" else "local"
    if recompute.granularity == "selective" and sorted(recompute.modules) != sorted(
            SELECTIVE_MODULES):
        raise ValueError(f"recompute.modules={recompute.modules}: the memory model's selective "
                         f"recompute is {list(SELECTIVE_MODULES)}")
    return PlannedFields(planned, layer_spec, recompute.granularity)
