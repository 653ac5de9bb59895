"""Model weights on disk in Megatron's sharded format, independent of layout.

`save_weights` writes the model chunks of every rank as one `dist_checkpointing`
(torch_dist) checkpoint: tensors are stored by their global names and offsets,
so `load_weights` can read them back under any other TP/PP/VPP/EP layout
(resharding). The write is atomic: it goes to a temporary sibling directory
that is renamed into place only after every rank has finished, so a reader
never sees half a checkpoint. Used by weight sync (trainer -> rollout servers),
by checkpoints and by the parity tests. A weight push from a trainer whose every rank
holds the whole model writes one file instead (`models.whole_weights`), which
`load_weights` reads as well.

Both directions are fully parallel (`parallel_save_strategy`,
`parallel_load_strategy`): a tensor only one rank holds is written and read by that
rank; a tensor several ranks hold (the weights, the same on every data-parallel
rank) is written by one of them, chosen so that every rank of the data-parallel
group writes about the same number of bytes, and read by one of them and broadcast
to the others. Without it data-parallel rank 0 writes all of the replicated
weights, and every rank reads every byte it holds. Only metadata (which rank holds
which shard) is exchanged to plan either direction. The group is data parallel with
context parallel, as in Megatron-LM: its ranks hold the same model shard.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core import parallel_state as ps
from megatron.core.dist_checkpointing.strategies.fully_parallel import (
    FullyParallelLoadStrategyWrapper,
    FullyParallelSaveStrategyWrapper,
)
from megatron.core.dist_checkpointing.strategies.torch import (
    TorchDistLoadShardedStrategy,
    TorchDistSaveShardedStrategy,
)

from moerl.models.weights_marker import MARKER as _MARKER
from moerl.models.weights_marker import is_complete
from moerl.signals import start_helpers_ignoring


class WeightsError(RuntimeError):
    """A weights checkpoint that exists but cannot be read (truncated, tampered, foreign)."""


def unwrap_model(chunk: torch.nn.Module) -> Any:
    """The GPTModel inside Megatron's DDP (and Float16Module) wrappers."""
    inner: Any = chunk
    while hasattr(inner, "module"):
        inner = inner.module
    return inner


def sharded_model_state(chunks: list[torch.nn.Module], prefix: str = "") -> dict[str, Any]:
    """{"model": ...} (or model0, model1, ... per virtual stage): the chunks' sharded
    state, every key (in the dicts and of the tensors on disk) starting with `prefix`,
    so that two models can share one checkpoint (`checkpoint.sharded`)."""
    if len(chunks) == 1:
        return {"model": unwrap_model(chunks[0]).sharded_state_dict(prefix)}
    # Virtual pipeline stages: Megatron names them model0, model1, ...; the tensors
    # inside carry global layer numbers, so the dict keys do not tie the layout.
    return {f"model{i}": unwrap_model(c).sharded_state_dict(prefix)
            for i, c in enumerate(chunks)}


def _replica_group() -> Any:
    """The ranks that hold the same shards (None: the whole world, or no groups yet)."""
    if not dist.is_initialized() or not ps.model_parallel_is_initialized():
        return None
    return ps.get_data_parallel_group(with_context_parallel=True)


def parallel_save_strategy(
    base: TorchDistSaveShardedStrategy | None = None,
) -> FullyParallelSaveStrategyWrapper:
    """`base` (default: plain torch_dist) with the writes spread over the replicas."""
    return FullyParallelSaveStrategyWrapper(base or TorchDistSaveShardedStrategy(),
                                            _replica_group())


def parallel_load_strategy(
    base: TorchDistLoadShardedStrategy | None = None,
) -> FullyParallelLoadStrategyWrapper:
    """`base` (default: plain torch_dist) with the reads spread over the replicas."""
    return FullyParallelLoadStrategyWrapper(base or TorchDistLoadShardedStrategy(),
                                            _replica_group())


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save_weights(chunks: list[torch.nn.Module], directory: str | Path) -> Path:
    """Write the weights of all ranks to `directory` (which must not exist yet)."""
    final = Path(directory)
    if final.exists():
        raise FileExistsError(f"weights directory {final} exists already; pick a new one")
    tmp = final.with_name(f".{final.name}.partial")
    start_helpers_ignoring()  # the writer's helper, started cheaply and bound to us
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    dist_checkpointing.save(sharded_model_state(chunks), str(tmp),
                            sharded_strategy=parallel_save_strategy())
    _barrier()
    if _rank() == 0:
        (tmp / _MARKER).write_text("ok\n")
        os.replace(tmp, final)
    _barrier()
    return final


def load_weights(chunks: list[torch.nn.Module], directory: str | Path) -> None:
    """Load weights written by `save_weights`, or by `whole_weights.save_whole`, under
    any layout into `chunks`."""
    path = Path(directory)
    if not is_complete(path):
        raise FileNotFoundError(
            f"{path} is not a complete weights checkpoint (missing {_MARKER}); it was "
            "never written or its write did not finish"
        )
    from moerl.models.whole_weights import is_whole, load_whole

    if is_whole(path):
        load_whole(chunks, path)
        return
    template = sharded_model_state(chunks)
    try:
        state = dist_checkpointing.load(template, str(path),
                                        sharded_strategy=parallel_load_strategy())
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as err:  # torch's CheckpointException derives from BaseException
        raise WeightsError(f"could not read weights from {path}: {err}") from err
    for key, chunk in zip(template, chunks, strict=True):
        unwrap_model(chunk).load_state_dict(state[key], strict=True)
