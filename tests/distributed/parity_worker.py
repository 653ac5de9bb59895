"""One parity run: load the shared tiny weights under a layout, take two optimizer steps.

Run under torchrun (or as one plain process); rank 0 writes JSON to --out.

- reference (one process, `--save --record DIR`): builds the model from a seed and
  writes it with dist_checkpointing (torch_dist), so every layout starts from exactly
  these weights, resharded on load; then trains and writes under DIR the whole
  gradient of every parameter at steps 1 and 2 (as layout-free weights checkpoints)
  and the weights and expert biases after step 2.
- layout (`--against DIR`): the same run, then every rank compares its shards of those
  gradients and weights with DIR's (`parity_checks.compare_with_checkpoint`).
- `--inject BUG`: one deliberate bug of `INJECTIONS`, for the tests that show the
  comparison catches it.

Both record the smallest top-k routing margin seen (`parity_checks.RoutingMargins`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.transformer.moe import moe_logging

sys.path.insert(0, str(Path(__file__).parent))
from parity_checks import (
    PARITY_OPTIM,
    RoutingMargins,
    compare_with_checkpoint,
    own_state,
    record_gradients,
    save_as_weights,
)

from moerl.data.synthetic import Batch, SyntheticCorpus
from moerl.models.arch import TINY
from moerl.models.build import build_model
from moerl.models.weights import load_weights, save_weights
from moerl.parallel.groups import ParallelGroups, destroy_parallel, init_parallel
from moerl.parallel.layout import ParallelLayout
from moerl.trainer.lm import batch_iterators
from moerl.trainer.optimizer import build_optimizer
from moerl.trainer.step import LossFn, lm_loss, train_step

GLOBAL_BATCH, MICRO_BATCH, SEQ_LENGTH, STEPS = 8, 2, 32, 2
INJECTIONS = ("rope_key_grad", "local_token_mean", "expert_bias_local")
# Under context parallelism Megatron scales the MTP loss by each rank's own token counts
# (loss tokens / loss tokens after the shift, per CP rank), not the whole sequence's:
# CP layouts are compared like for like, without MTP.
ARCHS = {"tiny": TINY, "tiny_no_mtp": TINY.replace(mtp_num_layers=0)}
# The corpus seed: its reference run decides every top-k routing choice by a margin of
# at least 4.6e-5 with MTP, 5.9e-5 without (parity_checks.MARGIN_FLOOR).
CORPUS_SEED = 5


@dataclasses.dataclass(frozen=True)
class PromptMaskedCorpus(SyntheticCorpus):
    """The synthetic corpus with the first (7 i) mod 11 labels of sample i masked out,
    like a prompt: micro-batches and data-parallel ranks get different numbers of loss
    tokens, as real batches do, so a loss normalised per rank is not the global mean."""

    def batch(self, first: int, size: int) -> Batch:
        batch = super().batch(first, size)
        mask = batch.loss_mask.clone()
        for i in range(size):
            mask[i, : (7 * (first + i)) % 11] = 0
        return dataclasses.replace(batch, loss_mask=mask)


def inject_model_bug(bug: str | None) -> None:
    """Bugs in the model or the update, installed before the model is built."""
    if bug == "rope_key_grad":
        # Megatron's own MLA at TP > 1 on the local spec: each rank keeps only its heads'
        # share of the shared RoPE key's gradient (about half at TP2).
        from moerl.models import build
        from moerl.models.mla_local import MLADotProductAttention

        def core_attention_only(layer: Any) -> None:
            layer.submodules.self_attention.submodules.core_attention = MLADotProductAttention

        build._patch_local_mla = core_attention_only
    elif bug == "expert_bias_local":
        # The router's bias follows this rank's own token counts, not the global ones.
        import importlib

        # (the package's `finalize_model_grads` is the function; this is its module)
        finalize = importlib.import_module("megatron.core.distributed.finalize_model_grads")

        def local_update(tokens: torch.Tensor, bias: torch.Tensor, rate: float,
                         tp_dp_cp_group: Any = None) -> torch.Tensor:
            average = tokens.sum(dim=-1, keepdim=True) / tokens.shape[-1]
            return bias + torch.sign(average - tokens) * rate

        finalize.get_updated_expert_bias = local_update  # type: ignore[attr-defined]


def loss_function(bug: str | None, corpus: SyntheticCorpus, step: int,
                  groups: ParallelGroups) -> LossFn:
    """The LM loss; with "local_token_mean" each data-parallel rank's loss is its mean
    over its own tokens, averaged over ranks (the same in one process)."""
    if bug != "local_token_mean":
        return lm_loss
    first, dp = step * GLOBAL_BATCH, groups.layout.dp
    masks = corpus.batch(first, GLOBAL_BATCH).loss_mask
    per_rank = GLOBAL_BATCH // dp
    factor = float(masks.sum()) / (dp * float(masks[groups.dp_rank * per_rank:][:per_rank].sum()))

    def local_mean(per_token: torch.Tensor, batch: Batch) -> Any:
        loss_sum, tokens, report = lm_loss(per_token, batch)
        return loss_sum * factor, tokens, report

    return local_mean


def latent_norm_count(model: list[Any]) -> int:
    """MLA q/kv latent-norm weights this rank holds (compared like every parameter)."""
    return sum(name.endswith(("q_layernorm.weight", "kv_layernorm.weight"))
               for chunk in model for name, _ in chunk.named_parameters())


def run(args: argparse.Namespace, layout: ParallelLayout) -> dict[str, Any]:
    groups = init_parallel(layout, seed=1234)
    arch = ARCHS[args.arch]
    layout.check(arch, groups.world_size, groups.backend)
    if args.save:
        save_weights(build_model(arch, layout), args.ckpt)
        moe_logging.destroy_moe_metrics_tracker()
    inject_model_bug(args.inject)
    torch.manual_seed(99)  # the loaded weights must not depend on this
    chunks = build_model(arch, layout)
    load_weights(chunks, args.ckpt)  # resharded from the single-process save
    trainable = build_optimizer(chunks, PARITY_OPTIM, layout)
    model = list(trainable.model)
    grads = record_gradients(trainable.optimizer, model)
    margins = RoutingMargins()
    margins.install()
    corpus = PromptMaskedCorpus(arch.vocab_size, SEQ_LENGTH, seed=CORPUS_SEED)
    losses, norms = [], []
    for step in range(STEPS):
        metrics = train_step(
            model,
            trainable.optimizer,
            batch_iterators(corpus, step, groups, GLOBAL_BATCH, MICRO_BATCH),
            num_microbatches=GLOBAL_BATCH // (MICRO_BATCH * layout.dp),
            micro_batch_size=MICRO_BATCH,
            seq_length=SEQ_LENGTH,
            loss_fn=loss_function(args.inject, corpus, step, groups),
            scheduler=trainable.scheduler,
        )
        losses.append(metrics.loss)
        norms.append(metrics.grad_norm)
    result: dict[str, Any] = {"layout": layout.describe(), "losses": losses,
                              "grad_norms": norms, "margin": margins.global_smallest(),
                              "latent_norms": latent_norm_count(model)}
    if args.record:
        for step, tensors in enumerate(grads, start=1):
            save_as_weights(model, tensors, args.record / f"grads{step}")
        save_weights(model, args.record / f"state{STEPS}")
    if args.against:
        checks = {f"grads{step}": (args.against / f"grads{step}", tensors)
                  for step, tensors in enumerate(grads, start=1)}
        checks[f"state{STEPS}"] = (args.against / f"state{STEPS}", own_state(model))
        result["checks"] = {name: compare_with_checkpoint(model, directory, own)
                            for name, (directory, own) in checks.items()}
    dist.barrier()
    result["rank"] = groups.rank
    destroy_parallel()
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt", type=Path, required=True, help="initial weights")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layout", default="{}", help="JSON of ParallelLayout degrees")
    parser.add_argument("--save", action="store_true", help="build and write --ckpt first")
    parser.add_argument("--record", type=Path, help="write gradients and weights here")
    parser.add_argument("--against", type=Path, help="compare with a --record directory")
    parser.add_argument("--inject", choices=INJECTIONS)
    parser.add_argument("--arch", choices=list(ARCHS), default="tiny")
    args = parser.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    layout = ParallelLayout.for_world(world, **json.loads(args.layout))
    result = run(args, layout)
    if result["rank"] == 0:
        args.out.write_text(json.dumps(result))


if __name__ == "__main__":  # dist_checkpointing's save starts a multiprocessing Manager
    main()
