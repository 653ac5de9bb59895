"""Every module that defines a `*Config` class imports without torch or Megatron.

Launchers read and check configs at start-up, before any process needs a tensor, so
a config must not cost the seconds that importing torch takes. The modules are found
with `ast` (a class whose name ends in `Config`) and imported in a fresh interpreter.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from package_graph import SRC, module_name

# Imported one module at a time in one child process. A finder on sys.meta_path sees
# the first request for a heavy package and notes the moerl files on the stack (the
# import chain); it finds nothing itself, so the import goes on as usual. A heavy
# package cannot be unloaded, so the child stops at the first module that pulls one.
_CHILD = """
import importlib, json, sys, traceback
HEAVY = ("torch", "megatron.core")
src, modules = sys.argv[1], sys.argv[2:]
chain = []

class Spy:
    def find_spec(self, name, path=None, target=None):
        if name in HEAVY and not chain:
            chain.extend(f.filename for f in traceback.extract_stack()
                         if f.filename.startswith(src))
        return None

sys.meta_path.insert(0, Spy())
for module in modules:
    try:
        importlib.import_module(module)
    except Exception as err:
        print(json.dumps({"module": module, "error": repr(err)}))
        break
    heavy = [h for h in HEAVY if h in sys.modules]
    if heavy:
        print(json.dumps({"module": module, "heavy": heavy, "via": chain}))
        break
"""


def config_modules() -> list[str]:
    """Modules under src/moerl defining a class whose name ends in `Config`."""
    found = []
    for path in sorted((SRC / "moerl").rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        if any(isinstance(n, ast.ClassDef) and n.name.endswith("Config") for n in ast.walk(tree)):
            found.append(module_name(path))
    return found


def _first_offender(modules: list[str]) -> dict[str, Any] | None:
    """The first of `modules` whose import fails or pulls torch/Megatron; None if none."""
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(SRC), *modules],
        capture_output=True, text=True, env=env, cwd=SRC.parent, timeout=300, check=False,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    return json.loads(lines[-1]) if lines else None


def _describe(report: dict[str, Any]) -> str:
    if "error" in report:
        return f"{report['module']}: import failed: {report['error']}"
    via = [module_name(Path(f)) for f in report["via"]]
    chain = " -> ".join(dict.fromkeys(via))  # one entry per module, in import order
    return f"{report['module']} imports {', '.join(report['heavy'])} (via {chain})"


def offenders(modules: list[str]) -> list[str]:
    """Every module of `modules` that pulls torch/Megatron: a new child after each one."""
    found, rest = [], modules
    while rest and (report := _first_offender(rest)) is not None:
        found.append(_describe(report))
        rest = rest[rest.index(report["module"]) + 1 :]
    return found


def test_config_modules_are_found() -> None:
    modules = config_modules()
    assert {"moerl.config", "moerl.rl.config", "moerl.rl.objective_config"} <= set(modules)
    assert "moerl.rl.policy" not in modules  # the policy reads the rl group (rl.config)


def test_spy_names_a_module_that_pulls_torch() -> None:
    # The loss package is torch by nature: this checks the check, not the package.
    [message] = offenders(["moerl.rl.objective_config", "moerl.rl.losses"])
    assert message.startswith("moerl.rl.losses imports torch (via moerl.rl.losses")


def test_configs_import_without_torch_or_megatron() -> None:
    found = offenders(config_modules())
    assert not found, "config modules that pull torch or Megatron:\n" + "\n".join(found)
