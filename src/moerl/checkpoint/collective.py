"""What the ranks of a save or load agree on, and the fault injection of its tests."""

from __future__ import annotations

import os
import signal
from typing import Any

import torch.distributed as dist

from moerl.checkpoint.config import CheckpointError

# Fault injection for the failure tests, "<raise|kill>:<phase>@<rank>[#<step>]": a write
# error or a SIGKILL at an exact point of the save, which no outside timing can hit.
FAULT_ENV = "MOERL_CHECKPOINT_FAULT"


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def fault(phase: str, step: int) -> None:
    spec = os.environ.get(FAULT_ENV, "")
    action, _, where = spec.partition(":")
    if where not in (f"{phase}@{rank()}", f"{phase}@{rank()}#{step}"):
        return
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise OSError(f"injected write error ({FAULT_ENV}={spec})")


def agree(error: str | None, what: str) -> None:
    """Raise on every rank if any rank failed (with every rank's message)."""
    errors: list[Any] = [error]
    if world() > 1:
        errors = [None] * world()
        dist.all_gather_object(errors, error)
    failed = [e for e in errors if e]
    if failed:
        raise CheckpointError(f"{what} failed; `latest` was not moved:\n  " + "\n  ".join(failed))


def broadcast(value: Any) -> Any:
    if world() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather_to_first(entries: dict[str, Any]) -> dict[str, Any]:
    """Every rank's dict (small: file names and digests), merged on rank 0 ({}
    elsewhere)."""
    if world() == 1:
        return dict(entries)
    parts: list[Any] = [None] * world() if rank() == 0 else []
    dist.gather_object(entries, parts if rank() == 0 else None, dst=0)
    return {k: v for part in parts for k, v in part.items()}
