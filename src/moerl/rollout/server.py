"""`moerl serve rollout`: the Megatron engine behind an OpenAI-compatible HTTP API.

Endpoints: POST /v1/completions, GET /v1/models, GET /health, and
POST /update_weights {"path": dir, "version": int}, and the same over the trainer's
weight group (`rollout.weight_group`): POST /init_weights_update_group, then POST
/update_weights_from_distributed per version. A weight update runs alone on
the engine, between two steps (`continuous_scheduler`; `batching` for the static
backend, between two batches); a request that has waited longer than
`--update-wait` seconds behind an update is answered 503 with Retry-After and
never from half-loaded weights. Every completion names its weight version.

Under torchrun (`--tp`, `--ep`, `--pp`) the model is split over the job's ranks:
rank 0 serves HTTP and the others follow it (`rollout.ranks`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from moerl.data.tiktoken_tokenizer import TiktokenTokenizer
from moerl.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer
from moerl.models.arch import MoEArch
from moerl.models.precision import FP8_RECIPES, ParamsDtype, PrecisionConfig, TransformerImpl
from moerl.ports import listen_port
from moerl.rendezvous import ENV_INDEX, ENV_RENDEZVOUS
from moerl.rendezvous import announce as announce_endpoint
from moerl.rollout.batching import BatchScheduler
from moerl.rollout.continuous_scheduler import ContinuousScheduler
from moerl.rollout.engine import EngineBroken, EngineOptions, MegatronEngine, build_engine
from moerl.rollout.follower import follow
from moerl.rollout.openai_api import (
    CompletionBody,
    GroupBody,
    ManifestBody,
    UpdateBody,
    to_requests,
    to_response,
)
from moerl.rollout.options import BACKENDS, STATIC_BATCH
from moerl.rollout.speculative.config import SPECULATIVE_MODES, SpeculativeConfig
from moerl.rollout.types import LOGPROB_MODES, RequestError
from moerl.rollout.weight_group import GroupSpec, Manifest
from moerl.typed_config import from_dict

log = logging.getLogger(__name__)


def _error(status: int, message: str, kind: str, **headers: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind}}, status, headers=headers)


@dataclass
class ServerState:
    engine: MegatronEngine
    scheduler: BatchScheduler | ContinuousScheduler
    model_name: str
    update_wait_s: float


async def _await_generation(state: ServerState, future: Any) -> Any:
    """The batch's result; None when it waited past the bound behind a weight update."""
    waiting = asyncio.wrap_future(future)
    while True:
        done, _ = await asyncio.wait({waiting}, timeout=0.25)
        if done:
            return waiting.result()
        pending = state.scheduler.pending_update
        if pending and time.monotonic() - pending[1] > state.update_wait_s and future.cancel():
            return None


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="moerl rollout server")
    tokenizer = state.engine.tokenizer

    @app.exception_handler(RequestError)
    async def bad_request(_: Request, exc: RequestError) -> JSONResponse:
        return _error(400, str(exc), "invalid_request_error")

    @app.exception_handler(EngineBroken)
    async def broken(_: Request, exc: EngineBroken) -> JSONResponse:
        return _error(503, str(exc), "engine_unavailable")

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionBody) -> dict[str, Any] | JSONResponse:
        if state.engine.broken:
            return _error(503, state.engine.broken, "engine_unavailable")
        if body.model not in (None, state.model_name):
            raise RequestError(f"model: this server serves {state.model_name!r}, "
                               f"not {body.model!r}")
        requests = to_requests(body, tokenizer, state.engine.options.logprob_mode)
        for request in requests:
            state.engine.check(request)
        groups = await _await_generation(state, state.scheduler.submit(requests))
        if groups is None:
            pending = state.scheduler.pending_update
            target = pending[0] if pending else "?"
            return _error(503, f"weights are being updated to version {target}; retry shortly",
                          "weights_updating", **{"Retry-After": "1"})
        return to_response(groups, body, state.model_name, tokenizer)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": state.model_name, "object": "model", "created": 0, "owned_by": "moerl",
                "max_model_len": state.engine.max_sequence_length,
                "weight_version": state.engine.weight_version}
        return {"object": "list", "data": [card]}

    @app.get("/health", response_model=None)
    async def health() -> dict[str, Any] | JSONResponse:
        if state.engine.broken:
            return _error(503, state.engine.broken, "engine_unavailable")
        pending = state.scheduler.pending_update
        ranks = state.engine.ranks.size if state.engine.ranks is not None else 1
        reply = {"status": "ok", "weight_version": state.engine.weight_version,
                 "updating_to": pending[0] if pending else None,
                 "backend": state.engine.backend, "ranks": ranks}
        if state.engine.runner is not None:  # rows each attention replica was given
            reply["replica_rows"] = list(state.engine.runner.served)
        if state.engine.continuous is not None:
            cache = state.engine.continuous.blocks.cache
            reply["kv_cache_tokens"] = cache.token_capacity
            reply["kv_bytes_per_token"] = cache.bytes_per_token
        return reply

    @app.post("/init_weights_update_group", response_model=None)
    async def init_weight_group(body: GroupBody) -> dict[str, Any] | JSONResponse:
        spec = GroupSpec(**body.model_dump())
        future = state.scheduler.submit_update(
            "weight group", state.engine.weight_version,
            action=lambda: state.engine.join_weight_group(spec))
        try:
            await asyncio.wrap_future(future)
        except Exception as exc:
            return _error(500, f"joining the weight group failed: {exc}", "join_failed")
        return {"success": True, "weight_version": state.engine.weight_version}

    @app.post("/update_weights_from_distributed", response_model=None)
    async def update_from_group(body: ManifestBody) -> dict[str, Any] | JSONResponse:
        manifest = Manifest(body.version, body.group_name, body.buffer_bytes)
        future = state.scheduler.submit_update(
            "weight group", body.version, action=lambda: state.engine.receive_weights(manifest))
        reply = await _updated(state, future)
        if isinstance(reply, dict):  # what each rank received, as its transport counted
            reply["ranks"] = state.engine.last_received
        return reply

    @app.post("/update_weights", response_model=None)
    async def update_weights(body: UpdateBody) -> dict[str, Any] | JSONResponse:
        future = state.scheduler.submit_update(body.path, body.version)
        return await _updated(state, future)

    return app


