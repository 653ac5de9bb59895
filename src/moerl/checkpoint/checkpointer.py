"""Checkpoints a run can resume from exactly, after any kill.

A checkpoint holds the model and optimizer (Megatron `dist_checkpointing`,
resharded on load, see `moerl.checkpoint.sharded`), the LR schedule, the step,
the same three of each named part (another trainable of the run, such as the RL
critic: its tensors' keys start with `<name>.`, its facts are in state.json's `parts`),
every rank's RNG states, the caller's extra state (data-loader position, RL state:
pending rollouts, weight versions of buffered samples, reward-cache keys; JSON,
never pickle) and fingerprints of the model, the dataset and the config.

Saving is atomic (`moerl.checkpoint.store`): every rank writes into a
temporary directory, the ranks agree that all writes succeeded, the files are
hashed into a manifest, the directory is renamed into place and only then does
`latest` move. A failure on any rank fails the save on every rank and leaves
`latest` where it was. Loading verifies the manifest first: a truncated or
modified checkpoint is refused, never half-used.

With `async_save` the tensors are written by megatron-core's own background
writer (a forked process per rank; it works on CPU with the CPU shims) and the
checkpoint is published when `poll()` or `wait()` finds every rank done.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

from moerl.checkpoint.collective import (
    FAULT_ENV,
    agree,
    barrier,
    broadcast,
    fault,
    rank,
    world,
)
from moerl.checkpoint.config import (
    CheckpointConfig,
    CheckpointError,
    Fingerprints,
    Json,
    check_json,
)
from moerl.checkpoint.manifest import verify_manifest, write_manifest
from moerl.checkpoint.rng import capture_rng, restore_rng
from moerl.checkpoint.sharded import (
    apply_loaded,
    check_optimizer_compatible,
    optimizer_facts,
    sharded_state,
)
from moerl.checkpoint.store import (
    cleanup,
    complete_checkpoints,
    partial_dir,
    publish,
    read_latest,
    remove_stale_partials,
    step_name,
)
from moerl.checkpoint.trainable import Trainable
from moerl.signals import StopOnSignal, start_helpers_ignoring

__all__ = ["FAULT_ENV", "CheckpointConfig", "CheckpointError", "Checkpointer", "Fingerprints",
           "Resumed"]

STATE = "state.json"
DIST = "dist"


@dataclass(frozen=True)
class Resumed:
    step: int  # optimizer steps completed; training continues at this step index
    path: Path
    extra: dict[str, Json]  # the caller's extra state, as saved
    weights_only: bool


class Checkpointer:
    """Saves and loads the checkpoints of one run under `cfg.dir`."""

    def __init__(self, cfg: CheckpointConfig, fingerprints: Fingerprints) -> None:
        if cfg.dir is None:
            raise ValueError("checkpoint.dir: set a directory to checkpoint")
        self.cfg = cfg
        self.root = Path(cfg.dir)
        self.fingerprints = fingerprints
        self._async = AsyncCallsQueue() if cfg.async_save else None

    def should_save(self, step: int) -> bool:
        return self.cfg.save_interval > 0 and step % self.cfg.save_interval == 0

    # -- saving ---------------------------------------------------------------

    def save(self, step: int, trainable: Trainable, extra_state: Mapping[str, Any],
             parts: Mapping[str, Trainable] | None = None) -> Path:
        """Checkpoint after `step` optimizer steps (collective: call on every rank).

        `parts`: other trainables saved beside `trainable`, by name. Returns the final
        directory; with `async_save` it appears there (and `latest` moves) only once
        `poll()` or `wait()` has seen every rank finish.
        """
        parts = _checked_parts(parts)
        self.wait()  # one save in flight at a time: `latest` moves in step order
        final = self.root / step_name(step)
        if broadcast(final.exists() and read_latest(self.root) == final):
            return final  # resumed at the last step: nothing new to save
        tmp = partial_dir(self.root, step)
        if rank() == 0:
            if final.exists():  # complete, but a kill came before `latest` moved to it
                os.replace(final, partial_dir(self.root, step).with_suffix(".old"))
            remove_stale_partials(self.root)
            (tmp / DIST).mkdir(parents=True)
        barrier()
        error = None
        try:
            self._write_plain_state(tmp, step, trainable, extra_state, parts)
        except Exception as err:
            error = f"rank {rank()}: {err!r}"
        self._fail_cleanly(error, tmp, "checkpoint save (step state)")
        request = None
        start_helpers_ignoring()  # the writer's helper, started cheaply and bound to us
        try:
            request = dist_checkpointing.save(
                _sharded(trainable, parts, with_optimizer=True, loading=False),
                str(tmp / DIST),
                async_sharded_save=self._async is not None,
                async_strategy="mcore",
            )
        except Exception as err:
            error = f"rank {rank()}: {err!r}"
        self._fail_cleanly(error, tmp, "checkpoint save (tensors)")
        if self._async is not None and request is not None:
            request.add_finalize_fn(partial(self._finish, tmp, final, step))
            self._async.schedule_async_request(request)
        else:
            self._finish(tmp, final, step)
        return final

    def _write_plain_state(
        self, tmp: Path, step: int, trainable: Trainable, extra_state: Mapping[str, Any],
        parts: Mapping[str, Trainable],
    ) -> None:
        rng_dir = tmp / "rng"
        rng_dir.mkdir(exist_ok=True)
        (rng_dir / f"rank_{rank():05d}.json").write_text(json.dumps(capture_rng()))
        fault("write", step)
        if rank() != 0:
            return
        check_json(dict(extra_state), "extra_state")
        state = {
            "format": 1,
            "step": step,
            "world_size": world(),
            "fingerprints": vars(self.fingerprints),
            "optimizer": optimizer_facts(trainable),
            "scheduler": trainable.scheduler.state_dict(),
            "parts": {name: {"optimizer": optimizer_facts(part),
                             "scheduler": part.scheduler.state_dict()}
                      for name, part in parts.items()},
            "extra": dict(extra_state),
        }
        (tmp / STATE).write_text(json.dumps(state, indent=1, allow_nan=False))

    def _fail_cleanly(self, error: str | None, tmp: Path, what: str) -> None:
        try:
            agree(error, what)
        except CheckpointError:
            if rank() == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise

    def _finish(self, tmp: Path, final: Path, step: int) -> None:
        """Verify, hash, rename, move `latest`, clean up (every rank, after the writes)."""
        error = None
        try:
            fault("tensors", step)
            if rank() == 0:
                expected = [tmp / STATE, tmp / DIST / "metadata.json"]
                expected += [tmp / "rng" / f"rank_{r:05d}.json" for r in range(world())]
                missing = [str(p.relative_to(tmp)) for p in expected if not p.is_file()]
                if missing:
                    raise CheckpointError(f"written checkpoint lacks {missing}")
        except Exception as err:
            error = f"rank {rank()}: {err!r}"
        self._fail_cleanly(error, tmp, "checkpoint save (verify)")
        write_manifest(tmp)
        fault("manifest", step)
        if rank() == 0:
            publish(tmp, final)
            fault("publish", step)
            cleanup(self.root, self.cfg.keep_last)
        barrier()

    def poll(self) -> None:
        """Publish async saves that every rank has finished writing (collective)."""
        if self._async is not None:
            self._async.maybe_finalize_async_calls(blocking=False)

    def wait(self) -> None:
        """Block until any async save is written and published (collective)."""
        if self._async is not None:
            self._async.maybe_finalize_async_calls(blocking=True)

    # -- loading --------------------------------------------------------------

    def resolve(self) -> Path | None:
        """The checkpoint `cfg.resume` asks for (the same answer on every rank)."""
        resume = self.cfg.resume
        if resume == "none":
            return None
        if resume != "auto":
            path = Path(resume)
            if not path.is_dir():
                raise CheckpointError(f"checkpoint.resume={resume}: no such checkpoint directory")
            return path
        found = None
        if rank() == 0:
            found = read_latest(self.root)
            if found is None and (complete := complete_checkpoints(self.root)):
                # Killed between the first rename and the first `latest`.
                found = complete[-1]
        return broadcast(found)

    def load(self, trainable: Trainable, require: tuple[str, ...] = ("data",),
             parts: Mapping[str, Trainable] | None = None) -> Resumed | None:
        """Resume into `trainable` (and each of `parts`, by name) as `cfg.resume` says;
        None: nothing to resume.

        `require`: the sections of the extra state this caller cannot continue
        without (a checkpoint lacking one, or one of `parts`, is refused, not resumed
        without it).
        """
        parts = _checked_parts(parts)
        path = self.resolve()
        if path is None:
            return None
        verify_manifest(path)
        state = json.loads((path / STATE).read_text())
        self._check_compatible(path, state, require)
        saved = state.get("parts", {})
        if missing := [name for name in parts if name not in saved]:
            raise CheckpointError(
                f"{path} holds no {', '.join(missing)} (the run that saved it had none), so "
                "this run cannot continue from it exactly; resume with the saving run's "
                "settings, or start fresh with checkpoint.resume=none")
        with_optimizer = not self.cfg.weights_only
        if with_optimizer:
            check_optimizer_compatible(state["optimizer"], optimizer_facts(trainable))
            for name, part in parts.items():
                check_optimizer_compatible(saved[name]["optimizer"], optimizer_facts(part))
        template = _sharded(trainable, parts, with_optimizer=with_optimizer, loading=True)
        loaded = dist_checkpointing.load(template, str(path / DIST))
        apply_loaded(trainable, loaded, with_optimizer, int(state["optimizer"]["step"]))
        trainable.scheduler.load_state_dict(state["scheduler"])
        for name, part in parts.items():
            apply_loaded(part, loaded[name], with_optimizer,
                         int(saved[name]["optimizer"]["step"]), prefix=f"{name}.")
            part.scheduler.load_state_dict(saved[name]["scheduler"])
        # Ranks keep their own random streams; under a new world size rank r
        # continues saved rank r % old_world's (no exact match exists then).
        saved_rank = rank() % int(state["world_size"])
        restore_rng(json.loads((path / "rng" / f"rank_{saved_rank:05d}.json").read_text()))
        if rank() == 0:
            how = "weights only" if self.cfg.weights_only else "model + optimizer"
            print(f"resumed from {path} at step {state['step']} ({how})", file=sys.stderr)
        return Resumed(int(state["step"]), path, state["extra"], self.cfg.weights_only)

    def check_compatible(self, path: Path, require: tuple[str, ...] = ("data",)) -> None:
        """Refuse `path` for a changed model or dataset before anything is built for it
        (`load` checks again, after verifying the manifest)."""
        if not (path / STATE).is_file():
            return  # `load` refuses it, naming what the manifest finds wrong
        self._check_compatible(path, json.loads((path / STATE).read_text()), require)

    def _check_compatible(
        self, path: Path, state: dict[str, Any], require: tuple[str, ...]
    ) -> None:
        saved = state.get("fingerprints", {})
        for name, allowed in (("model", self.cfg.allow_changed_model),
                              ("data", self.cfg.allow_changed_data)):
            ours = getattr(self.fingerprints, name)
            if saved.get(name) != ours and not allowed:
                raise CheckpointError(
                    f"{path} was trained on a different {name} (fingerprint "
                    f"{saved.get(name)} != {ours}); refusing to resume. Set "
                    f"checkpoint.allow_changed_{name}=true if this is intended."
                )
        missing = [key for key in require if key not in state.get("extra", {})]
        if missing:
            raise CheckpointError(
                f"{path} lacks the {', '.join(missing)} state this run needs to continue "
                "exactly; it cannot be resumed (start fresh with checkpoint.resume=none)"
            )

    def end_of_step(
        self, step: int, trainable: Trainable, extra_state: Mapping[str, Any],
        stop: StopOnSignal, last: bool, parts: Mapping[str, Trainable] | None = None,
    ) -> bool:
        """After optimizer step `step` (collective): save when due. True when a stop
        signal reached any rank: the checkpoint is then saved and complete, and the
        caller ends its loop; its entry point exits with the requeue code
        (`moerl.rendezvous.request_requeue`), which the checkpointer does not decide."""
        stopping = stop.agreed()
        if stopping or last or self.should_save(step):
            self.save(step, trainable, extra_state, parts)
        if stopping:
            self.wait()
            return True
        self.poll()
        return False

    def close(self) -> None:
        self.wait()


def _checked_parts(parts: Mapping[str, Trainable] | None) -> dict[str, Trainable]:
    """`parts` as a dict; a name must not shadow the main trainable's entries."""
    parts = dict(parts or {})
    for name in parts:
        if not name.isidentifier() or name.startswith(("model", "optimizer")):
            raise ValueError(f"checkpoint part {name!r}: needs an identifier that does not "
                             "start with 'model' or 'optimizer'")
    return parts


def _sharded(trainable: Trainable, parts: Mapping[str, Trainable], *, with_optimizer: bool,
             loading: bool) -> dict[str, Any]:
    """The sharded state of `trainable`, with each part's under its name (keys prefixed)."""
    state = sharded_state(trainable, with_optimizer=with_optimizer, loading=loading)
    for name, part in parts.items():
        state[name] = sharded_state(part, with_optimizer=with_optimizer, loading=loading,
                                    prefix=f"{name}.")
    return state
