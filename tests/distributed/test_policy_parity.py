"""Policy parity across layouts: logprobs and one RL update from the same saved weights.

A single process builds the tiny MoE from a seed, saves it, and computes the completion
logprobs of fixed samples, one GRPO update (KL and entropy terms on) and the logprobs
after it: the reference. TP2+SP, EP2 (with DP2), PP2, CP2, CP2·PP2 and TP2·EP2 with
expert-TP 2 then load those weights under torchrun (gloo) and must give the same
logprobs (1e-5), the same update loss and gradient norm (1e-5), and the same logprobs
after the update. CP2 runs the ring attention on each rank's half of every row and
gathers the logprobs back for the objective.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from worker_launch import run_worker

WORKER = Path(__file__).with_name("policy_parity_worker.py")
TOLERANCE = 1e-5

# name -> (ranks, ParallelLayout degrees; dp is filled in from the ranks)
LAYOUTS: dict[str, tuple[int, dict[str, Any]]] = {
    "tp2_sp": (2, {"tp": 2}),
    "ep2": (2, {"ep": 2}),
    "pp2": (2, {"pp": 2}),
    "cp2": (2, {"cp": 2}),
    "cp2_pp2": (4, {"cp": 2, "pp": 2}),
    "tp2_ep2_etp2": (4, {"tp": 2, "ep": 2, "etp": 2}),
}


def _run(ranks: int, layout: dict[str, Any], ckpt: Path, out: Path, save: bool = False) -> Any:
    args = ["--ckpt", str(ckpt), "--out", str(out), "--layout", json.dumps(layout)]
    return run_worker(WORKER, ranks, [*args, "--save"] if save else args, out)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    root = tmp_path_factory.mktemp("policy_parity")
    ckpt = root / "tiny"
    return ckpt, _run(1, {}, ckpt, root / "single.json", save=True)


def _max_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_policy_matches_single_process(
    name: str, reference: tuple[Path, Any], tmp_path: Path
) -> None:
    ckpt, ref = reference
    ranks, layout = LAYOUTS[name]
    got = _run(ranks, layout, ckpt, tmp_path / f"{name}.json")
    d_lp = _max_diff(got["logprobs"], ref["logprobs"])
    d_after = _max_diff(got["logprobs_after"], ref["logprobs_after"])
    m, r = got["metrics"], ref["metrics"]
    d_loss, d_norm = abs(m["loss"] - r["loss"]), abs(m["grad_norm"] - r["grad_norm"])
    print(f"{name}: max|dlogprob| {d_lp:.2e}  |dloss| {d_loss:.2e}  |dgrad-norm| {d_norm:.2e}"
          f"  max|dlogprob after update| {d_after:.2e}")
    assert d_lp < TOLERANCE, name
    assert d_loss < TOLERANCE and d_norm < TOLERANCE, (name, m, r)
    assert d_after < TOLERANCE, name
    for key in ("tokens", "sequences", "entropy", "kl_ref", "clip_frac"):
        assert m[key] == pytest.approx(r[key], abs=TOLERANCE), key
    assert got["moe"] == pytest.approx(ref["moe"], abs=1e-9)


@pytest.mark.distributed
def test_reference_update_is_sane(reference: tuple[Path, Any]) -> None:
    _, ref = reference
    m = ref["metrics"]
    assert m["ratio_mean"] == pytest.approx(1.0) and m["clip_frac"] == 0.0  # pi_old == pi
    assert m["kl_ref"] == pytest.approx(0.0, abs=1e-9)  # the reference is the initial policy
    assert m["skipped"] == 0.0 and m["grad_norm"] > 0
    assert ref["logprobs_after"] != ref["logprobs"]
