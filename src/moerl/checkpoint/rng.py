"""Random number generator states of one rank, as JSON.

Python's `random`, numpy's global generator, torch's CPU generator and, on GPU,
every CUDA generator plus Megatron's tracker (its named states give tensor-parallel
ranks different dropout). Restoring them makes any later randomness (dropout,
sampling, shuffles) continue as if the run had never stopped.
"""

from __future__ import annotations

import base64
import random
from typing import Any

import numpy as np
import torch

from moerl.checkpoint.config import CheckpointError


def _encode(state: torch.Tensor) -> str:
    return base64.b64encode(state.cpu().numpy().tobytes()).decode()


def _decode(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def capture_rng() -> dict[str, Any]:
    """This rank's generators as a JSON-able dict."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "python": [version, list(internal), gauss],
        "numpy": [kind, [int(k) for k in keys], int(pos), int(has_gauss), float(cached)],
        "torch": _encode(torch.get_rng_state()),
    }
    if torch.cuda.is_available():
        from megatron.core import tensor_parallel

        state["cuda"] = [_encode(s) for s in torch.cuda.get_rng_state_all()]
        tracker = tensor_parallel.get_cuda_rng_tracker().get_states()
        state["megatron_tracker"] = {name: _encode(s) for name, s in tracker.items()}
    return state


def restore_rng(state: dict[str, Any]) -> None:
    try:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
        torch.set_rng_state(_decode(state["torch"]))
    except (KeyError, TypeError, ValueError) as err:
        raise CheckpointError(f"RNG state unreadable: {err!r}") from err
    if torch.cuda.is_available():
        if "cuda" not in state:
            raise CheckpointError(
                "the checkpoint was written without a GPU and holds no CUDA RNG state; "
                "a GPU run cannot continue its random streams exactly"
            )
        from megatron.core import tensor_parallel

        torch.cuda.set_rng_state_all([_decode(s) for s in state["cuda"]])
        tracker = {k: _decode(v) for k, v in state["megatron_tracker"].items()}
        tensor_parallel.get_cuda_rng_tracker().set_states(tracker)
