"""Warm slots: executions launched ahead of time so that a request pays for its
program, not for bubblewrap's set-up.

A slot is one future execution, used once: its own cgroup (with the limits of the
request it will serve), its own empty work dir, bwrap with every namespace, seccomp
and the unprivileged uid, all set up. What the slot holds before it is taken is
only what its launch signature says (argv, limits, read-only binds, channel), so
two requests never share a process, a file or a directory. Either the starter
inside waits on a gate before it execs the program, or (`starts_on_stdin`) the
program is already running and waits for its stdin, which exists only once the
slot is taken: the HumanEval grader has started Python and forked its candidate by
then, which is most of an item's cost.

Slots are launched by one thread that lives as long as the pool: bwrap's
`--die-with-parent` follows the thread that started it, not the process. A taken
slot is replaced once it is finished; `close` kills what is idle and removes its groups and
work dirs. Nothing is carried over from a slot that died while idle: it is
discarded and the request is launched afresh.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from moerl.sandbox.config import Limits
from moerl.sandbox.launch import Launched, discard
from moerl.sandbox.result import ExecutionResult
from moerl.sandbox.workspace import Workspace

log = logging.getLogger(__name__)
_START_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class LaunchSignature:
    """Everything a slot is launched with, and so everything a request must match."""

    argv: tuple[str, ...]
    limits: Limits
    channel: bool
    binds: tuple[tuple[Path, str], ...]
    starts_on_stdin: bool
    """The program does nothing before it reads its stdin, so it may start early."""


@dataclass
class Slot:
    launched: Launched
    workspace: Workspace

    def discard(self) -> None:
        discard(self.launched)
        if self.launched.group is not None:
            self.launched.group.remove()
        self.workspace.remove()


LaunchSlot = Callable[[LaunchSignature], "Slot | ExecutionResult"]


class WarmPool:
    """Up to `slots` idle slots per launch signature, refilled as they are taken."""

    def __init__(self, launch_slot: LaunchSlot, slots: int) -> None:
        self._launch_slot = launch_slot
        self._slots = slots
        self._idle: dict[LaunchSignature, deque[Slot]] = defaultdict(deque)
        self._seen: set[LaunchSignature] = set()
        self._in_use = 0
        self.taken = 0
        """Requests served from an idle slot (the others were launched on demand)."""
        self._lock = threading.Condition()
        self._wanted: queue.SimpleQueue[LaunchSignature | None] = queue.SimpleQueue()
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="sandbox-warm", daemon=True)
        self._thread.start()

    def take(self, signature: LaunchSignature) -> Slot | None:
        """An idle slot of this signature, or None (the first request of a signature
        fills the pool). A taken slot is replaced once it is released: launching while
        the taken program runs would compete with it for the CPU."""
        with self._lock:
            if self._closed:
                return None
            idle = self._idle[signature]
            if signature not in self._seen:
                self._seen.add(signature)
                for _ in range(self._slots):
                    self._wanted.put(signature)
            elif not idle:  # a miss: a slot failed to launch, or requests outrun launches
                self._wanted.put(signature)
            slot = idle.popleft() if idle else None
            self._in_use += slot is not None
            self.taken += slot is not None
        if slot is not None and slot.launched.exited():  # died while idle
            slot.discard()
            with self._lock:
                self.taken -= 1
            self.release(signature)
            return None
        return slot

    def release(self, signature: LaunchSignature) -> None:
        """A taken slot has been finished (its process reaped): launch its replacement."""
        with self._lock:
            self._in_use -= 1
            self._lock.notify_all()
        self._wanted.put(signature)

    def idle_count(self) -> int:
        with self._lock:
            return sum(len(q) for q in self._idle.values())

    def close(self) -> None:
        """Stop launching, wait for the taken slots to finish (their bwrap dies with the
        launching thread), then kill every idle slot and remove its group and work dir."""
        with self._lock:
            self._closed = True
        self._wanted.put(None)
        self._thread.join()
        with self._lock:
            slots = [s for q in self._idle.values() for s in q]
            self._idle.clear()
        for slot in slots:
            slot.discard()

    def _serve(self) -> None:
        while (signature := self._wanted.get()) is not None:
            with self._lock:
                if self._closed or len(self._idle[signature]) >= self._slots:
                    continue
            made = self._launch_slot(signature)
            if not isinstance(made, Slot):
                log.warning("cannot warm a sandbox slot: %s", made.error)
                continue
            if not made.launched.wait_started(_START_TIMEOUT_S):
                # Not ready: a request gets a launch of its own, whose failure says why.
                made.discard()
                continue
            with self._lock:
                if not self._closed:
                    self._idle[signature].append(made)
                    continue
            made.discard()
        with self._lock:  # this thread is the parent of every slot it launched
            self._lock.wait_for(lambda: self._in_use == 0)
