"""A classic-BPF seccomp filter, assembled here and handed to `bwrap --seccomp FD`.

bubblewrap loads the program just before it executes the sandboxed command, so the
filter does not get in the way of its own namespace set-up. Denied calls fail with
EPERM rather than killing the process: a program probing for ptrace sees an ordinary
error. Only the ptrace family and kernel attack surface that no test program needs are
denied; everything else is allowed (the other layers hold the rest).
"""

from __future__ import annotations

import errno
import platform
import struct

# struct sock_filter { u16 code; u8 jt; u8 jf; u32 k; } in native byte order.
_INSN = struct.Struct("=HBBI")
_LD_W_ABS = 0x20  # BPF_LD | BPF_W | BPF_ABS
_JEQ_K = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
_JGE_K = 0x35  # BPF_JMP | BPF_JGE | BPF_K
_RET_K = 0x06  # BPF_RET | BPF_K
_RET_ALLOW = 0x7FFF0000
_RET_ERRNO = 0x00050000
_RET_KILL_PROCESS = 0x80000000
# struct seccomp_data { int nr; u32 arch; ... }
_OFFSET_NR = 0
_OFFSET_ARCH = 4
_X32_SYSCALL_BIT = 0x40000000

# (audit arch, {syscall name: number}) per machine.
_DENIED: dict[str, tuple[int, dict[str, int]]] = {
    "x86_64": (
        0xC000003E,
        {
            "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311,
            "perf_event_open": 298, "bpf": 321, "userfaultfd": 323, "keyctl": 250,
            "add_key": 248, "request_key": 249, "kexec_load": 246, "kexec_file_load": 320,
            "init_module": 175, "finit_module": 313, "delete_module": 176, "mount": 165,
            "umount2": 166, "pivot_root": 155, "unshare": 272, "setns": 308, "kcmp": 312,
            "open_by_handle_at": 304, "io_uring_setup": 425,
        },
    ),
    "aarch64": (
        0xC00000B7,
        {
            "ptrace": 117, "process_vm_readv": 270, "process_vm_writev": 271,
            "perf_event_open": 241, "bpf": 280, "userfaultfd": 282, "keyctl": 219,
            "add_key": 217, "request_key": 218, "mount": 40, "umount2": 39,
            "pivot_root": 41, "unshare": 97, "setns": 268, "io_uring_setup": 425,
        },
    ),
}  # fmt: skip


class SeccompUnsupported(RuntimeError):
    pass


def denied_syscalls(machine: str | None = None) -> dict[str, int]:
    machine = machine or platform.machine()
    if machine not in _DENIED:
        raise SeccompUnsupported(
            f"no seccomp filter for machine {machine!r} (supported: {sorted(_DENIED)})"
        )
    return dict(_DENIED[machine][1])


def build_filter(machine: str | None = None) -> bytes:
    """The compiled filter: wrong architecture -> kill; x32 ABI -> EPERM; a denied
    syscall -> EPERM; anything else -> allow."""
    machine = machine or platform.machine()
    numbers = sorted(set(denied_syscalls(machine).values()))
    audit_arch = _DENIED[machine][0]
    # Layout: [0] ld arch, [1] jeq arch, [2] ld nr, [3] x32 check (x86_64 only),
    # then one jeq per denied number, then ret allow, ret errno, ret kill.
    prog: list[tuple[int, int, int, int]] = [(_LD_W_ABS, 0, 0, _OFFSET_ARCH)]
    checks_start = 3 + (1 if machine == "x86_64" else 0)
    allow_at = checks_start + len(numbers)
    errno_at, kill_at = allow_at + 1, allow_at + 2
    prog.append((_JEQ_K, 0, kill_at - 2, audit_arch))
    prog.append((_LD_W_ABS, 0, 0, _OFFSET_NR))
    if machine == "x86_64":
        prog.append((_JGE_K, errno_at - 4, 0, _X32_SYSCALL_BIT))
    for nr in numbers:
        here = len(prog)
        prog.append((_JEQ_K, errno_at - here - 1, 0, nr))
    prog.append((_RET_K, 0, 0, _RET_ALLOW))
    prog.append((_RET_K, 0, 0, _RET_ERRNO | errno.EPERM))
    prog.append((_RET_K, 0, 0, _RET_KILL_PROCESS))
    if max(max(jt, jf) for _, jt, jf, _ in prog) > 255:
        raise SeccompUnsupported("seccomp filter too long for 8-bit jumps")
    return b"".join(_INSN.pack(*insn) for insn in prog)
