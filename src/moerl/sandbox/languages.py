"""How each supported language is compiled and run inside the sandbox."""

from __future__ import annotations

from dataclasses import dataclass, replace

from moerl.sandbox.config import Limits
from moerl.sandbox.result import ExecutionResult, ExecutionStatus
from moerl.sandbox.runner import Sandbox
from moerl.sandbox.workspace import Workspace


@dataclass(frozen=True)
class Language:
    name: str
    source_file: str
    compile_argv: tuple[str, ...] | None
    run_argv: tuple[str, ...]


# CPython ignores SIGXFSZ, so a write past the file-size limit would only fail with
# EFBIG; with the default action restored the program dies of the signal and the
# result names the limit, as for programs in the other languages.
_PYTHON_MAIN = ("import _signal; _signal.signal(_signal.SIGXFSZ, _signal.SIG_DFL); "
                "import runpy; runpy.run_path('main.py', run_name='__main__')")  # fmt: skip

LANGUAGES: dict[str, Language] = {
    "python": Language("python", "main.py", None, ("/usr/bin/python3", "-I", "-c", _PYTHON_MAIN)),
    "bash": Language("bash", "main.sh", None, ("/bin/bash", "main.sh")),
    "c": Language(
        "c", "main.c", ("/usr/bin/gcc", "-O2", "-std=c17", "-o", "main", "main.c", "-lm"),
        ("./main",),
    ),
    "cpp": Language(
        "cpp", "main.cpp", ("/usr/bin/g++", "-O2", "-std=c++17", "-o", "main", "main.cpp"),
        ("./main",),
    ),
}  # fmt: skip

# Compilers need more room than the programs they build.
COMPILE_LIMITS = Limits(wall_time_s=30.0, cpu_time_s=30.0, memory_mb=1024, max_processes=32)


def language(name: str) -> Language:
    if name not in LANGUAGES:
        raise ValueError(f"unsupported language {name!r}; supported: {sorted(LANGUAGES)}")
    return LANGUAGES[name]


def prepare(
    sandbox: Sandbox, workspace: Workspace, lang: Language, source: str
) -> ExecutionResult | None:
    """Write the source and compile it if the language needs it. Returns the compile
    result, whose status is COMPILE_ERROR (or SANDBOX_ERROR, or a resource status) when
    it failed, or None for interpreted languages."""
    workspace.write(lang.source_file, source)
    if lang.compile_argv is None:
        return None
    result = sandbox.run(lang.compile_argv, workspace, limits=COMPILE_LIMITS)
    if result.status is ExecutionStatus.RUNTIME_ERROR:
        return replace(result, status=ExecutionStatus.COMPILE_ERROR)
    return result
