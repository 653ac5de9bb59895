"""A checkpoint's tensors written with their digests, in Megatron's torch_dist format.

`DigestingSaveStrategy` is Megatron's torch_dist save strategy whose writer hashes
each data file as it writes it (`HashingWriter`), item by item (one tensor or one
object: the unit a reader reads; the items cover the file). Beside each data file
goes `<file>.digests.json`, the items' digests by offset; the manifest gets the data
file's size with the name of its digest list, and the size and sha256 of the list
and of the `.metadata` file the coordinator writes at the end. The data and metadata
files are Megatron's own: any torch_dist reader loads them.

Each item is a `torch.save` archive, written without the zip format's CRC32 of each
record (`torch.serialization.set_crc32_options`): the item's digest already covers
those bytes, and `torch.load` reads them either way. The writer's CPU is then the
copy into the page cache and one XXH3 pass (see `digests`).

The write runs where Megatron runs it: in the async writer process (forked from the
rank, so it writes the state as it was when the save began) or, for a synchronous
save, in the rank itself. Its digests come back with its write results.
"""

from __future__ import annotations

import io
import json
import os
import queue
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any, cast

import torch
from megatron.core.dist_checkpointing.core import CheckpointingConfig
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
from megatron.core.dist_checkpointing.strategies.state_dict_saver import (
    save_state_dict_async_finalize,
)
from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
from torch.distributed.checkpoint.api import _wrap_exception
from torch.distributed.checkpoint.filesystem import FileSystem, SerializationFormat, _write_item
from torch.distributed.checkpoint.storage import WriteResult

from moerl.checkpoint.async_writer import stage, staged_bytes
from moerl.checkpoint.digests import (
    ITEM_ALGORITHM,
    Entry,
    HashingWriter,
    entry_of,
    write_file,
)

DIGESTS_SUFFIX = ".digests.json"
# A writer that waits for this file before it writes: the tests' way to hold a save
# in flight for as long as they look (no timing decides when it ends).
HOLD_ENV = "MOERL_CHECKPOINT_HOLD"


@contextmanager
def _without_crc32() -> Iterator[None]:
    """`torch.save` without each record's CRC32 while the block runs. The switch is the
    process's: a save elsewhere meanwhile also skips it, which `torch.load` accepts."""
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(before)


def _write_bucket(transforms: Any, bucket: Any) -> tuple[list[WriteResult], dict[str, Entry]]:
    """Write one data file of Megatron's plan; its results and the entries of the file
    and of its item digests."""
    path, storage_key, (bytes_data, tensor_data) = bucket
    results: list[WriteResult] = []
    items: list[list[Any]] = []  # [offset, length, digest] of each item, in file order
    with open(path, "wb") as raw, _without_crc32():
        stream = HashingWriter(raw, whole=False)
        for write_item, data in [*bytes_data, *tensor_data]:
            stream.begin_item()
            result = _write_item(transforms, cast(io.IOBase, stream), data, write_item,
                                 storage_key, serialization_format=SerializationFormat.TORCH_SAVE)
            items.append([result.storage_data.offset, result.storage_data.length,
                          stream.end_item()])
            results.append(result)
        raw.flush()
        os.fsync(raw.fileno())
    name = Path(path).name
    sidecar = json.dumps({"file": name, "algorithm": ITEM_ALGORITHM, "items": items}).encode()
    return results, {name: {"size": stream.size, "digests": name + DIGESTS_SUFFIX},
                     name + DIGESTS_SUFFIX: write_file(Path(path + DIGESTS_SUFFIX), sidecar)}


def write_with_digests(transforms: Any, rank: int, write_buckets: list[Any],
                       results_queue: Any) -> None:
    """The writer: every data file of this rank, then its results and digests (or the
    error) on `results_queue`. Megatron's own writer takes the same arguments."""
    out: Any
    try:
        if hold := os.environ.get(HOLD_ENV):
            while not Path(hold).exists():
                time.sleep(0.01)
        results: dict[int, list[WriteResult]] = {}
        digests: dict[str, Entry] = {}
        for i, bucket in enumerate(write_buckets):
            results[i], entries = _write_bucket(transforms, bucket)
            digests.update(entries)
        out = {"results": results, "digests": digests}
    except Exception as err:  # reported to every rank by the finalisation
        out = RuntimeError(f"rank {rank}: checkpoint write failed: {err!r}")
    results_queue.put(out)


