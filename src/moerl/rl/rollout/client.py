"""`RolloutClient`: the RL loop's side of the rollout servers.

Prompts go out in chunks (one `/v1/completions` call each, which the server
batches together), as many chunks as live servers but at most `prompts_per_call`
prompts each, each chunk to the live server with the fewest calls in flight.
A refused connection, a timeout or a 5xx marks that server dead (a 503
"updating" only moves the call elsewhere) and the call is retried on another
server after a capped, jittered backoff; after `max_attempts` the step fails with
`RolloutUnavailable`, an infra error, never an empty sample. Dead servers come
back once `check_health` (called when none is left alive, or by the loop) sees
them answer again.

With `sampling.seed = s`, prompt i of a `generate` call is sampled with seed
s + i (the server gives prompt j of a call seed + j), so the samples do not depend
on how prompts were chunked or which server served them.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from moerl.launchers.stages import read_endpoints
from moerl.rl.rollout.backends import check_engine, weight_update_calls
from moerl.rl.rollout.types import RequestError, Sample, SamplingParams, SpeculationStats

log = logging.getLogger(__name__)

Prompt = str | Sequence[int]


class RolloutUnavailable(RuntimeError):
    """No server could answer (after retries): an infra error for the step."""


class _Retryable(Exception):
    def __init__(self, message: str, dead: bool, retry_after: float = 0.0) -> None:
        super().__init__(message)
        self.dead = dead
        self.retry_after = retry_after


@dataclasses.dataclass(frozen=True)
class ClientConfig:
    timeout_s: float = 600.0  # one group's generation, end to end
    connect_timeout_s: float = 5.0
    max_attempts: int = 4
    backoff_s: float = 0.5  # first retry waits up to this; doubles each time
    backoff_cap_s: float = 8.0
    max_in_flight: int = 64  # concurrent calls over all servers
    prompts_per_call: int = 32  # at most; prompts are also spread evenly over live servers
    model: str | None = None


def discover(rendezvous_dir: str | Path) -> list[str]:
    """Rollout server URLs announced in a rendezvous directory."""
    return [f"http://{address}" for address in read_endpoints(rendezvous_dir, "rollout")]


class RolloutClient:
    def __init__(self, urls: Sequence[str] = (), *, rendezvous_dir: str | Path | None = None,
                 config: ClientConfig | None = None,
                 transport: httpx.BaseTransport | None = None, engine: str = "moerl") -> None:
        self.config = config or ClientConfig()
        self.engine = check_engine(engine)  # which server kind: how weight updates are asked
        found = list(urls) + (discover(rendezvous_dir) if rendezvous_dir else [])
        self.urls = list(dict.fromkeys(u.rstrip("/") for u in found))
        if not self.urls:
            raise ValueError("rollout: no server URLs given and none found in the rendezvous dir")
        self.dead: set[str] = set()
        self._in_flight = dict.fromkeys(self.urls, 0)
        self._lock = threading.Lock()
        timeout = httpx.Timeout(self.config.timeout_s, connect=self.config.connect_timeout_s)
        self._http = httpx.Client(timeout=timeout, transport=transport)

    def close(self) -> None:
        self._http.close()

    # -- health ---------------------------------------------------------------------------

    def check_health(self) -> dict[str, bool]:
        """Probe every server; live ones come back from `dead`, silent ones join it."""
        status = {}
        for url in self.urls:
            try:
                ok = self._http.get(f"{url}/health", timeout=self.config.connect_timeout_s
                                    ).status_code == 200
            except httpx.HTTPError:
                ok = False
            status[url] = ok
            self._mark(url, dead=not ok, why="health check failed")
        return status

    def _mark(self, url: str, dead: bool, why: str) -> None:
        with self._lock:
            if dead and url not in self.dead:
                self.dead.add(url)
                log.warning("rollout server %s marked dead: %s", url, why)
            elif not dead and url in self.dead:
                self.dead.discard(url)
                log.info("rollout server %s is back", url)

    def _pick(self, avoid: str | None) -> str:
        with self._lock:
            live = [u for u in self.urls if u not in self.dead]
        if not live:
            self.check_health()
            with self._lock:
                live = [u for u in self.urls if u not in self.dead]
            if not live:
                raise RolloutUnavailable(f"no rollout server answers (tried {self.urls})")
        choices = [u for u in live if u != avoid] or live
        with self._lock:
            url = min(choices, key=lambda u: (self._in_flight[u], random.random()))
            self._in_flight[url] += 1
        return url

    # -- generation -----------------------------------------------------------------------

    def generate(self, prompts: Sequence[Prompt], n: int = 1,
                 sampling: SamplingParams | None = None) -> list[list[Sample]]:
        """One group of `n` samples per prompt, in prompt order."""
        base = dataclasses.replace(sampling or SamplingParams(), n=n)
        live = max(1, len(self.urls) - len(self.dead))
        step = max(1, min(self.config.prompts_per_call, -(-len(prompts) // live)))
        chunks = [list(prompts[i : i + step]) for i in range(0, len(prompts), step)]
        bodies = [self._body(chunk, base, i * step) for i, chunk in enumerate(chunks)]
        workers = max(1, min(self.config.max_in_flight, len(bodies)))
        with ThreadPoolExecutor(workers, thread_name_prefix="rollout-client") as pool:
            flat = [s for samples in pool.map(self._complete, bodies) for s in samples]
        # Choices come prompt-major: prompt j's samples are j*n .. j*n + n-1.
        return [flat[j * n : (j + 1) * n] for j in range(len(prompts))]

    def _body(self, chunk: list[Prompt], sampling: SamplingParams, first: int) -> dict[str, Any]:
        body: dict[str, Any] = {
            "prompt": [p if isinstance(p, str) else list(p) for p in chunk],
            "n": sampling.n, "max_tokens": sampling.max_tokens,
            "temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k,
            "stop": list(sampling.stop) or None, "stop_token_ids": list(sampling.stop_token_ids),
            "ignore_eos": sampling.ignore_eos, "logprob_mode": sampling.logprob_mode,
            "seed": None if sampling.seed is None else sampling.seed + first, "logprobs": 1,
        }
        if self.config.model:
            body["model"] = self.config.model
        return body

    def _complete(self, body: dict[str, Any]) -> list[Sample]:
        last: Exception | None = None
        url: str | None = None
        for attempt in range(self.config.max_attempts):
            url = self._pick(avoid=url)
            try:
                samples = self._post_completion(url, body)
                if len(samples) != len(body["prompt"]) * body["n"]:
                    raise RolloutUnavailable(f"{url} answered {len(samples)} choices for "
                                             f"{len(body['prompt'])} prompts x n={body['n']}")
                return samples
            except _Retryable as exc:
                last = exc
                self._mark(url, dead=exc.dead, why=str(exc))
                pause = min(self.config.backoff_cap_s, self.config.backoff_s * 2**attempt)
                time.sleep(max(exc.retry_after, pause * random.uniform(0.5, 1.0)))
            finally:
                with self._lock:
                    self._in_flight[url] -= 1
        raise RolloutUnavailable(f"generation failed after {self.config.max_attempts} "
                                 f"attempts: {last}")

    def _post_completion(self, url: str, body: dict[str, Any]) -> list[Sample]:
        try:
            reply = self._http.post(f"{url}/v1/completions", json=body)
        except httpx.TransportError as exc:  # refused, reset, timed out
            raise _Retryable(f"{url}: {type(exc).__name__}: {exc}", dead=True) from exc
        if reply.status_code == 503 and reply.headers.get("retry-after"):
            raise _Retryable(f"{url}: busy ({reply.text})", dead=False,
                             retry_after=float(reply.headers["retry-after"]))
        if reply.status_code >= 500:
            raise _Retryable(f"{url}: HTTP {reply.status_code}: {reply.text}", dead=True)
        if reply.status_code >= 400:  # our request is wrong: retrying elsewhere cannot help
            raise RequestError(f"{url} refused the request: HTTP {reply.status_code}: {reply.text}")
        return parse_samples(reply.json())

    # -- weights --------------------------------------------------------------------------

    def update_weights(self, path: str | Path, version: int) -> None:
        """Load `path` as `version` on every live server; raise naming those that failed.

        The requests depend on the engine (rl.rollout.backends); vLLM and SGLang need
        `path` to hold Hugging Face weights.
        """
        live = [u for u in self.urls if u not in self.dead]
        calls = weight_update_calls(self.engine, path, version)

        def push(url: str) -> str | None:
            for call in calls:
                try:
                    reply = self._http.post(f"{url}{call.path}", json=call.body)
                except httpx.TransportError as exc:
                    self._mark(url, dead=True, why=f"weight update: {exc}")
                    return f"{url}: {type(exc).__name__}"
                if reply.status_code != 200 or _refused(reply):
                    return f"{url}{call.path}: HTTP {reply.status_code} {reply.text}"
            return None

        with ThreadPoolExecutor(max(1, len(live))) as pool:
            failures = [f for f in pool.map(push, live) if f]
        if failures or not live:
            why = failures or "no live server"
            raise RolloutUnavailable(f"weight update to version {version} failed: {why}")


def _refused(reply: httpx.Response) -> bool:
    """SGLang answers a failed reload with `"success": false` in the body."""
    try:
        body = reply.json()
    except ValueError:
        return False
    return isinstance(body, dict) and body.get("success") is False


def parse_samples(reply: dict[str, Any]) -> list[Sample]:
    """Samples from an OpenAI completions response, using this server's extensions."""
    version = int(reply.get("weight_version", -1))
    samples = []
    for choice in sorted(reply["choices"], key=lambda c: c["index"]):
        logprobs = choice.get("token_logprobs")
        if logprobs is None and choice.get("logprobs"):
            logprobs = choice["logprobs"]["token_logprobs"]
        samples.append(Sample(
            prompt_token_ids=tuple(choice.get("prompt_token_ids") or ()),
            token_ids=tuple(choice.get("token_ids") or ()),
            logprobs=tuple(logprobs or ()),
            finish_reason="length" if choice.get("finish_reason") == "length" else "stop",
            weight_version=version,
            text=choice.get("text", ""),
            speculation=SpeculationStats(**choice["speculation"]) if choice.get("speculation")
            else None,
        ))
    return samples
