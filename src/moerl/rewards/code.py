"""Code rewards: the pass rate of unit tests run in the sandbox, with compile status as
its own signal. Two test styles: HumanEval (prompt, completion, a `check` function) and
competitive programming (stdin -> expected stdout, compared here, outside the sandbox).

Only evidence the program cannot forge counts as a pass: for HumanEval, records on the
result channel that carry this run's nonce and come from the grader process (see
pyharness.py); for stdin/stdout, a clean exit *and* the right output compared on the host.
"""

from __future__ import annotations

import ast
import marshal
import secrets
import signal
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from moerl.rewards.protocol import InvalidSpec, RewardResult
from moerl.sandbox import ExecutionResult, ExecutionStatus, Limits, Sandbox
from moerl.sandbox.config import clamp_request
from moerl.sandbox.languages import language, prepare

HARNESS = Path(__file__).with_name("pyharness.py")
HARNESS_INSIDE = "/opt/moerl/pyharness.py"


def _require(spec: Mapping[str, Any], key: str, kind: type) -> Any:
    value = spec.get(key)
    if not isinstance(value, kind):
        raise InvalidSpec(f"spec[{key!r}] must be a {kind.__name__}, got {type(value).__name__}")
    return value


def count_tests(test_source: str) -> int:
    """Top-level statements of `check` that contain an assert: the same rule the grader
    inside uses, applied here so that the total is not taken from the sandbox."""
    try:
        module = ast.parse(test_source)
    except SyntaxError as exc:
        raise InvalidSpec(f"test source does not parse: {exc}") from exc
    checks = [n for n in module.body if isinstance(n, ast.FunctionDef) and n.name == "check"]
    if len(checks) != 1 or not checks[0].args.args:
        raise InvalidSpec("test source must define exactly one `check(candidate)` function")
    for node in module.body:
        if not isinstance(node, _TEST_MODULE_STATEMENTS) and not _is_docstring(node):
            raise InvalidSpec(
                f"test source line {node.lineno}: top-level {type(node).__name__} beside "
                "`check`; only definitions, imports and assignments may stand there (the "
                "grader calls `check` itself, so a trailing `check(...)` must go)")
    total = sum(any(isinstance(x, ast.Assert) for x in ast.walk(s)) for s in checks[0].body)
    if total == 0:
        raise InvalidSpec("`check` contains no assert")
    return total


_TEST_MODULE_STATEMENTS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Import,
                           ast.ImportFrom, ast.Assign, ast.AnnAssign)  # fmt: skip


def _is_docstring(node: ast.stmt) -> bool:
    return isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)


def _limits(sandbox: Sandbox, spec: Mapping[str, Any]) -> Limits:
    requested = spec.get("limits") or {}
    if not isinstance(requested, dict):
        raise InvalidSpec("spec['limits'] must be a mapping")
    cfg = sandbox.config
    try:
        return clamp_request(requested, cfg.default_limits, cfg.max_limits)
    except ValueError as exc:  # an unknown key: the dataset's error, not the sandbox's
        raise InvalidSpec(f"spec['limits']: {exc}") from exc


def _infra(result: ExecutionResult) -> RewardResult:
    return RewardResult.infra(f"sandbox error: {result.error}", status=result.status.value)


class HumanEvalReward:
    """spec: {"prompt", "test", "entry_point"}; the program is prompt + completion unless
    spec["completion_is_program"] is true. Reward: fraction of tests passed."""

    name = "humaneval"

    def __init__(self, sandbox: Sandbox) -> None:
        self.sandbox = sandbox

    def score(self, completion: str, spec: Mapping[str, Any]) -> RewardResult:
        prompt = _require(spec, "prompt", str)
        test = _require(spec, "test", str)
        entry_point = _require(spec, "entry_point", str)
        total = count_tests(test)
        program = completion if spec.get("completion_is_program") else prompt + completion
        nonce = secrets.token_hex(16)
        config = {"nonce": nonce, "prompt": prompt, "test": test, "program": program,
                  "entry_point": entry_point}  # fmt: skip
        # The grader forks its candidate and then reads nothing but its stdin, so a
        # warm slot may have started it before this item existed.
        run = self.sandbox.run_fresh(
            [self.sandbox.config.python_path, "-I", "-S", HARNESS_INSIDE],
            stdin=marshal.dumps(config), limits=_limits(self.sandbox, spec),
            channel=True, extra_ro_binds=[(HARNESS, HARNESS_INSIDE)], starts_on_stdin=True,
        )  # fmt: skip
        if run.is_infra_error:
            return _infra(run)
        return grade_channel(run, nonce, total)


