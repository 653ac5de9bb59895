"""`moerl serve env`: agent environments behind HTTP, so that the trainer runs no
untrusted code (on a cluster its nodes are CPU nodes of their own).

A session is one `Environment` (default: the sandboxed terminal), used by one episode:

    POST   /sessions                      {"environment": "module:attr"?} -> {"id", "tools"}
    POST   /sessions/{id}/reset           {"task": {...}}                -> observation
    POST   /sessions/{id}/step            {"call": {"name", "arguments"}} -> observation
    POST   /sessions/{id}/verify                                         -> verify result
    POST   /sessions/{id}/snapshot | /restore                            -> {"ok": bool}
    DELETE /sessions/{id}
    GET    /health                        {"status", "sessions", "max_sessions"}

A session's calls run one at a time. One left idle for `--idle-timeout` seconds is
closed (its files removed); a full server answers 429. A call whose environment raises
(the environment crashed, not the model's action) recreates it, restored to the last
snapshot the crashed one handed over (or to its task's start), and answers with a
`fault`: the scheduler treats that as an environment fault, restores and goes on.
Tasks and calls are checked, and replies made safe, per session (env_requests.py).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import secrets
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from moerl.agent.env_requests import (
    BadRequest,
    CallBody,
    TaskBody,
    parse_call,
    parse_task,
    refuse,
    reply,
)
from moerl.agent.environment import (
    AgentTask,
    Environment,
    EnvironmentLoadError,
    Observation,
    load_environment,
)
from moerl.ports import listen_port
from moerl.rendezvous import ENV_INDEX, ENV_RENDEZVOUS, announce
from moerl.sandbox import Sandbox, SandboxConfig, SandboxUnavailable
from moerl.sandbox.preflight import open_checked

log = logging.getLogger(__name__)
TERMINAL = "moerl.agent.terminal:TerminalEnvironment"
T = TypeVar("T")


class SessionBody(BaseModel):
    environment: str = TERMINAL


@dataclass
class Session:
    env: Environment
    path: str
    task: AgentTask | None = None
    touched: float = field(default_factory=time.monotonic)
    lock: threading.Lock = field(default_factory=threading.Lock)


class Sessions:
    """The server's sessions, their idle clock and crash recovery."""

    def __init__(self, sandbox: Sandbox | None, max_sessions: int, idle_timeout_s: float) -> None:
        self.sandbox, self.max_sessions, self.idle_timeout_s = sandbox, max_sessions, idle_timeout_s
        self.live: dict[str, Session] = {}
        self.lock = threading.Lock()
        self.opened = 0
        self.closed_idle = 0
        self.recreated = 0

    def open(self, path: str) -> tuple[str, Session]:
        with self.lock:
            if len(self.live) >= self.max_sessions:
                raise OverflowError(f"this server holds its maximum of {self.max_sessions} "
                                    "sessions; retry or add environment servers")
        env = load_environment(path, self.sandbox)
        sid = secrets.token_hex(8)
        with self.lock:
            self.live[sid] = session = Session(env, path)
            self.opened += 1
        return sid, session

    def get(self, sid: str) -> Session:
        with self.lock:
            session = self.live.get(sid)
        if session is None:
            raise KeyError(f"no session {sid!r} (closed, timed out, or never opened)")
        session.touched = time.monotonic()
        return session

    def close(self, sid: str) -> bool:
        with self.lock:
            session = self.live.pop(sid, None)
        if session is None:
            return False
        with session.lock:
            session.env.close()
        return True

    def close_idle(self) -> int:
        now = time.monotonic()
        with self.lock:
            idle = [sid for sid, s in self.live.items() if now - s.touched > self.idle_timeout_s]
        for sid in idle:
            if self.close(sid):
                self.closed_idle += 1
                log.info("session %s closed after %.0f s idle", sid, self.idle_timeout_s)
        return len(idle)

    def close_all(self) -> None:
        for sid in list(self.live):
            self.close(sid)

    def call(self, sid: str, fn: Callable[[Environment], T], crashed: T) -> T:
        """`fn(env)` under the session's lock; a crash recreates the environment and
        returns `crashed`."""
        session = self.get(sid)
        with session.lock:
            try:
                return fn(session.env)
            except Exception as exc:
                log.exception("environment of session %s crashed; recreating it", sid)
                self._recreate(session, exc)
                return crashed

    def _recreate(self, session: Session, exc: Exception) -> None:
        saved = getattr(session.env, "saved", lambda: None)()
        try:
            session.env.close()
        except Exception:  # the crashed one may not close cleanly; its files go with it
            log.warning("closing the crashed environment failed", exc_info=True)
        session.env = load_environment(session.path, self.sandbox)
        self.recreated += 1
        if saved is not None and hasattr(session.env, "resume"):
            session.env.resume(*saved)
        elif session.task is not None:
            session.env.reset(session.task)


def _crash(what: str) -> Observation:
    return Observation("", fault=f"the environment crashed during {what}; it was recreated")


