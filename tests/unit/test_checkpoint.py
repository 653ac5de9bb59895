"""The checkpoint machinery that needs no model: manifest, directory protocol,
cleanup, JSON state, RNG states, fingerprints and the stop-signal flag."""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
from pathlib import Path

import numpy as np
import pytest
import torch

from moerl.checkpoint.checkpointer import Checkpointer
from moerl.checkpoint.config import (
    CheckpointConfig,
    CheckpointError,
    Fingerprints,
    check_json,
    fingerprint,
)
from moerl.checkpoint.digests import HashingWriter, entry_of, item_digest, write_file
from moerl.checkpoint.manifest import MANIFEST, read_verified, verify_manifest, write_manifest
from moerl.checkpoint.rng import capture_rng, restore_rng
from moerl.checkpoint.sharded import check_optimizer_compatible
from moerl.checkpoint.store import (
    cleanup,
    complete_checkpoints,
    partial_dir,
    publish,
    read_latest,
    step_name,
)
from moerl.signals import StopOnSignal


def _checkpoint(root: Path, step: int, latest: bool = True) -> Path:
    """A complete checkpoint directory, published the way a save does it."""
    tmp = partial_dir(root, step)
    (tmp / "dist").mkdir(parents=True, exist_ok=True)
    files = {"dist/__0_0.distcp": write_file(tmp / "dist" / "__0_0.distcp", os.urandom(4096)),
             "state.json": write_file(tmp / "state.json", json.dumps({"step": step}).encode())}
    write_manifest(tmp, files)
    final = root / step_name(step)
    if latest:
        publish(tmp, final)
    else:
        os.replace(tmp, final)
    return final


def test_manifest_accepts_the_written_checkpoint(tmp_path: Path) -> None:
    path = _checkpoint(tmp_path, 1)
    files = verify_manifest(path)
    assert sorted(files) == ["dist/__0_0.distcp", "state.json"]
    assert json.loads(read_verified(path, "state.json", files)) == {"step": 1}


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("truncate", "truncated"),
        ("flip", "sha256 differs"),
        ("delete", "missing"),
        ("extra", "not in the manifest"),
        ("no-manifest", "the save never finished"),
    ],
)
def test_damaged_checkpoint_is_refused(tmp_path: Path, damage: str, message: str) -> None:
    """Structure fails `verify_manifest` (sizes and names, no file read); a flipped
    byte fails the read of that file."""
    path = _checkpoint(tmp_path, 1)
    shard = path / "dist" / "__0_0.distcp"
    if damage == "truncate":
        shard.write_bytes(shard.read_bytes()[:-1])
    elif damage == "flip":
        data = bytearray(shard.read_bytes())
        data[100] ^= 0x40
        shard.write_bytes(bytes(data))
    elif damage == "delete":
        shard.unlink()
    elif damage == "extra":
        (path / "dist" / "stray.bin").write_bytes(b"x")
    else:
        (path / MANIFEST).unlink()
    with pytest.raises(CheckpointError, match=message):
        read_verified(path, "dist/__0_0.distcp", verify_manifest(path))


def test_hashing_writer_digests_what_reaches_the_file(tmp_path: Path) -> None:
    path = tmp_path / "f"
    with path.open("wb") as raw:
        stream = HashingWriter(raw)
        stream.write(b"head")
        stream.begin_item()
        stream.write(memoryview(bytearray(range(200))))
        item = stream.end_item()
        stream.write(b"tail")
    data = path.read_bytes()
    assert stream.entry() == entry_of(data)
    assert item == item_digest(data[4:204])
    assert item != item_digest(data[4:203] + bytes([data[203] ^ 1]))
    assert item_digest(data, "sha256") == hashlib.sha256(data).hexdigest()


def test_item_hashing_writer_refuses_bytes_outside_an_item(tmp_path: Path) -> None:
    """A data file's digests are its items': a byte no item covers would go unchecked."""
    with (tmp_path / "f").open("wb") as raw:
        stream = HashingWriter(raw, whole=False)
        stream.begin_item()
        stream.write(b"item")
        assert stream.end_item() == item_digest(b"item")
        with pytest.raises(ValueError, match="every byte must belong to an item"):
            stream.write(b"stray")
        with pytest.raises(ValueError, match="no whole-file digest"):
            stream.entry()


