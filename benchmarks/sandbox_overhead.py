"""Sandbox overhead: executions/s and p50/p90 latency of trivial programs, sandboxed
(bubblewrap + cgroups + rlimits + seccomp) against a bare subprocess, in the same run;
then one HumanEval-style item (the demo's task: a function and four asserts) scored by
the reward (grader and candidate processes in the sandbox) against the same program
and tests run by a bare `python3 -I -S -c`.

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

from moerl.data.code_tasks import make_tasks
from moerl.rewards.code import HumanEvalReward
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


def humaneval_item(sandbox: Sandbox, runs: int) -> None:
    task = make_tasks(1, seed=0)[0]
    spec = {"prompt": task.prompt, "test": task.tests, "entry_point": task.entry_point}
    reward = HumanEvalReward(sandbox)
    program = f"{task.prompt}{task.reference}\n{task.tests}\ncheck({task.entry_point})\n"
    python = sandbox.config.python_path

    def bare() -> None:
        subprocess.run([python, "-I", "-S", "-c", program], capture_output=True, check=True)

    def scored() -> None:
        result = reward.score(task.reference, spec)
        assert result.reward == 1.0, result

    b, s = measure(bare, runs, 1), measure(scored, runs, 1)
    for mode, (rate, p50, p90) in (("bare", b), ("reward", s)):
        print(f"{'humaneval item':<15} {1:>4} {mode:<8} {rate:>8.1f} {p50:>8.1f} {p90:>8.1f}")
    print(f"{'':<15} {'':>4} overhead: p50 x{s[1] / b[1]:.2f} (scored / bare program + tests)")


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
    humaneval_item(sandbox, args.runs)


if __name__ == "__main__":
    main()
