"""Tokenizers behind one protocol: a byte-level one the project ships, a Hugging Face
tokenizer directory on local disk (no hub access at run time): `tokenizer.json`, its
`tokenizer_config.json` (special tokens, chat template) or `chat_template.jinja`, and a
tiktoken BPE directory (`tiktoken.model` with that config: Kimi-K2's,
`data.tiktoken_tokenizer`). An imported checkpoint's weights directory holds copies of
these (`moerl hf import`).

The `tokenizer` group (`TokenizerConfig`) picks one for every stage: the trainer, SFT,
held-out evaluation and the rollout servers encode and stop with the same ids.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

# What a tokenizer directory may hold besides tokenizer.json; `moerl hf import` copies them.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "tiktoken.model")


class Tokenizer(Protocol):
    @property
    def vocab_size(self) -> int: ...
    @property
    def eos_id(self) -> int: ...
    @property
    def pad_id(self) -> int: ...
    @property
    def bos_id(self) -> int | None: ...
    @property
    def stop_ids(self) -> tuple[int, ...]: ...
    @property
    def chat_template(self) -> str | None: ...
    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...
    def special_text(self) -> dict[str, str]: ...


@dataclass(frozen=True)
class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; specials follow. Lossless for any text.

    `padded_vocab_size` is what the model's embedding holds (divisible by any tp
    the tiny preset runs with); ids past the specials are never produced.
    """

    padded_vocab_size: int = 512

    BOS = 256
    EOS = 257
    PAD = 258

    def __post_init__(self) -> None:
        if self.padded_vocab_size < 259:
            raise ValueError("data.tokenizer: the byte tokenizer needs a vocabulary of >= 259")

    @property
    def vocab_size(self) -> int:
        return self.padded_vocab_size

    @property
    def eos_id(self) -> int:
        return self.EOS

    @property
    def pad_id(self) -> int:
        return self.PAD

    @property
    def bos_id(self) -> int | None:
        return self.BOS

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return (self.EOS,)

    @property
    def chat_template(self) -> str | None:
        return None  # bytes have no special-token text to mark turns with

    def special_text(self) -> dict[str, str]:
        return {}

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        # Specials and out-of-range ids carry no text; a split multi-byte character
        # decodes to U+FFFD rather than failing mid-rollout.
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


def token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class DirectoryTokenizer:
    """What the tokenizers read from a directory share: BOS/EOS/PAD and the chat template
    come from `tokenizer_config.json` (or `chat_template.jinja`) unless given; generation
    stops at EOS and at `end_of_turn_token` (e.g. Kimi-K2's `<|im_end|>`) when the
    template ends turns with a token other than EOS. Subclasses map a token's text to
    its id (`_token_id`) and encode and decode."""

    add_bos: bool = False

    def _token_id(self, token: str, field_name: str) -> int:
        raise NotImplementedError

    def _read_specials(self, folder: Path, config: dict[str, Any], *, eos_token: str | None,
                       pad_token: str | None, bos_token: str | None,
                       end_of_turn_token: str | None, add_bos: bool | None,
                       chat_template: str | None, bos_by_default: bool) -> None:
        eos = eos_token or token_text(config.get("eos_token"))
        if eos is None:
            raise ValueError(f"tokenizer.eos_token: {folder} names no EOS token "
                             "(tokenizer_config.json eos_token); set tokenizer.eos_token")
        self._eos = self._token_id(eos, "eos_token")
        pad = pad_token or token_text(config.get("pad_token"))
        self._pad = self._token_id(pad, "pad_token") if pad else self._eos
        bos = bos_token or token_text(config.get("bos_token"))
        self._bos = self._token_id(bos, "bos_token") if bos else None
        if add_bos is None:
            add_bos = bool(config.get("add_bos_token", bos_by_default and self._bos is not None))
        self.add_bos = add_bos and self._bos is not None
        turn = self._token_id(end_of_turn_token, "end_of_turn_token") if end_of_turn_token else None
        self._stops = tuple(dict.fromkeys(i for i in (self._eos, turn) if i is not None))
        template = chat_template
        if template is None and (folder / "chat_template.jinja").is_file():
            template = (folder / "chat_template.jinja").read_text()
        if template is None and isinstance(config.get("chat_template"), str):
            template = config["chat_template"]
        self._chat_template = template
        self._specials = {"bos_token": bos or "", "eos_token": eos, "pad_token": pad or eos}

    @property
    def eos_id(self) -> int:
        return self._eos

    @property
    def pad_id(self) -> int:
        return self._pad

    @property
    def bos_id(self) -> int | None:
        return self._bos if self.add_bos else None

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return self._stops

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    def special_text(self) -> dict[str, str]:
        return dict(self._specials)