async def _updated(state: ServerState, future: Any) -> dict[str, Any] | JSONResponse:
    """The reply to a weight update once it has run."""
    try:
        version = await asyncio.wrap_future(future)
    except FileNotFoundError as exc:
        return _error(400, str(exc), "invalid_request_error")
    except Exception as exc:
        status = 503 if state.engine.broken else 500
        return _error(status, f"weight update failed, still serving version "
                      f"{state.engine.weight_version}: {exc}", "update_failed")
    return {"weight_version": version}


def make_scheduler(engine: MegatronEngine, batch_wait_s: float = 0.05
                   ) -> BatchScheduler | ContinuousScheduler:
    """The worker in front of `engine`: continuous steps, or static batches."""
    partial = engine.options.partial_rollouts
    if engine.runner is not None:
        return ContinuousScheduler(engine, partial=partial)
    return BatchScheduler(engine, engine.options.max_batch or STATIC_BATCH, batch_wait_s,
                          partial=partial)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="moerl serve rollout", description=__doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    p.add_argument("--model", default="tiny", help="model preset name")
    p.add_argument("--arch-file", default=None,
                   help="JSON of the full architecture (the trainer's, overrides included); "
                        "takes precedence over --model")
    p.add_argument("--weights", default=None, help="weights directory (default: random init)")
    p.add_argument("--seed", type=int, default=0, help="random-init seed without --weights")
    p.add_argument("--rendezvous-dir", default=os.environ.get(ENV_RENDEZVOUS),
                   help="announce host:port there once healthy (default: from the launcher)")
    p.add_argument("--index", type=int, default=int(os.environ.get(ENV_INDEX, "0")),
                   help="this server's number in the rendezvous")
    p.add_argument("--max-batch", type=int, default=0,
                   help="continuous: sequences at once (0: as many as the KV cache holds); "
                        f"static: rows (prompt x sample) per batch (0: {STATIC_BATCH})")
    p.add_argument("--batch-wait-ms", type=float, default=50.0,
                   help="static: how long a request may wait for others to share its batch")
    p.add_argument("--backend", choices=BACKENDS, default="auto",
                   help="auto: Megatron's dynamic engine on a GPU with flash attention, else "
                        "continuous batching (static for pipeline stages and speculation)")
    p.add_argument("--kv-cache-gb", type=float, default=0.0,
                   help="continuous: KV cache per rank (0: 1 GiB on a CPU, half the GPU's "
                        "free memory)")
    p.add_argument("--block-size", type=int, default=16, help="continuous: tokens per KV block")
    p.add_argument("--cuda-graphs", type=int, default=16,
                   help="dynamic: CUDA graphs Megatron's engine captures (0: none)")
    p.add_argument("--prefill-chunk", type=int, default=2048,
                   help="continuous: tokens per forward (prompts longer than this are read "
                        "in chunks)")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor parallelism across this server's ranks (under torchrun)")
    p.add_argument("--ep", type=int, default=1,
                   help="expert parallelism across this server's ranks (under torchrun)")
    p.add_argument("--pp", type=int, default=1,
                   help="pipeline stages across this server's ranks (under torchrun)")
    p.add_argument("--speculative", choices=SPECULATIVE_MODES, default="none",
                   help="draft tokens with n-gram lookup or the MTP head; samples keep the "
                        "policy's distribution")
    p.add_argument("--num-draft-tokens", type=int, default=4)
    p.add_argument("--adaptive-drafts", action="store_true",
                   help="grow/shrink the draft length with each sample's acceptance")
    p.add_argument("--logprob-mode", choices=LOGPROB_MODES, default="policy")
    p.add_argument("--partial-rollouts", action="store_true",
                   help="apply a weight update between two decode steps of a running batch; "
                        "each token records the version that sampled it")
    p.add_argument("--update-wait", type=float, default=30.0,
                   help="seconds a request may wait behind a weight update before a 503")
    p.add_argument("--transformer-impl", choices=get_args(TransformerImpl), default="auto",
                   help="the run's precision.transformer_impl")
    p.add_argument("--params-dtype", choices=get_args(ParamsDtype), default="auto",
                   help="the run's precision.params_dtype")
    p.add_argument("--fp8", choices=FP8_RECIPES, default=None, help="the run's precision.fp8")
    p.add_argument("--fp8-param", action="store_true",
                   help="the run's precision.fp8_param: FP8 primary weights (one byte each)")
    p.add_argument("--tokenizer", default=None,
                   help="a tokenizer directory (the run's tokenizer.path); default: bytes")
    p.add_argument("--tokenizer-kind", choices=("hf", "tiktoken"), default="hf",
                   help="the run's tokenizer.kind: tokenizer.json or tiktoken.model")
    p.add_argument("--eos-token", default=None, help="EOS token text (default: the directory's)")
    p.add_argument("--pad-token", default=None)
    p.add_argument("--bos-token", default=None)
    p.add_argument("--end-of-turn-token", default=None,
                   help="a token that also ends generation (the chat template's end of turn)")
    args = p.parse_args(argv)
    if args.max_batch < 0 or args.kv_cache_gb < 0:
        p.error("--max-batch and --kv-cache-gb must be >= 0 (0: sized from memory)")
    if args.block_size < 1 or args.prefill_chunk < 1 or args.cuda_graphs < 0:
        p.error("--block-size and --prefill-chunk must be >= 1, --cuda-graphs >= 0")
    if args.tp < 1 or args.ep < 1 or args.pp < 1:
        p.error("--tp, --ep and --pp must be >= 1")
    return args


