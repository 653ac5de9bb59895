"""The critic of PPO with GAE: a value model on Megatron-Core, its optimizer, its update.

    critic = Critic.build(arch, layout, optim, groups, CriticConfig(), init_from=policy.chunks)
    values = critic.values(micro)                          # V_old (B, T) per micro-batch
    metrics = critic.update(micro, values, returns, denom)  # one optimizer step

The value model (`models.value`) runs the policy's micro-batches through the same
pipeline schedule (`rl.forward.run_schedule`) in the same layout. Its value at position
t reads tokens[: t + 1], the state in which labels[t] is chosen, so values line up with
the policy's logprobs and loss mask. It starts from the policy's weights (its trunk; the
head is zero unless `head_init_std` > 0) or, for another architecture, from the seed.

One update is one optimizer step on the clipped value loss (rl/losses/value.py) over
the micro-batches of one minibatch. Loss scaling is the policy's (see rl/policy.py):
the model config has `calculate_per_token_loss`, each micro-batch reports its loss
tokens n_k and back-propagates N * loss_k, and `finalize_model_grads` divides the
gradients by N summed over data-parallel ranks. Under context parallelism each rank
computes its share of every row and the values are gathered back, as logprobs are.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from moerl.data.rl_batch import RLMicroBatch
from moerl.models.arch import MoEArch
from moerl.models.features import resolve_precision
from moerl.models.precision import RecomputeConfig, ResolvedPrecision
from moerl.models.value import build_value_model
from moerl.models.weights import unwrap_model
from moerl.parallel.context import gather_from_cp
from moerl.parallel.groups import ParallelGroups
from moerl.parallel.layout import ParallelLayout
from moerl.rl.critic_config import CriticConfig
from moerl.rl.forward import broadcast_from_last_stage, cp_share, run_schedule
from moerl.rl.losses import Denominator
from moerl.rl.losses.value import clipped_value_loss
from moerl.rl.policy_metrics import reduce_reports
from moerl.trainer.config import OptimConfig
from moerl.trainer.optimizer import Trainable, build_optimizer


class Critic:
    """The value model, its optimizer and LR schedule, and its update."""

    def __init__(self, trainable: Trainable, arch: MoEArch, groups: ParallelGroups,
                 cfg: CriticConfig) -> None:
        if not trainable.model[0].config.calculate_per_token_loss:
            raise ValueError("Critic needs a model config with calculate_per_token_loss=True")
        self.trainable, self.arch, self.groups, self.cfg = trainable, arch, groups, cfg

    @classmethod
    def build(
        cls,
        arch: MoEArch,
        layout: ParallelLayout,
        optim: OptimConfig,
        groups: ParallelGroups,
        cfg: CriticConfig,
        init_from: Sequence[torch.nn.Module] | None = None,
        seed: int = 0,
        precision: ResolvedPrecision | None = None,
        recompute: RecomputeConfig | None = None,
    ) -> Critic:
        """`arch` and `optim`: the policy's (`cfg` replaces fields of both). `init_from`:
        the policy's chunks, whose trunk weights the critic starts from when
        `cfg.init_from_policy`. `seed` draws the head when `cfg.head_init_std` > 0.
        `precision`: the run's, resolved (None: this machine's default, as the policy's)."""
        critic_arch = cfg.arch(arch)
        layout.check(critic_arch, groups.world_size, groups.backend)
        precision = precision or resolve_precision()
        chunks = build_value_model(critic_arch, layout, precision=precision,
                                   recompute=recompute, backend=groups.backend,
                                   head_init_std=cfg.head_init_std, head_seed=seed)
        if cfg.init_from_policy:
            if init_from is None:
                raise ValueError("rl.critic.init_from_policy: give the policy's chunks")
            copy_trunk(list(chunks), list(init_from))
        trainable = build_optimizer(list(chunks), cfg.optim(optim), layout,
                                    offload=precision.config.offload_optimizer)
        return cls(trainable, critic_arch, groups, cfg)

    @property
    def chunks(self) -> list[torch.nn.Module]:
        return list(self.trainable.model)

    @property
    def cp_group(self) -> dist.ProcessGroup | None:
        return self.groups.cp_group if self.groups.layout.cp > 1 else None

    def values(self, micro: Sequence[RLMicroBatch]) -> list[torch.Tensor]:
        """V (B, T) on the CPU per micro-batch, on every rank (forward only)."""
        device, cp_group = self.groups.device, self.cp_group

        def on_values(k: int, mb: RLMicroBatch, out: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
            zero = torch.zeros((), device=device)
            return zero, torch.zeros((), dtype=torch.int), {"v": gather_from_cp(out, cp_group)}

        for c in self.chunks:
            c.eval()
        try:
            with torch.no_grad():
                reports = run_schedule(self.chunks, micro, on_values, forward_only=True,
                                       device=device, cp_group=cp_group)
        finally:
            for c in self.chunks:
                c.train()
        b, t = micro[0].shape
        stacked = torch.zeros(len(micro), b, t, dtype=torch.float32, device=device)
        for k, r in enumerate(reports):
            stacked[k] = r["v"]
        return [v.cpu() for v in broadcast_from_last_stage(stacked)]

    def update(self, micro: Sequence[RLMicroBatch], old_values: Sequence[torch.Tensor],
               returns: Sequence[torch.Tensor], denom: Denominator) -> dict[str, float]:
        """One optimizer step on the value loss of `micro` (targets `returns`, clip window
        around `old_values`, all (B, T) per micro-batch; `denom` the global counts)."""
        reports = self.forward_backward(micro, old_values, returns, denom)
        ok, grad_norm, _ = self.trainable.optimizer.step()
        if ok:
            self.trainable.scheduler.step(increment=1)
        metrics = reduce_reports(reports, self.groups.dp_group)
        metrics.update(
            critic_grad_norm=float(grad_norm) if grad_norm is not None else float("nan"),
            critic_lr=float(self.trainable.optimizer.param_groups[0]["lr"]),
            critic_skipped=float(not ok),
        )
        return metrics

    def forward_backward(self, micro: Sequence[RLMicroBatch], old_values: Sequence[torch.Tensor],
                         returns: Sequence[torch.Tensor], denom: Denominator
                         ) -> list[dict[str, Any]]:
        """Zero the grads and back-propagate the value loss; the grads are then final.
        The per-micro-batch metric reports (last pipeline stage only)."""
        for chunk in self.trainable.model:
            chunk.zero_grad_buffer()
        self.trainable.optimizer.zero_grad()
        device, cp_group = self.groups.device, self.cp_group

        def on_values(k: int, mb: RLMicroBatch, out: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
            v = gather_from_cp(out, cp_group)  # (B, T): whole rows on every CP rank
            loss, metrics = clipped_value_loss(
                v, old_values[k].to(device), returns[k].to(device), mb.loss_mask.to(device),
                self.cfg.value_clip, denom)
            # Megatron divides by the loss tokens summed over DP x CP (policy.py).
            count = cp_share(mb, cp_group).loss_mask.sum().to(torch.int).cpu()
            report = {name: m.detach().float() for name, m in metrics.items()}
            return loss * denom.num_tokens, count, report

        return run_schedule(self.chunks, micro, on_values, forward_only=False, device=device,
                            cp_group=cp_group)


def copy_trunk(critic: list[torch.nn.Module], policy: list[torch.nn.Module]) -> None:
    """Load the policy chunks' weights into the critic's (same layout), all but the head.

    The policy's output layer and MTP layers have no place in the critic; every other
    tensor of the critic must come from the policy."""
    for dst, src in zip(critic, policy, strict=True):
        dst_module, theirs = unwrap_model(dst), unwrap_model(src).state_dict()
        own = dst_module.state_dict()
        missing = [k for k in own if k not in theirs and not k.startswith("value_head.")]
        if missing:
            raise ValueError(f"the critic's {missing[0]} has no counterpart in the policy; "
                             "set rl.critic.init_from_policy=false")
        dst_module.load_state_dict({k: theirs.get(k, v) for k, v in own.items()}, strict=True)
