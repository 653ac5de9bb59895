"""A small generated family of terminal tasks, each with a verifier and a scripted solution.

Families: create a file with given content; fix a syntax error so a script prints the
right number; fix a bug so hidden tests of a module pass; count ERROR lines of a log.
Checks compare values they hold against what agent code prints (see terminal.py), so
printing "PASSED" or exiting 0 early earns nothing; the module-fixing check also uses
inputs the visible tests do not show.

`TaskCase.solution` is a fixed action sequence that solves the task (some steps fail on
purpose, to exercise error observations). `ScriptedPolicy` replays such sequences behind
the generator interface, for tests and for the demo (`python -m moerl.agent.tasks`),
which runs every task through the scheduler and the real sandbox and prints the results.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from moerl.agent.environment import AgentTask
from moerl.agent.tools import ToolCall
from moerl.data.tokenizer import ByteTokenizer, Tokenizer
from moerl.rollout.types import Sample, SamplingParams

_WORDS = ("amber", "birch", "cobalt", "delta", "ember", "fjord", "garnet", "harbor", "indigo")


@dataclass(frozen=True)
class TaskCase:
    task: AgentTask
    solution: tuple[ToolCall, ...]


def _run(command: str) -> ToolCall:
    return ToolCall("run", {"command": command})


SUBMIT = ToolCall("submit", {})


def create_file(rng: random.Random, index: int) -> TaskCase:
    name = f"{rng.choice(_WORDS)}_{index}.txt"
    content = f"{rng.choice(_WORDS)} {rng.randint(100, 999)}"
    check = (f"def check():\n    text = read({name!r})\n"
             f"    return text is not None and text.rstrip('\\n') == {content!r}\n")  # fmt: skip
    task = AgentTask(f"create_file-{index}",
                     f"Create a file named {name} in /work containing exactly the line: {content}",
                     check=check)  # fmt: skip
    return TaskCase(task, (ToolCall("write_file", {"path": name, "content": content + "\n"}),
                           _run(f"cat {name}"), SUBMIT))  # fmt: skip


def fix_syntax(rng: random.Random, index: int) -> TaskCase:
    factor = rng.randint(2, 9)
    values = [rng.randint(1, 20) for _ in range(4)]
    program = (f"def total(values)\n    return sum(values) * {factor}\n\n\n"
               f"print(total({values}))\n")  # fmt: skip
    expected = str(sum(values) * factor)
    check = ("def check():\n    code, out = run(['python3', 'report.py'])\n"
             f"    return code == 0 and out.strip() == {expected!r}\n")  # fmt: skip
    task = AgentTask(f"fix_syntax-{index}",
                     "report.py in /work has a syntax error. Fix it so that "
                     "`python3 report.py` runs and prints its result.",
                     files={"report.py": program}, check=check)  # fmt: skip
    return TaskCase(task, (
        _run("python3 report.py"),  # fails: the model sees the SyntaxError
        _run("sed -i 's/^def total(values)$/def total(values):/' report.py"),
        _run("python3 report.py"),
        SUBMIT,
    ))  # fmt: skip


def fix_module(rng: random.Random, index: int) -> TaskCase:
    offset = rng.randint(1, 9)
    module = (f"def scale(x):\n    return x * 2 + {offset}\n\n\n"
              f"def add(a, b):\n    return a - b\n")  # fmt: skip
    tests = (f"import mathlib\n\nassert mathlib.add(2, 3) == 5\n"
             f"assert mathlib.scale(1) == {2 + offset}\nprint('ok')\n")  # fmt: skip
    hidden = [(rng.randint(-50, 50), rng.randint(-50, 50)) for _ in range(3)]
    expected = [a + b for a, b in hidden]
    probe = f"import json, mathlib; print(json.dumps([mathlib.add(a, b) for a, b in {hidden}]))"
    check = ("import json\n\n\ndef check():\n"
             f"    code, out = run(['python3', '-c', {probe!r}])\n"
             "    try:\n        got = json.loads(out.strip().splitlines()[-1])\n"
             "    except (ValueError, IndexError):\n        return False\n"
             f"    return code == 0 and got == {expected!r}"
             " and all(type(x) is int for x in got)\n")  # fmt: skip
    task = AgentTask(
        f"fix_module-{index}",
        "The tests in test_mathlib.py fail. Fix mathlib.py (not the tests) so "
        "that `python3 test_mathlib.py` passes.",
        files={"mathlib.py": module, "test_mathlib.py": tests},
        check=check,
    )
    return TaskCase(task, (
        _run("python3 test_mathlib.py"),  # fails: AssertionError
        _run("cat mathlib.py"),
        _run("sed -i 's/return a - b/return a + b/' mathlib.py"),
        _run("python3 test_mathlib.py"),
        SUBMIT,
    ))  # fmt: skip


def count_errors(rng: random.Random, index: int) -> TaskCase:
    levels = [rng.choice(("INFO", "WARN", "ERROR", "INFO")) for _ in range(rng.randint(8, 20))]
    log = "".join(f"2024-01-01T00:00:{i:02d} {lvl} event {i}\n" for i, lvl in enumerate(levels))
    count = levels.count("ERROR")
    check = (f"def check():\n    text = read('errors.txt')\n"
             f"    return text is not None and text.strip() == {str(count)!r}\n")  # fmt: skip
    task = AgentTask(f"count_errors-{index}",
                     "Write the number of lines of app.log that contain ERROR into errors.txt.",
                     files={"app.log": log}, check=check)  # fmt: skip
    return TaskCase(task, (_run("grep -c ERROR app.log > errors.txt"),
                           _run("cat errors.txt"), SUBMIT))  # fmt: skip


FAMILIES = (create_file, fix_syntax, fix_module, count_errors)


def generate_tasks(n: int, seed: int = 0) -> list[TaskCase]:
    """`n` tasks cycling through the families, reproducible from `seed`."""
    rng = random.Random(seed)
    return [FAMILIES[i % len(FAMILIES)](rng, i) for i in range(n)]


def tagged(task: AgentTask) -> AgentTask:
    """The task with its id in the instruction, which is how `ScriptedPolicy` finds it."""
    return dataclasses.replace(task, instruction=f"[{task.id}] {task.instruction}")


class ScriptedPolicy:
    """A generator that answers each tagged task's turns from a fixed action list."""

    def __init__(self, scripts: dict[str, Sequence[ToolCall]], tokenizer: Tokenizer) -> None:
        self.scripts = {k: list(v) for k, v in scripts.items()}
        self.tokenizer = tokenizer
        self._lock = threading.Lock()

    def generate(
        self, prompts: Sequence[Sequence[int]], n: int = 1, sampling: SamplingParams | None = None
    ) -> list[list[Sample]]:
        out = []
        for prompt in prompts:
            text = self.tokenizer.decode(list(prompt))
            task = next((k for k in self.scripts if f"[{k}]" in text), None)
            with self._lock:
                steps = self.scripts.get(task, []) if task is not None else []
                reply = steps.pop(0).to_text() if steps else "(no scripted action left)"
            ids = tuple(self.tokenizer.encode(reply))
            out.append([Sample(tuple(prompt), ids, (0.0,) * len(ids), "stop", -1, reply)] * n)
        return out


