"""Feed stdin and collect the sandbox's pipes with caps, a wall-clock deadline and a
pidfd for the exit, in one poll loop (no thread per pipe). The read ends are made
non-blocking when they are created (`new_capture`), before the execution is taken."""

from __future__ import annotations

import contextlib
import json
import os
import select
import time
from collections.abc import Callable
from dataclasses import dataclass, field

_CHUNK = 1 << 16
_DRAIN_AFTER_EXIT_S = 2.0
_STARTED_CAP = 16
_BWRAP_CAP = 64 << 10


@dataclass
class Stream:
    fd: int
    cap: int
    data: bytearray = field(default_factory=bytearray)
    truncated: bool = False
    open: bool = True
    awaited: bool = True
    """Collection waits for its EOF; otherwise it is drained of what is there at the end."""


@dataclass
class Capture:
    stdout: Stream
    stderr: Stream
    started: Stream
    """One byte from the starter inside once bwrap has finished its set-up."""
    channel: Stream | None
    bwrap: Stream
    """bubblewrap's own stderr: why it could not set up, if it could not."""
    status: Stream
    """bubblewrap's --json-status-fd: `{"child-pid": N}` (the host pid of its pid 1),
    then `{"exit-code": C}` as soon as pid 1 has reaped the program's first process."""
    timed_out: bool = False
    output_exceeded: bool = False
    _reported: dict[str, int] = field(default_factory=dict, init=False, repr=False)
    _parsed_to: int = field(default=0, init=False, repr=False)

    def readers(self) -> list[Stream]:
        return [s for s in (self.stdout, self.stderr, self.started, self.channel, self.bwrap,
                            self.status) if s is not None]  # fmt: skip

    def reported(self, key: str) -> int | None:
        """An integer bubblewrap wrote to its status pipe under `key`, if it has."""
        self._parse_status()
        return self._reported.get(key)

    def _parse_status(self) -> None:
        """Parse the complete lines of the status pipe not parsed yet (each only once:
        this runs after every read of the pipe)."""
        data = self.status.data
        end = data.rfind(b"\n") + 1
        if end <= self._parsed_to:
            return
        for line in bytes(data[self._parsed_to : end]).splitlines():
            with contextlib.suppress(ValueError):
                found = json.loads(line)
                if isinstance(found, dict):
                    self._reported.update((k, v) for k, v in found.items() if type(v) is int)
        self._parsed_to = end


def _read(stream: Stream) -> bool:
    """Read one chunk; False at EOF. Bytes past the cap are dropped, not kept."""
    try:
        chunk = os.read(stream.fd, _CHUNK)
    except BlockingIOError:
        return True
    if not chunk:
        return False
    _keep(stream, chunk)
    return True


def _keep(stream: Stream, chunk: bytes) -> None:
    room = stream.cap - len(stream.data)
    stream.data += chunk[: max(room, 0)]
    if len(chunk) > room:
        stream.truncated = True


def collect(
    *,
    pid_fd: int,
    stdin_fd: int | None,
    stdin_data: bytes,
    streams: Capture,
    deadline: float,
    kill: Callable[[], None],
    go: Callable[[], None] = lambda: None,
    on_quiet: Callable[[], None] = lambda: None,
) -> None:
    """Run until the program has exited (bubblewrap's exit-code, or bubblewrap's own
    exit) and the awaited pipes are drained. `kill` tears the whole tree down; it is
    called on timeout or when stdout/stderr pass their cap. `go` starts the program: it
    is called once everything here is set up, right before the first wait (the program
    often runs on this thread's CPU, and would wait for it). `on_quiet` is called once,
    as soon as every awaited pipe is at EOF (bwrap's report of the exit comes a little
    later: the caller may use the wait)."""
    collector = _Collector(streams, pid_fd, stdin_fd, stdin_data, kill, on_quiet)
    go()
    collector.run(deadline)


