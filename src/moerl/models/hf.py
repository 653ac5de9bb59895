"""Hugging Face checkpoints of the DeepSeek-V3 family in and out of the Megatron model:
what both directions share, and the export.

Megatron names are global (`local_tensors`); a tensor-parallel shard is cut and
joined as Megatron cuts it (`tp_split`, `shard`, `unshard`). The import, each rank
reading only its slices of the safetensors files, is `models.hf_import`; the file
reader, `models.hf_files`. Names and conversions are in `models.hf_mapping`.

`export_hf` writes from every rank at once, nothing gathered to one rank: each tensor
of the model is written by one of the ranks holding it (a replicated one by one of its
replicas, spread over them; a tensor-parallel one joined within its tensor-parallel
group, one tensor at a time, by one of its members), each writer rank to a file of its
own, and rank 0 writes `model.safetensors.index.json` (which file holds which tensor)
and `config.json` from the names alone. So a rank holds at most its share of the
model's tensors, and the files are written in parallel.

`gather_megatron` (the whole model on rank 0), `hf_tensors` and `write_safetensors`
serve a model one process holds whole (tests, benchmarks' initial weights).

The project's own adapter rather than megatron-bridge: megatron-bridge 0.6.2 does
not import without Transformer Engine, which does not install on CPU machines.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from moerl.models.arch import MoEArch
from moerl.models.hf_files import HFError
from moerl.models.hf_mapping import (
    Rule,
    hf_config_from_arch,
    megatron_to_hf,
    mtp_copies,
    rules,
    to_hf,
)

HF_CONFIG_COPY = "hf_config.json"  # written beside imported Megatron weights
INDEX = "model.safetensors.index.json"
_DECODER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.experts\.local_experts\.(\d+)\.")

__all__ = ["HF_CONFIG_COPY", "HFError", "cast_hf", "export_hf", "gather_megatron", "hf_config",
           "hf_tensors", "is_glu", "local_tensors", "shard", "tp_split", "write_safetensors"]


def _unwrap(chunk: torch.nn.Module) -> Any:
    inner: Any = chunk
    while hasattr(inner, "module"):
        inner = inner.module
    return inner


def local_tensors(chunk: torch.nn.Module, arch: MoEArch | None = None
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    """(global Megatron name, local tensor) for each weight of a chunk, same order on all
    ranks. Without `arch`, the expert count and the embedding tying are the model's."""
    model = _unwrap(chunk)
    experts = arch.num_experts if arch else model.config.num_moe_experts or 0
    untied = arch.untie_embeddings if arch else not model.share_embeddings_and_output_weights
    per_rank = experts // ps.get_expert_model_parallel_world_size()
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
        if name == "output_layer.weight" and not untied:
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


_FILE_BYTES = 4 << 30  # a writer starts a new file past this


def _replicas(expert: bool) -> tuple[int, int, int, int]:
    """(replicas, this replica, group size, rank in it): the ranks that hold the same
    tensor, and the tensor-parallel group its shards are joined in."""
    if expert:
        return (ps.get_expert_data_parallel_world_size(), ps.get_expert_data_parallel_rank(),
                ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_rank())
    return (ps.get_data_parallel_world_size(with_context_parallel=True),
            ps.get_data_parallel_rank(with_context_parallel=True),
            ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank())


