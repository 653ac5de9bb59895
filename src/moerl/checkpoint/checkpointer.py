"""Checkpoints a run can resume from exactly, after any kill.

A checkpoint holds the model and optimizer (Megatron `dist_checkpointing`, each rank
writing and reading its own shard, resharded on load where Megatron can: see
`moerl.checkpoint.sharded` and `moerl.checkpoint.tensor_files`), the LR schedule, the step,
the same three of each named part (another trainable of the run, such as the RL
critic: its tensors' keys start with `<name>.`, its facts are in state.json's `parts`),
every rank's RNG states, the caller's extra state (data-loader position, RL state:
pending rollouts, weight versions of buffered samples, reward-cache keys; JSON,
never pickle) and fingerprints of the model, the dataset and the config.

Saving is atomic (`moerl.checkpoint.store`): every rank writes into a
temporary directory, hashing every byte on its way out (`checkpoint.digests`: no file
is read back), the ranks agree that all writes succeeded, rank 0 writes the manifest
from every rank's digests, the directory is renamed into place and only then does
`latest` move. A failure on any rank fails the save on every rank and leaves
`latest` where it was. Loading checks the manifest's sizes first, and every byte it
reads against its digest (a rank checks what it reads): a truncated or modified
checkpoint is refused, never half-used.

With `async_save` each rank copies its shard and a thread writes it while training
goes on (`checkpoint.async_writer`); the checkpoint is published when `poll()` or
`wait()` finds every rank's write done, and a new save first waits for the one in
flight, so at most one is. A kill before the publication leaves the previous
checkpoint as `latest`.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.strategies.fully_parallel import (
    FullyParallelSaveStrategyWrapper,
)

from moerl.checkpoint.async_writer import ThreadCallsQueue
from moerl.checkpoint.collective import (
    FAULT_ENV,
    agree,
    barrier,
    broadcast,
    fault,
    gather_to_first,
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
from moerl.checkpoint.digest_write import DigestingSaveStrategy
from moerl.checkpoint.digests import Entry, write_file
from moerl.checkpoint.manifest import read_verified, verify_manifest, write_manifest
from moerl.checkpoint.rng import capture_rng, restore_rng
from moerl.checkpoint.sharded import (
    apply_loaded,
    check_optimizer_compatible,
    optimizer_facts,
    saved_format,
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
from moerl.checkpoint.tensor_files import (
    load_tensors,
    save_strategy,
    sharded_parts,
    tensor_entries,
)
from moerl.checkpoint.trainable import Trainable
from moerl.models.weights_marker import MARKER as WEIGHTS_MARKER
from moerl.signals import StopOnSignal, start_helpers_ignoring

__all__ = ["FAULT_ENV", "CheckpointConfig", "CheckpointError", "Checkpointer", "Fingerprints",
           "Resumed"]

STATE = "state.json"
DIST = "dist"  # the tensors; with WEIGHTS_MARKER, also a weights directory of the model


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
        self._async = ThreadCallsQueue() if cfg.async_save else None
        self._strategy: FullyParallelSaveStrategyWrapper | None = None
        self._last_save = time.monotonic()  # or the start: interval_minutes counts from it

    def should_save(self, step: int) -> bool:
        """Due after `step` by the step interval, or by `interval_minutes` of wall time
        since the last save (rank 0's clock decides for all: collective when set)."""
        if self.cfg.save_interval > 0 and step % self.cfg.save_interval == 0:
            return True
        if self.cfg.interval_minutes <= 0:
            return False
        late = time.monotonic() - self._last_save >= self.cfg.interval_minutes * 60
        return bool(broadcast(late))

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
        self._last_save = time.monotonic()
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
        error, digests = None, {}
        try:
            digests = self._write_plain_state(tmp, step, trainable, extra_state, parts)
        except Exception as err:
            error = f"rank {rank()}: {err!r}"
        self._fail_cleanly(error, tmp, "checkpoint save (step state)")
        request = None
        strategy = save_strategy(staged=self._async is not None)
        self._strategy = strategy
        start_helpers_ignoring()  # the writer's helper, started cheaply and bound to us
        try:
            request = dist_checkpointing.save(
                sharded_parts(trainable, parts, with_optimizer=True, loading=False,
                         fmt=self.cfg.optimizer_format),
                str(tmp / DIST),
                sharded_strategy=strategy,
                async_sharded_save=self._async is not None,
                async_strategy="mcore",
            )
        except Exception as err:
            error = f"rank {rank()}: {err!r}"
        self._fail_cleanly(error, tmp, "checkpoint save (tensors)")
        finish = partial(self._finish, tmp, final, step, digests, strategy)
        if self._async is not None and request is not None:
            request.add_finalize_fn(finish)
            self._async.schedule_async_request(request)
        else:
            finish()
        return final

    def _write_plain_state(
        self, tmp: Path, step: int, trainable: Trainable, extra_state: Mapping[str, Any],
        parts: Mapping[str, Trainable],
    ) -> dict[str, Entry]:
        """This rank's RNG (and on rank 0 the step state); their manifest entries."""
        rng = f"rng/rank_{rank():05d}.json"
        (tmp / "rng").mkdir(exist_ok=True)
        written = {rng: write_file(tmp / rng, json.dumps(capture_rng()).encode())}
        fault("write", step)
        if rank() != 0:
            return written
        check_json(dict(extra_state), "extra_state")
        fmt = self.cfg.optimizer_format
        state = {
            "format": 1,
            "step": step,
            "world_size": world(),
            "fingerprints": vars(self.fingerprints),
            "optimizer": optimizer_facts(trainable, fmt),
            "scheduler": trainable.scheduler.state_dict(),
            "parts": {name: {"optimizer": optimizer_facts(part, fmt),
                             "scheduler": part.scheduler.state_dict()}
                      for name, part in parts.items()},
            "extra": dict(extra_state),
        }
        text = json.dumps(state, indent=1, allow_nan=False)
        return {**written, STATE: write_file(tmp / STATE, text.encode())}

    def _fail_cleanly(self, error: str | None, tmp: Path, what: str) -> None:
        try:
            agree(error, what)
        except CheckpointError:
            if rank() == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise

    def _finish(self, tmp: Path, final: Path, step: int, digests: dict[str, Entry],
                strategy: FullyParallelSaveStrategyWrapper) -> None:
        """Manifest from every rank's digests, rename, move `latest`, clean up (every
        rank, once every rank's writes are complete)."""
        error = None
        try:
            fault("tensors", step)
            mine = {**digests, **tensor_entries(strategy, DIST)}
            if rank() == 0:  # the model part is a weights directory a rollout server reads
                mine[f"{DIST}/{WEIGHTS_MARKER}"] = write_file(tmp / DIST / WEIGHTS_MARKER,
                                                              b"ok\n")
            files = gather_to_first(mine)
            if rank() == 0:
                expected = {STATE, f"{DIST}/metadata.json", f"{DIST}/.metadata"}
                expected |= {f"rng/rank_{r:05d}.json" for r in range(world())}
                if missing := sorted(expected - set(files)):
                    raise CheckpointError(f"written checkpoint lacks {missing}")
                write_manifest(tmp, files)
        except Exception as err:
            error = f"rank {rank()}: {err!r}"
        self._fail_cleanly(error, tmp, "checkpoint save (manifest)")
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

    def writing(self) -> bool:
        """Is this rank's write of an asynchronous save still running? (its own answer:
        the save is published once every rank's is done, at a `poll()` or `wait()`)"""
        return self._async is not None and self._async.writing()

    def last_staged_bytes(self) -> int:
        """The host copy the last asynchronous save of this rank took (0: none)."""
        if self._strategy is None:
            return 0
        base = self._strategy.base_strategy
        return base.staged_bytes() if isinstance(base, DigestingSaveStrategy) else 0

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
        files = verify_manifest(path)  # sizes; each read below checks its own bytes
        state = json.loads(read_verified(path, STATE, files))
        self._check_compatible(path, state, require)
        saved = state.get("parts", {})
        if missing := [name for name in parts if name not in saved]:
            raise CheckpointError(
                f"{path} holds no {', '.join(missing)} (the run that saved it had none), so "
                "this run cannot continue from it exactly; resume with the saving run's "
                "settings, or start fresh with checkpoint.resume=none")
        with_optimizer = not self.cfg.weights_only
        fmt = saved_format(state["optimizer"])  # each part is saved in the same one
        if with_optimizer:
            ours = self.cfg.optimizer_format
            check_optimizer_compatible(state["optimizer"], optimizer_facts(trainable, ours))
            for name, part in parts.items():
                check_optimizer_compatible(saved[name]["optimizer"], optimizer_facts(part, ours))
        template = sharded_parts(trainable, parts, with_optimizer=with_optimizer, loading=True,
                            fmt=fmt)
        loaded = load_tensors(template, path / DIST, files)
        apply_loaded(trainable, loaded, with_optimizer, int(state["optimizer"]["step"]), fmt)
        trainable.scheduler.load_state_dict(state["scheduler"])
        for name, part in parts.items():
            apply_loaded(part, loaded[name], with_optimizer,
                         int(saved[name]["optimizer"]["step"]), fmt, prefix=f"{name}.")
            part.scheduler.load_state_dict(saved[name]["scheduler"])
        # Ranks keep their own random streams; under a new world size rank r
        # continues saved rank r % old_world's (no exact match exists then).
        saved_rank = rank() % int(state["world_size"])
        restore_rng(json.loads(read_verified(path, f"rng/rank_{saved_rank:05d}.json", files)))
        if rank() == 0:
            how = "weights only" if self.cfg.weights_only else "model + optimizer"
            print(f"resumed from {path} at step {state['step']} ({how})", file=sys.stderr)
        return Resumed(int(state["step"]), path, state["extra"], self.cfg.weights_only)

    def saved_extra(self, path: Path) -> dict[str, Json]:
        """The caller's extra state saved in checkpoint `path`, read before anything is
        built for it ({} for a checkpoint without one; `load` verifies it)."""
        if not (path / STATE).is_file():
            return {}
        extra: dict[str, Json] = json.loads((path / STATE).read_text()).get("extra", {})
        return extra

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
