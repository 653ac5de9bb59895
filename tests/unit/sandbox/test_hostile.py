"""RELIABILITY.md sandbox cases 1-7, 10 and 12 against the real sandbox (bubblewrap,
cgroups, rlimits, seccomp). Each test also checks the host is left clean."""

import os
import socket
import subprocess
import textwrap
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from proc_scan import processes_with

from moerl.sandbox import ExecutionResult, ExecutionStatus, Limits, Sandbox

pytestmark = pytest.mark.sandbox
PY = "/usr/bin/python3"


def run_py(sandbox: Sandbox, source: str, **kw: object) -> ExecutionResult:
    with sandbox.workspace() as ws:
        ws.write("main.py", textwrap.dedent(source))
        return sandbox.run([PY, "-I", "main.py"], ws, **kw)  # type: ignore[arg-type]


def assert_no_sandbox_groups_left(sandbox: Sandbox) -> None:
    sandbox.wait_cleanup()  # groups are removed in the background after the result
    assert sandbox.layout is not None
    for base in sandbox.layout.bases.values():
        mine = [p for p in base.iterdir() if p.name.startswith(f"{os.getpid()}-")]
        assert mine == [], f"leftover cgroups {mine}"


def test_identity_capabilities_seccomp_and_clean_environment(sandbox: Sandbox) -> None:
    os.environ["MOERL_HOST_SECRET"] = "hunter2"
    try:
        r = run_py(
            sandbox,
            """
            import ctypes, os
            status = open('/proc/self/status').read()
            libc = ctypes.CDLL(None, use_errno=True)
            rc = libc.ptrace(16, 1, 0, 0)  # PTRACE_ATTACH to bwrap (pid 1)
            print(os.getuid(), 'CapEff:\\t0000000000000000' in status,
                  'Seccomp:\\t2' in status, rc, ctypes.get_errno())
            print(open('/proc/1/environ', 'rb').read(), dict(os.environ))
        """,
        )
    finally:
        del os.environ["MOERL_HOST_SECRET"]
    assert r.status is ExecutionStatus.OK, r
    first, rest = r.text().split("\n", 1)
    assert first == "65534 True True -1 1"  # ptrace fails with EPERM
    assert "hunter2" not in rest and "MOERL_HOST_SECRET" not in rest


def test_fork_bomb_is_contained_by_the_pids_limit(sandbox: Sandbox) -> None:
    r = run_py(
        sandbox,
        """
        import os
        while True:
            try:
                os.fork()
            except OSError:
                pass
    """,
        limits=Limits(wall_time_s=2, max_processes=16),
    )
    assert "pids" in r.limits_hit
    assert r.status is ExecutionStatus.TIMEOUT
    assert_no_sandbox_groups_left(sandbox)
    assert subprocess.run(["true"]).returncode == 0  # the host can still fork


def test_memory_bomb_is_killed_at_the_memory_limit(sandbox: Sandbox) -> None:
    r = run_py(
        sandbox,
        """
        chunks = []
        while True:
            chunks.append(b'x' * (8 << 20))
    """,
        limits=Limits(memory_mb=96),
    )
    assert r.status is ExecutionStatus.MEMORY_LIMIT, r
    assert "memory" in r.limits_hit
    assert r.peak_memory_bytes is not None and r.peak_memory_bytes <= (96 << 20) + (1 << 20)


def test_infinite_output_is_capped_and_flagged(sandbox: Sandbox) -> None:
    r = run_py(
        sandbox,
        """
        import sys
        while True:
            sys.stdout.write('x' * 65536)
            sys.stderr.write('y' * 65536)
    """,
        limits=Limits(max_output_bytes=100_000),
    )
    assert r.status is ExecutionStatus.OUTPUT_LIMIT
    assert r.stdout_truncated or r.stderr_truncated
    assert len(r.stdout) <= 100_000 and len(r.stderr) <= 100_000
    assert r.wall_time_s < 3


@pytest.mark.parametrize("body", ["while True: pass", "import time; time.sleep(100)"])
def test_infinite_loop_and_sleep_end_as_timeout_at_the_wall_limit(
    sandbox: Sandbox, body: str
) -> None:
    r = run_py(sandbox, body, limits=Limits(wall_time_s=1, cpu_time_s=5))
    assert r.status is ExecutionStatus.TIMEOUT and "wall_time" in r.limits_hit
    assert 0.9 <= r.wall_time_s < 2.5


