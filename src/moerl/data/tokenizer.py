"""Tokenizers behind one protocol: a byte-level one the project ships, and any
Hugging Face `tokenizer.json` found on local disk (no hub access at run time).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol


class Tokenizer(Protocol):
    @property
    def vocab_size(self) -> int: ...
    @property
    def eos_id(self) -> int: ...
    @property
    def pad_id(self) -> int: ...
    @property
    def bos_id(self) -> int | None: ...
    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...


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

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        # Specials and out-of-range ids carry no text; a split multi-byte character
        # decodes to U+FFFD rather than failing mid-rollout.
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face fast tokenizer loaded from a local `tokenizer.json`."""

    def __init__(self, path: str | Path, eos_token: str, pad_token: str | None = None,
                 bos_token: str | None = None) -> None:
        from tokenizers import Tokenizer as FastTokenizer

        file = Path(path)
        if file.is_dir():
            file = file / "tokenizer.json"
        if not file.is_file():
            raise FileNotFoundError(f"data.tokenizer.path: no tokenizer.json at {file}")
        self._tok = FastTokenizer.from_file(str(file))
        self._eos = self._token_id(eos_token, "eos_token")
        self._pad = self._token_id(pad_token, "pad_token") if pad_token else self._eos
        self._bos = self._token_id(bos_token, "bos_token") if bos_token else None

    def _token_id(self, token: str, field: str) -> int:
        token_id = self._tok.token_to_id(token)
        if token_id is None:
            raise ValueError(f"data.tokenizer.{field}: {token!r} is not in the vocabulary")
        return int(token_id)

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    @property
    def eos_id(self) -> int:
        return self._eos

    @property
    def pad_id(self) -> int:
        return self._pad

    @property
    def bos_id(self) -> int | None:
        return self._bos

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int]) -> str:
        return str(self._tok.decode(ids, skip_special_tokens=True))
