"""`moerl serve env` as the trainer uses it, through `RemoteEnvironment`: episodes of
shipped tasks scored on the server, sessions closed when idle, a full server refusing
new sessions, an environment that crashes recreated from its last snapshot, and an
episode whose server is killed going on on another server."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from moerl.agent.remote import EnvironmentServers, RemoteEnvironment
from moerl.agent.scheduler import AgentScheduler, SchedulerConfig
from moerl.agent.suite import select_tasks
from moerl.agent.tasks import ScriptedPolicy, tagged
from moerl.agent.tools import ToolCall
from moerl.data.tokenizer import ByteTokenizer
from moerl.rendezvous import discover, wait_healthy
from moerl.rollout.types import Sample, SamplingParams

pytestmark = pytest.mark.sandbox
ENVS = Path(__file__).with_name("envs")


SERVERS: dict[str, subprocess.Popen[bytes]] = {}  # URL -> process, while it runs


@contextmanager
def env_server(tmp: Path, *flags: str, extra_env: dict[str, str] | None = None) -> Iterator[str]:
    rendezvous = tmp / f"rendezvous-{len(list(tmp.iterdir()))}"
    env = {**os.environ, **(extra_env or {}), "PYTHONPATH": os.pathsep.join(
        [str(ENVS), *filter(None, [os.environ.get("PYTHONPATH")])])}
    proc = subprocess.Popen([sys.executable, "-m", "moerl.launchers.cli", "serve", "env",
                             "--port", "0", "--rendezvous-dir", str(rendezvous), *flags],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

    def alive() -> None:
        if proc.poll() is not None:
            assert proc.stdout is not None
            raise RuntimeError(f"env server exited {proc.returncode}: {proc.stdout.read()}")

    try:
        (url,) = discover(rendezvous, "environment", 1, timeout=120, check=alive)
        wait_healthy(url, timeout=30, check=alive)
        SERVERS[f"http://{url}"] = proc
        yield f"http://{url}"
    finally:
        SERVERS.pop(f"http://{url}", None)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        assert proc.stdout is not None
        proc.stdout.close()


def _episode(servers: EnvironmentServers, task_id: str, calls: tuple[ToolCall, ...]
             ) -> float | None:
    (task,) = [t for t in select_tasks([task_id])]
    env = RemoteEnvironment(servers)
    try:
        first = env.reset(task.task)
        assert first.fault is None and "Files in /work" in first.text
        assert [t.name for t in env.tools] == ["run", "write_file", "submit"]
        for call in calls:
            assert env.step(call).fault is None
        return env.verify().reward
    finally:
        env.close()


def test_episodes_run_and_are_scored_on_the_server(tmp_path: Path) -> None:
    with env_server(tmp_path) as url:
        servers = EnvironmentServers([url])
        for task in select_tasks(["files-create-greeting", "logs-count-errors"]):
            assert _episode(servers, task.id, task.solution) == 1.0
            assert _episode(servers, task.id, task.wrong) == 0.0
        health = httpx.get(f"{url}/health").json()
        assert (health["opened"], health["sessions"]) == (4, 0)  # each closed after use


def test_idle_sessions_close_and_a_full_server_refuses(tmp_path: Path) -> None:
    with env_server(tmp_path, "--idle-timeout", "1", "--max-sessions", "1") as url:
        servers = EnvironmentServers([url])
        (task,) = select_tasks(["files-create-greeting"])
        env = RemoteEnvironment(servers)
        assert env.reset(task.task).fault is None
        refused = RemoteEnvironment(servers).reset(task.task)
        assert refused.fault is not None and "HTTP 429" in refused.fault
        deadline = time.monotonic() + 20
        while httpx.get(f"{url}/health").json()["closed_idle"] < 1:
            assert time.monotonic() < deadline, "the idle session was never closed"
            time.sleep(0.2)
        lost = env.step(ToolCall("run", {"command": "ls"}))
        assert lost.fault is not None and "HTTP 404" in lost.fault  # an infra fault


def test_a_crashed_environment_is_recreated_from_its_last_snapshot(tmp_path: Path) -> None:
    with env_server(tmp_path) as url:
        servers = EnvironmentServers([url], environment="crashing:CrashingTerminal")
        (task,) = select_tasks(["files-create-greeting"])
        env = RemoteEnvironment(servers)
        assert env.reset(task.task).fault is None
        assert env.step(ToolCall("write_file", {"path": "kept.txt", "content": "x"})).fault is None
        assert env.snapshot()
        assert env.step(ToolCall("write_file", {"path": "lost.txt", "content": "y"})).fault is None
        crashed = env.step(ToolCall("run", {"command": "crash!"}))
        assert crashed.fault is not None and "recreated" in crashed.fault
        listing = env.step(ToolCall("run", {"command": "ls"}))
        assert "kept.txt" in listing.text and "lost.txt" not in listing.text
        assert httpx.get(f"{url}/health").json()["recreated"] == 1
        env.close()


class _KillsItsServer:
    """The task's scripted solution as the policy; before its second action it kills
    (SIGKILL) the server that holds the episode's session."""

    def __init__(self, policy: ScriptedPolicy, env: list[RemoteEnvironment]) -> None:
        self.policy, self.env, self.turns = policy, env, 0
        self.killed: str | None = None

    def generate(self, prompts: Sequence[Sequence[int]], n: int = 1,
                 sampling: SamplingParams | None = None) -> list[list[Sample]]:
        self.turns += 1
        if self.turns == 2:
            (env,) = self.env
            assert env.url is not None
            self.killed = env.url
            SERVERS[env.url].kill()
            SERVERS[env.url].wait(timeout=30)
        return self.policy.generate(prompts, n, sampling)


