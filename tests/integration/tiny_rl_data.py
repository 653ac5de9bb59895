"""A dataset on which every RL step of the tiny model trains quickly, for tests of real runs.

Twelve one-line tasks `def f(): return i  # <completion>`: a completion passes while
it stays on the comment line, so the samples of a random policy get different rewards.
"""

from __future__ import annotations

import json
from pathlib import Path


def comment_tasks(root: Path) -> list[str]:
    """Write train.jsonl and eval.jsonl under `root`; the overrides that select them."""
    rows = []
    for i in range(12):
        prompt = f"def f():\n    return {i}  # "
        test = f"def check(candidate):\n    assert candidate() == {i}\n"
        rows.append({"id": f"t{i}", "prompt": prompt, "reward": "humaneval", "reference": "ok",
                     "spec": {"prompt": prompt, "test": test, "entry_point": "f"}})
    lines = [json.dumps(r) + "\n" for r in rows]
    root.mkdir(parents=True, exist_ok=True)
    (root / "train.jsonl").write_text("".join(lines))
    (root / "eval.jsonl").write_text("".join(lines[:2]))
    return ["data.source=jsonl", f"data.path={root / 'train.jsonl'}",
            f"data.eval_path={root / 'eval.jsonl'}"]
