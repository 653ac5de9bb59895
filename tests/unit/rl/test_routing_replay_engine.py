"""Routing replay end to end: the rollout engine returns the experts each MoE layer
chose, they cross the server's wire format, and the trainer's forward routes through
them, so a router that moved between rollout and update (here its expert bias, which
decides the choice and not the gate weights) leaves the engine/trainer logprob gap at
the recompute noise; without replay the gap is large."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from megatron.core.transformer.moe import moe_logging
from policy_logprobs import completion_logprobs

from moerl.data.rl_batch import RLSample
from moerl.data.tokenizer import ByteTokenizer
from moerl.models.arch import TINY
from moerl.models.build import build_model
from moerl.models.routers import decoder_routers
from moerl.models.weights import load_weights
from moerl.parallel.groups import ParallelGroups, destroy_parallel, init_parallel
from moerl.parallel.layout import ParallelLayout
from moerl.rl.config import RLConfig
from moerl.rl.losses import GRPOConfig
from moerl.rl.policy import Policy
from moerl.rl.scoring import routed_tensor
from moerl.rollout.engine import EngineOptions, MegatronEngine
from moerl.rollout.openai_api import CompletionBody, to_response
from moerl.rollout.speculative.config import SpeculativeConfig
from moerl.rollout.types import GenerationRequest, RequestError, Sample, SamplingParams
from moerl.rollout.wire import generation_call, parse_samples
from moerl.trainer.config import OptimConfig


@pytest.fixture(scope="module")
def policy() -> Iterator[Policy]:
    groups: ParallelGroups = init_parallel(ParallelLayout(), seed=3)
    moe_logging.destroy_moe_metrics_tracker()
    torch.manual_seed(5)
    yield Policy.build(TINY, groups.layout, OptimConfig(lr=1e-3, min_lr=0.0, clip_grad=0.0),
                       groups, RLConfig(objective_args=GRPOConfig(kl_coef=0.0), token_budget=256,
                                        use_reference=False, routing_replay=True))
    destroy_parallel()


def _engine(policy: Policy, tmp_path: Path, backend: str = "static") -> MegatronEngine:
    weights = policy.publish(tmp_path / "v0")
    (model,) = build_model(TINY, policy.groups.layout)
    load_weights([model], weights)
    return MegatronEngine(model, ByteTokenizer(), TINY.max_position_embeddings,
                          EngineOptions(backend=backend, kv_cache_gb=0.01))  # type: ignore[arg-type]


def _through_the_wire(groups: list[list[Sample]]) -> list[Sample]:
    reply = to_response(groups, CompletionBody(prompt=[1]), "tiny", ByteTokenizer())
    return parse_samples(reply)


def _gap(policy: Policy, samples: list[Sample], replay: bool) -> float:
    rl = [RLSample(torch.tensor(s.prompt_token_ids), torch.tensor(s.token_ids), 0.0,
                   routed_experts=routed_tensor(s) if replay else None) for s in samples]
    trainer = completion_logprobs(policy, rl)
    return max(float((lp - torch.tensor(s.logprobs)).abs().max())
               for lp, s in zip(trainer, samples, strict=True))


@pytest.mark.parametrize("backend", ["continuous", "static"])
def test_replayed_engine_routing_keeps_the_gap_at_noise(policy: Policy, tmp_path: Path,
                                                        backend: str) -> None:
    engine = _engine(policy, tmp_path, backend)
    gen = torch.Generator().manual_seed(0)
    # Eight rows, one of them done early: it stays in the batch (not yet compacted)
    # while the others go on, and its routing must end where its tokens do.
    requests = [GenerationRequest(tuple(torch.randint(1, 200, (5 + i % 3,),
                                                      generator=gen).tolist()),
                                  SamplingParams(max_tokens=3 if i == 5 else 10, seed=7 + i,
                                                 ignore_eos=True, return_routed_experts=True))
                for i in range(8)]
    samples = _through_the_wire(engine.generate(requests))
    moe_layers = sum(TINY.is_moe_layer(i) for i in range(TINY.num_layers))
    for s in samples:
        assert s.routed_experts is not None
        positions = len(s.prompt_token_ids) + len(s.token_ids) - 1
        assert s.routed_experts.shape == (moe_layers, positions, TINY.moe_router_topk)
    noise = _gap(policy, samples, replay=True)
    assert noise < 1e-4  # the same weights: replay or not, the recompute's own noise
    assert _gap(policy, samples, replay=False) < 1e-4

    routers = decoder_routers(policy.chunks)
    saved = {n: r.expert_bias.clone() for n, r in routers.items()}
    try:
        perturb = torch.Generator().manual_seed(1)
        for router in routers.values():  # moves which experts win, not their gate weights
            router.expert_bias += 5.0 * torch.randn(router.expert_bias.shape, generator=perturb)
        free, replayed = _gap(policy, samples, replay=False), _gap(policy, samples, replay=True)
    finally:
        for n, router in routers.items():
            router.expert_bias.copy_(saved[n])
    assert free > 0.05, free
    assert replayed < max(2 * noise, 1e-5), (replayed, noise)


def test_routing_is_returned_only_when_asked_and_refused_where_it_cannot_be(
        policy: Policy, tmp_path: Path) -> None:
    engine = _engine(policy, tmp_path)
    (plain,), = engine.generate([GenerationRequest((3, 4, 5), SamplingParams(max_tokens=3))])
    assert plain.routed_experts is None
    speculative = MegatronEngine(engine.model, ByteTokenizer(), TINY.max_position_embeddings,
                                 EngineOptions(backend="static",
                                               speculative=SpeculativeConfig(mode="ngram")))
    with pytest.raises(RequestError, match=r"return_routed_experts: .*static backend"):
        speculative.generate([GenerationRequest((3, 4),
                                                SamplingParams(return_routed_experts=True))])
    for engine_name in ("vllm", "sglang"):
        with pytest.raises(ValueError, match=rf"rollout\.engine={engine_name} does not return"):
            generation_call(engine_name, [[3, 4]], SamplingParams(return_routed_experts=True),
                            seed=0)


@pytest.mark.parametrize(("overrides", "message"), [
    (["rollout.engine=vllm", "rollout.hf_model_dir=/m", "tokenizer=hf", "tokenizer.path=/m"],
     "rollout.engine=vllm does not return"),
    (["rollout.backend=dynamic"], "rollout.backend=continuous"),
    (["rollout.speculative=ngram"], "rollout.speculative=none"),
    (["rollout.pipeline_parallel=2"], "rollout.pipeline_parallel=1"),
    (["rl.task_source=agent"], "an episode's turns"),
    (["domain=[code,terminal]", "data.source=mixture", "+data.mixture={code:1,terminal:1}"],
     "agent episodes"),
])  # fmt: skip
def test_routing_replay_is_refused_where_no_engine_returns_routing(
        overrides: list[str], message: str) -> None:
    from moerl.config import load_run_config
    from moerl.typed_config import ConfigError

    with pytest.raises(ConfigError, match=re.escape(message)):
        load_run_config(["rl.routing_replay=true", *overrides], world_size=1)
    load_run_config(["rl.routing_replay=true"], world_size=1)  # the default engine: accepted
