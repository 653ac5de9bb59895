"""A small pool of persistent child processes that answer JSON requests under a
wall-clock deadline, usable from any thread.

A worker is a Python program started as `python -m <module> <parent pid> [args...]`
that speaks JSON lines: after its start-up it writes {"ready": true}, then for each
request line read from stdin it writes one reply line to its stdout (see
`math_worker.py`). A request that has no reply by its deadline gets its worker killed
(SIGKILL) and forgotten; the next request starts a new one (lazily, as the first ones
were). Waiting for a free worker does not count against a request's deadline.

Workers never outlive the process that started them: `close()` and the garbage
collector of the pool kill them (and so does the interpreter's exit), and each worker
asks the kernel for SIGKILL when its parent thread ends (`PR_SET_PDEATHSIG`, which
fires even when the parent is SIGKILLed). Because that signal follows the *thread*
that forked the worker, every worker is forked by one long-lived keeper thread, never
by the (possibly short-lived) thread that asked for it.
"""

from __future__ import annotations

import json
import os
import queue
import select
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Sequence
from concurrent.futures import Future
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import moerl

_SOURCE_ROOT = str(Path(moerl.__file__).resolve().parents[1])
_READ_CHUNK = 1 << 16


class WorkerTimeout(Exception):
    """No reply by the deadline; the worker was killed."""


class WorkerDied(Exception):
    """The worker exited (or closed its stdout) before replying."""


class PoolClosed(RuntimeError):
    """The pool was closed; it starts no more workers."""


_SpawnRequest = tuple[list[str], dict[str, str], "Future[subprocess.Popen[bytes]]"]


class _Keeper:
    """The one thread (per process) that forks workers: it lives as long as the process."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests: queue.SimpleQueue[_SpawnRequest] = queue.SimpleQueue()
        self.pid = -1

    def spawn(self, argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        done: Future[subprocess.Popen[bytes]] = Future()
        with self.lock:
            if self.pid != os.getpid():  # first use, or a forked copy of this process
                self.requests = queue.SimpleQueue()
                threading.Thread(target=self._serve, args=(self.requests,),
                                 name="worker-keeper", daemon=True).start()  # fmt: skip
                self.pid = os.getpid()
            self.requests.put((argv, env, done))
        return done.result()

    @staticmethod
    def _serve(requests: queue.SimpleQueue[_SpawnRequest]) -> None:
        while True:
            argv, env, done = requests.get()
            try:
                proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        env=env, close_fds=True)  # fmt: skip
            except BaseException as exc:  # handed to the caller
                done.set_exception(exc)
            else:
                done.set_result(proc)


_KEEPER = _Keeper()


def _child_env() -> dict[str, str]:
    """This process's environment, with this checkout's sources importable first."""
    env = dict(os.environ)
    paths = [_SOURCE_ROOT, *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return env


@dataclass
class _Worker:
    proc: subprocess.Popen[bytes]
    pending: bytes = b""

    def send(self, message: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(message).encode() + b"\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError, OSError) as exc:
            raise WorkerDied(f"worker {self.proc.pid}: {exc}") from exc

    def receive(self, deadline: float) -> dict[str, Any]:
        """The next reply line; WorkerTimeout past `deadline` (time.monotonic)."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.pending:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise WorkerTimeout(f"worker {self.proc.pid}: no reply in time")
            chunk = os.read(fd, _READ_CHUNK)
            if not chunk:
                raise WorkerDied(f"worker {self.proc.pid} exited ({self.proc.poll()})")
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        reply = json.loads(line)
        if not isinstance(reply, dict):
            raise WorkerDied(f"worker {self.proc.pid}: reply is not an object: {line[:200]!r}")
        return reply