def grade_channel(run: ExecutionResult, nonce: str, total: int) -> RewardResult:
    passed: set[int] = set()
    failed: set[int] = set()
    load_state, load_error = "missing", ""
    candidate_signal: int | None = None
    for line in run.channel.splitlines():
        try:  # Python literals (see pyharness.py); whatever else is on a line is skipped
            record = ast.literal_eval(line.decode())
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            continue
        if not isinstance(record, dict) or record.get("nonce") != nonce:
            continue
        if record.get("kind") == "test_error":
            return RewardResult.invalid(f"test source fails before any test runs: "
                                        f"{str(record.get('error'))[:500]}")
        if record.get("kind") == "load":
            load_state, load_error = str(record.get("state")), str(record.get("error"))
        if record.get("kind") == "candidate_exit" and type(record.get("signal")) is int:
            candidate_signal = record["signal"]
        index = record.get("index")
        if record.get("kind") == "test" and type(index) is int and 0 <= index < total:
            (passed if record.get("passed") is True else failed).add(index)
    n_passed = len(passed - failed)
    compiled = load_state != "compile_error" if load_state != "missing" else None
    limits_hit = list(run.limits_hit)
    if candidate_signal == signal.SIGXFSZ and "file_size" not in limits_hit:
        limits_hit.append("file_size")  # the grader exited normally; its candidate did not
    status = run.status.value
    if compiled is False:
        status = ExecutionStatus.COMPILE_ERROR.value
    elif limits_hit:  # e.g. the candidate killed for memory while the grader exited 0
        status = limit_status(limits_hit[0])
    return RewardResult(
        reward=n_passed / total,
        passed=n_passed,
        total=total,
        compile_ok=compiled,
        status=status,
        details={
            "load": load_state,
            "load_error": load_error[:500],
            "stderr": run.text("stderr")[-500:],
            "limits_hit": list(limits_hit),
            "candidate_signal": candidate_signal,
        },
    )


_LIMIT_STATUS = {
    "wall_time": ExecutionStatus.TIMEOUT.value,
    "cpu_time": ExecutionStatus.TIMEOUT.value,
    "memory": ExecutionStatus.MEMORY_LIMIT.value,
    "output": ExecutionStatus.OUTPUT_LIMIT.value,
}


def limit_status(limit: str) -> str:
    """The status that names a limit of `ExecutionResult.limits_hit`."""
    return _LIMIT_STATUS.get(limit, f"{limit}_limit")


def normalize_output(text: str) -> list[str]:
    """Trailing spaces and trailing blank lines do not matter; everything else does."""
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


class StdioReward:
    """spec: {"language": python|c|cpp|bash, "cases": [{"input", "output"}], "limits"?}.
    Reward: fraction of cases whose run exits 0 with the expected stdout."""

    name = "stdio"
    max_cases = 64

    def __init__(self, sandbox: Sandbox) -> None:
        self.sandbox = sandbox

    def score(self, completion: str, spec: Mapping[str, Any]) -> RewardResult:
        try:
            lang = language(_require(spec, "language", str))
        except ValueError as exc:
            raise InvalidSpec(str(exc)) from exc
        cases = _require(spec, "cases", list)
        if not cases or len(cases) > self.max_cases:
            raise InvalidSpec(f"spec['cases'] must hold 1..{self.max_cases} cases")
        for case in cases:
            if not (isinstance(case, dict) and isinstance(case.get("input"), str)
                    and isinstance(case.get("output"), str)):  # fmt: skip
                raise InvalidSpec("each case must be {'input': str, 'output': str}")
        limits = _limits(self.sandbox, spec)
        with self.sandbox.workspace() as ws:
            compiled = prepare(self.sandbox, ws, lang, completion)
            if compiled is not None and compiled.is_infra_error:
                return _infra(compiled)
            if compiled is not None and compiled.status is not ExecutionStatus.OK:
                return RewardResult(
                    reward=0.0, passed=0, total=len(cases), compile_ok=False,
                    status=ExecutionStatus.COMPILE_ERROR.value,
                    details={"compiler": compiled.text("stderr")[-2000:]},
                )  # fmt: skip
            statuses: list[str] = []
            hit_limits: list[str] = []
            passed = 0
            for case in cases:
                run = self.sandbox.run(lang.run_argv, ws, stdin=case["input"].encode(),
                                       limits=limits)  # fmt: skip
                if run.is_infra_error:
                    return _infra(run)
                statuses.append(run.status.value)
                hit_limits += [name for name in run.limits_hit if name not in hit_limits]
                ok = run.status is ExecutionStatus.OK and not run.stdout_truncated
                passed += ok and normalize_output(run.text()) == normalize_output(case["output"])
        worst = next((s for s in statuses if s != "ok"), "ok")
        if hit_limits and worst != "ok":
            worst = limit_status(hit_limits[0])
        return RewardResult(
            reward=passed / len(cases), passed=passed, total=len(cases),
            compile_ok=True if compiled is not None else None, status=worst,
            details={"statuses": list(statuses), "limits_hit": list(hit_limits)},
        )  # fmt: skip
