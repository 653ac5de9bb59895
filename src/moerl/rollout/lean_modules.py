"""Megatron's linear layers and MLPs computed from their own weights, without their wrappers.

A Megatron `ColumnParallelLinear` / `RowParallelLinear` forward runs an autograd
function, autocast checks and group look-ups around one matmul: on a CPU serving a small
model that is most of a decode step. In inference, with no sequence parallelism and no
bias, the same result is `F.linear` on the layer's weight (this rank's shard), plus the
tensor-parallel sum a row-parallel layer makes (not for experts: their dispatcher
combines). Anything else (Transformer Engine's layers, biases, sequence parallelism)
goes through the module itself. Weights are read at every call, so an update needs no
refresh.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region
from megatron.core.transformer.identity_op import IdentityOp


def project(module: Any, x: torch.Tensor) -> torch.Tensor:
    """A Megatron linear's (or MLP's) output with its bias added (it returns (out, bias))."""
    out, bias = module(x)
    return out if bias is None else out + bias


def norm(module: Any, x: torch.Tensor) -> torch.Tensor:
    """`module(x)` for a norm: torch's RMSNorm (the local spec's) by `torch.rms_norm`,
    identities skipped, anything else called."""
    kind = type(module)
    if kind is torch.nn.RMSNorm:
        return torch.rms_norm(x, module.normalized_shape, module.weight, module.eps)
    if kind is IdentityOp:
        return x
    return module(x)


def _plain(module: Any) -> bool:
    kind = type(module)
    if kind is ColumnParallelLinear:
        return module.bias is None and not module.gather_output and not module.sequence_parallel
    if kind is RowParallelLinear:
        return module.bias is None and not module.sequence_parallel
    return False


def linear(module: Any, x: torch.Tensor) -> torch.Tensor:
    """`project(module, x)`, by `F.linear` where the module is a plain Megatron linear."""
    if not _plain(module):
        return project(module, x)
    out = F.linear(x, module.weight)
    if type(module) is RowParallelLinear and not module.explicit_expert_comm \
            and module.tp_group.size() > 1:
        out = reduce_from_tensor_model_parallel_region(out, group=module.tp_group)
    return out


class LeanMLP:
    """An `MLP` (dense layer, routed or shared expert) on its own weights:
    fc2(act(fc1 x) * scale), Megatron's order (the routing weight scales the activation)."""

    def __init__(self, mlp: Any) -> None:
        self.mlp = mlp
        config = mlp.config
        self.gated = config.gated_linear_unit
        self.activation = config.activation_func
        self.clamp = getattr(config, "activation_func_clamp_value", None)
        self.offset = getattr(config, "glu_linear_offset", 0.0)
        self.fast = (_plain(mlp.linear_fc1) and _plain(mlp.linear_fc2)
                     and not getattr(config, "use_te_activation_func", False)
                     and _standard_mlp(mlp))

    def __call__(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., H] -> [..., H]; `scale` [N] multiplies each token's activation."""
        if not self.fast:
            return project(self.mlp, x) if scale is None else self.mlp(x, scale)[0]
        hidden = linear(self.mlp.linear_fc1, x)
        if self.gated:
            gate, up = torch.chunk(hidden, 2, dim=-1)
            if self.clamp is not None:
                gate = gate.clamp(max=self.clamp)
                up = up.clamp(min=-self.clamp, max=self.clamp)
            hidden = self.activation(gate) * (up + self.offset if self.offset else up)
        else:
            hidden = self.activation(hidden)
        if scale is not None:
            hidden = (hidden * scale.unsqueeze(-1)).to(hidden.dtype)
        return linear(self.mlp.linear_fc2, hidden)


def _standard_mlp(mlp: Any) -> bool:
    """Megatron's `MLP`, or a shared expert without a gate (which computes the same); any
    other subclass is computed by the module."""
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.moe.shared_experts import SharedExpertMLP

    if type(mlp) is SharedExpertMLP:
        return not mlp.use_shared_expert_gate
    return type(mlp) is MLP