def _assigned(chunks: list[torch.nn.Module], arch: MoEArch, interleave: bool,
              dtype: torch.dtype | None) -> Iterator[tuple[str, torch.Tensor]]:
    """The HF tensors this rank writes: of the tensors it holds, the k-th goes to replica
    k mod replicas, and within that replica's tensor-parallel group (which joins it:
    a collective of the group, so every member takes the same turns) to member
    (k // replicas) mod group size."""
    by_name: dict[str, Rule] = {r.megatron: r for r in rules(arch)}
    copies: dict[str, list[str]] = {}
    for hf_name, meg in mtp_copies(arch).items():
        copies.setdefault(meg, []).append(hf_name)
    later_stage = not ps.is_pipeline_first_stage(ignore_virtual=True)
    k = 0
    for chunk in chunks:
        for name, local in local_tensors(chunk, arch):
            if later_stage and name == "embedding.word_embeddings.weight":
                continue  # the last stage's copy of the tied embedding: the first writes it
            replicas, replica, group, member = _replicas(".experts.local_experts." in name)
            k += 1
            if (k - 1) % replicas != replica:
                continue
            full = _unshard(name, local)
            if ((k - 1) // replicas) % group != member:
                continue
            for hf_name, tensor in to_hf(by_name[name], full, arch, interleave).items():
                yield hf_name, cast_hf(hf_name, tensor.contiguous(), dtype)
            for hf_name in copies.get(name, ()):
                yield hf_name, cast_hf(hf_name, full, dtype)


def _write_parts(tensors: Iterator[tuple[str, torch.Tensor]], out: Path, stem: str
                 ) -> dict[str, tuple[str, int]]:
    """`tensors` into files `<stem>-NNN.safetensors` of about `_FILE_BYTES` each;
    {tensor name: (file, bytes)}."""
    from safetensors.torch import save_file  # the hf extra; the shard helpers need none

    written: dict[str, tuple[str, int]] = {}
    part: dict[str, torch.Tensor] = {}

    def flush() -> None:
        file = f"{stem}-{len({f for f, _ in written.values()}):03d}.safetensors"
        save_file(part, str(out / file), metadata={"format": "pt"})
        written.update({name: (file, t.nbytes) for name, t in part.items()})
        part.clear()

    for name, tensor in tensors:
        if part and sum(t.nbytes for t in part.values()) + tensor.nbytes > _FILE_BYTES:
            flush()
        part[name] = tensor
    if part:
        flush()
    return written


def export_hf(chunks: list[torch.nn.Module], arch: MoEArch, out_dir: str | Path, *,
              base_config: dict[str, Any] | None = None, dtype: torch.dtype | None = None) -> None:
    """Write the model as an HF checkpoint from every rank (each writes its assigned
    tensors to files of its own; every rank must call this; see the module docstring).

    `base_config`: the imported checkpoint's config.json, whose fields the arch does
    not describe (token ids, rope_interleave) are kept. `dtype`: of the written weights
    (default: the model's); the router bias stays float32.
    """
    config = hf_config(arch, base_config)
    out = Path(out_dir)
    rank = dist.get_rank() if dist.is_initialized() else 0
    out.mkdir(parents=True, exist_ok=True)
    tensors = _assigned(chunks, arch, bool(config.get("rope_interleave", True)), dtype)
    written = _write_parts(tensors, out, f"model-rank{rank:05d}")
    everyone: list[Any] = [written]
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone = [None] * dist.get_world_size() if rank == 0 else []
        dist.gather_object(written, everyone if rank == 0 else None, dst=0)  # names only
    if rank == 0:
        _write_index(everyone, out)
        config["dtype"] = str(dtype or next(chunks[0].parameters()).dtype).removeprefix("torch.")
        (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if dist.is_initialized():
        dist.barrier()


def _write_index(written: list[dict[str, tuple[str, int]]], out: Path) -> None:
    """The index of every rank's files; a single file is named model.safetensors, as a
    reader without the index expects."""
    weight_map: dict[str, str] = {}
    for part in written:
        for name, (file, _) in part.items():
            if name in weight_map:
                raise HFError(f"export: {name} was written twice ({weight_map[name]}, {file})")
            weight_map[name] = file
    files = sorted(set(weight_map.values()))
    if len(files) == 1:
        os.replace(out / files[0], out / "model.safetensors")
        return
    total = sum(size for part in written for _, size in part.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / INDEX).write_text(json.dumps(index, indent=2))


def hf_tensors(meg: dict[str, torch.Tensor], arch: MoEArch,
               base_config: dict[str, Any] | None = None, dtype: torch.dtype | None = None,
               ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Whole Megatron tensors (`gather_megatron`, one process) in Hugging Face names and
    `dtype` (the router bias stays float32), and the config.json they go with."""
    config = hf_config(arch, base_config)
    tensors = megatron_to_hf(meg, arch, bool(config.get("rope_interleave", True)))
    tensors = {k: cast_hf(k, v, dtype) for k, v in tensors.items()}
    config["dtype"] = str(dtype or next(iter(meg.values())).dtype).removeprefix("torch.")
    return tensors, config


def write_safetensors(tensors: dict[str, torch.Tensor], out_dir: Path) -> None:
    """Whole tensors of one process (`hf_tensors`) into files of about `_FILE_BYTES`,
    with the index transformers reads for many files."""
    written = _write_parts(iter(sorted(tensors.items())), out_dir, "model")
    _write_index([written], out_dir)
