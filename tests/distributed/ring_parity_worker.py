"""Ring-attention parity worker: run as one process or under torchrun (gloo).

Modes (rank 0 writes JSON to --out):

- attention: `ring_attention` on each rank's share against causal attention over the
  whole sequence in one process, outputs and input gradients, for standard and
  MLA-shaped heads, with and without packed documents.
- model: the tiny MoE (MLA, or a GQA variant) loaded from --ckpt (written first with
  --save) under --layout, 3 Adam steps (`parity_checks.PARITY_OPTIM`) on the synthetic
  corpus; the losses, gradient norms and smallest top-k routing margin, and the first
  step's gradient of every parameter written, whatever the layout, as a layout-free
  weights checkpoint (--grads) by `parity_checks.save_gradients`.
- model --documents packed|split: one step on packed rows of several documents each
  (document boundaries through `Batch.cu_seqlens`), or on the same documents one per
  row (padded); the loss and gradients must agree, the split run being plain
  single-process attention with no packing at all.
- compare: one process loads two such gradient checkpoints into the single-process
  model and reports the largest difference per parameter.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))

# name -> (qk head dim, v head dim, heads, cu_seqlens as a list or None); T = 16, b = 2
CASES: dict[str, tuple[int, int, int, Any]] = {
    "standard": (8, 8, 4, None),
    "mla": (12, 8, 2, None),
    "standard_packed": (8, 8, 4, [0, 3, 9, 16]),
    "mla_packed_per_row": (12, 8, 2, [[0, 5, 11, 16], [0, 7, 16, 16]]),
}
SEQ_LENGTH, GLOBAL_BATCH, MICRO_BATCH, STEPS = 32, 8, 2, 3
# The model runs' corpus seed: with it both references decide every top-k routing choice
# by more than 1.6e-5 (parity_checks.MARGIN_FLOOR); with 7 a GQA choice was within 6.6e-7.
CORPUS_SEED = 2
# Packed rows of SEQ_LENGTH tokens: the lengths of their documents.
PACKED_ROWS = ((5, 11, 16), (9, 7, 10, 6), (32,), (3, 13, 8, 8))


def _attention_case(case: tuple[int, int, int, Any], group: Any) -> dict[str, float]:
    from moerl.models.ring_attention import ring_attention
    from moerl.parallel.context import document_ids, gather_from_cp, split_for_cp_rank

    dk, dv, heads, cu_list = case
    seq, batch = 16, 2
    gen = torch.Generator().manual_seed(dk * 100 + heads + (0 if cu_list is None else 7))
    full = [torch.randn(seq, batch, heads, d, generator=gen) for d in (dk, dk, dv)]
    grad_out = torch.randn(seq, batch, heads, dv, generator=gen)
    cu = None if cu_list is None else torch.tensor(cu_list)
    scale = 1 / math.sqrt(dk)

    # Reference: one process, the whole sequence, plain causal (+ document) mask.
    ref_in = [t.clone().requires_grad_() for t in full]
    q, k, v = (t.permute(1, 2, 0, 3) for t in ref_in)  # [b, h, s, d]
    allowed = torch.ones(seq, seq).tril().bool().expand(batch, 1, seq, seq)
    if cu is not None:
        docs = document_ids(cu, seq).expand(batch, seq)
        allowed = allowed & (docs[:, :, None] == docs[:, None, :]).unsqueeze(1)
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))
    ref = (torch.softmax(scores, -1) @ v).permute(2, 0, 1, 3)  # [s, b, h, dv]
    ref.backward(grad_out)

    # Ring: this rank's share; every rank computes the same loss from the gathered output.
    rank, size = group.rank(), group.size()
    local = [split_for_cp_rank(t, rank, size, dim=0).requires_grad_() for t in full]
    out = ring_attention(local[0], local[1], local[2], group, softmax_scale=scale, cu_seqlens=cu)
    gathered = gather_from_cp(out, group, dim=0)
    (gathered * grad_out).sum().backward()
    diffs = {"out": float((gathered - ref).abs().max())}
    for name, mine, theirs in zip(("dq", "dk", "dv"), local, ref_in, strict=True):
        assert mine.grad is not None and theirs.grad is not None
        whole = gather_from_cp(mine.grad, group, dim=0)
        diffs[name] = float((whole - theirs.grad).abs().max())
    return diffs


def _run_attention() -> dict[str, Any]:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        return {name: _attention_case(case, dist.group.WORLD) for name, case in CASES.items()}
    finally:
        dist.destroy_process_group()


def _arch(name: str) -> Any:
    from moerl.models.arch import TINY

    # MTP off: under CP Megatron rescales the MTP loss by this rank's token counts
    # (original / rolled), not the whole sequence's, a ~1/T deviation of its own.
    arch = TINY.replace(mtp_num_layers=0)
    if name == "gqa":  # standard attention, 4 query heads sharing 2 key/value heads
        arch = arch.replace(attention="gqa", num_query_groups=2, kv_channels=32)
    return arch


def document_batches(vocab: int, packed: bool, cp_rank: int, cp: int) -> list[Any]:
    """The documents of PACKED_ROWS as micro-batches of MICRO_BATCH rows: packed rows
    (this CP rank's share, boundaries global), or one document per padded row."""
    from moerl.data.synthetic import Batch
    from moerl.parallel.context import split_batch

    docs: list[list[torch.Tensor]] = []  # per packed row: (tokens, labels, mask) per doc
    for r, lengths in enumerate(PACKED_ROWS):
        row = []
        for d, n in enumerate(lengths):
            gen = torch.Generator().manual_seed(100 * r + d)
            start, stride = int(torch.randint(vocab, (1,), generator=gen)), 1 + d % 5
            seq = (start + stride * torch.arange(n + 1)) % vocab
            mask = torch.ones(n)
            mask[-1] = 0  # its label would be the next document's first token
            row.append(torch.stack([seq[:-1], seq[1:], mask.long()]))
        docs.append(row)

    def batch(rows: list[torch.Tensor], cu: torch.Tensor | None) -> Any:
        t = torch.stack(rows)  # [b, 3, T]
        positions = torch.arange(SEQ_LENGTH).expand(len(rows), -1).contiguous()
        return Batch(t[:, 0].contiguous(), t[:, 1].contiguous(), t[:, 2].float(), positions, cu)

    out = []
    if packed:
        rows = [torch.cat(row, dim=1) for row in docs]
        width = max(len(lengths) for lengths in PACKED_ROWS) + 1
        cu = torch.full((len(rows), width), SEQ_LENGTH, dtype=torch.int32)
        for r, lengths in enumerate(PACKED_ROWS):
            cu[r, 0] = 0
            cu[r, 1 : len(lengths) + 1] = torch.tensor(lengths).cumsum(0)
        for i in range(0, len(rows), MICRO_BATCH):
            b = batch(rows[i : i + MICRO_BATCH], cu[i : i + MICRO_BATCH])
            out.append(split_batch(b, cp_rank, cp) if cp > 1 else b)
        return out
    single = [torch.nn.functional.pad(d, (0, SEQ_LENGTH - d.shape[1])) for row in docs
              for d in row]
    return [batch(single[i : i + MICRO_BATCH], None) for i in range(0, len(single), MICRO_BATCH)]


def _run_model(args: argparse.Namespace) -> dict[str, Any]:
    from megatron.core.transformer.moe import moe_logging
    from parity_checks import PARITY_OPTIM, RoutingMargins, save_gradients

    from moerl.data.synthetic import SyntheticCorpus
    from moerl.models.build import build_model
    from moerl.models.weights import load_weights, save_weights
    from moerl.parallel.groups import destroy_parallel, init_parallel
    from moerl.parallel.layout import ParallelLayout
    from moerl.trainer.lm import batch_iterators
    from moerl.trainer.optimizer import build_optimizer
    from moerl.trainer.step import train_step

    world = int(os.environ.get("WORLD_SIZE", "1"))
    layout = ParallelLayout.for_world(world, use_distributed_optimizer=False,
                                      **json.loads(args.layout))
    groups = init_parallel(layout, seed=1234)
    arch = _arch(args.arch)
    if args.documents:  # padding rows route tokens too: no load-balancing loss
        arch = arch.replace(aux_loss_coeff=0.0)
    layout.check(arch, groups.world_size, groups.backend)
    if args.save:
        save_weights(build_model(arch, layout), args.ckpt)
        moe_logging.destroy_moe_metrics_tracker()
    torch.manual_seed(99)  # the loaded weights must not depend on this
    chunks = build_model(arch, layout)
    load_weights(chunks, args.ckpt)
    trainable = build_optimizer(chunks, PARITY_OPTIM, layout)  # see PARITY_OPTIM
    margins = RoutingMargins()
    margins.install()
    corpus = SyntheticCorpus(arch.vocab_size, SEQ_LENGTH, seed=CORPUS_SEED)
    losses, norms = [], []
    for step in range(1 if args.documents else STEPS):
        batches: Any = batch_iterators(corpus, step, groups, GLOBAL_BATCH, MICRO_BATCH)
        micro = GLOBAL_BATCH // (MICRO_BATCH * layout.dp)
        if args.documents:
            from megatron.core import parallel_state as ps

            listed = document_batches(arch.vocab_size, args.documents == "packed",
                                      ps.get_context_parallel_rank(), layout.cp)
            batches, micro = iter(listed), len(listed)
        metrics = train_step(
            trainable.model,  # type: ignore[arg-type]
            trainable.optimizer,
            batches,  # already this CP rank's share of each sequence
            num_microbatches=micro,
            micro_batch_size=MICRO_BATCH, seq_length=SEQ_LENGTH,
            scheduler=trainable.scheduler,
        )
        if step == 0:  # gradients are final (reduced over DP x CP, TP, EP) after the step
            save_gradients(list(trainable.model), args.grads)
        losses.append(metrics.loss)
        norms.append(metrics.grad_norm)
    margin = margins.global_smallest()
    destroy_parallel()
    return {"layout": layout.describe(), "losses": losses, "grad_norms": norms,
            "margin": margin}


def _run_compare(args: argparse.Namespace) -> dict[str, Any]:
    from moerl.models.build import build_model
    from moerl.models.weights import load_weights
    from moerl.parallel.groups import destroy_parallel, init_parallel
    from moerl.parallel.layout import ParallelLayout

    layout = ParallelLayout()
    init_parallel(layout, seed=1234)
    chunks = build_model(_arch(args.arch), layout)
    grads = []
    for directory in (args.grads, args.other):
        load_weights(chunks, directory)
        grads.append({n: p.detach().clone() for n, p in chunks[0].named_parameters()})
    destroy_parallel()
    diffs = {n: float((grads[0][n] - grads[1][n]).abs().max()) for n in grads[0]}
    norm = {n: float(grads[0][n].abs().max()) for n in grads[0]}
    return {"max_abs_diff": diffs, "max_abs": norm}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["attention", "model", "compare"], required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--arch", choices=["mla", "gqa"], default="mla")
    parser.add_argument("--layout", default="{}", help="JSON of ParallelLayout degrees")
    parser.add_argument("--ckpt", type=Path, help="initial weights (written with --save)")
    parser.add_argument("--save", action="store_true")
    parser.add_argument("--grads", type=Path, help="first-step gradients, as weights")
    parser.add_argument("--other", type=Path, help="compare: the second gradients dir")
    parser.add_argument("--documents", choices=["packed", "split"])
    args = parser.parse_args()
    run = {"attention": lambda: _run_attention(), "model": lambda: _run_model(args),
           "compare": lambda: _run_compare(args)}[args.mode]
    result = run()
    if int(os.environ.get("RANK", "0")) == 0:
        args.out.write_text(json.dumps(result))


if __name__ == "__main__":  # dist_checkpointing's save starts a multiprocessing Manager
    main()
