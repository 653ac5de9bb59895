"""Reading a Hugging Face checkpoint directory by slices: each caller asks for the rows
and columns it holds, and only those bytes are read.

`HFCheckpoint.read(name, rows, cols)` takes one block of a tensor from its
safetensors file (`safe_open(...).get_slice`, a view into the memory-mapped file, so
the bytes outside the block are never touched) and counts what it returned in
`bytes_read`. Block-quantised FP8 weights (DeepSeek-V3 and Kimi-K2 ship them, with a
`<name>_scale_inv` per 128 x 128 block) are dequantised block by block: the slice of
the weight and the slice of its scales that cover it, never the whole tensor.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

ALL = slice(None)


class HFError(ValueError):
    """A checkpoint or model that cannot be converted; the message says why."""


class HFCheckpoint:
    """Lazy reader of an HF checkpoint directory (one or many safetensors files)."""

    def __init__(self, directory: str | Path) -> None:
        self.dir = Path(directory)
        self.config: dict[str, Any] = json.loads((self.dir / "config.json").read_text())
        files = sorted(self.dir.glob("*.safetensors"))
        if not files:
            raise HFError(f"{self.dir}: no *.safetensors files")
        from safetensors import safe_open  # the hf extra: models.hf's shard helpers need none

        self._files = [safe_open(str(f), framework="pt") for f in files]
        self._where = {k: f for f in self._files for k in f.keys()}  # noqa: SIM118
        self.bytes_read = 0  # of tensors (and scales) returned so far
        quantization = self.config.get("quantization_config") or {}
        block = quantization.get("weight_block_size")
        self._block = (int(block[0]), int(block[1])) if block else None

    def keys(self) -> list[str]:
        return sorted(self._where)

    def _handle(self, name: str) -> Any:
        if name not in self._where:
            raise HFError(f"{self.dir}: tensor {name!r} is missing from the checkpoint")
        return self._where[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def read(self, name: str, rows: slice = ALL, cols: slice = ALL) -> torch.Tensor:
        """Rows `rows` (and, of a matrix, columns `cols`) of tensor `name`, FP8 blocks
        dequantised to float32 (steps of 1 only)."""
        shape = self.shape(name)
        rows, cols = _bounded(rows, shape[0]), _bounded(cols, shape[1] if len(shape) > 1 else 1)
        view = self._handle(name).get_slice(name)
        part = view[rows, cols] if len(shape) > 1 else view[rows]
        self.bytes_read += part.nbytes
        scale_name = name + "_scale_inv"
        if scale_name not in self._where:
            return part
        block_r, block_c = self._block or block_size(shape, self.shape(scale_name))
        scale = self._handle(scale_name).get_slice(scale_name)[
            rows.start // block_r: -(-rows.stop // block_r),
            cols.start // block_c: -(-cols.stop // block_c)]
        self.bytes_read += scale.nbytes
        return dequantize_blocks(part, scale, (block_r, block_c),
                                 (rows.start % block_r, cols.start % block_c))

    def __call__(self, name: str) -> torch.Tensor:
        """The whole tensor (a `hf_mapping.Reader`)."""
        return self.read(name)


def block_size(shape: tuple[int, ...], scale_shape: tuple[int, ...]) -> tuple[int, int]:
    """The quantisation block of a weight with one scale per block, where the checkpoint
    does not say (`quantization_config.weight_block_size`): 128 x 128 (DeepSeek-V3's,
    Kimi-K2's) where the scales fit it, the last block partial (576 rows: 5 blocks);
    else the even split."""
    return (128 if -(-shape[0] // 128) == scale_shape[0] else -(-shape[0] // scale_shape[0]),
            128 if -(-shape[1] // 128) == scale_shape[1] else -(-shape[1] // scale_shape[1]))


def _bounded(part: slice, size: int) -> slice:
    start, stop, step = part.indices(size)
    if step != 1:
        raise ValueError(f"slice {part}: only steps of 1 are read")
    return slice(start, stop)


def dequantize_blocks(weight: torch.Tensor, scale_inv: torch.Tensor,
                      block: tuple[int, int] | None = None,
                      offset: tuple[int, int] = (0, 0)) -> torch.Tensor:
    """FP8 weight [r, c] times one scale per block -> float32.

    `scale_inv` [ceil((offset_r + r) / br), ceil((offset_c + c) / bc)] covers the
    weight, whose first element sits `offset` into the first block; `block` (br, bc) is
    the checkpoint's block size (default: `block_size` of a whole tensor's scales)."""
    rows, cols = weight.shape
    if block is None:
        block = block_size((rows, cols), tuple(scale_inv.shape))
    scale = scale_inv.float().repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return weight.float() * scale[offset[0]: offset[0] + rows, offset[1]: offset[1] + cols]
