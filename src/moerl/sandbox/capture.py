"""Feed stdin and collect the sandbox's pipes with caps, a wall-clock deadline and a
pidfd for the exit, in one selector loop (no thread per pipe)."""

from __future__ import annotations

import contextlib
import os
import selectors
import time
from collections.abc import Callable
from dataclasses import dataclass, field

_CHUNK = 1 << 16
_DRAIN_AFTER_EXIT_S = 2.0
_STARTED_CAP = 16


@dataclass
class Stream:
    fd: int
    cap: int
    data: bytearray = field(default_factory=bytearray)
    truncated: bool = False
    open: bool = True


@dataclass
class Capture:
    stdout: Stream
    stderr: Stream
    started: Stream
    """One byte from the starter inside once bwrap has finished its set-up."""
    channel: Stream | None
    timed_out: bool = False
    output_exceeded: bool = False


def _read(stream: Stream) -> bool:
    """Read one chunk; False at EOF. Bytes past the cap are dropped, not kept."""
    try:
        chunk = os.read(stream.fd, _CHUNK)
    except BlockingIOError:
        return True
    if not chunk:
        return False
    room = stream.cap - len(stream.data)
    stream.data += chunk[: max(room, 0)]
    if len(chunk) > room:
        stream.truncated = True
    return True


def collect(
    *,
    pid_fd: int,
    stdin_fd: int | None,
    stdin_data: bytes,
    streams: Capture,
    deadline: float,
    kill: Callable[[], None],
) -> None:
    """Run until the process has exited and its pipes are drained. `kill` tears the
    whole tree down; it is called on timeout or when stdout/stderr pass their cap."""
    sel = selectors.DefaultSelector()
    readers = [s for s in (streams.stdout, streams.stderr, streams.started, streams.channel) if s]
    for s in readers:
        os.set_blocking(s.fd, False)
        sel.register(s.fd, selectors.EVENT_READ, s)
    sel.register(pid_fd, selectors.EVENT_READ, "exit")
    pending = memoryview(stdin_data)
    if stdin_fd is not None:
        os.set_blocking(stdin_fd, False)
        if pending:
            sel.register(stdin_fd, selectors.EVENT_WRITE, "stdin")
        else:
            os.close(stdin_fd)
            stdin_fd = None
    exited_at: float | None = None
    killed_at: float | None = None

    def kill_once() -> None:
        nonlocal killed_at
        if killed_at is None:
            killed_at = time.monotonic()
            kill()

    try:
        while True:
            now = time.monotonic()
            if exited_at is not None and (
                not any(s.open for s in readers) or now > exited_at + _DRAIN_AFTER_EXIT_S
            ):
                return
            if killed_at is not None and now > killed_at + _DRAIN_AFTER_EXIT_S:
                return  # the caller's teardown takes it from here
            if killed_at is None and now >= deadline:
                streams.timed_out = True
                kill_once()
            timeout = max(0.0, deadline - now) if killed_at is None else 0.05
            for key, _ in sel.select(timeout):
                if key.data == "exit":
                    exited_at = time.monotonic()
                    sel.unregister(pid_fd)
                elif key.data == "stdin":
                    try:
                        pending = pending[os.write(key.fd, pending[:_CHUNK]) :]
                    except (BrokenPipeError, BlockingIOError) as exc:
                        if isinstance(exc, BrokenPipeError):
                            pending = pending[:0]
                    if not pending:
                        sel.unregister(key.fd)
                        os.close(key.fd)
                        stdin_fd = None
                else:
                    stream: Stream = key.data
                    if not _read(stream):
                        stream.open = False
                        sel.unregister(stream.fd)
                    elif stream.truncated and stream in (streams.stdout, streams.stderr):
                        if killed_at is None:
                            streams.output_exceeded = True
                        kill_once()
    finally:
        sel.close()
        if stdin_fd is not None:
            with contextlib.suppress(OSError):
                os.close(stdin_fd)


def new_capture(
    stdout_fd: int,
    stderr_fd: int,
    started_fd: int,
    channel_fd: int | None,
    cap: int,
    channel_cap: int,
) -> Capture:
    return Capture(
        stdout=Stream(stdout_fd, cap),
        stderr=Stream(stderr_fd, cap),
        started=Stream(started_fd, _STARTED_CAP),
        channel=Stream(channel_fd, channel_cap) if channel_fd is not None else None,
    )
