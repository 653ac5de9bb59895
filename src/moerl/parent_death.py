"""Processes that die with the process that started them (Linux's parent-death signal).

A stage process, a torchrun rank or the checkpoint writer's helper is started by one
process and must not outlive it, whatever ends that process (SIGKILL included, which
runs no teardown). `PR_SET_PDEATHSIG` makes the kernel send a chosen signal to a
process when its parent exits; it survives `execve` and is not inherited by children,
so every process that must die with its parent sets it itself.

Set from a child right after the fork it races the parent's death: a parent that is
already gone is seen as a parent pid other than the expected one, and the child then
delivers the signal to itself.

Run as a program it is an exec wrapper, for starting a child from a process with
threads (where `preexec_fn` is unsafe):

    python -m moerl.parent_death PARENT_PID SIGNAL -- COMMAND [ARG ...]
"""

from __future__ import annotations

import ctypes
import importlib
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence

_PR_SET_PDEATHSIG = 1
_libc: ctypes.CDLL | None = None


def die_with_parent(parent_pid: int, sig: int = signal.SIGTERM) -> None:
    """Have the kernel send `sig` to this process when its parent exits; if the
    parent (`parent_pid`) is already gone, send it now. Does nothing off Linux."""
    global _libc
    if not sys.platform.startswith("linux"):
        return
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    if _libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent_pid:
        os.kill(os.getpid(), sig)


def die_with_parent_and_preload(parent_pid: int, sig: int, modules: Sequence[str]) -> None:
    """`die_with_parent`, then import `modules` in a background thread: the initializer
    of a helper process that will need them later but must answer at once. This module
    imports nothing heavy, so unpickling this function costs the helper nothing."""
    die_with_parent(parent_pid, sig)

    def preload() -> None:
        time.sleep(0.5)  # let the helper start serving: the imports hold the GIL
        for name in modules:
            try:
                importlib.import_module(name)
            except RuntimeError:
                # importlib's deadlock error: a request being served imports the same
                # modules right now, and that import completes them.
                return

    threading.Thread(target=preload, name="preload", daemon=True).start()


def wrapped(argv: Sequence[str], sig: int = signal.SIGTERM) -> list[str]:
    """`argv` started through this module: it gets `sig` when the caller exits."""
    return [sys.executable, "-m", "moerl.parent_death", str(os.getpid()), str(int(sig)),
            "--", *argv]  # fmt: skip


def main(args: Sequence[str]) -> None:
    if len(args) < 4 or args[2] != "--":
        sys.exit("usage: python -m moerl.parent_death PARENT_PID SIGNAL -- COMMAND [ARG ...]")
    die_with_parent(int(args[0]), int(args[1]))
    os.execvp(args[3], list(args[3:]))


if __name__ == "__main__":
    main(sys.argv[1:])
