"""A tiktoken BPE tokenizer from a local directory: Kimi-K2's format (no hub access).

The directory holds
    tiktoken.model          one "base64(token bytes) rank" per line: ids 0..n-1
    tokenizer_config.json   the special tokens past the ranks (`added_tokens_decoder`,
                            id -> {"content": ...}), bos/eos/pad tokens, add_bos_token
                            and the chat template (or chat_template.jinja beside it)
Ids n .. n + `reserved` - 1 are special: those the config names, the others
`<|reserved_token_{id}|>`. Text is split by `pattern` before BPE (Kimi-K2's split
by default: runs of Han characters, words with their case and English contractions,
numbers of up to three digits, punctuation, newlines, whitespace).

Special tokens in a text (a rendered chat template) are encoded as their ids, as a
Hugging Face tokenizer does with its added tokens; decoding drops them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from moerl.data.tokenizer import DirectoryTokenizer, read_tokenizer_config, token_text

MODEL_FILE = "tiktoken.model"
RESERVED_SPECIALS = 256

_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
KIMI_K2_PATTERN = "|".join([
    r"[\p{Han}]+",
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTION}",
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTION}",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])


def _specials(config: dict[str, Any], base: int, reserved: int) -> dict[str, int]:
    """Special token text -> id for the `reserved` ids past the `base` ranks."""
    named = {int(i): token_text(v) for i, v in config.get("added_tokens_decoder", {}).items()}
    out = {}
    for token_id in range(base, base + reserved):
        out[named.get(token_id) or f"<|reserved_token_{token_id}|>"] = token_id
    return out


class TiktokenTokenizer(DirectoryTokenizer):
    """`Tokenizer` over a tiktoken BPE directory (see the module docstring); BOS only
    with the config's add_bos_token."""

    def __init__(self, path: str | Path, eos_token: str | None = None,
                 pad_token: str | None = None, bos_token: str | None = None,
                 end_of_turn_token: str | None = None, add_bos: bool | None = None,
                 chat_template: str | None = None, pattern: str | None = None) -> None:
        import tiktoken
        from tiktoken.load import load_tiktoken_bpe

        folder = Path(path)
        model = folder / MODEL_FILE
        if not model.is_file():
            raise FileNotFoundError(f"tokenizer.path: no {MODEL_FILE} in {folder}")
        config = read_tokenizer_config(folder)
        ranks = load_tiktoken_bpe(str(model))
        self._base = len(ranks)
        self._special = _specials(config, self._base, RESERVED_SPECIALS)
        self._enc = tiktoken.Encoding(name=folder.name, pat_str=pattern or KIMI_K2_PATTERN,
                                      mergeable_ranks=ranks, special_tokens=self._special)
        self._read_specials(folder, config, eos_token=eos_token, pad_token=pad_token,
                            bos_token=bos_token, end_of_turn_token=end_of_turn_token,
                            add_bos=add_bos, chat_template=chat_template,
                            bos_by_default=False)

    def _token_id(self, token: str, field_name: str) -> int:
        if token not in self._special:
            raise ValueError(f"tokenizer.{field_name}: {token!r} is not one of the special "
                             f"tokens (ids {self._base}..{self._base + RESERVED_SPECIALS - 1})")
        return self._special[token]

    @property
    def vocab_size(self) -> int:
        return self._base + RESERVED_SPECIALS

    def encode(self, text: str) -> list[int]:
        return list(self._enc.encode(text, allowed_special="all", disallowed_special=()))

    def decode(self, ids: list[int]) -> str:
        # Special and out-of-range ids carry no text; a split multi-byte character
        # decodes to U+FFFD rather than failing mid-rollout.
        return str(self._enc.decode([i for i in ids if 0 <= i < self._base], errors="replace"))
