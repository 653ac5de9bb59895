"""`rl.weight_sync=memory`: each new version streamed from the trainer to the moerl
rollout servers over a process group they join (`rollout.weight_group`).

Every trainer rank takes part in gathering the policy to global rank 0 over tensor,
expert and pipeline parallelism (`models.hf.gather_megatron`, Megatron names); rank 0
announces the version to every server (`POST /update_weights_from_distributed`) and
broadcasts it in buckets; each server rank keeps the slices its own layout holds, so
the trainer's and the servers' layouts may differ. A server swaps versions only once
the whole version has arrived, between two batches.

The first version (the start, or a resume) goes through the disk path, and so does any
version whose stream fails (a server gone, a group that broke): the trainer ranks
agree on the outcome, publish that version to disk together, and the group is formed
again, with the servers then alive, at the next version.
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import torch
import torch.distributed as dist

from moerl.models.arch import MoEArch
from moerl.rendezvous import ENV_HOST
from moerl.rl.weight_sync import FilesystemWeightSync, Publisher
from moerl.rollout.client import RolloutClient
from moerl.rollout.weight_group import GroupSpec, Manifest, WeightGroup, open_group, send, spec_of

log = logging.getLogger(__name__)


class MemoryWeightSync:
    """Streams versions to `engines` (given on the controller, global rank 0 only)."""

    def __init__(self, root: Path, engines: RolloutClient | None, arch: MoEArch, *,
                 keep: int = 2, bucket_bytes: int = 64 << 20, timeout_s: float = 600.0) -> None:
        self.disk = FilesystemWeightSync(root, engines, keep)
        self.engines, self.arch = engines, arch
        self.bucket_bytes, self.timeout_s = bucket_bytes, timeout_s
        self.group: WeightGroup | None = None
        self.pushed = 0  # versions pushed, either way
        self.streamed = 0  # of them, over the group
        self._names = (f"moerl-weights-{os.getpid()}-{n}" for n in itertools.count())

    def push(self, policy: Publisher, version: int) -> None:
        self.pushed += 1
        if self.pushed == 1:  # the servers' starting weights: whatever they hold now
            self.disk.push(policy, version)
            return
        from moerl.models.hf import gather_megatron

        # Every trainer rank takes part; views, not copies, of what rank 0 holds whole:
        # the weights do not change until this push returns.
        full = gather_megatron(policy.chunks, self.arch, copy=False)
        ok = self._stream(full, version) if self.engines is not None else True
        if not _agreed(ok):
            self.group = None  # formed again, with the servers then alive, next time
            self.disk.push(policy, version)
            return
        self.streamed += 1

    def _stream(self, full: dict[str, torch.Tensor], version: int) -> bool:
        assert self.engines is not None
        try:
            if self.group is None:
                self.group = self._join()
            names = list(full)
            manifest = Manifest(tuple(spec_of(n, full[n]) for n in names), version,
                                self.bucket_bytes)
            body = {"tensors": [{"name": t.name, "dtype": t.dtype, "shape": list(t.shape)}
                                for t in manifest.tensors],
                    "version": version, "bucket_bytes": self.bucket_bytes}
            with ThreadPoolExecutor(len(self.engines.urls)) as pool:
                replies = self._post_all(pool, "/update_weights_from_distributed", body)
                send(self.group, manifest, [full[n] for n in names])
                _check(replies, f"version {version}")
        except Exception as exc:  # any failure: this version goes by disk
            log.warning("streaming weight version %d failed (%s); publishing it to disk",
                        version, exc)
            return False
        self.engines.weight_version = version
        return True

    def _join(self) -> WeightGroup:
        """Form the group: this rank (0, the store's host) and every rank of every server."""
        assert self.engines is not None
        with httpx.Client(timeout=30.0, trust_env=False) as http:
            ranks = [int(http.get(f"{url}/health").json().get("ranks", 1))
                     for url in self.engines.urls]
        host = os.environ.get(ENV_HOST, "127.0.0.1")
        spec = GroupSpec(host, free_port(host), 1, 1 + sum(ranks), next(self._names),
                         "nccl" if torch.cuda.is_available() else "gloo", self.timeout_s)
        offsets = list(itertools.accumulate([1, *ranks[:-1]]))
        with ThreadPoolExecutor(len(self.engines.urls)) as pool:
            replies = [pool.submit(self._post, url, "/init_weights_update_group",
                                   {**spec.__dict__, "rank_offset": offset})
                       for url, offset in zip(self.engines.urls, offsets, strict=True)]
            group = open_group(spec, 0)
            _check(replies, "joining the weight group")
        log.info("weight group %s: %d server ranks on %d servers", spec.group_name,
                 spec.world_size - 1, len(ranks))
        return group

    def _post_all(self, pool: ThreadPoolExecutor, path: str, body: dict[str, Any]
                  ) -> list[Future[str | None]]:
        assert self.engines is not None
        return [pool.submit(self._post, url, path, body) for url in self.engines.urls]

    def _post(self, url: str, path: str, body: dict[str, Any]) -> str | None:
        """None, or why the server refused."""
        with httpx.Client(timeout=self.timeout_s, trust_env=False) as http:
            reply = http.post(f"{url}{path}", json=body)
        return None if reply.status_code == 200 else f"{url}{path}: HTTP {reply.status_code} " \
                                                      f"{reply.text[:500]}"


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _check(replies: list[Future[str | None]], what: str) -> None:
    failures = [f for f in (r.result() for r in replies) if f]
    if failures:
        raise RuntimeError(f"{what}: {failures}")


def _agreed(ok: bool) -> bool:
    """Global rank 0's outcome, on every trainer rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return ok
    flag = torch.tensor([int(ok)], device="cuda" if torch.cuda.is_available() else "cpu")
    dist.broadcast(flag, src=0)
    return bool(flag.item())
