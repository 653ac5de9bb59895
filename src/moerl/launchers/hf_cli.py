"""`moerl hf import|export`: Hugging Face DeepSeek-V3-family checkpoints <-> Megatron weights.

The conversion itself is `moerl.models.hf`; this module reads the command line
and the torchrun environment (data parallel takes the ranks the layout leaves).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from moerl.config import MODEL_FILE
from moerl.data.tokenizer import TOKENIZER_FILES
from moerl.models.arch import get_preset
from moerl.models.build import build_model
from moerl.models.hf import HF_CONFIG_COPY, export_hf
from moerl.models.hf_files import HFCheckpoint, HFError
from moerl.models.hf_import import import_hf, weights_precision
from moerl.models.hf_mapping import arch_from_hf_config, hf_config_from_arch
from moerl.models.weights import load_weights, save_weights
from moerl.parallel.groups import destroy_parallel, init_parallel
from moerl.parallel.layout import ParallelLayout
from moerl.typed_config import from_dict


def parse_overrides(items: list[str]) -> tuple[ParallelLayout, dict[str, str]]:
    parallel: dict[str, Any] = {}
    other: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise HFError(f"expected key=value, got {item!r}")
        key = key.removeprefix("parallel.")
        if key in ParallelLayout.__dataclass_fields__:
            parallel[key] = json.loads(value) if value not in ("", "null") else None
        else:
            other[key] = value
    layout = from_dict(ParallelLayout, parallel, "parallel")
    if "WORLD_SIZE" in os.environ:  # under torchrun: data parallel takes the other ranks
        world = int(os.environ["WORLD_SIZE"])
        layout.dp = max(world // (layout.tp * layout.pp * layout.cp), 1)
    return layout, other


_USAGE = """usage:
  moerl hf import <hf_dir> <megatron_weights_dir> [tp=N pp=N ep=N ...] [dtype=bfloat16]
  moerl hf export <megatron_weights_dir> <hf_out_dir> [model=<preset|hf_dir>] [dtype=bfloat16]
Run under torchrun for a layout with more than one rank: each rank reads only its
slices of the Hugging Face files (import) and writes its own files (export).
import dtype: of the weights written (float32, the default, or bfloat16)."""


def copy_tokenizer_files(src: Path, dst: Path) -> list[str]:
    """The tokenizer files of a Hugging Face directory, copied beside imported weights."""
    copied = []
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)
            copied.append(name)
    return copied


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise HFError(f"dtype={name}: not a torch dtype (bfloat16, float32)")
    return dtype


def _gathered(value: int) -> list[int]:
    """`value` of every rank (small: one number each)."""
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return [int(v) for v in out]


def hf_main(argv: list[str]) -> int:
    """`moerl hf import|export ...`; returns the exit code."""
    if len(argv) < 3 or argv[0] not in ("import", "export"):
        print(_USAGE, file=sys.stderr)
        return 2
    command, src, dst = argv[:3]
    layout, other = parse_overrides(argv[3:])
    init_parallel(layout)
    try:
        if command == "import":
            import_dtype = _dtype(other.get("dtype", "float32"))
            arch, chunks, reader = import_hf(src, layout, import_dtype)
            read = _gathered(reader.bytes_read)
            save_weights(chunks, dst)
            if dist.get_rank() == 0:  # what export needs: the arch as imported (MTP or not)
                config = hf_config_from_arch(arch, HFCheckpoint(src).config)
                (Path(dst) / HF_CONFIG_COPY).write_text(json.dumps(config, indent=2))
                # ... and what `model_from=<dst>` reads (moerl train, moerl sft)
                (Path(dst) / MODEL_FILE).write_text(json.dumps(dataclasses.asdict(arch), indent=2))
                copied = copy_tokenizer_files(Path(src), Path(dst))
                if copied:  # the weights dir is then also the run's tokenizer.path
                    print(f"tokenizer: {', '.join(copied)} copied; tokenizer=hf "
                          f"tokenizer.path={dst}")
                print(f"imported {arch.name} ({arch.num_layers} layers) into {dst} at "
                      f"{import_dtype}; read {sum(read)} bytes of tensors "
                      f"({sum(read) / 1e9:.3f} GB), at most {max(read)} on one of "
                      f"{len(read)} rank(s)")
            return 0
        model = other.get("model", str(Path(src) / HF_CONFIG_COPY))
        base: dict[str, Any] | None = None
        if Path(model).is_dir() or Path(model).is_file():
            path = Path(model) / "config.json" if Path(model).is_dir() else Path(model)
            base = json.loads(path.read_text())
            arch = arch_from_hf_config(base)
        else:
            arch = get_preset(model)
        dtype = _dtype(other["dtype"]) if "dtype" in other else None
        # Built at the written dtype where it can be: a bf16 export holds half the bytes.
        precision = (weights_precision(dtype)
                     if dtype in (torch.float32, torch.bfloat16) else None)
        chunks = list(build_model(arch, layout, qk_layernorm=True, precision=precision))
        load_weights(chunks, src)
        export_hf(chunks, arch, dst, base_config=base, dtype=dtype)
        if dist.get_rank() == 0:
            print(f"exported {arch.name} to {dst}")
        return 0
    finally:
        destroy_parallel()
