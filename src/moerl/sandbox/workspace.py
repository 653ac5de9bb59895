"""The one writable directory of an execution, seen from the host.

After a run the directory holds whatever the program left there, symlinks to host paths
included, so nothing here follows a link: files are opened relative to a directory fd
with O_NOFOLLOW and must be regular files.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import tempfile
import threading
from pathlib import Path, PurePosixPath

from moerl.sandbox.workroot import DIR_NAME


class UnsafePath(ValueError):
    pass


def _parts(name: str) -> list[str]:
    path = PurePosixPath(name)
    if path.is_absolute() or not path.parts or any(p in ("..", ".") for p in path.parts):
        raise UnsafePath(f"work dir paths must be relative and plain, got {name!r}")
    return list(path.parts)


def _base(root: Path | None) -> Path:
    """`root`, as `Sandbox` placed it (workroot.py); the default place without one."""
    return root or Path(tempfile.gettempdir()) / DIR_NAME


def sweep_stale_workspaces(root: Path | None) -> int:
    """Remove work dirs whose owner process is gone (e.g. a SIGKILLed server)."""
    removed = 0
    base = _base(root)
    for path in base.glob("run-*-*") if base.is_dir() else []:
        owner = path.name.split("-")[1]
        if owner.isdigit() and not Path(f"/proc/{owner}").exists():
            shutil.rmtree(path, ignore_errors=True)
            removed += 1
    return removed


class Workspace:
    def __init__(self, root: Path | None, owner: tuple[int, int] | None) -> None:
        base = _base(root)
        base.mkdir(mode=0o711, parents=True, exist_ok=True)  # again, if it was removed
        # The owner's pid in the name lets the next sandbox remove what a crash left.
        self.path = Path(tempfile.mkdtemp(prefix=f"run-{os.getpid()}-", dir=base))
        self._owner = owner
        if owner is not None and os.geteuid() == 0:
            # The program runs as the unprivileged uid and must be able to write here.
            os.chown(self.path, *owner)
        os.chmod(self.path, 0o755)

    def write(self, name: str, data: bytes | str, mode: int = 0o644) -> None:
        """Write a file before the run (sources, inputs); readable by the sandbox uid."""
        parts = _parts(name)
        target = self.path.joinpath(*parts)
        target.parent.mkdir(parents=True, exist_ok=True)
        raw = data.encode() if isinstance(data, str) else data
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
        with os.fdopen(fd, "wb") as fh:
            fh.write(raw)

    def read(self, name: str, max_bytes: int) -> bytes:
        """Read a file the program produced, refusing symlinks at every component and
        anything that is not a regular file (a FIFO would block, a device could be huge)."""
        parts = _parts(name)
        dir_fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            for part in parts[:-1]:
                next_fd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dir_fd)
                os.close(dir_fd)
                dir_fd = next_fd
            fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
        except OSError as exc:
            raise UnsafePath(f"cannot read {name!r} from the work dir: {exc}") from exc
        finally:
            os.close(dir_fd)
        with os.fdopen(fd, "rb") as fh:
            if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
                raise UnsafePath(f"{name!r} in the work dir is not a regular file")
            return fh.read(max_bytes)

    def remove(self) -> None:
        # rmtree removes symlinks without following them.
        shutil.rmtree(self.path, ignore_errors=True)

    def __enter__(self) -> Workspace:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def _shared_dir(root: Path | None) -> Path:
    return _base(root) / f"run-{os.getpid()}-shared"


def remove_shared_copies(root: Path | None) -> None:
    """Remove this process's copies of bound files (at exit; the sweep removes those of
    a process that died)."""
    shutil.rmtree(_shared_dir(root), ignore_errors=True)


def readable_copy(host: Path, root: Path | None) -> Path:
    """A world-readable copy of the file `host` for a read-only bind into the sandbox
    (a directory is returned as it is).

    bwrap runs as the unprivileged sandbox uid, which cannot open files below a
    private directory (a checkout in a `mktemp -d` dir is 0700). The copy lives in
    `run-<pid>-shared` under the work root, so the sweep removes it with its owner.
    """
    if host.is_dir():
        return host
    shared = _shared_dir(root)
    digest = hashlib.sha256(str(host.resolve()).encode()).hexdigest()[:16]
    target = shared / f"{digest}-{host.name}"
    if not target.exists() or target.stat().st_mtime < host.stat().st_mtime:
        shared.mkdir(parents=True, exist_ok=True)
        os.chmod(shared, 0o755)
        partial = target.with_name(f".{target.name}.{threading.get_ident()}.tmp")
        shutil.copyfile(host, partial)
        os.chmod(partial, 0o644)
        os.replace(partial, target)
    return target
