"""The memory model and the rehearsal against what Megatron actually allocates, per rank.

For the `tiny` preset under several layouts, `memory_worker.py` builds the model
and optimizer, takes one step of one micro-batch and counts bytes per rank. The
memory model, given the same settings (fp32 on CPU, the local layer spec, no
recompute, one micro-batch in flight), must predict weights, main gradients,
fp32 master copies and Adam states exactly, and the saved activations (layers,
MTP, head and logits of one micro-batch) within 15%. The rehearsal
(`rehearse_worker.py`: every rank built on a fake process group of the job's size,
on tensors without memory, by the same builder) must count exactly what was
measured, term by term, DDP's padding included.

The model is built with the latent norms (`qk_layernorm`) that DeepSeek-V3 and
Kimi-K2 have and that the parameter counts include.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from worker_launch import worker_command, worker_env

from moerl.models.arch import TINY
from moerl.parallel.layout import ParallelLayout
from moerl.planning.memory import RunSettings, rank_memory

WORKER = Path(__file__).with_name("memory_worker.py")
REHEARSE = Path(__file__).with_name("rehearse_worker.py")
SEQ_LENGTH, MICRO_BATCH = 64, 2
ACTIVATION_TOLERANCE = 0.15
STATIC = ("weights", "main_grads", "master_weights", "adam_states")

# name -> (ranks, ParallelLayout degrees; dp is filled in from the ranks)
LAYOUTS: dict[str, tuple[int, dict[str, Any]]] = {
    "single": (1, {}),
    "tp2": (2, {"tp": 2}),
    "ep2": (2, {"ep": 2}),
    "pp2": (2, {"pp": 2}),
    "dp2_distributed_optimizer": (2, {"use_distributed_optimizer": True}),
}


def _launch(ranks: int, layout: dict[str, Any], out: Path) -> subprocess.Popen[str]:
    args = ["--out", str(out), "--layout", json.dumps(layout),
            "--seq-length", str(SEQ_LENGTH), "--micro-batch", str(MICRO_BATCH)]
    return subprocess.Popen(worker_command(WORKER, ranks, args), env=worker_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory
         ) -> tuple[dict[str, list[dict[str, Any]]], dict[str, list[dict[str, Any]]]]:
    """Every layout measured, and rehearsed, at once: the runs are mostly start-up,
    which overlaps. (measured, rehearsed), each name -> one dict per rank."""
    root = tmp_path_factory.mktemp("memory")
    rehearse = subprocess.Popen(
        [sys.executable, str(REHEARSE), "--out", str(root / "rehearsed.json"), "--layouts",
         json.dumps(LAYOUTS)], cwd=REHEARSE.parent, env=worker_env(),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    procs = {name: _launch(ranks, degrees, root / name)
             for name, (ranks, degrees) in LAYOUTS.items()}
    for name, proc in [*procs.items(), ("rehearsal", rehearse)]:
        output, _ = proc.communicate(timeout=600)
        if proc.returncode != 0:
            tail = "\n".join(output.splitlines()[-40:])
            pytest.fail(f"{name} failed:\n{tail}")
    measured = {name: [json.loads((root / name / f"rank{r}.json").read_text())
                       for r in range(ranks)] for name, (ranks, _) in LAYOUTS.items()}
    return measured, json.loads((root / "rehearsed.json").read_text())


@pytest.fixture(scope="module")
def measured(runs: tuple[dict[str, list[dict[str, Any]]], dict[str, list[dict[str, Any]]]]
             ) -> dict[str, list[dict[str, Any]]]:
    return runs[0]


def predict(layout: ParallelLayout, pp_rank: int) -> dict[str, float]:
    """The model's terms for one rank, with the activation terms of one micro-batch."""
    run = RunSettings(seq_length=SEQ_LENGTH, micro_batch_size=MICRO_BATCH,
                      global_batch_size=MICRO_BATCH * layout.dp, precision="fp32",
                      recompute="none", layer_spec="local")
    memory = rank_memory(TINY, layout, run, pp_rank)
    assert memory.in_flight == 1
    terms = dict(memory.terms)
    terms["saved_activations"] = terms["activations"] + terms["logits"]
    return terms


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_memory_model_matches_allocation(
    name: str, measured: dict[str, list[dict[str, Any]]]
) -> None:
    ranks, degrees = LAYOUTS[name]
    layout = ParallelLayout.for_world(ranks, **degrees)
    for got in measured[name]:
        want = predict(layout, got["pp_rank"])
        ratio = got["activations"] / want["saved_activations"]
        print(f"{name} rank {got['rank']}: " + ", ".join(
            f"{k} {got[k]:,} (model {want[k]:,.0f})" for k in STATIC)
            + f"; activations {got['activations']:,} (model "
            f"{want['saved_activations']:,.0f}, measured/model {ratio:.3f}); "
            f"DDP padding {got['grad_buffer_padding']:,}")
        for key in STATIC:
            assert got[key] == want[key], (name, got["rank"], key, got[key], want[key])
        assert abs(ratio - 1) <= ACTIVATION_TOLERANCE, (name, got["rank"], ratio)


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_rehearsal_counts_what_was_allocated(
    name: str, runs: tuple[dict[str, list[dict[str, Any]]], dict[str, list[dict[str, Any]]]]
) -> None:
    measured, rehearsed = runs
    keys = (*STATIC, "grad_buffer_padding")
    for got, want in zip(rehearsed[name], measured[name], strict=True):
        assert got["rank"] == want["rank"]
        assert {k: got[k] for k in keys} == {k: want[k] for k in keys}, (name, got["rank"])
        assert got["weights"] > 0 and got["adam_states"] > 0