def test_cpu_time_limit_is_reported_as_timeout(sandbox: Sandbox) -> None:
    r = run_py(sandbox, "while True: pass", limits=Limits(wall_time_s=5, cpu_time_s=1))
    assert r.status is ExecutionStatus.TIMEOUT and "cpu_time" in r.limits_hit
    assert r.wall_time_s < 4


def test_requested_huge_limit_is_clamped_to_the_configured_maximum(sandbox: Sandbox) -> None:
    # The fixture's maximum wall time is 5 s; the model asks for 1e9.
    t0 = time.monotonic()
    r = run_py(sandbox, "import time; time.sleep(1000)", limits=Limits(wall_time_s=1e9))
    assert r.status is ExecutionStatus.TIMEOUT
    assert time.monotonic() - t0 < 7


def test_setsid_daemons_are_killed_at_teardown(sandbox: Sandbox) -> None:
    marker = f"moerl-daemon-{uuid.uuid4().hex}"
    r = run_py(
        sandbox,
        f"""
        import os, subprocess
        subprocess.Popen(['setsid', '{PY}', '-c', 'import time; time.sleep(1000)', '{marker}'])
        if os.fork() == 0:  # classic double-fork daemon
            os.setsid()
            if os.fork() == 0:
                os.execv('{PY}', ['{PY}', '-c', 'import time; time.sleep(1000)', '{marker}'])
            os._exit(0)
        import time; time.sleep(0.3)
        print('spawned')
    """,
    )
    assert r.status is ExecutionStatus.OK and r.text() == "spawned\n"
    assert processes_with(marker) == []
    assert_no_sandbox_groups_left(sandbox)
    zombies = [
        p for p in Path("/proc").iterdir()
        if p.name.isdigit() and _zombie_child_of_me(p)
    ]  # fmt: skip
    assert zombies == []


def _zombie_child_of_me(proc: Path) -> bool:
    try:
        fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return fields[0] == "Z" and int(fields[1]) == os.getpid()


def test_no_network_even_to_a_listener_on_loopback(sandbox: Sandbox) -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    r = run_py(
        sandbox,
        f"""
        import socket
        for host in ('127.0.0.1', '10.0.0.1'):
            try:
                socket.create_connection((host, {port}), timeout=1)
                print('connected', host)
            except OSError as exc:
                print('failed', host, type(exc).__name__)
    """,
    )
    with pytest.raises(TimeoutError):
        listener.accept()
    listener.close()
    assert r.status is ExecutionStatus.OK
    assert "connected" not in r.text() and r.text().count("failed") == 2


def test_host_secrets_unreadable_and_writes_outside_work_dir_fail(sandbox: Sandbox) -> None:
    host_tmp_marker = f"moerl-escape-{uuid.uuid4().hex}"
    r = run_py(
        sandbox,
        f"""
        import os
        def attempt(label, fn):
            try:
                fn(); print(label, 'ALLOWED')
            except OSError as exc:
                print(label, 'denied')
        attempt('shadow', lambda: open('/etc/shadow').read())
        attempt('root', lambda: os.listdir('/root'))
        attempt('repo', lambda: open('{Path.cwd() / "pyproject.toml"}').read())
        attempt('usr', lambda: open('/usr/moerl-escape', 'w').write('x'))
        attempt('etc', lambda: open('/etc/moerl-escape', 'w').write('x'))
        attempt('root-dir', lambda: open('/moerl-escape', 'w').write('x'))
        open('/tmp/{host_tmp_marker}', 'w').write('x')  # private tmpfs
        open('/work/out.txt', 'w').write('kept')
    """,
    )
    assert r.status is ExecutionStatus.OK, r
    assert "ALLOWED" not in r.text() and r.text().count("denied") == 6
    assert not Path("/tmp", host_tmp_marker).exists()
    assert not Path("/usr/moerl-escape").exists() and not Path("/etc/moerl-escape").exists()


def test_file_size_limit(sandbox: Sandbox) -> None:
    with sandbox.workspace() as ws:
        r = sandbox.run(["/bin/sh", "-c", "head -c 3000000 /dev/zero > big"], ws,
                        limits=Limits(max_file_size_mb=1))  # fmt: skip
        assert "file_size" in r.limits_hit and r.status is ExecutionStatus.RUNTIME_ERROR
        assert (ws.path / "big").stat().st_size <= 1 << 20


