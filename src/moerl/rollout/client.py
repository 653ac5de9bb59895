"""`RolloutClient`: the RL loop's side of the rollout servers.

Prompts go out in chunks (one generation call each, which the server batches
together; the request and reply formats of each engine are in `rollout.wire`),
as many chunks as live servers but at most `prompts_per_call` prompts each,
each chunk to the live server with the fewest calls in flight.
A refused connection, a timeout or a 5xx marks that server dead (a 503
"updating" only moves the call elsewhere) and the call is retried on another
server after a capped, jittered backoff; after `max_attempts` the step fails with
`RolloutUnavailable`, an infra error, never an empty sample. Dead servers come
back once `check_health` (called when none is left alive, or by the loop) sees
them answer again.

With `sampling.seed = s`, prompt i of a `generate` call is sampled with seed
s + i (the server gives prompt j of a call seed + j), so the samples do not depend
on how prompts were chunked or which server served them (vLLM seeds a whole call,
so with a seed its calls carry one prompt each).
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

import httpx

from moerl.rendezvous import server_urls
from moerl.retry import backoff_s
from moerl.rollout.backends import check_engine, weight_update_calls
from moerl.rollout.config import RolloutClientConfig
from moerl.rollout.types import RequestError, Sample, SamplingParams
from moerl.rollout.wire import (
    EngineAborted,
    GenerationCall,
    Prompt,
    generation_call,
    parse_generation,
)

log = logging.getLogger(__name__)


class RolloutUnavailable(RuntimeError):
    """No server could answer (after retries): an infra error for the step."""


class _Retryable(Exception):
    def __init__(self, message: str, dead: bool, retry_after: float = 0.0) -> None:
        super().__init__(message)
        self.dead = dead
        self.retry_after = retry_after


class RolloutClient:
    def __init__(self, urls: Sequence[str] = (), *, rendezvous_dir: str | Path | None = None,
                 config: RolloutClientConfig | None = None,
                 transport: httpx.BaseTransport | None = None, engine: str = "moerl") -> None:
        self.config = config or RolloutClientConfig()
        self._rng = random.Random()
        self.engine = check_engine(engine)  # which server kind: its wire format and updates
        # The version last loaded by every live server: reported for engines whose
        # replies name none (vLLM). -1 until the first `update_weights`.
        self.weight_version = -1
        found = list(urls) + (server_urls(rendezvous_dir, "rollout") if rendezvous_dir else [])
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
        if self.engine == "vllm" and base.seed is not None:
            step = 1  # vLLM seeds a whole call: one prompt per call keeps seed + i per prompt
        calls = [self._call(prompts[i : i + step], base, i) for i in range(0, len(prompts), step)]
        workers = max(1, min(self.config.max_in_flight, len(calls)))
        with ThreadPoolExecutor(workers, thread_name_prefix="rollout-client") as pool:
            flat = [s for samples in pool.map(self._complete, calls) for s in samples]
        # Choices come prompt-major: prompt j's samples are j*n .. j*n + n-1.
        return [flat[j * n : (j + 1) * n] for j in range(len(prompts))]

    def _call(self, chunk: Sequence[Prompt], sampling: SamplingParams, first: int
              ) -> GenerationCall:
        seed = None if sampling.seed is None else sampling.seed + first
        return generation_call(self.engine, chunk, sampling, seed, self.config.model)

    def _complete(self, call: GenerationCall) -> list[Sample]:
        last: Exception | None = None
        url: str | None = None
        for attempt in range(self.config.max_attempts):
            url = self._pick(avoid=url)
            try:
                samples = self._post(url, call)
                if len(samples) != call.expected:
                    raise RolloutUnavailable(f"{url} answered {len(samples)} choices for "
                                             f"{len(call.prompts)} prompts x n={call.n}")
                return samples
            except _Retryable as exc:
                last = exc
                self._mark(url, dead=exc.dead, why=str(exc))
                pause = backoff_s(attempt, self.config.backoff_base_s,
                                  self.config.backoff_cap_s, self._rng)
                time.sleep(max(exc.retry_after, pause))
            finally:
                with self._lock:
                    self._in_flight[url] -= 1
        raise RolloutUnavailable(f"generation failed after {self.config.max_attempts} "
                                 f"attempts: {last}")

    def _post(self, url: str, call: GenerationCall) -> list[Sample]:
        version = self.weight_version  # what the server holds when the call goes out
        try:
            reply = self._http.post(f"{url}{call.path}", json=call.body)
        except httpx.TransportError as exc:  # refused, reset, timed out
            raise _Retryable(f"{url}: {type(exc).__name__}: {exc}", dead=True) from exc
        if reply.status_code == 503 and reply.headers.get("retry-after"):
            raise _Retryable(f"{url}: busy ({reply.text})", dead=False,
                             retry_after=float(reply.headers["retry-after"]))
        if reply.status_code >= 500:
            raise _Retryable(f"{url}: HTTP {reply.status_code}: {reply.text}", dead=True)
        if reply.status_code >= 400:  # our request is wrong: retrying elsewhere cannot help
            raise RequestError(f"{url} refused the request: HTTP {reply.status_code}: {reply.text}")
        try:
            return parse_generation(self.engine, call, reply.json(), version)
        except EngineAborted as exc:  # e.g. a weight update aborted it: not the server's fault
            raise _Retryable(f"{url}: {exc}", dead=False) from exc

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
            results = dict(zip(live, pool.map(push, live), strict=True))
        # A server that cannot be reached is marked dead (generation avoids it, and the
        # next update finds it again if it comes back); one that answered and refused,
        # or no server at all taking the version, fails the update.
        refused = [f for url, f in results.items() if f and url not in self.dead]
        took = [url for url, f in results.items() if not f]
        if refused or not took:
            why = refused or [f for f in results.values() if f] or "no live server"
            raise RolloutUnavailable(f"weight update to version {version} failed: {why}")
        if len(took) < len(live):
            log.warning("weight version %d: %d of %d servers unreachable, marked dead",
                        version, len(live) - len(took), len(live))
        self.weight_version = version


def _refused(reply: httpx.Response) -> bool:
    """SGLang answers a failed reload with `"success": false` in the body."""
    try:
        body = reply.json()
    except ValueError:
        return False
    return isinstance(body, dict) and body.get("success") is False