def _arch(args: argparse.Namespace) -> str | MoEArch:
    if args.arch_file is None:
        return str(args.model)
    data = json.loads(Path(args.arch_file).read_text())
    return from_dict(MoEArch, data, "model")


def precision_of(args: argparse.Namespace) -> PrecisionConfig:
    """The precision a server parsed from `args` computes in (the run's)."""
    return PrecisionConfig(transformer_impl=args.transformer_impl,
                           params_dtype=args.params_dtype, fp8=args.fp8,
                           fp8_param=args.fp8_param)


def _tokenizer(args: argparse.Namespace) -> Tokenizer:
    if not args.tokenizer:
        return ByteTokenizer()
    specials = dict(eos_token=args.eos_token, pad_token=args.pad_token,
                    bos_token=args.bos_token, end_of_turn_token=args.end_of_turn_token)
    if args.tokenizer_kind == "tiktoken":
        return TiktokenTokenizer(args.tokenizer, **specials)
    return HFTokenizer(args.tokenizer, **specials)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    tokenizer = _tokenizer(args)
    speculative = SpeculativeConfig(mode=args.speculative, num_draft_tokens=args.num_draft_tokens,
                                    adaptive=args.adaptive_drafts)
    options = EngineOptions(args.max_batch, args.backend, args.logprob_mode, speculative,
                            partial_rollouts=args.partial_rollouts, kv_cache_gb=args.kv_cache_gb,
                            block_size=args.block_size, prefill_chunk=args.prefill_chunk,
                            cuda_graphs=args.cuda_graphs)
    engine = build_engine(_arch(args), tokenizer, weights=args.weights, seed=args.seed,
                          options=options, precision=precision_of(args), tp=args.tp, ep=args.ep,
                          pp=args.pp)
    if engine.ranks is not None and not engine.ranks.leader:
        follow(engine, engine.ranks)
        return 0
    scheduler = make_scheduler(engine, args.batch_wait_ms / 1000)
    state = ServerState(engine, scheduler, args.model, args.update_wait)
    app = create_app(state)
    bind_port = listen_port(args.host, args.port)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=bind_port,
                                           log_level="warning", timeout_graceful_shutdown=5))
    published: list[Path] = []

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async def announce() -> None:
            while not server.started:
                await asyncio.sleep(0.05)
            port = server.servers[0].sockets[0].getsockname()[1]
            ranks = engine.ranks.size if engine.ranks is not None else 1
            log.info("rollout server %s on %s:%d (backend %s, weights v%d, tokenizer %s, "
                     "%d rank(s): tp %d, ep %d, pp %d)", args.model, args.host, port,
                     engine.backend, engine.weight_version, args.tokenizer or "bytes", ranks,
                     args.tp, args.ep, args.pp)
            if args.rendezvous_dir:
                published.append(announce_endpoint(
                    args.rendezvous_dir, "rollout", args.index, args.host, port))

        task = asyncio.create_task(announce())
        yield
        # Here, not after `server.run()`: uvicorn re-raises SIGTERM once it has shut down.
        task.cancel()
        for path in published:
            path.unlink(missing_ok=True)
        scheduler.close()
        if engine.ranks is not None:  # the followers end with the leader
            with engine.lock:
                engine.ranks.stop()

    app.router.lifespan_context = lifespan
    server.run()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
