"""Two real rollout server processes on 127.0.0.1 serving the tiny MoE.

Checked against a model built in this process from the same seed: greedy output
equals an uncached loop, logprobs equal a full forward's log-softmax, seeds
reproduce, malformed requests get a 4xx, a weight update switches every answer to
the new weights and version (a request racing it is answered by one version
only), and the client fails over when a server is killed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from megatron.core.models.gpt import GPTModel

from moerl.rendezvous import read_endpoints, server_urls
from moerl.rollout.client import RolloutClient
from moerl.rollout.types import SamplingParams

SEED = 77
PROMPT = list(b"The answer is")
STEPS = 8


def _full_logits(model: GPTModel, tokens: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    with torch.inference_mode():
        return model(tokens, positions, None).float()  # [B, S, V]


def _greedy(model: GPTModel, prompt: list[int], steps: int) -> list[int]:
    tokens = torch.tensor([prompt])
    for _ in range(steps):
        tokens = torch.cat([tokens, _full_logits(model, tokens)[:, -1:].argmax(-1)], dim=1)
    return tokens[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[GPTModel, GPTModel, Path]]:
    """The servers' model (same seed), another one, and the other one's weights on disk."""
    from moerl.models.arch import TINY
    from moerl.models.build import build_model
    from moerl.models.weights import save_weights
    from moerl.parallel.groups import destroy_parallel, init_parallel
    from moerl.parallel.layout import ParallelLayout

    torch.set_num_threads(1)
    init_parallel(ParallelLayout(), seed=SEED)
    (served,) = build_model(TINY, ParallelLayout())
    torch.manual_seed(SEED + 1)
    (other,) = build_model(TINY, ParallelLayout())
    served.eval()
    other.eval()
    weights = save_weights([other], tmp_path_factory.mktemp("weights") / "v1")
    yield served, other, weights
    destroy_parallel()


@pytest.fixture(scope="module")
def servers(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Path, list[subprocess.Popen]]]:
    rendezvous = tmp_path_factory.mktemp("rendezvous")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "moerl.rollout.server", "--port", "0", "--seed", str(SEED),
             "--rendezvous-dir", str(rendezvous), "--index", str(i), "--max-batch", "8"],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )
        for i in range(2)
    ]
    deadline = time.monotonic() + 120
    while len(server_urls(rendezvous, "rollout")) < 2:
        for proc in procs:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited: {proc.stderr.read().decode()[-3000:]}")  # type: ignore[union-attr]
        assert time.monotonic() < deadline, "servers did not come up"
        time.sleep(0.2)
    yield rendezvous, procs
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="module")
def urls(servers: tuple[Path, list[subprocess.Popen]]) -> list[str]:
    return [f"http://{address}" for address in read_endpoints(servers[0], "rollout")]


def _complete(url: str, **body: object) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120)


def test_openai_shape_greedy_and_logprobs(urls: list[str], models: tuple) -> None:
    served = models[0]
    reply = _complete(urls[0], prompt=[PROMPT, "Hi"], n=2, max_tokens=STEPS, temperature=0,
                      ignore_eos=True, logprobs=1)
    assert reply.status_code == 200, reply.text
    data = reply.json()
    assert data["object"] == "text_completion" and data["weight_version"] == 0
    assert [c["index"] for c in data["choices"]] == [0, 1, 2, 3]
    assert data["usage"]["completion_tokens"] == 4 * STEPS
    first = data["choices"][0]
    assert set(first) >= {"text", "logprobs", "finish_reason", "prompt_token_ids", "token_ids",
                          "token_logprobs"}
    assert first["prompt_token_ids"] == PROMPT and first["finish_reason"] == "length"
    assert first["token_ids"] == _greedy(served, PROMPT, STEPS)
    assert first["logprobs"]["token_logprobs"] == first["token_logprobs"]
    tokens = torch.tensor([PROMPT + first["token_ids"]])
    logits = _full_logits(served, tokens[:, :-1])[0, len(PROMPT) - 1 :]
    expected = torch.log_softmax(logits, -1).gather(1, tokens[0, len(PROMPT):, None]).squeeze(1)
    assert (torch.tensor(first["token_logprobs"]) - expected).abs().max() < 1e-5
    models_reply = httpx.get(f"{urls[0]}/v1/models").json()
    assert models_reply["data"][0]["id"] == "tiny"
    assert httpx.get(f"{urls[1]}/health").json()["status"] == "ok"


def test_seeds_stop_and_length_over_http(urls: list[str]) -> None:
    body = {"prompt": PROMPT, "n": 2, "max_tokens": 12, "temperature": 1.0, "ignore_eos": True}
    a = _complete(urls[0], seed=5, **body).json()["choices"]
    b = _complete(urls[1], seed=5, **body).json()["choices"]  # same weights, other process
    c = _complete(urls[0], seed=6, **body).json()["choices"]
    assert [x["token_ids"] for x in a] == [x["token_ids"] for x in b]
    assert [x["token_ids"] for x in a] != [x["token_ids"] for x in c]
    stop_id = a[0]["token_ids"][3]
    cut = _complete(urls[0], seed=5, stop_token_ids=[stop_id], **body).json()["choices"][0]
    assert cut["finish_reason"] == "stop" and cut["token_ids"][-1] == stop_id
    assert all(x["finish_reason"] == "length" and len(x["token_ids"]) == 12 for x in a)


@pytest.mark.parametrize("body", [
    {"max_tokens": 4},  # no prompt
    {"prompt": "x", "max_tokens": 100000},
    {"prompt": [1, 99999]},
    {"prompt": "x", "n": 0},
    {"prompt": "x", "temperature": -1},
    {"prompt": "x", "model": "not-this-one"},
    {"prompt": "x", "stream": True},
    {"prompt": {"a": 1}},
])
def test_malformed_requests_get_a_4xx_with_a_message(urls: list[str], body: dict) -> None:
    reply = _complete(urls[0], **body)
    assert 400 <= reply.status_code < 500 and reply.text
    garbage = httpx.post(f"{urls[0]}/v1/completions", content=b"{not json",
                         headers={"content-type": "application/json"})
    assert 400 <= garbage.status_code < 500
    assert httpx.get(f"{urls[0]}/health").status_code == 200


def test_update_switches_weights_and_races_see_one_version(urls: list[str], models: tuple,
                                                           servers: tuple) -> None:
    served, other, weights = models
    expected = {0: _greedy(served, PROMPT, STEPS), 1: _greedy(other, PROMPT, STEPS)}
    answers: list[tuple[int, list[int]]] = []
    stop = threading.Event()

    def hammer() -> None:
        while not stop.is_set():
            data = _complete(urls[1], prompt=PROMPT, max_tokens=STEPS, temperature=0,
                             ignore_eos=True).json()
            answers.append((data["weight_version"], data["choices"][0]["token_ids"]))

    threads = [threading.Thread(target=hammer) for _ in range(3)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    client = RolloutClient(rendezvous_dir=servers[0])
    client.update_weights(weights, 1)
    time.sleep(1.0)
    stop.set()
    for t in threads:
        t.join()
    assert {v for v, _ in answers} == {0, 1}
    assert all(tokens == expected[v] for v, tokens in answers)  # never a mix of versions
    for url in urls:
        assert httpx.get(f"{url}/health").json()["weight_version"] == 1
    bad = httpx.post(f"{urls[0]}/update_weights", json={"path": "/nowhere", "version": 2})
    assert bad.status_code == 400 and httpx.get(f"{urls[0]}/health").json()["weight_version"] == 1


def test_client_fails_over_when_a_server_is_killed(servers: tuple, models: tuple) -> None:
    rendezvous, procs = servers
    client = RolloutClient(rendezvous_dir=rendezvous)
    assert client.check_health() == dict.fromkeys(client.urls, True)
    procs[0].kill()
    procs[0].wait()
    sampling = SamplingParams(max_tokens=STEPS, temperature=0, ignore_eos=True)
    groups = client.generate([PROMPT] * 6, n=2, sampling=sampling)
    assert len(groups) == 6 and all(len(g) == 2 for g in groups)
    assert all(list(s.token_ids) == _greedy(models[1], PROMPT, STEPS) for g in groups for s in g)
    assert client.dead == {client.urls[0]}
