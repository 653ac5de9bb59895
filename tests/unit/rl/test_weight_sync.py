"""Weight sync for vLLM / SGLang: the policy is exported to Hugging Face format
before the engine is told to load it, and the samples then carry that version.

The policy is a tiny DeepSeek-V3 (built with transformers, imported into Megatron);
the engines are small HTTP servers answering as stock vLLM and SGLang do.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from moerl.models.arch import MoEArch
from moerl.parallel.layout import ParallelLayout
from moerl.rl.weight_sync import FilesystemWeightSync, HFExportWeightSync, export_dtype
from moerl.rl.weight_sync_build import build_weight_sync
from moerl.rollout.client import RolloutClient, RolloutClientConfig

pytest.importorskip("transformers")
TESTS = Path(__file__).parents[2]


def _load(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module


HF_WORKER = _load(TESTS / "distributed" / "hf_parity_worker.py")
FAKES = _load(TESTS / "unit" / "rollout" / "fake_engines.py")


class _Policy:
    def __init__(self, arch: MoEArch, chunks: list[torch.nn.Module]) -> None:
        self.arch, self._chunks = arch, chunks

    @property
    def chunks(self) -> list[torch.nn.Module]:
        return self._chunks

    def publish(self, directory: str | Path) -> Path:
        raise AssertionError("vllm/sglang must not be sent Megatron weights")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, _Policy]]:
    from megatron.core.transformer.moe import moe_logging

    from moerl.models.hf_import import import_hf
    from moerl.parallel.groups import destroy_parallel, init_parallel

    hf_dir = HF_WORKER.tiny_hf_checkpoint(tmp_path_factory.mktemp("served") / "tiny")
    (hf_dir / "tokenizer.json").write_text('{"model": "bytes"}')
    init_parallel(ParallelLayout(), seed=0)
    moe_logging.destroy_moe_metrics_tracker()
    arch, chunks, _ = import_hf(hf_dir, ParallelLayout())
    yield hf_dir, _Policy(arch, chunks)
    destroy_parallel()


def _engine(seen: list[dict[str, Any]], engine: str) -> Any:
    """A server that, on each weight-update call, records what the named directory holds."""
    def reply(path: str, body: dict[str, Any]) -> tuple[int, Any]:
        if path in ("/update_weights_from_disk", "/collective_rpc", "/reset_prefix_cache"):
            target = body.get("model_path") or (body.get("args") or [{}])[0].get(
                "model_config", {}).get("model")
            files = sorted(p.name for p in Path(target).iterdir()) if target else []
            seen.append({"path": path, "body": body, "files": files})
            return 200, {"success": True, "message": "ok", "num_paused_requests": 0}
        if engine == "sglang":
            version = next(s["body"]["weight_version"] for s in reversed(seen)
                           if s["path"] == "/update_weights_from_disk")
            return 200, [FAKES.sglang_output([5], [-0.5], {"type": "length", "length": 1},
                                             version)]
        return 200, FAKES.vllm_completion([FAKES.vllm_choice(0, [5], [-0.5], "length")])
    return reply


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_export_then_update_call_then_versioned_samples(
        engine: str, served: tuple[Path, _Policy], tmp_path: Path) -> None:
    from safetensors.torch import load_file

    hf_dir, policy = served
    seen: list[dict[str, Any]] = []
    server = FAKES.FakeEngine(_engine(seen, engine))
    client = RolloutClient([server.url], engine=engine, config=RolloutClientConfig(timeout_s=10.0))
    try:
        sync = build_weight_sync(engine, tmp_path / "weights", client, keep=1,
                                 hf_model_dir=str(hf_dir), dtype="auto")
        assert isinstance(sync, HFExportWeightSync)
        sync.push(policy, 3)
        exported = tmp_path / "weights" / "v000003"
        # The first call already saw the whole export: weights, config, tokenizer.
        assert {"model.safetensors", "config.json", "tokenizer.json"} <= set(seen[0]["files"])
        if engine == "sglang":
            assert [s["path"] for s in seen] == ["/update_weights_from_disk"]
            assert seen[0]["body"] == {"model_path": str(exported), "weight_version": "3"}
        else:
            assert [s["path"] for s in seen] == ["/collective_rpc", "/collective_rpc",
                                                 "/reset_prefix_cache"]
            assert seen[0]["body"]["args"] == [{"model_config": {"model": str(exported)}}]
        before, after = load_file(hf_dir / "model.safetensors"), load_file(
            exported / "model.safetensors")
        assert sorted(after) == sorted(before)
        assert all(torch.equal(after[k], before[k]) for k in before)  # exact round trip
        config = json.loads((exported / "config.json").read_text())
        assert config["model_type"] == "deepseek_v3"
        (sample,), = client.generate([[1, 2]])
        assert sample.weight_version == 3 and sample.token_ids == (5,)

        sync.push(policy, 4)  # keep=1: the older export goes once the new one is loaded
        assert not exported.exists() and (tmp_path / "weights" / "v000004").is_dir()
        assert not list((tmp_path / "weights").glob("*.partial"))
    finally:
        client.close()
        server.close()


def test_strategy_follows_the_engine(tmp_path: Path) -> None:
    assert isinstance(build_weight_sync("moerl", tmp_path, None), FilesystemWeightSync)
    sync = build_weight_sync("sglang", tmp_path, None, dtype="bfloat16")
    assert isinstance(sync, HFExportWeightSync) and sync.dtype == torch.bfloat16
    assert export_dtype("auto") is None
    with pytest.raises(ValueError, match=r"rollout\.dtype"):
        export_dtype("bf17")
    with pytest.raises(ValueError, match=r"rollout\.engine"):
        build_weight_sync("tgi", tmp_path, None)


def test_a_model_without_latent_norms_is_refused(served: tuple[Path, _Policy],
                                                 tmp_path: Path) -> None:
    from moerl.models.build import build_model

    _, policy = served
    arch = policy.arch.replace(latent_norms=False)
    (plain,) = build_model(arch, ParallelLayout())  # no latent norms: not exportable
    sync = HFExportWeightSync(tmp_path, None)
    with pytest.raises(ValueError, match=r"model\.latent_norms=true"):
        sync.push(_Policy(arch, [plain]), 1)
    assert not list(tmp_path.iterdir())  # refused before anything was written
