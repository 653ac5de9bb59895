"""Reading a checkpoint's tensors and checking every item read against its digest.

`verified_reads(dist_dir, files)` makes every torch_dist read of `dist_checkpointing`
inside it go through `VerifyingReader`: the `.metadata` file is checked against the
manifest before it is unpickled, and each item (one tensor or object) a rank reads is
checked, as the bytes arrive, against the digest its writer recorded
(`digest_write`, `<file>.digests.json`, itself checked against the manifest). A rank
checks exactly the bytes it loads, nothing more: under a fully parallel load each
rank reads its share, so the check is split like the reads.

Megatron builds its readers in one module function (`_get_filesystem_reader`, used by
the load strategy and by the common-state load); inside the block that function
returns ours, and the original is put back after.
"""

from __future__ import annotations

import io
import json
import pickle
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from megatron.core.dist_checkpointing import serialization
from megatron.core.dist_checkpointing.strategies import torch as torch_strategy
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.futures import Future

from moerl.checkpoint.config import CheckpointError
from moerl.checkpoint.digest_write import DIGESTS_SUFFIX
from moerl.checkpoint.digests import LEGACY_ITEM_ALGORITHM, Entry, item_digest
from moerl.checkpoint.manifest import read_verified

METADATA = ".metadata"


class _Verified:
    """What one load has checked already: the metadata, each file's item digests."""

    def __init__(self, root: Path, files: dict[str, Entry]) -> None:
        self.root, self.files = root, files
        self._metadata: bytes | None = None
        self._items: dict[str, dict[int, tuple[int, str]]] = {}
        self._algorithms: dict[str, str] = {}

    def metadata(self) -> bytes:
        if self._metadata is None:
            self._metadata = read_verified(self.root, METADATA, self.files)
        return self._metadata

    def items(self, name: str) -> dict[int, tuple[int, str]]:
        """offset -> (length, digest) of every item of data file `name`."""
        if name not in self._items:
            sidecar = json.loads(read_verified(self.root, name + DIGESTS_SUFFIX, self.files))
            self._items[name] = {int(o): (int(n), str(h)) for o, n, h in sidecar["items"]}
            self._algorithms[name] = str(sidecar.get("algorithm", LEGACY_ITEM_ALGORITHM))
        return self._items[name]

    def algorithm(self, name: str) -> str:
        """The digest algorithm of data file `name`'s items (after `items(name)`)."""
        return self._algorithms[name]


class VerifyingReader(FileSystemReader):
    """torch's file system reader, every item checked against its digest."""

    def __init__(self, path: Any, verified: _Verified) -> None:
        super().__init__(path)
        self._verified = verified

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata: Metadata = pickle.loads(self._verified.metadata())  # checked: ours
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        assert metadata.storage_meta is not None
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def _item(self, stream: Any, name: str, offset: int, length: int) -> bytes:
        recorded = self._verified.items(name).get(offset)
        stream.seek(offset)
        data: bytes = stream.read(length)
        if recorded is None or recorded[0] != length or len(data) != length or (
                item_digest(data, self._verified.algorithm(name)) != recorded[1]):
            raise CheckpointError(
                f"checkpoint {self._verified.root}: dist/{name}: the {length} bytes at offset "
                f"{offset} differ from the digest recorded when they were written (modified "
                "or corrupted); resume from another checkpoint (checkpoint.resume=<dir>) or "
                "delete this one")
        return data

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list[Any]] = {}
        for read_item in plan.items:
            per_file.setdefault(self.storage_data[read_item.storage_index].relative_path,
                                []).append(read_item)
        for name, reads in per_file.items():
            last: tuple[int, bytes] | None = None  # reads of one item come together
            with (Path(self.path) / name).open("rb") as stream:
                for req in sorted(reads, key=lambda r: self.storage_data[r.storage_index].offset):
                    info = self.storage_data[req.storage_index]
                    if info.transform_descriptors:
                        raise CheckpointError(f"dist/{name}: items stored with transforms "
                                              f"{info.transform_descriptors} are not ours")
                    if last is None or last[0] != info.offset:
                        last = (info.offset, self._item(stream, name, info.offset, info.length))
                    self._deliver(req, last[1], planner)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    @staticmethod
    def _deliver(req: Any, data: bytes, planner: LoadPlanner) -> None:
        if req.type == LoadItemType.BYTE_IO:
            planner.load_bytes(req, io.BytesIO(data))
            return
        tensor = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        tensor = narrow_tensor_by_index(tensor, req.storage_offsets, req.lengths)
        target = planner.resolve_tensor(req).detach()
        if target.size() != tensor.size():
            raise CheckpointError(f"{req.storage_index.fqn}: the checkpoint holds "
                                  f"{tuple(tensor.size())} where {tuple(target.size())} is "
                                  "expected")
        target.copy_(tensor)
        planner.commit_tensor(req, target)


@contextmanager
def verified_reads(dist_dir: Path, files: dict[str, Entry]) -> Iterator[None]:
    """Every torch_dist read of `dist_dir` inside the block checks its bytes against
    `files` (the manifest's entries of that directory) and the item digests."""
    verified = _Verified(Path(dist_dir), files)
    original = torch_strategy._get_filesystem_reader

    def reader(checkpoint_dir: Any, *args: Any, **kwargs: Any) -> FileSystemReader:
        if Path(checkpoint_dir).resolve() != verified.root.resolve():
            return original(checkpoint_dir, *args, **kwargs)
        return VerifyingReader(checkpoint_dir, verified)

    torch_strategy._get_filesystem_reader = reader
    serialization._get_filesystem_reader = reader  # imported there by name
    try:
        yield
    finally:
        torch_strategy._get_filesystem_reader = original
        serialization._get_filesystem_reader = original