def test_an_episode_whose_server_is_killed_goes_on_on_another(tmp_path: Path) -> None:
    (task,) = select_tasks(["logs-count-errors"])
    tokenizer = ByteTokenizer()
    with env_server(tmp_path) as first, env_server(tmp_path) as second:
        servers = EnvironmentServers([first, second])
        made: list[RemoteEnvironment] = []

        def environment() -> RemoteEnvironment:
            made.append(RemoteEnvironment(servers))
            return made[-1]

        policy = _KillsItsServer(ScriptedPolicy({task.id: task.solution}, tokenizer), made)
        scheduler = AgentScheduler(policy, environment, tokenizer,
                                   SchedulerConfig(max_turns=8, step_timeout_s=60))
        (traj,) = scheduler.run([tagged(task.task)])
        assert policy.killed == first  # the session was on the first server
        # scored as an uninterrupted episode: solved, no infra failure
        assert traj.reward == 1.0 and traj.infra_error is None, traj
        assert len(traj.faults) == 1 and first in traj.faults[0]
        assert made[0].moved == 1
        health = httpx.get(f"{second}/health").json()
        assert health["opened"] == 1


def _post(url: str, path: str, body: object) -> httpx.Response:
    """`body` encoded ASCII-escaped, so lone surrogates travel as they would from a
    decode with surrogateescape."""
    return httpx.post(f"{url}{path}", content=json.dumps(body), timeout=60,
                      headers={"content-type": "application/json"})  # fmt: skip


def test_a_private_tmpdir_and_hostile_session_inputs(tmp_path: Path) -> None:
    """TMPDIR under a 0700 directory: the server puts its work dirs where the sandbox
    user reaches them (RELIABILITY.md 28). A malformed task is refused naming its field;
    the model's text holding lone surrogates is repaired and run, and a malformed call
    comes back to the model as an error; none of them crashes the environment."""
    private = tmp_path / "job-tmp"
    private.mkdir()
    os.chmod(private, 0o700)
    deep: object = "ls"
    for _ in range(100):
        deep = [deep]
    with env_server(tmp_path, extra_env={"TMPDIR": str(private)}) as url:
        sid = httpx.post(f"{url}/sessions", json={}).json()["id"]
        for task, why in [({"instruction": "x"}, "task.id is missing"),
                          ({"id": "t", "instruction": "x", "files": ["a"]}, "task.files"),
                          ({"id": "t", "instruction": "x", "colour": 1}, "unknown field"),
                          ({"id": "t", "instruction": "x", "files": {"a.txt": "\udc80"}},
                           "task.files.a.txt holds a lone surrogate")]:  # fmt: skip
            refused = _post(url, f"/sessions/{sid}/reset", {"task": task})
            assert refused.status_code == 422 and why in refused.text, refused.text
        check = "def check():\n    return read('out.txt') == 'caf\ufffd'\n"
        task = {"id": "t", "instruction": "x", "files": {"a.txt": "x"}, "check": check}
        assert _post(url, f"/sessions/{sid}/reset", {"task": task}).json()["fault"] is None
        calls = [({"name": "write_file", "arguments": {"path": "out.txt", "content": "caf\udc80"}},
                  False, "wrote 4 characters"),
                 ({"name": "run", "arguments": {"command": "printf '\udc80' | wc -c"}},
                  False, "stdout:\n3"),  # U+FFFD: three bytes of UTF-8
                 ({"name": "write_file", "arguments": {"path": "x"}}, True, "missing required"),
                 ({"name": 3}, True, 'needs a string "name"'),
                 ({"name": "run", "arguments": {"command": deep}}, True, "value nests deeper"),
                 ]  # fmt: skip
        for call, error, says in calls:
            seen = _post(url, f"/sessions/{sid}/step", {"call": call}).json()
            assert seen["fault"] is None and seen["error"] is error and says in seen["text"], seen
        verdict = _post(url, f"/sessions/{sid}/verify", {}).json()
        assert verdict["reward"] == 1.0, verdict
        assert httpx.get(f"{url}/health").json()["recreated"] == 0
        assert not list(private.rglob("run-*"))
