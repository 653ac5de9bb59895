"""The batching client against fake servers (flaky, refusing, too slow): infra errors
are retried with capped jittered backoff, re-sent with the same ids, then surfaced as
infra errors, never as reward 0 (RELIABILITY.md case 13)."""

import json
import random
import socket
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from moerl.retry import backoff_s
from moerl.rewards.client import RewardClient, RewardClientConfig, ScoreItem

Behaviour = Callable[[int, dict], tuple[int, dict] | None]


class FakeServer:
    """Answers /score by `behaviour(request_number, body)`: (status, json) or None to
    hang past the client's timeout. Records every request body."""

    def __init__(self, behaviour: Behaviour) -> None:
        self.requests: list[dict] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.requests.append(body)
                answer = behaviour(len(fake.requests), body)
                if answer is None:
                    time.sleep(1.0)
                    return
                status, payload = answer
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def ok(body: dict, reward: float = 1.0) -> tuple[int, dict]:
    return 200, {"results": [{"id": it["id"], "reward": reward} for it in body["items"]]}


@pytest.fixture
def serve() -> Iterator[Callable[[Behaviour], FakeServer]]:
    servers: list[FakeServer] = []

    def start(behaviour: Behaviour) -> FakeServer:
        servers.append(FakeServer(behaviour))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


def client_for(url: str, **kw: object) -> RewardClient:
    cfg = RewardClientConfig(backoff_base_s=0.01, backoff_cap_s=0.05, **kw)  # type: ignore[arg-type]
    return RewardClient(cfg, urls=(url,), seed=0)


ITEMS = [ScoreItem("format", f"<answer>{i}</answer>", {}) for i in range(3)]


def test_server_errors_are_retried_with_the_same_ids(
    serve: Callable[[Behaviour], FakeServer],
) -> None:
    server = serve(lambda n, body: (503, {}) if n <= 2 else ok(body))
    report = client_for(server.url).score(ITEMS, step=0)
    assert [r.reward for r in report.results] == [1.0, 1.0, 1.0]
    assert report.metrics["reward/retries"] == 2 and report.metrics["reward/infra_errors"] == 0
    ids = [[it["id"] for it in req["items"]] for req in server.requests]
    assert ids[0] == ids[1] == ids[2]  # a retry never creates a second execution


def test_refused_connection_ends_as_infra_error_not_zero() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens here
    report = client_for(f"http://127.0.0.1:{port}", max_attempts=3).score(ITEMS, step=0)
    assert all(r.reward is None and r.error_kind == "infra" for r in report.results)
    assert "after 3 attempts" in (report.results[0].error or "")
    assert report.metrics["reward/infra_errors"] == 3
    assert report.metrics["reward/retries"] == 2


def test_timeouts_are_infra_errors(serve: Callable[[Behaviour], FakeServer]) -> None:
    server = serve(lambda n, body: None)
    report = client_for(server.url, timeout_s=0.2, max_attempts=2).score(ITEMS[:1], step=0)
    assert report.results[0].reward is None and report.results[0].error_kind == "infra"
    assert len(server.requests) == 2


def test_item_infra_errors_are_retried_with_new_ids(
    serve: Callable[[Behaviour], FakeServer],
) -> None:
    def flaky_item(n: int, body: dict) -> tuple[int, dict]:
        if n == 1:
            rows = [{"id": it["id"], "reward": None, "error_kind": "infra", "error": "x"}
                    for it in body["items"]]  # fmt: skip
            return 200, {"results": rows}
        return ok(body, 0.0)

    server = serve(flaky_item)
    report = client_for(server.url).score(ITEMS[:1], step=0)
    assert report.results[0].reward == 0.0  # a real model failure, after the retry
    assert server.requests[0]["items"][0]["id"] != server.requests[1]["items"][0]["id"]


def test_client_errors_are_not_retried(serve: Callable[[Behaviour], FakeServer]) -> None:
    server = serve(lambda n, body: (422, {"detail": "bad"}))
    report = client_for(server.url, retry_item_infra_errors=False).score(ITEMS[:1], step=0)
    assert report.results[0].error_kind == "infra" and len(server.requests) == 1


def test_identical_requests_within_a_step_are_scored_once(
    serve: Callable[[Behaviour], FakeServer],
) -> None:
    server = serve(lambda n, body: ok(body))
    client = client_for(server.url, batch_size=2)
    same = [ITEMS[0], ITEMS[1], ITEMS[0], ITEMS[0]]
    report = client.score(same, step=5)
    assert len(report.results) == 4 and report.metrics["reward/cache_hits"] == 2
    assert sum(len(r["items"]) for r in server.requests) == 2
    client.score(same, step=5)
    assert sum(len(r["items"]) for r in server.requests) == 2  # all from the cache
    client.score(same, step=6)
    assert sum(len(r["items"]) for r in server.requests) == 4  # new step, new cache


def test_limits_hit_are_counted_per_step(serve: Callable[[Behaviour], FakeServer]) -> None:
    hits = [["memory"], ["memory", "pids"], []]

    def answer(n: int, body: dict) -> tuple[int, dict]:
        return 200, {"results": [{"id": it["id"], "reward": 0.0,
                                  "details": {"limits_hit": hits[i]}}
                                 for i, it in enumerate(body["items"])]}  # fmt: skip

    report = client_for(serve(answer).url).score(ITEMS, step=0)
    assert report.metrics["reward/limits/memory"] == 2
    assert report.metrics["reward/limits/pids"] == 1
    assert not any(k.startswith("reward/limits/") and k.endswith("output") for k in report.metrics)


def test_backoff_is_capped_and_jittered() -> None:
    rng = random.Random(1)
    delays = [backoff_s(a, 0.1, 2.0, rng) for a in range(12)]
    assert all(0 < d <= 2.0 for d in delays)
    assert max(delays[6:]) <= 2.0 and min(delays[6:]) >= 1.0
    assert len({round(d, 6) for d in delays[6:]}) > 1  # jittered, not a fixed value