class _Collector:
    """One poll loop over the pipes, the pidfd and stdin (no thread per pipe)."""

    def __init__(self, streams: Capture, pid_fd: int, stdin_fd: int | None, stdin_data: bytes,
                 kill: Callable[[], None], on_quiet: Callable[[], None]) -> None:  # fmt: skip
        self.streams, self.pid_fd, self._kill, self._on_quiet = streams, pid_fd, kill, on_quiet
        self.readers = {s.fd: s for s in streams.readers() if s.open}
        self.awaited = [s for s in self.readers.values() if s.awaited]
        self.poll = select.poll()
        for fd in (*self.readers, pid_fd):
            self.poll.register(fd, select.POLLIN)
        self.pending = memoryview(stdin_data)
        self.stdin_fd = stdin_fd
        if stdin_fd is not None:
            os.set_blocking(stdin_fd, False)
            if self.pending:
                self.poll.register(stdin_fd, select.POLLOUT)
            else:
                self._close_stdin()
        self.exited_at: float | None = None
        self.killed_at: float | None = None
        self.quiet = False

    def run(self, deadline: float) -> None:
        try:
            while not self._done(time.monotonic()):
                now = time.monotonic()
                if self.killed_at is None and now >= deadline:
                    self.streams.timed_out = True
                    self._kill_once()
                timeout = max(0.0, deadline - now) if self.killed_at is None else 0.05
                for fd, _ in self.poll.poll(timeout * 1000):
                    self._ready(fd)
                if not self.quiet and not any(s.open for s in self.awaited):
                    self.quiet = True
                    self._on_quiet()
        finally:
            self._close_stdin()
            for s in self.readers.values():
                if s.open and self._worth_draining(s):
                    _drain(s)

    def _worth_draining(self, stream: Stream) -> bool:
        """What the result may still need: an awaited pipe left open (the drain time ran
        out), bwrap's stderr when the program never started, its status before pid 1 is
        known. (Each empty read of a non-blocking pipe raises: on the path of every run.)"""
        streams = self.streams
        if stream is streams.bwrap:
            return not streams.started.data
        if stream is streams.status:
            return streams.reported("child-pid") is None
        return stream.awaited

    def _done(self, now: float) -> bool:
        if self.exited_at is not None and (
            not any(s.open for s in self.awaited) or now > self.exited_at + _DRAIN_AFTER_EXIT_S
        ):
            return True
        # After a kill, the caller's teardown takes it from here.
        return self.killed_at is not None and now > self.killed_at + _DRAIN_AFTER_EXIT_S

    def _ready(self, fd: int) -> None:
        if fd == self.pid_fd:
            self.exited_at = self.exited_at or time.monotonic()
            self.poll.unregister(fd)
        elif fd == self.stdin_fd:
            self._feed()
        elif fd in self.readers:
            self._read(self.readers[fd])

    def _read(self, stream: Stream) -> None:
        streams = self.streams
        if not _read(stream):
            stream.open = False
            self.poll.unregister(stream.fd)
        if stream is streams.status and self.exited_at is None and _exit_reported(streams):
            self.exited_at = time.monotonic()
        elif stream.truncated and stream in (streams.stdout, streams.stderr):
            if self.killed_at is None:
                streams.output_exceeded = True
            self._kill_once()

    def _feed(self) -> None:
        assert self.stdin_fd is not None
        try:
            self.pending = self.pending[os.write(self.stdin_fd, self.pending[:_CHUNK]) :]
        except BlockingIOError:
            return
        except BrokenPipeError:
            self.pending = self.pending[:0]
        if not self.pending:
            self.poll.unregister(self.stdin_fd)
            self._close_stdin()

    def _close_stdin(self) -> None:
        if self.stdin_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.stdin_fd)
            self.stdin_fd = None

    def _kill_once(self) -> None:
        if self.killed_at is None:
            self.killed_at = time.monotonic()
            self._kill()


def _exit_reported(streams: Capture) -> bool:
    """The program's first process has exited (bubblewrap says so before it exits)."""
    return streams.reported("exit-code") is not None


def _drain(stream: Stream) -> None:
    """Take what is in the pipe now, without waiting for more (its fd is non-blocking)."""
    while stream.open and not stream.truncated:
        try:
            chunk = os.read(stream.fd, _CHUNK)
        except OSError:  # BlockingIOError: nothing more for now
            return
        if not chunk:
            stream.open = False
            return
        _keep(stream, chunk)


@dataclass(frozen=True)
class Fds:
    """The host's read ends of an execution's pipes."""

    stdout: int
    stderr: int
    started: int
    channel: int | None
    bwrap: int
    status: int


def new_capture(fds: Fds, cap: int, channel_cap: int, *, await_bwrap: bool) -> Capture:
    """`await_bwrap`: wait for bubblewrap's stderr to close, i.e. for its pid 1 to be
    gone (the proof that the tree is dead where no cgroup can give it)."""
    for fd in (fds.stdout, fds.stderr, fds.started, fds.channel, fds.bwrap, fds.status):
        if fd is not None:
            os.set_blocking(fd, False)
    return Capture(
        stdout=Stream(fds.stdout, cap),
        stderr=Stream(fds.stderr, cap),
        started=Stream(fds.started, _STARTED_CAP),
        channel=Stream(fds.channel, channel_cap) if fds.channel is not None else None,
        bwrap=Stream(fds.bwrap, _BWRAP_CAP, awaited=await_bwrap),
        status=Stream(fds.status, _BWRAP_CAP, awaited=False),
    )
