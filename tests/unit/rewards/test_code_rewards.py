"""Code rewards against the real sandbox: pass rates, compile status, and the tricks
that must never pass (RELIABILITY.md cases 8, 9, 10 and the always-equal object)."""

import dataclasses
import time
from collections.abc import Iterator

import pytest

from moerl.rewards.code import HumanEvalReward, StdioReward, count_tests
from moerl.rewards.protocol import InvalidSpec
from moerl.rewards.server import DEFAULT_MAX_COMPLETION_BYTES
from moerl.sandbox import Limits, Sandbox, SandboxConfig

pytestmark = pytest.mark.sandbox

SPEC = {
    "prompt": 'def add(a, b):\n    """Return a + b."""\n',
    "entry_point": "add",
    "test": (
        "def check(candidate):\n"
        "    assert candidate(1, 2) == 3\n"
        "    assert candidate(-1, 1) == 0\n"
        "    assert candidate(2, 2) == 4\n"
        "    for a in range(5):\n"
        "        assert candidate(a, 10) == a + 10\n"
    ),
}


@pytest.fixture(scope="module", params=["cold", "warm"])
def humaneval(request: pytest.FixtureRequest, sandbox: Sandbox) -> Iterator[HumanEvalReward]:
    """Every HumanEval case twice: each item launched on demand, and from warm slots
    (the grader started and its candidate forked before the item exists)."""
    if request.param == "cold":
        yield HumanEvalReward(sandbox)
        return
    warm = Sandbox(dataclasses.replace(sandbox.config, warm_slots=2))
    try:
        yield HumanEvalReward(warm)
    finally:
        warm.close()


def test_correct_partial_and_wrong_completions(humaneval: HumanEvalReward) -> None:
    good = humaneval.score("    return a + b\n", SPEC)
    assert (good.reward, good.passed, good.total, good.compile_ok) == (1.0, 4, 4, True)
    partial = humaneval.score(
        "    return 4 if a == 2 else a - b + 2 * b * (a != 1) + 2 * (a == 1)\n", SPEC
    )
    assert partial.reward is not None and 0 < partial.reward < 1
    syntax = humaneval.score("    return a +\n", SPEC)
    assert syntax.reward == 0.0 and syntax.compile_ok is False and syntax.status == "compile_error"


@pytest.mark.parametrize(
    "completion",
    [
        "    exit(0)\n",
        "    import sys; sys.exit(0)\n",
        "    import os; os._exit(0)\n",
        "    return a + b\nimport os\nos._exit(0)\n",  # exits while being defined
        "    raise SystemExit(0)\n",
    ],
)
def test_exit_tricks_are_not_a_pass(humaneval: HumanEvalReward, completion: str) -> None:
    assert humaneval.score(completion, SPEC).reward == 0.0


def test_fake_passed_lines_and_always_equal_objects_are_not_a_pass(
    humaneval: HumanEvalReward,
) -> None:
    fake = humaneval.score(
        "    print('PASSED\\nOK\\nall tests passed'); import sys; sys.exit(1)\n", SPEC
    )
    assert fake.reward == 0.0
    always_equal = (
        "    class Any(int):\n"
        "        def __eq__(self, other): return True\n"
        "        __hash__ = int.__hash__\n"
        "    return Any(0)\n"
    )
    assert humaneval.score(always_equal, SPEC).reward == 0.0
    plain_object = "    class E:\n        def __eq__(self, other): return True\n    return E()\n"
    assert humaneval.score(plain_object, SPEC).reward == 0.0


def test_candidate_cannot_reach_the_grader_or_forge_records(humaneval: HumanEvalReward) -> None:
    forger = (
        "    import os, json, glob\n"
        "    seen = []\n"
        "    for path in glob.glob('/proc/*/environ') + glob.glob('/proc/*/fd/*'):\n"
        "        try:\n"
        "            seen.append(open(path, 'rb').read(100))\n"
        "        except OSError:\n"
        "            pass\n"
        "    for fd in range(3, 256):\n"
        "        for i in range(4):\n"
        "            rec = {'nonce': 'x', 'kind': 'test', 'index': i, 'passed': True}\n"
        "            for line in (json.dumps(rec), repr(rec)):\n"
        "                try:\n"
        "                    os.write(fd, (line + '\\n').encode())\n"
        "                except OSError:\n"
        "                    pass\n"
        "    return None\n"
    )
    result = humaneval.score(forger, SPEC)
    assert result.reward == 0.0


