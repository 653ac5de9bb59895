"""LocalLauncher with stand-in servers and trainers (stdlib HTTP, small scripts).

Every process records its pid, and each server also forks a `sleep` into its
process group, so "nothing left behind" is checked pid by pid.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moerl import rendezvous
from moerl.launchers import stages
from moerl.launchers.local import LocalLauncher, StageFailed
from moerl.launchers.stages import RunPlan, StageSpec
from moerl.rendezvous import announce, discover, read_endpoints

PY = sys.executable
SRC = str(Path(__file__).resolve().parents[3] / "src")

SERVER = """
import http.server, os, signal, subprocess, sys, threading
from pathlib import Path
from moerl.rendezvous import announce_from_env

pids, mode, port = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3].split("=")[1])
name = f"{os.environ['MOERL_STAGE']}.{os.environ['MOERL_STAGE_INDEX']}"
(pids / f"{name}.pid").write_text(str(os.getpid()))
(pids / f"{name}.port-given").write_text(str(port))
child = subprocess.Popen(["sleep", "300"])  # stays in this process group
(pids / f"{name}.child.pid").write_text(str(child.pid))
if mode == "crash":
    print("loading the model", flush=True)
    print("boom: no such model", flush=True)
    sys.exit(3)
if mode == "ignore-term":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *args):
        pass

server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Health)
if mode != "silent":
    announce_from_env(os.environ["MOERL_HOST"], server.server_port)
if mode == "die-later":
    # Die once the trainer is running (not on a timer, which races a slow start).
    def die_when_trainer_ready():
        while not (pids / "trainer.ready").exists():
            threading.Event().wait(0.05)
        os._exit(4)
    threading.Thread(target=die_when_trainer_ready, daemon=True).start()
server.serve_forever()
"""

TRAINER = """
import json, os, sys, time, urllib.request
from pathlib import Path
from moerl.rendezvous import read_endpoints

pids, mode = Path(sys.argv[1]), sys.argv[2]
(pids / "trainer.pid").write_text(str(os.getpid()))
rdv = os.environ["MOERL_RENDEZVOUS_DIR"]
found = {s: read_endpoints(rdv, s) for s in ("reward", "rollout")}
codes = [urllib.request.urlopen(f"http://{e}/health").status for v in found.values() for e in v]
(pids / "trainer.json").write_text(json.dumps({"found": found, "codes": codes}))
if mode == "sleep":
    (pids / "trainer.ready").write_text("")
    time.sleep(300)
sys.exit(int(mode))
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"  # a zombie has exited; only its parent's wait is missing


def _pids(directory: Path) -> list[int]:
    return [int(p.read_text()) for p in directory.glob("*.pid")]


def _plan(tmp: Path, *, reward: str = "ok", rollout: str | None = "ok", trainer: str = "0",
          replicas: int = 2, binds_any_port: bool = False) -> RunPlan:  # fmt: skip
    (tmp / "pids").mkdir(exist_ok=True)
    (tmp / "server.py").write_text(SERVER)
    (tmp / "trainer.py").write_text(TRAINER)
    env = {"PYTHONPATH": SRC}

    def server(name: stages.StageName, mode: str, n: int) -> StageSpec:
        argv = (PY, str(tmp / "server.py"), str(tmp / "pids"), mode, "--port={port}")
        return StageSpec(name, argv, replicas=n, env=env, binds_any_port=binds_any_port)

    specs = [server("reward", reward, replicas)]
    if rollout is not None:
        specs.append(server("rollout", rollout, 1))
    trainer_argv = (PY, str(tmp / "trainer.py"), str(tmp / "pids"), trainer)
    specs.append(StageSpec("trainer", trainer_argv, env=env, torchrun=False))
    return RunPlan(tuple(specs), tmp / "rdv", tmp / "logs")


def test_discovers_endpoints_and_leaves_nothing(tmp_path: Path) -> None:
    plan = _plan(tmp_path, rollout="ignore-term")
    launcher = LocalLauncher(plan, grace=1.0, startup_timeout=30)
    assert launcher.run() == 0
    got = json.loads((tmp_path / "pids" / "trainer.json").read_text())
    assert got["found"] == launcher.endpoints
    assert len(got["found"]["reward"]) == 2 and len(got["found"]["rollout"]) == 1
    assert got["codes"] == [200, 200, 200]
    pids = _pids(tmp_path / "pids")
    assert len(pids) == 7  # 3 servers, 3 forked sleeps, the trainer
    assert [p for p in pids if _alive(p)] == []  # the TERM-ignoring one was KILLed
    assert (plan.log_dir / "reward.0.log").exists() and (plan.log_dir / "trainer.0.log").exists()


