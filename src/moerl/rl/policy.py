"""The policy on the Megatron model: logprobs of given sequences, its update, publishing.

    policy = Policy.build(arch, layout, optim, groups, RLConfig(objective="grpo"))
    micro = policy.pack(samples)            # every rank passes the same global batch
    prepared = Prepared(micro, policy.old_logprobs(micro), ref, policy.denominator(micro))
    metrics = policy.update([prepared])     # one optimizer step per Prepared
    path = policy.publish(run_dir / "v1")   # weights for the rollout servers

The policy trains alone: the loop (rl/loop.py `update`, through rl/peers.py) prepares
each minibatch (the policy packs it and computes pi_old, the reference model its
logprobs `ref`), sets the per-token advantages (with a critic, from its values) and then
calls `update`. As the `rl` group (RLConfig) says (objective, token budget, routing
replay): the samples are split over data-parallel ranks and packed into same-shape
micro-batches (data.rl_batch); old logprobs are recomputed with the current weights, or
the rollout's, except the first minibatch's recomputed ones: the weights have not moved
yet, so they are the update's own forward, detached (one forward pass fewer per step);
the global `Denominator` counts loss tokens and sequences over all micro-batches and DP
ranks; the objective runs per micro-batch inside Megatron's pipeline schedule; one
optimizer step per minibatch.

Loss scaling. The model config runs with `calculate_per_token_loss`: the schedule sums the
token counts the loss function returns, `finalize_model_grads` all-reduces that sum over
DP and divides every gradient by it. Each micro-batch here reports its number of loss
tokens n_k (so the divisor is N = Denominator.num_tokens exactly) and back-propagates
N * loss_k, where loss_k is the objective's share of the global-batch loss. The division
then returns the objective's gradient for any aggregation mode. With
`rl.aux_losses` the MoE load-balancing and MTP losses, which Megatron scales
for that divisor, are added with their per-token normalisation (as in LM training).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from moerl.data.rl_batch import RLMicroBatch, RLSample, pack, plan_microbatches
from moerl.models.arch import MoEArch
from moerl.models.build import build_model
from moerl.models.features import resolve_precision
from moerl.models.precision import RecomputeConfig, ResolvedPrecision
from moerl.models.weights import load_weights, save_weights
from moerl.models.whole_weights import holds_whole, save_whole
from moerl.parallel.groups import ParallelGroups
from moerl.parallel.layout import ParallelLayout
from moerl.rl.config import RLConfig
from moerl.rl.forward import ForwardHooks, cp_share, forward_logprobs, run_schedule, token_logprobs
from moerl.rl.losses import Denominator, PolicyLossInputs, build_objective, global_denominator
from moerl.rl.policy_metrics import gap_metrics, gap_report, reduce_reports
from moerl.rl.routing import ExpertLoad, RoutingReplay
from moerl.rl.update_advantages import Prepared
from moerl.trainer.config import OptimConfig
from moerl.trainer.optimizer import Trainable, build_optimizer

LogprobPair = tuple[torch.Tensor, torch.Tensor]  # (logprobs, entropy), each (B, T)


class Policy:
    """The trained model, its optimizer, and its update."""

    def __init__(
        self,
        trainable: Trainable,
        arch: MoEArch,
        groups: ParallelGroups,
        cfg: RLConfig | None = None,
    ) -> None:
        config = trainable.model[0].config
        if not config.calculate_per_token_loss:
            raise ValueError("Policy needs a model config with calculate_per_token_loss=True")
        self.trainable, self.arch, self.groups = trainable, arch, groups
        self.cfg = cfg or RLConfig()
        self.objective = build_objective(self.cfg.objective, self.cfg.objective_args)
        chunks: list[torch.nn.Module] = list(trainable.model)
        self.load = ExpertLoad(chunks, arch)
        self.replay = RoutingReplay(chunks, arch) if self.cfg.routing_replay else None

    @classmethod
    def build(
        cls,
        arch: MoEArch,
        layout: ParallelLayout,
        optim: OptimConfig,
        groups: ParallelGroups,
        cfg: RLConfig | None = None,
        weights: str | Path | None = None,
        precision: ResolvedPrecision | None = None,
        recompute: RecomputeConfig | None = None,
    ) -> Policy:
        """Model (from `weights` if given) and optimizer. `precision`: the run's,
        resolved (None: this machine's default)."""
        precision = precision or resolve_precision()
        chunks = build_model(arch, layout, precision=precision, recompute=recompute,
                             backend=groups.backend)
        if weights is not None:
            load_weights(list(chunks), weights)
        trainable = build_optimizer(chunks, optim, layout,
                                    offload=precision.config.offload_optimizer)
        return cls(trainable, arch, groups, cfg)

    @property
    def cp_group(self) -> dist.ProcessGroup | None:
        return self.groups.cp_group if self.groups.layout.cp > 1 else None

    @property
    def chunks(self) -> list[torch.nn.Module]:
        return list(self.trainable.model)

    def pack(self, samples: Sequence[RLSample]) -> list[RLMicroBatch]:
        """This rank's share of `samples` as same-shape micro-batches."""
        layout = self.groups.layout
        plan = plan_microbatches(samples, self.cfg.token_budget, layout.dp,
                                 layout.sequence_multiple())
        return pack(samples, plan, self.groups.dp_rank)

    def logprobs(self, micro: Sequence[RLMicroBatch]) -> list[LogprobPair]:
        """Per-token (logprobs, entropy) of the policy, on every rank (forward only)."""
        return forward_logprobs(
            self.chunks, micro, tp_group=self.groups.tp_group, device=self.groups.device,
            hooks=ForwardHooks(replay=self.replay), cp_group=self.cp_group,
        )

    def old_logprobs(self, micro: Sequence[RLMicroBatch], first: bool = True
                     ) -> list[torch.Tensor] | None:
        """pi_old of `micro`: recomputed with the current weights, or the rollout's
        (`rl.recompute_old_logprobs`). `first`: the step's first minibatch, trained
        before any weight moves, whose recomputed pi_old is the update's own forward
        (None)."""
        if self.cfg.recompute_old_logprobs:
            return None if first else [lp for lp, _ in self.logprobs(micro)]
        if any(mb.rollout_logprobs is None for mb in micro):
            raise ValueError("recompute_old_logprobs=False needs rollout logprobs")
        return [mb.rollout_logprobs for mb in micro]  # type: ignore[misc]

    def denominator(self, micro: Sequence[RLMicroBatch]) -> Denominator:
        """The loss tokens and sequences of `micro` over every data-parallel rank."""
        return global_denominator([mb.loss_mask for mb in micro],
                                  self.cfg.objective_args.norm_len, group=self.groups.dp_group)

    def update(self, prepared: Sequence[Prepared]) -> dict[str, float]:
        """One optimizer step per prepared minibatch, in order (their micro-batches carry
        the per-token advantages). Metrics are averaged over the steps (maxima: the
        largest)."""
        return _average([self._step(p) for p in prepared])

    def _step(self, p: Prepared) -> dict[str, float]:
        reports = self.forward_backward(p)
        ok, grad_norm, _ = self.trainable.optimizer.step()
        if ok:
            self.trainable.scheduler.step(increment=1)
        metrics = gap_metrics(reduce_reports(reports, self.groups.dp_group))
        metrics.update(self.load.metrics())
        metrics.update(
            grad_norm=float(grad_norm) if grad_norm is not None else float("nan"),
            lr=float(self.trainable.optimizer.param_groups[0]["lr"]),
            tokens=p.denom.num_tokens,
            sequences=p.denom.num_seqs,
            skipped=float(not ok),
        )
        return metrics

    def forward_backward(self, p: Prepared) -> list[dict[str, Any]]:
        """Zero the grads, run the objective over the micro-batches; grads are then final.

        Returns the per-micro-batch metric reports (last pipeline stage only).
        """
        for chunk in self.trainable.model:
            chunk.zero_grad_buffer()
        self.trainable.optimizer.zero_grad()
        self.load.reset()
        device, tp_group = self.groups.device, self.groups.tp_group
        entropy_grad = self.cfg.objective_args.entropy_coef > 0

        def on_logits(
            k: int, mb: RLMicroBatch, logits: torch.Tensor
        ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
            lp, ent = token_logprobs(logits, mb, tp_group, self.cp_group)
            mask = mb.loss_mask.to(device)
            old = lp.detach() if p.old is None else p.old[k].to(device)
            inputs = PolicyLossInputs(
                logprobs=lp,
                old_logprobs=old,
                advantages=mb.advantages.to(device),
                loss_mask=mask,
                rollout_logprobs=_to(mb.rollout_logprobs, device),
                ref_logprobs=_to(p.ref[k], device) if p.ref is not None else None,
                entropy=ent if entropy_grad else ent.detach(),
                token_versions=_to(mb.token_versions, device),
            )
            loss, metrics = self.objective(inputs, p.denom)
            # See the module docstring: Megatron divides by the counts summed over DP x CP,
            # N; each CP rank counts the loss tokens it holds.
            count = cp_share(mb, self.cp_group).loss_mask.sum().to(torch.int).cpu()
            report = {name: v.detach().float() for name, v in metrics.items()}
            if mb.rollout_logprobs is not None:  # pack(): on every rank or on none
                # the trainer's side: pi_old, or (old = rollout's) this forward's own
                trainer = old if self.cfg.recompute_old_logprobs else lp.detach()
                report.update(gap_report(mb.rollout_logprobs, trainer, mb.loss_mask))
            return loss * p.denom.num_tokens, count, report

        hooks = ForwardHooks(replay=self.replay, load=self.load)
        with _aux_losses(self.trainable.model[0].config, self.cfg.aux_losses):
            # Without the MTP loss (rl.aux_losses=false) its layers would only add zeros.
            return run_schedule(self.chunks, p.micro, on_logits, forward_only=False,
                                device=device, hooks=hooks, cp_group=self.cp_group,
                                mtp=self.cfg.aux_losses)

    def publish(self, directory: str | Path) -> Path:
        """Write the current weights for the rollout servers (every rank calls it): one
        file from global rank 0 when every rank holds the whole model, else every rank
        its shards (`models.weights`); `load_weights` reads either under any layout."""
        if not holds_whole(self.groups.layout):
            return save_weights(self.chunks, directory)
        if self.groups.rank == 0:
            save_whole(self.chunks, directory)
        if dist.is_initialized():
            dist.barrier()  # the file is complete before any rank returns its path
        return Path(directory)


@contextmanager
def _aux_losses(config: Any, keep: bool) -> Iterator[None]:
    """Zero the load-balancing and MTP loss coefficients for the duration (both are read
    from the shared model config at every forward)."""
    saved = (config.moe_aux_loss_coeff, config.mtp_loss_scaling_factor)
    if not keep:
        config.moe_aux_loss_coeff, config.mtp_loss_scaling_factor = 0.0, 0.0
    try:
        yield
    finally:
        config.moe_aux_loss_coeff, config.mtp_loss_scaling_factor = saved


def _to(t: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    return None if t is None else t.to(device)


def _average(steps: list[dict[str, float]]) -> dict[str, float]:
    if len(steps) == 1:
        return steps[0]
    out: dict[str, float] = {}
    for key in steps[0]:
        values = [s[key] for s in steps if key in s]
        top = key.endswith(("_max", "/max_abs"))
        out[key] = max(values) if top else sum(values) / len(values)
    out["optimizer_steps"] = float(len(steps))
    return out