def create_app(sessions: Sessions) -> FastAPI:
    app = FastAPI(title="moerl environment server")

    def missing(exc: KeyError) -> JSONResponse:
        return JSONResponse({"error": {"message": str(exc.args[0]), "type": "not_found"}}, 404)

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {"status": "ok", "sessions": len(sessions.live), "opened": sessions.opened,
                "max_sessions": sessions.max_sessions, "closed_idle": sessions.closed_idle,
                "recreated": sessions.recreated}

    @app.post("/sessions", response_model=None)
    def open_session(body: SessionBody) -> dict[str, Any] | JSONResponse:
        try:
            sid, session = sessions.open(body.environment)
        except OverflowError as exc:
            return JSONResponse({"error": {"message": str(exc), "type": "full"}}, 429,
                                headers={"Retry-After": "1"})
        except EnvironmentLoadError as exc:
            return JSONResponse({"error": {"message": str(exc), "type": "invalid"}}, 400)
        return {"id": sid, "tools": [asdict(t) for t in session.env.tools]}

    @app.post("/sessions/{sid}/reset", response_model=None)
    def reset(sid: str, body: TaskBody) -> JSONResponse:
        try:
            task = parse_task(body.task)
        except BadRequest as exc:
            return refuse(str(exc))
        try:
            sessions.get(sid).task = task
            return reply(asdict(sessions.call(sid, lambda env: env.reset(task), _crash("reset"))))
        except KeyError as exc:
            return missing(exc)

    @app.post("/sessions/{sid}/step", response_model=None)
    def step(sid: str, body: CallBody) -> JSONResponse:
        try:
            call = parse_call(body.call, sessions.get(sid).env.tools)
            if isinstance(call, Observation):  # the model's malformed call, shown to it
                return reply(asdict(call))
            checked = call
            return reply(asdict(sessions.call(sid, lambda env: env.step(checked),
                                              _crash("a step"))))  # fmt: skip
        except KeyError as exc:
            return missing(exc)

    @app.post("/sessions/{sid}/verify", response_model=None)
    def verify(sid: str) -> JSONResponse:
        try:
            result = sessions.call(sid, lambda env: env.verify(), None)
        except KeyError as exc:
            return missing(exc)
        if result is None:
            return reply({"reward": None, "infra_error": "the environment crashed during "
                          "verification; it was recreated", "details": {}})  # fmt: skip
        return reply(asdict(result))

    @app.post("/sessions/{sid}/{action}", response_model=None)
    def keep(sid: str, action: str) -> dict[str, Any] | JSONResponse:
        if action not in ("snapshot", "restore"):
            return JSONResponse({"error": {"message": f"no action {action!r}",
                                           "type": "not_found"}}, 404)
        try:
            return {"ok": sessions.call(sid, lambda env: getattr(env, action)(), False)}
        except KeyError as exc:
            return missing(exc)

    @app.delete("/sessions/{sid}")
    def close(sid: str) -> dict[str, Any]:
        return {"closed": sessions.close(sid)}

    return app


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="moerl serve env", description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--max-sessions", type=int, default=64)
    parser.add_argument("--idle-timeout", type=float, default=600.0,
                        help="seconds after which an untouched session is closed")
    parser.add_argument("--isolation", choices=["strict", "no-cgroups"], default="strict")
    env_dir = os.environ.get(ENV_RENDEZVOUS)
    parser.add_argument("--rendezvous-dir", type=Path, default=Path(env_dir) if env_dir else None,
                        help="announce host:port here once healthy (default: the launcher's)")
    args = parser.parse_args(argv)
    if args.max_sessions < 1 or args.idle_timeout <= 0:
        parser.error("--max-sessions must be >= 1 and --idle-timeout > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    args = _parse(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:  # a sandbox that cannot run anything is refused now, not per session
        sandbox = open_checked(SandboxConfig(isolation=args.isolation))
    except SandboxUnavailable as exc:
        print(f"error: {exc}", flush=True)
        return 2
    sessions = Sessions(sandbox, args.max_sessions, args.idle_timeout)
    app = create_app(sessions)
    bind_port = listen_port(args.host, args.port)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=bind_port,
                                           log_level="warning", timeout_graceful_shutdown=5))
    published: list[Path] = []

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async def housekeeping() -> None:
            while not server.started:
                await asyncio.sleep(0.05)
            port = server.servers[0].sockets[0].getsockname()[1]
            print(f"environment server listening on {args.host}:{port}", flush=True)
            if args.rendezvous_dir is not None:
                index = int(os.environ.get(ENV_INDEX, "0"))
                published.append(announce(args.rendezvous_dir, "environment", index,
                                          args.host, port))
            while True:
                await asyncio.sleep(min(args.idle_timeout / 4, 5.0))
                await asyncio.to_thread(sessions.close_idle)

        task = asyncio.create_task(housekeeping())
        yield
        task.cancel()
        for path in published:
            path.unlink(missing_ok=True)
        print(f"environment server: {sessions.opened} sessions opened, {sessions.closed_idle} "
              f"closed idle, {sessions.recreated} recreated after a crash", flush=True)
        sessions.close_all()
        sandbox.close()

    app.router.lifespan_context = lifespan
    server.run()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
