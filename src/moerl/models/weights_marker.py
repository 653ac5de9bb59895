"""Whether a weights directory is complete, without importing torch or Megatron.

`weights.save_weights` writes `MARKER` last, inside the temporary directory that
is then renamed into place; the run config checks `init_weights` with it at
start-up, before anything heavy is imported.
"""

from __future__ import annotations

from pathlib import Path

MARKER = "moerl_weights_complete"


def is_complete(directory: str | Path) -> bool:
    return (Path(directory) / MARKER).is_file()
