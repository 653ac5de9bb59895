"""What is built in place of Transformer Engine's layers, and the bytes they stand for.

A rehearsal runs where Transformer Engine cannot (a CPU login node) and on tensors
that hold no memory, which TE's kernels do not take. It builds the run's model on
Megatron's local spec in the run's parameter dtype instead: the same layers, the same
parameter shapes per rank but for MLA's down-projections, which the local spec splits
over tensor parallelism and TE replicates (a small share of a rank; the planner's
`layer_spec` says which it counts). FP8 primary weights (`precision.fp8_param`) are
the weights of TE's linear layers, held in one byte: here the weights of Megatron's
column- and row-parallel linears inside decoder and MTP layers. The output layer is
Megatron's own linear in either spec and stays in bf16, as do embeddings, norms and
routers. The local spec's torch norms hold fp32 weights where TE's hold bf16 (a few
megabytes a rank, optimized in place rather than through a master copy).
`precision.fp8_bf16_layers_*` (layers kept in bf16) are not modelled.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

from moerl.models.precision import PrecisionConfig, ResolvedPrecision
from moerl.trainer.memory_census import WeightWidth


def stand_in_precision(run: PrecisionConfig) -> ResolvedPrecision:
    """The local spec in the run's parameter dtype; `auto` is bf16 where the run would
    take Transformer Engine (on GPUs), else fp32."""
    bf16 = run.params_dtype == "bf16" or (run.params_dtype == "auto"
                                          and run.transformer_impl != "local")
    local = replace(run, transformer_impl="local", fp8=None, fp8_param=False,
                    fp8_bf16_layers_at_start=0, fp8_bf16_layers_at_end=0,
                    offload_activations_layers=0, offload_optimizer=False)
    return ResolvedPrecision(te=False, bf16=bf16, config=local)


def fp8_weight_width(chunks: list[torch.nn.Module]) -> WeightWidth:
    """Bytes per element of each parameter of `chunks` under FP8 primary weights."""
    fp8 = {id(module.weight) for chunk in chunks for name, module in chunk.named_modules()
           if isinstance(module, ColumnParallelLinear | RowParallelLinear)
           and not name.endswith("output_layer")}

    def width(_: str, param: torch.nn.Parameter) -> int:
        return 1 if id(param) in fp8 else param.element_size()

    return width
