"""`rl.weight_sync=memory`: each new version streamed from the trainer to the rollout
servers over a process group they join (`rollout.weight_group`).

Every trainer rank takes part in gathering the policy to global rank 0 over tensor,
expert and pipeline parallelism (`models.hf.gather_megatron`, Megatron names); rank 0
announces the version to every server (`POST /update_weights_from_distributed`) and
broadcasts it. moerl servers take Megatron names in byte buckets, and each server rank
keeps the slices its own layout holds, so the trainer's and the servers' layouts may
differ; a server swaps versions only once the whole version has arrived, between two
batches. SGLang servers take SGLang's protocol: Hugging Face names and dtypes
(`models.hf.hf_tensors`, as the disk export writes them), one broadcast per tensor in
the announced order, every rank of a server in the group (`rollout.tensor_parallel`
of them). vLLM servers take the same tensors through moerl's worker extension
(`rollout.vllm_extension`), called with `POST /collective_rpc`, then drop their
prefix cache.

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
from typing import Any

import httpx
import torch
import torch.distributed as dist

from moerl.models.arch import MoEArch
from moerl.rendezvous import ENV_HOST
from moerl.rl.weight_sync import Publisher, WeightSync
from moerl.rollout.client import RolloutClient
from moerl.rollout.weight_group import (
    GroupSpec,
    Manifest,
    WeightGroup,
    broadcast_each,
    open_group,
    send,
    spec_of,
)

log = logging.getLogger(__name__)


class MemoryWeightSync:
    """Streams versions to `engines` (given on the controller, global rank 0 only);
    `disk`: the engine's disk strategy, for the first version and failed streams.
    `engine`: the servers' protocol (moerl, sglang or vllm). `server_ranks`: ranks of
    each server in the group (None: each moerl server says, in /health). `hf_config`
    and `hf_dtype` (sglang, vllm): the served config.json and the weights' dtype."""

    def __init__(self, disk: WeightSync, engines: RolloutClient | None, arch: MoEArch, *,
                 engine: str = "moerl", server_ranks: int | None = None,
                 bucket_bytes: int = 64 << 20, timeout_s: float = 600.0,
                 hf_config: dict[str, Any] | None = None,
                 hf_dtype: torch.dtype | None = None) -> None:
        if engine not in ("moerl", "sglang", "vllm"):
            raise ValueError(f"rl.weight_sync=memory: rollout.engine={engine} has no stream "
                             "here; set rl.weight_sync=disk")
        self.disk, self.engine, self.server_ranks = disk, engine, server_ranks
        self.hf_config, self.hf_dtype = hf_config, hf_dtype
        self.engines, self.arch = engines, arch
        self.bucket_bytes, self.timeout_s = bucket_bytes, timeout_s
        self.group: WeightGroup | None = None
        self.pushed = 0  # versions pushed, either way
        self.streamed = 0  # of them, over the group
        self._names = (f"moerl-weights-{os.getpid()}-{n}" for n in itertools.count())
        self._group_name = ""

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
            if self.engine != "moerl":
                from moerl.models.hf import hf_tensors

                full, _ = hf_tensors(full, self.arch, self.hf_config, self.hf_dtype)
            names = list(full)
            manifest = Manifest(tuple(spec_of(n, full[n]) for n in names), version,
                                self.bucket_bytes)
            path = "/collective_rpc" if self.engine == "vllm" else \
                "/update_weights_from_distributed"
            with ThreadPoolExecutor(len(self.engines.urls)) as pool:
                replies = self._post_all(pool, path, self._announcement(manifest))
                if self.engine == "moerl":
                    send(self.group, manifest, [full[n] for n in names])
                else:
                    broadcast_each(self.group, [full[n] for n in names])
                _check(replies, f"version {version}")
                if self.engine == "vllm":  # prefixes cached under the old weights
                    _check(self._post_all(pool, "/reset_prefix_cache", {}), "prefix cache")
        except Exception as exc:  # any failure: this version goes by disk
            log.warning("streaming weight version %d failed (%s); publishing it to disk",
                        version, exc)
            return False
        self.engines.weight_version = version
        return True

    def _announcement(self, manifest: Manifest) -> dict[str, Any]:
        """The update request's body in the servers' protocol."""
        tensors = {"names": [t.name for t in manifest.tensors],
                   "dtypes": [t.dtype for t in manifest.tensors],
                   "shapes": [list(t.shape) for t in manifest.tensors]}
        if self.engine == "sglang":
            return {**tensors, "group_name": self._group_name, "flush_cache": True,
                    "weight_version": str(manifest.version)}
        if self.engine == "vllm":
            return {"method": "moerl_update_weights",
                    "kwargs": {**tensors, "version": manifest.version}}
        return {"tensors": [{"name": t.name, "dtype": t.dtype, "shape": list(t.shape)}
                            for t in manifest.tensors],
                "version": manifest.version, "bucket_bytes": manifest.bucket_bytes}

    def _join(self) -> WeightGroup:
        """Form the group: this rank (0, the store's host) and every rank of every server."""
        assert self.engines is not None
        if self.server_ranks is not None:
            ranks = [self.server_ranks] * len(self.engines.urls)
        else:
            with httpx.Client(timeout=30.0, trust_env=False) as http:
                ranks = [int(http.get(f"{url}/health").json().get("ranks", 1))
                         for url in self.engines.urls]
        host = os.environ.get(ENV_HOST, "127.0.0.1")
        self._group_name = next(self._names)
        spec = GroupSpec(host, free_port(host), 1, 1 + sum(ranks), self._group_name,
                         "nccl" if torch.cuda.is_available() else "gloo", self.timeout_s)
        offsets = list(itertools.accumulate([1, *ranks[:-1]]))
        with ThreadPoolExecutor(len(self.engines.urls)) as pool:
            replies = [pool.submit(self._post, url, *self._join_request(spec, offset))
                       for url, offset in zip(self.engines.urls, offsets, strict=True)]
            group = open_group(spec, 0)
            _check(replies, "joining the weight group")
        log.info("weight group %s: %d server ranks on %d servers", spec.group_name,
                 spec.world_size - 1, len(ranks))
        return group

    def _join_request(self, spec: GroupSpec, offset: int) -> tuple[str, dict[str, Any]]:
        """(path, body) asking one server to join the group from rank `offset` on."""
        body: dict[str, Any] = {**spec.__dict__, "rank_offset": offset}
        if self.engine == "vllm":
            return "/collective_rpc", {"method": "moerl_join_weight_group", "kwargs": body}
        if self.engine == "sglang":  # its request has no timeout field
            body.pop("timeout_s")
        return "/init_weights_update_group", body

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
