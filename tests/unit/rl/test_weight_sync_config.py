"""`rl.weight_sync` choices: what each engine accepts, and what is refused at start-up
with the field named."""

from __future__ import annotations

from pathlib import Path

import pytest

from moerl.config import load_run_config
from moerl.models.arch import TINY
from moerl.rl.weight_stream import MemoryWeightSync
from moerl.rl.weight_sync import FilesystemWeightSync, HFExportWeightSync
from moerl.rl.weight_sync_build import build_weight_sync
from moerl.typed_config import ConfigError


def test_memory_is_accepted_for_every_engine(tmp_path: Path) -> None:
    hf = ["tokenizer=hf", f"tokenizer.path={tmp_path}", f"rollout.hf_model_dir={tmp_path}"]
    for engine in ("vllm", "sglang"):
        cfg = load_run_config(["rl.weight_sync=memory", f"rollout.engine={engine}", *hf])
        assert cfg.rl.weight_sync == "memory"
    assert load_run_config(["rl.weight_sync=memory"]).rl.weight_sync == "memory"
    with pytest.raises(ConfigError, match=r"rl\.weight_sync_staging_bytes: 1048576 is below"):
        load_run_config(["rl.weight_sync_staging_bytes=1048576"])
    with pytest.raises(ConfigError, match=r"rl\.weight_sync_timeout_s"):
        load_run_config(["rl.weight_sync_timeout_s=0"])


def test_each_engine_gets_its_disk_path_under_the_stream(tmp_path: Path) -> None:
    moerl = build_weight_sync("moerl", tmp_path, None, mode="memory", arch=TINY)
    assert isinstance(moerl, MemoryWeightSync) and moerl.engine == "moerl"
    assert isinstance(moerl.disk, FilesystemWeightSync)
    assert moerl.server_ranks is None  # moerl servers say how many ranks they have
    sglang = build_weight_sync("sglang", tmp_path, None, mode="memory", arch=TINY,
                               server_ranks=4)
    assert isinstance(sglang, MemoryWeightSync) and isinstance(sglang.disk, HFExportWeightSync)
    assert sglang.server_ranks == 4
    assert isinstance(build_weight_sync("moerl", tmp_path, None), FilesystemWeightSync)
    vllm = build_weight_sync("vllm", tmp_path, None, mode="memory", arch=TINY,
                             server_ranks=2)
    assert isinstance(vllm, MemoryWeightSync) and isinstance(vllm.disk, HFExportWeightSync)
    assert (vllm.engine, vllm.server_ranks) == ("vllm", 2)
    with pytest.raises(ValueError, match=r"rl\.weight_sync: 'nccl'"):
        build_weight_sync("moerl", tmp_path, None, mode="nccl", arch=TINY)


def test_the_first_version_is_read_where_the_weights_are(tmp_path: Path) -> None:
    """With `initial` (the run's start weights, or a resumed checkpoint's model part) the
    servers are told to read that directory: nothing is written for the first version,
    and the directory is never deleted with the versions published after it."""
    from typing import Any, cast

    announced: list[tuple[Path, int]] = []
    published: list[Path] = []

    class Engines:
        def update_weights(self, path: Path, version: int) -> None:
            announced.append((Path(path), version))

    class Trained:
        arch = TINY
        chunks: tuple[Any, ...] = ()

        def publish(self, directory: str | Path) -> Path:
            Path(directory).mkdir(parents=True)
            published.append(Path(directory))
            return Path(directory)

    start = tmp_path / "sft"
    start.mkdir()
    for mode in ("disk", "memory"):  # the stream's first version goes by disk too
        announced.clear()
        published.clear()
        sync = build_weight_sync("moerl", tmp_path / mode, cast(Any, Engines()), keep=1,
                                 mode=mode, arch=TINY, initial=start)
        disk = sync.disk if isinstance(sync, MemoryWeightSync) else sync
        disk.push(Trained(), 7)
        assert announced == [(start, 7)] and published == []
        disk.push(Trained(), 8)
        disk.push(Trained(), 9)  # keep=1: v8 goes, the start weights stay
        assert published == [tmp_path / mode / "v000008", tmp_path / mode / "v000009"]
        assert start.is_dir() and not published[0].exists()
