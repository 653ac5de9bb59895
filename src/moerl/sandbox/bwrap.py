"""The bubblewrap command line and the launcher that puts it in its cgroups with rlimits."""

from __future__ import annotations

import os
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from moerl.sandbox.config import Limits, SandboxConfig

SANDBOX_WORKDIR = "/work"
CHANNEL_ENV_NAME = "MOERL_CHANNEL_FD"
"""Names the fd of the result channel inside: a pipe only the grader outside reads."""

# bwrap itself runs with exactly this environment: inside its pid namespace it is pid 1
# and /proc/1/environ is readable by the program, so nothing from the host may be in it.
LAUNCH_ENV = {"PATH": "/usr/bin:/bin"}
_SANDBOX_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "HOME": SANDBOX_WORKDIR,
    "TMPDIR": "/tmp",
    "LANG": "C.UTF-8",
    "PYTHONDONTWRITEBYTECODE": "1",
}
_TMPFS_BYTES = 64 << 20


def _root_entries() -> list[str]:
    """/bin, /lib, ... as links into /usr where the host merged them, else bound."""
    args: list[str] = []
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        host = Path("/") / name
        if host.is_symlink():
            args += ["--symlink", os.readlink(host), str(host)]
        elif host.is_dir():
            args += ["--ro-bind", str(host), str(host)]
    return args


def bwrap_argv(
    config: SandboxConfig,
    workdir: Path,
    argv: Sequence[str],
    *,
    seccomp_fd: int,
    status_fd: int,
    extra_ro_binds: Sequence[tuple[Path, str]] = (),
) -> list[str]:
    """bwrap with every namespace unshared (network included), the unprivileged uid, no
    capabilities, a new session (no TIOCSTI on the caller's terminal), death with the
    parent, and a filesystem of read-only runtime files, a tmpfs /tmp and one writable
    work dir. bwrap writes `{"child-pid": N}` to `status_fd`: N is its pid 1 inside,
    the one process of the execution that is not the program's."""
    args = [
        config.bwrap_path,
        "--unshare-all",
        "--uid", str(config.sandbox_uid),
        "--gid", str(config.sandbox_gid),
        "--cap-drop", "ALL",
        "--die-with-parent",
        "--new-session",
        "--clearenv",
        "--hostname", "sandbox",
        "--json-status-fd", str(status_fd),
    ]  # fmt: skip
    for key, value in _SANDBOX_ENV.items():
        args += ["--setenv", key, value]
    for path in config.ro_binds:
        args += ["--ro-bind", path, path]
    args += _root_entries()
    for path in config.etc_files:
        args += ["--ro-bind-try", path, path]
    for host, inside in extra_ro_binds:
        args += ["--ro-bind", str(host), inside]
    args += ["--proc", "/proc", "--dev", "/dev"]
    args += ["--size", str(_TMPFS_BYTES), "--tmpfs", "/tmp"]
    args += ["--bind", str(workdir), SANDBOX_WORKDIR, "--chdir", SANDBOX_WORKDIR]
    # The root is bwrap's private tmpfs: make it read-only so that no write lands
    # anywhere but /work and /tmp, even in memory.
    args += ["--remount-ro", "/", "--seccomp", str(seccomp_fd)]
    return [*args, "--", *argv]


@dataclass(frozen=True)
class StarterFds:
    """The fds (numbers inside) the starter is handed, besides bwrap's own stdio."""

    started: int
    stdout: int
    stderr: int
    channel: int | None = None
    gate: int | None = None


GATE_BYTES = b"G\n"
"""What opens a warm slot's gate (a line: the waiter is dash, whose `read` takes lines)."""


