"""Sandbox overhead: executions/s and p50/p90 latency of trivial programs, sandboxed
(bubblewrap + cgroups + rlimits + seccomp) against a bare subprocess, in the same run.

    .venv/bin/python benchmarks/sandbox_overhead.py [--runs 60]
    .venv/bin/python benchmarks/sandbox_overhead.py --smoke   # one run of each
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from _smoke import parse_with_smoke

from moerl.sandbox import ExecutionStatus, Sandbox

TABLE_TITLE = "sandbox overhead: sandboxed against bare subprocess"
NEEDS_EXECUTABLES = ("bwrap",)
SMOKE = {"runs": 1}
PROGRAMS = {
    "python3 print": ["/usr/bin/python3", "-I", "-c", "print(1)"],
    "/bin/true": ["/bin/true"],
}


def measure(run_one: Callable[[], None], runs: int, concurrency: int) -> tuple[float, float, float]:
    """(executions per second, p50 ms, p90 ms)."""

    def timed(_: int) -> float:
        t0 = time.perf_counter()
        run_one()
        return time.perf_counter() - t0

    run_one()  # warm the page cache
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        latencies = sorted(pool.map(timed, range(runs)))
    elapsed = time.perf_counter() - start
    p50 = statistics.median(latencies) * 1e3
    p90 = latencies[int(0.9 * (len(latencies) - 1))] * 1e3
    return runs / elapsed, p50, p90


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=60)
    return parse_with_smoke(parser, SMOKE, argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    sandbox = Sandbox()
    print(TABLE_TITLE)
    print(f"{'program':<15} {'conc':>4} {'mode':<8} {'exec/s':>8} {'p50 ms':>8} {'p90 ms':>8}")
    for name, argv_ in PROGRAMS.items():
        for concurrency in (1, 2):

            def bare(argv_: list[str] = argv_) -> None:
                subprocess.run(argv_, capture_output=True, check=True)

            def boxed(argv_: list[str] = argv_) -> None:
                with sandbox.workspace() as ws:
                    result = sandbox.run(argv_, ws)
                assert result.status is ExecutionStatus.OK, result

            b = measure(bare, args.runs, concurrency)
            s = measure(boxed, args.runs, concurrency)
            for mode, (rate, p50, p90) in (("bare", b), ("sandbox", s)):
                print(f"{name:<15} {concurrency:>4} {mode:<8} {rate:>8.1f} {p50:>8.1f} {p90:>8.1f}")
            print(f"{'':<15} {'':>4} overhead: p50 x{s[1] / b[1]:.2f}, "
                  f"throughput x{b[0] / s[0]:.2f} (sandbox / bare)")  # fmt: skip


if __name__ == "__main__":
    main()
