"""The real reward server (own process, 127.0.0.1, a free port, the real sandbox) and the
real client: hostile batches, lost responses, a killed server (RELIABILITY.md 1-3, 11,
13, 14 at service level)."""

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx
import pytest

from moerl.rendezvous import server_urls
from moerl.rewards.client import RewardClient, RewardClientConfig, ScoreItem
from moerl.rewards.protocol import RewardResult
from moerl.sandbox import Sandbox

pytestmark = pytest.mark.sandbox
ROOT = Path(__file__).resolve().parents[2]


class CountingReward:
    """A reward with a side effect (one line appended per execution), standing in for a
    non-idempotent command. spec: {"file": path, "sleep": seconds, "explode": bool}."""

    name = "count"

    def __init__(self, sandbox: object) -> None:
        pass

    def score(self, completion: str, spec: Mapping[str, Any]) -> RewardResult:
        with open(spec["file"], "a") as fh:
            fh.write(completion + "\n")
        time.sleep(float(spec.get("sleep", 0)))
        if spec.get("explode"):
            raise RuntimeError("reward crashed")
        return RewardResult(reward=1.0)


class OddDetailsReward:
    """A plug-in whose details JSON cannot hold as they are: a NaN, an object, a lone
    surrogate; spec {"not_a_result": true} makes it return a float instead."""

    name = "odd"

    def __init__(self, sandbox: object) -> None:
        pass

    def score(self, completion: str, spec: Mapping[str, Any]) -> RewardResult:
        if spec.get("not_a_result"):
            return 1.0  # type: ignore[return-value]
        return RewardResult(reward=1.0, details={"nan": float("nan"), "obj": object(),
                                                 "text": "\udc80", "big": 10**5000})


