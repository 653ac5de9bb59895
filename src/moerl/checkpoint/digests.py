"""sha256 digests of a checkpoint's files, taken from the bytes as they are written.

A save never reads a file back to hash it: `HashingWriter` sits between the writer
and the file and hashes every byte on its way out (the whole file, and each item of
it separately: one tensor, one object), and `write_file` hashes the bytes it was given.
A 14 TB save then costs its writes, not twice its size in I/O.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

# {"size": bytes, "sha256": hex digest}: what the manifest records of each file.
Entry = dict[str, Any]


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

    `begin_item()` starts the digest of one item (the bytes from there to the next
    `begin_item()` or `end_item()`); the file's digest covers everything. `tell()` is
    the raw stream's, so writers that record offsets (torch.distributed.checkpoint)
    see the true positions.
    """

    def __init__(self, raw: Any) -> None:
        self.raw = raw
        self.size = 0
        self._file = hashlib.sha256()
        self._item: Any = None

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        written: int = self.raw.write(view)
        if written != len(view):
            raise OSError(f"short write: {written} of {len(view)} bytes")
        self._file.update(view)
        if self._item is not None:
            self._item.update(view)
        self.size += written
        return written

    def begin_item(self) -> None:
        self._item = hashlib.sha256()

    def end_item(self) -> str:
        digest: str = self._item.hexdigest()
        self._item = None
        return digest

    def entry(self) -> Entry:
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