class _HashingFileSystem(FileSystem):
    """torch's file system, hashing the files it writes (the coordinator's `.metadata`:
    written to a temporary name, then renamed)."""

    def __init__(self, digests: dict[str, Entry]) -> None:
        super().__init__()
        self._digests = digests
        self._pending: dict[str, Entry] = {}

    @contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[io.IOBase]:
        with super().create_stream(path, mode) as raw:
            if "w" not in mode:
                yield raw
                return
            stream = HashingWriter(raw)
            yield cast(io.IOBase, stream)
        self._pending[Path(path).name] = stream.entry()

    def rename(self, path: Any, new_path: Any) -> None:
        super().rename(path, new_path)
        if (entry := self._pending.pop(Path(path).name, None)) is not None:
            self._digests[Path(new_path).name] = entry


class _DigestingWriter:
    """Megatron's prepared async writer, with the write and the finish hashed."""

    def __init__(self, inner: FileSystemWriterAsync) -> None:
        self.inner = inner
        self.digests: dict[str, Entry] = {}
        self.results: queue.Queue[Any] = queue.Queue()  # one put per write
        self.staged_bytes = 0
        self.writes = False  # has this rank a write to report?
        inner.fs = _HashingFileSystem(self.digests)

    def request(self, finalize: Callable[[], None], staged: bool) -> AsyncRequest:
        """The write of this rank's plan; `staged`: from a copy taken when the write is
        scheduled (an asynchronous save), else from the tensors themselves."""
        buckets = self.inner.write_buckets or []
        self.inner.write_buckets = []  # the request holds the plan from here on
        write = partial(write_with_digests, self.inner.transforms)
        rank = torch.distributed.get_rank()
        if not buckets:  # nothing of this rank's is written by it
            return AsyncRequest(None, (), [finalize])
        self.writes = True
        if not staged:
            return AsyncRequest(write, (rank, buckets, self.results), [finalize])
        plan = [buckets]  # emptied by the staging: the originals are not kept alive

        def copy() -> list[Any]:
            copies = stage(plan.pop())
            self.staged_bytes = staged_bytes(copies)
            return copies

        return AsyncRequest(write, (rank, None, self.results), [finalize], preload_fn=copy)

    def retrieve_write_results(self) -> Any:
        try:
            out = self.results.get_nowait()
        except queue.Empty:
            if not self.writes:
                return []
            return _wrap_exception(RuntimeError("the checkpoint writer ended without "
                                                "reporting its write"))
        if isinstance(out, BaseException):
            return _wrap_exception(out)
        self.digests.update(out["digests"])
        return [r for i in sorted(out["results"]) for r in out["results"][i]]

    def finish(self, metadata: Any, results: Any) -> None:
        self.inner.finish(metadata, results)


class DigestingSaveStrategy(TorchDistSaveShardedStrategy):
    """torch_dist saving with digests taken while writing (`digests()` after the save).

    `staged`: the write goes from a copy of this rank's tensors taken when it is
    scheduled (`async_writer.stage`), so that training may go on meanwhile."""

    def __init__(self, staged: bool = False) -> None:
        super().__init__()
        self.staged = staged
        self._writer: _DigestingWriter | None = None

    def _get_save_and_finalize_callbacks(self, writer: Any, save_state_dict_ret: Any,
                                         async_strategy: str) -> AsyncRequest:
        if async_strategy != "mcore":
            raise ValueError(f"async_strategy={async_strategy!r}: digests are taken by "
                             "megatron-core's own async writer ('mcore')")
        digesting = _DigestingWriter(writer)
        self._writer = digesting
        _, metadata, dist_wrapper = save_state_dict_ret

        def finalize() -> None:
            save_state_dict_async_finalize(digesting, metadata, dist_wrapper)

        return digesting.request(finalize, self.staged)

    def digests(self) -> dict[str, Entry]:
        """This rank's files (and the coordinator's `.metadata`), by name in the dir."""
        return dict(self._writer.digests) if self._writer is not None else {}

    def staged_bytes(self) -> int:
        """Bytes of the copy an asynchronous save of this rank took (0: none)."""
        return self._writer.staged_bytes if self._writer is not None else 0


def metadata_json_entry(backend: str, version: int) -> Entry:
    """The entry of `metadata.json`, which `dist_checkpointing.save` writes on rank 0
    (`save_config`: `json.dump` of this config, the same bytes as `json.dumps`)."""
    return entry_of(json.dumps(asdict(CheckpointingConfig(backend, version))).encode())
