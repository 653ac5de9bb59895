"""The client side of the environment servers (`agent.env_server`): an `Environment`
whose state lives in a session on one of them, so the agent scheduler (in the trainer)
runs every command of an episode elsewhere.

The session is opened at `reset`, on the server with the fewest sessions this client
has open (a full server, HTTP 429, is skipped). A server that cannot be reached, or a
session it lost (HTTP 404: closed, timed out), makes the call an environment fault
(an observation's `fault`, a verification's `infra_error`), and the scheduler asks
for a restore. A session whose server is gone is then retried elsewhere: a new
session (on another server where one answers), the task reset and the episode's
actions up to its last snapshot replayed, as the snapshot held them; the scheduler
replays the rest. Only when that fails too is the episode an infra failure, never
the model's.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import httpx

from moerl.agent.environment import AgentTask, Observation, VerifyResult
from moerl.agent.tools import ToolCall, ToolSpec


class EnvironmentServerError(RuntimeError):
    """A call to an environment server failed (unreachable, refused, lost session)."""


class EnvironmentServers:
    """The servers episodes draw sessions from; shared by every episode of a client."""

    def __init__(self, urls: Sequence[str], timeout_s: float = 600.0,
                 environment: str | None = None) -> None:
        if not urls:
            raise ValueError("environment servers: none given (no URLs, none announced)")
        self.urls = [u.rstrip("/") if "://" in u else f"http://{u.rstrip('/')}" for u in urls]
        self.environment = environment
        self.open_sessions = dict.fromkeys(self.urls, 0)
        self._lock = threading.Lock()
        self.http = httpx.Client(timeout=httpx.Timeout(timeout_s, connect=10.0), trust_env=False)

    def open(self, avoid: str | None = None) -> tuple[str, str, tuple[ToolSpec, ...]]:
        """(server URL, session id, its tools) of a new session; `avoid` (a server that
        just failed) is tried last."""
        with self._lock:
            order = sorted(self.urls, key=lambda u: (u == avoid, self.open_sessions[u]))
        body = {} if self.environment is None else {"environment": self.environment}
        refused = []
        for url in order:
            try:
                reply = self.http.post(f"{url}/sessions", json=body)
            except httpx.HTTPError as exc:
                refused.append(f"{url}: {type(exc).__name__}")
                continue
            if reply.status_code != 200:
                refused.append(f"{url}: HTTP {reply.status_code} {reply.text[:200]}")
                continue
            data = reply.json()
            with self._lock:
                self.open_sessions[url] += 1
            tools = tuple(ToolSpec(t["name"], t["description"], t.get("parameters") or {},
                                   tuple(t.get("required") or ())) for t in data["tools"])
            return url, str(data["id"]), tools
        raise EnvironmentServerError(f"no environment server opened a session: {refused}")

    def post(self, url: str, path: str, body: dict[str, Any] | None = None) -> Any:
        try:
            # Encoded here, ASCII-escaped: a tool call's text may hold a lone surrogate
            # (a byte-level decode of the model's tokens), which a UTF-8 encoder refuses.
            reply = self.http.post(f"{url}{path}", content=json.dumps(body or {}).encode(),
                                   headers={"content-type": "application/json"})
        except httpx.HTTPError as exc:
            raise EnvironmentServerError(f"{url}{path}: {type(exc).__name__}: {exc}") from exc
        if reply.status_code != 200:
            raise EnvironmentServerError(f"{url}{path}: HTTP {reply.status_code} "
                                         f"{reply.text[:300]}")
        return reply.json()

    def release(self, url: str, sid: str) -> None:
        with contextlib.suppress(httpx.HTTPError):  # else the server idles it out
            self.http.delete(f"{url}/sessions/{sid}")
        with self._lock:
            self.open_sessions[url] = max(self.open_sessions[url] - 1, 0)

    def close(self) -> None:
        self.http.close()


class RemoteEnvironment:
    """`Environment` over a session of an environment server."""

    def __init__(self, servers: EnvironmentServers) -> None:
        self.servers = servers
        self.url: str | None = None
        self.sid: str | None = None
        self._tools: tuple[ToolSpec, ...] = ()
        self._task: AgentTask | None = None
        self._calls: list[ToolCall] = []  # executed since the reset, to replay elsewhere
        self._at_snapshot = 0  # of them, those the last snapshot holds
        self.moved = 0  # sessions retried on a new session after their server failed

    @property
    def tools(self) -> tuple[ToolSpec, ...]:
        return self._tools

    def _session(self, action: str, body: dict[str, Any] | None = None) -> Any:
        if self.url is None or self.sid is None:
            raise EnvironmentServerError("no session (reset first)")
        return self.servers.post(self.url, f"/sessions/{self.sid}/{action}", body)

    def reset(self, task: AgentTask) -> Observation:
        self._task, self._calls, self._at_snapshot = task, [], 0
        try:
            if self.sid is None:
                self.url, self.sid, self._tools = self.servers.open()
            data = self._session("reset", _task_body(task))
        except EnvironmentServerError as exc:
            return Observation("", fault=str(exc))
        return Observation(**data)

    def step(self, call: ToolCall) -> Observation:
        try:
            data = self._session("step", _call_body(call))
        except EnvironmentServerError as exc:
            return Observation("", fault=str(exc))
        self._calls.append(call)
        return Observation(**data)

    def verify(self) -> VerifyResult:
        try:
            data = self._session("verify")
        except EnvironmentServerError as exc:
            # once more elsewhere, in the state of every action so far
            if not self._retry_elsewhere(len(self._calls)):
                return VerifyResult(None, infra_error=str(exc))
            try:
                data = self._session("verify")
            except EnvironmentServerError as again:
                return VerifyResult(None, infra_error=str(again))
        return VerifyResult(**data)

    def snapshot(self) -> bool:
        try:
            saved = bool(self._session("snapshot")["ok"])
        except EnvironmentServerError:
            return False
        if saved:
            self._at_snapshot = len(self._calls)
        return saved

    def restore(self) -> bool:
        try:
            restored = bool(self._session("restore")["ok"])
        except EnvironmentServerError:
            return self._retry_elsewhere(self._at_snapshot)
        if restored:
            del self._calls[self._at_snapshot:]
        return restored

    def _retry_elsewhere(self, replay: int) -> bool:
        """A new session (another server first) in the state of the first `replay`
        actions: the task reset, those actions run again. False if none could."""
        if self._task is None:
            return False
        failed, calls = self.url, self._calls[:replay]
        self.close()
        try:
            self.url, self.sid, self._tools = self.servers.open(avoid=failed)
            self._session("reset", _task_body(self._task))
            for call in calls:
                self._session("step", _call_body(call))
            self._calls, self._at_snapshot = calls, len(calls)
            if replay and not self._session("snapshot")["ok"]:
                self._at_snapshot = 0
        except EnvironmentServerError:
            return False
        self.moved += 1
        return True

    def close(self) -> None:
        if self.url is not None and self.sid is not None:
            self.servers.release(self.url, self.sid)
        self.url = self.sid = None


def _task_body(task: AgentTask) -> dict[str, Any]:
    return {"task": {**asdict(task), "files": dict(task.files)}}


def _call_body(call: ToolCall) -> dict[str, Any]:
    return {"call": {"name": call.name, "arguments": dict(call.arguments)}}
