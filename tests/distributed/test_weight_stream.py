"""`rl.weight_sync=memory` across layouts.

With real servers (`moerl serve rollout`, torchrun), started once for the module: a
one-rank server, an EP2 server and a PP2 server (2 ranks each).
- A TP2-EP2 trainer streams a version; what the servers then answer must be bit for
  bit what they answer after loading the same version from disk.
- Failures (an EP2 trainer): a trainer rank frozen past the stream's timeout
  (version 3), then a rank of the EP2 server killed (version 5), each after its first
  message went out: the version goes by disk within the timeout, and the next version
  streams again to the servers then alive, which answer with it.

And with 12 ranks of one job (`sharded_stream_worker.py`): 8 trainer ranks (TP2, PP2,
EP2) into servers at EP2 and TP2, each server rank comparing every parameter it holds
with the trainer's, and the transport's counts of memory and bytes checked.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import psutil
import pytest
import torch

from moerl.rollout.client import RolloutClient
from moerl.rollout.types import Sample, SamplingParams

sys.path.insert(0, str(Path(__file__).parent))
from rollout_servers import publish, rollout_server
from worker_launch import run_worker

WORKER = Path(__file__).with_name("weight_stream_worker.py")
FAILURES = Path(__file__).with_name("stream_failure_worker.py")
PROMPTS = [list(b"def add(a, b):\n    return"), list(b"Return n times 3."), list(b"x = 1\ny =")]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0)
TIMEOUT, FREEZE = 8.0, 14.0  # the failure test's stream timeout and trainer freeze


SHARDED = Path(__file__).with_name("sharded_stream_worker.py")


def test_each_trainer_rank_sends_its_shard_and_each_server_rank_takes_only_its_own(
        tmp_path: Path) -> None:
    """8 trainer ranks (TP2, PP2, EP2) stream to a server at EP2 and one at TP2 (2 ranks
    each): every server parameter equals the trainer's bit for bit; a trainer rank
    holds no more than its staging buffers beyond its weights, a server rank receives
    no more than 1.1x the bytes of its own slices (as the transport counted them)."""
    from moerl.ports import free_port

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


class Servers:
    """The module's servers: one rank, EP2 (the one the failure test kills), PP2."""

    def __init__(self, clients: list[RolloutClient], ep2_launcher: int) -> None:
        self.clients, self.ep2_launcher = clients, ep2_launcher


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    tmp = tmp_path_factory.mktemp("servers")
    start = publish(1, tmp / "start")
    pids: list[int] = []
    with ExitStack() as stack:
        one = stack.enter_context(rollout_server(tmp, 1, [], start))
        ep2 = stack.enter_context(rollout_server(tmp, 2, ["--ep", "2"], start, pids))
        pp2 = stack.enter_context(rollout_server(tmp, 2, ["--pp", "2"], start))
        yield Servers([one, ep2, pp2], pids[0])


def _greedy(client: RolloutClient) -> list[Sample]:
    return [group[0] for group in client.generate(PROMPTS, 1, GREEDY)]


def test_streamed_version_equals_the_disk_version(servers: Servers, tmp_path: Path) -> None:
    clients = servers.clients
    before = [_greedy(s) for s in clients]
    urls = ",".join(s.urls[0] for s in clients)
    out = tmp_path / "sync.json"
    report = run_worker(WORKER, 4, ["--urls", urls, "--root", str(tmp_path / "weights"),
                                    "--disk", str(tmp_path / "v2"), "--out", str(out)], out)
    assert report == {"pushed": 2, "streamed": 1, "version": 2}
    assert not (tmp_path / "weights" / "v000002").exists()  # version 2 never hit the disk
    streamed = [_greedy(s) for s in clients]
    for server in clients:
        server.update_weights(tmp_path / "v2", 3)
    from_disk = [_greedy(s) for s in clients]
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


def _rank_pid(launcher: int, rank: int) -> int:
    """The pid of torchrun worker `rank` under the launcher `launcher`."""
    for child in psutil.Process(launcher).children(recursive=True):
        if child.environ().get("RANK") == str(rank) and "torch.distributed.run" not in \
                " ".join(child.cmdline()):
            return child.pid
    raise LookupError(f"no rank {rank} under {launcher}")


def test_a_failed_stream_goes_by_disk_and_the_next_streams_again(servers: Servers,
                                                                 tmp_path: Path) -> None:
    """Runs after the test above: it kills the EP2 server."""
    one, ep2, pp2 = servers.clients
    out = tmp_path / "report.json"
    run_worker(FAILURES, 2, ["--urls", ",".join(c.urls[0] for c in servers.clients),
                             "--root", str(tmp_path / "weights"), "--out", str(out),
                             "--timeout", str(TIMEOUT), "--freeze", str(FREEZE),
                             "--kill-pid", str(_rank_pid(servers.ep2_launcher, 1))],
               out, timeout=600)
    for alive in (one, pp2):  # the run's next version, streamed, is what they answer with
        assert _greedy(alive)[0].weight_version == 6
    assert ep2.check_health() == {ep2.urls[0]: False}  # torchrun ended it
    rows = json.loads(out.read_text())
    rank0, rank1 = ({r["version"]: r for r in ranks} for ranks in rows)
    print("\n" + "\n".join(f"v{v}: " + ", ".join(
        f"rank {i} stream {r[v].get('stream_s', 0):.1f} s push {r[v]['push_s']:.1f} s"
        for i, r in enumerate((rank0, rank1))) for v in range(1, 7)))
    assert [rank0[v]["streamed"] for v in range(1, 7)] == [0, 1, 1, 2, 2, 3]
    # version 3: the ranks that were not frozen gave up by the timeout, not the freeze;
    # the version was on disk once the frozen rank was back
    assert TIMEOUT <= rank0[3]["stream_s"] < TIMEOUT + 4
    assert rank0[3]["push_s"] < FREEZE + 30
    # version 5: a server rank killed; every trainer rank done by the timeout, disk included
    assert max(rank0[5]["push_s"], rank1[5]["push_s"]) < TIMEOUT + 30
