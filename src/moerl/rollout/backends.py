"""Rollout engines other than ours: launch commands and weight-update requests.

`rollout.engine` picks the generation server: `moerl` (default, `moerl serve rollout`
on the trainer's Megatron model), `vllm` or `sglang`. The last two serve a Hugging
Face directory (`rollout.hf_model_dir`) and are started from the argv built here; the
launcher wraps that argv in `python -m moerl.rollout.backends -- ARGV`, which waits
for the engine's `/health` and then announces it in the rendezvous directory as our
own server does. Neither engine can run on a CPU machine: here the generated argv
and requests are tested, and replies in their formats are parsed (`rollout.wire`);
a GPU check has to exercise the real calls.

Weight updates. Both engines read Hugging Face weights, so the directory handed to
`RolloutClient.update_weights` must hold an HF-format checkpoint, not the trainer's
Megatron weights: `rl.weight_sync.HFExportWeightSync` writes one per version
(`moerl hf export <weights_dir> <hf_dir>` does the same by hand).

- sglang: `POST /update_weights_from_disk {"model_path": dir}` (SGLang's documented
  in-place reload; it pauses generation while loading).
- vllm: vLLM has no standard HTTP reload. We use its development endpoints, enabled
  by `VLLM_SERVER_DEV_MODE=1` in the stage's environment (set by `launch_env`):
  `POST /collective_rpc` calls `update_config` on every worker to point the model
  path at the new directory, then `reload_weights` (the worker re-reads the weights
  from that path into the live model), and `POST /reset_prefix_cache` drops KV blocks
  computed with the old weights. Where those endpoints are unavailable, the fallback
  is to restart the server on the new directory.

Flag names of both command lines live in `_FLAGS` only.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from moerl.rollout.config import RolloutStageConfig

Engine = Literal["moerl", "vllm", "sglang"]
VLLM_EXTENSION = "moerl.rollout.vllm_extension.WeightReceiver"
ENGINES: tuple[Engine, ...] = ("moerl", "vllm", "sglang")

# The engines' CLI flags, per logical option (vLLM `vllm serve --help`, SGLang
# `server_args.py`); None: the engine has no such flag.
_FLAGS: dict[str, dict[str, str | None]] = {
    "vllm": {
        "host": "--host", "port": "--port", "tp": "--tensor-parallel-size",
        "pp": "--pipeline-parallel-size",
        "ep": "--enable-expert-parallel",  # a switch: vLLM's EP size is TP x DP
        "dtype": "--dtype", "max_len": "--max-model-len",
        "name": "--served-model-name", "memory": "--gpu-memory-utilization",
    },
    "sglang": {
        "host": "--host", "port": "--port", "tp": "--tp-size", "pp": "--pp-size",
        "ep": "--ep-size",
        "dtype": "--dtype", "max_len": "--context-length",
        "name": "--served-model-name", "memory": "--mem-fraction-static",
    },
}


def check_engine(engine: str) -> Engine:
    """`engine` if known; a ValueError naming `rollout.engine` otherwise."""
    for known in ENGINES:
        if engine == known:
            return known
    raise ValueError(f"rollout.engine: unknown engine {engine!r}; expected one of "
                     f"{', '.join(ENGINES)}")


def engine_argv(rollout: RolloutStageConfig, python: str | None = None) -> tuple[str, ...]:
    """The vLLM or SGLang server command for one replica ({host}/{port} placeholders)."""
    engine = check_engine(rollout.engine)
    if engine == "moerl":
        raise ValueError("rollout.engine: moerl servers are started by `moerl serve rollout`")
    if not rollout.hf_model_dir:
        raise ValueError(f"rollout.hf_model_dir: the {engine} engine serves a Hugging Face "
                         "directory (write one with `moerl hf export`)")
    flags = _FLAGS[engine]

    def opt(key: str, value: object) -> list[str]:
        flag = flags[key]
        return [] if flag is None or value is None else [flag, str(value)]

    if engine == "vllm":
        # moerl's weight receiver in every worker (`rollout.vllm_extension`), for
        # rl.weight_sync=memory; idle otherwise.
        argv = ["vllm", "serve", rollout.hf_model_dir, "--worker-extension-cls", VLLM_EXTENSION]
    else:
        argv = [python or sys.executable, "-m", "sglang.launch_server",
                "--model-path", rollout.hf_model_dir]
    argv += opt("host", "{host}") + opt("port", "{port}") + opt("tp", rollout.tensor_parallel)
    if rollout.pipeline_parallel > 1:
        argv += opt("pp", rollout.pipeline_parallel)
    if rollout.expert_parallel > 1:
        ep = flags["ep"]
        assert ep is not None
        argv += [ep] if engine == "vllm" else [ep, str(rollout.expert_parallel)]
    argv += opt("dtype", rollout.dtype) + opt("max_len", rollout.max_model_len)
    argv += opt("name", rollout.served_model_name)
    argv += opt("memory", rollout.gpu_memory_utilization)
    return tuple(argv)


def launch_env(engine: str) -> dict[str, str]:
    """Environment the engine's server needs beyond the launcher's."""
    if check_engine(engine) == "vllm":
        return {"VLLM_SERVER_DEV_MODE": "1"}  # exposes /collective_rpc for weight reloads
    return {}


@dataclass(frozen=True)
class HttpCall:
    """One POST to a rollout server; a weight update is a sequence of them."""

    path: str
    body: dict[str, Any]


def weight_update_calls(engine: str, path: str | Path, version: int) -> list[HttpCall]:
    """The requests that make a server of `engine` serve the weights in `path`."""
    engine = check_engine(engine)
    directory = str(path)
    if engine == "moerl":
        return [HttpCall("/update_weights", {"path": directory, "version": version})]
    if engine == "sglang":
        return [HttpCall("/update_weights_from_disk",
                         {"model_path": directory, "weight_version": str(version)})]
    return [
        HttpCall("/collective_rpc", {"method": "update_config",
                                     "args": [{"model_config": {"model": directory}}]}),
        HttpCall("/collective_rpc", {"method": "reload_weights"}),
        HttpCall("/reset_prefix_cache", {}),
    ]


def main(argv: list[str] | None = None) -> int:
    """Run an engine's server, announce it once healthy, exit with its status."""
    from moerl.rendezvous import ENV_HOST, ENV_PORT, announce_from_env, wait_healthy

    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--"]:
        args = args[1:]
    if not args:
        print("usage: python -m moerl.rollout.backends -- ENGINE_ARGV", file=sys.stderr)
        return 2
    host = _arg(args, "--host") or os.environ.get(ENV_HOST, "127.0.0.1")
    port = _arg(args, "--port") or os.environ.get(ENV_PORT)
    child = subprocess.Popen(args)

    def stop(signum: int, _frame: FrameType | None) -> None:
        child.send_signal(signum)  # the engine shuts down its own workers

    saved = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}

    def alive() -> None:
        if child.poll() is not None:
            raise RuntimeError(f"{args[0]} exited with status {child.returncode}")

    try:
        if port is not None:
            # Engines load their weights before they listen: allow them an hour.
            wait_healthy(f"{host}:{port}", timeout=3600.0, check=alive)
            announce_from_env(host, int(port))
        return child.wait()
    finally:
        if child.poll() is None:  # not healthy in time, or interrupted: no orphan engine
            child.terminate()
            child.wait()
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def _arg(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv[:-1] else None


if __name__ == "__main__":
    sys.exit(main())