def main(argv: list[str] | None = None) -> int:
    from moerl.agent.scheduler import AgentScheduler, SchedulerConfig
    from moerl.agent.terminal import TerminalEnvironment
    from moerl.sandbox import Sandbox, SandboxConfig

    parser = argparse.ArgumentParser(description="Solve generated tasks with their scripts.")
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--isolation", choices=("strict", "no-cgroups"), default="strict")
    args = parser.parse_args(argv)
    cases = generate_tasks(args.n, args.seed)
    sandbox = Sandbox(SandboxConfig(isolation=args.isolation))
    tok = ByteTokenizer()
    policy = ScriptedPolicy({c.task.id: c.solution for c in cases}, tok)
    scheduler = AgentScheduler(policy, lambda: TerminalEnvironment(sandbox), tok,
                               SchedulerConfig(max_concurrency=4))  # fmt: skip
    trajectories = scheduler.run([tagged(c.task) for c in cases])
    for traj in trajectories:
        print(f"{traj.task_id:20s} {traj.status:18s} reward={traj.reward} turns={traj.model_turns}")
    solved = sum(t.reward == 1.0 for t in trajectories)
    print(f"completion rate: {solved}/{len(trajectories)}")
    return 0 if solved == len(trajectories) else 1


if __name__ == "__main__":
    raise SystemExit(main())
