"""What this machine offers a model, asked without importing Megatron.

The launcher checks a layout at start-up with these answers, before it pays for
Megatron's import (`models.build` uses the same answers to pick the layer spec).
"""

from __future__ import annotations

import importlib.util


def te_available() -> bool:
    """Transformer Engine importable and a GPU present (TE has no CPU path)."""
    import torch

    return torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None
