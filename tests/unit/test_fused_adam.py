"""Torch's fused Adam inside Megatron's optimizer: switched on where torch's AdamW is
what Megatron built, and the same update as the per-tensor loop it replaces."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from moerl.models.arch import TINY
from moerl.models.build import build_model
from moerl.parallel.layout import ParallelLayout
from moerl.trainer.config import OptimConfig
from moerl.trainer.optimizer import Trainable, build_optimizer, torch_optimizers

if TYPE_CHECKING:
    from moerl.parallel.groups import ParallelGroups

ARCH = TINY.replace(num_layers=2, mtp_num_layers=0)


def _trainable(distributed: bool, fused: bool) -> Trainable:
    layout = ParallelLayout(use_distributed_optimizer=distributed)
    trainable = build_optimizer(build_model(ARCH, layout), OptimConfig(lr=1e-2, warmup_steps=0),
                                layout)
    if not fused:
        for torch_opt in torch_optimizers(trainable.optimizer):
            for group in torch_opt.param_groups:
                group["fused"] = None
    return trainable


def _steps(trainable: Trainable, start: dict[str, torch.Tensor], steps: int) -> None:
    """Load `start`, then `steps` optimizer steps on the same made-up gradients."""
    module = trainable.model[0].module
    module.load_state_dict(start, strict=False)
    for chunk in trainable.model:
        chunk.broadcast_params()
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        for chunk in trainable.model:
            chunk.zero_grad_buffer()
        for param in module.parameters():
            param.main_grad.copy_(torch.randn(param.shape, generator=gen) * 1e-2)
        ok, _, _ = trainable.optimizer.step()
        assert ok


def test_every_adam_group_is_fused(single_process: ParallelGroups) -> None:
    for distributed in (True, False):
        trainable = _trainable(distributed, fused=True)
        groups = [g for opt in torch_optimizers(trainable.optimizer) for g in opt.param_groups]
        assert groups and all(g["fused"] is True for g in groups)


def test_fused_update_equals_the_per_tensor_loop(single_process: ParallelGroups) -> None:
    for distributed in (True, False):
        fused, loop = _trainable(distributed, fused=True), _trainable(distributed, fused=False)
        start = {k: v.clone() for k, v in loop.model[0].module.state_dict().items()
                 if isinstance(v, torch.Tensor)}
        _steps(fused, start, steps=3)
        _steps(loop, start, steps=3)
        moved = 0
        for (name, a), (_, b) in zip(fused.model[0].module.named_parameters(),
                                     loop.model[0].module.named_parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
            moved += int(not torch.equal(a, start[name]))
        assert moved > 0  # the steps did move the weights
