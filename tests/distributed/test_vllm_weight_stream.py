"""`rl.weight_sync=memory` with `rollout.engine=vllm`, against a stand-in for vLLM's
API server in development mode: `POST /collective_rpc` runs the named method on every
worker of the engine at once, as vLLM does, and the workers are moerl's worker
extension (`rollout.vllm_extension.WeightReceiver`) mixed into a stand-in worker that
has what vLLM's has (`rank`, `device`, `model_runner.model.load_weights`). Two
workers (tensor parallel 2) really join the trainer's weight group, receive every
tensor and load it; the test checks each got exactly the Hugging Face export of the
same weights, after the first version came by disk (`update_config`,
`reload_weights`) and each version was followed by `/reset_prefix_cache`. The trainer
runs at EP2: each rank owns half the experts, which rank 0 receives before they go out."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from fastapi import FastAPI
from safetensors.torch import load_file

from moerl.rollout.vllm_extension import WeightReceiver

sys.path.insert(0, str(Path(__file__).parent))
from stand_in_server import serving
from worker_launch import run_worker

WORKER = Path(__file__).with_name("hf_stream_worker.py")
TENSOR_PARALLEL = 2


class _Model:
    """What vLLM's model offers the extension: `load_weights` of (name, tensor) pairs."""

    def __init__(self) -> None:
        self.loaded: dict[str, torch.Tensor] = {}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in weights:
            self.loaded[name] = tensor.clone()


class _Worker(WeightReceiver):
    """A vLLM worker as far as the extension and the disk reload see it."""

    def __init__(self, rank: int) -> None:
        self.rank, self.device = rank, torch.device("cpu")
        self.model_runner = SimpleNamespace(model=_Model())
        self.model_paths: list[str] = []

    def update_config(self, overrides: dict[str, Any]) -> None:
        self.model_paths.append(overrides["model_config"]["model"])

    def reload_weights(self) -> None:
        pass


class StandIn:
    """vLLM's dev-mode endpoints: each call of /collective_rpc on every worker at once."""

    def __init__(self) -> None:
        self.workers = [_Worker(rank) for rank in range(TENSOR_PARALLEL)]
        self.calls: list[str] = []
        app = FastAPI()
        app.get("/health")(lambda: {"status": "ok"})
        app.post("/collective_rpc")(self.collective_rpc)
        app.post("/reset_prefix_cache")(self.reset_prefix_cache)
        self.app = app

    def collective_rpc(self, body: dict[str, Any]) -> dict[str, Any]:
        method, args, kwargs = body["method"], body.get("args", []), body.get("kwargs", {})
        self.calls.append(method)
        with ThreadPoolExecutor(len(self.workers)) as pool:
            results = list(pool.map(lambda w: getattr(w, method)(*args, **kwargs),
                                    self.workers))
        return {"results": results}

    def reset_prefix_cache(self) -> dict[str, Any]:
        self.calls.append("reset_prefix_cache")
        return {}


@pytest.fixture
def stand_in() -> Iterator[tuple[StandIn, str]]:
    server = StandIn()
    with serving(server.app) as url:
        yield server, url


def test_vllm_workers_receive_the_hf_export(stand_in: tuple[StandIn, str],
                                            tmp_path: Path) -> None:
    server, url = stand_in
    out = tmp_path / "report.json"
    report = run_worker(WORKER, 2, [
        "--url", url, "--root", str(tmp_path / "weights"), "--expect", str(tmp_path / "expect"),
        "--out", str(out), "--engine", "vllm", "--server-ranks", str(TENSOR_PARALLEL),
        "--ep", "2"], out)
    assert report == {"streamed": 1}
    assert server.calls == ["update_config", "reload_weights", "reset_prefix_cache",
                            "moerl_join_weight_group", "moerl_update_weights",
                            "reset_prefix_cache"]
    expected: dict[str, torch.Tensor] = {}
    for shard in sorted((tmp_path / "expect").glob("*.safetensors")):
        expected.update(load_file(shard))
    for worker in server.workers:
        assert worker.model_paths == [str(tmp_path / "weights" / "v000001")]  # by disk
        assert worker._moerl_version == 2
        loaded = worker.model_runner.model.loaded
        assert set(loaded) == set(expected), worker.rank
        for name, tensor in expected.items():
            assert loaded[name].dtype == tensor.dtype, name
            assert torch.equal(loaded[name], tensor), (worker.rank, name)
