"""The client against servers that answer as stock vLLM and SGLang do: ids, logprobs,
finish reasons and weight versions parsed; the requests they are sent."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fake_engines import FakeEngine, sglang_output, vllm_choice, vllm_completion

from moerl.rollout.client import RolloutClient, RolloutClientConfig
from moerl.rollout.types import SamplingParams
from moerl.rollout.wire import ReplyError, token_id

FAST = RolloutClientConfig(backoff_base_s=0.01, backoff_cap_s=0.02, timeout_s=10.0)


@pytest.fixture
def servers() -> Iterator[list[FakeEngine]]:
    started: list[FakeEngine] = []
    yield started
    for server in started:
        server.close()


def _client(servers: list[FakeEngine], engine: str, *replies: Any) -> RolloutClient:
    servers.extend(FakeEngine(reply) for reply in replies)
    return RolloutClient([s.url for s in servers], engine=engine, config=FAST)


def _vllm(path: str, body: dict[str, Any]) -> tuple[int, Any]:
    """Two samples per prompt; prompt j's sample i generates [10j + i, 99]."""
    assert path == "/v1/completions"
    choices = []
    for j, prompt in enumerate(body["prompt"]):
        for i in range(body["n"]):
            index = j * body["n"] + i
            ids = [10 * j + i, 99]
            # Odd choices as an older vLLM writes them: ids only as "token_id:N".
            choices.append(vllm_choice(index, ids, [-0.5 - index, -0.25], "length" if i else "stop",
                                       prompt_ids=prompt, with_ids=index % 2 == 0))
    return 200, vllm_completion(list(reversed(choices)))  # order by index, not position


def test_vllm_ids_logprobs_and_finish_reasons(servers: list[FakeEngine]) -> None:
    client = _client(servers, "vllm", _vllm)
    groups = client.generate([[1, 2, 3], [4, 5]], n=2,
                             sampling=SamplingParams(max_tokens=2, top_k=0, stop=("\n",)))
    assert [[s.token_ids for s in g] for g in groups] == [[(0, 99), (1, 99)], [(10, 99), (11, 99)]]
    assert groups[1][1].logprobs == (-3.5, -0.25)
    assert [s.finish_reason for s in groups[0]] == ["stop", "length"]
    assert groups[0][1].prompt_token_ids == (1, 2, 3)  # from the request when the reply omits it
    assert all(s.weight_version == -1 for g in groups for s in g)  # nothing pushed yet
    (_, body), = servers[0].calls
    assert body["return_tokens_as_token_ids"] and body["return_token_ids"]
    assert body["logprobs"] == 1 and body["top_k"] == -1 and body["stop"] == ["\n"]
    assert "logprob_mode" not in body  # not a vLLM field
    client.close()


def test_vllm_seeded_calls_carry_one_prompt_each(servers: list[FakeEngine]) -> None:
    client = _client(servers, "vllm", _vllm)
    client.generate([[1], [2], [3]], n=2, sampling=SamplingParams(seed=40))
    sent = sorted((b["prompt"], b["seed"]) for _, b in servers[0].calls)
    assert sent == [([[1]], 40), ([[2]], 41), ([[3]], 42)]
    client.close()


def test_vllm_reply_without_ids_is_named() -> None:
    assert token_id("token_id:123") == 123
    with pytest.raises(ReplyError, match="return_tokens_as_token_ids"):
        token_id("hello")


def _sglang(version: str) -> Any:
    def reply(path: str, body: dict[str, Any]) -> tuple[int, Any]:
        assert path == "/generate"
        prompts = body.get("input_ids") or body["text"]
        outs = []
        for k, prompt in enumerate(prompts):
            ids = [k, k + 1, 7]
            finish = ({"type": "length", "length": 3} if k % 2 else
                      {"type": "stop", "matched": 7})
            prompt_ids = [ord(c) for c in prompt] if isinstance(prompt, str) else prompt
            outs.append(sglang_output(ids, [-0.1 * k, -0.2, -0.3], finish, version, prompt_ids))
        return 200, outs
    return reply


def test_sglang_generate_parsed_and_each_sample_sent_alone(servers: list[FakeEngine]) -> None:
    client = _client(servers, "sglang", _sglang("5"))
    groups = client.generate([[1, 2], [3]], n=2, sampling=SamplingParams(seed=9, top_k=0))
    assert [[s.token_ids for s in g] for g in groups] == [[(0, 1, 7), (1, 2, 7)],
                                                          [(2, 3, 7), (3, 4, 7)]]
    assert groups[1][0].logprobs == pytest.approx((-0.2, -0.2, -0.3))
    assert [s.finish_reason for s in groups[0]] == ["stop", "length"]
    assert groups[1][1].prompt_token_ids == (3,) and groups[1][1].weight_version == 5
    (_, body), = servers[0].calls
    assert body["input_ids"] == [[1, 2], [1, 2], [3], [3]]  # n copies, prompt-major
    assert body["return_logprob"] and body["logprob_start_len"] == -1
    params = body["sampling_params"]
    assert all(p["n"] == 1 and p["top_k"] == -1 for p in params)
    assert len({p["sampling_seed"] for p in params}) == 4  # no two samples alike
    client.close()


def test_sglang_text_prompts_get_their_ids_back(servers: list[FakeEngine]) -> None:
    client = _client(servers, "sglang", _sglang("default"))
    (sample,), = client.generate(["hi"])
    assert sample.prompt_token_ids == (ord("h"), ord("i"))
    assert sample.weight_version == -1  # "default" is not a version we pushed
    (_, body), = servers[0].calls
    assert body["text"] == ["hi"] and body["logprob_start_len"] == 0
    with pytest.raises(ValueError, match="mix text and token-id"):
        client.generate(["hi", [1, 2]])
    client.close()


def test_an_aborted_request_is_asked_again_elsewhere(servers: list[FakeEngine]) -> None:
    def aborts(path: str, body: dict[str, Any]) -> tuple[int, Any]:
        return 200, [sglang_output([], [], {"type": "abort", "message": "weights updating"})]

    client = _client(servers, "sglang", aborts, _sglang("3"))
    for _ in range(3):  # whichever server is picked first, the answer comes from the other
        (sample,), = client.generate([[1]])
        assert sample.token_ids == (0, 1, 7) and sample.weight_version == 3
    assert client.dead == set()  # an abort is not the server's failure
    client.close()


def test_malformed_replies_name_the_field(servers: list[FakeEngine]) -> None:
    def no_logprobs(path: str, body: dict[str, Any]) -> tuple[int, Any]:
        choice = vllm_choice(0, [1], [-1.0], "stop") | {"logprobs": None}
        return 200, {"id": "cmpl-1", "object": "text_completion", "model": "policy",
                     "choices": [choice], "usage": {}}

    client = _client(servers, "vllm", no_logprobs)
    with pytest.raises(ReplyError, match=r"choices\[0\]\.logprobs is missing"):
        client.generate([[1]])
    client.close()
