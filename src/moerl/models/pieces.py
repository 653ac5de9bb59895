"""The pieces of the model one rank holds, and the ones it sends, as `parallel.shard_plan`
describes them.

`held_pieces` reads them off the rank's own model chunks (global Megatron names,
`models.hf.local_tensors`; the cut from each tensor's tensor-parallel attributes), so
a trainer rank and a rollout rank describe the same tensor the same way whatever
their layouts. `owned_pieces` keeps the share this rank sends: the ranks holding
identical pieces are its data-parallel replicas (with context parallelism; for
routed experts the expert-data-parallel ones) and, for a tensor held whole, the
tensor-parallel ranks too; each computes the same balanced split of the same list
(`shard_plan.owned_by`) and keeps its own part, with no communication.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state as ps

from moerl.models.arch import MoEArch
from moerl.models.hf import is_glu, local_tensors, tp_split
from moerl.parallel.shard_plan import Piece, owned

_EXPERT = ".experts.local_experts."


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def held_pieces(chunks: list[torch.nn.Module], arch: MoEArch
                ) -> list[tuple[Piece, torch.Tensor]]:
    """(piece, the parameter or buffer holding it on this rank) for every weight of
    `chunks`, in model order."""
    return [(_piece(name, local), local) for chunk in chunks
            for name, local in local_tensors(chunk, arch)]


def _piece(name: str, local: torch.Tensor) -> Piece:
    size, rank, _ = tp_split(name, local)
    dtype = dtype_name(local.dtype)
    # Along the dimension tensor parallelism cuts this tensor in any layout (Megatron
    # tags it even at tp 1), so a part of it a sender owns lines up with the slices of
    # a receiver that cuts it.
    dim = int(getattr(local, "partition_dim", 0)) if local.dim() > 1 else 0
    if size == 1:
        return Piece(name, dtype, tuple(local.shape), dim, ((0, local.shape[dim]),))
    shape = list(local.shape)
    shape[dim] *= size
    n = local.shape[dim]
    ranges: tuple[tuple[int, int], ...]
    if is_glu(name):  # [gate slice; up slice] of the whole [gate; up]
        half, step = shape[dim] // 2, n // 2
        ranges = ((rank * step, (rank + 1) * step), (half + rank * step, half + (rank + 1) * step))
    else:
        ranges = ((rank * n, (rank + 1) * n),)
    return Piece(name, dtype, tuple(shape), dim, ranges)


def _replica(piece: Piece) -> tuple[int, int, str]:
    """(this rank's index, count, class) among the ranks holding `piece` alike."""
    if _EXPERT in piece.name:
        dp, dps = ps.get_expert_data_parallel_rank(), ps.get_expert_data_parallel_world_size()
        tp = ps.get_expert_tensor_parallel_rank()
        tps = ps.get_expert_tensor_parallel_world_size()
    else:
        dp = ps.get_data_parallel_rank(with_context_parallel=True)
        dps = ps.get_data_parallel_world_size(with_context_parallel=True)
        tp, tps = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    kind = ("expert" if _EXPERT in piece.name else "dense") + ("/cut" if piece.cut else "")
    if piece.cut:
        return dp, dps, kind
    return dp * tps + tp, dps * tps, kind


def owned_pieces(held: list[tuple[Piece, torch.Tensor]]) -> list[tuple[Piece, torch.Tensor]]:
    """The pieces (or parts of pieces) of `held` this rank sends, with the tensor each
    is part of: its balanced share among the ranks holding the same."""
    return [(part, held[i][1]) for i, part in owned([piece for piece, _ in held], _replica)]