def test_publish_moves_latest_only_after_the_rename(tmp_path: Path) -> None:
    _checkpoint(tmp_path, 2)
    assert read_latest(tmp_path) == tmp_path / "step_00000002"
    # A save killed before its rename: invisible, `latest` unchanged.
    (partial_dir(tmp_path, 4) / "dist").mkdir(parents=True)
    assert read_latest(tmp_path) == tmp_path / "step_00000002"
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step_00000002"]
    _checkpoint(tmp_path, 4)
    assert (tmp_path / "latest").read_text() == "step_00000004\n"


def test_cleanup_keeps_last_k_and_latest(tmp_path: Path) -> None:
    for step in (1, 2, 3, 4):
        _checkpoint(tmp_path, step)
    removed = cleanup(tmp_path, keep_last=2)
    assert [p.name for p in removed] == ["step_00000001", "step_00000002"]
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step_00000003", "step_00000004"]
    # `latest` pointing at an older checkpoint (the newest was renamed in but a
    # kill came before `latest` moved): both it and the newest survive.
    _checkpoint(tmp_path, 5, latest=False)
    cleanup(tmp_path, keep_last=1)
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step_00000004", "step_00000005"]
    assert cleanup(tmp_path, keep_last=0) == []


def test_cleanup_never_deletes_the_only_complete_checkpoint(tmp_path: Path) -> None:
    _checkpoint(tmp_path, 7)
    (partial_dir(tmp_path, 9) / "dist").mkdir(parents=True)
    assert cleanup(tmp_path, keep_last=1) == []
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step_00000007"]


def _checkpointer(root: Path, resume: str = "auto") -> Checkpointer:
    return Checkpointer(CheckpointConfig(dir=str(root), resume=resume), Fingerprints("m", "d", "c"))


def test_resolve(tmp_path: Path) -> None:
    assert _checkpointer(tmp_path).resolve() is None  # nothing yet: a fresh start
    _checkpoint(tmp_path, 3, latest=False)  # killed before the first `latest`
    assert _checkpointer(tmp_path).resolve() == tmp_path / "step_00000003"
    _checkpoint(tmp_path, 5)
    _checkpoint(tmp_path, 6, latest=False)
    assert _checkpointer(tmp_path).resolve() == tmp_path / "step_00000005"
    assert _checkpointer(tmp_path, "none").resolve() is None
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        _checkpointer(tmp_path, str(tmp_path / "nope")).resolve()


def test_extra_state_must_be_plain_json() -> None:
    check_json({"data": {"next_step": 3}, "rl": {"pending": [{"ids": [1, 2], "v": 4}]}}, "x")
    for bad in ({"a": (1, 2)}, {"a": float("nan")}, {"a": object()}, {1: "x"}):
        with pytest.raises(CheckpointError):
            check_json(bad, "extra_state")


def test_fingerprint_ignores_key_order() -> None:
    assert fingerprint({"a": 1, "b": [1, 2]}) == fingerprint({"b": [1, 2], "a": 1})
    assert fingerprint({"a": 1}) != fingerprint({"a": 2})


def test_rng_round_trip_through_json() -> None:
    state = json.loads(json.dumps(capture_rng()))
    expected = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    random.random(), np.random.rand(), torch.rand(3)
    restore_rng(state)
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == expected


def _facts(kind: str = "distributed", fmt: str = "dp_reshardable", **degrees: int) -> dict:
    layout = {"tp": 1, "pp": 1, "vpp": 1, "ep": 1, "etp": 1, **degrees}
    return {"kind": kind, "ep": layout["ep"], "step": 3, "format": fmt, "layout": layout}


