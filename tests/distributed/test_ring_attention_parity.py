"""Ring attention under torchrun (gloo, CP=2 and 4) against full attention in one process.

The file is both the pytest module and the worker it launches
(`python -m torch.distributed.run ... test_ring_attention_parity.py --mode ...`);
rank 0 of each run writes JSON that the tests read.

- attention: outputs and input gradients of `ring_attention` on each rank's
  share equal those of causal attention over the whole sequence, for standard
  and MLA-shaped heads (qk dim != v dim), with and without packed documents.
- model: the tiny MoE (MLA, and a GQA variant; MTP off, see `_run_model`)
  trained 3 Adam steps with CP=2 and ring attention gives the same losses,
  gradient norms and first-step gradient of every parameter as one process
  with Megatron's plain local attention.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

TOLERANCE = 1e-5
HERE = Path(__file__).resolve()

# name -> (qk head dim, v head dim, heads, cu_seqlens as a list or None); T = 16, b = 2
CASES: dict[str, tuple[int, int, int, Any]] = {
    "standard": (8, 8, 4, None),
    "mla": (12, 8, 2, None),
    "standard_packed": (8, 8, 4, [0, 3, 9, 16]),
    "mla_packed_per_row": (12, 8, 2, [[0, 5, 11, 16], [0, 7, 16, 16]]),
}


def _launch(ranks: int, args: list[str], out: Path) -> Any:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    src = str(HERE.parents[2] / "src")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    script = [str(HERE), *args, "--out", str(out)]
    cmd = [sys.executable, *script] if ranks == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={ranks}", *script]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-40:])
        pytest.fail(f"{args} on {ranks} ranks failed:\n{tail}")
    return json.loads(out.read_text())


@pytest.mark.distributed
@pytest.mark.parametrize("cp", [2, 4])
def test_ring_attention_matches_full_attention(cp: int, tmp_path: Path) -> None:
    got = _launch(cp, ["--mode", "attention"], tmp_path / "attention.json")
    assert set(got) == set(CASES)
    for name, diffs in got.items():
        print(f"cp{cp} {name}: " + "  ".join(f"max|{k}| {v:.1e}" for k, v in diffs.items()))
        assert max(diffs.values()) < TOLERANCE, (name, diffs)


@pytest.mark.distributed
@pytest.mark.parametrize("arch", ["mla", "gqa"])
def test_tiny_model_cp2_matches_single_process(arch: str, tmp_path: Path) -> None:
    common = ["--mode", "model", "--arch", arch, "--grads"]
    ref = _launch(1, [*common, str(tmp_path / "g1.pt")], tmp_path / "1.json")
    got = _launch(2, [*common, str(tmp_path / "g2.pt")], tmp_path / "2.json")
    assert ref["weights"] == got["weights"]  # the same initial weights
    dloss = max(abs(a - b) for a, b in zip(got["losses"], ref["losses"], strict=True))
    # Relative: by step 3 Adam has magnified fp32 rounding (the ring sums the softmax
    # in another order) to ~1e-5 of a norm of ~2.7; the step-1 gradients are exact.
    dnorm = max(abs(a - b) / b for a, b in zip(got["grad_norms"], ref["grad_norms"], strict=True))
    g1, g2 = torch.load(tmp_path / "g1.pt"), torch.load(tmp_path / "g2.pt")
    assert g1.keys() == g2.keys()
    dgrad = max(float((g1[k] - g2[k]).abs().max()) for k in g1)
    print(f"tiny {arch} cp2: max|dloss| {dloss:.1e}  max rel|dgrad-norm| {dnorm:.1e}  "
          f"step-1 max|dgrad| {dgrad:.1e} over {len(g1)} params  losses {got['losses']}")
    assert dloss < TOLERANCE and dnorm < TOLERANCE and dgrad < TOLERANCE
    assert got["losses"][-1] < got["losses"][0]


# ---------------------------------------------------------------- the worker


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


def _run_model(grads_path: Path, arch_name: str) -> dict[str, Any]:
    from moerl.data.synthetic import SyntheticCorpus
    from moerl.models.arch import TINY
    from moerl.models.build import build_model
    from moerl.parallel.groups import destroy_parallel, init_parallel
    from moerl.parallel.layout import ParallelLayout
    from moerl.trainer.lm import batch_iterators
    from moerl.trainer.optimizer import OptimConfig, build_optimizer
    from moerl.trainer.step import train_step

    cp = int(os.environ.get("WORLD_SIZE", "1"))
    layout = ParallelLayout(cp=cp, use_distributed_optimizer=False)
    groups = init_parallel(layout, seed=1234)
    # MTP off: under CP Megatron rescales the MTP loss by this rank's token counts
    # (original / rolled), not the whole sequence's, a ~1/T deviation of its own.
    arch = TINY.replace(mtp_num_layers=0)
    if arch_name == "gqa":  # standard attention, 4 query heads sharing 2 key/value heads
        arch = arch.replace(attention="gqa", num_query_groups=2, kv_channels=32)
    chunks = build_model(arch, layout)
    weights = sum(float(p.detach().double().sum()) for p in chunks[0].parameters())
    trainable = build_optimizer(chunks, OptimConfig(lr=1e-2, clip_grad=1.0), layout)
    corpus = SyntheticCorpus(TINY.vocab_size, 32, seed=7)
    losses, norms = [], []
    for step in range(3):
        batches = batch_iterators(corpus, step, groups, 8, 2)
        assert not isinstance(batches, list)
        metrics = train_step(
            trainable.model,
            trainable.optimizer,
            batches,  # already this CP rank's share of each sequence
            num_microbatches=4, micro_batch_size=2, seq_length=32 // cp,
            scheduler=trainable.scheduler,
        )
        if step == 0 and groups.rank == 0:
            # Gradients are reduced over the dp x cp group: complete on every rank.
            named = trainable.model[0].named_parameters()
            torch.save({n: p.main_grad.detach().clone() for n, p in named}, grads_path)
        losses.append(metrics.loss)
        norms.append(metrics.grad_norm)
    destroy_parallel()
    return {"losses": losses, "grad_norms": norms, "weights": weights}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["attention", "model"], required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--grads", type=Path)
    parser.add_argument("--arch", choices=["mla", "gqa"], default="mla")
    args = parser.parse_args()
    result = _run_attention() if args.mode == "attention" else _run_model(args.grads, args.arch)
    if int(os.environ.get("RANK", "0")) == 0:
        args.out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
