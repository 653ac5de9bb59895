"""The `programs` domain: its generator (determinism, uids, options, prompts) and its
records graded by the real `stdio` reward in the sandbox: references pass, wrong,
malformed and hostile programs do not, and hostile ones leave nothing behind."""

from __future__ import annotations

import os
import re
import socket
import uuid
from pathlib import Path

import pytest

from moerl.data.domains.program_families import FAMILIES
from moerl.data.domains.programs import LANGUAGES, generate
from moerl.data.prompts import PromptRecord
from moerl.rewards.code import StdioReward
from moerl.sandbox import Sandbox

# One record per (family, language): record i is in LANGUAGES[i % 2], families in turn.
RECORDS = generate(len(FAMILIES) * len(LANGUAGES), 11, "train", {"hidden_cases": 4})


def family_of(record: PromptRecord) -> str:
    return record.uid.split("-")[4]


def first(language: str, family: str | None = None) -> PromptRecord:
    return next(r for r in RECORDS if r.spec["language"] == language
                and family in (None, family_of(r)))  # fmt: skip


@pytest.fixture(scope="module")
def stdio(sandbox: Sandbox) -> StdioReward:
    return StdioReward(sandbox)


def assert_contained(sandbox: Sandbox) -> None:
    """No cgroup and no work dir of this process is left once a score has returned."""
    sandbox.wait_cleanup()
    assert sandbox.layout is not None
    for base in sandbox.layout.bases.values():
        assert [p for p in base.iterdir() if p.name.startswith(f"{os.getpid()}-")] == []
    with sandbox.workspace() as probe:
        work_root = probe.path.parent
    # run-<pid>-shared holds files shared by runs (workspace.py), owned by the process
    assert [p for p in work_root.glob(f"run-{os.getpid()}-*")
            if not p.name.endswith("-shared")] == []


def test_the_records_cover_every_family_in_both_languages() -> None:
    assert {(family_of(r), r.spec["language"]) for r in RECORDS} == {
        (f, lang) for f in FAMILIES for lang in LANGUAGES}


@pytest.mark.sandbox
@pytest.mark.parametrize("record", RECORDS, ids=lambda r: r.uid)
def test_each_reference_passes_every_hidden_case(stdio: StdioReward,
                                                 record: PromptRecord) -> None:
    result = stdio.score(record.reference or "", record.spec)
    assert (result.reward, result.passed, result.total) == (1.0, 4, 4), result


def _extra_line(record: PromptRecord) -> str:
    """The reference, printing one more line at the end."""
    source = record.reference or ""
    if record.spec["language"] == "python":
        return source + "print(0)\n"
    head, _, tail = source.rpartition("    return 0;\n}")
    return head + '    printf("0\\n");\n    return 0;\n}' + tail


def _off_by_one(record: PromptRecord) -> str:
    """FizzBuzz's reference stopping one short of n."""
    source = record.reference or ""
    fixed = source.replace("range(1, n + 1)", "range(1, n)").replace("i <= n", "i < n")
    assert fixed != source
    return fixed


@pytest.mark.sandbox
@pytest.mark.parametrize("language", LANGUAGES)
def test_wrong_programs_score_below_one(stdio: StdioReward, language: str) -> None:
    for record in [r for r in RECORDS if r.spec["language"] == language]:
        result = stdio.score(_extra_line(record), record.spec)
        assert result.reward == 0.0, (record.uid, result)
    fizz = first(language, "fizzbuzz")
    assert stdio.score(_off_by_one(fizz), fizz.spec).reward == 0.0
    # The shown example's output, printed whatever the input: the hidden cases differ.
    reverse = first(language, "reverse_words")
    shown = re.search(r"Example output:\n(.*)\n", reverse.prompt)
    assert shown is not None
    echo = (f"print({shown.group(1)!r})\n" if language == "python" else
            f'#include <stdio.h>\nint main(void) {{ puts("{shown.group(1)}"); return 0; }}\n')
    assert stdio.score(echo, reverse.spec).reward == 0.0


MARKDOWN = "Here is my solution:\n```{fence}\n{source}```\nIt reads the input and prints it."


@pytest.mark.sandbox
@pytest.mark.parametrize(("language", "completion", "compiles"), [
    ("python", "", None),
    ("python", "def main(:\n    print(1)\n", None),
    ("python", "markdown", None),
    ("c", "", False),
    ("c", "int main(void) { printf(\"%d\\n\", 1) return 0; }\n", False),
    ("c", "markdown", False),
])  # fmt: skip
def test_malformed_answers_score_below_one_without_raising(
    stdio: StdioReward, language: str, completion: str, compiles: bool | None
) -> None:
    record = first(language)
    if completion == "markdown":
        fence = "python" if language == "python" else "c"
        completion = MARKDOWN.format(fence=fence, source=record.reference)
    result = stdio.score(completion, record.spec)
    assert result.reward == 0.0 and result.error_kind is None, result
    assert result.compile_ok is compiles


def _hostile(record: PromptRecord, attack: str) -> str:
    """`attack`, then the correct program: only an attack that goes through unharmed
    reaches the reference and passes."""
    return attack + "\n" + (record.reference or "")


@pytest.mark.sandbox
@pytest.mark.parametrize("kind", ["harmless", "infinite_loop", "fork_bomb", "huge_output",
                                  "write_outside", "read_shadow", "network"])  # fmt: skip
