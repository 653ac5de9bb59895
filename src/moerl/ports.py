"""A free TCP port on this host for a server or a process group's store to bind.

Ports are drawn at random from below the kernel's ephemeral range
(`/proc/sys/net/ipv4/ip_local_port_range`), never from inside it: a port the kernel
handed out as "free" from that range can be given again, before our server binds it,
to any outgoing connection on the host, and gloo opens many (a 12-rank job on one
machine opens hundreds). A port below the range is taken only by a process that asks
for it by number. One process never hands out the same port twice, so two servers it
starts cannot be given one port before either binds.
"""

from __future__ import annotations

import random
import socket
import threading
from pathlib import Path

EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LINUX_DEFAULT_EPHEMERAL = (32768, 60999)
LOWEST = 10000  # well above the registered services most hosts run
_TRIES = 200

_given: set[int] = set()
_lock = threading.Lock()
_rng = random.SystemRandom()


def ephemeral_range(path: Path = EPHEMERAL_RANGE_FILE) -> tuple[int, int]:
    """The kernel's range for outgoing connections' local ports (inclusive)."""
    try:
        low, high = (int(field) for field in path.read_text().split())
    except (OSError, ValueError):
        return LINUX_DEFAULT_EPHEMERAL
    return low, high


def candidate_ports(ephemeral: tuple[int, int]) -> range:
    """The ports outside `ephemeral` to draw from: below it, or above it when the range
    starts too low to leave room below."""
    low, high = ephemeral
    if low - LOWEST >= 1000:
        return range(LOWEST, low)
    if 65535 - high >= 1000:
        return range(high + 1, 65536)
    return range(0)  # the whole space is ephemeral: let the kernel choose


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def _kernel_choice(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing on `host` listens on now and this process has not handed out."""
    candidates = candidate_ports(ephemeral_range())
    with _lock:
        for _ in range(_TRIES if len(candidates) else 0):
            port = _rng.choice(candidates)
            if port not in _given and _bindable(host, port):
                _given.add(port)
                return port
        port = _kernel_choice(host)
        _given.add(port)
        return port


def listen_port(host: str, port: int) -> int:
    """The port a server given `--port port` binds: `port` itself, or for 0 one drawn by
    `free_port` rather than by the kernel. A port the kernel picks comes from its
    ephemeral range: once the server dies, the next outgoing connection or `port 0`
    listener on the host (an srun's I/O socket, another server) may take it, and a
    client that still holds the address reaches that instead of a refusal."""
    return free_port(host) if port == 0 else port
