"""Request parsing (OpenAI shape -> engine requests) and the client's retry rules."""

from __future__ import annotations

import json
import threading

import httpx
import pytest
from pydantic import ValidationError

from moerl.data.tokenizer import ByteTokenizer
from moerl.rollout.client import RolloutClient, RolloutClientConfig, RolloutUnavailable
from moerl.rollout.openai_api import CompletionBody, to_requests
from moerl.rollout.types import RequestError, SamplingParams

TOK = ByteTokenizer()


def _parse(**body: object) -> list:
    return to_requests(CompletionBody(**body), TOK, "policy")  # type: ignore[arg-type]


def test_prompt_forms_and_per_prompt_seeds() -> None:
    assert [r.prompt_token_ids for r in _parse(prompt="ab")] == [(97, 98)]
    assert [r.prompt_token_ids for r in _parse(prompt=[1, 2])] == [(1, 2)]
    many = _parse(prompt=["a", [5, 6]], seed=10, n=3, stop="x", top_k=-1)
    assert [r.prompt_token_ids for r in many] == [(97,), (5, 6)]
    assert [r.sampling.seed for r in many] == [10, 11]
    assert many[0].sampling == SamplingParams(n=3, stop=("x",), seed=10)


@pytest.mark.parametrize("body", [
    {"prompt": []}, {"prompt": [""]}, {"prompt": [[1], 2]}, {"prompt": "a", "stream": True},
    {"prompt": "a", "echo": True}, {"prompt": "a", "stop": [""]},
])
def test_malformed_requests_name_the_problem(body: dict) -> None:
    with pytest.raises((RequestError, ValidationError)):  # the server answers 400 / 422
        _parse(**body)


def _client(handler: object, urls: list[str], attempts: int = 3) -> RolloutClient:
    config = RolloutClientConfig(max_attempts=attempts, backoff_base_s=0.01, backoff_cap_s=0.02,
                          prompts_per_call=1)
    return RolloutClient(urls, config=config,
                         transport=httpx.MockTransport(handler))  # type: ignore[arg-type]


def _ok(request: httpx.Request, version: int) -> httpx.Response:
    """n choices per prompt; token j of a choice is its prompt's seed (to see seeding)."""
    body = json.loads(request.content)
    seed = body["seed"] or 0
    choices = [{"index": j * body["n"] + i, "text": "", "finish_reason": "length",
                "prompt_token_ids": [1], "token_ids": [seed + j], "token_logprobs": [-0.5]}
               for j in range(len(body["prompt"])) for i in range(body["n"])]
    return httpx.Response(200, json={"choices": choices, "weight_version": version})


def test_client_groups_and_seeds_do_not_depend_on_chunking() -> None:
    prompts = [[1], "two", [3, 3], "four", [5]]
    sampling = SamplingParams(seed=100)
    results = []
    for per_call in (1, 2, 8):
        config = RolloutClientConfig(prompts_per_call=per_call)
        client = RolloutClient(["http://a", "http://b"], config=config,
                               transport=httpx.MockTransport(lambda r: _ok(r, 1)))
        groups = client.generate(prompts, n=3, sampling=sampling)
        assert [len(g) for g in groups] == [3] * 5
        results.append([[s.token_ids for s in g] for g in groups])
    assert results[0] == results[1] == results[2]
    assert [g[0] for g in results[0]] == [(100 + i,) for i in range(5)]


def test_client_moves_off_a_failing_server_and_marks_it_dead() -> None:
    bad_tried = threading.Event()

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "bad":
            bad_tried.set()
            raise httpx.ConnectError("refused")
        # "good" answers only once "bad" was tried: its calls stay in flight, so the
        # client's next pick goes to the server with fewer (instead of a finished call
        # leaving both at none and the tie choosing "good" every time)
        bad_tried.wait(timeout=10)
        if request.url.host == "busy":
            return httpx.Response(503, headers={"Retry-After": "0"}, text="updating")
        return _ok(request, 3)

    client = _client(handler, ["http://bad", "http://good"])
    groups = client.generate([[1]] * 4, n=1)
    assert [g[0].weight_version for g in groups] == [3] * 4
    assert client.dead == {"http://bad"}
    busy = _client(handler, ["http://busy", "http://good"])
    assert [g[0].weight_version for g in busy.generate([[1]] * 3)] == [3] * 3
    assert busy.dead == set()  # an updating server is busy, not dead


def test_client_gives_up_loudly_and_does_not_retry_bad_requests() -> None:
    calls = {"n": 0}

    def down(request: httpx.Request) -> httpx.Response:
        calls["n"] += 1
        raise httpx.ConnectError("refused")

    with pytest.raises(RolloutUnavailable):
        _client(down, ["http://a", "http://b"]).generate([[1]])

    def bad(request: httpx.Request) -> httpx.Response:
        calls["n"] += 1
        return httpx.Response(400, json={"error": {"message": "max_tokens"}})

    calls["n"] = 0
    with pytest.raises(RequestError):
        _client(bad, ["http://a", "http://b"]).generate([[1]])
    assert calls["n"] == 1
