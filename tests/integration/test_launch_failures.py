"""A stage dying mid-run: the local launcher stops the others and names the stage.

The first test is a real `moerl train` run (tiny model, servers, trainer under
torchrun) whose rollout server is killed once the trainer is in its RL loop. The
others use stand-in processes to pin down two details of teardown: which stage
is named when the trainer exits right after a server died, and that a torchrun
rank (in a session of its own) is not left behind.

"Nothing left behind" is checked by scanning /proc for processes that carry the
run's rendezvous directory in their environment: every stage process and its
children do, and nothing outside the run does.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from moerl.launchers.local import LocalLauncher, StageFailed
from moerl.launchers.stages import RunPlan, StageSpec
from moerl.rendezvous import ENV_RENDEZVOUS

PY = sys.executable


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def run_processes(rendezvous: Path) -> dict[int, str]:
    """Live processes of the run (pid -> command line), found by their environment."""
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and entry.name != str(os.getpid()):
            pid = int(entry.name)
            if _environ(pid).get(ENV_RENDEZVOUS) == str(rendezvous) and not _is_zombie(pid):
                found[pid] = _cmdline(pid)
    return found


def _until(cond: Callable[[], bool], timeout: float, what: str, out: Path) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} within {timeout} s; launcher output:\n"
                        f"{out.read_text(errors='replace')[-4000:]}")
        time.sleep(0.2)


def _stage_pid(rendezvous: Path, stage: str) -> int | None:
    for pid, cmd in run_processes(rendezvous).items():
        rank_or_server = stage != "trainer" or "torch.distributed.run" not in cmd
        if _environ(pid).get("MOERL_STAGE") == stage and "moerl.launchers.cli" in cmd and (
                rank_or_server):
            return pid
    return None


@contextlib.contextmanager
def run_in_rl_loop(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], Path, Path]]:
    """A real `moerl train` (tiny model, servers, trainer under torchrun) once its RL
    loop has begun (the first weights published to the servers); yields the launcher,
    the rendezvous directory and the launcher's output file. Killed on the way out."""
    run, out = tmp_path / "run", tmp_path / "launcher.out"
    argv = [PY, "-m", "moerl.launchers.cli", "train", "+experiment=demo", "sft.steps=0",
            "rl.steps=200", "rl.prompts_per_step=2", "rl.eval_interval=0", "data.eval_size=4",
            f"run_dir={run}"]  # fmt: skip
    rendezvous = run / "rendezvous"
    with open(out, "wb") as sink:
        launcher = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT,
                                    start_new_session=True)
    try:
        _until(lambda: (run / "weights").is_dir() and _stage_pid(rendezvous, "trainer") is not None,
               240, "trainer in its RL loop", out)
        yield launcher, rendezvous, out
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()


@pytest.mark.timeout(300)
def test_killing_the_rollout_server_stops_the_run(tmp_path: Path) -> None:
    victim = "rollout"  # the reward server's death takes the same path (test below)
    with run_in_rl_loop(tmp_path) as (launcher, rendezvous, out):
        assert launcher.poll() is None
        pid = _stage_pid(rendezvous, victim)
        assert pid is not None, run_processes(rendezvous)
        os.kill(pid, signal.SIGKILL)
        code = launcher.wait(timeout=60)
    text = out.read_text(errors="replace")
    assert code != 0, text[-3000:]
    assert f"run failed: stage {victim}.0 exited (exit code -9)" in text, text[-3000:]
    # every pid the launcher started is gone, and nothing else of the run either
    started = [int(line.split("pid ")[1].split(",")[0])
               for line in text.splitlines() if line.startswith("[launcher] ")]
    assert len(started) == 3, text[-3000:]
    assert [p for p in started if not _is_zombie(p)] == []
    assert run_processes(rendezvous) == {}


@pytest.mark.timeout(300)
def test_sigint_to_launcher_and_trainer_together_leaves_nothing(tmp_path: Path) -> None:
    """Ctrl-C as a terminal (or a `timeout` wrapper) delivers it, repeatedly: to the
    launcher and to every trainer process (torchrun and its ranks) at once."""
    with run_in_rl_loop(tmp_path) as (launcher, rendezvous, out):
        trainer = [pid for pid in run_processes(rendezvous)
                   if _environ(pid).get("MOERL_STAGE") == "trainer"]
        assert len(trainer) >= 2, run_processes(rendezvous)  # torchrun and its rank
        for _ in range(3):  # the later ones land while the launcher tears down
            for pid in [launcher.pid, *trainer]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGINT)
            time.sleep(0.15)
        code = launcher.wait(timeout=90)
    assert code != 0, out.read_text(errors="replace")[-3000:]
    _until(lambda: run_processes(rendezvous) == {}, 30, "every process of the run gone", out)


SERVER = """
import http.server, os, sys
from moerl.rendezvous import announce_from_env

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
    def log_message(self, *args):
        pass

server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
announce_from_env("127.0.0.1", server.server_port)
open(sys.argv[1], "w").write(str(os.getpid()))
server.serve_forever()
"""

# Kills the reward server itself, then fails at once, as a client giving up would:
# the launcher may see the trainer's exit before the server's.
TRAINER_AFTER_SERVER = """
import os, signal, sys
os.kill(int(open(sys.argv[1]).read()), signal.SIGKILL)
sys.exit(1)
"""

RANK_IGNORING_TERM = """
import os, signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # e.g. a rank busy checkpointing
open(sys.argv[1], "w").write(str(os.getpid()))
time.sleep(300)
"""


def test_trainer_failing_after_a_server_names_the_server(tmp_path: Path) -> None:
    server = tmp_path / "server.py"
    server.write_text(SERVER)
    trainer = tmp_path / "trainer.py"
    trainer.write_text(TRAINER_AFTER_SERVER)
    pid_file = tmp_path / "server.pid"
    plan = RunPlan(
        (StageSpec("trainer", (PY, str(trainer), str(pid_file)), torchrun=False),
         StageSpec("reward", (PY, str(server), str(pid_file)))),
        rendezvous_dir=tmp_path / "rdv", log_dir=tmp_path / "logs",
    )  # fmt: skip
    with pytest.raises(StageFailed, match=r"stage reward\.0 exited \(exit code -9\)"):
        LocalLauncher(plan, grace=2.0, startup_timeout=60).run()


def test_torchrun_rank_is_not_left_behind(tmp_path: Path) -> None:
    rank = tmp_path / "rank.py"
    rank.write_text(RANK_IGNORING_TERM)
    pid_file = tmp_path / "rank.pid"
    plan = RunPlan((StageSpec("trainer", (PY, str(rank), str(pid_file))),),
                   rendezvous_dir=tmp_path / "rdv", log_dir=tmp_path / "logs")
    launcher = LocalLauncher(plan, grace=1.0)
    # torchrun gets SIGTERM when the test stops the launcher; its own shutdown
    # timeout (30 s) is longer than the grace, so it is SIGKILLed with its rank alive.
    stopper = subprocess.Popen(
        [PY, "-c", f"import os, signal, time, pathlib\n"
                   f"p = pathlib.Path({str(pid_file)!r})\n"
                   f"while not p.exists(): time.sleep(0.1)\n"
                   f"time.sleep(0.5); os.kill({os.getpid()}, signal.SIGTERM)"],
    )  # fmt: skip
    try:
        with pytest.raises(Exception, match="signal 15"):
            launcher.run()
    finally:
        stopper.wait(timeout=120)
    rank_pid = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while not _is_zombie(rank_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _is_zombie(rank_pid), f"rank {rank_pid} outlived the run: {_cmdline(rank_pid)}"
