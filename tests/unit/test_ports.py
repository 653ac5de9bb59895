"""Free ports come from outside the kernel's ephemeral range, never twice to one process,
and never one something listens on."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from moerl import ports


def test_ports_come_from_below_the_ephemeral_range_and_never_twice() -> None:
    low, high = ports.ephemeral_range()
    given = [ports.free_port() for _ in range(200)]
    assert len(set(given)) == len(given)
    assert all(not low <= port <= high for port in given)


def test_a_listening_port_is_never_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as listener, socket.socket() as probe:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        taken = listener.getsockname()[1]
        probe.bind(("127.0.0.1", 0))
        free = probe.getsockname()[1]
        probe.close()
        monkeypatch.setattr(ports, "candidate_ports", lambda _: [taken, free])
        assert ports.free_port() == free
        # Only the listening port is left: the kernel's choice, as the last resort.
        monkeypatch.setattr(ports, "candidate_ports", lambda _: [taken])
        assert ports.free_port() not in {taken, free}


@pytest.mark.parametrize(("ephemeral", "expected"), [
    ((32768, 60999), range(10000, 32768)),  # Linux's default: below it
    ((1024, 60000), range(60001, 65536)),  # a range from 1024 up: above it
    ((1024, 65535), range(0)),  # everything ephemeral: the kernel chooses
])
def test_candidates_avoid_the_ephemeral_range(ephemeral: tuple[int, int],
                                              expected: range) -> None:
    assert ports.candidate_ports(ephemeral) == expected


def test_the_range_is_read_from_the_kernel_file(tmp_path: Path) -> None:
    path = tmp_path / "range"
    path.write_text("20000\t40000\n")
    assert ports.ephemeral_range(path) == (20000, 40000)
    assert ports.ephemeral_range(tmp_path / "missing") == ports.LINUX_DEFAULT_EPHEMERAL


def test_a_server_given_port_0_listens_outside_the_kernels_ephemeral_range() -> None:
    low, high = ports.ephemeral_range()
    chosen = {ports.listen_port("127.0.0.1", 0) for _ in range(20)}
    assert len(chosen) == 20 and not any(low <= port <= high for port in chosen)
    assert ports.listen_port("127.0.0.1", 8123) == 8123
