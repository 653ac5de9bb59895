"""A Hugging Face tokenizer directory as the run's tokenizer: specials from its
config, stops at EOS and the end of a turn, the vocabulary checked against the
model's; chat rows rendered by its template, SFT loss on assistant turns only."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[2]))
from tokenizer_dirs import CHATML, make_tokenizer_dir

from moerl.data.chat import ChatError, encode_prompt, render
from moerl.data.prompts import DatasetError, parse_row
from moerl.data.sft import SFTDataError, instruction_examples, sft_batch
from moerl.data.tokenizer import HFTokenizer, TokenizerConfig
from moerl.data.tokenizer_build import build_tokenizer

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Add 1 and 2."},
        {"role": "assistant", "content": "3"}, {"role": "user", "content": "And 2 and 2?"},
        {"role": "assistant", "content": "4"}]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tokenizer_dir(tmp_path_factory.mktemp("tokenizer"))


def test_specials_and_template_come_from_the_directory(hf_dir: Path) -> None:
    tok = build_tokenizer(TokenizerConfig(kind="hf", path=str(hf_dir),
                                          end_of_turn_token="<|im_end|>"), 512)
    assert isinstance(tok, HFTokenizer)
    vocab = json.loads((hf_dir / "tokenizer.json").read_text())["model"]["vocab"]
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (vocab["<s>"], vocab["</s>"], vocab["<pad>"])
    assert tok.stop_ids == (vocab["</s>"], vocab["<|im_end|>"])
    assert tok.chat_template == CHATML
    text = "def add(a, b):\n    return a + b  # ünïcødé\n"
    assert tok.decode(tok.encode(text)) == text
    assert encode_prompt(tok, text) == [vocab["<s>"], *tok.encode(text)]


def test_a_vocabulary_larger_than_the_models_is_refused_naming_both(hf_dir: Path) -> None:
    size = HFTokenizer(hf_dir).vocab_size
    assert size > 256
    with pytest.raises(ValueError, match=rf"has {size} tokens but model\.vocab_size .* is 256"):
        build_tokenizer(TokenizerConfig(kind="hf", path=str(hf_dir)), 256)


def test_bad_tokenizer_settings_name_the_field(hf_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"tokenizer\.path"):
        TokenizerConfig(kind="hf")
    with pytest.raises(ValueError, match=r"tokenizer\.end_of_turn_token: the byte tokenizer"):
        TokenizerConfig(end_of_turn_token="</s>")
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.path"):
        build_tokenizer(TokenizerConfig(kind="hf", path=str(tmp_path)), 512)
    with pytest.raises(ValueError, match=r"tokenizer\.end_of_turn_token: '<eot>'"):
        build_tokenizer(TokenizerConfig(kind="hf", path=str(hf_dir), end_of_turn_token="<eot>"),
                        512)


def test_chat_prompt_is_rendered_with_the_generation_prompt(hf_dir: Path) -> None:
    tok = build_tokenizer(TokenizerConfig(kind="hf", path=str(hf_dir)), 512)
    text = render(tok, CHAT[:2], add_generation_prompt=True)
    assert text == ("<s><|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"
                    "Add 1 and 2.<|im_end|>\n<|im_start|>assistant\n")
    ids = encode_prompt(tok, "ignored", CHAT[:2])
    assert ids[0] == tok.bos_id and ids.count(tok.bos_id) == 1  # the template's BOS only
    assert tok.decode(ids) == text.replace("<s>", "").replace("<|im_start|>", "").replace(
        "<|im_end|>", "")  # specials carry no text when decoded


def test_sft_conversation_trains_on_assistant_turns_only(hf_dir: Path, tmp_path: Path) -> None:
    tok = build_tokenizer(TokenizerConfig(kind="hf", path=str(hf_dir)), 512)
    data = tmp_path / "sft.jsonl"
    data.write_text(json.dumps({"messages": CHAT}) + "\n"
                    + json.dumps({"prompt": "Add 1 and 2.", "response": "3"}) + "\n")
    chat, plain = instruction_examples(tok, str(data), [])
    batch = sft_batch([chat], 96, tok.pad_id)
    trained = [int(label) for label, m in zip(batch.labels[0], batch.loss_mask[0], strict=True)
               if m]
    # Exactly the two assistant answers and their end-of-turn text are trained.
    assert tok.decode(trained) == "3\n4\n"
    assert trained.count(tok._tok.token_to_id("<|im_end|>")) == 2
    assert tok.decode(list(chat.prompt_ids)).endswith("Add 1 and 2.\nassistant\n")
    assert plain.response_mask is None and plain.response_ids[-1] == tok.eos_id


def test_chat_rows_without_a_template_or_assistant_turn_are_refused(
        hf_dir: Path, tmp_path: Path) -> None:
    byte = build_tokenizer(TokenizerConfig(), 512)
    with pytest.raises(ChatError, match=r"tokenizer=hf"):
        encode_prompt(byte, "x", CHAT[:2])
    tok = build_tokenizer(TokenizerConfig(kind="hf", path=str(hf_dir)), 512)
    data = tmp_path / "sft.jsonl"
    data.write_text(json.dumps({"messages": CHAT[:2]}) + "\n")
    with pytest.raises(SFTDataError, match=r"row 1: an SFT conversation needs"):
        instruction_examples(tok, str(data), [])
    data.write_text(json.dumps({"messages": [{"role": "robot", "content": "x"}]}) + "\n")
    with pytest.raises(SFTDataError, match=r"row 1: messages\[0\]"):
        instruction_examples(tok, str(data), [])


def test_prompt_rows_may_be_conversations() -> None:
    row = parse_row(json.dumps({"messages": CHAT[:2], "reward": "r", "spec": {}}), 3)
    assert row.messages == CHAT[:2] and row.prompt == "Be brief.\nAdd 1 and 2."
    with pytest.raises(DatasetError, match=r"row 3: field 'prompt'"):
        parse_row(json.dumps({"reward": "r", "spec": {}}), 3)


def test_vllm_and_sglang_runs_need_the_models_tokenizer(hf_dir: Path) -> None:
    from moerl.config import load_run_config
    from moerl.typed_config import ConfigError

    for engine in ("vllm", "sglang"):
        with pytest.raises(ConfigError, match=rf"rollout\.engine={engine} .*tokenizer=hf"):
            load_run_config([f"rollout.engine={engine}", f"+rollout.hf_model_dir={hf_dir}"])
    cfg = load_run_config(["rollout.engine=vllm", f"+rollout.hf_model_dir={hf_dir}",
                           "tokenizer=hf", f"tokenizer.path={hf_dir}"])
    assert cfg.tokenizer.path == str(hf_dir)


def test_imported_weights_directory_is_a_tokenizer_directory(hf_dir: Path,
                                                            tmp_path: Path) -> None:
    """`moerl hf import` copies the tokenizer beside the weights it writes."""
    from moerl.launchers.hf_cli import copy_tokenizer_files

    weights = tmp_path / "weights"
    weights.mkdir()
    assert copy_tokenizer_files(hf_dir, weights) == ["tokenizer.json", "tokenizer_config.json"]
    tok = build_tokenizer(TokenizerConfig(kind="hf", path=str(weights)), 512)
    assert tok.chat_template == CHATML
    assert tok.encode("def f") == HFTokenizer(hf_dir).encode("def f")
