"""Sandbox overhead: latency and throughput of trivial programs, sandboxed (bubblewrap +
cgroups + rlimits + seccomp) against a bare subprocess, in the same run; and of one
HumanEval-style item (the demo's task: a function and four asserts) scored by the
reward (grader and candidate processes in the sandbox) against the same program and
tests run by a bare `python3 -I -S -c`.

    .venv/bin/python benchmarks/sandbox_overhead.py [--runs 60] [--gap-ms 50]
    .venv/bin/python benchmarks/sandbox_overhead.py --smoke   # a few runs of each

Each sandboxed row is measured twice: "on demand" launches bwrap for every execution
(`Sandbox.run_fresh` with no warm slots); "warm" takes a slot launched ahead of time
(`SandboxConfig.warm_slots`: as many as the requests sent at once, 2 when paced, as
the reward server keeps one per `--max-concurrency` by default). Three ways to send:
"paced" sends one at a time with --gap-ms of idle time after each (a request reaching
an idle server: its latency, p50 and p90, is what a warm slot saves, since the slot
was launched during the gap); "conc 2" and "conc 8" send back to back from 2 or 8
threads (the machine saturated: items/s, where a warm slot saves little or nothing,
because every execution still costs one launch and the launches compete with the
programs for the cores). The summary puts the paced p50 (x bare) beside the
throughput at 2 and 8 (items/s, and its share of bare's items/s at the same
concurrency). Bare, on demand and warm take turns, --rounds times, --runs split
between the turns, so that other load on the machine weighs on all three alike.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from _smoke import parse_with_smoke

from moerl.data.code_tasks import make_tasks
from moerl.rewards.code import HumanEvalReward
from moerl.sandbox import ExecutionStatus, Sandbox, SandboxConfig

TABLE_TITLE = "sandbox overhead: sandboxed against bare subprocess"
NEEDS_EXECUTABLES = ("bwrap",)
SMOKE = {"runs": 3, "gap_ms": 5.0, "warmup": 1, "rounds": 1}
PROGRAMS = {
    "python3 print": ["/usr/bin/python3", "-I", "-S", "-c", "print(1)"],
    "/bin/true": ["/bin/true"],
}
SENDS = (("paced", 1), ("conc 2", 2), ("conc 8", 8))
"""(name, requests in flight); paced ones wait --gap-ms after each."""
MODES = ("bare", "on demand", "warm")
Stats = tuple[float, float, float]  # items/s, p50 ms, p90 ms
Task = Callable[[], None]
Workload = tuple[Task, Callable[[Sandbox], Task]]
"""A workload: the bare run, and the sandboxed run for a given sandbox."""


@dataclass
class Tally:
    """Runs of one (workload, send, mode) over the rounds: count, seconds, latencies."""

    runs: int = 0
    seconds: float = 0.0
    latencies: list[float] = field(default_factory=list)

    def stats(self) -> Stats:
        ordered = sorted(self.latencies)
        p90 = ordered[int(0.9 * (len(ordered) - 1))]
        return self.runs / self.seconds, statistics.median(ordered) * 1e3, p90 * 1e3


def measure(run_one: Task, tally: Tally, runs: int, concurrency: int, gap_s: float,
            warmup: int) -> None:  # fmt: skip
    """Add `runs` runs (after `warmup` unmeasured ones) to `tally`: their latencies and
    their seconds; `gap_s` idle seconds after each run (paced, one thread), which do
    not count, or none (`concurrency` threads back to back)."""

    def timed(_: int) -> float:
        t0 = time.perf_counter()
        run_one()
        latency = time.perf_counter() - t0
        time.sleep(gap_s)
        return latency

    for _ in range(warmup):
        timed(0)  # the page cache, and a warm pool's first fill
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        tally.latencies += pool.map(timed, range(runs))
    tally.seconds += time.perf_counter() - start - (gap_s * runs / concurrency)
    tally.runs += runs


def workloads() -> dict[str, Workload]:
    def program(argv: list[str]) -> Workload:
        def bare() -> None:
            subprocess.run(argv, capture_output=True, check=True)

        def boxed(box: Sandbox) -> Task:
            def run() -> None:
                result = box.run_fresh(argv)
                assert result.status is ExecutionStatus.OK, result

            return run

        return bare, boxed

    task = make_tasks(1, seed=0)[0]
    spec = {"prompt": task.prompt, "test": task.tests, "entry_point": task.entry_point}
    source = f"{task.prompt}{task.reference}\n{task.tests}\ncheck({task.entry_point})\n"
    python = SandboxConfig().python_path

    def bare_item() -> None:
        subprocess.run([python, "-I", "-S", "-c", source], capture_output=True, check=True)

    def scored_item(box: Sandbox) -> Task:
        reward = HumanEvalReward(box)

        def run() -> None:
            result = reward.score(task.reference, spec)
            assert result.reward == 1.0, result

        return run

    return {**{name: program(argv) for name, argv in PROGRAMS.items()},
            "humaneval item": (bare_item, scored_item)}  # fmt: skip


def run_all(args: argparse.Namespace) -> dict[tuple[str, str, str], Stats]:
    """Stats of every (workload, send, mode), printed as they come. The modes of a
    workload take turns, --rounds times, so that load from elsewhere that comes and
    goes weighs on bare and sandboxed runs alike."""
    found: dict[tuple[str, str, str], Stats] = {}
    loads = workloads()
    per_round = max(1, args.runs // args.rounds)
    for send, concurrency in SENDS:
        gap = args.gap_ms / 1e3 if concurrency == 1 else 0.0
        boxes = {"on demand": Sandbox(),
                 "warm": Sandbox(SandboxConfig(warm_slots=max(2, concurrency)))}  # fmt: skip
        try:
            for name, (bare, boxed) in loads.items():
                tasks = {"bare": bare, **{mode: boxed(box) for mode, box in boxes.items()}}
                tallies = {mode: Tally() for mode in tasks}
                for round_index in range(args.rounds):
                    for mode, task in tasks.items():
                        warmup = args.warmup if round_index == 0 else 0
                        measure(task, tallies[mode], per_round, concurrency, gap, warmup)
                for mode, tally in tallies.items():
                    rate, p50, p90 = found[name, send, mode] = tally.stats()
                    print(f"{name:<15} {send:<7} {mode:<10} {rate:>8.1f} {p50:>8.2f} {p90:>8.2f}")
        finally:
            for box in boxes.values():
                box.close()
    return found


def summary(found: dict[tuple[str, str, str], Stats]) -> None:
    print("\nsummary: paced p50 ms (x bare); items/s at concurrency 2 and 8 (share of bare)")
    print(f"{'program':<15} {'mode':<10} {'paced p50':>17} {'conc 2 items/s':>19} "
          f"{'conc 8 items/s':>19}")  # fmt: skip
    names = dict.fromkeys(name for name, _, _ in found)
    for name in names:
        for mode in MODES:
            paced, base = found[name, "paced", mode], found[name, "paced", "bare"]
            cells = [f"{paced[1]:>8.2f} (x{paced[1] / base[1]:.2f})"]
            for send in ("conc 2", "conc 8"):
                rate, bare_rate = found[name, send, mode][0], found[name, send, "bare"][0]
                cells.append(f"{rate:>8.1f} (x{rate / bare_rate:.2f})")
            print(f"{name:<15} {mode:<10} {cells[0]:>17} {cells[1]:>19} {cells[2]:>19}")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=60)
    parser.add_argument("--gap-ms", type=float, default=50.0,
                        help="idle time after each paced request")  # fmt: skip
    parser.add_argument("--warmup", type=int, default=3, help="unmeasured runs before each row")
    parser.add_argument("--rounds", type=int, default=4,
                        help="turns the modes take, --runs split between them")  # fmt: skip
    return parse_with_smoke(parser, SMOKE, argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    print(TABLE_TITLE)
    print(f"{'program':<15} {'sent':<7} {'mode':<10} {'items/s':>8} {'p50 ms':>8} "
          f"{'p90 ms':>8}")  # fmt: skip
    summary(run_all(args))


if __name__ == "__main__":
    main()
