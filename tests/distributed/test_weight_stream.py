"""`rl.weight_sync=memory` across layouts: a TP2-EP2 trainer streams a version to a
one-rank server, an EP2 server and a PP2 server (2 ranks each, torchrun); what they
then answer must be bit for bit what they answer after loading the same version from
disk."""

from __future__ import annotations

import json
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


SHARDED = Path(__file__).with_name("sharded_stream_worker.py")


def test_each_trainer_rank_sends_its_shard_and_each_server_rank_takes_only_its_own(
        tmp_path: Path) -> None:
    """8 trainer ranks (TP2, PP2, EP2) stream to a server at EP2 and one at TP2 (2 ranks
    each): every server parameter equals the trainer's bit for bit; a trainer rank
    holds no more than its staging buffers beyond its weights, a server rank receives
    no more than 1.1x the bytes of its own slices (as the transport counted them)."""
    from moerl.launchers.local import free_port

    start = publish(3, tmp_path / "start")
    ports = ",".join(str(free_port()) for _ in range(3))
    staging = 4 << 20
    run_worker(SHARDED, 12, ["--dir", str(tmp_path), "--start", str(start), "--ports", ports,
                             "--staging-bytes", str(staging)], timeout=600)
    report = json.loads((tmp_path / "rank0.json").read_text())
    engines = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(8, 12)]
    assert (report["pushed"], report["streamed"]) == (2, 1)
    for rank in engines:  # every parameter, bit for bit, on every server rank
        assert rank["version"] == 2 and rank["mismatched"] == [], rank
    senders = report["senders"]
    for sent in senders:
        assert sent["bytes_received"] == 0  # no trainer rank gathers anything
        assert 0 < sent["staging_bytes"] <= staging  # its memory beyond its weights
        assert sent["owned_bytes"] <= sent["shard_bytes"]
    received = [r for ranks in report["received"].values() for r in ranks]
    assert len(received) == 4
    for rank in received:
        assert rank["bytes_received"] <= 1.1 * rank["held_bytes"]
        assert rank["staging_bytes"] <= staging
    assert sum(s["bytes_sent"] for s in senders) == sum(r["bytes_received"] for r in received)
    # the owners share the sending: no trainer rank sends much more than its share
    sent = [s["bytes_sent"] for s in senders]
    assert max(sent) <= 2 * sum(sent) / len(sent)
    print(f"\nstream: {report['seconds']:.2f} s; bytes sent per trainer rank "
          f"{min(sent)}..{max(sent)}; peak RSS MB trainer "
          f"{max(s['peak_mb'] for s in senders):.0f}, server "
          f"{max(e['peak_mb'] for e in engines):.0f}")
