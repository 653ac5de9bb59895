"""Hugging Face checkpoints of the DeepSeek-V3 family in and out of the Megatron model.

`import_hf` builds the model for a layout and fills each rank's shard from the HF
safetensors; `export_hf` gathers the shards to rank 0 and writes safetensors and
`config.json`. Names and conversions are in `models.hf_mapping`.

Memory: on import each rank reads only the tensors its chunks hold (its pipeline
stages, its experts), but a tensor-parallel rank reads a whole tensor and keeps its
slice; on export every tensor passes through rank 0. Both are fine up to a few
billion parameters; a 1T import should read per-shard slices (`safe_open.get_slice`)
and a 1T export should write one file per rank plus an index, which this module's
structure allows but does not do yet.

The project's own adapter rather than megatron-bridge: megatron-bridge 0.6.2 does
not import without Transformer Engine, which does not install on CPU machines.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from safetensors import safe_open
from safetensors.torch import save_file

from moerl.models.arch import MoEArch
from moerl.models.build import build_model
from moerl.models.hf_mapping import (
    Rule,
    arch_from_hf_config,
    hf_config_from_arch,
    megatron_to_hf,
    rules,
    to_megatron,
)
from moerl.parallel.layout import ParallelLayout

HF_CONFIG_COPY = "hf_config.json"  # written beside imported Megatron weights
_SHARD_BYTES = 4 << 30
_DECODER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.experts\.local_experts\.(\d+)\.")


class HFError(ValueError):
    """A checkpoint or model that cannot be converted; the message says why."""


class HFCheckpoint:
    """Lazy reader of an HF checkpoint directory (one or many safetensors files).

    Block-quantised FP8 weights (DeepSeek-V3 and Kimi-K2 ship them, with a
    `<name>_scale_inv` per 128 x 128 block) are dequantised to float32 on read.
    """

    def __init__(self, directory: str | Path) -> None:
        self.dir = Path(directory)
        self.config: dict[str, Any] = json.loads((self.dir / "config.json").read_text())
        files = sorted(self.dir.glob("*.safetensors"))
        if not files:
            raise HFError(f"{self.dir}: no *.safetensors files")
        self._files = [safe_open(str(f), framework="pt") for f in files]
        self._where = {k: f for f in self._files for k in f.keys()}  # noqa: SIM118

    def keys(self) -> list[str]:
        return sorted(self._where)

    def __call__(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise HFError(f"{self.dir}: tensor {name!r} is missing from the checkpoint")
        tensor = self._where[name].get_tensor(name)
        scale_name = name + "_scale_inv"
        if scale_name in self._where:
            tensor = dequantize_blocks(tensor, self._where[scale_name].get_tensor(scale_name))
        return tensor


def dequantize_blocks(weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """FP8 weight [r, c] with one scale per block ([ceil(r/br), ceil(c/bc)]) -> float32."""
    rows, cols = weight.shape
    block_r = -(-rows // scale_inv.shape[0])
    block_c = -(-cols // scale_inv.shape[1])
    scale = scale_inv.float().repeat_interleave(block_r, 0).repeat_interleave(block_c, 1)
    return weight.float() * scale[:rows, :cols]


def _unwrap(chunk: torch.nn.Module) -> Any:
    inner: Any = chunk
    while hasattr(inner, "module"):
        inner = inner.module
    return inner


def local_tensors(chunk: torch.nn.Module, arch: MoEArch) -> Iterator[tuple[str, torch.Tensor]]:
    """(global Megatron name, local tensor) for each weight of a chunk, same order on all ranks."""
    model = _unwrap(chunk)
    per_rank = arch.num_experts // ps.get_expert_model_parallel_world_size()
    first_expert = ps.get_expert_model_parallel_rank() * per_rank
    for name, tensor in model.state_dict(keep_vars=True).items():
        if name.endswith("_extra_state"):
            continue
        match = _DECODER.match(name)
        if match:  # local layer index -> global (the layer knows its 1-based number)
            number = model.decoder.layers[int(match[1])].layer_number
            name = f"decoder.layers.{number - 1}." + name[match.end():]
        match = _EXPERT.search(name)
        if match:
            name = (name[: match.start()] + f".experts.local_experts."
                    f"{first_expert + int(match[1])}." + name[match.end():])
        if name == "output_layer.weight" and not arch.untie_embeddings:
            name = "embedding.word_embeddings.weight"  # the last stage's copy of the tied one
        yield name, tensor


def tp_split(name: str, tensor: torch.Tensor) -> tuple[int, int, dist.ProcessGroup | None]:
    """(size, rank, group) of the tensor-parallel split this tensor is cut by."""
    if not getattr(tensor, "tensor_model_parallel", False):
        return 1, 0, None
    if ".experts.local_experts." in name:
        return (ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_rank(),
                ps.get_expert_tensor_parallel_group())
    return (ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank(),
            ps.get_tensor_model_parallel_group())


def is_glu(name: str) -> bool:
    # Each rank holds [gate slice; up slice] of a gated fc1, not a slice of [gate; up].
    return name.endswith("linear_fc1.weight")


def held_whole(name: str, local: torch.Tensor) -> bool:
    """Does this rank hold the whole tensor `name` (no tensor-parallel cut)?"""
    return tp_split(name, local)[0] == 1


def shard(name: str, full: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    size, rank, _ = tp_split(name, local)
    if size == 1:
        return full
    dim = int(local.partition_dim)  # type: ignore[attr-defined]
    if is_glu(name):
        return torch.cat([half.chunk(size, dim)[rank] for half in full.chunk(2, dim)], dim)
    return full.chunk(size, dim)[rank]


def _unshard(name: str, local: torch.Tensor, copy: bool = True) -> torch.Tensor:
    size, _, group = tp_split(name, local)
    if size == 1:
        return local.detach().clone() if copy else local.detach()
    parts = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(parts, local.detach().contiguous(), group=group)
    dim = int(local.partition_dim)  # type: ignore[attr-defined]
    if is_glu(name):
        halves = [p.chunk(2, dim) for p in parts]
        return torch.cat([torch.cat([h[i] for h in halves], dim) for i in range(2)], dim)
    return torch.cat(parts, dim)


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
                full = to_megatron(by_name[name], ckpt, arch, interleave)
                part = shard(name, full, local)
                if part.shape != local.shape:
                    raise HFError(f"{name}: HF gives {tuple(part.shape)} for this rank, the "
                                  f"model holds {tuple(local.shape)}")
                local.copy_(part)


def import_hf(hf_dir: str | Path, layout: ParallelLayout, **build: Any) -> tuple[
        MoEArch, list[torch.nn.Module]]:
    """Build the model for `layout` (process groups must exist) and load the checkpoint."""
    ckpt = HFCheckpoint(hf_dir)
    arch = arch_from_hf_config(ckpt.config, name=Path(hf_dir).name)
    present = set(ckpt.keys())
    if arch.mtp_num_layers and f"model.layers.{arch.num_layers}.eh_proj.weight" not in present:
        # transformers drops MTP layers when it saves; the main model is complete.
        arch = arch.replace(mtp_num_layers=0)
    chunks: list[torch.nn.Module] = list(build_model(arch, layout, qk_layernorm=True, **build))
    load_hf_into(chunks, arch, ckpt)
    return arch, chunks


def gather_megatron(chunks: list[torch.nn.Module], arch: MoEArch,
                    copy: bool = True) -> dict[str, torch.Tensor]:
    """The whole Megatron state dict (global names) on rank 0; {} on other ranks.
    `copy=False`: tensors this rank holds whole come back as views of its weights
    (for a caller that only reads them before the weights change)."""
    mine: dict[str, torch.Tensor] = {}
    dense_writer = ps.get_data_parallel_rank(with_context_parallel=True) == 0
    expert_writer = ps.get_expert_data_parallel_rank() == 0
    for chunk in chunks:
        for name, local in local_tensors(chunk, arch):
            full = _unshard(name, local, copy)  # collective over the tp group: every rank calls it
            expert = ".experts.local_experts." in name
            _, rank, _ = tp_split(name, local)
            if rank == 0 and (expert_writer if expert else dense_writer):
                mine[name] = full
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return mine
    gathered: list[Any] = [None] * dist.get_world_size() if dist.get_rank() == 0 else []
    dist.gather_object(mine, gathered if dist.get_rank() == 0 else None, dst=0)
    return {k: v for part in gathered for k, v in part.items()}


def write_safetensors(tensors: dict[str, torch.Tensor], out_dir: Path) -> None:
    """Files of at most ~4 GiB each, with the index transformers reads for many files."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        tensor = tensors[name].contiguous()
        if shards[-1] and size + tensor.nbytes > _SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += tensor.nbytes
    if len(shards) == 1:
        save_file(shards[0], str(out_dir / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out_dir / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
             "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def cast_hf(name: str, tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """An HF tensor in the exported `dtype` (None: as it is); the router bias stays
    float32."""
    if dtype is None or name.endswith("e_score_correction_bias"):
        return tensor
    return tensor.to(dtype)


def hf_config(arch: MoEArch, base_config: dict[str, Any] | None = None) -> dict[str, Any]:
    """The config.json of `arch`, on top of the served one's fields it does not describe."""
    base = {k: v for k, v in (base_config or {}).items() if k != "quantization_config"}
    return hf_config_from_arch(arch, base)


def hf_tensors(meg: dict[str, torch.Tensor], arch: MoEArch,
               base_config: dict[str, Any] | None = None, dtype: torch.dtype | None = None,
               ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The gathered Megatron tensors (`gather_megatron`) in Hugging Face names and
    `dtype` (the router bias stays float32), and the config.json they go with."""
    config = hf_config(arch, base_config)
    tensors = megatron_to_hf(meg, arch, bool(config.get("rope_interleave", True)))
    tensors = {k: cast_hf(k, v, dtype) for k, v in tensors.items()}
    config["dtype"] = str(dtype or next(iter(meg.values())).dtype).removeprefix("torch.")
    return tensors, config


def export_hf(chunks: list[torch.nn.Module], arch: MoEArch, out_dir: str | Path, *,
              base_config: dict[str, Any] | None = None, dtype: torch.dtype | None = None) -> None:
    """Write the model as an HF checkpoint (rank 0 writes; every rank must call this).

    `base_config`: the imported checkpoint's config.json, whose fields the arch does
    not describe (token ids, rope_interleave) are kept. `dtype`: of
    the written weights (default: the model's); the router bias stays float32.
    """
    meg = gather_megatron(chunks, arch)
    if dist.is_initialized() and dist.get_rank() != 0:
        dist.barrier()
        return
    tensors, config = hf_tensors(meg, arch, base_config, dtype)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_safetensors(tensors, out)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if dist.is_initialized():
        dist.barrier()
