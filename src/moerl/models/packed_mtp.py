"""Multi-token prediction over packed [s, b] rows.

MTP shifts input ids, labels and loss masks one token left per MTP layer
(`multi_token_prediction.roll_tensor`). For packed sequences Megatron rolls within
each document, reading the boundaries as THD's flat `cu_seqlens` [n + 1]; the
project's packed rows are [b, s] with per-row boundaries [b, n + 1] and
qkv_format="sbhd" (`data.synthetic.Batch.cu_seqlens`), which that code cannot
index. `install()` routes exactly those calls to `roll_within_documents`; every
other call (no packing, THD, context parallelism) goes to Megatron's own roll.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer import multi_token_prediction as mtp

from moerl.parallel.context import document_ids

_megatron_roll = mtp.roll_tensor


def roll_within_documents(
    tensor: torch.Tensor, cu_seqlens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`tensor` [b, s] shifted one token left inside each document of its row; a
    document's last position (whose next token belongs to another) becomes 0.
    Returns (rolled, rolled.sum()) like Megatron's roll."""
    if tensor.dim() != 2:
        raise ValueError(f"packed MTP roll expects [b, s] tensors, got shape {tuple(tensor.shape)}")
    s = tensor.size(1)
    docs = document_ids(cu_seqlens.to(tensor.device), s)  # [b, s] (or [s])
    docs = docs.expand(tensor.size(0), s) if docs.dim() == 1 else docs
    rolled = torch.roll(tensor, shifts=-1, dims=-1)
    keep = torch.zeros_like(docs, dtype=torch.bool)
    keep[:, :-1] = docs[:, 1:] == docs[:, :-1]
    rolled = torch.where(keep, rolled, torch.zeros_like(rolled))
    return rolled, rolled.sum()


def _roll(tensor: Any, shifts: int = -1, dims: int = -1, cp_group: Any = None,
          packed_seq_params: PackedSeqParams | None = None) -> Any:
    if (tensor is None or packed_seq_params is None
            or packed_seq_params.qkv_format != "sbhd"):
        return _megatron_roll(tensor, shifts=shifts, dims=dims, cp_group=cp_group,
                              packed_seq_params=packed_seq_params)
    if cp_group is not None and cp_group.size() > 1:
        raise ValueError(
            "multi-token prediction over packed rows under context parallelism is not "
            "supported; set model.mtp_num_layers=0 or parallel.cp=1"
        )
    if shifts != -1 or dims not in (-1, tensor.dim() - 1):
        raise ValueError(f"packed MTP roll supports shifts=-1 on the last dim, got "
                         f"shifts={shifts} dims={dims}")
    assert packed_seq_params.cu_seqlens_q is not None
    return roll_within_documents(tensor, packed_seq_params.cu_seqlens_q)


def install() -> None:
    """Route Megatron's MTP roll of sbhd-packed rows here (idempotent)."""
    mtp.roll_tensor = _roll
