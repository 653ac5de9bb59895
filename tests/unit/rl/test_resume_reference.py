"""Where a resumed RL run's reference model comes from: the weights directory the run
started from, the same fresh model built again (same seed, same layout), or the copy
older runs wrote; anything else is refused before a model is built."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from moerl.checkpoint.config import CheckpointConfig, CheckpointError, Fingerprints
from moerl.checkpoint.digests import write_file
from moerl.checkpoint.manifest import write_manifest
from moerl.checkpoint.store import partial_dir, publish, step_name
from moerl.models.weights_marker import MARKER
from moerl.rl.resume import RLCheckpoints

PRINTS = Fingerprints("model", "data", "config")
LAYOUT = "tp1-pp1-ep1-etp1-cp1-dp1"


def _saved(root: Path, reference: dict[str, Any] | None, **legacy: Any) -> Path:
    """A published checkpoint whose RL state names `reference`."""
    rl = {"next_step": 2, "weight_version": 2, "prompts": {}, "updates": 2, **legacy}
    if reference is not None:
        rl["reference"] = reference
    state = {"step": 2, "world_size": 1, "fingerprints": vars(PRINTS), "extra": {"rl": rl}}
    tmp = partial_dir(root, 2)
    tmp.mkdir(parents=True)
    write_manifest(tmp, {"state.json": write_file(tmp / "state.json",
                                                  json.dumps(state).encode())})
    publish(tmp, root / step_name(2))
    return root / step_name(2)


def _weights_dir(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / MARKER).write_text("ok\n")
    return path


def _resumed(root: Path, seed: int = 3, layout: str = LAYOUT) -> RLCheckpoints:
    return RLCheckpoints(CheckpointConfig(dir=str(root)), PRINTS, None, seed=seed, layout=layout)


def test_the_reference_is_read_where_the_run_started(tmp_path: Path) -> None:
    start = _weights_dir(tmp_path / "sft")
    _saved(tmp_path / "ckpt", {"weights": str(start)})
    ckpt = _resumed(tmp_path / "ckpt")
    assert ckpt.reference_weights() == start
    assert ckpt.reference == {"weights": str(start)}  # and saved again as such
    (start / MARKER).unlink()
    with pytest.raises(CheckpointError, match=r"reference model is read from .*sft.* not a "
                                              "complete weights directory"):
        _resumed(tmp_path / "ckpt").reference_weights()


def test_a_fresh_model_is_built_again_only_with_its_seed_and_layout(tmp_path: Path) -> None:
    fresh = {"weights": None, "seed": 3, "layout": LAYOUT}
    _saved(tmp_path / "ckpt", fresh)
    ckpt = _resumed(tmp_path / "ckpt")
    assert ckpt.reference_weights() is None and ckpt.reference == fresh
    for other in ({"seed": 4}, {"layout": "tp2-pp1-ep1-etp1-cp1-dp1"}):
        with pytest.raises(CheckpointError, match=r"started from a fresh model \(seed 3"):
            _resumed(tmp_path / "ckpt", **other).reference_weights()


def test_a_fresh_start_records_where_its_weights_are(tmp_path: Path) -> None:
    start = _weights_dir(tmp_path / "init")
    ckpt = RLCheckpoints(CheckpointConfig(dir=str(tmp_path / "ckpt")), PRINTS, start, seed=3,
                         layout=LAYOUT)
    assert ckpt.reference_weights() is None  # nothing to resume: a copy of the policy
    assert ckpt.reference == {"weights": str(start.resolve())}


def test_an_older_runs_reference_copy_is_still_read(tmp_path: Path) -> None:
    legacy = _weights_dir(tmp_path / "ckpt" / "reference")
    (legacy / "reference_id").write_text("abc\n")
    _saved(tmp_path / "ckpt", None, reference_id="abc")
    assert _resumed(tmp_path / "ckpt").reference_weights() == legacy
    (legacy / "reference_id").write_text("other\n")
    with pytest.raises(CheckpointError, match="missing or another run's"):
        _resumed(tmp_path / "ckpt").reference_weights()
