"""Run a plan's stages as processes on this machine.

Servers start first (rewards, then rollouts), each replica in its own process
group so that teardown reaches whatever it forked; the launcher waits until every
replica has announced itself in the rendezvous directory and answers its health
path, then runs the trainer in the foreground while watching the servers. Whatever
happens (success, a crash, Ctrl-C, SIGTERM) every process group gets SIGTERM, then
SIGKILL after a grace period; signals that arrive meanwhile are ignored. Each stage
process is started through `moerl.parent_death`, so it gets SIGTERM when the launcher
dies without a teardown (SIGKILL); torchrun's ranks die with torchrun the same way.
Each process writes to `<log_dir>/<stage>.<i>.log`; with `echo` its lines are also
printed with a `[stage.i]` prefix.

SIGUSR1 to the launcher is the graceful stop: it is passed on to the trainer's
ranks, which finish their step, checkpoint and exit for requeue while the servers
stay up. A trainer that asked for a requeue (the marker in the rendezvous
directory; torchrun reports its ranks' exit code 85 as 1) makes `run()` return
REQUEUE_EXIT_CODE, so the same command continues the run.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import IO, Any

from moerl.launchers.proctree import (
    children,
    descendants,
    group_alive,
    kill_pids,
    signal_group,
    still_running,
)
from moerl.launchers.stage_render import (
    Replica,
    local_command,
    local_port,
    readiness,
    replica_env,
)
from moerl.launchers.stages import RunPlan, StageSpec
from moerl.parent_death import wrapped
from moerl.ports import free_port
from moerl.rendezvous import (
    REQUEUE_EXIT_CODE,
    REQUEUE_MARKER,
    discover,
    wait_healthy,
)

LOG_TAIL_LINES = 30
# The launcher's own signals: SIGINT and SIGTERM tear the run down, SIGUSR1 stops it
# for requeue.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


class StageFailed(RuntimeError):
    """A stage process ended when it should not have; the message names it."""

    def __init__(self, label: str, returncode: int | None, log_path: Path, reason: str) -> None:
        self.label = label
        self.returncode = returncode
        self.log_path = log_path
        tail = log_tail(log_path)
        super().__init__(
            f"stage {label} {reason}"
            + (f" (exit code {returncode})" if returncode is not None else "")
            + f"; last lines of {log_path}:\n{tail}"
        )


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_bytes()[-64 * 1024 :].decode(errors="replace")
    except OSError as err:
        return f"<no log: {err}>"
    return "\n".join(text.splitlines()[-lines:])


@dataclass
class _Proc:
    label: str
    stage: StageSpec
    popen: subprocess.Popen[bytes]
    log_path: Path
    pump: threading.Thread | None = None

    @property
    def pgid(self) -> int:
        return self.popen.pid  # start_new_session makes the child its group's leader


def _pump(src: IO[bytes], log_path: Path, prefix: str | None) -> None:
    """Copy a child's output to its log file (and the console) line by line."""
    with open(log_path, "ab") as log:
        for line in iter(src.readline, b""):
            log.write(line)
            log.flush()
            if prefix is not None:
                sys.stdout.write(prefix + line.decode(errors="replace"))
                sys.stdout.flush()
    src.close()


class Terminated(Exception):
    """SIGTERM to the launcher, turned into an exception so teardown runs."""


