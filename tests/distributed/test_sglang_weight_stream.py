"""`rl.weight_sync=memory` with `rollout.engine=sglang`, against a stand-in server that
speaks SGLang's protocol (`/update_weights_from_disk`, `/init_weights_update_group`,
`/update_weights_from_distributed`): it really joins the trainer's weight group and
receives every announced tensor, one broadcast each, as SGLang does; the test then
checks that it got exactly the Hugging Face export of the same weights. The trainer
runs at TP2: rank 0 assembles each tensor from both ranks' halves before it goes out."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi import FastAPI
from safetensors.torch import load_file

from moerl.rollout.weight_group import GroupSpec, open_group

sys.path.insert(0, str(Path(__file__).parent))
from stand_in_server import serving
from worker_launch import run_worker

WORKER = Path(__file__).with_name("hf_stream_worker.py")


class StandIn:
    """What an SGLang server does with the weight-update requests, and what it got."""

    def __init__(self) -> None:
        self.group: Any = None
        self.group_name = ""
        self.from_disk: list[str] = []
        self.received: dict[str, torch.Tensor] = {}
        self.versions: list[str] = []
        app = FastAPI()
        app.get("/health")(lambda: {"status": "ok"})
        app.post("/update_weights_from_disk")(self.update_from_disk)
        app.post("/init_weights_update_group")(self.init_group)
        app.post("/update_weights_from_distributed")(self.update_from_group)
        self.app = app

    def update_from_disk(self, body: dict[str, Any]) -> dict[str, Any]:
        self.from_disk.append(body["model_path"])
        return {"success": True, "message": "loaded"}

    def init_group(self, body: dict[str, Any]) -> dict[str, Any]:
        assert set(body) == {"master_address", "master_port", "rank_offset", "world_size",
                             "group_name", "backend"}
        spec = GroupSpec(body["master_address"], body["master_port"], body["rank_offset"],
                         body["world_size"], body["group_name"], body["backend"], 60.0)
        self.group, self.group_name = open_group(spec, body["rank_offset"]), body["group_name"]
        return {"success": True, "message": "joined"}

    def update_from_group(self, body: dict[str, Any]) -> dict[str, Any]:
        assert body["group_name"] == self.group_name
        for name, dtype, shape in zip(body["names"], body["dtypes"], body["shapes"],
                                      strict=True):
            tensor = torch.empty(shape, dtype=getattr(torch, dtype))
            options = torch.distributed.BroadcastOptions()
            options.rootRank = 0
            self.group.broadcast([tensor], options).wait()
            self.received[name] = tensor
        self.versions.append(body["weight_version"])
        return {"success": True, "message": "updated"}


@pytest.fixture
def stand_in() -> Iterator[tuple[StandIn, str]]:
    server = StandIn()
    with serving(server.app) as url:
        yield server, url


def test_sglang_protocol_stream_carries_the_hf_export(stand_in: tuple[StandIn, str],
                                                      tmp_path: Path) -> None:
    server, url = stand_in
    out = tmp_path / "report.json"
    report = run_worker(WORKER, 2, ["--url", url, "--root", str(tmp_path / "weights"),
                                    "--expect", str(tmp_path / "expect"), "--out", str(out),
                                    "--tp", "2"], out)
    assert report == {"streamed": 1}
    assert server.from_disk == [str(tmp_path / "weights" / "v000001")]  # the start: by disk
    assert server.versions == ["2"]
    expected: dict[str, torch.Tensor] = {}
    for shard in sorted((tmp_path / "expect").glob("*.safetensors")):
        expected.update(load_file(shard))
    assert set(server.received) == set(expected)
    for name, tensor in expected.items():
        assert server.received[name].dtype == tensor.dtype, name
        assert torch.equal(server.received[name], tensor), name
