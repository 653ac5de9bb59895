"""The weight sync a run asks for: `rollout.engine` picks the published format (moerl's
Megatron weights, or an HF export for vLLM and SGLang), `rl.weight_sync` disk or memory."""

from __future__ import annotations

from pathlib import Path

from moerl.models.arch import MoEArch
from moerl.rl.weight_stream import MemoryWeightSync
from moerl.rl.weight_sync import (
    FilesystemWeightSync,
    HFExportWeightSync,
    WeightSync,
    export_dtype,
)
from moerl.rollout.backends import check_engine
from moerl.rollout.client import RolloutClient


def build_weight_sync(engine: str, root: Path, rollout_client: RolloutClient | None, *,
                      keep: int = 2,
                      hf_model_dir: str | None = None, dtype: str = "auto",
                      mode: str = "disk", arch: MoEArch | None = None,
                      staging_bytes: int = 256 << 20, timeout_s: float = 600.0,
                      server_ranks: int | None = None,
                      initial: Path | None = None) -> WeightSync:
    """The strategy `rollout.engine` and `rl.weight_sync` need: Megatron weights for
    moerl, an HF export then the engine's update call for vllm and sglang; with
    `mode="memory"` each version after the first is streamed over a process group
    instead (`server_ranks`: each server's ranks, None: they say; `staging_bytes` and
    `timeout_s`: each rank's staging memory and each version's bound). `initial`: the
    weights directory the first version already is (moerl servers read it there; see
    `FilesystemWeightSync`)."""
    if mode not in ("disk", "memory"):
        raise ValueError(f"rl.weight_sync: {mode!r}; choose disk or memory")
    kind = check_engine(engine)
    disk: WeightSync
    if kind == "moerl":
        disk = FilesystemWeightSync(root, rollout_client, keep, initial)
    else:
        disk = HFExportWeightSync(root, rollout_client, keep, served_dir=hf_model_dir,
                                  dtype=export_dtype(dtype))
    if mode == "disk":
        return disk
    assert arch is not None, "rl.weight_sync=memory needs the architecture"
    hf_config = disk.base_config if isinstance(disk, HFExportWeightSync) else None
    return MemoryWeightSync(disk, rollout_client, arch, engine=kind,
                            server_ranks=None if kind == "moerl" else (server_ranks or 1),
                            staging_bytes=staging_bytes, timeout_s=timeout_s,
                            hf_config=hf_config, hf_dtype=export_dtype(dtype))
