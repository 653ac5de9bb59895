"""What a run says about its checkpoints, and the fingerprints that tie one to its run."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from moerl.typed_config import to_dict

# A JSON value: what the caller's extra state (data position, RL state) may hold.
# Checkpoints never pickle: a pickle runs code on load, and it ties the file to
# the class layout of the writer.
Json = None | bool | int | float | str | list["Json"] | dict[str, "Json"]


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written, trusted or used for this run."""


@dataclass
class CheckpointConfig:
    """Where and when to checkpoint, and how to resume."""

    dir: str | None = None
    """Root holding `step_XXXXXXXX/` checkpoints and the `latest` pointer; None: off."""
    save_interval: int = 0
    """Save every this many optimizer steps (0: only at the end and on a stop signal)."""
    interval_minutes: float = 0.0
    """Also save after a step that ends this many minutes of wall time after the last
    save (or the start); 0: off. `planning.checkpoint_time` plans it for a recipe."""
    keep_last: int = 2
    """Complete checkpoints kept; older ones are deleted after each save (0: keep all)."""
    async_save: bool = False
    """Write tensors while training goes on: each rank copies its shard and a thread of
    its own writes the copy (megatron-core's async queue, `checkpoint.async_writer`);
    the checkpoint becomes `latest` once every rank has finished."""
    optimizer_format: str = "dp_reshardable"
    """How the distributed optimizer's state is saved: "dp_reshardable" (each rank
    writes its own shard as it holds it; a resume may change DP and CP only) or
    "fully_reshardable" (each state in its parameter's shape, gathered per parameter
    at save time; a resume may also change TP, PP and EP>1). `checkpoint.sharded`."""
    resume: str = "auto"
    """"auto": continue from `latest` if there is one; "none": start fresh; else a
    checkpoint directory to start from."""
    allow_changed_data: bool = False
    """Resume although the dataset fingerprint differs from the checkpoint's."""
    allow_changed_model: bool = False
    """Resume although the model architecture fingerprint differs."""
    weights_only: bool = False
    """Resume the model weights, step, data position and RNG but start the optimizer
    fresh: the way across a change megatron cannot reshard optimizer state over
    (EP=1 <-> EP>1, distributed <-> plain optimizer)."""

    def __post_init__(self) -> None:
        if self.save_interval < 0:
            raise ValueError(f"checkpoint.save_interval: must be >= 0, got {self.save_interval}")
        if self.interval_minutes < 0:
            raise ValueError(f"checkpoint.interval_minutes: must be >= 0 (0: off), got "
                             f"{self.interval_minutes}")
        if self.keep_last < 0:
            raise ValueError(f"checkpoint.keep_last: must be >= 0, got {self.keep_last}")
        if not self.resume:
            raise ValueError('checkpoint.resume: "auto", "none" or a checkpoint directory')
        if self.optimizer_format not in ("dp_reshardable", "fully_reshardable"):
            raise ValueError(f"checkpoint.optimizer_format: {self.optimizer_format!r}; choose "
                             "dp_reshardable (the default) or fully_reshardable")

    @property
    def enabled(self) -> bool:
        return self.dir is not None


@dataclass(frozen=True)
class Fingerprints:
    """Hashes of what a checkpoint was trained on; compared on resume.

    `model` and `data` must match (or be overridden); `config` (optimizer, batch
    sizes, ...) is recorded for the record and may change between runs.
    """

    model: str
    data: str
    config: str

    @classmethod
    def of(cls, model: Any, data: Any, config: Any) -> Fingerprints:
        return cls(fingerprint(model), fingerprint(data), fingerprint(config))


def fingerprint(obj: Any) -> str:
    """A stable hash of a dataclass or JSON-able value (key order does not matter)."""
    text = json.dumps(to_dict(obj), sort_keys=True, separators=(",", ":"), default=repr)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def check_json(value: Any, where: str) -> None:
    """Refuse what JSON would silently change or cannot hold (tuples, NaN, objects)."""
    if value is None or isinstance(value, bool | int | str):
        return
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            raise CheckpointError(f"{where}: non-finite float {value} cannot be checkpointed")
        return
    if isinstance(value, list):
        for i, item in enumerate(value):
            check_json(item, f"{where}[{i}]")
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise CheckpointError(f"{where}: key {key!r} is not a string")
            check_json(item, f"{where}.{key}")
        return
    raise CheckpointError(
        f"{where}: {type(value).__name__} is not JSON (use lists, dicts, str, numbers)"
    )
