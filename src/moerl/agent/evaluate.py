"""`moerl eval agent`: terminal tasks against a policy, scored by their verifiers.

The policy is either rollout servers (OpenAI-compatible, found in a rendezvous dir or
given by URL; `--policy server`) or the tasks' scripted solutions (`--policy scripted`,
which checks the suite and the sandbox themselves). Every episode runs through the
agent scheduler and the real sandbox. The report is the completion rate (reward 1.0)
over the scored episodes, overall and per category, a per-task table and a JSON file.
Infra failures (the sandbox or the servers failed) are counted apart, never as 0.
`--tasks-dir DIR` adds a directory of a user's own tasks; `--check DIR` checks one
(`agent.check_tasks`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from moerl.agent.scheduler import AgentScheduler, Generator, SchedulerConfig
from moerl.agent.suite import SuiteError, SuiteTask, select_tasks
from moerl.agent.tasks import ScriptedPolicy, tagged
from moerl.agent.terminal import TerminalEnvironment
from moerl.agent.trajectory import Trajectory
from moerl.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer
from moerl.sandbox import Sandbox, SandboxConfig
from moerl.sandbox.config import Isolation


@dataclass(frozen=True)
class TaskResult:
    task_id: str
    category: str
    status: str
    reward: float | None
    """None for infra failures."""
    turns: int
    tokens: int
    infra_error: str | None = None
    check_error: str | None = None

    @property
    def solved(self) -> bool:
        return self.reward == 1.0


def run_suite(tasks: Sequence[SuiteTask], generator: Generator, sandbox: Sandbox,
              tokenizer: Tokenizer, config: SchedulerConfig) -> list[Trajectory]:  # fmt: skip
    """One episode per task, concurrently, in the real sandbox."""
    scheduler = AgentScheduler(generator, lambda: TerminalEnvironment(sandbox), tokenizer, config)
    return scheduler.run([t.task for t in tasks])


def scripted_policy(tasks: Sequence[SuiteTask], tokenizer: Tokenizer) -> ScriptedPolicy:
    return ScriptedPolicy({t.id: t.solution for t in tasks}, tokenizer)


def results(tasks: Sequence[SuiteTask], trajectories: Sequence[Trajectory]) -> list[TaskResult]:
    return [
        TaskResult(task.id, task.category, traj.status, traj.reward, traj.model_turns,
                   traj.num_tokens, traj.infra_error,
                   traj.verify_details.get("check_error"))
        for task, traj in zip(tasks, trajectories, strict=True)
    ]


def summary(rows: Sequence[TaskResult]) -> dict[str, Any]:
    """Completion rate over scored episodes (infra failures excluded and counted)."""

    def rate(part: Sequence[TaskResult]) -> dict[str, Any]:
        scored = [r for r in part if r.reward is not None]
        return {
            "tasks": len(part),
            "solved": sum(r.solved for r in scored),
            "infra_failures": len(part) - len(scored),
            "completion_rate": statistics.fmean(r.solved for r in scored) if scored else 0.0,
            "mean_reward": statistics.fmean(r.reward or 0.0 for r in scored) if scored else 0.0,
        }

    categories = dict.fromkeys(r.category for r in rows)  # in the order they come
    return {**rate(rows),
            "categories": {c: rate([r for r in rows if r.category == c]) for c in categories}}


def results_table(rows: Sequence[TaskResult], title: str) -> Table:
    table = Table(title=title)
    for name in ("task", "category", "status"):
        table.add_column(name)
    for name in ("reward", "turns", "tokens"):
        table.add_column(name, justify="right")
    for r in rows:
        reward = "infra" if r.reward is None else f"{r.reward:.2f}"
        style = "green" if r.solved else ("yellow" if r.reward is None else "red")
        table.add_row(r.task_id, r.category, r.status, reward, str(r.turns), str(r.tokens),
                      style=style)  # fmt: skip
    return table


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moerl eval agent", description=__doc__.split("\n\n")[0])
    p.add_argument("--policy", choices=("server", "scripted"), default="server")
    p.add_argument("--rendezvous", help="rendezvous dir of a run (its rollout servers)")
    p.add_argument("--url", action="append", default=[], help="a rollout server URL (repeat)")
    p.add_argument("--task", action="append", default=[], metavar="GLOB",
                   help="task ids to run, e.g. 'git-*' (repeat; default: all)")
    p.add_argument("--category", action="append", default=[],
                   help="only tasks of this category (repeat)")
    p.add_argument("--tasks-dir", action="append", default=[], metavar="DIR",
                   help="a directory of your own task files, added to the shipped ones")
    p.add_argument("--check", metavar="DIR", default=None,
                   help="check the task files in DIR: each solution must score 1 and each "
                        "wrong sequence 0, with load, setup and check errors shown")
    p.add_argument("--list", action="store_true", help="list the selected tasks and exit")
    p.add_argument("--out", default="runs/eval/agent.json", help="the JSON report")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-turns", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--context-tokens", type=int, default=4096)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer", default=None,
                   help="a Hugging Face tokenizer directory (the servers' and the run's "
                        "tokenizer.path); default: bytes")
    p.add_argument("--end-of-turn-token", default=None,
                   help="with --tokenizer: a token that also ends a turn")
    p.add_argument("--vocab-size", type=int, default=512, help="the byte tokenizer's padded vocab")
    p.add_argument("--compact-tools", action="store_true",
                   help="one line per tool (small contexts)")
    p.add_argument("--isolation", choices=("strict", "no-cgroups"), default="strict")
    return p


def _generator(args: argparse.Namespace, tasks: Sequence[SuiteTask], tok: Tokenizer) -> Generator:
    if args.policy == "scripted":
        return scripted_policy(tasks, tok)
    from moerl.rollout.client import RolloutClient

    if not args.url and not args.rendezvous:
        raise SystemExit("moerl eval agent: --policy server needs --url or --rendezvous "
                         "(or use --policy scripted)")  # fmt: skip
    return RolloutClient(args.url, rendezvous_dir=args.rendezvous)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    console = Console()
    if args.check is not None:
        return _check(Path(args.check), args.isolation, console)
    try:
        tasks = select_tasks(args.task, args.category, args.tasks_dir)
    except SuiteError as err:
        console.print(f"moerl eval agent: {err}", style="red", markup=False)
        return 2
    if args.list:
        for t in tasks:
            console.print(f"{t.id:32s} {t.category}", markup=False)
        return 0
    tok: Tokenizer = (HFTokenizer(args.tokenizer, end_of_turn_token=args.end_of_turn_token)
                      if args.tokenizer else ByteTokenizer(args.vocab_size))
    if args.policy == "scripted":  # the scripted policy finds each task by its tag
        tasks = [SuiteTask(tagged(t.task), t.category, t.solution, t.wrong) for t in tasks]
    config = SchedulerConfig(
        max_turns=args.max_turns, max_concurrency=args.concurrency,
        context_tokens=args.context_tokens, max_new_tokens=args.max_new_tokens,
        max_episode_tokens=max(16384, args.context_tokens), temperature=args.temperature,
        seed=args.seed, compact_tools=args.compact_tools,
    )  # fmt: skip
    sandbox = Sandbox(SandboxConfig(isolation=args.isolation))
    start = time.monotonic()
    rows = results(tasks, run_suite(tasks, _generator(args, tasks, tok), sandbox, tok, config))
    report = {"policy": args.policy, "seconds": round(time.monotonic() - start, 2),
              **summary(rows), "results": [asdict(r) for r in rows]}  # fmt: skip
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    console.print(results_table(rows, f"terminal tasks, policy={args.policy}"))
    for name, part in report["categories"].items():
        console.print(f"  {name:9s} {part['solved']}/{part['tasks']} solved", markup=False)
    console.print(f"completion rate {report['completion_rate']:.3f} ({report['solved']}/"
                  f"{report['tasks']}; infra failures {report['infra_failures']}); "
                  f"report: {out}", markup=False)  # fmt: skip
    if report["infra_failures"]:
        return 1
    return 1 if args.policy == "scripted" and report["solved"] != report["tasks"] else 0


def _check(directory: Path, isolation: Isolation, console: Console) -> int:
    from moerl.agent.check_tasks import check_dir, check_table

    try:
        rows = check_dir(directory, Sandbox(SandboxConfig(isolation=isolation)))
    except SuiteError as err:
        console.print(f"moerl eval agent --check: {err}", style="red", markup=False)
        return 2
    console.print(check_table(rows, directory))
    passed = sum(r.passed for r in rows)
    console.print(f"{passed}/{len(rows)} task files pass", markup=False)
    return 0 if passed == len(rows) else 1
