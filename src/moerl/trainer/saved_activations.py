"""Measuring activation memory on any device: the storages autograd saves in a pass.

    with counting_saved_activations(trainable) as saved:
        train_step(...)
    activation_bytes = saved.total

What the memory model (`planning.memory`, `planning.activations`) predicts as
activations is what autograd keeps for the backward pass; counting the unique
storages handed to `saved_tensors_hooks`, minus the parameters and the gradient
buffers, measures exactly that, on CPU as on GPU.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from moerl.trainer.optimizer import Trainable


class SavedBytes:
    """Sums the unique storages autograd saves, skipping those in `exclude`.

    Saved tensors are kept referenced until the count is read, so a freed
    storage's address cannot be reused by a later tensor and hide it.
    """

    def __init__(self, exclude: set[int]) -> None:
        self.exclude = exclude
        self.seen: dict[int, torch.Tensor] = {}

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        ptr = tensor.untyped_storage().data_ptr()
        if ptr not in self.exclude and ptr not in self.seen:
            self.seen[ptr] = tensor
        return tensor

    @property
    def total(self) -> int:
        return sum(t.untyped_storage().nbytes() for t in self.seen.values())


def model_storages(trainable: Trainable) -> set[int]:
    """Storage addresses of the parameters and of Megatron's DDP gradient buffers."""
    found = {p.untyped_storage().data_ptr() for c in trainable.model for p in c.parameters()}
    found |= {buf.grad_data.untyped_storage().data_ptr() for c in trainable.model
              for buf in c.buffers + c.expert_parallel_buffers}
    return found


@contextmanager
def counting_saved_activations(trainable: Trainable) -> Iterator[SavedBytes]:
    """Count what autograd saves inside the block; the parameters and gradient
    buffers of `trainable` are not activations. Read `.total`, then drop the result
    (it keeps the saved tensors alive)."""
    saved = SavedBytes(model_storages(trainable))
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
        yield saved
