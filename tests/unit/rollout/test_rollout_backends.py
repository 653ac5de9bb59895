"""vLLM / SGLang backends: the generated launch commands and weight-update requests.

Neither engine runs on CPU, so these check what would be sent, not the engines.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import httpx
import pytest

from moerl.config import LaunchConfig
from moerl.launchers.plan import build_run_plan
from moerl.rewards.config import RewardStageConfig
from moerl.rollout.backends import engine_argv, weight_update_calls
from moerl.rollout.client import RolloutClient, RolloutUnavailable
from moerl.rollout.config import RolloutStageConfig

HF = "/ckpt/hf/v3"


def _flag(argv: tuple[str, ...], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_vllm_argv() -> None:
    cfg = RolloutStageConfig(engine="vllm", hf_model_dir=HF, tensor_parallel=8,
                             expert_parallel=8, max_model_len=8192, served_model_name="policy")
    argv = engine_argv(cfg)
    assert argv[:3] == ("vllm", "serve", HF)
    assert _flag(argv, "--host") == "{host}" and _flag(argv, "--port") == "{port}"
    assert _flag(argv, "--tensor-parallel-size") == "8"
    assert "--enable-expert-parallel" in argv
    assert _flag(argv, "--dtype") == "bfloat16"
    assert _flag(argv, "--max-model-len") == "8192"
    assert _flag(argv, "--served-model-name") == "policy"
    assert _flag(argv, "--gpu-memory-utilization") == "0.85"
    # the class vLLM mixes into its workers must import by that name
    module, _, name = _flag(argv, "--worker-extension-cls").rpartition(".")
    assert hasattr(importlib.import_module(module), name)
    no_ep = engine_argv(RolloutStageConfig(engine="vllm", hf_model_dir=HF))
    assert "--enable-expert-parallel" not in no_ep and "--max-model-len" not in no_ep
    assert "--pipeline-parallel-size" not in no_ep
    staged = engine_argv(RolloutStageConfig(engine="vllm", hf_model_dir=HF,
                                            pipeline_parallel=2))
    assert _flag(staged, "--pipeline-parallel-size") == "2"


def test_sglang_argv() -> None:
    cfg = RolloutStageConfig(engine="sglang", hf_model_dir=HF, tensor_parallel=4,
                             expert_parallel=4, dtype="float16", max_model_len=4096)
    argv = engine_argv(cfg, python="/env/bin/python")
    assert argv[:5] == ("/env/bin/python", "-m", "sglang.launch_server", "--model-path", HF)
    assert _flag(argv, "--host") == "{host}" and _flag(argv, "--port") == "{port}"
    assert _flag(argv, "--tp-size") == "4" and _flag(argv, "--ep-size") == "4"
    assert _flag(argv, "--dtype") == "float16" and _flag(argv, "--context-length") == "4096"
    assert "--served-model-name" not in argv  # not set: the engine's default
    assert "--ep-size" not in engine_argv(RolloutStageConfig(engine="sglang", hf_model_dir=HF))


def test_engines_need_hf_dir_and_known_names() -> None:
    with pytest.raises(ValueError, match=r"rollout\.hf_model_dir"):
        engine_argv(RolloutStageConfig(engine="vllm"))
    with pytest.raises(ValueError, match=r"rollout\.engine.*'tgi'.*moerl, vllm, sglang"):
        engine_argv(RolloutStageConfig(engine="tgi", hf_model_dir=HF))
    with pytest.raises(ValueError, match=r"rollout\.engine.*'tgi'"):
        weight_update_calls("tgi", HF, 1)
    with pytest.raises(ValueError, match=r"rollout\.engine.*'tgi'"):
        RolloutClient(["http://x:1"], engine="tgi")


def _plan(tmp_path: Path, rollout: RolloutStageConfig) -> tuple[str, ...]:
    plan = build_run_plan(tmp_path, [], LaunchConfig(python="/env/bin/python"), rollout,
                          RewardStageConfig(), tmp_path / "arch.json")
    stage = next(s for s in plan.stages if s.name == "rollout")
    if rollout.engine == "vllm":
        assert stage.env["VLLM_SERVER_DEV_MODE"] == "1"
    return stage.command


def test_run_plan_uses_the_configured_engine(tmp_path: Path) -> None:
    ours = _plan(tmp_path, RolloutStageConfig())
    assert ours[1:5] == ("-m", "moerl.launchers.cli", "serve", "rollout")
    vllm = _plan(tmp_path, RolloutStageConfig(engine="vllm", hf_model_dir=HF))
    # Wrapped so the engine gets announced in the rendezvous dir once healthy.
    assert vllm[:4] == ("/env/bin/python", "-m", "moerl.rollout.backends", "--")
    assert vllm[4:7] == ("vllm", "serve", HF)
    sglang = _plan(tmp_path, RolloutStageConfig(engine="sglang", hf_model_dir=HF))
    assert sglang[4:7] == ("/env/bin/python", "-m", "sglang.launch_server")
    with pytest.raises(ValueError, match=r"rollout\.engine"):
        _plan(tmp_path, RolloutStageConfig(engine="trt"))


class _Recorder:
    def __init__(self, fail_path: str | None = None, sglang_refuses: bool = False) -> None:
        self.calls: list[tuple[str, str, dict[str, object]]] = []
        self.fail_path, self.sglang_refuses = fail_path, sglang_refuses

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content or b"{}")
        self.calls.append((request.url.host, request.url.path, body))
        if request.url.path == self.fail_path:
            return httpx.Response(500, text="boom")
        if self.sglang_refuses:
            return httpx.Response(200, json={"success": False, "message": "bad dir"})
        return httpx.Response(200, json={"success": True})

    def update(self, engine: str, hosts: tuple[str, ...] = ("a", "b")) -> None:
        client = RolloutClient([f"http://{h}:8000" for h in hosts], engine=engine,
                               transport=httpx.MockTransport(self))
        try:
            client.update_weights(Path(HF), 7)
        finally:
            client.close()


@pytest.mark.parametrize("engine,expected", [
    ("moerl", [("/update_weights", {"path": HF, "version": 7})]),
    ("sglang", [("/update_weights_from_disk", {"model_path": HF, "weight_version": "7"})]),
    ("vllm", [
        ("/collective_rpc", {"method": "update_config",
                             "args": [{"model_config": {"model": HF}}]}),
        ("/collective_rpc", {"method": "reload_weights"}),
        ("/reset_prefix_cache", {}),
    ]),
])
def test_weight_update_requests(engine: str, expected: list[tuple[str, dict[str, object]]]
                                ) -> None:
    assert [(c.path, c.body) for c in weight_update_calls(engine, Path(HF), 7)] == expected
    seen = _Recorder()
    seen.update(engine)
    for host in ("a", "b"):  # every server, each in order
        assert [(p, b) for h, p, b in seen.calls if h == host] == expected


def test_weight_update_failures_name_the_server() -> None:
    with pytest.raises(RolloutUnavailable, match=r"http://a:8000/reset_prefix_cache: HTTP 500"):
        _Recorder(fail_path="/reset_prefix_cache").update("vllm", hosts=("a",))
    with pytest.raises(RolloutUnavailable, match="bad dir"):
        _Recorder(sglang_refuses=True).update("sglang", hosts=("a",))



def test_an_unreachable_server_is_marked_dead_and_the_others_take_the_version() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "gone":
            raise httpx.ConnectError("refused", request=request)
        return httpx.Response(200, json={"success": True})

    client = RolloutClient(["http://a:8000", "http://gone:8000"],
                           transport=httpx.MockTransport(handler))
    client.update_weights(Path(HF), 7)
    assert client.dead == {"http://gone:8000"} and client.weight_version == 7
    client.dead.add("http://a:8000")  # none left to take the next one
    with pytest.raises(RolloutUnavailable, match="no live server"):
        client.update_weights(Path(HF), 8)
    client.close()

_FAKE_ENGINE = """
import argparse, http.server
p = argparse.ArgumentParser(); p.add_argument("--host"); p.add_argument("--port", type=int)
a, _ = p.parse_known_args()
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404); self.end_headers()
        if self.path == "/health":
            raise SystemExit(0)  # exit after the first health check: the test needs no stop
    def log_message(self, *args): pass
http.server.HTTPServer((a.host, a.port), H).serve_forever()
"""


def test_wrapper_announces_the_engine_once_healthy(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    import socket
    import sys

    from moerl.rendezvous import ENV_INDEX, ENV_RENDEZVOUS, ENV_STAGE, read_endpoints
    from moerl.rollout.backends import main

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "engine.py"
    script.write_text(_FAKE_ENGINE)
    for name, value in ((ENV_RENDEZVOUS, str(tmp_path)), (ENV_STAGE, "rollout"), (ENV_INDEX, "0")):
        monkeypatch.setenv(name, value)
    status = main(["--", sys.executable, str(script), "--host", "127.0.0.1", "--port", str(port)])
    assert status == 0
    assert read_endpoints(tmp_path, "rollout") == [f"127.0.0.1:{port}"]
