"""The RL loop's client of the reward servers: batching, retries, a per-step cache.

Retries use capped, jittered exponential backoff. A batch is re-sent with the *same*
item ids, so the server (which runs each id once) never executes an item twice because
a response was lost; a batch fails over to another server only when the request
provably never left (the connection was refused). Whatever still fails after the last
attempt comes back as an infra error (`reward=None`), never as a reward of 0, and is
counted in the metrics apart from the model's failures.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import random
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from moerl.rendezvous import server_urls
from moerl.retry import backoff_s
from moerl.rewards.config import RewardClientConfig
from moerl.rewards.protocol import REPAIRED, RewardRequest, RewardResult


@dataclass(frozen=True)
class ScoreItem:
    reward: str
    completion: str
    spec: Mapping[str, Any]


@dataclass
class ScoreReport:
    results: list[RewardResult]
    """One per input item, in order."""
    metrics: dict[str, float] = field(default_factory=dict)


class _Unsent(Exception):
    """The request never reached a server: safe to send elsewhere."""


class RewardClient:
    def __init__(self, config: RewardClientConfig | None = None, *, urls: Sequence[str] = (),
                 rendezvous_dir: Path | None = None, seed: int | None = None) -> None:
        """The servers at `urls`, or those announced in `rendezvous_dir`."""
        if not urls and rendezvous_dir is None:
            raise ValueError("RewardClient needs `urls` or `rendezvous_dir`")
        self.config = config or RewardClientConfig()
        self.urls, self.rendezvous_dir = tuple(urls), rendezvous_dir
        self._http = httpx.Client(timeout=self.config.timeout_s)
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._cache: dict[str, RewardResult] = {}
        self._cache_step: int | None = None
        self._next_url = itertools.count()

    def close(self) -> None:
        self._http.close()

    def _urls(self) -> tuple[str, ...]:
        if self.urls:
            return self.urls
        assert self.rendezvous_dir is not None
        return tuple(server_urls(self.rendezvous_dir, "reward"))

    def score(self, items: Sequence[ScoreItem], step: int) -> ScoreReport:
        """Score `items`; identical items within one step are scored once."""
        metrics = dict.fromkeys(("retries", "cache_hits", "infra_errors", "invalid_spec",
                                 "repaired_completions"), 0.0)  # fmt: skip
        if step != self._cache_step:
            self._cache, self._cache_step = {}, step
        keys = [_key(item) for item in items]
        todo = {k: item for k, item in zip(keys, items, strict=True) if k not in self._cache}
        metrics["cache_hits"] = float(len(items) - len(todo))
        fresh = self._score_unique(todo, metrics)
        for key, result in fresh.items():
            if result.error_kind != "infra":  # infra errors are never cached
                self._cache[key] = result
        results = [self._cache.get(k) or fresh[k] for k in keys]
        metrics["infra_errors"] = float(sum(r.error_kind == "infra" for r in results))
        metrics["invalid_spec"] = float(sum(r.error_kind == "invalid_spec" for r in results))
        # Completions that held bytes a decode left as lone surrogates (scored as U+FFFD).
        metrics["repaired_completions"] = float(sum(REPAIRED in r.details for r in results))
        for result in results:  # reward/limits/<name>: samples that hit each sandbox limit
            hit = result.details.get("limits_hit")
            for name in hit if isinstance(hit, list) else ():
                metrics[f"limits/{name}"] = metrics.get(f"limits/{name}", 0.0) + 1.0
        scored = [r.reward for r in results if r.reward is not None]
        metrics["scored"] = float(len(scored))
        metrics["mean_reward"] = sum(scored) / len(scored) if scored else float("nan")
        return ScoreReport(results, {f"reward/{k}": v for k, v in metrics.items()})

    def _score_unique(
        self, todo: dict[str, ScoreItem], metrics: dict[str, float]
    ) -> dict[str, RewardResult]:
        results: dict[str, RewardResult] = {}
        pending = dict(todo)
        for attempt in range(
            self.config.max_attempts if self.config.retry_item_infra_errors else 1
        ):
            if not pending:
                break
            if attempt:
                metrics["retries"] += len(pending)
            got = self._send_all(pending, metrics)
            results.update(got)
            # Only errors the server reported are re-sent (with new ids). A batch that got
            # no answer may still be running there: sending it anew could run it twice.
            pending = {
                k: pending[k]
                for k, r in got.items()
                if r.error_kind == "infra" and r.details.get("stage") != "transport"
            }
        return results

    def _send_all(
        self, todo: dict[str, ScoreItem], metrics: dict[str, float]
    ) -> dict[str, RewardResult]:
        requests = {
            key: RewardRequest(uuid.uuid4().hex, it.reward, it.completion, it.spec)
            for key, it in todo.items()
        }
        keys = list(requests)
        size = self.config.batch_size
        batches = [keys[i : i + size] for i in range(0, len(keys), size)]
        with ThreadPoolExecutor(self.config.max_in_flight) as pool:
            outs = pool.map(lambda b: self._post(b, [requests[k] for k in b], metrics), batches)
            return {k: r for out in outs for k, r in out.items()}

    def _post(
        self, keys: list[str], batch: list[RewardRequest], metrics: dict[str, float]
    ) -> dict[str, RewardResult]:
        body = {"items": [r.to_json() for r in batch]}
        url: str | None = None
        error = "no reward server found"
        for attempt in range(self.config.max_attempts):
            if attempt:
                with self._lock:
                    metrics["retries"] += 1
                    delay = backoff_s(attempt - 1, self.config.backoff_base_s,
                                      self.config.backoff_cap_s, self._rng)  # fmt: skip
                time.sleep(delay)
            try:
                if url is None:  # only a request that never left may change server
                    urls = self._urls()
                    if not urls:
                        raise _Unsent(error)
                    url = urls[next(self._next_url) % len(urls)]
                return self._post_once(url, keys, batch, body)
            except _Unsent as exc:
                error, url = str(exc), None
            except (httpx.HTTPError, ValueError, KeyError) as exc:
                error = f"{type(exc).__name__}: {exc}"
        message = f"reward server failed after {self.config.max_attempts} attempts: {error}"
        return {k: RewardResult.infra(message, details={"stage": "transport"}) for k in keys}

    def _post_once(
        self, url: str, keys: list[str], batch: list[RewardRequest], body: dict[str, Any]
    ) -> dict[str, RewardResult]:
        # Encoded here, ASCII-escaped: a completion holding a lone surrogate (or a NaN in
        # a spec) must reach the server, which answers for that item alone; an encoder
        # that writes raw UTF-8 or refuses NaN would fail the whole batch here.
        content = json.dumps(body).encode()
        try:
            response = self._http.post(f"{url}/score", content=content,
                                       headers={"content-type": "application/json"})  # fmt: skip
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            raise _Unsent(f"{url}: {type(exc).__name__}: {exc}") from exc
        if 400 <= response.status_code < 500 and response.status_code not in (408, 429):
            # The request itself is wrong: sending it again cannot help.
            message = (
                f"reward server rejected the batch ({response.status_code}): {response.text[:500]}"
            )
            return {k: RewardResult.infra(message, details={"stage": "transport"}) for k in keys}
        response.raise_for_status()
        by_id = {row["id"]: row for row in response.json()["results"]}
        return {k: RewardResult.from_json(by_id[r.id]) for k, r in zip(keys, batch, strict=True)}


def _key(item: ScoreItem) -> str:
    body = json.dumps([item.reward, item.completion, item.spec], sort_keys=True, default=str)
    return hashlib.sha256(body.encode()).hexdigest()