def starter_argv(fds: StarterFds, argv: Sequence[str]) -> list[str]:
    """The first process inside: it makes `fds.stdout`/`fds.stderr` its stdout and
    stderr, writes one byte to `fds.started`, closes it and execs the program. A byte
    there proves bwrap finished its set-up, so a failure without it is the sandbox's
    (an infra error), and one with it is the program's. The program cannot fake either:
    the pipe is closed before it runs. With `fds.gate` (a warm slot) it then waits for
    `GATE_BYTES` on that pipe before the exec, and exits without running the program
    when the pipe closes first.

    The program's output pipes are not bwrap's stdio: bwrap's monitor and pid 1 close
    every fd but their stdio, so the program's pipes reach EOF when the program's last
    process is gone, not when pid 1 has finished unmounting the namespaces (bwrap's
    own messages go to its stderr, a pipe of their own). bash, because dash cannot
    redirect fds above 9; but a warm slot waits in dash: the exec that starts the
    program tears the waiter's memory down, and dash has less of it (~0.15 ms here)."""
    script = f"exec 1>&{fds.stdout} 2>&{fds.stderr} {fds.stdout}>&- {fds.stderr}>&- && "
    if fds.channel is not None:
        script += f"export {CHANNEL_ENV_NAME}={fds.channel} && "
    if fds.gate is None:
        script += f'printf S >&{fds.started} && exec {fds.started}>&- && exec "$@"'
        return ["/bin/bash", "--norc", "--noprofile", "-c", script, "moerl-start", *argv]
    gate, started = _free_low_fds(fds)
    script += f"exec {gate}<&{fds.gate} {started}>&{fds.started} "
    script += f"{fds.gate}<&- {fds.started}>&- && "
    wait = f"printf S >&{started} && exec {started}>&- && read _ <&{gate} && exec {gate}<&- && "
    script += f'exec /bin/sh -c {shlex.quote(wait + 'exec "$@"')} moerl-wait "$@"'
    return ["/bin/bash", "--norc", "--noprofile", "-c", script, "moerl-start", *argv]


def _free_low_fds(fds: StarterFds) -> tuple[int, int]:
    """Two fds from 3-9 (all dash can name) that none of the starter's pipes uses."""
    taken = {fds.started, fds.stdout, fds.stderr, fds.channel, fds.gate}
    free = [fd for fd in range(3, 10) if fd not in taken]
    return free[0], free[1]


def rlimit_commands(limits: Limits) -> list[str]:
    """`ulimit` lines for /bin/sh (dash takes one limit per call). RLIMIT_AS is a
    backstop above the cgroup memory limit: address space counts untouched mappings, so
    setting it at the limit itself would fail programs that never use the memory."""
    address_space_kb = (2 * limits.memory_mb + 512) * 1024
    return [
        f"ulimit -t {max(1, round(limits.cpu_time_s))}",
        f"ulimit -v {address_space_kb}",
        f"ulimit -f {limits.max_file_size_mb * 2048}",  # 512-byte blocks in dash
        "ulimit -c 0",
        "ulimit -n 1024",
    ]


def drop_privileges_argv(config: SandboxConfig) -> list[str]:
    """Run as root, bwrap would map the sandbox uid back to host uid 0: without
    capabilities, but still the owner of every root-owned file it can see. setpriv makes
    the whole tree a real unprivileged host uid before bwrap starts."""
    if os.geteuid() != 0:
        return []
    uid, gid = str(config.sandbox_uid), str(config.sandbox_gid)
    return [config.setpriv_path, "--reuid", uid, "--regid", gid, "--clear-groups"]


def launcher_argv(procs_files: Sequence[Path], limits: Limits, command: Sequence[str]) -> list[str]:
    """A tiny sh that joins the cgroups and sets rlimits, then execs the command (same pid).

    Joining before exec means every process bwrap starts is born inside the groups; doing
    it from the parent after the start would race with the first fork. A shell is used
    instead of a Python pre-exec hook because those are unsafe in a threaded server."""
    steps = [f"echo $$ > {shlex.quote(str(p))}" for p in procs_files]
    steps += rlimit_commands(limits)
    steps.append('exec "$@"')
    return ["/bin/sh", "-c", " && ".join(steps), "sandbox-launcher", *command]
