"""The tensor part of a checkpoint (`<step>/dist`): what is saved, written, read back.

Megatron's torch_dist format, fully parallel both ways (`models.weights`'s
strategies): each rank writes its own shard, with digests taken as it writes
(`digest_write`), and reads only its share, checking each item it reads
(`digest_read`). The model and optimizer of every part of the checkpoint go into one
sharded state dict, each part's keys prefixed by its name.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.strategies.fully_parallel import (
    FullyParallelSaveStrategyWrapper,
)

from moerl.checkpoint.collective import rank
from moerl.checkpoint.config import CheckpointError
from moerl.checkpoint.digest_read import verified_reads
from moerl.checkpoint.digest_write import DigestingSaveStrategy, metadata_json_entry
from moerl.checkpoint.digests import Entry
from moerl.checkpoint.manifest import read_verified
from moerl.checkpoint.sharded import sharded_state
from moerl.checkpoint.trainable import Trainable
from moerl.models.weights import parallel_load_strategy, parallel_save_strategy


def sharded_parts(trainable: Trainable, parts: Mapping[str, Trainable], *,
                  with_optimizer: bool, loading: bool, fmt: str) -> dict[str, Any]:
    """The sharded state of `trainable`, with each part's under its name (keys prefixed)."""
    state = sharded_state(trainable, with_optimizer=with_optimizer, loading=loading, fmt=fmt)
    for name, part in parts.items():
        state[name] = sharded_state(part, with_optimizer=with_optimizer, loading=loading,
                                    fmt=fmt, prefix=f"{name}.")
    return state


def save_strategy(staged: bool) -> FullyParallelSaveStrategyWrapper:
    """Fully parallel, digesting; `staged`: an asynchronous save's (a copy, then a thread)."""
    return parallel_save_strategy(DigestingSaveStrategy(staged=staged))


def tensor_entries(strategy: FullyParallelSaveStrategyWrapper, prefix: str) -> dict[str, Entry]:
    """This rank's manifest entries of a finished tensor save, named `<prefix>/<file>`
    (rank 0 adds `metadata.json`, which Megatron writes there)."""
    base = strategy.base_strategy
    assert isinstance(base, DigestingSaveStrategy)
    entries = base.digests()
    if rank() == 0:
        entries["metadata.json"] = metadata_json_entry(strategy.backend, strategy.version)
    return {f"{prefix}/{name}": entry for name, entry in entries.items()}


def load_tensors(template: dict[str, Any], dist_dir: Path,
                 files: dict[str, Entry]) -> dict[str, Any]:
    """`dist_checkpointing.load` of `template`, fully parallel, every byte read checked
    against the digests of `files` (the checkpoint's manifest entries)."""
    prefix = f"{dist_dir.name}/"
    mine = {k.removeprefix(prefix): v for k, v in files.items() if k.startswith(prefix)}
    read_verified(dist_dir, "metadata.json", mine)  # Megatron reads it by itself
    try:
        with verified_reads(dist_dir, mine):
            loaded: dict[str, Any] = dist_checkpointing.load(
                template, str(dist_dir), sharded_strategy=parallel_load_strategy())
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as err:  # torch wraps a reader's error in CheckpointException
        raise CheckpointError(f"could not load {dist_dir}: {err}") from err
    return loaded
