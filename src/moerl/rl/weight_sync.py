"""Trainer -> rollout servers: publish new weights, tell every server to load them.

Two filesystem strategies, chosen from `rollout.engine` by `weight_sync_build.build_weight_sync`:

- `FilesystemWeightSync` (our own servers): all trainer ranks write the Megatron
  weights together to `<root>/v<version>` (atomic; see models.weights), then the
  controller asks each server to load that directory.
- `HFExportWeightSync` (vLLM, SGLang: they read Hugging Face checkpoints only):
  every rank writes the tensors it is assigned to safetensors files of its own
  (`models.hf.export_hf`: nothing gathered to one rank; rank 0 writes the index and
  config.json), the directory is completed with the served model's tokenizer files
  and renamed into place, and only then does the controller send the engine's update
  call (`rollout.backends.weight_update_calls`) naming it.

`rollout_client` is given on the controller only, which is global rank 0 (the rank that
renames the HF export into place); every trainer rank calls `push`.

`rl.weight_sync=memory` streams each version to the servers over a process group
instead (`rl.weight_stream`: every trainer rank its own slices to moerl servers;
SGLang's protocol, and vLLM through moerl's worker extension, from rank 0);
docs/architecture.md ("Weight sync") maps it onto the servers' endpoints.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from moerl.models.arch import MoEArch
from moerl.models.weights import unwrap_model
from moerl.rollout.client import RolloutClient

# Files of the served HF directory that are not weights and that a new version keeps.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
_REWRITTEN = ("config.json", "model.safetensors.index.json")


class Publisher(Protocol):
    """What a weight sync reads from the policy."""

    arch: MoEArch

    @property
    def chunks(self) -> list[torch.nn.Module]: ...

    def publish(self, directory: str | Path) -> Path: ...


class WeightSync(Protocol):
    def push(self, policy: Publisher, version: int) -> None: ...


class _Announcer:
    """Tells the servers about a published directory, keeping the last `keep`."""

    def __init__(self, root: Path, rollout_client: RolloutClient | None, keep: int) -> None:
        self.root, self.rollout_client, self.keep = Path(root), rollout_client, max(keep, 1)
        self.published: list[Path] = []

    def _announce(self, path: Path, version: int) -> None:
        if self.rollout_client is None:
            return
        self.rollout_client.update_weights(path, version)
        self.published.append(path)
        # Servers hold their weights in memory once loaded: older directories can go.
        while len(self.published) > self.keep:
            shutil.rmtree(self.published.pop(0), ignore_errors=True)


class FilesystemWeightSync(_Announcer):
    """Megatron weights for our own servers (`rollout.engine=moerl`).

    `initial`: a weights directory that holds exactly the policy's weights when the
    first version is pushed (the run's initial weights, or a resumed checkpoint's model
    part): the servers are told to read it where it is, and nothing is written. It is
    never deleted with the published versions."""

    def __init__(self, root: Path, rollout_client: RolloutClient | None, keep: int,
                 initial: Path | None = None) -> None:
        super().__init__(root, rollout_client, keep)
        self.initial = initial

    def push(self, policy: Publisher, version: int) -> None:
        if self.initial is not None:
            initial, self.initial = self.initial, None
            if self.rollout_client is not None:
                self.rollout_client.update_weights(initial, version)
            return
        path = policy.publish(self.root / f"v{version:06d}")
        if dist.is_initialized():
            dist.barrier()
        self._announce(path, version)


class HFExportWeightSync(_Announcer):
    """A Hugging Face export per version for vLLM and SGLang.

    `served_dir`: the HF directory the rollout_client were started on (`rollout.hf_model_dir`):
    its config.json is the base of each export's (token ids, RoPE scaling) and its
    tokenizer files are copied along. `dtype`: of the exported weights (None: the
    model's).
    """

    def __init__(self, root: Path, rollout_client: RolloutClient | None, keep: int = 2,
                 served_dir: str | Path | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__(root, rollout_client, keep)
        self.served_dir = Path(served_dir) if served_dir else None
        self.dtype = dtype
        config = self.served_dir / "config.json" if self.served_dir else None
        self.base_config: dict[str, Any] | None = (
            json.loads(config.read_text()) if config is not None and config.is_file() else None)

    def push(self, policy: Publisher, version: int) -> None:
        from moerl.models.hf import export_hf

        chunks = policy.chunks
        check_exportable(chunks)  # same answer on every rank: none is left in a collective
        final = self.root / f"v{version:06d}"
        partial = final.with_name(final.name + ".partial")
        writer = not dist.is_initialized() or dist.get_rank() == 0
        if writer:
            shutil.rmtree(partial, ignore_errors=True)
        if dist.is_initialized():  # every rank writes into it: none before it is cleared
            dist.barrier()
        export_hf(chunks, policy.arch, partial, base_config=self.base_config, dtype=self.dtype)
        if not writer:
            return
        self._copy_tokenizer(partial)
        shutil.rmtree(final, ignore_errors=True)
        partial.rename(final)  # servers never see a half-written directory
        self._announce(final, version)

    def _copy_tokenizer(self, out: Path) -> None:
        if self.served_dir is None or not self.served_dir.is_dir():
            return
        for item in self.served_dir.iterdir():
            if (item.is_file() and item.name not in _REWRITTEN
                    and not item.name.endswith(_WEIGHT_SUFFIXES)):
                shutil.copy2(item, out / item.name)


def check_exportable(chunks: list[torch.nn.Module]) -> None:
    """Refuse models the Hugging Face DeepSeek-V3 layout cannot hold."""
    config = unwrap_model(chunks[0]).config
    if getattr(config, "multi_latent_attention", False) and not config.qk_layernorm:
        raise ValueError(
            "rollout.engine: vllm/sglang serve Hugging Face DeepSeek-V3 weights, which have "
            "q/kv latent norms this policy was built without; set model.latent_norms=true "
            "(Hugging Face imports have it) or use rollout.engine=moerl")


def export_dtype(name: str) -> torch.dtype | None:
    """`rollout.dtype` as a torch dtype; None for "auto" (the model's own)."""
    if name == "auto":
        return None
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"rollout.dtype: {name!r} is not a torch dtype; use bfloat16, "
                         "float16, float32 or auto")
    return dtype
