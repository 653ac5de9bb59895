"""A weight version over real gloo weight groups, the parties being threads of this
process: two senders holding tensor-parallel halves, one receiver holding the whole
tensors (`weight_group.join_with_plan`, `weight_transport`, `weight_receive`). The
receiver must get exactly its bytes, through at most two staging buffers; a sender
that stops makes the receiver fail by the deadline, one that leaves the group makes
it fail at once."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from moerl.parallel.shard_messages import schedule
from moerl.parallel.shard_plan import Piece, by_name, routes_from, routes_to
from moerl.ports import free_port
from moerl.rollout.weight_group import GroupSpec, Manifest, abort, join_with_plan
from moerl.rollout.weight_receive import ReceiveLink, install, stage
from moerl.rollout.weight_transport import Traffic, send_messages

SHAPES = {"rows.weight": (64, 32), "fc1.weight": (32, 16), "norm.weight": (32,)}
BUFFER = 2048  # bytes: the 8 KiB rows tensor goes in several messages


def _half(name: str, rank: int) -> Piece:
    shape = SHAPES[name]
    if name == "norm.weight":
        return Piece.whole(name, "float32", shape)
    if name == "fc1.weight":  # [gate; up]: a quarter of the rows from each half
        return Piece(name, "float32", shape, 0, ((rank * 8, rank * 8 + 8),
                                                 (16 + rank * 8, 16 + rank * 8 + 8)))
    return Piece(name, "float32", shape, 0, ((rank * 32, rank * 32 + 32),))


def _slice(whole: torch.Tensor, piece: Piece) -> torch.Tensor:
    return torch.cat([whole[a:b] for a, b in piece.ranges])


def _run(parties: list[Callable[[], Any]]) -> list[Any]:
    """Run each party in a thread; its result or the exception it raised, and when
    it ended (time.monotonic())."""
    results: list[Any] = [None] * len(parties)

    def go(i: int) -> None:
        try:
            results[i] = parties[i](), time.monotonic()
        except Exception as exc:  # handed to the test, without the frames that hold
            results[i] = exc.with_traceback(None), time.monotonic()  # its group open

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(parties))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    return results


def _version(stall: int | None = None, leave: int | None = None,
             timeout_s: float = 20.0) -> tuple[list[Any], dict[str, torch.Tensor],
                                               dict[str, torch.nn.Parameter], float]:
    """Version 1 from senders 0 and 1 into receiver 2; sender `stall` stops after its
    first message, sender `leave` leaves the group instead of sending."""
    spec = GroupSpec("127.0.0.1", free_port("127.0.0.1"), 2, 3, "test", "gloo", timeout_s)
    gen = torch.Generator().manual_seed(0)
    wholes = {n: torch.randn(s, generator=gen) for n, s in SHAPES.items()}
    params = {n: torch.nn.Parameter(torch.zeros(s)) for n, s in SHAPES.items()}
    mine = [Piece.whole(n, "float32", s) for n, s in SHAPES.items()]
    started = time.monotonic()

    def sender(rank: int) -> Traffic:
        pieces = [_half(n, rank) for n in SHAPES]
        group, routes = join_with_plan(spec, rank, pieces, [],
                                       lambda senders, receivers: routes_from(
                                           senders.get(rank, []), receivers))
        if rank == leave:
            abort(group)
            return Traffic()
        plan = schedule({(rank, d): ts for d, ts in routes.items()}, BUFFER)
        if rank == stall:
            plan = plan[:1]
        tensors = {p.name: _slice(wholes[p.name], p) for p in pieces}
        traffic = Traffic()
        send_messages(group, rank, plan, tensors, torch.device("cpu"),
                      time.monotonic() + timeout_s, traffic)
        if rank == stall:
            time.sleep(timeout_s + 2)
        return traffic

    def receiver() -> Any:
        group, routes = join_with_plan(spec, 2, [], mine,
                                       lambda senders, _: routes_to(mine, by_name(senders)))
        link = ReceiveLink(group, spec, 2, [(p, params[p.name]) for p in mine], routes)
        try:
            return stage(link, Manifest(1, "test", BUFFER))
        except Exception:
            abort(group)  # as the engine does: its senders' waits end too
            raise

    results = _run([lambda: sender(0), lambda: sender(1), receiver])
    return results, wholes, params, started


def test_the_receiver_gets_exactly_its_bytes_and_swaps_them_in() -> None:
    ((sent0, _), (sent1, _), (staged, _)), wholes, params, _ = _version()
    traffic = staged.traffic
    assert traffic.bytes_received == sent0.bytes_sent + sent1.bytes_sent
    assert traffic.bytes_received <= 1.1 * staged.held_bytes
    # the norm both senders hold whole comes from one of them only
    assert staged.held_bytes == sum(t.numel() * 4 for t in wholes.values())
    for traffic in (sent0, sent1, staged.traffic):
        assert 0 < traffic.staging_bytes <= 2 * BUFFER
    assert traffic.messages_received > 3  # the rows tensor went in pieces
    assert all(torch.equal(p, torch.zeros_like(p)) for p in params.values())  # not yet
    install(staged)
    for name, whole in wholes.items():
        assert torch.equal(params[name], whole)
    assert staged.values == []  # nothing of the version is kept beside the weights


def test_a_stalled_sender_fails_the_receiver_by_the_deadline() -> None:
    results, _, params, started = _version(stall=1, timeout_s=3.0)
    failure, ended = results[2]
    assert isinstance(failure, TimeoutError)
    assert 3.0 <= ended - started < 10.0
    assert all(torch.equal(p, torch.zeros_like(p)) for p in params.values())


def test_a_sender_that_leaves_fails_the_receiver_at_once() -> None:
    results, _, _, started = _version(leave=0, timeout_s=30.0)
    (failure, ended), (other, other_ended) = results[2], results[1]
    assert isinstance(failure, RuntimeError) and not isinstance(failure, TimeoutError)
    assert ended - started < 20.0  # not the 30 s timeout
    # the other sender, whose receiver left, is not left waiting either
    assert isinstance(other, RuntimeError) and other_ended - started < 20.0


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)