def _kill_all(procs: set[subprocess.Popen[bytes]]) -> None:
    """SIGKILL and reap every process of `procs` (the pool's finalizer). Their pipes
    are left to the threads that use them (a reply being awaited ends in EOF)."""
    for proc in list(procs):
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def _kill(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    for stream in (proc.stdin, proc.stdout):
        if stream is not None:
            with suppress(OSError):
                stream.close()


@dataclass
class WorkerPool:
    """Up to `max_workers` workers running `python -m module <our pid> *args`.

    `call(request, timeout_s)` sends `request` to a free worker (starting one if
    fewer than `max_workers` run) and returns its reply; WorkerTimeout when the reply
    takes longer than `timeout_s` (the worker is killed), WorkerDied when the worker
    exits before replying (it is replaced: the caller may retry), PoolClosed after
    `close()`, and RuntimeError when a worker cannot start within `start_timeout_s`.
    Thread-safe.
    """

    module: str
    args: Sequence[str] = ()
    max_workers: int = 2
    start_timeout_s: float = 60.0
    _idle: list[_Worker] = field(default_factory=list, init=False, repr=False)
    _procs: set[subprocess.Popen[bytes]] = field(default_factory=set, init=False, repr=False)
    _starting: int = field(default=0, init=False, repr=False)
    _closed: bool = field(default=False, init=False, repr=False)
    _ready: threading.Condition = field(default_factory=threading.Condition, init=False,
                                        repr=False)  # fmt: skip

    def __post_init__(self) -> None:
        if self.max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {self.max_workers}")
        # Kills the workers when the pool is closed, collected, or the interpreter exits.
        self._finalizer = weakref.finalize(self, _kill_all, self._procs)

    def pids(self) -> list[int]:
        """The process ids of the workers running now."""
        with self._ready:
            return sorted(p.pid for p in self._procs if p.poll() is None)

    def call(self, request: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        worker = self._acquire()
        try:
            worker.send(request)
            reply = worker.receive(time.monotonic() + timeout_s)
        except (WorkerTimeout, WorkerDied, ValueError) as exc:
            self._discard(worker)
            if self._closed:
                raise PoolClosed("the worker pool was closed during the request") from exc
            if isinstance(exc, ValueError):  # a reply that is not JSON: a broken worker
                raise WorkerDied(f"worker {worker.proc.pid}: unreadable reply ({exc})") from exc
            raise
        except BaseException:
            self._discard(worker)
            raise
        self._release(worker)
        return reply

    def close(self) -> None:
        """Kill every worker and refuse further requests. Idempotent."""
        with self._ready:
            self._closed = True
            idle, self._idle = self._idle, []
            self._ready.notify_all()
        self._finalizer()
        for worker in idle:
            self._discard(worker)

    def _acquire(self) -> _Worker:
        with self._ready:
            while True:
                if self._closed:
                    raise PoolClosed("the worker pool is closed")
                if self._idle:
                    return self._idle.pop()
                if len(self._procs) + self._starting < self.max_workers:
                    self._starting += 1
                    break
                self._ready.wait()
        try:
            worker = self._start()
        finally:
            with self._ready:
                self._starting -= 1
                self._ready.notify()
        return worker

    def _start(self) -> _Worker:
        argv = [sys.executable, "-m", self.module, str(os.getpid()), *self.args]
        proc = _KEEPER.spawn(argv, _child_env())
        with self._ready:
            self._procs.add(proc)
            closed = self._closed
        worker = _Worker(proc)
        try:
            if closed:
                raise PoolClosed("the worker pool was closed while a worker started")
            hello = worker.receive(time.monotonic() + self.start_timeout_s)
            if hello.get("ready") is not True:
                raise RuntimeError(f"worker {self.module} said {hello!r} instead of ready")
        except (WorkerTimeout, WorkerDied, ValueError) as exc:
            self._discard(worker)
            if self._closed:
                raise PoolClosed("the worker pool was closed while a worker started") from exc
            raise RuntimeError(f"worker {self.module} did not start: {exc}") from exc
        except BaseException:
            self._discard(worker)
            raise
        return worker

    def _discard(self, worker: _Worker) -> None:
        _kill(worker.proc)
        with self._ready:
            self._procs.discard(worker.proc)
            self._ready.notify()

    def _release(self, worker: _Worker) -> None:
        with self._ready:
            if self._closed or worker.proc not in self._procs:
                closed = True
            else:
                closed = False
                self._idle.append(worker)
                self._ready.notify()
        if closed:
            self._discard(worker)