def test_hostile_python_programs_are_contained(stdio: StdioReward, sandbox: Sandbox,
                                               kind: str) -> None:
    record = first("python")
    spec = {**record.spec, "cases": record.spec["cases"][:1],
            "limits": {"wall_time_s": 2, "cpu_time_s": 2, "max_processes": 16}}
    escape = Path("/etc", f"moerl-escape-{uuid.uuid4().hex}")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(0.2)
    attack = {
        "harmless": "import os",  # the control: the reference after it passes
        "infinite_loop": "while True:\n    pass",
        "fork_bomb": "import os\nwhile True:\n    try:\n        os.fork()\n"
                     "    except OSError:\n        pass",
        "huge_output": "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)",
        "write_outside": f"open({str(escape)!r}, 'w').write('x')",
        "read_shadow": "print(open('/etc/shadow').read()[:0], end='')",
        "network": "import socket\nsocket.create_connection(('127.0.0.1', "
                   f"{listener.getsockname()[1]}), timeout=1)",
    }[kind]  # fmt: skip
    try:
        result = stdio.score(_hostile(record, attack), spec)
        with pytest.raises(TimeoutError):
            listener.accept()
    finally:
        listener.close()
    assert result.reward == (1.0 if kind == "harmless" else 0.0), result
    assert result.error_kind is None and not escape.exists()
    assert_contained(sandbox)


@pytest.mark.sandbox
@pytest.mark.parametrize("attack", ["for (;;) {}", "for (;;) fork();"])
def test_hostile_c_programs_are_contained(stdio: StdioReward, sandbox: Sandbox,
                                          attack: str) -> None:
    record = first("c")
    spec = {**record.spec, "cases": record.spec["cases"][:1],
            "limits": {"wall_time_s": 2, "cpu_time_s": 2, "max_processes": 16}}
    source = "#include <unistd.h>\n" + (record.reference or "").replace(
        "int main(void) {\n", "int main(void) {\n    " + attack + "\n", 1)
    result = stdio.score(source, spec)
    assert result.compile_ok is True and result.reward == 0.0, result
    assert result.status != "ok"
    assert_contained(sandbox)


def test_same_arguments_give_identical_records_and_longer_sets_extend_shorter() -> None:
    assert generate(12, 5, "train", {}) == generate(12, 5, "train", {})
    assert generate(12, 5, "train", {})[:5] == generate(5, 5, "train", {})


def test_seeds_and_splits_give_different_tasks_and_disjoint_uids() -> None:
    train = generate(16, 5, "train", {})
    other_seed = generate(16, 6, "train", {})
    held_out = generate(16, 5, "eval", {})
    assert all(r.uid.startswith("train-") and r.reward == "stdio" for r in train)
    assert all(r.uid.startswith("eval-") for r in held_out)
    uids = [r.uid for r in train + other_seed + held_out]
    assert len(set(uids)) == len(uids)
    for other in (other_seed, held_out):
        same = [a for a, b in zip(train, other, strict=True) if a.spec == b.spec]
        assert same == []


def test_options_shape_the_records() -> None:
    records = generate(6, 2, "eval", {"languages": ["c"], "hidden_cases": 7, "shown_cases": 3})
    for record in records:
        assert record.spec["language"] == "c" and "C (C17" in record.prompt
        assert len(record.spec["cases"]) == 7
        assert record.prompt.count("Example input:") == 3
        shown = re.findall(r"Example input:\n(.*?)Example output:", record.prompt, re.S)
        assert len(shown) == 3
        assert not {c["input"] for c in record.spec["cases"]} & set(shown)
        assert "#include" in (record.reference or "")
    bare = generate(2, 2, "eval", {"languages": ["python"], "shown_cases": 0})
    assert all("Example" not in r.prompt and r.spec["language"] == "python" for r in bare)


def test_prompts_are_short_and_state_the_task() -> None:
    records = generate(64, 9, "train", {})
    assert max(len(r.prompt) for r in records) <= 600
    for record in records:
        assert "Input:" in record.prompt and "Output:" in record.prompt
        assert "no Markdown fences" in record.prompt
        assert ("Python 3" in record.prompt) == (record.spec["language"] == "python")


@pytest.mark.parametrize(("options", "field"), [
    ({"languages": ["rust"]}, "options.languages"),
    ({"languages": []}, "options.languages"),
    ({"languages": "python"}, "options.languages"),
    ({"languages": ["c", "c"]}, "options.languages"),
    ({"hidden_cases": 0}, "options.hidden_cases"),
    ({"hidden_cases": 65}, "options.hidden_cases"),
    ({"hidden_cases": True}, "options.hidden_cases"),
    ({"shown_cases": 4}, "options.shown_cases"),
    ({"shown_cases": "1"}, "options.shown_cases"),
    ({"hidden_case": 3}, "options.hidden_case"),
])  # fmt: skip
def test_bad_options_are_refused_naming_the_field(options: dict[str, object],
                                                  field: str) -> None:
    with pytest.raises(ValueError, match=re.escape(field) + ":"):
        generate(2, 0, "train", options)


def test_bad_split_is_refused() -> None:
    with pytest.raises(ValueError, match="split"):
        generate(2, 0, "test", {})
