"""`rl.weight_sync=memory` across layouts: a TP2-EP2 trainer streams a version to a
one-rank server, an EP2 server and a PP2 server (2 ranks each, torchrun); what they
then answer must be bit for bit what they answer after loading the same version from
disk."""

from __future__ import annotations

import sys
from contextlib import ExitStack
from pathlib import Path

import torch

from moerl.rollout.client import RolloutClient
from moerl.rollout.types import Sample, SamplingParams

sys.path.insert(0, str(Path(__file__).parent))
from rollout_servers import publish, rollout_server
from worker_launch import run_worker

WORKER = Path(__file__).with_name("weight_stream_worker.py")
PROMPTS = [list(b"def add(a, b):\n    return"), list(b"Return n times 3."), list(b"x = 1\ny =")]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0)


def _greedy(client: RolloutClient) -> list[Sample]:
    return [group[0] for group in client.generate(PROMPTS, 1, GREEDY)]


def test_streamed_version_equals_the_disk_version(tmp_path: Path) -> None:
    start = publish(1, tmp_path / "start")
    with ExitStack() as stack:
        servers = [stack.enter_context(rollout_server(tmp_path, ranks, flags, start))
                   for ranks, flags in ((1, []), (2, ["--ep", "2"]), (2, ["--pp", "2"]))]
        before = [_greedy(s) for s in servers]
        urls = ",".join(s.urls[0] for s in servers)
        out = tmp_path / "sync.json"
        report = run_worker(WORKER, 4, ["--urls", urls, "--root", str(tmp_path / "weights"),
                                        "--disk", str(tmp_path / "v2"), "--out", str(out)], out)
        assert report == {"pushed": 2, "streamed": 1, "version": 2}
        assert not (tmp_path / "weights" / "v000002").exists()  # version 2 never hit the disk
        streamed = [_greedy(s) for s in servers]
        for server in servers:
            server.update_weights(tmp_path / "v2", 3)
        from_disk = [_greedy(s) for s in servers]
    for server_before, server_streamed, server_disk in zip(before, streamed, from_disk,
                                                           strict=True):
        assert [s.weight_version for s in server_streamed] == [2, 2, 2]
        assert [s.token_ids for s in server_streamed] != [s.token_ids for s in server_before]
        for a, b in zip(server_streamed, server_disk, strict=True):
            assert a.token_ids == b.token_ids
            assert torch.equal(torch.tensor(a.logprobs), torch.tensor(b.logprobs))
    # the servers hold the same model: the one-rank, EP2 and PP2 answers agree
    for other in streamed[1:]:
        for a, b in zip(streamed[0], other, strict=True):
            assert a.token_ids == b.token_ids