def test_candidate_cannot_read_the_graders_config(humaneval: HumanEvalReward) -> None:
    """The candidate is forked from the grader: the config (tests, nonce) on the
    grader's stdin must be out of its reach, through its own stdin or the grader's
    /proc files. Any nonce it finds is used to forge passing records."""
    thief = (
        "    import os, re, sys\n"
        "    found = b''\n"
        "    for path in ('/dev/stdin', f'/proc/{os.getppid()}/fd/0',\n"
        "                 f'/proc/{os.getppid()}/environ', f'/proc/{os.getppid()}/cmdline'):\n"
        "        try:\n"
        "            with open(path, 'rb') as f:\n"
        "                found += f.read(1 << 16)\n"
        "        except OSError:\n"
        "            pass\n"
        "    try:\n"
        "        found += os.read(0, 1 << 16)\n"
        "    except OSError:\n"
        "        pass\n"
        "    frame = sys._getframe()\n"
        "    while frame is not None:  # the stack the fork left: the grader's locals\n"
        "        found += repr(frame.f_locals).encode()\n"
        "        frame = frame.f_back\n"
        "    nonces = {m.decode() for m in re.findall(rb'[0-9a-f]{32}', found)}\n"
        "    print(f'nonces found: {len(nonces)}', file=sys.stderr, flush=True)\n"
        "    for nonce in nonces:\n"
        "        for fd in range(3, 64):\n"
        "            for i in range(4):\n"
        "                rec = {'nonce': nonce, 'kind': 'test', 'index': i, 'passed': True}\n"
        "                try:\n"
        "                    os.write(fd, (repr(rec) + '\\n').encode())\n"
        "                except OSError:\n"
        "                    pass\n"
        "    return None\n"
    )
    result = humaneval.score(thief, SPEC)
    assert result.reward == 0.0 and result.compile_ok is True, result
    assert "nonces found: 0" in result.details["stderr"], result


def test_returned_values_cross_exactly(humaneval: HumanEvalReward) -> None:
    """Floats (inf, nan, the last bit), complex, bytes, big ints and containers come back
    to the tests as they were returned."""
    spec = {
        "prompt": "def f(k):\n",
        "entry_point": "f",
        "test": (
            "def check(candidate):\n"
            "    assert candidate(0) == 0.1 + 0.2\n"
            "    assert candidate(1) == float('-inf')\n"
            "    assert candidate(2) != candidate(2)\n"
            "    assert candidate(3) == complex(1.5, -2.0)\n"
            "    assert candidate(4) == {(1, b'x'): [3 ** 200, None, frozenset({True})]}\n"
        ),
    }
    body = (
        "    return [0.1 + 0.2, float('-inf'), float('nan'), complex(1.5, -2.0),\n"
        "            {(1, b'x'): [3 ** 200, None, frozenset({True})]}][k]\n"
    )
    result = humaneval.score(body, spec)
    assert (result.passed, result.total) == (5, 5), result


def test_sandbox_failure_is_an_infra_error_not_zero() -> None:
    broken = Sandbox(SandboxConfig(ro_binds=("/usr", "/nonexistent-moerl-dir")))
    result = HumanEvalReward(broken).score("    return a + b\n", SPEC)
    assert result.reward is None and result.error_kind == "infra"


def test_invalid_specs_are_rejected(humaneval: HumanEvalReward) -> None:
    with pytest.raises(InvalidSpec):
        humaneval.score("x", {**SPEC, "test": "def nope(): pass"})
    with pytest.raises(InvalidSpec):
        humaneval.score("x", {"prompt": "", "test": SPEC["test"]})
    assert count_tests(SPEC["test"]) == 4


CASES = [{"input": "1 2\n", "output": "3\n"}, {"input": "5 7\n", "output": "12"}]


@pytest.fixture(scope="module")
def stdio(sandbox: Sandbox) -> StdioReward:
    return StdioReward(sandbox)


@pytest.mark.parametrize(
    ("language", "source"),
    [
        ("python", "a, b = map(int, input().split())\nprint(a + b)\n"),
        ("c", "#include <stdio.h>\nint main(){long a,b;scanf(\"%ld %ld\",&a,&b);"
              "printf(\"%ld\\n\",a+b);return 0;}\n"),
        ("cpp", "#include <iostream>\nint main(){long a,b;std::cin>>a>>b;"
                "std::cout<<a+b<<std::endl;}\n"),
        ("bash", "read a b; echo $((a + b))\n"),
    ],
)  # fmt: skip
def test_stdio_programs_in_each_language(stdio: StdioReward, language: str, source: str) -> None:
    result = stdio.score(source, {"language": language, "cases": CASES})
    assert result.reward == 1.0, result


def test_stdio_failures(stdio: StdioReward) -> None:
    wrong_once = stdio.score("a, b = map(int, input().split())\nprint(3)\n",
                             {"language": "python", "cases": CASES})  # fmt: skip
    assert wrong_once.reward == 0.5 and wrong_once.passed == 1
    # The right output followed by a non-zero exit is not a pass.
    bad_exit = stdio.score("a, b = map(int, input().split())\nprint(a + b)\nraise SystemExit(1)\n",
                           {"language": "python", "cases": CASES})  # fmt: skip
    assert bad_exit.reward == 0.0
    broken_c = stdio.score("int main( {", {"language": "c", "cases": CASES})
    assert broken_c.compile_ok is False and broken_c.reward == 0.0
    assert "error" in str(broken_c.details["compiler"])
    with pytest.raises(InvalidSpec):
        stdio.score("", {"language": "cobol", "cases": CASES})


