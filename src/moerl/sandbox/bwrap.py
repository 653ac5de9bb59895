"""The bubblewrap command line and the launcher that puts it in its cgroups with rlimits."""

from __future__ import annotations

import os
import shlex
from collections.abc import Sequence
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
    extra_ro_binds: Sequence[tuple[Path, str]] = (),
) -> list[str]:
    """bwrap with every namespace unshared (network included), the unprivileged uid, no
    capabilities, a new session (no TIOCSTI on the caller's terminal), death with the
    parent, and a filesystem of read-only runtime files, a tmpfs /tmp and one writable
    work dir."""
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


def starter_argv(started_fd: int, channel_fd: int | None, argv: Sequence[str], *,
                 gate_fd: int | None = None) -> list[str]:
    """The first process inside: it writes one byte to `started_fd`, closes it and execs
    the program. A byte there proves bwrap finished its set-up, so a failure without it
    is the sandbox's (an infra error), and one with it is the program's. The program
    cannot fake either: the pipe is closed before it runs. With `gate_fd` (a warm slot)
    it then waits for one byte on that pipe before the exec, and exits without running
    the program when the pipe closes empty. bash, not dash, because dash cannot
    redirect to fds above 9."""
    script = f"printf S >&{started_fd} && exec {started_fd}>&- && "
    if gate_fd is not None:
        script += f"IFS= read -r -n 1 -u {gate_fd} _ && exec {gate_fd}<&- && "
    if channel_fd is not None:
        script += f"export {CHANNEL_ENV_NAME}={channel_fd} && "
    return ["/bin/bash", "--norc", "--noprofile", "-c", script + 'exec "$@"', "moerl-start", *argv]


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
