"""A tiktoken BPE directory (Kimi-K2's format) as the run's tokenizer, from a BPE file
made here: merges applied, specials from the config past the ranks, reserved ids
named, the chat template's special tokens encoded as their ids, stops at EOS and the
end of a turn, the group in configs/tokenizer composing to it."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from moerl.config import load_run_config
from moerl.data.chat import encode_prompt, render
from moerl.data.tiktoken_tokenizer import RESERVED_SPECIALS, TiktokenTokenizer
from moerl.data.tokenizer import TokenizerConfig
from moerl.data.tokenizer_build import build_tokenizer

# Kimi-K2's chat template, in its shape: role markers, the content, <|im_end|>.
TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'system' %}<|im_system|>system<|im_middle|>"
    "{% elif m['role'] == 'user' %}<|im_user|>user<|im_middle|>{% else %}"
    "<|im_assistant|>assistant<|im_middle|>{% endif %}{{ m['content'] }}<|im_end|>"
    "{% endfor %}{% if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>"
    "{% endif %}")
MERGES = ["in", "th", "the", " the", "re", "ret", "retu", "return", " return", "er", "ing"]
SPECIALS = ["[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>",
            "<|im_system|>", "<|im_middle|>"]


@pytest.fixture(scope="module")
def kimi_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """256 byte tokens then merges, each made of two tokens ranked before it."""
    root = tmp_path_factory.mktemp("tiktoken")
    tokens = [bytes([b]) for b in range(256)] + [m.encode() for m in MERGES]
    (root / "tiktoken.model").write_text("".join(
        f"{base64.b64encode(t).decode()} {rank}\n" for rank, t in enumerate(tokens)))
    base = len(tokens)
    (root / "tokenizer_config.json").write_text(json.dumps({
        "added_tokens_decoder": {str(base + i): {"content": s, "special": True}
                                 for i, s in enumerate(SPECIALS)},
        "bos_token": "[BOS]", "eos_token": "[EOS]", "chat_template": TEMPLATE,
    }))
    return root


def test_bpe_merges_and_round_trips(kimi_dir: Path) -> None:
    tok = build_tokenizer(TokenizerConfig(kind="tiktoken", path=str(kimi_dir),
                                          end_of_turn_token="<|im_end|>"), 1024)
    assert isinstance(tok, TiktokenTokenizer)
    base = 256 + len(MERGES)
    assert tok.vocab_size == base + RESERVED_SPECIALS
    rank = {m: 256 + i for i, m in enumerate(MERGES)}
    assert tok.encode("return the") == [rank["return"], rank[" the"]]
    for text in ("def add(a, b):\n    return a + b  # ünïcødé\n", "中文分词 123456 it's",
                 "  trailing  \r\n\n"):
        assert tok.decode(tok.encode(text)) == text
    assert tok.encode("12345") == [ord("1"), ord("2"), ord("3"), ord("4"), ord("5")]
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (None, base + 1, base + 1)
    assert tok.stop_ids == (base + 1, base + 2)


def test_chat_template_specials_encode_as_their_ids(kimi_dir: Path) -> None:
    tok = build_tokenizer(TokenizerConfig(kind="tiktoken", path=str(kimi_dir)), 1024)
    messages = [{"role": "user", "content": "return 1"}]
    text = render(tok, messages, add_generation_prompt=True)
    assert text == ("<|im_user|>user<|im_middle|>return 1<|im_end|>"
                    "<|im_assistant|>assistant<|im_middle|>")
    ids = encode_prompt(tok, "ignored", messages)
    base = 256 + len(MERGES)
    special = {s: base + i for i, s in enumerate(SPECIALS)}
    assert ids[0] == special["<|im_user|>"] and ids[-1] == special["<|im_middle|>"]
    assert special["<|im_end|>"] in ids
    assert tok.decode(ids) == "userreturn 1assistant"  # specials carry no text


def test_reserved_ids_and_bad_settings_name_the_field(kimi_dir: Path, tmp_path: Path) -> None:
    base = 256 + len(MERGES)
    tok = TiktokenTokenizer(kimi_dir, end_of_turn_token=f"<|reserved_token_{base + 9}|>")
    assert tok.stop_ids == (base + 1, base + 9)
    with pytest.raises(ValueError, match=r"tokenizer\.end_of_turn_token: '<eot>'"):
        TiktokenTokenizer(kimi_dir, end_of_turn_token="<eot>")
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.path: no tiktoken\.model"):
        TiktokenTokenizer(tmp_path)
    with pytest.raises(ValueError, match=r"tokenizer\.path: tokenizer=tiktoken"):
        TokenizerConfig(kind="tiktoken")
    with pytest.raises(ValueError, match=r"has \d+ tokens but model\.vocab_size"):
        build_tokenizer(TokenizerConfig(kind="tiktoken", path=str(kimi_dir)), 512)


def test_kimi_k2_group_composes(kimi_dir: Path) -> None:
    cfg = load_run_config(["tokenizer=kimi_k2", f"tokenizer.path={kimi_dir}"]).tokenizer
    assert (cfg.kind, cfg.end_of_turn_token, cfg.path) == ("tiktoken", "<|im_end|>",
                                                           str(kimi_dir))