def test_optimizer_changes_megatron_cannot_reshard_are_refused() -> None:
    full = "fully_reshardable"
    check_optimizer_compatible(_facts(fmt=full, ep=2), _facts(ep=4))
    check_optimizer_compatible(_facts(fmt=full, tp=2), _facts(tp=1, pp=2))
    check_optimizer_compatible(_facts(tp=2, ep=2), _facts(tp=2, ep=2))  # any DP, CP
    check_optimizer_compatible(_facts("plain", tp=2), _facts("plain", pp=2))
    with pytest.raises(CheckpointError, match=r"EP=1.*weights_only=true"):
        check_optimizer_compatible(_facts(fmt=full), _facts(ep=2))
    with pytest.raises(CheckpointError, match=r"plain.*use_distributed_optimizer"):
        check_optimizer_compatible(_facts(), _facts("plain"))
    for change in ({"tp": 2}, {"pp": 2}, {"vpp": 2}, {"ep": 4}, {"etp": 2}):
        with pytest.raises(CheckpointError, match=(
                r"dp_reshardable format at TP1 PP1 VPP1 EP2 ETP1 .* data and context "
                r"parallelism only.*weights_only=true.*optimizer_format=fully_reshardable")):
            check_optimizer_compatible(_facts(ep=2), _facts(**{"ep": 2, **change}))
    legacy = {k: v for k, v in _facts(fmt=full, tp=2).items() if k not in ("format", "layout")}
    check_optimizer_compatible(legacy, _facts(tp=1))  # written before formats were recorded


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_stop_signal_sets_the_flag_and_restores_the_handler(sig: signal.Signals) -> None:
    before = signal.getsignal(sig)
    with StopOnSignal() as stop:
        assert not stop.agreed()
        os.kill(os.getpid(), sig)
        assert stop.requested and stop.agreed()
        assert stop.received == sig
    assert signal.getsignal(sig) == before


def test_config_checks() -> None:
    with pytest.raises(ValueError, match="keep_last"):
        CheckpointConfig(dir="x", keep_last=-1)
    assert not CheckpointConfig().enabled


def test_checkpoint_writer_helper_ignores_the_stop_signals() -> None:
    """SLURM signals every process of a step: megatron-core's checkpoint-writer helper
    must survive SIGUSR1/SIGTERM, or the checkpoint the signal asks for breaks."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    filesystem_async._results_queue = None  # a helper of this test's own
    children_before = _children()
    with StopOnSignal():
        helpers = _children() - children_before
        assert helpers, "no helper process was started"
        for pid in helpers:
            ignored = int(_status(pid)["SigIgn"], 16)
            for sig in (signal.SIGUSR1, signal.SIGTERM):
                assert ignored & (1 << (sig - 1)), (pid, sig)
        os.kill(os.getpid(), signal.SIGUSR1)  # ours still records it
    assert filesystem_async.get_write_results_queue() is not None


def _children() -> set[int]:
    me = os.getpid()
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int(_status(int(entry.name))["PPid"]) == me:
                    found.add(int(entry.name))
            except (OSError, KeyError):
                pass
    return found


def _status(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {k: v.strip() for k, _, v in (line.partition(":") for line in lines)}


def test_materialized_adam_state_is_the_state_a_first_step_starts_from() -> None:
    """A save before any optimizer step creates Adam's state (lr=0, zero gradients);
    the next real step must then equal a fresh optimizer's first step exactly."""
    from types import SimpleNamespace

    from moerl.checkpoint.sharded import _materialize_adam_state

    torch.manual_seed(0)
    start, grad = torch.randn(5, 3), torch.randn(5, 3)
    params = [torch.nn.Parameter(start.clone()) for _ in range(2)]
    fresh, saved = (torch.optim.AdamW([p], lr=0.1, weight_decay=0.1) for p in params)
    _materialize_adam_state(SimpleNamespace(optimizer=saved))
    assert torch.equal(params[1].detach(), start) and len(saved.state[params[1]]) > 0
    for p, opt in zip(params, (fresh, saved), strict=True):
        p.grad = grad.clone()
        opt.step()
    assert torch.equal(params[0].detach(), params[1].detach())
    assert float(fresh.state[params[0]]["step"]) == float(saved.state[params[1]]["step"]) == 1


def test_a_save_is_due_after_interval_minutes_of_wall_time(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from moerl.checkpoint import checkpointer

    now = [1000.0]
    monkeypatch.setattr(checkpointer, "time", SimpleNamespace(monotonic=lambda: now[0]))
    cfg = CheckpointConfig(dir=str(tmp_path), save_interval=10, interval_minutes=30)
    ckpt = Checkpointer(cfg, Fingerprints("m", "d", "c"))
    now[0] += 29 * 60
    assert not ckpt.should_save(7)
    assert ckpt.should_save(10)  # the step interval still counts
    now[0] += 61
    assert ckpt.should_save(11)
    with pytest.raises(ValueError, match="interval_minutes"):
        CheckpointConfig(dir="x", interval_minutes=-1)
