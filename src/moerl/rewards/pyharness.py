"""Runs inside the sandbox (system Python 3.11, standard library only): HumanEval-style
tests with the grader and the candidate in separate processes, and (`pyharness.py check`)
the checks of the agent's terminal tasks (`check_main`).

    grader process (this file, no argument)     candidate process (this file, `candidate`)
      holds the tests and the nonce               runs prompt + completion
      non-dumpable: its memory, fds and           answers calls to the entry point with
      environ are closed to the candidate         values encoded as plain data
      writes one record per test to the
      result channel, which only it holds

The candidate is forked from the grader before the grader reads its stdin (the
tests and the nonce): its copy of the grader's memory holds nothing but this file,
and it closes stdin and the channel before the program is compiled. So it never
shares memory with the tests: it cannot read the expected values, the nonce or the
channel, and what it returns is rebuilt here from plain data, so an
object whose `==` always returns True cannot reach an assert. Exiting early
(`exit(0)`, `os._exit(0)`) only leaves tests without a passing record, and printed
"PASSED" lines go to stdout, which nobody grades. Each top-level statement of `check`
that contains an assert is one test; the grader outside counts them itself.
"""

from __future__ import annotations

import _signal
import ast
import builtins
import marshal
import os
import struct
import sys
import time

# Start-up time is most of an item's cost, so only modules that cost little are
# imported (no json, re or typing); ctypes is imported by the grader after the fork.
# Messages are Python literals: `repr` writes them, `ast.literal_eval` (which builds
# no object but literals) reads them. The config arrives on stdin as marshal data from
# the host. The interpreter runs with `-I -S`.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

_CANDIDATE_ENV = {"PATH": "/usr/bin:/bin", "HOME": "/work", "LANG": "C.UTF-8"}

# sandbox/bwrap.py's CHANNEL_ENV_NAME (this file imports nothing of moerl; a test checks
# the two agree).
CHANNEL_ENV_NAME = "MOERL_CHANNEL_FD"
_PR_SET_DUMPABLE = 4

_HEADER = struct.Struct(">I")
_MAX_DEPTH = 200


def encode(value: Any, depth: int = 0) -> Any:
    """Plain data only, by exact type: subclasses (and their overridden `==`) are refused."""
    if depth > _MAX_DEPTH:
        raise TypeError("value nested too deeply")
    kind = type(value)
    if value is None:
        return ["N"]
    if kind is bool:
        return ["b", value]
    if kind is int:
        return ["i", hex(value)]  # hex has no digit limit, unlike str(int)
    if kind is float:
        return ["f", value.hex()]  # exact, and inf/nan are literals this way
    if kind is str:
        return ["s", value]
    if kind is bytes:
        return ["y", value.hex()]
    if kind is complex:
        return ["c", [value.real.hex(), value.imag.hex()]]
    tags: dict[type, str] = {list: "l", tuple: "t", set: "S", frozenset: "F"}
    if kind in tags:
        return [tags[kind], [encode(v, depth + 1) for v in value]]
    if kind is dict:
        return ["d", [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in value.items()]]
    raise TypeError(f"cannot return a value of type {kind.__name__}")


_SIMPLE: dict[str, Any] = {
    "N": lambda b: None, "b": bool, "i": lambda b: int(b, 16), "f": float.fromhex, "s": str,
    "y": bytes.fromhex, "c": lambda b: complex(float.fromhex(b[0]), float.fromhex(b[1])),
}  # fmt: skip
_CONTAINERS: dict[str, Any] = {"l": list, "t": tuple, "S": set, "F": frozenset}


def decode(wire: Any) -> Any:
    """Rebuild a value from plain data; only builtin types can come out."""
    tag, body = wire[0], wire[1] if len(wire) > 1 else None
    if tag in _SIMPLE:
        return _SIMPLE[tag](body)
    if tag in _CONTAINERS:
        return _CONTAINERS[tag](decode(v) for v in body or ())
    if tag == "d":
        return {decode(k): decode(v) for k, v in body or ()}
    raise ValueError(f"bad wire tag {tag!r}")


def send(fd: int, message: Any) -> None:
    data = repr(message).encode()
    os.write(fd, _HEADER.pack(len(data)))
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def receive(fd: int) -> Any:
    def exactly(n: int) -> bytes:
        chunks = bytearray()  # grows in place: linear in n, unlike bytes concatenation
        while len(chunks) < n:
            chunk = os.read(fd, n - len(chunks))
            if not chunk:
                raise EOFError("peer closed")
            chunks += chunk
        return bytes(chunks)

    (length,) = _HEADER.unpack(exactly(_HEADER.size))
    return ast.literal_eval(exactly(length).decode())


