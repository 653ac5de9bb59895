"""Where the work dirs of executions live: a directory the sandbox user can reach.

Run as root, bubblewrap starts as the unprivileged sandbox uid (see bwrap.py), and it
must be able to search every directory above a work dir to bind it. A private temp
dir (a SLURM job's per-job TMPDIR, a per-user tmp: mode 0700) would make every
execution fail with "Can't find source path ...: Permission denied", an infra error
per item. So the work root is placed once, when the sandbox is built: under the temp
dir when the sandbox user can reach it, else under the first shared temp dir it can
(/tmp, /var/tmp, /dev/shm), and a sandbox that finds none refuses to start, naming
the directory in the way and the fix. A work root set in `SandboxConfig.work_root` is
used as it is, or refused.

The root itself is the server's own (created 0711: the sandbox user passes through
but cannot list it); one owned by another user is not used, since its owner could
replace what is in it.
"""

from __future__ import annotations

import logging
import os
import stat
import tempfile
from collections.abc import Sequence
from pathlib import Path

log = logging.getLogger(__name__)
DIR_NAME = "moerl-sandbox-work"
SHARED_TEMP_DIRS = (Path("/tmp"), Path("/var/tmp"), Path("/dev/shm"))
_ROOT_MODE = 0o711


class WorkRootUnusable(RuntimeError):
    """No directory for work dirs that the sandbox user can reach; says why and the fix."""


def blocking_dir(path: Path, uid: int, gid: int) -> tuple[Path, int, int] | None:
    """The first directory from / down to `path` (itself included) that `uid`, with group
    `gid` and no other groups, may not search, as (dir, mode, owner uid); None when every
    one of them that exists lets it through. Permission bits only, not ACLs: the probe
    run of preflight.py catches what these miss."""
    absolute = path.absolute()
    for current in [*reversed(absolute.parents), absolute]:
        try:
            info = os.stat(current)
        except FileNotFoundError:
            return None
        if info.st_uid == uid:
            bit = stat.S_IXUSR
        elif info.st_gid == gid:
            bit = stat.S_IXGRP
        else:
            bit = stat.S_IXOTH
        if not info.st_mode & bit:
            return current, stat.S_IMODE(info.st_mode), info.st_uid
    return None


def _problem(root: Path, sandbox_ids: tuple[int, int] | None) -> str | None:
    """Why `root` cannot hold work dirs (it is created if need be), or None when it can."""
    try:
        root.mkdir(mode=_ROOT_MODE, parents=True, exist_ok=True)
        info = os.lstat(root)
    except OSError as exc:
        return f"cannot create {root}: {exc.strerror}"
    if not stat.S_ISDIR(info.st_mode):
        return f"{root} is not a directory"
    if info.st_uid != os.geteuid():
        return f"{root} belongs to uid {info.st_uid}, not to this process's uid {os.geteuid()}"
    if stat.S_IMODE(info.st_mode) & _ROOT_MODE != _ROOT_MODE:
        os.chmod(root, stat.S_IMODE(info.st_mode) | _ROOT_MODE)  # e.g. made under umask 077
    if sandbox_ids is not None:
        blocked = blocking_dir(root, *sandbox_ids)
        if blocked is not None:
            where, mode, owner = blocked
            return (f"{where} (mode {mode:04o}, owner uid {owner}) does not let the sandbox "
                    f"user (uid {sandbox_ids[0]}) search it")  # fmt: skip
    return None


def place_work_root(configured: Path | None, uid: int, gid: int,
                    candidates: Sequence[Path] | None = None) -> Path:  # fmt: skip
    """The directory for work dirs (created): `configured` if it is usable; when none is
    configured, `<dir>/moerl-sandbox-work` for the first usable dir of `candidates`
    (default: the temp dir, then the shared ones). Raises WorkRootUnusable.

    `uid`/`gid` are the sandbox user's; they matter only when this process is root,
    since otherwise bwrap runs as this process's own uid, which made the directory."""
    sandbox_ids = (uid, gid) if os.geteuid() == 0 else None
    if configured is not None:
        configured = configured.resolve()  # a link the user chose is followed once, here
        problem = _problem(configured, sandbox_ids)
        if problem is None:
            return configured
        raise WorkRootUnusable(
            f"the sandbox's work root {configured} cannot be used: {problem}. Every execution "
            f"would fail. Fix: give it to this user and let uid {uid} search every directory "
            f"above it (chmod o+x), or configure another work root")
    if candidates is None:
        candidates = [Path(tempfile.gettempdir()), *SHARED_TEMP_DIRS]
    bases = list(dict.fromkeys(candidates))
    problems: list[str] = []
    for base in bases:
        root = base / DIR_NAME
        problem = _problem(root, sandbox_ids)
        if problem is None:
            if problems:
                log.warning("sandbox work dirs go to %s, not under the temp dir: %s", root,
                            "; ".join(problems))  # fmt: skip
            return root
        problems.append(f"{root}: {problem}")
    raise WorkRootUnusable(
        "no directory for the sandbox's work dirs is usable, so every execution would fail: "
        f"{'; '.join(problems)}. Fix: set TMPDIR to a directory of this user's that uid {uid} "
        f"may search, with every directory above it (chmod o+x), e.g. a 0711 directory on "
        "the node's local disk")