@contextmanager
def _signals(usr1: Callable[[], None]) -> Iterator[None]:
    """SIGTERM raises Terminated; SIGUSR1 calls `usr1`; SIGINT raises KeyboardInterrupt
    even where it was inherited as ignored (a background job of a non-interactive
    shell): a signal sent to the launcher always tears the run down. Main thread only."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    # The first signal that tears the run down makes the next ones ignored, so none
    # can cut teardown short (the launcher's `finally`) before it has begun.
    def terminate(signum: int, frame: FrameType | None) -> None:
        _ignore(STOP_SIGNALS)
        raise Terminated(f"launcher got signal {signum}")

    def interrupt(signum: int, frame: FrameType | None) -> None:
        _ignore(STOP_SIGNALS)
        raise KeyboardInterrupt

    def stop(signum: int, frame: FrameType | None) -> None:
        try:
            usr1()
        except Terminated:
            _ignore(STOP_SIGNALS)
            raise

    previous = {sig: signal.signal(sig, handler)
                for sig, handler in ((signal.SIGTERM, terminate), (signal.SIGUSR1, stop),
                                     (signal.SIGINT, interrupt))}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _ignore(signals: tuple[signal.Signals, ...]) -> dict[signal.Signals, Any]:
    """Ignore `signals` (main thread only); returns the handlers they had."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.signal(sig, signal.SIG_IGN) for sig in signals}


@contextmanager
def _ignoring_stop_signals() -> Iterator[None]:
    previous = _ignore(STOP_SIGNALS)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@dataclass
