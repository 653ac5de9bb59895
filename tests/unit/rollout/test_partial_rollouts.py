"""Partial rollouts: a weight update lands between two decode steps of a running batch
(the generation is neither thrown away nor waited for), every token records the version
that sampled it, the record crosses the wire, and the trainer masks tokens past the
staleness bound per token."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from megatron.core.models.gpt import GPTModel

from moerl.config import load_run_config
from moerl.data.rl_batch import RLSample
from moerl.data.tokenizer import ByteTokenizer
from moerl.models.arch import TINY
from moerl.models.build import build_model
from moerl.models.weights import save_weights
from moerl.parallel.layout import ParallelLayout
from moerl.rl.batch import Batch
from moerl.rl.loop import drop_stale
from moerl.rollout.batching import BatchScheduler
from moerl.rollout.engine import EngineOptions, MegatronEngine
from moerl.rollout.openai_api import CompletionBody, to_response
from moerl.rollout.types import GenerationRequest, Sample, SamplingParams
from moerl.rollout.wire import parse_samples
from moerl.typed_config import ConfigError

PROMPT = (5, 17, 42, 9)


@pytest.fixture
def fresh_model(engine: MegatronEngine) -> GPTModel:  # `engine` sets up the parallel state
    torch.manual_seed(99)
    (model,) = build_model(TINY, ParallelLayout())
    return model


@pytest.fixture
def partial(fresh_model: GPTModel) -> Iterator[tuple[MegatronEngine, BatchScheduler]]:
    engine = MegatronEngine(fresh_model, ByteTokenizer(), TINY.max_position_embeddings,
                            EngineOptions(max_batch=8, backend="static", partial_rollouts=True))
    scheduler = BatchScheduler(engine, max_batch=8, wait_s=0.0, partial=True)
    yield engine, scheduler
    scheduler.close()


def _greedy(n: int) -> GenerationRequest:
    return GenerationRequest(PROMPT, SamplingParams(max_tokens=120, temperature=0.0, n=n,
                                                    ignore_eos=True, seed=0))


def test_an_update_lands_mid_generation_and_every_token_has_its_version(
        partial: tuple[MegatronEngine, BatchScheduler], other_weights: Path,
        fresh_model: GPTModel, tmp_path: Path) -> None:
    engine, scheduler = partial
    before = save_weights([fresh_model], tmp_path / "v0")
    alone = scheduler.submit([_greedy(2)]).result(timeout=120)[0][0]  # v0 throughout

    steps = 0
    hook = engine.between_steps
    assert hook is not None

    def counting() -> None:
        nonlocal steps
        steps += 1
        hook()

    engine.between_steps = counting
    running = scheduler.submit([_greedy(2)])
    while steps < 20:
        assert not running.done()
        time.sleep(0.01)
    update = scheduler.submit_update(other_weights, 1)
    assert update.result(timeout=60) == 1
    assert not running.done(), "the update waited for the generation to end"
    samples = _through_the_wire(running.result(timeout=120))
    for sample in samples:
        versions = sample.versions
        switch = versions.index(1)
        assert set(versions[:switch]) == {0} and set(versions[switch:]) == {1}
        assert 20 <= switch < len(versions)  # from the next token after the update on
        assert sample.weight_version == 0  # the first token's
        assert sample.token_ids[:switch] == alone.token_ids[:switch]  # v0's greedy tokens
        assert sample.token_ids[switch:] != alone.token_ids[switch:]  # then the new weights'
    assert engine.weight_version == 1
    scheduler.submit_update(before, 2).result(timeout=60)


def test_the_continuous_engine_takes_an_update_between_two_steps(
        fresh_model: GPTModel, other_weights: Path, tmp_path: Path) -> None:
    """What its scheduler does with partial rollouts, step by step."""
    engine = MegatronEngine(fresh_model, ByteTokenizer(), TINY.max_position_embeddings,
                            EngineOptions(backend="continuous", partial_rollouts=True,
                                          kv_cache_gb=0.01))
    before = save_weights([fresh_model], tmp_path / "v0")
    alone = engine.generate([_greedy(1)])[0][0]  # v0 throughout
    results: list[list[list[Sample]]] = []
    engine.start([_greedy(2)], results.append)
    for _ in range(20):  # the prompt and 19 more tokens
        engine.step()
    engine.load_weights(other_weights, 1)
    while engine.busy():
        engine.step()
    for sample in _through_the_wire(results[0]):
        assert sample.versions == (0,) * 20 + (1,) * 100
        assert sample.weight_version == 0  # the first token's
        assert sample.token_ids[:20] == alone.token_ids[:20]  # v0's greedy tokens
        assert sample.token_ids[20:] != alone.token_ids[20:]  # then the new weights'
    engine.load_weights(before, 2)


@pytest.mark.parametrize("backend", ["static", "continuous"])
def test_without_partial_rollouts_an_update_waits_for_the_batch(
        fresh_model: GPTModel, other_weights: Path, backend: str) -> None:
    from moerl.rollout.server import make_scheduler

    engine = MegatronEngine(fresh_model, ByteTokenizer(), TINY.max_position_embeddings,
                            EngineOptions(max_batch=8, backend=backend,  # type: ignore[arg-type]
                                          kv_cache_gb=0.01))
    scheduler = make_scheduler(engine, batch_wait_s=0.0)
    try:
        running = scheduler.submit([_greedy(1)])
        time.sleep(0.2)
        scheduler.submit_update(other_weights, 1).result(timeout=120)
        ((sample,),) = running.result(timeout=1)  # done before the update ran
        assert sample.token_versions is None and sample.versions == (0,) * 120
    finally:
        scheduler.close()


def _through_the_wire(groups: list[list[Sample]]) -> list[Sample]:
    reply = to_response(groups, CompletionBody(prompt=[1]), "tiny", ByteTokenizer())
    samples = parse_samples(reply)
    assert [s.token_versions for s in samples] == [s.token_versions for g in groups for s in g]
    return samples


def _sample(versions: list[int], mask: list[float] | None = None) -> RLSample:
    return RLSample(torch.tensor([1, 2]), torch.tensor([3] * len(versions)), 1.0,
                    weight_version=versions[0],
                    token_versions=torch.tensor(versions) if len(set(versions)) > 1 else None,
                    loss_mask=None if mask is None else torch.tensor(mask))


def test_tokens_past_the_staleness_bound_are_masked_per_token() -> None:
    batch = Batch([_sample([3, 3, 4, 4]), _sample([3, 3, 3]), _sample([4, 4]),
                   _sample([3, 4, 5], mask=[1.0, 1.0, 0.0])])
    out = drop_stale(batch, version=5, max_staleness=1)
    assert len(out.samples) == 3  # the all-v3 sample has no fresh token
    assert out.samples[0].loss_mask is not None
    assert out.samples[0].loss_mask.tolist() == [0.0, 0.0, 1.0, 1.0]
    assert out.samples[1].loss_mask is None  # all fresh: untouched
    assert out.samples[2].loss_mask.tolist() == [0.0, 1.0, 0.0]  # its own mask kept
    m = out.metrics
    assert m["async/dropped_stale"] == 1 and m["async/spanning_versions"] == 2
    assert m["async/masked_stale_tokens"] == 3
    assert m["async/staleness_max_collected"] == 2 and m["async/staleness_max_trained"] == 1


@pytest.mark.parametrize(("overrides", "message"), [
    ([], "set rl.mode=async"),
    (["rl.mode=async", "rollout.speculative=ngram"], "rollout.speculative=none"),
    (["rl.mode=async", "rollout.pipeline_parallel=2"], "set rollout.pipeline_parallel=1"),
    (["rl.mode=async", "rollout.expert_parallel=2", "rollout.backend=static"],
     "rollout.backend=continuous"),
])  # fmt: skip
def test_partial_rollouts_are_refused_where_no_update_can_land_mid_batch(
        overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_run_config(["rollout.partial_rollouts=true", *overrides], world_size=1)
    load_run_config(["rollout.partial_rollouts=true", "rl.mode=async"], world_size=1)
    load_run_config(["rollout.partial_rollouts=true", "rl.mode=async",  # continuous, EP2
                     "rollout.expert_parallel=2"], world_size=1)


def test_the_server_flag_reaches_the_rollout_command(tmp_path: Path) -> None:
    from moerl.launchers.plan import build_run_plan

    overrides = ["rollout.partial_rollouts=true", "rl.mode=async"]
    cfg = load_run_config(overrides, world_size=1)
    plan = build_run_plan(tmp_path, overrides, cfg.launcher, cfg.rollout, cfg.rewards,
                          tmp_path / "arch.json")
    (rollout,) = [s for s in plan.stages if s.name == "rollout"]
    assert "--partial-rollouts" in rollout.argv("127.0.0.1", 0, 0)
