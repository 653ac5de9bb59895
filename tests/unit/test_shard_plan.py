"""The shard plan (`parallel.shard_plan`, `parallel.shard_messages`): which sender
passes which slabs to which receiver, in which messages. Pieces are described here as
tensor parallelism cuts them (plain rows, columns, gated [gate; up] rows), and every
plan is carried out with real tensors: each receiver must end up holding exactly its
slice of the whole tensor."""

from __future__ import annotations

import random
from collections import deque

import pytest
import torch

from moerl.parallel.shard_messages import Message, loads, messages, schedule
from moerl.parallel.shard_plan import (
    Piece,
    PlanError,
    by_name,
    first_senders,
    overlap,
    owned_by,
    routes_from,
    routes_to,
)

WHOLE = {"rows.weight": (12, 6), "cols.weight": (6, 12), "fc1.weight": (16, 4),
         "norm.weight": (6,)}
DIM = {"rows.weight": 0, "cols.weight": 1, "fc1.weight": 0, "norm.weight": 0}


def _pieces(tp: int, rank: int) -> list[Piece]:
    """What tensor-parallel rank `rank` of `tp` holds of each tensor in WHOLE."""
    out = []
    for name, shape in WHOLE.items():
        dim = DIM[name]
        if name == "norm.weight" or tp == 1:
            out.append(Piece.whole(name, "float32", shape))
            continue
        size = shape[dim] // tp
        if name == "fc1.weight":  # [gate; up]: a share of each half
            half, step = shape[0] // 2, shape[0] // 2 // tp
            ranges = ((rank * step, (rank + 1) * step), (half + rank * step,
                                                         half + (rank + 1) * step))
        else:
            ranges = ((rank * size, (rank + 1) * size),)
        out.append(Piece(name, "float32", shape, dim, ranges))
    return out


def _slice(whole: torch.Tensor, piece: Piece) -> torch.Tensor:
    return torch.cat([whole.narrow(piece.dim, a, b - a) for a, b in piece.ranges], piece.dim)


def _carry_out(plan: list[Message], senders: dict[int, list[Piece]],
               receivers: dict[int, list[Piece]], wholes: dict[str, torch.Tensor]
               ) -> dict[int, dict[str, torch.Tensor]]:
    local = {r: {p.name: _slice(wholes[p.name], p) for p in ps} for r, ps in senders.items()}
    got = {r: {p.name: torch.full(p.local_shape, float("nan")) for p in ps}
           for r, ps in receivers.items()}
    for message in plan:
        for part in message.parts:
            src = local[message.src][part.name].narrow(part.dim, part.src_offset, part.length)
            got[message.dst][part.name].narrow(part.dim, part.dst_offset,
                                               part.length).copy_(src)
    return got


@pytest.mark.parametrize(("send_tp", "receive_tp"), [(2, 1), (1, 2), (2, 4), (4, 2), (2, 2)])
def test_every_receiver_gets_exactly_its_slices(send_tp: int, receive_tp: int) -> None:
    gen = torch.Generator().manual_seed(send_tp * 10 + receive_tp)
    wholes = {n: torch.randn(s, generator=gen) for n, s in WHOLE.items()}
    # senders 0..send_tp-1; two receiver replicas of receive_tp ranks each
    senders = first_senders({r: _pieces(send_tp, r) for r in range(send_tp)})
    receivers = {100 + 10 * replica + r: _pieces(receive_tp, r)
                 for replica in range(2) for r in range(receive_tp)}
    pairs = {(s, d): ts for s in senders for d, ts in routes_from(senders[s], receivers).items()}
    for d, mine in receivers.items():  # the receivers' view of the same plan agrees
        for s, ts in routes_to(mine, by_name(senders)).items():
            assert pairs[(s, d)] == ts
    got = _carry_out(schedule(pairs, buffer_bytes=64), senders, receivers, wholes)
    for rank, pieces in receivers.items():
        for piece in pieces:
            assert torch.equal(got[rank][piece.name], _slice(wholes[piece.name], piece))
    # a byte's only sender: the norm every sender holds whole goes from rank 0 alone
    assert [p.name for p in senders.get(1, [])].count("norm.weight") == 0
    wire = loads(schedule(pairs, buffer_bytes=64))
    for rank, pieces in receivers.items():  # nothing but its own slices (plus alignment)
        assert wire[rank].bytes_received <= sum(p.nbytes for p in pieces) * 1.1


def test_a_gated_slice_keeps_gate_then_up() -> None:
    whole = Piece.whole("fc1.weight", "float32", (16, 4))
    (gate, up) = _pieces(2, 1)[2].ranges
    transfers = overlap(whole, _pieces(2, 1)[2])
    assert [(t.src_offset, t.dst_offset, t.length) for t in transfers] == [
        (gate[0], 0, 4), (up[0], 4, 4)]