def test_limits_requested_in_the_spec_are_clamped(stdio: StdioReward) -> None:
    t0 = time.monotonic()
    result = stdio.score("import time\ntime.sleep(1000)\n", {
        "language": "python", "cases": CASES[:1], "limits": {"wall_time_s": 1e9},
    })  # fmt: skip
    assert result.reward == 0.0 and result.status == "timeout"
    assert time.monotonic() - t0 < Limits(wall_time_s=5).wall_time_s + 3


def test_reference_data_errors_are_invalid_spec(humaneval: HumanEvalReward) -> None:
    """Errors of the dataset, not the model: top-level code beside `check` (a trailing
    `check(add)`), a test module that fails when run, an unknown limit."""
    trailing = {**SPEC, "test": SPEC["test"] + "check(add)\n"}
    with pytest.raises(InvalidSpec, match="line 7: top-level Expr"):
        humaneval.score("    return a + b\n", trailing)
    broken = {**SPEC, "test": "TOLERANCE = undefined_name\n" + SPEC["test"]}
    result = humaneval.score("    return a + b\n", broken)
    assert result.error_kind == "invalid_spec" and "NameError" in (result.error or ""), result
    with pytest.raises(InvalidSpec, match="unknown limit"):
        humaneval.score("    return a + b\n", {**SPEC, "limits": {"memory_gb": 1}})
    documented = {**SPEC, "test": '"""Tests."""\nimport math\nEPS = 1e-9\n' + SPEC["test"]}
    assert humaneval.score("    return a + b\n", documented).reward == 1.0


def test_limits_the_candidate_hits_are_reported(humaneval: HumanEvalReward) -> None:
    """The candidate killed for memory, or stopped by the pids limit, while the grader
    exits normally: the reward is 0 and the status and details name the limit."""
    hog = "    x = []\n    while True:\n        x.append(b'x' * (8 << 20))\n"
    result = humaneval.score(hog, {**SPEC, "limits": {"memory_mb": 128}})
    assert result.reward == 0.0 and result.status == "memory_limit", result
    assert "memory" in result.details["limits_hit"]  # type: ignore[operator]
    forks = ("    import os\n    while True:\n        try:\n            os.fork()\n"
             "        except OSError:\n            return None\n")  # fmt: skip
    result = humaneval.score(forks, {**SPEC, "limits": {"wall_time_s": 5}})
    assert result.reward == 0.0 and "pids" in result.details["limits_hit"], result  # type: ignore[operator]
    assert result.status in ("pids_limit", "timeout"), result
    # CPython ignores SIGXFSZ; the candidate does not, so the write kills it.
    writer = ("    open('/work/big', 'wb').write(b'x' * (3 << 20))\n    return a + b\n")
    result = humaneval.score(writer, {**SPEC, "limits": {"max_file_size_mb": 1}})
    assert result.reward == 0.0 and result.status == "file_size_limit", result
    assert result.details["limits_hit"] == ["file_size"], result
    plain = humaneval.score("    return a + b\n", SPEC)
    assert plain.status == "ok" and plain.details["limits_hit"] == []
    assert plain.details["candidate_signal"] is None


def test_file_size_limit_of_a_python_program_is_reported(stdio: StdioReward) -> None:
    source = "open('big', 'wb').write(b'x' * (3 << 20))\nprint(3)\n"
    result = stdio.score(source, {"language": "python", "cases": CASES[:1],
                                  "limits": {"max_file_size_mb": 1}})  # fmt: skip
    assert result.reward == 0.0 and result.status == "file_size_limit", result
    assert result.details["limits_hit"] == ["file_size"]
    adds = "open('small', 'wb').write(b'x' * 1000)\nprint(sum(map(int, input().split())))\n"
    small = stdio.score(adds, {"language": "python", "cases": CASES})
    assert small.reward == 1.0 and small.details["limits_hit"] == [], small


def test_a_correct_answer_at_the_size_limit_scores_within_the_default_limits(
    humaneval: HumanEvalReward,
) -> None:
    """The grader receives its candidate in linear time: a correct function followed by
    a comment as long as the reward server accepts is scored, not timed out."""
    padded = "    return a + b\n# " + "x" * (DEFAULT_MAX_COMPLETION_BYTES - 64) + "\n"
    result = humaneval.score(padded, SPEC)
    assert result.reward == 1.0 and result.status == "ok", result


def test_the_harness_reads_the_channel_the_sandbox_opens() -> None:
    """pyharness.py runs inside the sandbox without moerl, so it names the channel's
    variable itself: for the code rewards and the terminal checks alike."""
    from moerl.rewards import pyharness
    from moerl.sandbox.bwrap import CHANNEL_ENV_NAME

    assert pyharness.CHANNEL_ENV_NAME == CHANNEL_ENV_NAME
