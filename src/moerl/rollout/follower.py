"""A follower rank of a rollout server across ranks: it runs the leader's commands
(sent over `RolloutRanks`) on its engine until the leader says stop."""

from __future__ import annotations

import logging
import os
import signal

from moerl.rollout.engine import MegatronEngine
from moerl.rollout.ranks import Command, RolloutRanks, WeightLoadError

log = logging.getLogger(__name__)


def follow(engine: MegatronEngine, ranks: RolloutRanks) -> None:
    """A follower's life: run the leader's commands until it says stop.

    A follower that fails cannot answer the leader's next collective, so it ends the
    job (torchrun then stops every rank) instead of leaving the leader waiting. A
    stop signal (torchrun passes one to every rank) ends it at once: it holds nothing
    that is not on disk."""
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    try:
        while True:
            command = ranks.receive()
            if command.kind == "stop":
                return
            if command.kind == "tick":
                assert engine.runner is not None
                engine.runner.tick(command.assignments, command.forward)
            elif command.kind == "generate":
                engine.run_batch(list(command.requests))
            else:
                try:
                    _update(engine, command)
                except WeightLoadError as exc:  # every rank kept the old weights
                    log.warning("%s", exc)
    except Exception:
        log.exception("rollout rank %d failed; ending the server", ranks.rank)
        os._exit(1)


def _update(engine: MegatronEngine, command: Command) -> None:
    """A follower's part of a weight update (`join`, `receive` or `load`)."""
    if command.kind == "join":
        assert command.group is not None
        engine.join_on_every_rank(command.group)
    elif command.kind == "receive":
        assert command.manifest is not None
        engine.receive_on_every_rank(command.manifest)
    else:
        engine.load_on_every_rank(command.path, command.version)