def test_owners_share_the_bytes() -> None:
    rng = random.Random(0)
    pieces = [Piece.whole(f"t{i}", "float32", (rng.randint(1, 50), 8)) for i in range(60)]
    owners = owned_by(pieces, 4)
    load = [sum(p.nbytes for p, o in zip(pieces, owners, strict=True) if o == r)
            for r in range(4)]
    assert max(load) - min(load) <= max(p.nbytes for p in pieces)
    assert owned_by(pieces, 4) == owners  # every replica computes the same split


def test_messages_fit_the_buffer_and_cut_large_slabs() -> None:
    big = overlap(Piece.whole("a", "float32", (100, 8)), Piece.whole("a", "float32", (100, 8)))
    small = overlap(Piece.whole("b", "bfloat16", (3,)), Piece.whole("b", "bfloat16", (3,)))
    packed = messages(big + small, buffer_bytes=1024)
    assert all(Message(0, 1, 0, tuple(m)).nbytes <= 1024 for m in packed)
    assert sum(p.length for m in packed for p in m if p.name == "a") == 100
    assert packed[-1][-1].name == "b"  # the small one rides with the last slab
    with pytest.raises(PlanError, match=r"rl\.weight_sync_staging_bytes: a moves 32 bytes"):
        messages(big, buffer_bytes=16)


def test_a_tensor_no_sender_covers_is_refused() -> None:
    with pytest.raises(PlanError, match=r"rows\.weight: the senders cover 36 of the 72 elements"):
        routes_to(_pieces(1, 0)[:1], by_name({0: [_pieces(2, 0)[0]]}))
    with pytest.raises(PlanError, match="the sender holds it as"):
        overlap(Piece.whole("a", "float32", (4, 2)), Piece.whole("a", "float32", (2, 4)))


def test_the_schedule_never_deadlocks_with_two_buffers_a_side() -> None:
    """Every rank works through its own messages in the schedule's order, waiting for
    the oldest before it posts a third; a message moves once both ends posted it."""
    rng = random.Random(1)
    pairs = {}
    for s in range(3):
        for d in range(3, 7):
            if rng.random() < 0.8:
                whole = Piece.whole(f"t{s}{d}", "float32", (rng.randint(1, 9), 4))
                pairs[(s, d)] = overlap(whole, whole)
    plan = schedule(pairs, buffer_bytes=32)
    assert len({(m.src, m.dst) for m in plan}) == len(pairs) and len(plan) > len(pairs)
    queues = {r: deque(m for m in plan if r in (m.src, m.dst)) for r in range(7)}
    done: set[int] = set()
    while len(done) < len(plan):
        posted = {r: {id(m) for m in list(q)[:2]} for r, q in queues.items()}
        ready = [m for m in plan if id(m) not in done
                 and id(m) in posted[m.src] and id(m) in posted[m.dst]]
        assert ready, "no message can move: deadlock"
        done.update(id(m) for m in ready)
        for q in queues.values():  # a rank waits for its oldest first
            while q and id(q[0]) in done:
                q.popleft()


def test_a_large_piece_is_shared_out_among_its_holders(monkeypatch: pytest.MonkeyPatch) -> None:
    """Four replicas hold the same whole tensor; each owns a quarter of it and sends
    those rows from its own tensor to a receiver cutting it in two along dim 0."""
    from moerl.parallel import shard_plan

    monkeypatch.setattr(shard_plan, "SPLIT_BYTES", 16)
    shard_plan._shares.cache_clear()
    whole = torch.arange(16 * 3, dtype=torch.float32).reshape(16, 3)
    held = [Piece.whole("w", "float32", (16, 3)), Piece.whole("small", "float32", (2,))]
    shares = {r: shard_plan.owned(held, lambda _p, r=r: (r, 4, "dense")) for r in range(4)}
    parts = {r: [part for _, part in share] for r, share in shares.items()}
    assert [[p.ranges for p in ps if p.name == "w"] for ps in parts.values()] == [
        [((0, 4),)], [((4, 8),)], [((8, 12),)], [((12, 16),)]]
    assert sum(p.name == "small" for ps in parts.values() for p in ps) == 1  # 8 bytes: whole
    half = Piece("w", "float32", (16, 3), 0, ((8, 16),))
    got = torch.full((8, 3), float("nan"))
    for mine in parts.values():
        for t in routes_from(mine, {9: [half]}).get(9, []):
            got.narrow(0, t.dst_offset, t.length).copy_(whole.narrow(0, t.src_offset, t.length))
    assert torch.equal(got, whole[8:])
    shard_plan._shares.cache_clear()
