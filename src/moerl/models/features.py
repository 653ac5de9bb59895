"""What this machine offers a model, asked without importing Megatron.

The launcher checks a layout at start-up with these answers, before it pays for
Megatron's import (`models.build` uses the same answers to pick the layer spec).
"""

from __future__ import annotations

import importlib.util

from moerl.models.precision import PrecisionConfig, ResolvedPrecision


def te_available() -> bool:
    """Transformer Engine importable and a GPU present (TE has no CPU path)."""
    import torch

    return torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None


def resolve_precision(config: PrecisionConfig | None = None) -> ResolvedPrecision:
    """The run's precision decided for this machine; refused here, naming the field,
    when it asks for what the machine lacks (a GPU, Transformer Engine)."""
    import torch

    return (config or PrecisionConfig()).resolve(te_available=te_available(),
                                                 cuda=torch.cuda.is_available())