def read_tokenizer_config(folder: Path) -> dict[str, Any]:
    """`tokenizer_config.json` of `folder`, or {} without one."""
    path = folder / "tokenizer_config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


class HFTokenizer(DirectoryTokenizer):
    """A Hugging Face fast tokenizer from a local directory (or its `tokenizer.json`);
    BOS is prepended by default when the directory names one."""

    def __init__(self, path: str | Path, eos_token: str | None = None,
                 pad_token: str | None = None, bos_token: str | None = None,
                 end_of_turn_token: str | None = None, add_bos: bool | None = None,
                 chat_template: str | None = None) -> None:
        from tokenizers import Tokenizer as FastTokenizer

        given = Path(path)
        file = given / "tokenizer.json" if given.is_dir() else given
        if not file.is_file():
            raise FileNotFoundError(f"tokenizer.path: no tokenizer.json at {file}")
        self._tok = FastTokenizer.from_file(str(file))
        self._read_specials(file.parent, read_tokenizer_config(file.parent),
                            eos_token=eos_token, pad_token=pad_token, bos_token=bos_token,
                            end_of_turn_token=end_of_turn_token, add_bos=add_bos,
                            chat_template=chat_template, bos_by_default=True)

    def _token_id(self, token: str, field_name: str) -> int:
        token_id = self._tok.token_to_id(token)
        if token_id is None:
            raise ValueError(f"tokenizer.{field_name}: {token!r} is not in the vocabulary")
        return int(token_id)

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int]) -> str:
        return str(self._tok.decode(ids, skip_special_tokens=True))


@dataclass
class TokenizerConfig:
    """The `tokenizer` group: the ids every stage of a run encodes, decodes and stops with."""

    kind: Literal["byte", "hf", "tiktoken"] = "byte"
    """byte: UTF-8 bytes (the tiny model); hf: a Hugging Face tokenizer directory;
    tiktoken: a tiktoken BPE directory (tiktoken.model, tokenizer_config.json: Kimi-K2)."""
    path: str | None = None
    """With hf or tiktoken: the directory, or an imported checkpoint's weights directory."""
    eos_token: str | None = None
    """null: tokenizer_config.json's."""
    pad_token: str | None = None
    bos_token: str | None = None
    end_of_turn_token: str | None = None
    """A token that also ends generation (the chat template's end of an assistant turn)."""
    add_bos: bool | None = None
    """Prepend BOS to plain prompts; null: tokenizer_config.json's add_bos_token."""
    chat_template: str | None = None
    """A Jinja chat template replacing the directory's."""
    pattern: str | None = None
    """With tiktoken: the regex splitting text before BPE; null: Kimi-K2's."""

    def __post_init__(self) -> None:
        if self.kind in ("hf", "tiktoken") and not self.path:
            files = "tokenizer.json" if self.kind == "hf" else "tiktoken.model"
            raise ValueError(f"tokenizer.path: tokenizer={self.kind} needs the tokenizer's "
                             f"directory ({files}, tokenizer_config.json)")
        if self.pattern is not None and self.kind != "tiktoken":
            raise ValueError("tokenizer.pattern: only a tiktoken tokenizer splits by a pattern")
        if self.kind == "byte":
            for name in ("path", "eos_token", "pad_token", "bos_token", "end_of_turn_token",
                         "add_bos", "chat_template"):
                if getattr(self, name) is not None:
                    raise ValueError(f"tokenizer.{name}: the byte tokenizer has fixed ids and "
                                     "no files or template; set tokenizer=hf to use a "
                                     "tokenizer directory")