def test_concurrent_runs_never_see_each_others_files(sandbox: Sandbox) -> None:
    def one(i: int) -> str:
        secret = f"secret-{i}-{uuid.uuid4().hex}"
        with sandbox.workspace() as ws:
            ws.write("mine.txt", secret)
            r = sandbox.run(
                ["/bin/sh", "-c", "cat mine.txt; echo; echo tmp > /tmp/t-$$; ls -a /work /tmp;"
                 "sleep 0.3; ls /tmp | wc -l"], ws,
            )  # fmt: skip
            assert r.status is ExecutionStatus.OK, r
            return r.text()

    with ThreadPoolExecutor(4) as pool:
        outputs = list(pool.map(one, range(4)))
    for i, out in enumerate(outputs):
        assert f"secret-{i}-" in out
        others = [j for j in range(4) if j != i and f"secret-{j}-" in out]
        assert others == []
        assert out.strip().endswith("1")  # only its own file in its /tmp
        assert out.count("mine.txt") == 1


def test_symlinks_left_in_the_work_dir_are_not_followed(sandbox: Sandbox) -> None:
    from moerl.sandbox.workspace import UnsafePath

    with sandbox.workspace() as ws:
        r = sandbox.run(["/bin/sh", "-c",
                         "ln -s /etc/hostname result.txt && mkdir d && ln -s /etc d/x"
                         " && mkfifo fifo"], ws)  # fmt: skip
        assert r.status is ExecutionStatus.OK, r
        for name in ("result.txt", "d/x/hostname", "fifo"):
            with pytest.raises(UnsafePath):
                ws.read(name, 1000)
    assert not ws.path.exists()
    assert Path("/etc/hostname").exists()  # removal did not follow the links


def test_stdin_is_fed_and_exit_code_reported(sandbox: Sandbox) -> None:
    data = b"line\n" * 50_000  # larger than a pipe buffer
    with sandbox.workspace() as ws:
        r = sandbox.run(["/bin/sh", "-c", "wc -l; exit 7"], ws, stdin=data)
    assert r.status is ExecutionStatus.RUNTIME_ERROR and r.exit_code == 7
    assert r.text().strip() == "50000"


def test_failure_before_the_program_starts_is_a_sandbox_error(sandbox: Sandbox) -> None:
    results: list[ExecutionResult] = []
    with sandbox.workspace() as ws:
        # A bind of a host path that does not exist: bwrap fails while setting up.
        binds = [(Path("/nonexistent-moerl"), "/opt/x")]
        t = threading.Thread(
            target=lambda: results.append(sandbox.run(["true"], ws, extra_ro_binds=binds))
        )
        t.start()
        t.join()
        # Once the program has started, a failure is the program's: a missing binary is
        # indistinguishable from a program that prints bwrap's message and exits 1.
        missing = sandbox.run(["/nonexistent"], ws)
    assert results[0].status is ExecutionStatus.SANDBOX_ERROR and results[0].is_infra_error
    assert "nonexistent-moerl" in (results[0].error or "")
    assert missing.status is ExecutionStatus.RUNTIME_ERROR


def test_read_only_bind_of_a_file_below_a_private_directory(
    sandbox: Sandbox, tmp_path: Path
) -> None:
    # A checkout in a `mktemp -d` dir is 0700: the sandbox uid cannot open what is below
    # it, so a bound file (the HumanEval harness) is handed over as a readable copy.
    private = tmp_path / "checkout"
    private.mkdir(mode=0o700)
    os.chmod(private, 0o700)
    (private / "harness.py").write_text("print('harness ran')\n")
    with sandbox.workspace() as ws:
        binds = [(private / "harness.py", "/opt/harness.py")]
        first = sandbox.run([PY, "-I", "/opt/harness.py"], ws, extra_ro_binds=binds)
        (private / "harness.py").write_text("print('harness changed')\n")
        os.utime(private / "harness.py", (time.time() + 5, time.time() + 5))
        second = sandbox.run([PY, "-I", "/opt/harness.py"], ws, extra_ro_binds=binds)
    assert first.status is ExecutionStatus.OK, first
    assert first.stdout.strip() == b"harness ran"
    assert second.stdout.strip() == b"harness changed"
