"""Critic parity across layouts: PPO with GAE from the same saved weights.

A single process builds the tiny MoE from a seed, saves it, builds the critic from it
(trunk = the policy's weights, a head drawn from a fixed seed) and runs one update of
two minibatches with `rl.advantage=gae`: the critic's values of fixed samples, two
critic steps on the clipped value loss (the second one clips: its values moved in the
first), two policy steps on the GAE advantages, the values after. It records the
critic's whole gradient at both steps. TP2+SP, EP2 (with DP2), PP2 and CP2 then load
the same weights under torchrun (gloo) and must give the same values before and after,
the same value loss, explained variance, GAE advantage statistics and gradient norms
(1e-5, relative for norms; values relative to the largest), and, parameter by
parameter, the same critic gradients (1e-5 of each tensor's largest entry, as
tests/distributed/test_parity.py) on every rank's shards. Measured: at most 1.1e-6
(TP2 values after the update; gradients <= 1.0e-6); PP2 exact. Without the value
head's sequence-parallel gradient reduction (models/value.py) TP2 is off by 0.75 in the
head's gradient.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from parity_checks import MARGIN_FLOOR
from worker_launch import run_worker

WORKER = Path(__file__).with_name("critic_parity_worker.py")
TOLERANCE = 1e-5

LAYOUTS: dict[str, tuple[int, dict[str, Any]]] = {
    "tp2_sp": (2, {"tp": 2}),
    "ep2": (2, {"ep": 2}),
    "pp2": (2, {"pp": 2}),
    "cp2": (2, {"cp": 2}),
}
ABSOLUTE = ("value_loss", "explained_variance", "advantages_mean", "advantages_std",
            "returns_mean", "values_mean", "kl_in_reward", "value_clip_frac", "loss")
RELATIVE = ("critic_grad_norm", "grad_norm")


def _run(ranks: int, layout: dict[str, Any], ckpt: Path, out: Path, *extra: str) -> Any:
    args = ["--ckpt", str(ckpt), "--out", str(out), "--layout", json.dumps(layout), *extra]
    return run_worker(WORKER, ranks, args, out)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Any]:
    root = tmp_path_factory.mktemp("critic_parity")
    ckpt, grads = root / "tiny", root / "grads"
    got = _run(1, {}, ckpt, root / "single.json", "--save", "--record", str(grads))
    return ckpt, grads, got


def _max_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def _relative(a: list[float], b: list[float]) -> float:
    """The largest difference relative to the largest value of the reference `b`."""
    return _max_diff(a, b) / max(abs(y) for y in b)


@pytest.mark.distributed
def test_reference_update_exercises_the_critic(reference: tuple[Path, Path, Any]) -> None:
    _, _, ref = reference
    m = ref["metrics"]
    assert m["critic_warmup"] == 0.0 and m["optimizer_steps"] == 2.0
    assert 0 < m["value_clip_frac"] < 0.5  # clipping acted in the second critic step
    assert m["critic_grad_norm"] > 0 and m["value_loss"] > 0
    assert _max_diff(ref["values"], ref["values_after"]) > 1e-3  # the critic moved
    assert ref["margin"] > MARGIN_FLOOR  # no routing choice near a tie


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_critic_matches_single_process(
    name: str, reference: tuple[Path, Path, Any], tmp_path: Path
) -> None:
    ckpt, grads, ref = reference
    ranks, layout = LAYOUTS[name]
    got = _run(ranks, layout, ckpt, tmp_path / f"{name}.json", "--against", str(grads))
    d_values = _relative(got["values"], ref["values"])
    d_after = _relative(got["values_after"], ref["values_after"])
    checks = {k: (v["worst"], v["worst_value"]) for k, v in got["checks"].items()}
    m, r = got["metrics"], ref["metrics"]
    print(f"{name}: max|dV|/max|V| {d_values:.1e}  after the update {d_after:.1e}  "
          f"|dvalue_loss| {abs(m['value_loss'] - r['value_loss']):.1e}  "
          + "  ".join(f"{k} worst {v:.1e} ({w})" for k, (w, v) in checks.items()))
    assert d_values < TOLERANCE and d_after < TOLERANCE, name
    for key in ABSOLUTE:
        assert m[key] == pytest.approx(r[key], abs=TOLERANCE), key
    for key in RELATIVE:
        assert m[key] == pytest.approx(r[key], rel=TOLERANCE), key
    for step, (worst, value) in checks.items():
        assert value < TOLERANCE, (step, worst, value)
    assert len(got["checks"]) == 2
