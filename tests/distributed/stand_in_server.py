"""Serving a stand-in engine's FastAPI app on a free local port for one test."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn
from fastapi import FastAPI

from moerl.ports import free_port
from moerl.rendezvous import wait_healthy


@contextmanager
def serving(app: FastAPI) -> Iterator[str]:
    """`app` on 127.0.0.1 in a thread; yields its URL once /health answers."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, timeout=30)
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=10)
