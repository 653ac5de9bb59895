"""`rl.weight_sync=memory`: each new version streamed from the trainer to the rollout
servers over a process group they join (`rollout.weight_group`).

moerl servers: every trainer rank is in the group and sends the slices it owns (its
balanced share among the ranks holding them) straight to the server ranks that hold
them, whatever the two layouts, every server fed at once (`rl.weight_send`; the plan,
agreed when the group forms, in `parallel.shard_plan`). A server swaps the version in
only once every rank has all of it, between two batches (`rollout.weight_receive`).
SGLang and vLLM servers take whole Hugging Face tensors broadcast by trainer rank 0
(their protocols); rank 0 assembles them tensor by tensor from the ranks that own the
pieces (`rl.weight_stream_hf`). Nothing of the model's size passes through one rank.

No wait is unbounded: every step of a version (forming the group, the plan exchange,
each message, the servers' replies) ends by `timeout_s` after the push began. A
failure on any rank (a server gone, a rank killed or frozen mid-stream, a group that
broke) makes that rank leave the group, which fails its peers' waits at once; the
trainer ranks then agree on the outcome over a gloo group of their own, publish that
version to disk together, and form the group again, with the servers then alive, at
the next version. The first version (the start, or a resume) goes by disk too.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from moerl.models.arch import MoEArch
from moerl.ports import free_port
from moerl.rendezvous import ENV_HOST
from moerl.rl.weight_requests import (
    asking,
    check,
    join_request,
    live_servers,
    post,
    post_all,
)
from moerl.rl.weight_send import SendLink, join, send_version
from moerl.rl.weight_stream_hf import (
    Assembly,
    announced,
    assemble_and_broadcast,
    converter,
    join_sources,
    send_pieces,
)
from moerl.rl.weight_sync import Publisher, WeightSync
from moerl.rollout.client import RolloutClient
from moerl.rollout.weight_group import GroupSpec, TensorSpec, WeightGroup, abort, open_group
from moerl.rollout.weight_transport import Traffic

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Join:
    """Rank 0's decision to form the groups anew, as every trainer rank needs it."""

    spec: GroupSpec  # moerl: every trainer rank and server rank; else rank 0 and the servers'
    sources: GroupSpec | None  # sglang / vllm: the trainer ranks' own group
    servers: tuple[tuple[str, int], ...]  # (url, ranks) of each live server, in group order


