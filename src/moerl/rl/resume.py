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
    reference_id     which frozen reference model the run trains against
    updates          the policy's update() calls so far (the critic's warm-up counts them)

The reference model (the policy as RL started: after SFT, or the initial weights)
is written once per run to `<checkpoint.dir>/reference`; a resume loads it from
there instead of running SFT again, since the policy's own weights come from the
checkpoint.
"""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moerl.checkpoint.checkpointer import Checkpointer
from moerl.checkpoint.collective import barrier, broadcast, rank
from moerl.checkpoint.config import CheckpointConfig, CheckpointError, Fingerprints
from moerl.checkpoint.store import complete_checkpoints
from moerl.models.weights import save_weights
from moerl.models.weights_marker import is_complete
from moerl.rl.loop import StepEnd
from moerl.rl.policy import Policy
from moerl.signals import StopOnSignal

RL_STATE = "rl"
REFERENCE = "reference"
_REFERENCE_ID = "reference_id"


@dataclass(frozen=True)
class RLState:
    next_step: int
    weight_version: int
    prompts: dict[str, Any]
    collected_ahead: int
    reference_id: str | None
    updates: int

    @classmethod
    def from_extra(cls, extra: dict[str, Any], where: Path) -> RLState:
        rl = extra.get(RL_STATE)
        try:
            if not isinstance(rl, dict):
                raise TypeError(f"'{RL_STATE}' is {type(rl).__name__}, not an object")
            state = cls(int(rl["next_step"]), int(rl["weight_version"]), dict(rl["prompts"]),
                        int(rl.get("collected_ahead", 0)), rl.get("reference_id"),
                        int(rl["updates"] if "updates" in rl else rl["next_step"]))
        except (KeyError, TypeError, ValueError) as err:
            raise CheckpointError(
                f"{where}: the RL state is missing or malformed ({err!r}); it cannot be "
                "resumed exactly (start a new run in another run_dir)"
            ) from err
        return state


class RLCheckpoints:
    """The `Checkpointer` of one RL run, plus its reference model (every rank)."""

    def __init__(self, cfg: CheckpointConfig, fingerprints: Fingerprints) -> None:
        self.cfg = cfg
        self.checkpointer = Checkpointer(cfg, fingerprints)
        self.reference_dir = Path(str(cfg.dir)) / REFERENCE
        self.reference_id: str | None = None
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
                # A new run's saves would mix with them (and replace the reference).
                raise CheckpointError(
                    f"checkpoint.resume=none, but {self.checkpointer.root} holds an earlier "
                    f"run's checkpoints ({earlier[-1].name}, ...); give this run another "
                    "run_dir (or checkpoint.dir), or delete them"
                )
        return self._found

    def reference_weights(self) -> Path | None:
        """Where the resumed run's reference model is (None when starting fresh)."""
        if self.found() is None:
            return None
        if not is_complete(self.reference_dir):
            raise CheckpointError(
                f"{self.reference_dir}: the reference model's weights are missing, so the "
                f"checkpoint {self.found()} cannot be resumed exactly (start a new run in "
                "another run_dir)"
            )
        return self.reference_dir

    def load(self, policy: Policy) -> RLState | None:
        """Resume `policy` from the checkpoint found (None: a fresh start, whose
        reference model is written now)."""
        resumed = self.checkpointer.load(policy.trainable, require=(RL_STATE,),
                                         parts=policy.checkpoint_parts())
        if resumed is None:
            self._write_reference(policy)
            return None
        state = RLState.from_extra(resumed.extra, resumed.path)
        on_disk = _read_id(self.reference_dir)
        if policy.reference is not None and state.reference_id != on_disk:
            raise CheckpointError(
                f"{self.reference_dir} holds the reference model of another run (id "
                f"{on_disk} != {state.reference_id} recorded in {resumed.path}); "
                "resume in the run's own checkpoint.dir, or start a new run in another run_dir"
            )
        self.reference_id = state.reference_id
        policy.updates = state.updates
        return state

    def _write_reference(self, policy: Policy) -> None:
        if policy.reference is None:
            return
        new_id = broadcast(uuid.uuid4().hex)
        if rank() == 0:
            shutil.rmtree(self.reference_dir, ignore_errors=True)
        barrier()
        save_weights(policy.reference, self.reference_dir)
        if rank() == 0:
            (self.reference_dir / _REFERENCE_ID).write_text(new_id + "\n")
        barrier()
        self.reference_id = new_id

    def step_end_hook(self, policy: Policy, stop: StopOnSignal,
                      steps: int) -> Callable[[StepEnd], bool]:
        """`rl.loop.train`'s `on_step_end`: save when due or at the end; on a stop
        signal save and return True, which ends the run."""

        def on_step_end(end: StepEnd) -> bool:
            done = end.step + 1
            rl = {"next_step": done, "weight_version": done, "prompts": end.prompts,
                  "collected_ahead": end.collected_ahead, "reference_id": self.reference_id,
                  "updates": policy.updates}
            return self.checkpointer.end_of_step(done, policy.trainable, {RL_STATE: rl}, stop,
                                                 last=done == steps,
                                                 parts=policy.checkpoint_parts())

        return on_step_end

    def close(self) -> None:
        self.checkpointer.close()


def _read_id(directory: Path) -> str | None:
    path = directory / _REFERENCE_ID
    return path.read_text().strip() if path.is_file() else None
