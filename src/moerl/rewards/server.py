"""The reward server: HTTP `/score` for batches of samples, `/health`.

Every item carries an id, and each id is executed at most once: a retried request whose
response was lost (client timeout, dropped connection) joins the execution already
running or gets its stored result, so a non-idempotent command never runs twice.
Errors are per item and typed: `infra` (the system failed: never a reward of 0) or
`invalid_spec` (bad reference data).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import sys
import threading
import time
import traceback
from collections import OrderedDict
from collections.abc import AsyncIterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from moerl.ports import listen_port
from moerl.rendezvous import ENV_INDEX, ENV_RENDEZVOUS, announce
from moerl.rewards import wire
from moerl.rewards.items import (
    ScoreItem,
    fingerprint,
    parse_item,
    raw_id,
    response_row,
    with_repair_noted,
)
from moerl.rewards.protocol import InvalidSpec, RewardFunction, RewardResult
from moerl.rewards.registry import BUILTIN, RewardLoadError, load_rewards
from moerl.sandbox import SandboxConfig, SandboxUnavailable
from moerl.sandbox.preflight import open_checked
from moerl.sandbox.workspace import remove_shared_copies

log = logging.getLogger(__name__)


class Scorer:
    """Runs items on a bounded thread pool, once per id."""

    def __init__(self, rewards: Mapping[str, RewardFunction], max_concurrency: int,
                 remember: int = 50_000) -> None:  # fmt: skip
        self.rewards = dict(rewards)
        self.max_concurrency = max_concurrency
        self.pool = ThreadPoolExecutor(max_concurrency, thread_name_prefix="reward")
        self.remember = remember
        self.tasks: OrderedDict[str, tuple[str, asyncio.Future[RewardResult]]] = OrderedDict()
        self.executions = 0
        self.stopping = threading.Event()
        """Set on SIGTERM: items not yet started are answered as cancelled infra errors."""

    def score_sync(self, item: ScoreItem) -> RewardResult:
        if self.stopping.is_set():  # the client sends it again, to another server
            return RewardResult.infra("reward server shutting down; the item was not run",
                                      details={"stage": "cancelled"})  # fmt: skip
        reward = self.rewards.get(item.reward)
        if reward is None:
            return RewardResult.invalid(
                f"unknown reward {item.reward!r}; have {sorted(self.rewards)}"
            )
        self.executions += 1
        started = time.perf_counter()
        try:
            result = reward.score(item.completion, item.spec)
        except InvalidSpec as exc:
            return RewardResult.invalid(wire.message(exc))
        except Exception as exc:  # a bug or a crash in a reward function is infra
            log.exception("reward %s failed", item.reward)
            tail = "".join(traceback.format_exception_only(exc)).strip()
            return RewardResult.infra(f"reward function {item.reward!r} raised: {tail}")
        if not isinstance(result, RewardResult):
            return RewardResult.infra(f"reward function {item.reward!r} returned a "
                                      f"{type(result).__name__}, not a RewardResult")
        return replace(result, seconds=round(time.perf_counter() - started, 6))

    async def score(self, item: ScoreItem) -> RewardResult:
        asked = fingerprint(item)
        known = self.tasks.get(item.id)
        if known is not None:
            if known[0] != asked:
                return RewardResult.invalid(f"id {item.id!r} was already used for another item")
            return await asyncio.shield(known[1])
        loop = asyncio.get_running_loop()
        # A task, not a bare await: if this request is cancelled (client gone), the
        # execution still finishes and its result waits for the retry.
        task = asyncio.ensure_future(loop.run_in_executor(self.pool, self.score_sync, item))
        self.tasks[item.id] = (asked, task)
        while len(self.tasks) > self.remember:
            oldest, (_, old_task) = next(iter(self.tasks.items()))
            if not old_task.done():
                break
            del self.tasks[oldest]
        return await asyncio.shield(task)

    def in_flight(self) -> int:
        return sum(not task.done() for _, task in self.tasks.values())


DEFAULT_MAX_BATCH_ITEMS = 1024
DEFAULT_MAX_COMPLETION_BYTES = 8 << 20


def create_app(rewards: Mapping[str, RewardFunction], max_concurrency: int,
               max_batch_items: int = DEFAULT_MAX_BATCH_ITEMS,
               max_completion_bytes: int = DEFAULT_MAX_COMPLETION_BYTES) -> FastAPI:
    scorer = Scorer(rewards, max_concurrency)
    app = FastAPI(title="moerl reward server")
    app.state.scorer = scorer

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {
            "status": "ok",
            "rewards": sorted(scorer.rewards),
            "in_flight": scorer.in_flight(),
            "max_concurrency": scorer.max_concurrency,
            "max_batch_items": max_batch_items,
            "max_completion_bytes": max_completion_bytes,
        }

    @app.post("/score")
    async def score(request: Request) -> JSONResponse:
        # Parsed here, not by a typed body: an item that fails validation (a string
        # holding a lone surrogate, a missing field) is that item's invalid_spec, and
        # the rest of the batch is scored.
        try:
            raw_items = wire.loads(await request.body())["items"]
            if not isinstance(raw_items, list):
                raise TypeError("items is not a list")
        except (ValueError, KeyError, TypeError, RecursionError) as exc:
            return JSONResponse({"detail": f'the body must be JSON {{"items": [...]}}: '
                                           f"{wire.error_text(exc)}"}, status_code=422)  # fmt: skip
        if len(raw_items) > max_batch_items:  # bounded work per request
            return JSONResponse(
                {"detail": f"a batch of {len(raw_items)} items is over this server's limit of "
                           f"{max_batch_items} (--max-batch-items); send smaller batches "
                           "(rewards.client.batch_size)"}, status_code=413)  # fmt: skip

        async def one(raw: Any) -> RewardResult:
            try:
                item = parse_item(raw, max_completion_bytes)
                if isinstance(item, RewardResult):
                    return item
                return with_repair_noted(await scorer.score(item), item)
            except Exception as exc:  # a bug of the server's: this item's, not the batch's
                log.exception("item %r failed outside its reward function", raw_id(raw))
                return RewardResult.infra(f"the reward server failed on this item: "
                                          f"{wire.error_text(exc)}")  # fmt: skip

        results = await asyncio.gather(*(one(raw) for raw in raw_items))
        rows = [response_row(raw_id(raw), r) for raw, r in zip(raw_items, results, strict=True)]
        return JSONResponse({"results": rows})

    return app


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="moerl serve reward", description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--max-concurrency", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--max-batch-items", type=int, default=DEFAULT_MAX_BATCH_ITEMS,
                        help="larger requests are refused with 413")  # fmt: skip
    parser.add_argument("--max-completion-bytes", type=int, default=DEFAULT_MAX_COMPLETION_BYTES,
                        help="longer completions are invalid_spec, never run")  # fmt: skip
    parser.add_argument("--grace-s", type=float, default=30.0,
                        help="on SIGTERM, how long running requests may still take")  # fmt: skip
    env_dir = os.environ.get(ENV_RENDEZVOUS)
    parser.add_argument("--rendezvous-dir", type=Path, default=Path(env_dir) if env_dir else None,
                        help="announce host:port here once healthy (default: from the "
                        "launcher's environment)")  # fmt: skip
    parser.add_argument("--reward", action="append", default=[], metavar="NAME=MODULE:ATTR",
                        help="reward functions to serve (default: the built-in ones)")  # fmt: skip
    parser.add_argument("--isolation", choices=["strict", "no-cgroups"], default="strict",
                        help="'no-cgroups' is weaker; see moerl.sandbox.config")  # fmt: skip
    parser.add_argument("--warm-slots", type=int, default=None,
                        help="executions launched ahead of requests, per kind (default: "
                        "--max-concurrency; 0 launches each on demand)")  # fmt: skip
    args = parser.parse_args(argv)
    if min(args.max_concurrency, args.max_batch_items, args.max_completion_bytes) < 1:
        parser.error("--max-concurrency, --max-batch-items and --max-completion-bytes: >= 1")
    if args.warm_slots is None:
        args.warm_slots = args.max_concurrency
    if args.warm_slots < 0:
        parser.error("--warm-slots: >= 0")
    return args


def _reward_paths(specs: list[str]) -> dict[str, str]:
    if not specs:
        return dict(BUILTIN)
    paths = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep:
            raise RewardLoadError(f"--reward {spec!r} must look like NAME=module:attr")
        paths[name] = BUILTIN.get(path, path)
    return paths


def _announce(server: Any, host: str, rendezvous_dir: Path | None, done: list[Path]) -> None:
    """Wait until uvicorn listens and /health answers, then publish host:port."""
    import httpx

    while not server.started:
        if server.should_exit:
            return
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    reach = socket.gethostname() if host in ("0.0.0.0", "::") else host
    httpx.get(f"http://{host if reach == host else '127.0.0.1'}:{port}/health", timeout=10)
    print(f"reward server listening on {reach}:{port}", flush=True)
    if rendezvous_dir is not None:
        index = int(os.environ.get(ENV_INDEX, "0"))
        done.append(announce(rendezvous_dir, "reward", index, reach, port))


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    args = _parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:  # a sandbox that cannot run anything is refused now, not per item
        sandbox = open_checked(SandboxConfig(isolation=args.isolation,
                                             warm_slots=args.warm_slots))  # fmt: skip
        rewards = load_rewards(_reward_paths(args.reward), sandbox)
    except (SandboxUnavailable, RewardLoadError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    app = create_app(rewards, args.max_concurrency, args.max_batch_items,
                     args.max_completion_bytes)
    scorer: Scorer = app.state.scorer

    class DrainingServer(uvicorn.Server):
        """SIGTERM/SIGINT: no new connections, queued items answered as cancelled, running
        ones finish (each bounded by its sandbox limits) within the grace period."""

        def handle_exit(self, sig: int, frame: Any) -> None:
            scorer.stopping.set()
            super().handle_exit(sig, frame)

    published: list[Path] = []

    def shut_down() -> None:
        """Idempotent: from the lifespan's end (uvicorn re-raises a caught SIGTERM once
        it has shut down, so nothing after `server.run()` runs then) and on other exits."""
        for path in published:
            path.unlink(missing_ok=True)
        scorer.stopping.set()
        scorer.pool.shutdown(wait=True, cancel_futures=True)
        sandbox.close()  # idle warm slots: their processes, groups and work dirs
        remove_shared_copies(sandbox.config.work_root)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        shut_down()

    app.router.lifespan_context = lifespan
    config = uvicorn.Config(app, host=args.host,
                            port=listen_port(args.host, args.port), log_level="warning",
                            timeout_graceful_shutdown=max(1, round(args.grace_s)))  # fmt: skip
    server = DrainingServer(config)
    announcer = threading.Thread(
        target=_announce, args=(server, args.host, args.rendezvous_dir, published), daemon=True
    )
    announcer.start()
    try:
        server.run()
    finally:
        shut_down()
    return 0

if __name__ == "__main__":
    raise SystemExit(main())
