"""The trainer side of the weight stream failure test: an EP2 trainer (2 ranks) pushes
versions 1..6 to the rollout servers at `--urls`, with `--timeout` seconds as the
stream's bound. Faults strike mid-stream, after a rank's first message went out:

- version 3: trainer rank 1 freezes (SIGSTOP) for `--freeze` seconds, longer than the
  timeout, then goes on (SIGCONT from a shell it started);
- version 5: trainer rank 0 kills rank `--kill-pid` of a server (SIGKILL).

Every rank records, per version, how long its stream took before it gave up or
finished, how long the whole push took, and how many versions had streamed; rank 0
writes them to `--out`."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from weight_stream_worker import Trained

from moerl.models.arch import TINY
from moerl.models.build import build_model
from moerl.parallel.groups import destroy_parallel, init_parallel
from moerl.parallel.layout import ParallelLayout
from moerl.rl import weight_send
from moerl.rl.weight_stream import MemoryWeightSync
from moerl.rl.weight_sync import FilesystemWeightSync
from moerl.rollout.client import RolloutClient


def _faulty_sends(faults: dict[int, Any], version: list[int]) -> None:
    """Sends as they are, but this rank's fault for the current version strikes once
    its first message has gone out."""
    real = weight_send.send_messages

    def send(group: Any, rank: int, plan: Any, *args: Any) -> None:
        fault = faults.get(version[0])
        mine = [m for m in plan if m.src == rank]
        if fault is None or not mine:
            real(group, rank, plan, *args)
            return
        real(group, rank, mine[:1], *args)
        fault()
        real(group, rank, mine[1:], *args)

    weight_send.send_messages = send  # type: ignore[attr-defined]


def _freeze(seconds: float) -> None:
    subprocess.Popen(["sh", "-c", f"sleep {seconds}; kill -CONT {os.getpid()}"])
    os.kill(os.getpid(), signal.SIGSTOP)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--urls", required=True)
    parser.add_argument("--root", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--timeout", type=float, required=True)
    parser.add_argument("--freeze", type=float, required=True)
    parser.add_argument("--kill-pid", type=int, required=True)
    args = parser.parse_args()
    layout = ParallelLayout.for_world(2, ep=2)
    groups = init_parallel(layout, seed=3)
    policy = Trained(TINY, list(build_model(TINY, layout)))
    engines = RolloutClient(args.urls.split(",")) if groups.rank == 0 else None
    sync = MemoryWeightSync(FilesystemWeightSync(args.root, engines, keep=2), engines, TINY,
                            staging_bytes=2 << 20, timeout_s=args.timeout)
    version = [0]
    faults = ({3: lambda: _freeze(args.freeze)} if groups.rank == 1 else
              {5: lambda: os.kill(args.kill_pid, signal.SIGKILL)})
    _faulty_sends(faults, version)
    stream = sync._stream
    rows: list[dict[str, float]] = []

    def timed_stream(*a: Any) -> bool:
        start = time.monotonic()
        ok = stream(*a)
        rows[-1]["stream_s"] = time.monotonic() - start
        return ok

    sync._stream = timed_stream  # type: ignore[method-assign]
    for v in range(1, 7):
        version[0] = v
        with torch.no_grad():  # each version differs; the same change on every replica
            for param in policy.chunks[0].parameters():
                param.mul_(1.01)
        rows.append({"version": v})
        start = time.monotonic()
        sync.push(policy, v)
        rows[-1].update(push_s=time.monotonic() - start, streamed=sync.streamed)
    everyone: list[Any] = [None] * 2
    dist.all_gather_object(everyone, rows)
    if groups.rank == 0:
        args.out.write_text(json.dumps(everyone))
    destroy_parallel()


if __name__ == "__main__":
    main()
