"""The manifest: size and digest of every file of a checkpoint, written last (a
tensor shard's digests are its items', in the digest list it names).

The digests are those taken while the files were written (`checkpoint.digests`):
a save reads none of its files back. A load trusts a checkpoint only as far as it
checks it, and it checks everything it uses without a second read of its own:

- structure, by `stat` alone (`verify_manifest`): every listed file is there with
  its size and nothing else is, split over the ranks, so a truncated shard, a
  missing file or a stray one fails before anything loads;
- content, by whoever reads the bytes: `read_verified` for the small files (the
  step state, a rank's RNG, Megatron's metadata), and, for the tensor shards, each
  rank's reader checks every item it reads against the item digests recorded
  beside its file (`checkpoint.digest_read`). A flipped byte fails the load on the
  rank that read it, naming the file and the offset, instead of resuming from
  damaged state.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch.distributed as dist

from moerl.checkpoint.config import CheckpointError
from moerl.checkpoint.digests import Entry, entry_of, write_file

MANIFEST = "manifest.json"
FORMAT = 2  # 1: digests by reading the files back (still loads: same fields)


def fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in `path` durable (a crash cannot undo it)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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


def _broadcast(value: Any) -> Any:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    box: list[Any] = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def write_manifest(root: Path, files: dict[str, Entry]) -> None:
    """Write the manifest of `root` (one rank: the digests are gathered already)."""
    text = json.dumps({"format": FORMAT, "algorithm": "sha256", "files": files},
                      indent=1, sort_keys=True)
    tmp = root / f".{MANIFEST}.tmp"
    write_file(tmp, text.encode())
    os.replace(tmp, root / MANIFEST)


def _listed(root: Path) -> list[str]:
    return sorted(
        str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and p.name != MANIFEST
    )


def _load(root: Path) -> tuple[dict[str, Entry], list[str]]:
    try:
        files = json.loads((root / MANIFEST).read_text())["files"]
        if not isinstance(files, dict):
            raise ValueError("'files' is not an object")
        return files, []
    except (OSError, ValueError, KeyError) as err:
        return {}, [f"{MANIFEST}: unreadable ({err}); the save never finished"]


def _structure(root: Path, files: dict[str, Entry], names: list[str]) -> list[str]:
    found = []
    for name in names:
        path = root / name
        if not path.is_file():
            found.append(f"{name}: missing")
        elif (size := path.stat().st_size) != files[name]["size"]:
            found.append(f"{name}: {size} bytes, manifest says {files[name]['size']} "
                         "(truncated?)")
    return found


def _refuse(root: Path, problems: list[str]) -> CheckpointError:
    shown = "\n  ".join(problems[:20])
    return CheckpointError(
        f"checkpoint {root} failed verification ({len(problems)} problem(s)):\n  {shown}\n"
        "It is truncated or was modified; resume from another checkpoint "
        "(checkpoint.resume=<dir>) or delete this one."
    )


def verify_manifest(root: Path) -> dict[str, Entry]:
    """The manifest's entries, once `root` has every listed file at its size and no
    other (collective; `stat` only, split over the ranks). Raises `CheckpointError` on
    every rank otherwise."""
    rank, world = _rank_world()
    files, problems = _load(root) if rank == 0 else ({}, [])
    if rank == 0 and not problems:
        problems = [f"{name}: not in the manifest" for name in sorted(set(_listed(root))
                                                                      - set(files))]
    files = _broadcast(files)
    problems += _structure(root, files, sorted(files)[rank::world])
    everything = sorted({p for part in _gather(problems) for p in part})
    if everything:
        raise _refuse(root, everything)
    return dict(files)


def read_verified(root: Path, name: str, files: dict[str, Entry]) -> bytes:
    """The bytes of `root/name`, once they match the manifest (this rank only)."""
    if name not in files:
        raise _refuse(root, [f"{name}: not in the manifest"])
    if "sha256" not in files[name]:
        raise ValueError(f"{name} is checked item by item as it is read "
                         f"(its digests: {files[name].get('digests')}), not whole")
    try:
        data = (root / name).read_bytes()
    except OSError as err:
        raise _refuse(root, [f"{name}: unreadable ({err})"]) from err
    if entry_of(data) != {k: files[name][k] for k in ("size", "sha256")}:
        raise _refuse(root, [f"{name}: sha256 differs from the manifest (modified or "
                             "corrupted)"])
    return data
