"""The continuous engine against the model's own forward and plain uncached loops: equal
logits through the paged cache (MLA's absorbed latent cache and GQA's per-group cache),
chunked prefill, preemption, shared prompts prefilled once, requests joining between
steps, and the cache's bytes per token."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from conftest import full_logits, greedy_no_cache
from megatron.core.models.gpt import GPTModel

from moerl.models.arch import KIMI_K2, TINY
from moerl.rollout.continuous_decode import ContinuousDecoder, ContinuousOptions
from moerl.rollout.engine import MegatronEngine
from moerl.rollout.kv_size import kv_bytes_per_token
from moerl.rollout.paged_cache import CacheSpec, PagedKVCache
from moerl.rollout.sampling import RowSampling
from moerl.rollout.serving_model import ServingModel
from moerl.rollout.static_decode import DecodeRow
from moerl.rollout.step_plan import Segment, plan_step
from moerl.rollout.types import GenerationRequest, Sample, SamplingParams

GQA = TINY.replace(attention="gqa", num_query_groups=2)


@pytest.fixture(scope="module")
def gqa_model(engine: MegatronEngine) -> Iterator[GPTModel]:  # `engine`: the parallel state
    from moerl.models.build import build_model
    from moerl.parallel.layout import ParallelLayout

    torch.manual_seed(11)
    (model,) = build_model(GQA, ParallelLayout())
    yield model.eval()


def _prompts(*lengths: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in lengths]


def _cache(model: GPTModel, blocks: int, block_size: int) -> PagedKVCache:
    return PagedKVCache(CacheSpec.of_model(model), len(model.decoder.layers), blocks,
                        block_size, torch.float32, "cpu")


@pytest.mark.parametrize("kind", ["mla", "gqa", "mla_sliced", "gqa_sliced"])
def test_paged_forward_gives_the_models_logits(kind: str, model: GPTModel, gqa_model: GPTModel,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    net = model if kind.startswith("mla") else gqa_model
    if kind.endswith("sliced"):  # queries of a chunk in runs of a few positions
        monkeypatch.setattr("moerl.rollout.paged_attention._SCORES_LIMIT", 500)
    cache = _cache(net, 64, 4)
    serving = ServingModel(net, cache)
    table = torch.zeros(3, 16, dtype=torch.long)
    for row in range(3):
        blocks = cache.pool.allocate(16)
        assert blocks is not None
        cache.zero_blocks(blocks)
        table[row] = torch.tensor(blocks)
    prompts = _prompts(13, 5, 30)
    # Step 1: a prompt's first chunk beside whole prompts; step 2: the chunks' rest and a
    # decode token, in one forward.
    steps = [[Segment(0, 0, prompts[0][:7]), Segment(1, 0, prompts[1]),
              Segment(2, 0, prompts[2][:20])],
             [Segment(0, 7, prompts[0][7:]), Segment(1, 5, [7]), Segment(2, 20, prompts[2][20:])]]
    got: dict[int, list[torch.Tensor]] = {0: [], 1: [], 2: []}
    with torch.inference_mode():
        for segments in steps:
            plan = plan_step(segments, table, 4)
            logits = serving.forward(plan, torch.arange(plan.num_tokens))
            start = 0
            for seg in plan.segments:
                got[seg.row].append(logits[start: start + len(seg.tokens)])
                start += len(seg.tokens)
    for row, prompt in enumerate(prompts):
        sequence = prompt + ([7] if row == 1 else [])
        want = full_logits(net, torch.tensor([sequence]))[0]
        assert (torch.cat(got[row]) - want).abs().max().item() < 1e-5, (kind, row)


def test_cache_holds_mlas_latent_bytes_per_token(engine: MegatronEngine,
                                                 gqa_model: GPTModel) -> None:
    assert engine.backend == "continuous" and engine.continuous is not None
    cache = engine.continuous.blocks.cache
    latent = TINY.num_layers * (TINY.kv_lora_rank + TINY.qk_pos_emb_head_dim) * 4  # fp32
    assert cache.bytes_per_token == latent == kv_bytes_per_token(TINY, torch.float32)
    per_head = TINY.num_layers * TINY.num_attention_heads * (
        TINY.qk_head_dim + TINY.qk_pos_emb_head_dim + TINY.v_head_dim) * 4
    assert cache.bytes_per_token < per_head  # what a per-head cache (the static one) holds
    gqa = _cache(gqa_model, 4, 16)
    assert gqa.bytes_per_token == kv_bytes_per_token(GQA, "float32") == 4 * 2 * 2 * 32 * 4
    # Kimi-K2 in bf16: 61 layers x (512 + 64) x 2 bytes, whatever the tensor parallelism.
    assert kv_bytes_per_token(KIMI_K2, "bfloat16") == kv_bytes_per_token(KIMI_K2, 2, tp=8) \
        == 61 * 576 * 2


def _greedy_rows(prompts: list[list[int]], budgets: list[int]) -> list[DecodeRow]:
    return [DecodeRow(p, RowSampling.make(SamplingParams(max_tokens=b, temperature=0,
                                                         ignore_eos=True), 0, 0))
            for p, b in zip(prompts, budgets, strict=True)]


def test_chunks_small_blocks_and_preemption_keep_greedy_tokens(model: GPTModel) -> None:
    prompts, budgets = _prompts(13, 5, 30, 3), [12, 5, 9, 20]
    cache = _cache(model, 26, 2)  # 50 slots for 139 tokens: rows must be preempted
    decoder = ContinuousDecoder(model, cache, None, lambda ids: "",
                                ContinuousOptions(step_tokens=8, block_size=2, max_rows=4))
    rows = _greedy_rows(prompts, budgets)
    decoder.decode(rows)
    for row, prompt, budget in zip(rows, prompts, budgets, strict=True):
        assert row.token_ids == greedy_no_cache(model, prompt, budget)
    assert decoder.prefill_tokens > sum(map(len, prompts))  # a preempted row re-read its own
    assert cache.pool.free == cache.pool.usable and not decoder.has_work()


def _counted(engine: MegatronEngine, requests: list[GenerationRequest]
             ) -> tuple[list[list[Sample]], tuple[int, int]]:
    """The samples, and the forwards that read prompt tokens and those tokens."""
    decoder = engine.continuous
    assert decoder is not None
    before = (decoder.prefill_forwards, decoder.prefill_tokens)
    groups = engine.generate(requests)
    return groups, (decoder.prefill_forwards - before[0], decoder.prefill_tokens - before[1])


def _prompt_routing(sample: Sample) -> torch.Tensor:
    assert sample.routed_experts is not None
    ids = torch.frombuffer(bytearray(sample.routed_experts.ids), dtype=torch.uint8)
    return ids.view(sample.routed_experts.shape)[:, : len(sample.prompt_token_ids)]


def test_a_group_of_copies_is_prefilled_once(engine: MegatronEngine) -> None:
    (prompt,) = _prompts(37, seed=4)
    params = SamplingParams(max_tokens=6, n=8, seed=3, ignore_eos=True,
                            return_routed_experts=True)
    (group,), counted = _counted(engine, [GenerationRequest(tuple(prompt), params)])
    assert counted == (1, len(prompt))
    assert len({s.token_ids for s in group}) > 1  # each copy samples on its own
    routing = [_prompt_routing(s) for s in group]  # the prompt's, handed to every copy
    assert all(torch.equal(r, routing[0]) for r in routing)
    # Identical prompts in separate requests of one call share too; each answers as alone.
    greedy = SamplingParams(max_tokens=5, seed=9, temperature=0.0)
    alone = engine.generate([GenerationRequest(tuple(prompt), greedy)])[0][0]
    pair, counted = _counted(engine, [GenerationRequest(tuple(prompt), greedy)] * 2)
    assert counted == (1, len(prompt))
    assert [g[0].token_ids for g in pair] == [alone.token_ids] * 2


def test_a_request_joins_between_steps_and_leaves_when_done(engine: MegatronEngine) -> None:
    long_p, short_p = _prompts(9, 21, seed=5)
    greedy = {"temperature": 0.0, "ignore_eos": True}
    long_req = GenerationRequest(tuple(long_p), SamplingParams(max_tokens=40, **greedy))  # type: ignore[arg-type]
    short_req = GenerationRequest(tuple(short_p), SamplingParams(max_tokens=4, **greedy))  # type: ignore[arg-type]
    results: dict[str, list[list[Sample]]] = {}
    engine.start([long_req], lambda groups: results.__setitem__("long", groups))
    for _ in range(10):
        engine.step()
    engine.start([short_req], lambda groups: results.__setitem__("short", groups))
    while "short" not in results:
        engine.step()
    assert "long" not in results  # the long one is still running beside it
    while engine.busy():
        engine.step()
    assert results["long"][0][0].token_ids == tuple(greedy_no_cache(engine.model, long_p, 40))
    assert results["short"][0][0].token_ids == tuple(greedy_no_cache(engine.model, short_p, 4))