def candidate_main(req_fd: int, resp_fd: int) -> None:
    source, entry_point = receive(req_fd)
    namespace: dict[str, Any] = {"__name__": "__candidate__"}
    try:
        code = compile(source, "<completion>", "exec")
    except (SyntaxError, ValueError) as exc:
        send(resp_fd, ["compile_error", f"{type(exc).__name__}: {exc}"])
        return
    try:
        exec(code, namespace)
        function = namespace[entry_point]
    except BaseException as exc:
        send(resp_fd, ["load_error", f"{type(exc).__name__}: {exc}"])
        return
    send(resp_fd, ["ready"])
    while True:
        try:
            args, kwargs = receive(req_fd)
        except EOFError:
            return
        try:
            result = function(*decode(args), **decode(kwargs))
            send(resp_fd, ["ok", encode(result)])
        except BaseException as exc:
            send(resp_fd, ["raise", type(exc).__name__, str(exc)[:500]])


class Candidate:
    """The grader's handle on the candidate process; calling it calls the entry point."""

    def __init__(self, channel: int) -> None:
        """Fork the candidate. Call this before reading anything the candidate must not
        see: the child closes stdin and `channel`, then waits for its program."""
        req_r, self.req_w = os.pipe()
        self.resp_r, resp_w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # the candidate: nothing untrusted runs before the closes
            try:
                os.close(self.req_w)
                os.close(self.resp_r)
                os.close(channel)
                null = os.open(os.devnull, os.O_RDONLY)
                os.dup2(null, 0)  # stdin carries the grader's config
                os.close(null)
                os.environ.clear()
                os.environ.update(_CANDIDATE_ENV)
                # CPython ignores SIGXFSZ (a write past the file-size limit fails with
                # EFBIG); the default action kills the candidate, so the limit is seen.
                _signal.signal(_signal.SIGXFSZ, _signal.SIG_DFL)
                candidate_main(req_r, resp_w)
            finally:
                os._exit(0)
        os.close(req_r)
        os.close(resp_w)
        self.state: list[Any] = ["load_error", "candidate not loaded"]
        self.dead = True

    def reap(self) -> int | None:
        """End the candidate (its end of the request pipe closes, so it returns) and
        wait for it; one that does not exit within a second is killed. Returns the signal
        that ended it, or None for a normal exit."""
        os.close(self.req_w)
        # It exits within microseconds of the close: poll from 0.2 ms up, not a fixed nap.
        delay, deadline = 0.0002, time.monotonic() + 1.0
        while time.monotonic() < deadline:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                return os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
            time.sleep(delay)
            delay = min(2 * delay, 0.05)
        os.kill(self.pid, 9)
        os.waitpid(self.pid, 0)
        return None

    def load(self, source: str, entry_point: str) -> None:
        try:
            send(self.req_w, [source, entry_point])
            self.state = receive(self.resp_r)
        except (EOFError, BrokenPipeError):
            self.state = ["load_error", "candidate exited while loading"]
        self.dead = self.state[0] != "ready"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.dead:
            raise RuntimeError("candidate process is not running")
        try:
            send(self.req_w, [encode(list(args)), encode(dict(kwargs))])
            reply = receive(self.resp_r)
        except (EOFError, BrokenPipeError):
            self.dead = True
            raise RuntimeError("candidate process exited") from None
        if reply[0] == "ok":
            return decode(reply[1])
        error = getattr(builtins, reply[1], None)
        if isinstance(error, type) and issubclass(error, Exception):
            raise error(reply[2])
        raise RuntimeError(f"{reply[1]}: {reply[2]}")


def take_channel() -> int:
    """The result channel's fd, taken out of the environment and kept from exec'd
    children: only this process can write a verdict."""
    channel = int(os.environ.pop(CHANNEL_ENV_NAME))
    os.set_inheritable(channel, False)
    return channel


def forbid_dumping() -> None:
    """Children of the same uid can no longer open this process's /proc files (its
    memory, fds and environ)."""
    import ctypes

    ctypes.CDLL(None).prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)


