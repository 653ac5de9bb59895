"""Ranks of the sharded weight stream test, 12 of one job: 0-7 a TP2-PP2-EP2 trainer,
8-9 a rollout server at EP2, 10-11 one at TP2, each side in a torch.distributed world
of its own (as on a cluster), the servers' leaders serving the real rollout HTTP app.

The trainer pushes version 1 (the start: by disk) and version 2 (streamed; nothing may
gather the model, so `gather_megatron` raises), then publishes version 2 to
`--expect`. Each server rank then compares every parameter it holds with the same
version loaded from there into a model of its own layout, and writes what it found;
trainer rank 0 writes what each trainer rank sent and what every server rank says it
received. Every rank also reports its peak resident memory (`ru_maxrss`)."""

from __future__ import annotations

import argparse
import json
import os
import resource
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from weight_stream_worker import Trained

from moerl.models import hf
from moerl.models.arch import TINY

ENGINES = {"ep2": (8, ["ep", 2]), "tp2": (10, ["tp", 2])}  # first rank, layout


def _world(rank: int, size: int, port: int) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(size),
                      LOCAL_WORLD_SIZE=str(size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def trainer(rank: int, args: argparse.Namespace) -> dict[str, Any] | None:
    from moerl.models.build import build_model
    from moerl.parallel.groups import destroy_parallel, init_parallel
    from moerl.parallel.layout import ParallelLayout
    from moerl.rl.weight_stream import MemoryWeightSync
    from moerl.rl.weight_sync import FilesystemWeightSync
    from moerl.rollout.client import RolloutClient

    _world(rank, 8, args.ports[0])
    layout = ParallelLayout.for_world(8, tp=2, pp=2, ep=2)
    init_parallel(layout, seed=3)
    policy = Trained(TINY, list(build_model(TINY, layout)))
    engines = None
    if rank == 0:
        urls = [_wait_file(args.dir / f"{name}.url") for name in ENGINES]
        engines = RolloutClient(urls)
    sync = MemoryWeightSync(FilesystemWeightSync(args.dir / "weights", engines, keep=2),
                            engines, TINY, staging_bytes=args.staging_bytes, timeout_s=120.0)
    sync.push(policy, 1)
    with torch.no_grad():  # a new version: the same change on every replica
        for chunk in policy.chunks:
            for param in chunk.parameters():
                param.mul_(1.01)

    def no_gather(*_: Any, **__: Any) -> Any:
        raise AssertionError("the stream gathered the model")

    hf.gather_megatron = no_gather
    start = time.perf_counter()
    sync.push(policy, 2)
    seconds = time.perf_counter() - start
    policy.publish(args.dir / "expect")
    link = sync.link
    mine = {**sync.traffic.as_dict(), "owned_bytes": link.owned_bytes if link else -1,
            "shard_bytes": link.shard_bytes if link else -1, "peak_mb": _peak_mb()}
    everyone: list[Any] = [None] * 8
    dist.all_gather_object(everyone, mine)  # the test's report, after the stream
    destroy_parallel()
    (args.dir / "trainer-done").write_text("ok")
    if rank != 0:
        return None
    return {"streamed": sync.streamed, "pushed": sync.pushed, "seconds": seconds,
            "senders": everyone, "received": sync.received}


def engine(rank: int, args: argparse.Namespace) -> dict[str, Any]:
    from moerl.data.tokenizer import ByteTokenizer
    from moerl.rollout.engine import build_engine
    from moerl.rollout.follower import follow
    from moerl.rollout.ranks import Command

    name = next(n for n, (first, _) in ENGINES.items() if first <= rank < first + 2)
    first, (flag, size) = ENGINES[name][0], ENGINES[name][1]
    local = rank - first
    _world(local, 2, args.ports[1 + list(ENGINES).index(name)])
    degrees = {str(flag): int(size)}
    eng = build_engine(TINY, ByteTokenizer(), weights=args.start, **degrees)  # type: ignore[arg-type]
    if local == 0:
        _serve(eng, args.dir / f"{name}.url", args.dir / "trainer-done")
        with eng.lock:
            assert eng.ranks is not None
            eng.ranks.send(Command("stop"))
    else:
        assert eng.ranks is not None
        follow(eng, eng.ranks)
    return {"engine": name, "rank": local, "version": eng.weight_version,
            "mismatched": _compare(eng.model, args.dir / "expect", degrees),
            "peak_mb": _peak_mb()}


def _serve(eng: Any, url_file: Path, done: Path) -> None:
    """The rollout server's HTTP app for `eng` until the trainer is done."""
    import uvicorn

    from moerl.rollout.batching import BatchScheduler
    from moerl.rollout.server import ServerState, create_app

    scheduler = BatchScheduler(eng, 32, 0.05)
    app = create_app(ServerState(eng, scheduler, "tiny", 30.0))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    url_file.write_text(f"http://127.0.0.1:{port}")
    _wait_file(done)
    server.should_exit = True
    thread.join(timeout=30)
    scheduler.close()


def _compare(model: torch.nn.Module, expect: Path, degrees: dict[str, int]) -> list[str]:
    """Names of the parameters that differ from version 2 loaded from disk."""
    from moerl.models.build import build_model
    from moerl.models.weights import load_weights
    from moerl.rollout.ranks import serving_layout

    layout = serving_layout(TINY, 2, **degrees)
    (fresh,) = build_model(TINY, layout)
    load_weights([fresh], expect)
    want = fresh.state_dict()
    return [k for k, v in model.state_dict().items()
            if torch.is_tensor(v) and not torch.equal(v, want[k])]


def _wait_file(path: Path, timeout: float = 600.0) -> str:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.1)
    return path.read_text()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True, type=Path)
    parser.add_argument("--start", required=True, type=Path)
    parser.add_argument("--ports", required=True, type=lambda s: [int(p) for p in s.split(",")])
    parser.add_argument("--staging-bytes", type=int, default=4 << 20)
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    result = trainer(rank, args) if rank < 8 else engine(rank, args)
    if result is not None:
        (args.dir / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