class LocalLauncher:
    """Start `plan` on this machine; `run()` returns the trainer's exit code."""

    plan: RunPlan
    host: str = "127.0.0.1"
    startup_timeout: float = 120.0
    grace: float = 10.0
    echo: bool = False
    procs: list[_Proc] = field(default_factory=list, init=False)
    endpoints: dict[str, list[str]] = field(default_factory=dict, init=False)
    _trainer: _Proc | None = field(default=None, init=False)

    def run(self) -> int:
        """Servers up and healthy, trainer to completion, then everything down.

        Raises StageFailed when a server dies or never becomes healthy, with the
        tail of its log; KeyboardInterrupt passes through after teardown.
        """
        self.plan.log_dir.mkdir(parents=True, exist_ok=True)
        # Announcements left by an earlier run would point at dead servers.
        shutil.rmtree(self.plan.rendezvous_dir, ignore_errors=True)
        self.plan.rendezvous_dir.mkdir(parents=True, exist_ok=True)
        with _signals(self._stop_trainer):
            try:
                for stage in self.plan.servers:
                    self._start_servers(stage)
                for stage in self.plan.servers:
                    self._wait_ready(stage)
                trainer = self.plan.trainer
                self._trainer = self._start(trainer, 0, self.replica_ports(trainer)[0])
                return self._supervise(self._trainer)
            finally:
                self.teardown()

    def _stop_trainer(self) -> None:
        """SIGUSR1: pass it on to the trainer's ranks (they checkpoint, then exit)."""
        if self._trainer is None:
            raise Terminated("launcher got SIGUSR1 before the trainer started")
        pid = self._trainer.popen.pid
        ranks = children(pid) if self._trainer.stage.torchrun else [pid]
        print(f"[launcher] SIGUSR1: trainer ranks {ranks} checkpoint after this step",
              flush=True)
        for rank in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(rank, signal.SIGUSR1)

    def _start_servers(self, stage: StageSpec) -> None:
        for index, port in enumerate(self.replica_ports(stage)):
            self._start(stage, index, port)

    def replica_ports(self, stage: StageSpec) -> list[int]:
        """The port of each of the stage's replicas (`stage_render.local_port`), a free
        one where the rule leaves the choice to the launcher."""
        ports = [local_port(stage, index) for index in range(stage.replicas)]
        return [free_port(self.host) if port is None else port for port in ports]

    def _replica(self, index: int, port: int) -> Replica:
        return Replica(self.host, str(port), str(index))

    def replica_command(self, stage: StageSpec, index: int, port: int) -> list[str]:
        """The argv replica `index` of `stage` is started with (before the parent-death
        wrapper)."""
        return local_command(stage, self._replica(index, port))

    def replica_env(self, stage: StageSpec, index: int, port: int) -> dict[str, str]:
        """What replica `index` of `stage` gets on top of the launcher's environment."""
        return replica_env(stage, self._replica(index, port), str(self.plan.rendezvous_dir))

    def _start(self, stage: StageSpec, index: int, port: int) -> _Proc:
        label = f"{stage.name}.{index}"
        env = {**os.environ, **self.replica_env(stage, index, port)}
        log_path = self.plan.log_dir / f"{label}.log"
        log_path.write_bytes(b"")
        popen = subprocess.Popen(
            # SIGTERM when the launcher dies, even of SIGKILL: no stage outlives it.
            wrapped(self.replica_command(stage, index, port), signal.SIGTERM),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        assert popen.stdout is not None
        prefix = f"[{label}] " if self.echo else None
        pump = threading.Thread(target=_pump, args=(popen.stdout, log_path, prefix), daemon=True)
        pump.start()
        proc = _Proc(label, stage, popen, log_path, pump)
        self.procs.append(proc)
        if self.echo:
            print(f"[launcher] {label}: pid {popen.pid}, log {log_path}", flush=True)
        return proc

    def _check_servers(self) -> None:
        for proc in self.procs:
            if proc.stage.is_server and proc.popen.poll() is not None:
                if proc.pump is not None:  # the last lines, for the error message
                    proc.pump.join(timeout=1.0)
                raise StageFailed(proc.label, proc.popen.returncode, proc.log_path, "exited")

    def _wait_ready(self, stage: StageSpec) -> None:
        deadline = time.monotonic() + self.startup_timeout
        ready = readiness(stage)
        try:
            found = discover(
                self.plan.rendezvous_dir, ready.stage, ready.replicas,
                self.startup_timeout, check=self._check_servers,
            )  # fmt: skip
            for endpoint in found:
                left = max(deadline - time.monotonic(), 1.0)
                wait_healthy(endpoint, left, path=ready.health_path, check=self._check_servers)
        except TimeoutError as err:
            proc = next(p for p in self.procs if p.stage is stage)
            raise StageFailed(stage.name, None, proc.log_path, f"not ready: {err}") from err
        self.endpoints[stage.name] = found

    def _supervise(self, trainer: _Proc) -> int:
        # A server dying mid-run would leave the trainer retrying forever; stop early.
        while (code := trainer.popen.poll()) is None:
            self._check_servers()
            time.sleep(0.2)
        if trainer.pump is not None:
            trainer.pump.join(timeout=5.0)
        if code != 0 and (self.plan.rendezvous_dir / REQUEUE_MARKER).exists():
            return REQUEUE_EXIT_CODE  # checkpointed on a stop signal: run again to continue
        if code != 0:
            # The trainer may notice a dead server (its client gives up) between two
            # polls; the server is then the cause, and the one to name.
            self._check_servers()
        return code

    def teardown(self) -> None:
        """SIGTERM every process group, SIGKILL what is left after `grace` seconds.

        Descendants are recorded first: once their parent is gone they can no
        longer be found, and torchrun's ranks are outside its process group. The
        launcher's own stop signals are ignored meanwhile: a second Ctrl-C (or the
        SIGINT a `timeout` wrapper passes on right after the first) must not cut
        teardown short and leave servers running.
        """
        with _ignoring_stop_signals():
            self._teardown()

    def _teardown(self) -> None:
        strays = {pid: start for p in self.procs for pid, start in descendants(p.pgid).items()}
        for proc in reversed(self.procs):  # trainer first: it is the servers' client
            signal_group(proc.pgid, signal.SIGTERM)
        deadline = time.monotonic() + self.grace
        while time.monotonic() < deadline and (
            any(_alive(p) for p in self.procs) or still_running(strays)
        ):
            time.sleep(0.05)
        for proc in self.procs:
            if _alive(proc):
                signal_group(proc.pgid, signal.SIGKILL)
        kill_pids(still_running(strays))
        for proc in self.procs:
            proc.popen.wait()
            if proc.pump is not None:
                proc.pump.join(timeout=2.0)


def _alive(proc: _Proc) -> bool:
    proc.popen.poll()  # reap the leader: a zombie still counts as a group member
    return group_alive(proc.pgid)
