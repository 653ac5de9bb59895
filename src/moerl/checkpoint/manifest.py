"""The manifest: size and sha256 of every file of a checkpoint, written last.

A checkpoint is trusted only if every listed file is there with its size and
hash and nothing else is: a truncated shard, a flipped byte or a stray file fails
the load loudly instead of resuming from damaged state. Hashing is split over the
ranks (file i goes to rank i % world), so a large checkpoint is read once, in
parallel, whatever the layout it is written or read under.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch.distributed as dist

from moerl.checkpoint.config import CheckpointError

MANIFEST = "manifest.json"
_CHUNK = 1 << 22


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(_CHUNK):
            digest.update(block)
    return digest.hexdigest()


def _files(root: Path) -> list[str]:
    return sorted(
        str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and p.name != MANIFEST
    )


def _rank_world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _gather(local: Any) -> list[Any]:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [local]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, local)
    return out


def fsync_file(path: Path) -> None:
    with path.open("rb") as f:
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in `path` durable (a crash cannot undo it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(root: Path) -> dict[str, dict[str, Any]]:
    """Hash `root` (all ranks take part, every file written); rank 0 writes the manifest."""
    rank, world = _rank_world()
    names = _files(root) if rank == 0 else []
    names = _broadcast(names)
    mine = {}
    for name in names[rank::world]:
        path = root / name
        fsync_file(path)  # the hash must describe bytes that are on disk
        mine[name] = {"size": path.stat().st_size, "sha256": _sha256(path)}
    files = {k: v for part in _gather(mine) for k, v in part.items()}
    if rank == 0:
        text = json.dumps({"format": 1, "algorithm": "sha256", "files": files}, indent=1)
        tmp = root / f".{MANIFEST}.tmp"
        tmp.write_text(text)
        fsync_file(tmp)
        os.replace(tmp, root / MANIFEST)
    return files


def _broadcast(names: list[str]) -> list[str]:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return names
    box: list[Any] = [names]
    dist.broadcast_object_list(box, src=0)
    return list(box[0])


def _problems(root: Path, files: dict[str, Any], names: list[str]) -> list[str]:
    found = []
    for name in names:
        path = root / name
        want = files[name]
        if not path.is_file():
            found.append(f"{name}: missing")
        elif (size := path.stat().st_size) != want["size"]:
            found.append(f"{name}: {size} bytes, manifest says {want['size']} (truncated?)")
        elif _sha256(path) != want["sha256"]:
            found.append(f"{name}: sha256 differs from the manifest (modified or corrupted)")
    return found


def verify_manifest(root: Path) -> None:
    """Raise `CheckpointError` on every rank unless `root` matches its manifest exactly."""
    rank, world = _rank_world()
    problems: list[str] = []
    files: dict[str, Any] = {}
    try:
        payload = json.loads((root / MANIFEST).read_text())
        files = payload["files"]
    except (OSError, ValueError, KeyError) as err:
        problems.append(f"{MANIFEST}: unreadable ({err}); the save never finished")
    if not problems:
        if rank == 0:
            extra = sorted(set(_files(root)) - set(files))
            problems += [f"{name}: not in the manifest" for name in extra]
        problems += _problems(root, files, sorted(files)[rank::world])
    everything = sorted({p for part in _gather(problems) for p in part})
    if everything:
        shown = "\n  ".join(everything[:20])
        raise CheckpointError(
            f"checkpoint {root} failed verification ({len(everything)} problem(s)):\n  {shown}\n"
            "It is truncated or was modified; resume from another checkpoint "
            "(checkpoint.resume=<dir>) or delete this one."
        )
