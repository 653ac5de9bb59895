"""Checkpoints of an RL run, and the RL state an exact resume continues from.

A checkpoint (`moerl.checkpoint.checkpointer`) holds the policy's model and optimizer, the LR
schedule and every rank's RNG, and the same of the critic (`rl.advantage=gae`) as its
part "critic". The RL run adds, as the checkpoint's JSON `rl` state:

    next_step        the RL step to run next (the loop's steps done so far)
    weight_version   the version the rollout servers serve (pushed again on resume)
    prompts          the PromptStream state where the next step's prompts begin
    collected_ahead  async mode: batches already collected for later steps. They are
                     not saved: a resume collects their prompts again (same order)
                     under the resumed weights, so an async resume repeats the data
                     but not those samples; a sync resume is exact.
    reference        where the frozen reference model is: {"weights": the weights
                     directory the run started from (`init_weights` or the SFT warm-up's
                     output)} or, for a run that started from a fresh model,
                     {"weights": null, "seed", "layout"}
    updates          the loop's updates so far (`Peers.updates`; the critic's warm-up
                     counts them)

The reference model is the policy as RL started, so it is read from where those
weights already are: nothing is copied at start-up. A resume loads it from the
recorded directory (each rank its shard), or builds the fresh model again from the
seed under the same layout (a fresh model's values depend on both); a resume that
cannot find it is refused. Checkpoints of runs before this wrote a copy to
`<checkpoint.dir>/reference` (`reference_id`), which a resume still reads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moerl.checkpoint.checkpointer import Checkpointer
from moerl.checkpoint.collective import broadcast, rank
from moerl.checkpoint.config import CheckpointConfig, CheckpointError, Fingerprints
from moerl.checkpoint.store import complete_checkpoints
from moerl.models.weights_marker import is_complete
from moerl.rl.loop import StepEnd
from moerl.rl.peers import Peers
from moerl.signals import StopOnSignal

RL_STATE = "rl"
LEGACY_REFERENCE = "reference"  # <checkpoint.dir>/reference: the copy older runs wrote
_REFERENCE_ID = "reference_id"


@dataclass(frozen=True)
class RLState:
    next_step: int
    weight_version: int
    prompts: dict[str, Any]
    collected_ahead: int
    reference: dict[str, Any] | None  # None: an older run's copy (reference_id)
    updates: int

    @classmethod
    def from_extra(cls, extra: dict[str, Any], where: Path) -> RLState:
        rl = extra.get(RL_STATE)
        try:
            if not isinstance(rl, dict):
                raise TypeError(f"'{RL_STATE}' is {type(rl).__name__}, not an object")
            reference = rl.get("reference")
            state = cls(int(rl["next_step"]), int(rl["weight_version"]), dict(rl["prompts"]),
                        int(rl.get("collected_ahead", 0)),
                        None if reference is None else dict(reference),
                        int(rl["updates"] if "updates" in rl else rl["next_step"]))
        except (KeyError, TypeError, ValueError) as err:
            raise CheckpointError(
                f"{where}: the RL state is missing or malformed ({err!r}); it cannot be "
                "resumed exactly (start a new run in another run_dir)"
            ) from err
        return state


class RLCheckpoints:
    """The `Checkpointer` of one RL run, plus where its reference model is (every rank).

    `start`: where a fresh start's policy comes from, the weights directory or None for
    a fresh model (then `seed` and `layout` make it again)."""

    def __init__(self, cfg: CheckpointConfig, fingerprints: Fingerprints,
                 start: str | Path | None, seed: int, layout: str) -> None:
        self.cfg = cfg
        self.checkpointer = Checkpointer(cfg, fingerprints)
        self.reference: dict[str, Any] = (
            {"weights": str(Path(start).resolve())} if start is not None
            else {"weights": None, "seed": seed, "layout": layout})
        self._legacy_dir = Path(str(cfg.dir)) / LEGACY_REFERENCE
        self._found: Path | None = None
        self._resolved = False

    def found(self) -> Path | None:
        """The checkpoint a resume starts from, if any (collective, asked once)."""
        if not self._resolved:
            self._found, self._resolved = self.checkpointer.resolve(), True
            if self._found is not None:
                self.checkpointer.check_compatible(self._found, require=(RL_STATE,))
            elif earlier := broadcast(
                    complete_checkpoints(self.checkpointer.root) if rank() == 0 else None):
                # A new run's saves would mix with them.
                raise CheckpointError(
                    f"checkpoint.resume=none, but {self.checkpointer.root} holds an earlier "
                    f"run's checkpoints ({earlier[-1].name}, ...); give this run another "
                    "run_dir (or checkpoint.dir), or delete them"
                )
        return self._found

    def reference_weights(self) -> Path | None:
        """Where a resumed run's reference model is read from; None when starting fresh
        (the reference is then the initial policy), or when the run began from a fresh
        model (the policy is built again from the same seed, and the reference is its
        copy). Refuses what cannot give the run's own reference back."""
        found = self.found()
        if found is None:
            return None
        saved = RLState.from_extra(self.checkpointer.saved_extra(found), found).reference
        if saved is None:  # a run from before: its reference was copied into the run
            return self._legacy_reference(found)
        if saved.get("weights") is None:
            ours = {k: self.reference.get(k) for k in ("seed", "layout")}
            if {k: saved.get(k) for k in ours} != ours:
                raise CheckpointError(
                    f"{found}: the run started from a fresh model (seed {saved.get('seed')}, "
                    f"layout {saved.get('layout')}), which is its reference model; this run "
                    f"has seed {ours['seed']}, layout {ours['layout']}, and would build "
                    "another. Resume with that seed and layout, or start a new run from "
                    "weights on disk (init_weights)")
        elif not is_complete(saved["weights"]):
            raise CheckpointError(
                f"{found}: the reference model is read from {saved['weights']} (the weights "
                "the run started from), which is not a complete weights directory any more; "
                "put it back to resume exactly, or start a new run in another run_dir")
        self.reference = saved
        return None if saved["weights"] is None else Path(saved["weights"])

    def _legacy_reference(self, found: Path) -> Path:
        rl = self.checkpointer.saved_extra(found).get(RL_STATE)
        recorded = rl.get(_REFERENCE_ID) if isinstance(rl, dict) else None
        on_disk = _read_id(self._legacy_dir)
        if not is_complete(self._legacy_dir) or recorded != on_disk:
            raise CheckpointError(
                f"{self._legacy_dir}: the reference model of the run that wrote {found} is "
                f"missing or another run's (id {on_disk} != {recorded}); resume in the run's "
                "own checkpoint.dir, or start a new run in another run_dir")
        self.reference = {"weights": str(self._legacy_dir)}
        return self._legacy_dir

    def load(self, peers: Peers) -> RLState | None:
        """Resume the policy and the critic of `peers` from the checkpoint found (None: a
        fresh start)."""
        resumed = self.checkpointer.load(peers.policy.trainable, require=(RL_STATE,),
                                         parts=peers.checkpoint_parts())
        if resumed is None:
            return None
        state = RLState.from_extra(resumed.extra, resumed.path)
        peers.updates = state.updates
        return state

    def step_end_hook(self, peers: Peers, stop: StopOnSignal,
                      steps: int) -> Callable[[StepEnd], bool]:
        """`rl.loop.run_steps`'s `on_step_end`: save when due or at the end; on a stop
        signal save and return True, which ends the run."""

        def on_step_end(end: StepEnd) -> bool:
            done = end.step + 1
            rl = {"next_step": done, "weight_version": done, "prompts": end.prompts,
                  "collected_ahead": end.collected_ahead, "reference": self.reference,
                  "updates": peers.updates}
            return self.checkpointer.end_of_step(done, peers.policy.trainable, {RL_STATE: rl},
                                                 stop, last=done == steps,
                                                 parts=peers.checkpoint_parts())

        return on_step_end

    def close(self) -> None:
        self.checkpointer.close()


def _read_id(directory: Path) -> str | None:
    path = directory / _REFERENCE_ID
    return path.read_text().strip() if path.is_file() else None
