"""How a run computes and what its ranks keep: the `precision` and `recompute` groups.

These are the only way a run chooses Transformer Engine, bf16, FP8, activation
recompute and CPU offloading. `models.build` turns them into Megatron's
`TransformerConfig` fields (`transformer_kwargs`), the optimizer reads
`offload_optimizer`, the rollout server is started with the same precision, and the
planner's memory model (`planning.memory.RunSettings.from_run`) reads these same
dataclasses, so a plan and the run it describes cannot disagree.

No torch here: the run config imports this module at start-up.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

TransformerImpl = Literal["auto", "local", "transformer_engine"]
ParamsDtype = Literal["auto", "fp32", "bf16"]
Fp8Recipe = Literal["delayed", "tensorwise", "blockwise", "mxfp8"]
FP8_RECIPES: tuple[str, ...] = ("delayed", "tensorwise", "blockwise", "mxfp8")
RecomputeGranularity = Literal["none", "selective", "full"]
RecomputeMethod = Literal["uniform", "block"]
# Megatron-Core 0.19's selective-recompute modules (TransformerConfig.recompute_modules).
RECOMPUTE_MODULES: tuple[str, ...] = (
    "core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts",
)  # fmt: skip


class PrecisionUnavailable(ValueError):
    """A precision setting this machine cannot run; the message names the field."""


@dataclass
class PrecisionConfig:
    """The `precision` group."""

    transformer_impl: TransformerImpl = "auto"
    """transformer_engine: TE's layer spec (GPU, TE installed); local: Megatron's local
    spec; auto: TE where it runs, else local."""
    params_dtype: ParamsDtype = "auto"
    """Weights and math: bf16 (fp32 master weights and gradients) or fp32; auto: bf16 on
    a GPU, fp32 on CPU."""
    fp8: Fp8Recipe | None = None
    """FP8 GEMMs through Transformer Engine with this scaling recipe; null: none."""
    fp8_param: bool = False
    """Keep the primary weights in FP8 (one byte each; fp32 master copies)."""
    fp8_bf16_layers_at_start: int = 0
    """With fp8: this many first layers of each pipeline stage stay in bf16."""
    fp8_bf16_layers_at_end: int = 0
    """With fp8: this many last layers of each pipeline stage stay in bf16."""
    offload_activations_layers: int = 0
    """Layers whose activations go to CPU memory between forward and backward
    (Megatron's cpu_offloading); 0: none. Not with pipeline parallelism or recompute."""
    offload_optimizer: bool = False
    """Adam's state and step on the CPU (needs the distributed optimizer)."""

    def __post_init__(self) -> None:
        if self.fp8 is None and (self.fp8_param or self.fp8_bf16_layers_at_start
                                 or self.fp8_bf16_layers_at_end):
            raise ValueError("precision.fp8_param / fp8_bf16_layers_*: need precision.fp8 "
                             f"(one of {', '.join(FP8_RECIPES)})")
        if self.fp8 is not None and self.transformer_impl == "local":
            raise ValueError(f"precision.fp8={self.fp8}: FP8 runs through Transformer Engine; "
                             "set precision.transformer_impl=transformer_engine (or auto)")
        if self.fp8 is not None and self.params_dtype == "fp32":
            raise ValueError(f"precision.fp8={self.fp8} with precision.params_dtype=fp32: FP8 "
                             "training keeps bf16 weights; set precision.params_dtype=bf16")
        if min(self.fp8_bf16_layers_at_start, self.fp8_bf16_layers_at_end,
               self.offload_activations_layers) < 0:
            raise ValueError("precision.fp8_bf16_layers_* and "
                             "precision.offload_activations_layers must be >= 0")

    def resolve(self, *, te_available: bool, cuda: bool) -> ResolvedPrecision:
        """What runs here; a setting this machine cannot run is refused, naming it."""
        te = self.transformer_impl == "transformer_engine" or (
            self.transformer_impl == "auto" and te_available)
        if te and not te_available:
            why = "no GPU is present" if not cuda else "transformer_engine is not installed"
            raise PrecisionUnavailable(
                f"precision.transformer_impl=transformer_engine: Transformer Engine needs a GPU "
                f"with transformer_engine installed, but {why}; set precision.transformer_impl="
                "local (or auto)")
        if self.fp8 is not None and not te:
            why = "no GPU is present" if not cuda else "transformer_engine is not installed"
            raise PrecisionUnavailable(
                f"precision.fp8={self.fp8}: FP8 runs through Transformer Engine, but {why}; "
                "set precision.fp8=null")
        bf16 = self.params_dtype == "bf16" or (self.params_dtype == "auto" and cuda)
        if bf16 and not cuda:
            raise PrecisionUnavailable(
                "precision.params_dtype=bf16: bf16 training needs a GPU (CPU runs keep fp32); "
                "set precision.params_dtype=fp32 (or auto)")
        if (self.offload_activations_layers or self.offload_optimizer) and not cuda:
            field_name = ("offload_optimizer" if self.offload_optimizer
                          else "offload_activations_layers")
            raise PrecisionUnavailable(
                f"precision.{field_name}: offloading moves GPU memory to the CPU and needs a GPU; "
                f"set it to {'false' if self.offload_optimizer else '0'}")
        return ResolvedPrecision(te=te, bf16=bf16, config=self)


@dataclass(frozen=True)
class ResolvedPrecision:
    """A `PrecisionConfig` decided for one machine."""

    te: bool
    bf16: bool
    config: PrecisionConfig = field(default_factory=PrecisionConfig)

    def transformer_kwargs(self) -> dict[str, Any]:
        """TransformerConfig fields for precision and offloading."""
        cfg = self.config
        kwargs: dict[str, Any] = {}
        if cfg.fp8 is not None:
            kwargs.update(
                fp8="e4m3" if cfg.fp8 in ("blockwise", "mxfp8") else "hybrid",
                fp8_recipe=cfg.fp8, fp8_param=cfg.fp8_param)
            if cfg.fp8_bf16_layers_at_start or cfg.fp8_bf16_layers_at_end:
                kwargs.update(first_last_layers_bf16=True,
                              num_layers_at_start_in_bf16=cfg.fp8_bf16_layers_at_start,
                              num_layers_at_end_in_bf16=cfg.fp8_bf16_layers_at_end)
        if cfg.offload_activations_layers:
            kwargs.update(cpu_offloading=True,
                          cpu_offloading_num_layers=cfg.offload_activations_layers,
                          cpu_offloading_activations=True, cpu_offloading_weights=False)
        return kwargs


def local_fp32() -> ResolvedPrecision:
    """Megatron's local spec in fp32: what a CPU runs."""
    return ResolvedPrecision(te=False, bf16=False)


@dataclass
class RecomputeConfig:
    """The `recompute` group: activations dropped in forward and recomputed in backward."""

    granularity: RecomputeGranularity = "none"
    """selective: the `modules` only; full: whole layers (`method`, `num_layers`)."""
    modules: list[str] = field(default_factory=lambda: ["core_attn"])
    """With selective: of core_attn, moe_act, layernorm, mla_up_proj, mlp, moe,
    shared_experts (layernorm and moe_act need Transformer Engine; mla_up_proj, MLA)."""
    method: RecomputeMethod = "uniform"
    """With full: uniform (every layer, checkpointed `num_layers` at a time) or block
    (the first `num_layers` layers of each pipeline stage)."""
    num_layers: int = 1
    """With full: see `method`."""

    def __post_init__(self) -> None:
        if unknown := sorted(set(self.modules) - set(RECOMPUTE_MODULES)):
            raise ValueError(f"recompute.modules: unknown {unknown}; choose from "
                             f"{', '.join(RECOMPUTE_MODULES)}")
        if self.granularity == "selective" and not self.modules:
            raise ValueError("recompute.modules: selective recompute needs at least one module")
        if self.num_layers < 1:
            raise ValueError("recompute.num_layers: must be >= 1")

    def check(self, precision: PrecisionConfig, *, te: bool) -> None:
        """Combinations Megatron refuses, refused at start-up with the fields named."""
        if self.granularity != "none" and precision.offload_activations_layers:
            raise ValueError("recompute.granularity and precision.offload_activations_layers: "
                             "Megatron offloads activations only without recompute; pick one")
        # layernorm: Megatron recomputes the norm through TE's FP8 state; moe_act: only
        # with grouped GEMM experts, which the local spec does not build.
        needs_te = sorted({"layernorm", "moe_act"} & set(self.modules))
        if self.granularity == "selective" and needs_te and not te:
            raise ValueError(f"recompute.modules={self.modules}: {needs_te} recompute only "
                             "with Transformer Engine layers; on the local spec use core_attn, "
                             "mla_up_proj, mlp, moe, shared_experts")

    def transformer_kwargs(self) -> dict[str, Any]:
        """TransformerConfig fields for activation recompute."""
        if self.granularity == "none":
            return {}
        if self.granularity == "selective":
            return {"recompute_granularity": "selective", "recompute_modules": list(self.modules)}
        return {"recompute_granularity": "full", "recompute_method": self.method,
                "recompute_num_layers": self.num_layers}
