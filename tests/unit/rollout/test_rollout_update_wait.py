"""The server during a weight update: a request that waits too long gets 503 + Retry-After."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from fastapi.testclient import TestClient
from test_rollout_batching import FakeEngine

from moerl.data.tokenizer import ByteTokenizer
from moerl.rollout.batching import BatchScheduler
from moerl.rollout.engine import EngineOptions
from moerl.rollout.server import ServerState, create_app
from moerl.rollout.types import GenerationRequest


class SlowLoadEngine(FakeEngine):
    """The members the HTTP layer reads, and an update that takes a second."""

    tokenizer = ByteTokenizer()
    options = EngineOptions()
    max_sequence_length = 64
    backend = "fake"
    broken: str | None = None
    ranks = None  # one process
    runner = None  # the static backend
    continuous = None

    def check(self, request: GenerationRequest) -> None:
        pass

    def load_weights(self, path: str | Path, version: int) -> None:
        time.sleep(1.0)
        self.weight_version = version


def test_request_behind_a_slow_update_gets_503_then_the_new_version() -> None:
    engine = SlowLoadEngine()
    scheduler = BatchScheduler(engine, max_batch=8, wait_s=0.0)
    app = create_app(ServerState(engine, scheduler, "tiny", update_wait_s=0.2))  # type: ignore[arg-type]
    with TestClient(app) as http:
        update = threading.Thread(
            target=lambda: http.post("/update_weights", json={"path": "/x", "version": 9}))
        update.start()
        time.sleep(0.1)
        busy = http.post("/v1/completions", json={"prompt": "hi"})
        assert busy.status_code == 503 and busy.headers["retry-after"] == "1"
        assert "version 9" in busy.json()["error"]["message"]
        update.join()
        after = http.post("/v1/completions", json={"prompt": "hi"})
        assert after.status_code == 200 and after.json()["weight_version"] == 9
        assert http.get("/health").json()["weight_version"] == 9
    scheduler.close()
