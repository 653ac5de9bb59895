"""The weight sync's projection (`planning.weight_sync`): the stream's plan for layouts
it never builds, and a version's seconds from each link's load."""

from __future__ import annotations

import math

import pytest

from moerl.models.arch import get_preset
from moerl.models.count import count_params
from moerl.parallel.layout import ParallelLayout
from moerl.parallel.shard_messages import Load
from moerl.parallel.shard_plan import first_senders
from moerl.planning.weight_sync import (
    Links,
    StreamLoads,
    owned_pieces,
    rank_pieces,
    stream_loads,
    version_time,
)

ARCH = get_preset("kimi-k2-mini")
TRAINER = ParallelLayout(tp=2, pp=2, ep=2, cp=1, dp=2)  # 8 ranks
ENGINE = ParallelLayout.for_world(4, tp=1, ep=4)


def test_a_layouts_pieces_hold_the_model() -> None:
    whole = sum(p.nbytes for p in rank_pieces(ARCH, ParallelLayout(), 0, "bfloat16"))
    assert math.isclose(whole, 2 * count_params(ARCH)[0], rel_tol=0.01)  # rounding only
    # every byte owned once over the trainer's ranks, whatever it cuts and replicates
    owned = first_senders({r: owned_pieces(ARCH, TRAINER, r, "bfloat16")
                           for r in range(TRAINER.world_size)})
    assert sum(p.nbytes for ps in owned.values() for p in ps) == whole


def test_every_engine_rank_receives_its_own_pieces_from_a_share_of_senders() -> None:
    plan = stream_loads(ARCH, TRAINER, ENGINE, engines=3, buffer_bytes=1 << 20)
    assert set(plan.receivers) == set(plan.held) == {8, 9, 10, 11}
    for rank, load in plan.receivers.items():
        assert plan.held[rank] <= load.bytes_received <= 1.1 * plan.held[rank]
    received = sum(r.bytes_received for r in plan.receivers.values())
    sent = [s.bytes_sent for s in plan.senders.values()]
    assert sum(sent) == 3 * received  # every engine replica takes the same
    assert len(sent) == TRAINER.world_size and max(sent) <= 2 * sum(sent) / len(sent)


def test_the_version_time_is_its_slowest_link_then_the_install() -> None:
    plan = StreamLoads({0: Load(bytes_sent=100, messages_sent=2),
                        1: Load(bytes_sent=300, messages_sent=1)},
                       {5: Load(bytes_received=400, messages_received=3)}, {5: 400})
    t = version_time(plan, Links(bandwidth=100.0, latency=0.5, staging=50.0, install=200.0))
    assert t.send == pytest.approx(3.5)  # rank 1: 300 / 100 + 1 x 0.5
    assert t.receive == pytest.approx(9.5)  # 400 / min(100, 50) + 3 x 0.5
    assert t.wire == t.receive and t.install == pytest.approx(2.0)
    assert t.total == pytest.approx(11.5)
    shared = version_time(plan, Links(bandwidth=100.0, latency=0.0, shared=20.0))
    assert shared.wire == shared.shared == pytest.approx(20.0)  # 400 bytes at 20 B/s
