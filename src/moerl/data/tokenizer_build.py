"""The configured tokenizer (`tokenizer` group): bytes, a Hugging Face tokenizer
directory, or a tiktoken BPE file, checked against the model's vocabulary."""

from __future__ import annotations

from moerl.data.tiktoken_tokenizer import TiktokenTokenizer
from moerl.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, TokenizerConfig


def build_tokenizer(cfg: TokenizerConfig, model_vocab_size: int) -> Tokenizer:
    """The configured tokenizer, checked against the model's padded vocabulary."""
    tok: Tokenizer
    if cfg.kind == "byte":
        tok = ByteTokenizer(model_vocab_size)
    elif cfg.kind == "tiktoken":
        assert cfg.path is not None
        tok = TiktokenTokenizer(cfg.path, eos_token=cfg.eos_token, pad_token=cfg.pad_token,
                                bos_token=cfg.bos_token, end_of_turn_token=cfg.end_of_turn_token,
                                add_bos=cfg.add_bos, chat_template=cfg.chat_template,
                                pattern=cfg.pattern)
    else:
        assert cfg.path is not None
        tok = HFTokenizer(cfg.path, eos_token=cfg.eos_token, pad_token=cfg.pad_token,
                          bos_token=cfg.bos_token, end_of_turn_token=cfg.end_of_turn_token,
                          add_bos=cfg.add_bos, chat_template=cfg.chat_template)
    if tok.vocab_size > model_vocab_size:
        raise ValueError(
            f"tokenizer: {cfg.path or 'the byte tokenizer'} has {tok.vocab_size} tokens but "
            f"model.vocab_size (the padded embedding) is {model_vocab_size}; use the model "
            "this tokenizer belongs to, or a larger model.vocab_size")
    return tok
