"""The Megatron engine against plain uncached loops over the same model."""

from __future__ import annotations

import torch
from conftest import full_logits, greedy_no_cache
from megatron.core.models.gpt import GPTModel

from moerl.rollout.engine import MegatronEngine
from moerl.rollout.types import GenerationRequest, SamplingParams

PROMPTS = [list(b"Hello there"), list(b"Hi"), list(b"The quick brown fox jumps")]


def _run(engine: MegatronEngine, prompt: list[int], **kwargs: object) -> list:
    sampling = SamplingParams(**kwargs)  # type: ignore[arg-type]
    return engine.generate([GenerationRequest(tuple(prompt), sampling)])[0]


def test_greedy_matches_uncached_loop_in_a_mixed_batch(engine: MegatronEngine,
                                                        model: GPTModel) -> None:
    # Different prompt lengths and budgets in one batch: prompt reading, early
    # finishers and KV-cache compaction all happen.
    budgets = [12, 5, 9]
    requests = [
        GenerationRequest(tuple(p), SamplingParams(max_tokens=m, temperature=0, ignore_eos=True))
        for p, m in zip(PROMPTS, budgets, strict=True)
    ]
    groups = engine.generate(requests)
    for prompt, budget, (sample,) in zip(PROMPTS, budgets, groups, strict=True):
        assert list(sample.token_ids) == greedy_no_cache(model, prompt, budget)
        assert sample.finish_reason == "length"
        assert list(sample.prompt_token_ids) == prompt


def test_logprobs_equal_full_forward_log_softmax(engine: MegatronEngine, model: GPTModel) -> None:
    for mode, temperature in (("policy", 0.7), ("sampling", 0.7), ("policy", 0.0)):
        sample = _run(engine, PROMPTS[0], max_tokens=10, temperature=temperature, seed=3,
                      logprob_mode=mode, ignore_eos=True)[0]
        tokens = torch.tensor([PROMPTS[0] + list(sample.token_ids)])
        logits = full_logits(model, tokens[:, :-1])[0, len(PROMPTS[0]) - 1 :]  # [N, V]
        scale = temperature if mode == "sampling" and temperature > 0 else 1.0
        expected = torch.log_softmax(logits / scale, -1).gather(
            1, torch.tensor(sample.token_ids)[:, None]).squeeze(1)
        got = torch.tensor(sample.logprobs)
        assert (got - expected).abs().max().item() < 1e-5, mode


def test_seed_reproducible_and_samples_differ(engine: MegatronEngine) -> None:
    kwargs = {"max_tokens": 8, "temperature": 1.0, "n": 3, "ignore_eos": True}
    first = _run(engine, PROMPTS[1], seed=7, **kwargs)
    again = _run(engine, PROMPTS[1], seed=7, **kwargs)
    other = _run(engine, PROMPTS[1], seed=8, **kwargs)
    assert [s.token_ids for s in first] == [s.token_ids for s in again]
    assert [s.token_ids for s in first] != [s.token_ids for s in other]
    assert len({s.token_ids for s in first}) > 1  # the n samples of a request differ
    # The same request inside a bigger batch draws the same tokens.
    mixed = engine.generate([
        GenerationRequest(tuple(PROMPTS[2]), SamplingParams(max_tokens=4, seed=1)),
        GenerationRequest(tuple(PROMPTS[1]), SamplingParams(seed=7, **kwargs)),  # type: ignore[arg-type]
    ])[1]
    assert [s.token_ids for s in mixed] == [s.token_ids for s in first]


def test_stop_token_stop_string_and_length(engine: MegatronEngine) -> None:
    greedy = _run(engine, PROMPTS[0], max_tokens=12, temperature=0, ignore_eos=True)[0]
    stop_id = greedy.token_ids[4]
    first = greedy.token_ids.index(stop_id)
    by_id = _run(engine, PROMPTS[0], max_tokens=12, temperature=0, stop_token_ids=(stop_id,))[0]
    assert by_id.finish_reason == "stop" and by_id.token_ids == greedy.token_ids[: first + 1]

    # A random model writes few printable bytes: sample a long completion, then stop
    # the same seeded request at a character it wrote.
    kwargs = {"max_tokens": 40, "seed": 11, "ignore_eos": True}
    free = _run(engine, PROMPTS[0], **kwargs)[0]
    text = free.text
    stop = next(ch for ch in text[1:] if ch.isprintable() and ch != "\ufffd")
    by_text = _run(engine, PROMPTS[0], stop=(stop, "never-written"), **kwargs)[0]
    assert by_text.finish_reason == "stop"
    assert by_text.text == text[: text.index(stop)]
    assert by_text.token_ids == free.token_ids[: len(by_text.token_ids)]
    assert stop in engine.tokenizer.decode(list(by_text.token_ids))

    short = _run(engine, PROMPTS[0], max_tokens=3, temperature=0, ignore_eos=True)[0]
    assert short.finish_reason == "length" and len(short.token_ids) == 3


def test_top_k_one_is_greedy_and_every_result_has_the_version(engine: MegatronEngine) -> None:
    greedy = _run(engine, PROMPTS[2], max_tokens=6, temperature=0, ignore_eos=True)[0]
    top1 = _run(engine, PROMPTS[2], max_tokens=6, temperature=1.3, top_k=1, seed=5,
                ignore_eos=True)[0]
    assert top1.token_ids == greedy.token_ids
    assert top1.weight_version == greedy.weight_version == engine.weight_version
