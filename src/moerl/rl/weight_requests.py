"""The weight stream's HTTP calls to the rollout servers (the controller, trainer rank 0).

Which servers are alive (`live_servers`, each moerl server saying how many ranks it
has), the join request in each engine's protocol (`join_request`), and the calls made
while the trainer ranks stream, in threads that never hold up a failure (`asking`):
once a rank's group is dropped the servers' waits on it end, and they answer then.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import httpx

from moerl.rollout.client import RolloutClient
from moerl.rollout.weight_group import GroupSpec

log = logging.getLogger(__name__)

Reply = Future[tuple[str | None, Any]]


def live_servers(rollout_client: RolloutClient | None, engine: str, server_ranks: int | None,
                 timeout_s: float) -> tuple[tuple[str, int], ...]:
    """(url, ranks) of every server that answers /health."""
    assert rollout_client is not None, "the controller rank streams to the servers"
    live = []
    with httpx.Client(timeout=min(30.0, timeout_s), trust_env=False) as http:
        for url in rollout_client.urls:
            try:
                reply = http.get(f"{url}/health")
            except httpx.HTTPError as exc:
                log.warning("weight group: %s is left out (%s)", url, exc)
                continue
            if reply.status_code != 200:
                log.warning("weight group: %s is left out (HTTP %d)", url, reply.status_code)
                continue
            ranks = (int(reply.json().get("ranks", 1)) if engine == "moerl"
                     else server_ranks or 1)
            live.append((url, ranks))
    return tuple(live)


def join_request(engine: str, spec: GroupSpec, offset: int) -> tuple[str, dict[str, Any]]:
    """(path, body) asking one server to join the group from rank `offset` on."""
    body: dict[str, Any] = {**spec.__dict__, "rank_offset": offset}
    if engine == "vllm":
        return "/collective_rpc", {"method": "moerl_join_weight_group", "kwargs": body}
    if engine == "sglang":  # its request has no timeout field
        body.pop("timeout_s")
    return "/init_weights_update_group", body


def post(url: str, path: str, body: dict[str, Any], *, deadline: float
         ) -> tuple[str | None, Any]:
    """(None or why the server refused, its JSON answer)."""
    left = max(deadline - time.monotonic(), 1.0)
    with httpx.Client(timeout=left, trust_env=False) as http:
        reply = http.post(f"{url}{path}", json=body)
    if reply.status_code != 200:
        return f"{url}{path}: HTTP {reply.status_code} {reply.text[:500]}", None
    return None, reply.json()


def post_all(pool: ThreadPoolExecutor, servers: tuple[tuple[str, int], ...], path: str,
             body: dict[str, Any], deadline: float) -> list[Reply]:
    return [pool.submit(post, url, path, body, deadline=deadline) for url, _ in servers]


@contextmanager
def asking(servers: int) -> Iterator[ThreadPoolExecutor]:
    """Threads for the requests to the servers that do not hold up a failure: the
    servers answer once their waits on the group end, which happens when this side's
    group is dropped (after the failure is handled)."""
    pool = ThreadPoolExecutor(max(servers, 1), thread_name_prefix="weight-sync")
    try:
        yield pool
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


def check(replies: list[Reply], what: str) -> list[Any]:
    """The servers' answers; raises naming every refusal."""
    results = [r.result() for r in replies]
    failures = [f for f, _ in results if f]
    if failures:
        raise RuntimeError(f"{what}: {failures}")
    return [answer for _, answer in results]