def test_servers_that_bind_any_port_are_given_port_0(tmp_path: Path) -> None:
    """No window between choosing a port and binding it: the server binds a free one
    and announces it (two runs on one machine took the same chosen port)."""
    plan = _plan(tmp_path, binds_any_port=True)
    launcher = LocalLauncher(plan, grace=1.0, startup_timeout=30)
    assert launcher.run() == 0
    given = {p.name: p.read_text() for p in (tmp_path / "pids").glob("*.port-given")}
    assert given == {"reward.0.port-given": "0", "reward.1.port-given": "0",
                     "rollout.0.port-given": "0"}
    ports = [int(e.rsplit(":", 1)[1]) for v in launcher.endpoints.values() for e in v]
    assert len(ports) == 3 and all(ports)


def test_trainer_exit_code_is_returned(tmp_path: Path) -> None:
    launcher = LocalLauncher(_plan(tmp_path, rollout=None, trainer="5", replicas=1), grace=2.0)
    assert launcher.run() == 5
    assert [p for p in _pids(tmp_path / "pids") if _alive(p)] == []


def test_crashed_server_is_named_with_its_log(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan = _plan(tmp_path, rollout="crash")
    with pytest.raises(StageFailed, match=r"stage rollout\.0 exited \(exit code 3\)") as err:
        LocalLauncher(plan, grace=2.0, startup_timeout=30, echo=True).run()
    assert "loading the model\nboom: no such model" in str(err.value)
    assert "[rollout.0] boom: no such model" in capsys.readouterr().out  # streamed, prefixed
    assert not (tmp_path / "pids" / "trainer.pid").exists()
    assert [p for p in _pids(tmp_path / "pids") if _alive(p)] == []


def test_server_dying_mid_run_stops_the_trainer(tmp_path: Path) -> None:
    plan = _plan(tmp_path, rollout="die-later", trainer="sleep")
    with pytest.raises(StageFailed, match=r"stage rollout\.0 exited \(exit code 4\)"):
        LocalLauncher(plan, grace=2.0, startup_timeout=30).run()
    assert (tmp_path / "pids" / "trainer.ready").exists()
    assert [p for p in _pids(tmp_path / "pids") if _alive(p)] == []


def test_server_that_never_announces_times_out(tmp_path: Path) -> None:
    plan = _plan(tmp_path, rollout=None, reward="silent", replicas=1)
    with pytest.raises(StageFailed, match=r"stage reward not ready: .*0 of 1 endpoints"):
        LocalLauncher(plan, grace=2.0, startup_timeout=1.5).run()
    assert [p for p in _pids(tmp_path / "pids") if _alive(p)] == []


RUN_LAUNCHER = """
import pickle, sys
from moerl.launchers.local import LocalLauncher
plan = pickle.loads(bytes.fromhex(sys.argv[1]))
sys.exit(LocalLauncher(plan, grace=1.0, startup_timeout=30).run())
"""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_to_launcher_tears_down(tmp_path: Path, sig: signal.Signals) -> None:
    import pickle

    plan = _plan(tmp_path, trainer="sleep")
    proc = subprocess.Popen(
        [PY, "-c", RUN_LAUNCHER, pickle.dumps(plan).hex()],
        env={**os.environ, "PYTHONPATH": SRC}, stderr=subprocess.PIPE,
    )  # fmt: skip
    deadline = time.monotonic() + 30
    while not (tmp_path / "pids" / "trainer.ready").exists():
        assert proc.poll() is None and time.monotonic() < deadline, "trainer never started"
        time.sleep(0.05)
    proc.send_signal(sig)  # Ctrl-C, or the scheduler stopping the launcher
    _, err = proc.communicate(timeout=90)  # generous: other runs may still load the machine
    assert proc.returncode != 0
    assert ("KeyboardInterrupt" if sig == signal.SIGINT else "launcher got signal") in err.decode()
    assert [p for p in _pids(tmp_path / "pids") if _alive(p)] == []


def _launch(plan: RunPlan, grace: float) -> subprocess.Popen[bytes]:
    """The launcher in a process of its own, once its trainer is running."""
    import pickle

    proc = subprocess.Popen(
        [PY, "-c", RUN_LAUNCHER.replace("grace=1.0", f"grace={grace}"), pickle.dumps(plan).hex()],
        env={**os.environ, "PYTHONPATH": SRC}, stderr=subprocess.PIPE,
    )  # fmt: skip
    deadline = time.monotonic() + 30
    while not (plan.log_dir.parent / "pids" / "trainer.ready").exists():
        assert proc.poll() is None and time.monotonic() < deadline, "trainer never started"
        time.sleep(0.05)
    return proc


def _until_gone(pids: list[int], timeout: float = 20.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while (alive := [p for p in pids if _alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in alive:  # nothing outlives the test, whatever it found
        os.kill(pid, signal.SIGKILL)
    return alive


def test_signals_during_teardown_do_not_cut_it_short(tmp_path: Path) -> None:
    """Ctrl-C twice, then SIGTERM, while teardown waits out a server that ignores
    SIGTERM: teardown still SIGKILLs it and everything it started."""
    plan = _plan(tmp_path, rollout="ignore-term", trainer="sleep")
    proc = _launch(plan, grace=3.0)
    for sig in (signal.SIGINT, signal.SIGINT, signal.SIGTERM, signal.SIGINT):
        proc.send_signal(sig)
        time.sleep(0.3)
    _, err = proc.communicate(timeout=90)
    assert proc.returncode != 0 and "KeyboardInterrupt" in err.decode(), err.decode()[-2000:]
    assert [p for p in _pids(tmp_path / "pids") if _alive(p)] == []


def test_stages_die_with_a_killed_launcher(tmp_path: Path) -> None:
    """SIGKILL runs no teardown; the parent-death signal still reaches every stage."""
    plan = _plan(tmp_path, trainer="sleep")
    proc = _launch(plan, grace=1.0)
    proc.kill()
    proc.communicate(timeout=30)
    stages = [int(p.read_text()) for p in (tmp_path / "pids").glob("*.pid")
              if ".child." not in p.name]  # fmt: skip
    assert len(stages) == 4  # 2 reward servers, a rollout server, the trainer
    assert _until_gone(stages) == []
    # What a stage forks is the stage's own to stop (the real servers do, on SIGTERM).
    _until_gone(_pids(tmp_path / "pids"), timeout=0)


def test_announce_is_atomic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[str, bool]] = []
    real_replace = os.replace

    def spying_replace(src: str | Path, dst: str | Path) -> None:
        # at the moment of the rename the full address is already on disk and
        # the final name does not exist yet: readers never see a partial file
        seen.append((Path(src).read_text(), Path(dst).exists()))
        real_replace(src, dst)

    monkeypatch.setattr(rendezvous.os, "replace", spying_replace)
    announce(tmp_path, "reward", 0, "127.0.0.1", 8100)
    assert seen == [("127.0.0.1:8100\n", False)]
    # a writer that died before its rename leaves only a dot-file, never an endpoint
    (tmp_path / "reward" / ".1.addr.999.tmp").write_text("127.0.0")
    assert read_endpoints(tmp_path, "reward") == ["127.0.0.1:8100"]
    assert [p.name for p in (tmp_path / "reward").iterdir() if not p.name.startswith(".")] == [
        "0.addr"
    ]


def test_failed_write_publishes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken_fsync(fd: int) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(rendezvous.os, "fsync", broken_fsync)
    with pytest.raises(OSError, match="disk full"):
        announce(tmp_path, "rollout", 0, "127.0.0.1", 8000)
    assert read_endpoints(tmp_path, "rollout") == []
    assert list((tmp_path / "rollout").iterdir()) == []  # no temporary left behind


def test_discover_waits_and_orders(tmp_path: Path) -> None:
    for index, port in ((1, 8001), (0, 8000)):
        announce(tmp_path, "rollout", index, "127.0.0.1", port)
    assert discover(tmp_path, "rollout", 2, timeout=1) == ["127.0.0.1:8000", "127.0.0.1:8001"]
    with pytest.raises(TimeoutError, match="2 of 3 endpoints"):
        discover(tmp_path, "rollout", 3, timeout=0.3)


@pytest.mark.parametrize("engine", ["moerl", "vllm"])
def test_run_plan_gives_port_0_to_servers_that_announce_themselves(
        tmp_path: Path, engine: str) -> None:
    from moerl.config import LaunchConfig
    from moerl.launchers.plan import build_run_plan
    from moerl.rewards.config import RewardStageConfig
    from moerl.rollout.config import RolloutStageConfig

    rollout = RolloutStageConfig(engine=engine, hf_model_dir=str(tmp_path) if engine != "moerl"
                                 else None)  # fmt: skip
    plan = build_run_plan(tmp_path, [], LaunchConfig(), rollout, RewardStageConfig(),
                          tmp_path / "arch.json")
    binds = {s.name: s.binds_any_port for s in plan.stages}
    # The moerl servers bind port 0 and announce; vLLM needs its port chosen for it.
    assert binds == {"trainer": False, "rollout": engine == "moerl", "reward": True}
