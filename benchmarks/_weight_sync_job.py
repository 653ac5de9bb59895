"""The trainer job of benchmarks/weight_sync.py's model check, one torchrun rank each.

    python -m torch.distributed.run --nproc-per-node=N benchmarks/_weight_sync_job.py \
        --arch-file A.json --tp 2 --ep 2 [--pp 2] --urls U1,U2 --root DIR --out OUT.json

First the ranks measure this machine under the stream's own transport (packed into a
staging buffer, sent over gloo, unpacked into a version's tensors): one link's
bytes/s (messages of a staging buffer's size from rank 0 to rank 1), the time one
message adds (many small ones), and what every pair of ranks moves at once (all
sending together: the machine's shared cores), each the median of three rounds.
Version 1 goes by disk, version 2 forms the weight group, and versions 3.. are timed
on rank 0 from the call until every server answered. The plan's loads (each trainer
rank's messages, computed when the group formed, before a byte moved) and the
servers' shard sizes go to `--out`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from moerl.models.arch import MoEArch
from moerl.models.build import build_model
from moerl.models.weights import save_weights
from moerl.parallel.groups import destroy_parallel, init_parallel
from moerl.parallel.layout import ParallelLayout
from moerl.parallel.shard_messages import schedule
from moerl.parallel.shard_plan import Piece, overlap
from moerl.rl.weight_stream import MemoryWeightSync
from moerl.rl.weight_sync import FilesystemWeightSync
from moerl.rollout.client import RolloutClient
from moerl.rollout.weight_transport import Traffic, receive_messages, send_messages
from moerl.typed_config import from_dict


@dataclass
class Trained:
    """What a weight sync reads of a policy."""

    arch: MoEArch
    chunks: list[Any]

    def publish(self, directory: str | Path) -> Path:
        return save_weights(self.chunks, directory)


def _timed(rank: int, ranks: tuple[int, ...], work: Any) -> float:
    """Seconds `work` takes on `ranks` (the others wait), as rank 0 sees it."""
    dist.barrier()
    start = time.perf_counter()
    if rank in ranks:
        work()
    dist.barrier()
    return time.perf_counter() - start


def _through_transport(message_bytes: int, messages: int) -> Any:
    """Work for each rank of the pairs (0, 1), (2, 3), ...: `messages` messages from the
    even rank to the odd one through the stream's transport (packed into staging,
    sent, unpacked into a version's tensor), as a version moves its bytes."""
    rank = dist.get_rank()
    src, dst = rank - rank % 2, rank - rank % 2 + 1
    # Two tensors of one message each, sent in turn: the job and its servers leave
    # little of this machine's memory free (about 1 GB of 24 at 8 ranks), and tensors of
    # a version's size would time the kernel reclaiming pages, not the transport.
    pieces = [Piece.whole(f"x{i}", "uint8", (message_bytes,)) for i in range(min(messages, 2))]
    sends = [overlap(p, p) for p in pieces]
    plan = schedule({(src, dst): [t for k in range(messages) for t in sends[k % len(sends)]]},
                    message_bytes)
    source = {p.name: torch.ones(p.shape, dtype=torch.uint8) for p in pieces}
    # The receiver's tensors are touched before the clock starts: a server's new version
    # is many tensors of at most a few MB, which the allocator serves from memory the
    # process already holds, not pages the kernel maps during the transfer.
    landing = {p.name: torch.zeros(p.shape, dtype=torch.uint8) for p in pieces}
    cpu, group = torch.device("cpu"), dist.group.WORLD

    def work() -> None:
        deadline = time.monotonic() + 600
        if rank == src:
            send_messages(group, rank, plan, source, cpu, deadline, Traffic())
        else:
            receive_messages(group, rank, plan, landing.__getitem__, cpu, deadline, Traffic())

    return work


def calibrate(buffer_bytes: int, repeats: int = 8, rounds: int = 3) -> dict[str, float]:
    """This machine under the stream's transport: one link's bytes/s, the time a
    message adds, what every rank pair moves at once (bytes/s); each the median of
    `rounds` measurements, as a dozen processes on two cores make any one of them noisy."""
    rank, world = dist.get_rank(), dist.get_world_size()
    pairs = world - world % 2
    nbytes = repeats * buffer_bytes
    measured: dict[str, list[float]] = defaultdict(list)
    large, many_small = _through_transport(buffer_bytes, repeats), _through_transport(64, 256)
    for _ in range(rounds):
        one = _timed(rank, (0, 1), large)
        small = _timed(rank, (0, 1), many_small) / 256
        together = _timed(rank, tuple(range(pairs)), large)
        measured["bandwidth"].append(nbytes / one)
        measured["latency"].append(small)
        measured["shared"].append(pairs // 2 * nbytes / together)
    return {name: statistics.median(values) for name, values in measured.items()}


def plan_loads(sync: MemoryWeightSync, buffer_bytes: int) -> dict[str, Any]:
    """This rank's messages of a version, per receiver: (bytes, messages)."""
    assert sync.link is not None
    link = sync.link
    per_dst: dict[int, list[int]] = defaultdict(lambda: [0, 0])
    for message in schedule({(link.rank, d): ts for d, ts in link.routes.items()},
                            buffer_bytes):
        per_dst[message.dst][0] += message.nbytes
        per_dst[message.dst][1] += 1
    return {str(d): v for d, v in per_dst.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("arch-file", "urls", "root", "out"):
        parser.add_argument(f"--{name}", required=True)
    for name in ("tp", "ep", "pp"):
        parser.add_argument(f"--{name}", type=int, default=1)
    parser.add_argument("--pushes", type=int, default=3)
    parser.add_argument("--staging-bytes", type=int, default=64 << 20)
    args = parser.parse_args()
    arch = from_dict(MoEArch, json.loads(Path(args.arch_file).read_text()), "model")
    layout = ParallelLayout.for_world(int(os.environ["WORLD_SIZE"]), tp=args.tp, ep=args.ep,
                                      pp=args.pp)
    groups = init_parallel(layout, seed=0)
    policy = Trained(arch, list(build_model(arch, layout)))
    engines = RolloutClient(args.urls.split(",")) if groups.rank == 0 else None
    sync = MemoryWeightSync(FilesystemWeightSync(Path(args.root), engines, keep=1), engines,
                            arch, staging_bytes=args.staging_bytes, timeout_s=600.0)
    versions = []
    for version in range(1, args.pushes + 3):
        # each timed version right after its own measurement of the machine: a shared
        # machine's load drifts from minute to minute
        links = calibrate(args.staging_bytes // 2) if version > 2 else {}
        dist.barrier()
        start = time.perf_counter()
        sync.push(policy, version)
        versions.append({"seconds": time.perf_counter() - start, "links": links})
    assert sync.streamed == args.pushes + 1, "a version fell back to disk"
    mine = plan_loads(sync, args.staging_bytes // 2)
    everyone: list[Any] = [None] * groups.world_size
    dist.all_gather_object(everyone, mine)  # the report's metadata, after the pushes
    if groups.rank == 0:
        Path(args.out).write_text(json.dumps({
            "versions": versions[2:], "join": versions[1]["seconds"], "senders": everyone,
            "received": sync.received, "traffic": asdict(sync.traffic)}))
    destroy_parallel()


if __name__ == "__main__":
    main()
