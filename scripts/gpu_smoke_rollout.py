"""GPU smoke checks of the rollout backends (run by scripts/gpu_smoke.py).

- Our server on Megatron's dynamic inference engine (paged KV cache, continuous
  batching, chunked prefill, prefix caching, CUDA graphs; CUDA + flash attention
  only): the `tiny` model is built as `moerl serve rollout` builds it (layers built
  for CUDA graphs), prompts go through the HTTP app, its continuous scheduler and the
  wire format the RL client uses, and the greedy tokens must equal those of the
  continuous engine (the CPU path) on the same weights; a group of 8 copies of a
  prompt is answered.
- vLLM / SGLang: the command lines the launcher would run for them, and whether
  the packages are importable here. Running them needs a Hugging Face checkpoint
  and their own install; weight updates to them are covered by the unit tests
  against servers that answer in their formats.
"""

from __future__ import annotations

import importlib.util
import shlex
import traceback

from moerl.rollout.backends import engine_argv, launch_env
from moerl.rollout.config import RolloutStageConfig

PROMPTS = ("def add(a, b):", "The capital of France is", "1, 2, 3, 5, 8,", "x")


def print_engine_commands(hf_dir: str = "/path/to/hf_export") -> None:
    """The vLLM and SGLang argv (host/port filled in) the launcher would start."""
    for engine in ("vllm", "sglang"):
        cfg = RolloutStageConfig(engine=engine, hf_model_dir=hf_dir, tensor_parallel=1,
                                 expert_parallel=1, served_model_name="policy")
        argv = [a.format(host="127.0.0.1", port=8000) for a in engine_argv(cfg)]
        env = " ".join(f"{k}={v}" for k, v in launch_env(engine).items())
        found = "installed" if importlib.util.find_spec(engine) else "not installed here"
        print(f"{engine:>10}: ({found}) {env + ' ' if env else ''}{shlex.join(argv)}")


def dynamic_engine_check(max_tokens: int = 24) -> bool:
    """Greedy generation through our server on Megatron's dynamic engine (continuous
    batching, chunked prefill, prefix caching, CUDA graphs) equals the continuous
    engine's on the same weights, and a group of 8 copies of one prompt is served."""
    from fastapi.testclient import TestClient

    from moerl.data.tokenizer import ByteTokenizer
    from moerl.parallel.groups import destroy_parallel
    from moerl.rollout.dynamic_decode import dynamic_missing
    from moerl.rollout.engine import EngineOptions, MegatronEngine, build_engine
    from moerl.rollout.server import ServerState, create_app, make_scheduler
    from moerl.rollout.types import GenerationRequest, SamplingParams
    from moerl.rollout.wire import generation_call, parse_generation

    missing = dynamic_missing()
    if missing is not None:
        print(f"{'dynamic':>10}: could not run: {missing}")
        return False
    tok = ByteTokenizer()
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    prompts = [[tok.bos_id, *tok.encode(p)] if tok.bos_id is not None else tok.encode(p)
               for p in PROMPTS]
    try:
        dynamic = build_engine("tiny", tok, seed=0,
                               options=EngineOptions(max_batch=8, backend="dynamic"))
        continuous = MegatronEngine(dynamic.model, tok, dynamic.max_sequence_length,
                                    EngineOptions(max_batch=8, backend="continuous",
                                                  kv_cache_gb=1.0))
        scheduler = make_scheduler(dynamic)
        call = generation_call("moerl", prompts, greedy, seed=0)
        with TestClient(create_app(ServerState(dynamic, scheduler, "tiny", 60.0))) as http:
            assert http.get("/health").json()["backend"] == "dynamic"
            reply = http.post(call.path, json=call.body)
            reply.raise_for_status()
            served = parse_generation("moerl", call, reply.json(), -1)
            group = http.post("/v1/completions", json={"prompt": prompts[0], "n": 8,
                                                       "max_tokens": 8, "seed": 1})
            group.raise_for_status()
            copies = len(group.json()["choices"])
        scheduler.close()
        want = continuous.generate([GenerationRequest(tuple(p), greedy) for p in prompts])
    except Exception as err:
        print(f"{'dynamic':>10}: could not run: {type(err).__name__}: {err}")
        traceback.print_exc(limit=5)
        return False
    finally:
        destroy_parallel()
    same = 0
    for prompt, got, (ref,) in zip(PROMPTS, served, want, strict=True):
        if got.token_ids == ref.token_ids:
            same += 1
            continue
        at = next((i for i, (a, b) in enumerate(zip(got.token_ids, ref.token_ids, strict=False))
                   if a != b), min(len(got.token_ids), len(ref.token_ids)))
        print(f"{'dynamic':>10}: {prompt!r}: differs from continuous at token {at}: "
              f"{got.token_ids[at:at + 4]} vs {ref.token_ids[at:at + 4]}")
    gap = max((abs(a - b) for got, (ref,) in zip(served, want, strict=True)
               for a, b in zip(got.logprobs, ref.logprobs, strict=False)), default=0.0)
    print(f"{'dynamic':>10}: greedy tokens equal to the continuous engine's for "
          f"{same}/{len(PROMPTS)} prompts; max |logprob gap| {gap:.2e}; a group of 8 "
          f"copies answered with {copies} samples")
    return same == len(PROMPTS) and copies == 8
