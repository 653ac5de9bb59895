"""A model that every trainer rank holds whole, written by one rank as one file.

`models.weights` writes Megatron's sharded format: every tensor a record of its own with
its sharding metadata, which any layout can read back. For a small model most of that is
fixed cost: the tiny preset's ~140 tensors take ~0.1 s of CPU to write and another
~0.1 s to read, most of a weight push to a rollout server at every RL step. When no
tensor, pipeline or expert split cuts the model (data and context parallel ranks each
hold all of it), global rank 0 writes it instead as one torch file of whole tensors,
keyed by their global Megatron names; a reader under any layout (a rollout server with
tensor, expert or pipeline parallelism) takes its own slice of each tensor it holds
(`models.hf.local_tensors` names them, `models.hf.shard` cuts them). Nothing passes
through a rank that does not hold it whole already. The write is atomic, as
`save_weights`'s: a temporary sibling renamed into place with the completion marker.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from moerl.models.weights_marker import MARKER
from moerl.parallel.layout import ParallelLayout

FILE = "model.pt"


class WholeWeightsError(RuntimeError):
    """A whole-model file that does not fit the model reading it."""


def holds_whole(layout: ParallelLayout) -> bool:
    """Does every rank of `layout` hold every weight (no tensor, pipeline or expert split)?"""
    return layout.tp == 1 and layout.pp == 1 and layout.ep == 1 and not layout.vpp


def is_whole(directory: str | Path) -> bool:
    return (Path(directory) / FILE).is_file()


def save_whole(chunks: list[torch.nn.Module], directory: str | Path) -> Path:
    """Write the model held whole by this rank; the caller makes one rank call it."""
    from moerl.models.hf import local_tensors

    final = Path(directory)
    if final.exists():
        raise FileExistsError(f"weights directory {final} exists already; pick a new one")
    tmp = final.with_name(f".{final.name}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    # Copies: the DDP-wrapped parameters are views of one buffer; saved as views, the
    # file would hold that buffer, padding included, and tie every tensor to it.
    tensors = {name: t.detach().clone() for chunk in chunks for name, t in local_tensors(chunk)}
    torch.save(tensors, tmp / FILE)
    (tmp / MARKER).write_text("ok\n")
    os.replace(tmp, final)
    return final


def load_whole(chunks: list[torch.nn.Module], directory: str | Path) -> None:
    """This rank's slice of every tensor its chunks hold, from a whole-model file.
    Tensors of the file the chunks do not hold (another stage's) are not read."""
    from moerl.models.hf import local_tensors, shard

    path = Path(directory) / FILE
    saved = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    with torch.no_grad():
        for chunk in chunks:
            for name, local in local_tensors(chunk):
                if name not in saved:
                    raise WholeWeightsError(f"{path} has no tensor {name}: it was written "
                                            "for another architecture")
                part = shard(name, saved[name], local)
                if part.shape != local.shape:
                    raise WholeWeightsError(f"{path}: {name} gives {tuple(part.shape)} for "
                                            f"this rank, the model holds {tuple(local.shape)}")
                local.copy_(part)
