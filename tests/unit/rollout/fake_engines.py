"""Small HTTP servers that answer as stock vLLM and SGLang servers do (unit tests only).

The reply shapes follow vLLM's `CompletionResponse` (`vllm/entrypoints/openai/
completion/protocol.py`) and SGLang's `/generate` output (`TokenizerManager.
_handle_batch_output`: `{"text", "output_ids", "meta_info"}` with
`(logprob, token_id, text)` triples); only the fields the client reads are varied.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

Reply = Callable[[str, dict[str, Any]], tuple[int, Any]]


class FakeEngine:
    """Answers POSTs with `reply(path, body) -> (status, json)`; GET /health is 200."""

    def __init__(self, reply: Reply) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self._send(200 if self.path == "/health" else 404, {})

            def do_POST(self) -> None:
                length = int(self.headers.get("content-length", 0))
                body = json.loads(self.rfile.read(length) or b"{}")
                engine.calls.append((self.path, body))
                self._send(*reply(self.path, body))

            def _send(self, status: int, payload: Any) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def vllm_choice(index: int, ids: list[int], logprobs: list[float], finish: str | None,
                prompt_ids: list[int] | None = None, with_ids: bool = True) -> dict[str, Any]:
    """One `CompletionResponseChoice`; `with_ids=False` is a server older than
    `return_token_ids` (ids only in the "token_id:N" strings)."""
    choice: dict[str, Any] = {
        "index": index, "text": "".join(chr(97 + t % 26) for t in ids),
        "logprobs": {
            "text_offset": list(range(len(ids))),
            "token_logprobs": logprobs,
            "tokens": [f"token_id:{t}" for t in ids],
            "top_logprobs": [{f"token_id:{t}": lp} for t, lp in zip(ids, logprobs, strict=True)],
        },
        "finish_reason": finish, "stop_reason": None, "prompt_logprobs": None,
    }
    if with_ids:
        choice.update(token_ids=ids, prompt_token_ids=prompt_ids)
    return choice


def vllm_completion(choices: list[dict[str, Any]]) -> dict[str, Any]:
    tokens = sum(len(c["logprobs"]["tokens"]) for c in choices)
    return {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "policy",
            "choices": choices,
            "usage": {"prompt_tokens": 3, "total_tokens": 3 + tokens, "completion_tokens": tokens}}


def sglang_output(ids: list[int], logprobs: list[float], finish: dict[str, Any],
                  version: str = "default", prompt_ids: list[int] | None = None
                  ) -> dict[str, Any]:
    """One `/generate` output with `return_logprob` (and `return_text_in_logprobs` off)."""
    prompt = prompt_ids or []
    return {
        "text": "".join(chr(97 + t % 26) for t in ids),
        "output_ids": ids,
        "meta_info": {
            "id": "r", "finish_reason": finish, "prompt_tokens": len(prompt),
            "weight_version": version, "completion_tokens": len(ids), "cached_tokens": 0,
            "e2e_latency": 0.01,
            "input_token_logprobs": [[None if k == 0 else -1.0, t, None]
                                     for k, t in enumerate(prompt)],
            "output_token_logprobs": [[lp, t, None]
                                      for lp, t in zip(logprobs, ids, strict=True)],
        },
    }
