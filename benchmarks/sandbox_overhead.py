"""Sandbox overhead: latency and executions/s of trivial programs, sandboxed
(bubblewrap + cgroups + rlimits + seccomp) against a bare subprocess, in the same run;
then one HumanEval-style item (the demo's task: a function and four asserts) scored by
the reward (grader and candidate processes in the sandbox) against the same program
and tests run by a bare `python3 -I -S -c`.

    .venv/bin/python benchmarks/sandbox_overhead.py [--runs 60] [--gap-ms 50]
    .venv/bin/python benchmarks/sandbox_overhead.py --smoke   # a few runs of each

Each sandboxed row is measured twice: "on demand" launches bwrap for every execution
(`Sandbox.run_fresh` with no warm slots); "warm" takes a slot launched ahead of time
(`SandboxConfig.warm_slots`, as the reward server runs by default). Two ways to send
requests: "paced" sends one at a time with --gap-ms of idle time between them (a
request reaching an idle server: its latency is what a warm slot saves); "conc N"
sends back to back from N threads (the machine saturated: the throughput, where
a warm slot saves nothing, because every execution still costs one launch).
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
from moerl.sandbox import ExecutionStatus, Sandbox, SandboxConfig

TABLE_TITLE = "sandbox overhead: sandboxed against bare subprocess"
NEEDS_EXECUTABLES = ("bwrap",)
SMOKE = {"runs": 3, "gap_ms": 5.0}
PROGRAMS = {
    "python3 print": ["/usr/bin/python3", "-I", "-S", "-c", "print(1)"],
    "/bin/true": ["/bin/true"],
}
Stats = tuple[float, float, float]  # executions/s, p50 ms, p90 ms


def measure(run_one: Callable[[], None], runs: int, concurrency: int, gap_s: float) -> Stats:
    """(executions per second, p50 ms, p90 ms); `gap_s` idle seconds after each run
    (paced, one thread) or none (`concurrency` threads back to back)."""

    def timed(_: int) -> float:
        t0 = time.perf_counter()
        run_one()
        latency = time.perf_counter() - t0
        time.sleep(gap_s)
        return latency

    for _ in range(3):
        timed(0)  # the page cache, and a warm pool's first fill
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        latencies = sorted(pool.map(timed, range(runs)))
    elapsed = time.perf_counter() - start - (gap_s * runs / concurrency)
    p50 = statistics.median(latencies) * 1e3
    p90 = latencies[int(0.9 * (len(latencies) - 1))] * 1e3
    return runs / elapsed, p50, p90


def row(name: str, how: str, mode: str, stats: Stats) -> None:
    rate, p50, p90 = stats
    print(f"{name:<15} {how:<7} {mode:<10} {rate:>8.1f} {p50:>8.2f} {p90:>8.2f}")


def ratio(name: str, what: str, boxed: Stats, bare: Stats) -> None:
    print(f"{'':<15} {'':<7} {what}: p50 x{boxed[1] / bare[1]:.2f}, "
          f"throughput x{bare[0] / boxed[0]:.2f} (sandbox / bare)")  # fmt: skip


def trivial_programs(boxes: dict[str, Sandbox], args: argparse.Namespace) -> None:
    for name, argv in PROGRAMS.items():
        for how, concurrency, gap in (("paced", 1, args.gap_ms / 1e3), ("conc 2", 2, 0.0)):

            def bare(argv: list[str] = argv) -> None:
                subprocess.run(argv, capture_output=True, check=True)

            b = measure(bare, args.runs, concurrency, gap)
            row(name, how, "bare", b)
            for mode, box in boxes.items():

                def boxed(box: Sandbox = box, argv: list[str] = argv) -> None:
                    result = box.run_fresh(argv)
                    assert result.status is ExecutionStatus.OK, result

                s = measure(boxed, args.runs, concurrency, gap)
                row(name, how, mode, s)
                ratio(name, mode, s, b)


def humaneval_item(boxes: dict[str, Sandbox], args: argparse.Namespace) -> None:
    task = make_tasks(1, seed=0)[0]
    spec = {"prompt": task.prompt, "test": task.tests, "entry_point": task.entry_point}
    program = f"{task.prompt}{task.reference}\n{task.tests}\ncheck({task.entry_point})\n"
    python = SandboxConfig().python_path
    gap = args.gap_ms / 1e3

    def bare() -> None:
        subprocess.run([python, "-I", "-S", "-c", program], capture_output=True, check=True)

    b = measure(bare, args.runs, 1, gap)
    row("humaneval item", "paced", "bare", b)
    for mode, box in boxes.items():
        reward = HumanEvalReward(box)

        def scored(reward: HumanEvalReward = reward) -> None:
            result = reward.score(task.reference, spec)
            assert result.reward == 1.0, result

        s = measure(scored, args.runs, 1, gap)
        row("humaneval item", "paced", mode, s)
        ratio("humaneval item", f"{mode} (scored / bare program + tests)", s, b)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=60)
    parser.add_argument("--gap-ms", type=float, default=50.0,
                        help="idle time after each paced request")  # fmt: skip
    return parse_with_smoke(parser, SMOKE, argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    boxes = {"on demand": Sandbox(), "warm": Sandbox(SandboxConfig(warm_slots=2))}
    try:
        print(TABLE_TITLE)
        print(f"{'program':<15} {'sent':<7} {'mode':<10} {'exec/s':>8} {'p50 ms':>8} "
              f"{'p90 ms':>8}")  # fmt: skip
        trivial_programs(boxes, args)
        humaneval_item(boxes, args)
    finally:
        for box in boxes.values():
            box.close()


if __name__ == "__main__":
    main()
