"""A real model's path through every stage, on CPU.

A DeepSeek-V3-family checkpoint in Hugging Face format is made here (transformers'
DeepseekV3 with random weights, beside a byte-level BPE tokenizer trained with
`tokenizers` and a ChatML template), then: `moerl hf import` (weights, the
architecture and the tokenizer), `moerl sft` on chat rows, `moerl train` (RL through
the real reward and rollout servers, chat prompts), `moerl hf export` of the trained
policy, and transformers again: its greedy continuation of every held-out prompt
equals the rollout server's, token for token.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1]))
sys.path.insert(0, str(Path(__file__).parents[1] / "distributed"))
from hf_parity_worker import tiny_hf_checkpoint
from tiny_rl_data import comment_tasks
from tokenizer_dirs import make_tokenizer_dir

from moerl.rendezvous import read_endpoints, server_urls

pytestmark = pytest.mark.timeout(600)
VOCAB = 384  # the checkpoint's; the trained tokenizer holds fewer
MAX_TOKENS = 6
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def _moerl(*args: str) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([sys.executable, "-m", "moerl.launchers.cli", *args],
                          capture_output=True, text=True, timeout=400, env=ENV)
    assert proc.returncode == 0, f"moerl {args[0]}: {proc.stdout[-3000:]}{proc.stderr[-3000:]}"
    return proc


def _chat(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    for row in rows:
        row["messages"] = [{"role": "user", "content": row.pop("prompt")}]
    return rows


def _serve(weights: Path, arch: Path, tokenizer: Path, rendezvous: Path) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "moerl.rollout.server", "--port", "0", "--weights", str(weights),
         "--arch-file", str(arch), "--tokenizer", str(tokenizer), "--rendezvous-dir",
         str(rendezvous)], env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not server_urls(rendezvous, "rollout"):
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {proc.stderr.read().decode()[-3000:]}")  # type: ignore[union-attr]
        assert time.monotonic() < deadline, "the rollout server did not come up"
        time.sleep(0.2)
    return proc


def test_hf_checkpoint_through_sft_rl_and_back_to_transformers(tmp_path: Path) -> None:
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed")
    import torch
    from transformers import DeepseekV3ForCausalLM

    from moerl.data.chat import encode_prompt
    from moerl.data.tokenizer import HFTokenizer

    hf = tiny_hf_checkpoint(tmp_path / "hf", vocab_size=VOCAB, max_position_embeddings=512)
    make_tokenizer_dir(hf)
    imported = tmp_path / "imported"
    _moerl("hf", "import", str(hf), str(imported))
    assert (imported / "model.json").is_file() and (imported / "tokenizer.json").is_file()
    # The chat model's EOS is the end of an assistant turn (as in ChatML models).
    tokenizer = ["tokenizer=hf", f"tokenizer.path={imported}",
                 "tokenizer.eos_token='<|im_end|>'"]

    data = comment_tasks(tmp_path / "data")
    train, held_out = (Path(o.split("=", 1)[1]) for o in data[1:])
    for path in (train, held_out):  # every prompt a one-message conversation
        rows = _chat([json.loads(line) for line in path.read_text().splitlines()])
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    sft_rows = tmp_path / "sft.jsonl"  # the answer that passes every task, then end of turn
    sft_rows.write_text("".join(
        json.dumps({"messages": [*json.loads(line)["messages"],
                                 {"role": "assistant", "content": "ok"}]}) + "\n"
        for line in train.read_text().splitlines()))

    sft_out = tmp_path / "sft"
    _moerl("sft", f"model_from={imported}", f"init_weights={imported}", *tokenizer,
           f"sft.data_path={sft_rows}", "sft.steps=30", "sft.global_batch=4",
           "sft.micro_batch=4", "sft.seq_length=64", f"out_dir={sft_out}")
    run = tmp_path / "run"
    _moerl("train", "+experiment=demo", f"model_from={imported}",
           f"init_weights={sft_out / 'weights'}", *tokenizer, *data, "sft.steps=0",
           "rl.steps=2", "rl.prompts_per_step=2", "rl.group_size=2",
           f"rl.sampling.max_tokens={MAX_TOKENS}", "rl.eval_interval=0",
           "data.max_prompt_tokens=128", f"run_dir={run}", "checkpoint.dir=null",
           "logger.wandb_mode=disabled", "logger.plot=false")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "train/loss" in r] == [0, 1]
    final = max((run / "weights").glob("v*"))  # the last version the trainer published
    exported = tmp_path / "exported"
    # the architecture as imported (transformers drops the MTP layer the config names)
    _moerl("hf", "export", str(final), str(exported), f"model={imported / 'hf_config.json'}")

    tok = HFTokenizer(imported, eos_token="<|im_end|>")
    records = [json.loads(line) for line in held_out.read_text().splitlines()]
    for record in records:  # the tokenizer round-trips every prompt
        text = record["messages"][0]["content"]
        assert tok.decode(tok.encode(text)) == text
    prompts = [encode_prompt(tok, "", r["messages"]) for r in records]
    model = DeepseekV3ForCausalLM.from_pretrained(exported).eval()
    rendezvous = tmp_path / "rendezvous"
    server = _serve(final, run / "arch.json", imported, rendezvous)
    try:
        (address,) = read_endpoints(rendezvous, "rollout")
        for prompt in prompts:
            reply = httpx.post(f"http://{address}/v1/completions", timeout=120, json={
                "prompt": [prompt], "max_tokens": MAX_TOKENS, "temperature": 0,
                "stop_token_ids": list(tok.stop_ids)}).json()["choices"][0]
            # SFT taught "ok" and the end of the turn: generation ends at the EOS.
            assert reply["finish_reason"] == "stop" and reply["token_ids"][-1] == tok.eos_id
            with torch.no_grad():
                out = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS,
                                     do_sample=False, eos_token_id=tok.eos_id,
                                     pad_token_id=tok.pad_id)
            assert out[0, len(prompt):].tolist() == reply["token_ids"], (prompt, reply)
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=30)
