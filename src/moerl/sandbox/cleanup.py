"""Teardown after the result: removing an execution's cgroup and work dir, and waiting
for bubblewrap's pid 1 to finish unmounting its namespaces, done by one background
thread so that a request does not wait for them.

Only what no program can observe goes here: by the time a job is queued, every process
of the execution is dead (runner.py proves it before it returns the result), and each
execution has a cgroup and a work dir of its own, so a later one never sees what is
still being removed. `drain` waits for every queued job; `close` drains and stops the
thread, and an interpreter that exits with jobs queued drains them first (atexit).
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import weakref
from collections.abc import Callable

log = logging.getLogger(__name__)
Job = Callable[[], None]
_open: weakref.WeakSet[Cleaner] = weakref.WeakSet()


class Cleaner:
    """A FIFO of teardown jobs run by one daemon thread, started on the first job."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closed = False
        _open.add(self)

    def submit(self, job: Job) -> None:
        """Run `job` in the background; at once, here, once the cleaner is closed."""
        with self._lock:  # a job is never queued behind `close`'s end mark
            if not self._closed:
                self._start()
                self._jobs.put(job)
                return
        _run(job)

    def drain(self) -> None:
        """Return once every job submitted so far has run (jobs run in order)."""
        if self._thread is None:
            return
        done = threading.Event()
        self.submit(done.set)
        done.wait()

    def close(self) -> None:
        """Run what is queued, then stop the thread; later jobs run in the caller."""
        with self._lock:
            self._closed = True
            thread = self._thread
        if thread is not None:
            self._jobs.put(None)
            thread.join()

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="sandbox-cleanup", daemon=True)
            self._thread.start()

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            _run(job)


def _run(job: Job) -> None:
    try:
        job()
    except Exception:  # one failed removal must not stop the others
        log.exception("sandbox cleanup failed")


@atexit.register
def _close_all() -> None:
    for cleaner in list(_open):
        cleaner.close()
