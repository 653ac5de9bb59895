"""A Hugging Face tokenizer directory made on the spot (no hub): byte-level BPE trained
on a little text, specials in the style of a chat model, and a ChatML template."""

from __future__ import annotations

import json
from pathlib import Path

SPECIALS = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "def add(a, b):\n    return a + b\n", "Return n times 3.", "Write a function.",
    "The quick brown fox jumps over the lazy dog.", "print(sum(map(int, input().split())))",
] * 20


def make_tokenizer_dir(path: Path, vocab_size: int = 400, template: str | None = CHATML,
                       add_bos: bool = True) -> Path:
    """`path` holding tokenizer.json and tokenizer_config.json; returns it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    config: dict[str, object] = {"bos_token": "<s>", "eos_token": {"content": "</s>"},
                                 "pad_token": "<pad>", "add_bos_token": add_bos}
    if template is not None:
        config["chat_template"] = template
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path
