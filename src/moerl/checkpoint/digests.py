"""Digests of a checkpoint's files, taken from the bytes as they are written.

A save never reads a file back to hash it: `HashingWriter` sits between the writer
and the file and hashes every byte on its way out, and `write_file` hashes the bytes
it was given. A 14 TB save then costs its writes, not twice its size in I/O.

Small files (metadata, digest lists, JSON state) get a sha256 of the whole file. A
data file is hashed once, item by item (one tensor or one object: the unit a reader
reads), with XXH3-128 (`ITEM_ALGORITHM`): every byte belongs to exactly one item, so
the items' digests cover the file, and a reader checks exactly the bytes it reads.
XXH3 is a non-cryptographic 128-bit hash at ~13 GB/s a core against sha256's ~1.5
(SHA-NI): it catches corruption (a flipped byte, a torn write), not a forger, and it
keeps the writer of an asynchronous save from taking a CPU rank's cores from its
training step (`benchmarks/checkpoint_overlap.py`).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import xxhash

# What the manifest records of each file: {"size": bytes, "sha256": hex digest} for a
# file hashed whole, {"size": bytes, "digests": name of its item digests} for a data
# file.
Entry = dict[str, Any]
ITEM_ALGORITHM = "xxh3_128"
# Item digests of checkpoints written before items were hashed with XXH3.
LEGACY_ITEM_ALGORITHM = "sha256"


def item_digest(data: Any, algorithm: str = ITEM_ALGORITHM) -> str:
    """The hex digest of one item's bytes by `algorithm` (as a digest list names it)."""
    if algorithm == ITEM_ALGORITHM:
        return str(xxhash.xxh3_128_hexdigest(data))
    if algorithm == LEGACY_ITEM_ALGORITHM:
        return hashlib.sha256(data).hexdigest()
    raise ValueError(f"unknown item digest algorithm {algorithm!r}")


def entry_of(data: bytes) -> Entry:
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def write_file(path: Path, data: bytes) -> Entry:
    """Write `data` to `path` durably; its manifest entry, hashed from memory."""
    with path.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return entry_of(data)


class HashingWriter:
    """A binary stream that hashes what passes through it to `raw`.

    `whole=True`: one sha256 of everything (`entry()`). `whole=False`: each item's
    XXH3-128 only, from `begin_item()` to `end_item()`; a byte written outside an
    item is an error, so the items cover the file. `tell()` is the raw stream's, so
    writers that record offsets (torch.distributed.checkpoint) see the true positions.
    """

    def __init__(self, raw: Any, whole: bool = True) -> None:
        self.raw = raw
        self.size = 0
        self._file = hashlib.sha256() if whole else None
        self._item: Any = None

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if self._file is None and self._item is None and len(view):
            raise ValueError("HashingWriter(whole=False): every byte must belong to an "
                             "item (begin_item() first)")
        written: int = self.raw.write(view)
        if written != len(view):
            raise OSError(f"short write: {written} of {len(view)} bytes")
        if self._file is not None:
            self._file.update(view)
        if self._item is not None:
            self._item.update(view)
        self.size += written
        return written

    def begin_item(self) -> None:
        self._item = xxhash.xxh3_128()

    def end_item(self) -> str:
        digest: str = self._item.hexdigest()
        self._item = None
        return digest

    def entry(self) -> Entry:
        if self._file is None:
            raise ValueError("a HashingWriter(whole=False) has no whole-file digest")
        return {"size": self.size, "sha256": self._file.hexdigest()}

    def tell(self) -> int:
        position: int = self.raw.tell()
        return position

    def flush(self) -> None:
        self.raw.flush()

    def fileno(self) -> int:
        number: int = self.raw.fileno()
        return number

    def writable(self) -> bool:
        return True
