"""The asynchronous checkpoint writer's thread yields the CPU to training: SCHED_IDLE
for that thread alone, never for the rank that starts it."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from moerl.checkpoint.async_writer import lower_own_priority


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread policy is Linux's")
def test_writer_thread_runs_idle_and_the_rank_keeps_its_policy() -> None:
    seen: dict[str, int | str] = {}

    def writer() -> None:
        seen["got"] = lower_own_priority()
        seen["policy"] = os.sched_getscheduler(threading.get_native_id())

    before = os.sched_getscheduler(0)
    thread = threading.Thread(target=writer)
    thread.start()
    thread.join()
    assert seen == {"got": "idle", "policy": os.SCHED_IDLE}
    assert os.sched_getscheduler(0) == before != os.SCHED_IDLE
    assert os.sched_getscheduler(threading.get_native_id()) == before
