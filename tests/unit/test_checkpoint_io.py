"""A save reads none of its files back: every digest in its manifest is taken from the
bytes on their way out. A load reads what it uses, and checks it (a flipped byte in
a tensor is `test_resume.py`'s; a flipped byte in a small file, `test_checkpoint.py`'s).

Reads are counted by an audit hook on every `open` of this process (Python's own and
`os.open`, which the writer thread and torch's file readers go through)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from moerl.checkpoint.checkpointer import Checkpointer
from moerl.checkpoint.config import CheckpointConfig, Fingerprints

pytestmark = pytest.mark.usefixtures("single_process")

_watching: list[tuple[str, list[str]]] = []


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if event != "open" or not _watching:
        return
    path, mode, flags = args
    if path is None or isinstance(path, int):
        return
    reading = (("r" in mode or "+" in mode) if isinstance(mode, str)
               else (flags & os.O_ACCMODE) != os.O_WRONLY)
    name = os.fsdecode(path)
    root, seen = _watching[-1]
    if reading and name.startswith(root) and not os.path.isdir(name):
        seen.append(name)


sys.addaudithook(_audit)  # for the life of the process; idle unless watching


@contextmanager
def reads_under(root: Path) -> Iterator[list[str]]:
    """The files under `root` opened for reading inside the block."""
    seen: list[str] = []
    _watching.append((str(root), seen))
    try:
        yield seen
    finally:
        _watching.pop()


@pytest.fixture(scope="module")
def trainable() -> Any:
    from moerl.models.arch import TINY
    from moerl.models.build import build_model
    from moerl.parallel.layout import ParallelLayout
    from moerl.trainer.config import OptimConfig
    from moerl.trainer.optimizer import build_optimizer

    layout = ParallelLayout()
    return build_optimizer(build_model(TINY.replace(num_layers=2), layout), OptimConfig(),
                           layout)


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_save_reads_none_of_its_files(trainable: Any, tmp_path: Path,
                                        async_save: bool) -> None:
    cfg = CheckpointConfig(dir=str(tmp_path), async_save=async_save)
    ckpt = Checkpointer(cfg, Fingerprints("m", "d", "c"))
    with reads_under(tmp_path) as reads:
        ckpt.save(1, trainable, {"data": {"next_step": 1}})
        ckpt.wait()
    assert (tmp_path / "latest").read_text() == "step_00000001\n"
    assert reads == []
    with reads_under(tmp_path) as reads:  # the counter sees reads where there are some
        assert ckpt.load(trainable) is not None
    read = {Path(p).relative_to(tmp_path).as_posix() for p in reads}
    step = "step_00000001/"
    assert {"latest", step + "manifest.json", step + "state.json", step + "rng/rank_00000.json",
            step + "dist/.metadata", step + "dist/metadata.json", step + "dist/__0_0.distcp",
            step + "dist/__0_0.distcp.digests.json"} <= read


def test_tensor_items_are_written_without_crc32_and_load(trainable: Any, tmp_path: Path) -> None:
    """Each tensor item is a torch.save archive whose records carry no CRC32 (their
    sha256 covers them), loads with torch.load, and saves elsewhere keep theirs."""
    import io
    import json
    import zipfile

    import torch

    ckpt = Checkpointer(CheckpointConfig(dir=str(tmp_path)), Fingerprints("m", "d", "c"))
    ckpt.save(1, trainable, {"data": {"next_step": 1}})
    dist = tmp_path / "step_00000001" / "dist"
    data = (dist / "__0_0.distcp").read_bytes()
    items = json.loads((dist / "__0_0.distcp.digests.json").read_text())["items"]
    archives = [data[offset:offset + length] for offset, length, _ in items]
    tensors = 0
    for archive in archives:
        # Objects other than tensors are serialised by the planner beforehand, on the
        # rank's own thread; the writer writes their bytes as they are.
        with zipfile.ZipFile(io.BytesIO(archive)) as zipped:
            records = zipped.infolist()
        if any("/data/" in info.filename for info in records):
            tensors += 1
            assert {info.CRC for info in records} == {0}
            assert isinstance(torch.load(io.BytesIO(archive)), torch.Tensor)
    assert tensors > 100
    assert torch.serialization.get_crc32_options()  # the switch is back
    assert ckpt.load(trainable) is not None
