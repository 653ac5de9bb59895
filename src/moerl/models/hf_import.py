"""`moerl hf import`: a Hugging Face DeepSeek-V3-family checkpoint into the Megatron
model of a layout, each rank reading only the slices it holds.

A rank reads the layers of its pipeline stages and the experts of its expert rank, and
of a tensor-parallel weight only its block of rows (column-parallel layers, the
vocabulary) or columns (row-parallel layers): `HFCheckpoint.read` takes that block
from the file, FP8 blocks dequantised block by block. A gated MLP's `linear_fc1` holds
[gate block; up block], read from the two HF tensors; a checkpoint with
`rope_interleave=False` has its rotary rows permuted, whose block is read as the
smallest range covering it. So the bytes a rank reads are its shard of the model (plus
its replicated tensors), not every tensor it touches: `HFCheckpoint.bytes_read`.

The model is built at `dtype` (bf16 halves the weights directory of an fp32 build:
the run loads it at its own precision). FP8 weights are dequantised: keeping them as
FP8 blocks needs Transformer Engine's FP8 parameters, which this import does not build.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from moerl.models.arch import MoEArch
from moerl.models.build import build_model
from moerl.models.hf import local_tensors, tp_split
from moerl.models.hf_files import ALL, HFCheckpoint, HFError
from moerl.models.hf_mapping import Rule, arch_from_hf_config, rope_perm, rules, to_megatron
from moerl.models.precision import PrecisionConfig, ResolvedPrecision
from moerl.parallel.layout import ParallelLayout


def _block(n: int, size: int, rank: int) -> slice:
    """This rank's part of `n` split `size` ways, as `torch.chunk` cuts it."""
    step = -(-n // size)
    return slice(min(rank * step, n), min((rank + 1) * step, n))


def read_local(rule: Rule, local: torch.Tensor, ckpt: HFCheckpoint, arch: MoEArch,
               interleave: bool) -> torch.Tensor:
    """This rank's shard of the Megatron tensor of `rule` (shaped like `local`), read
    from the HF checkpoint as the blocks it is made of."""
    size, rank, _ = tp_split(rule.megatron, local)
    if size == 1:
        return to_megatron(rule, ckpt, arch, interleave)  # held whole: read whole
    dim = int(local.partition_dim)  # type: ignore[attr-defined]

    def block(name: str) -> torch.Tensor:
        part = _block(ckpt.shape(name)[dim], size, rank)
        return ckpt.read(name, part, ALL) if dim == 0 else ckpt.read(name, ALL, part)

    if rule.kind == "glu":  # each rank holds [gate block; up block]
        return torch.cat([block(name) for name in rule.hf], dim)
    if rule.kind == "rope" and not interleave:  # rows of the permuted tensor
        rows = ckpt.shape(rule.hf[0])[0]
        wanted = rope_perm(arch, rule, rows)[_block(rows, size, rank)]
        first, last = int(wanted.min()), int(wanted.max()) + 1
        return ckpt.read(rule.hf[0], slice(first, last))[wanted - first]
    return block(rule.hf[0])


def load_hf_into(chunks: list[torch.nn.Module], arch: MoEArch, ckpt: HFCheckpoint) -> None:
    """Fill this rank's shards of `chunks` from the HF checkpoint."""
    by_name: dict[str, Rule] = {r.megatron: r for r in rules(arch)}
    interleave = bool(ckpt.config.get("rope_interleave", True))
    with torch.no_grad():
        for chunk in chunks:
            for name, local in local_tensors(chunk, arch):
                if name not in by_name:
                    raise HFError(f"Megatron tensor {name} has no HF counterpart; build the "
                                  "model with qk_layernorm=True for the DeepSeek-V3 family")
                part = read_local(by_name[name], local, ckpt, arch, interleave)
                if part.shape != local.shape:
                    raise HFError(f"{name}: HF gives {tuple(part.shape)} for this rank, the "
                                  f"model holds {tuple(local.shape)}")
                local.copy_(part)


def weights_precision(dtype: torch.dtype) -> ResolvedPrecision:
    """The local spec at `dtype` (float32 or bfloat16): an import or export builds the
    weights and writes them; it does not train, so bf16 needs no GPU here."""
    if dtype not in (torch.float32, torch.bfloat16):
        raise HFError(f"dtype={dtype}: the import builds float32 or bfloat16 weights; "
                      "set dtype=float32 or dtype=bfloat16")
    bf16 = dtype == torch.bfloat16
    return ResolvedPrecision(te=False, bf16=bf16, config=PrecisionConfig(
        transformer_impl="local", params_dtype="bf16" if bf16 else "fp32"))


def import_hf(hf_dir: str | Path, layout: ParallelLayout, dtype: torch.dtype = torch.float32,
              **build: Any) -> tuple[MoEArch, list[torch.nn.Module], HFCheckpoint]:
    """Build the model for `layout` at `dtype` (process groups must exist) and load the
    checkpoint; the reader comes back too (its `bytes_read`)."""
    ckpt = HFCheckpoint(hf_dir)
    arch = arch_from_hf_config(ckpt.config, name=Path(hf_dir).name)
    present = set(ckpt.keys())
    if arch.mtp_num_layers and f"model.layers.{arch.num_layers}.eh_proj.weight" not in present:
        # transformers drops MTP layers when it saves; the main model is complete.
        arch = arch.replace(mtp_num_layers=0)
    chunks: list[torch.nn.Module] = list(build_model(
        arch, layout, qk_layernorm=True, precision=weights_precision(dtype), **build))
    load_hf_into(chunks, arch, ckpt)
    return arch, chunks, ckpt