def start_server(rendezvous: Path, *flags: str,
                 env: Mapping[str, str] | None = None) -> subprocess.Popen[bytes]:  # fmt: skip
    """A reward server process on a free port, once it announced itself in `rendezvous`."""
    if not Path("/usr/bin/bwrap").exists():
        pytest.skip("bubblewrap is not installed")
    proc = subprocess.Popen(
        [sys.executable, "-m", "moerl.rewards.server", "--host", "127.0.0.1", "--port", "0",
         "--rendezvous-dir", str(rendezvous), *flags],
        cwd=ROOT, env={**os.environ, **(env or {}),
                       "PYTHONPATH": f"{ROOT / 'src'}:{Path(__file__).parent}"},
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not server_urls(rendezvous, "reward") and time.monotonic() < deadline:
            assert proc.poll() is None, "reward server exited during start-up"
            time.sleep(0.1)
        assert server_urls(rendezvous, "reward"), "reward server never announced itself"
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    rendezvous = tmp_path_factory.mktemp("rendezvous")
    proc = start_server(
        rendezvous, "--max-concurrency", "2",
        "--reward", "humaneval=humaneval", "--reward", "stdio=stdio",
        "--reward", "math=math", "--reward", "format=format",
        "--reward", f"count={__name__}:CountingReward",
        "--reward", f"odd={__name__}:OddDetailsReward",
    )  # fmt: skip
    yield proc, rendezvous
    proc.kill()
    proc.wait()


def client(rendezvous: Path, **kw: Any) -> RewardClient:
    cfg = RewardClientConfig(backoff_base_s=0.05, backoff_cap_s=0.2, **kw)
    return RewardClient(cfg, rendezvous_dir=rendezvous, seed=0)


PRINTS_OK = {"language": "python", "cases": [{"input": "", "output": "ok"}]}
HE = {
    "prompt": "def sq(x):\n",
    "entry_point": "sq",
    "test": "def check(candidate):\n    assert candidate(3) == 9\n    assert candidate(0) == 0\n",
}


def test_mixed_hostile_batch_is_scored_and_the_server_survives(server: tuple[Any, Path]) -> None:
    proc, rendezvous = server
    items = [
        ScoreItem("humaneval", "    return x * x\n", HE),
        ScoreItem("humaneval", "    import os; os._exit(0)\n", HE),
        ScoreItem("stdio", "print('ok')", PRINTS_OK),
        ScoreItem("stdio", "import os\nwhile True:\n    try: os.fork()\n    except OSError: pass\n",
                  {**PRINTS_OK, "limits": {"wall_time_s": 2}}),
        ScoreItem("stdio", "x = []\nwhile True: x.append(b'x' * (16 << 20))\n", PRINTS_OK),
        ScoreItem("stdio", "while True: print('y' * 100000)\n", PRINTS_OK),
        ScoreItem("math", "so \\boxed{12}", {"answer": "12"}),
        ScoreItem("format", "<answer>1</answer>", {"tag": "answer"}),
        ScoreItem("nope", "", {}),
    ]  # fmt: skip
    report = client(rendezvous).score(items, step=0)
    rewards = [r.reward for r in report.results]
    assert rewards[:8] == [1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0, 1.0]
    statuses = [r.status for r in report.results[3:6]]
    assert statuses == ["timeout", "memory_limit", "output_limit"]
    assert report.results[8].error_kind == "invalid_spec"
    assert report.metrics["reward/infra_errors"] == 0
    health = httpx.get(f"{server_urls(rendezvous, "reward")[0]}/health", timeout=5).json()
    assert health["status"] == "ok" and proc.poll() is None


def test_a_poison_item_leaves_the_rest_of_its_batch_scored(server: tuple[Any, Path]) -> None:
    """A program whose error text holds a lone surrogate (plain ASCII source), and an id
    that holds one, cannot turn the response into an error for the whole batch."""
    _, rendezvous = server
    poison = "    return x * x\nraise ValueError('\\udc80')\n"
    items = [{"id": f"ok-{i}", "reward": "humaneval", "completion": "    return x * x\n",
              "spec": HE} for i in range(6)]  # fmt: skip
    items.insert(2, {"id": "poison", "reward": "humaneval", "completion": poison, "spec": HE})
    items.insert(5, {"id": "bad-\udc80", "reward": "humaneval",
                     "completion": "    return x * x\n", "spec": HE})  # fmt: skip
    body = json.dumps({"items": items})  # ensure_ascii: the surrogates travel escaped
    response = httpx.post(f"{server_urls(rendezvous, "reward")[0]}/score", content=body, timeout=60,
                          headers={"content-type": "application/json"})  # fmt: skip
    assert response.status_code == 200, response.text
    rows = response.json()["results"]
    assert len(rows) == 8
    assert [r["reward"] for r in rows if r["id"].startswith("ok-")] == [1.0] * 6
    poisoned = next(r for r in rows if r["id"] == "poison")
    assert poisoned["reward"] == 0.0 and poisoned["escaped"] is True
    assert "\\udc80" in poisoned["details"]["load_error"]
    bad_id = rows[5]
    assert bad_id["error_kind"] == "invalid_spec" and bad_id["escaped"] is True
    assert bad_id["error"].startswith("item rejected: id:")


def _post(rendezvous: Path, items: list[Any]) -> list[dict[str, Any]]:
    body = json.dumps({"items": items})  # ensure_ascii: lone surrogates travel escaped
    response = httpx.post(f"{server_urls(rendezvous, "reward")[0]}/score", content=body, timeout=60,
                          headers={"content-type": "application/json"})  # fmt: skip
    assert response.status_code == 200, response.text
    rows: list[dict[str, Any]] = response.json()["results"]
    assert len(rows) == len(items)
    return rows


def test_a_lone_surrogate_in_one_completion_leaves_the_batch_scored(
    server: tuple[Any, Path],
) -> None:
    """The completion of a model whose bytes were decoded with surrogateescape: scored
    as U+FFFD in the code (a compile error, reward 0), never an infra error, and the
    seven beside it pass; the same batch through the client, which encodes it itself."""
    correct = "    return x * x\n"
    completions = [correct] * 8
    completions[3] = "    return x \udc80 x\n"
    items = [{"id": uuid.uuid4().hex, "reward": "humaneval", "completion": c, "spec": HE}
             for c in completions]  # fmt: skip
    rows = _post(server[1], items)
    assert [r["reward"] for r in rows] == [1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0], rows
    bad = rows[3]
    assert bad["error_kind"] is None and bad["compile_ok"] is False
    assert bad["details"]["completion_repaired"] == 1
    report = client(server[1]).score([ScoreItem("humaneval", c, HE) for c in completions], 0)
    assert [r.reward for r in report.results] == [1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0]
    assert report.metrics["reward/repaired_completions"] == 1
    assert report.metrics["reward/infra_errors"] == 0


def test_hostile_contents_of_one_item_are_answered_for_that_item(
    server: tuple[Any, Path],
) -> None:
    """Every other kind of value that used to fail a batch, each beside a good item:
    reference data that is not valid Unicode or nests too deep, a number past Python's
    parser or past any float, a NUL in a program, a non-object item, a plug-in whose
    details JSON cannot hold or that returns no RewardResult."""
    deep: Any = "leaf"
    for _ in range(100):
        deep = [deep]
    refused: list[tuple[Any, str]] = [
        ({"reward": "humaneval", "completion": "    return x * x\n",
          "spec": {**HE, "test": HE["test"] + "# \udc80\n"}}, "spec.test holds a lone"),
        ({"reward": "stdio", "completion": "print('ok')",
          "spec": {**PRINTS_OK, "cases": [{"input": "\ud800", "output": "ok"}]}},
         "spec.cases[0].input holds a lone"),
        ({"reward": "stdio", "completion": "print('ok')", "spec": {**PRINTS_OK, "deep": deep}},
         "nests deeper than"),
        ({"reward": "math\udc80", "completion": "1", "spec": {"answer": "1"}}, "reward"),
        ({"reward": "stdio", "completion": "print('ok')",
          "spec": {**PRINTS_OK, "limits": {"wall_time_s": "LONG"}}},
         "spec.limits.wall_time_s is a number of 5000 digits"),
        (42, "item rejected"),
    ]  # fmt: skip
    scored: list[tuple[dict[str, Any], float]] = [
        ({"reward": "stdio", "completion": "print('ok')  # \udc80", "spec": PRINTS_OK}, 1.0),
        ({"reward": "stdio", "completion": "print('ok')\x00", "spec": PRINTS_OK}, 0.0),
        ({"reward": "stdio", "completion": "print('ok')",
          "spec": {**PRINTS_OK, "limits": {"wall_time_s": 10**400}}}, 1.0),
        ({"reward": "odd", "completion": "", "spec": {}}, 1.0),
    ]  # fmt: skip
    good = {"reward": "humaneval", "completion": "    return x * x\n", "spec": HE}
    items: list[Any] = []
    for item, _ in [*refused, *scored]:
        items.append({"id": uuid.uuid4().hex, **item} if isinstance(item, dict) else item)
        items.append({"id": uuid.uuid4().hex, **good})
    # An integer of 5000 digits, which Python's own JSON parser refuses, whole document.
    body = json.dumps({"items": items}).replace('"LONG"', "9" * 5000)
    response = httpx.post(f"{server_urls(server[1], "reward")[0]}/score", content=body, timeout=60,
                          headers={"content-type": "application/json"})  # fmt: skip
    assert response.status_code == 200, response.text
    rows = response.json()["results"]
    assert [r["reward"] for r in rows[1::2]] == [1.0] * (len(refused) + len(scored))
    for row, (_, why) in zip(rows[0 : 2 * len(refused) : 2], refused, strict=True):
        assert row["error_kind"] == "invalid_spec" and why in row["error"], row
    for row, (_, reward) in zip(rows[2 * len(refused) :: 2], scored, strict=True):
        assert row["error_kind"] is None and row["reward"] == reward, row
    odd = rows[-2]["details"]
    assert rows[-2]["escaped"] is True and odd["nan"] == "nan" and odd["text"] == "\\udc80"
    assert odd["obj"].startswith("<object") and odd["big"].startswith("<an integer of")
    not_a_result = _post(server[1], [{"id": uuid.uuid4().hex, "reward": "odd",
                                      "completion": "", "spec": {"not_a_result": True}}])[0]
    assert not_a_result["error_kind"] == "infra" and "returned a float" in not_a_result["error"]


def test_a_batch_over_the_limit_is_refused_with_413(server: tuple[Any, Path]) -> None:
    url = server_urls(server[1], "reward")[0]
    limit = httpx.get(f"{url}/health", timeout=5).json()["max_batch_items"]
    items = [{"id": f"i{i}", "reward": "nope", "completion": "", "spec": {}}
             for i in range(limit + 1)]  # fmt: skip
    response = httpx.post(f"{url}/score", json={"items": items}, timeout=60)
    assert response.status_code == 413 and f"limit of {limit}" in response.text
    assert httpx.post(f"{url}/score", json={"items": items[:limit]}, timeout=60).status_code == 200


def test_an_oversized_completion_is_refused_by_rule(server: tuple[Any, Path]) -> None:
    url = server_urls(server[1], "reward")[0]
    limit = httpx.get(f"{url}/health", timeout=5).json()["max_completion_bytes"]
    correct = "    return x * x\n"
    padded = correct + "# " + "x" * limit + "\n"
    items = [{"id": "big", "reward": "humaneval", "completion": padded, "spec": HE},
             {"id": "small", "reward": "humaneval", "completion": correct, "spec": HE}]
    rows = httpx.post(f"{url}/score", json={"items": items}, timeout=60).json()["results"]
    assert rows[0]["error_kind"] == "invalid_spec" and f"limit of {limit}" in rows[0]["error"]
    assert rows[1]["reward"] == 1.0


def test_reward_crash_is_an_infra_error(server: tuple[Any, Path], tmp_path: Path) -> None:
    spec = {"file": str(tmp_path / "log"), "explode": True}
    report = client(server[1], max_attempts=2).score([ScoreItem("count", "x", spec)], step=0)
    result = report.results[0]
    assert (
        result.reward is None and result.error_kind == "infra" and "crashed" in (result.error or "")
    )
    assert report.metrics["reward/infra_errors"] == 1


def test_lost_response_does_not_run_a_command_twice(
    server: tuple[Any, Path], tmp_path: Path
) -> None:
    log = tmp_path / "executions"
    spec = {"file": str(log), "sleep": 1.5}
    # The client stops waiting after 0.5 s, twice; the retry carries the same id, so the
    # server joins the execution already running instead of starting another.
    report = client(server[1], timeout_s=0.5, max_attempts=8).score(
        [ScoreItem("count", "rm -rf /precious", spec)], step=0
    )
    assert report.results[0].reward == 1.0 and report.metrics["reward/retries"] >= 1
    assert log.read_text().splitlines() == ["rm -rf /precious"]


def _marked(marker: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


def test_killed_server_takes_its_sandboxes_along_then_clients_see_infra_errors(
    server: tuple[subprocess.Popen[bytes], Path],
) -> None:
    proc, rendezvous = server
    marker = f"moerl-served-{uuid.uuid4().hex}"
    url = server_urls(rendezvous, "reward")[0]
    program = (
        "import subprocess, time\n"
        "nap = ['/usr/bin/python3', '-c', 'import time; time.sleep(999)']\n"
        f"subprocess.Popen(['setsid', *nap, '{marker}'])\n"
        "time.sleep(999)\n"
    )
    item = {"id": uuid.uuid4().hex, "reward": "stdio", "completion": program,
            "spec": {"language": "python", "cases": [{"input": "", "output": ""}]}}  # fmt: skip
    with pytest.raises(httpx.HTTPError), httpx.Client(timeout=20) as http:
        pending = http.build_request("POST", f"{url}/score", json={"items": [item]})
        deadline = time.monotonic() + 15

        def kill_when_running() -> None:
            while not _marked(marker) and time.monotonic() < deadline:
                time.sleep(0.05)
            proc.send_signal(signal.SIGKILL)

        threading.Thread(target=kill_when_running, daemon=True).start()
        http.send(pending)
    proc.wait()
    deadline = time.monotonic() + 5
    while _marked(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _marked(marker) == []
    # The server is gone: its clients get infra errors after retries, not rewards of 0.
    report = client(rendezvous, max_attempts=2).score(
        [ScoreItem("format", "<answer>1</answer>", {})], step=1
    )
    assert report.results[0].reward is None and report.results[0].error_kind == "infra"
    # What the killed server left (its empty cgroups, its work dir) goes with the next one.
    Sandbox()
    leftovers = list(Path(tempfile.gettempdir(), "moerl-sandbox-work").glob(f"run-{proc.pid}-*"))
    assert leftovers == []


def test_sigterm_answers_queued_items_and_exits_clean(tmp_path: Path) -> None:
    """SIGTERM with a batch queued: the running item finishes, the queued ones come back
    as cancelled infra errors (the client sends them elsewhere), and the server exits
    within its grace period leaving no work dir behind."""
    rendezvous = tmp_path / "rendezvous"
    proc = start_server(rendezvous, "--max-concurrency", "1", "--grace-s", "20")
    try:
        url = server_urls(rendezvous, "reward")[0]
        # A HumanEval item first: the server then keeps a warm slot launched (its own work
        # dir and cgroup, a grader waiting on stdin), which the shutdown must remove too.
        he = {"id": "he", "reward": "humaneval", "completion": "    return x * x\n", "spec": HE}
        first = httpx.post(f"{url}/score", json={"items": [he]}, timeout=60).json()["results"]
        assert first[0]["reward"] == 1.0, first
        work = Path(tempfile.gettempdir(), "moerl-sandbox-work")
        deadline = time.monotonic() + 30
        while not list(work.glob(f"run-{proc.pid}-*[!d]")) and time.monotonic() < deadline:
            time.sleep(0.05)  # the warm slot's work dir (not the shared dir of binds)
        assert list(work.glob(f"run-{proc.pid}-*[!d]")), "no warm slot was launched"
        naps = {"language": "python", "cases": [{"input": "", "output": "ok"}]}
        items = [{"id": f"nap-{i}", "reward": "stdio", "spec": naps,
                  "completion": "import time\ntime.sleep(1.5)\nprint('ok')\n"}
                 for i in range(8)]  # fmt: skip
        answer: list[httpx.Response] = []
        sender = threading.Thread(target=lambda: answer.append(
            httpx.post(f"{url}/score", json={"items": items}, timeout=60)))
        sender.start()
        time.sleep(1.0)  # the first item is running, the other seven are queued
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=20)
        sender.join(timeout=20)
    finally:
        proc.kill()
        proc.wait()
    assert answer and answer[0].status_code == 200, answer
    rows = answer[0].json()["results"]
    done = [r for r in rows if r["reward"] == 1.0]
    cancelled = [r for r in rows if r["error_kind"] == "infra"
                 and r["details"].get("stage") == "cancelled"]  # fmt: skip
    assert len(done) >= 1 and len(done) + len(cancelled) == 8, rows
    assert len(cancelled) >= 5, rows
    assert list(work.glob(f"run-{proc.pid}-*")) == []


def test_a_private_tmpdir_does_not_turn_every_item_into_an_infra_error(tmp_path: Path) -> None:
    """TMPDIR under a 0700 directory (a SLURM job's per-job tmp): the sandbox user
    cannot reach it, so the server places its work dirs where it can (RELIABILITY.md
    28) and a correct completion scores 1.0."""
    private = tmp_path / "job-tmp"
    private.mkdir(mode=0o700)
    os.chmod(private, 0o700)  # whatever the umask
    rendezvous = tmp_path / "rendezvous"
    proc = start_server(rendezvous, "--max-concurrency", "1", env={"TMPDIR": str(private)})
    try:
        item = {"id": "he", "reward": "humaneval", "completion": "    return x * x\n", "spec": HE}
        (row,) = _post(rendezvous, [item])
        assert row["reward"] == 1.0, row
        # The warm slot launched next lives outside the private dir too.
        assert not list(private.rglob("run-*")), list(private.rglob("*"))
    finally:
        proc.kill()
        proc.wait()