def grader_main() -> None:
    channel = take_channel()
    candidate = Candidate(channel)  # before stdin is read: see the module's docstring
    forbid_dumping()
    config = marshal.loads(sys.stdin.buffer.read())
    nonce = config["nonce"]

    def emit(record: dict[str, Any]) -> None:
        os.write(channel, (repr({"nonce": nonce, **record}) + "\n").encode())

    namespace: dict[str, Any] = {"__name__": "__grader__"}
    # Helpers the tests use (e.g. `poly`) come from the trusted prompt, not the model.
    try:  # noqa: SIM105 (importing contextlib costs start-up time)
        exec(compile(config["prompt"], "<prompt>", "exec"), namespace)
    except BaseException:  # a prompt that does not run only loses its helpers
        pass
    module = ast.parse(config["test"])
    check = next(n for n in module.body if isinstance(n, ast.FunctionDef) and n.name == "check")
    try:  # the dataset's own code, run before the candidate loads: its errors are the data's
        exec(compile(ast.Module([n for n in module.body if n is not check], []), "<test>",
                     "exec"), namespace)  # fmt: skip
    except BaseException as exc:
        emit({"kind": "test_error", "error": f"{type(exc).__name__}: {exc}"[:2000]})
        return
    candidate.load(config["program"], config["entry_point"])
    emit({"kind": "load", "state": candidate.state[0], "error": candidate.state[-1][:2000]})
    # As in HumanEval's own runner, the tests may name the entry point directly.
    namespace[check.args.args[0].arg] = namespace[config["entry_point"]] = candidate
    index = 0
    for statement in check.body:
        error = None
        try:
            exec(compile(ast.Module([statement], []), "<check>", "exec"), namespace)
        except BaseException as exc:
            error = f"{type(exc).__name__}: {exc}"[:500]
        if any(isinstance(node, ast.Assert) for node in ast.walk(statement)):
            emit({"kind": "test", "index": index, "passed": error is None, "error": error})
            index += 1
    emit({"kind": "candidate_exit", "signal": candidate.reap()})
    emit({"kind": "done"})


def _run(argv: list[str], timeout: float = 10.0, stdin: str = "") -> tuple[int | None, str]:
    """A terminal check's `run`: agent-written code in a child, (exit code, stdout+stderr);
    the code is None on a timeout or when the program cannot be started (never built)."""
    import subprocess

    try:
        done = subprocess.run(argv, input=stdin, capture_output=True, text=True,
                              errors="replace", timeout=timeout, close_fds=True, cwd="/work")
    except subprocess.TimeoutExpired:
        return None, "timeout"
    except OSError as exc:
        return None, f"cannot start: {exc}"
    return done.returncode, done.stdout + done.stderr


def _read(path: str, limit: int = 1 << 20) -> str | None:
    """A terminal check's `read`: the text of a regular file in /work (symlinks and
    devices refused), or None."""
    import stat

    try:
        fd = os.open(os.path.join("/work", path), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as fh:
        if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
            return None
        return fh.read(limit).decode("utf-8", "replace")


def check_main() -> None:
    """A terminal task's `check()` run against the episode's /work. stdin: the nonce on
    its first line, then the check's source; the verdict (JSON with the nonce and a
    score in [0, 1], or an error) goes to the channel, which agent code started by the
    check (`run`) never gets, nor stdin."""
    import json

    forbid_dumping()
    channel = take_channel()
    nonce = sys.stdin.readline().strip()
    source = sys.stdin.read()
    verdict: dict[str, Any] = {"nonce": nonce}
    try:
        scope: dict[str, Any] = {"run": _run, "read": _read, "__name__": "moerl_check"}
        exec(compile(source, "check.py", "exec"), scope)
        value = scope["check"]()
        if type(value) is bool:
            verdict["score"] = 1.0 if value else 0.0
        elif type(value) in (int, float) and 0 <= value <= 1:
            verdict["score"] = float(value)
        else:
            raise TypeError(f"check() returned {type(value).__name__}, not bool or [0, 1]")
    except BaseException as exc:
        verdict["score"] = 0.0
        verdict["error"] = repr(exc)[:500]
    os.write(channel, json.dumps(verdict).encode())


if __name__ == "__main__":
    if sys.argv[1:2] == ["candidate"]:
        candidate_main(int(sys.argv[2]), int(sys.argv[3]))
    elif sys.argv[1:2] == ["check"]:
        check_main()
    else:
        grader_main()