class MemoryWeightSync:
    """Streams versions to `rollout_client` (given on the controller, global rank 0 only);
    every trainer rank calls `push`. `disk`: the engine's disk strategy, for the first
    version and failed streams. `engine`: the servers' protocol (moerl, sglang, vllm).
    `server_ranks`: ranks of each server (None: each moerl server says, in /health).
    `staging_bytes`: the staging memory a rank may use, two buffers of half as many
    bytes. `hf_config`, `hf_dtype` (sglang, vllm): the served config.json and dtype."""

    def __init__(self, disk: WeightSync, rollout_client: RolloutClient | None, arch: MoEArch, *,
                 engine: str = "moerl", server_ranks: int | None = None,
                 staging_bytes: int = 256 << 20, timeout_s: float = 600.0,
                 hf_config: dict[str, Any] | None = None,
                 hf_dtype: torch.dtype | None = None) -> None:
        if engine not in ("moerl", "sglang", "vllm"):
            raise ValueError(f"rl.weight_sync=memory: rollout.engine={engine} has no stream "
                             "here; set rl.weight_sync=disk")
        self.disk, self.engine, self.server_ranks = disk, engine, server_ranks
        self.rollout_client, self.arch = rollout_client, arch
        self.buffer_bytes, self.timeout_s = staging_bytes // 2, timeout_s
        self.convert = converter(arch, hf_config, hf_dtype) if engine != "moerl" else None
        self.link: SendLink | None = None  # moerl
        self.assembly: Assembly | None = None  # sglang, vllm: the trainer ranks' group
        self.engine_group: WeightGroup | None = None  # sglang, vllm: rank 0's to the servers
        self.tensors: list[TensorSpec] = []  # sglang, vllm: what rank 0 broadcasts
        self.servers: tuple[tuple[str, int], ...] = ()  # rank 0: the group's servers
        self.group_name = ""  # rank 0: the servers' group
        self.control: Any = None  # the trainer ranks' gloo group: decisions and outcomes
        self.pushed = 0  # versions pushed, either way
        self.streamed = 0  # of them, over the group
        self.traffic = Traffic()  # this rank's, of the last streamed version
        self.received: dict[str, list[dict[str, int]]] = {}  # rank 0: each server's ranks'
        self._names = (f"moerl-weights-{os.getpid()}-{n}" for n in itertools.count())

    def push(self, policy: Publisher, version: int) -> None:
        self.pushed += 1
        if self.pushed == 1:  # the servers' starting weights: whatever they hold now
            self.control = _control_group(self.timeout_s)
            self.disk.push(policy, version)
            return
        ok = self._stream(policy, version, time.monotonic() + self.timeout_s)
        if not self._agreed(ok):
            self._leave()  # formed again, with the servers then alive, next time
            self.disk.push(policy, version)
            return
        self.streamed += 1

    def _stream(self, policy: Publisher, version: int, deadline: float) -> bool:
        decision = self._share(self._decide() if _rank() == 0 else None)
        if isinstance(decision, str):
            log.warning("weight version %d goes by disk: %s", version, decision)
            return False
        try:
            if decision is not None:
                self._form(decision, policy, deadline)
            if self.engine == "moerl":
                self._send_moerl(policy, version, deadline)
            else:
                self._send_hf(policy, version, deadline)
        except Exception as exc:  # any failure: this version goes by disk
            log.warning("streaming weight version %d failed on trainer rank %d (%s); "
                        "publishing it to disk", version, _rank(), exc)
            self._leave()
            return False
        if self.rollout_client is not None:
            self.rollout_client.weight_version = version
        return True

    def _decide(self) -> _Join | str | None:
        """Rank 0: None (keep the group), a new one to form, or why not to stream."""
        try:
            servers = live_servers(self.rollout_client, self.engine, self.server_ranks,
                                   self.timeout_s)
            if not servers:
                return "no rollout server answers /health"
            if servers == self.servers and (self.link or self.assembly):
                return None
            host = os.environ.get(ENV_HOST, "127.0.0.1")
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            name, ranks = next(self._names), sum(r for _, r in servers)
            trainers = dist.get_world_size() if dist.is_initialized() else 1
            if self.engine == "moerl":
                return _Join(GroupSpec(host, free_port(host), trainers, trainers + ranks, name,
                                       backend, self.timeout_s), None, servers)
            sources = GroupSpec(host, free_port(host), 0, trainers, f"{name}-sources", backend,
                                self.timeout_s)
            return _Join(GroupSpec(host, free_port(host), 1, 1 + ranks, name, backend,
                                   self.timeout_s), sources, servers)
        except Exception as exc:  # told to every rank; the version goes by disk
            return f"choosing the servers failed: {exc}"

    def _form(self, decision: _Join, policy: Publisher, deadline: float) -> None:
        """Every trainer rank: leave the old groups, join the new ones, agree the plan."""
        self._leave()
        rank, spec = _rank(), decision.spec
        with asking(len(decision.servers)) as pool:
            asked = []
            if rank == 0:
                self.servers, self.group_name = decision.servers, spec.group_name
                offsets = itertools.accumulate([spec.rank_offset,
                                                *(r for _, r in decision.servers[:-1])])
                asked = [pool.submit(post, url, *join_request(self.engine, spec, offset),
                                     deadline=deadline)
                         for (url, _), offset in zip(decision.servers, offsets, strict=True)]
            if decision.sources is None:
                self.link = join(spec, rank, policy.chunks, self.arch)
            else:
                if rank == 0:
                    self.engine_group = open_group(spec, 0)
                self.assembly = join_sources(decision.sources, rank, policy.chunks,
                                             self.arch, self.buffer_bytes)
                if rank == 0:
                    assert self.convert is not None
                    self.tensors = announced(self.assembly, self.arch, self.convert)
            check(asked, "joining the weight group")
        if rank == 0:
            log.info("weight group %s: %d server ranks on %d servers", spec.group_name,
                     sum(r for _, r in decision.servers), len(decision.servers))

    def _send_moerl(self, policy: Publisher, version: int, deadline: float) -> None:
        assert self.link is not None
        body = {"version": version, "group_name": self.link.spec.group_name,
                "buffer_bytes": self.buffer_bytes}
        with asking(len(self.servers)) as pool:
            replies = post_all(pool, self.servers, "/update_weights_from_distributed", body,
                               deadline)
            self.traffic = send_version(self.link, policy.chunks, self.arch,
                                        self.buffer_bytes, deadline)
            answers = check(replies, f"version {version}")
        self.received = {url: list(a.get("ranks", [])) for (url, _), a in
                         zip(self.servers, answers, strict=True)}

    def _send_hf(self, policy: Publisher, version: int, deadline: float) -> None:
        assert self.assembly is not None
        if _rank() != 0:
            self.traffic = send_pieces(self.assembly, policy.chunks, self.arch, deadline)
            return
        assert self.engine_group is not None and self.convert is not None
        path = "/collective_rpc" if self.engine == "vllm" else "/update_weights_from_distributed"
        with asking(len(self.servers)) as pool:
            replies = post_all(pool, self.servers, path, self._hf_announcement(version),
                               deadline)
            self.traffic = assemble_and_broadcast(self.assembly, policy.chunks, self.arch,
                                                  self.engine_group, self.convert, deadline)
            check(replies, f"version {version}")
            if self.engine == "vllm":  # prefixes cached under the old weights
                check(post_all(pool, self.servers, "/reset_prefix_cache", {}, deadline),
                       "prefix cache")

    def _hf_announcement(self, version: int) -> dict[str, Any]:
        """The update request's body in SGLang's protocol or vLLM's extension's."""
        tensors = {"names": [t.name for t in self.tensors],
                   "dtypes": [t.dtype for t in self.tensors],
                   "shapes": [list(t.shape) for t in self.tensors]}
        if self.engine == "vllm":
            return {"method": "moerl_update_weights",
                    "kwargs": {**tensors, "version": version}}
        return {**tensors, "group_name": self.group_name, "flush_cache": True,
                "weight_version": str(version)}

    def _share(self, decision: _Join | str | None) -> _Join | str | None:
        """Rank 0's decision on every trainer rank."""
        if self.control is None:
            return decision
        box = [decision]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def _agreed(self, ok: bool) -> bool:
        """True on every trainer rank when the version streamed on every trainer rank."""
        if self.control is None:
            return ok
        flag = torch.tensor([int(ok)])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.control)
        return bool(flag.item())

    def _leave(self) -> None:
        for group in (self.link and self.link.group, self.assembly and self.assembly.group,
                      self.engine_group):
            abort(group)
        self.link = self.assembly = self.engine_group = None
        self.servers = ()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _control_group(timeout_s: float) -> Any:
    """A gloo group of the trainer ranks whose waits outlast a version's timeout."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=2 * timeout_s + 120))
