"""The checkpoint root on disk: step directories, the `latest` pointer, cleanup.

    <root>/step_00000012/          a complete checkpoint (it has manifest.json)
    <root>/.step_00000014.partial/ a save in progress, or one a kill interrupted
    <root>/latest                  "step_00000012": the checkpoint a resume takes

A checkpoint becomes visible by one rename of its finished directory, and
`latest` moves by one rename of a small file, so a kill at any moment leaves
`latest` naming a complete checkpoint (or no `latest` at all before the first).
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from moerl.checkpoint.digests import write_file
from moerl.checkpoint.manifest import MANIFEST, fsync_dir

LATEST = "latest"
_STEP_DIR = re.compile(r"^step_(\d{8,})$")


def step_name(step: int) -> str:
    return f"step_{step:08d}"


def partial_dir(root: Path, step: int) -> Path:
    return root / f".{step_name(step)}.partial"


def step_of(path: Path) -> int | None:
    match = _STEP_DIR.match(path.name)
    return int(match.group(1)) if match else None


def is_complete(path: Path) -> bool:
    """Renamed into place with its manifest (verification is the loader's job)."""
    return step_of(path) is not None and (path / MANIFEST).is_file()


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and is_complete(p)]
    return sorted(found, key=lambda p: step_of(p) or 0)


def read_latest(root: Path) -> Path | None:
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    return root / pointer.read_text().strip()


def publish(partial: Path, final: Path) -> None:
    """Rename a finished checkpoint into place, then point `latest` at it."""
    if final.exists():
        raise FileExistsError(f"checkpoint {final} exists already")
    os.replace(partial, final)
    fsync_dir(final.parent)
    tmp = final.parent / f".{LATEST}.tmp"
    write_file(tmp, (final.name + "\n").encode())
    os.replace(tmp, final.parent / LATEST)
    fsync_dir(final.parent)


def remove_stale_partials(root: Path) -> None:
    """Leftovers of saves a kill interrupted; never read, safe to delete."""
    if root.is_dir():
        for path in root.iterdir():
            if path.name.startswith(".step_") and path.is_dir():
                shutil.rmtree(path, ignore_errors=True)


def cleanup(root: Path, keep_last: int) -> list[Path]:
    """Delete all but the newest `keep_last` complete checkpoints.

    The one `latest` names is always kept, and so is the newest complete one,
    so a cleanup can never leave the run without a checkpoint to resume from.
    """
    complete = complete_checkpoints(root)
    if keep_last <= 0 or len(complete) <= keep_last:
        return []
    latest = read_latest(root)
    protected = {p.resolve() for p in complete[-keep_last:]}
    protected.add(complete[-1].resolve())
    if latest is not None:
        protected.add(latest.resolve())
    removed = [p for p in complete if p.resolve() not in protected]
    for path in removed:
        # Rename first: a kill mid-delete leaves a dot-name no reader picks up.
        doomed = path.with_name(f".{path.name}.deleting")
        os.replace(path, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
    return removed
