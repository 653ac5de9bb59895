"""A real run (reward server with the sandbox, rollout server, trainer) with a Hugging
Face tokenizer directory as the run's tokenizer and chat rows as its prompts: the SFT
warm-up, the prompts, the rollout server and the stops all use that tokenizer, and a
model whose vocabulary is smaller than the tokenizer's is refused before any stage
starts."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1]))
from tiny_rl_data import comment_tasks
from tokenizer_dirs import make_tokenizer_dir

STEPS = 2


def _chat_rows(data: list[str]) -> list[str]:
    """The comment tasks with each prompt as a one-message conversation."""
    for override in data:
        if override.startswith(("data.path=", "data.eval_path=")):
            path = Path(override.split("=", 1)[1])
            rows = [json.loads(line) for line in path.read_text().splitlines()]
            for row in rows:
                row["messages"] = [{"role": "user", "content": row.pop("prompt")}]
            path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return data


def _train(run: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "moerl.launchers.cli", "train", "+experiment=demo",
            f"run_dir={run}", "checkpoint.dir=null", "logger.wandb_mode=disabled",
            "logger.plot=false", *extra]
    return subprocess.run(argv, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_run_with_a_tokenizer_directory_and_chat_prompts(tmp_path: Path) -> None:
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed")
    tokenizer = make_tokenizer_dir(tmp_path / "tokenizer")
    data = _chat_rows(comment_tasks(tmp_path / "data"))
    run = tmp_path / "run"
    proc = _train(run, *data, "tokenizer=hf", f"tokenizer.path={tokenizer}",
                  "tokenizer.end_of_turn_token='<|im_end|>'", "sft.steps=2", "sft.global_batch=4",
                  "sft.micro_batch=4", "sft.seq_length=48", f"rl.steps={STEPS}",
                  "rl.prompts_per_step=2", "rl.group_size=2", "rl.sampling.max_tokens=8",
                  "rl.eval_interval=0", "rl.dynamic_sampling=false")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "SFT: loss" in proc.stdout + proc.stderr
    rollout_log = (run / "logs" / "rollout.0.log").read_text()
    assert f"tokenizer {tokenizer}" in rollout_log, rollout_log[-2000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "train/loss" in r]
    assert [r["step"] for r in steps] == list(range(STEPS))
    assert all(r["train/tokens"] > 0 for r in steps)


def test_a_tokenizer_larger_than_the_model_is_refused_at_start(tmp_path: Path) -> None:
    tokenizer = make_tokenizer_dir(tmp_path / "tokenizer")
    proc = _train(tmp_path / "run", "tokenizer=hf", f"tokenizer.path={tokenizer}",
                  "model.vocab_size=256")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert re.search(r"has \d+ tokens but model\.vocab_size \(the padded embedding\) is 256",
                     proc.stderr), proc.stderr[-2000:]
    assert not (tmp_path / "run" / "logs").exists()  # no stage started
