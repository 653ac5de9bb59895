"""Chat rows (`{"messages": [{"role": ..., "content": ...}, ...]}`) rendered with the
tokenizer's chat template, as Hugging Face `apply_chat_template` renders them (a
sandboxed Jinja environment; `messages`, `add_generation_prompt` and the special
tokens' text as variables).

A prompt is the conversation so far with the generation prompt added. An SFT example
trains on the assistant turns only: the conversation is rendered turn by turn, each
turn's text is the difference between successive renderings, and the tokens of
assistant turns carry the loss (the generation prompt before each belongs to the
prompt side).
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from moerl.data.tokenizer import Tokenizer

ROLES = ("system", "user", "assistant", "tool")
Message = dict[str, str]


class ChatError(ValueError):
    """A chat row or template that cannot be rendered; the message names the field."""


def check_messages(value: Any, where: str) -> list[Message]:
    """`value` as a list of {"role", "content"} messages, or ChatError naming `where`."""
    if not isinstance(value, list) or not value:
        raise ChatError(f"{where}: 'messages' must be a non-empty list")
    messages = []
    for i, message in enumerate(value):
        if (not isinstance(message, dict) or message.get("role") not in ROLES
                or not isinstance(message.get("content"), str)):
            raise ChatError(f"{where}: messages[{i}] must be {{'role': one of {ROLES}, "
                            "'content': a string}")
        messages.append({"role": message["role"], "content": message["content"]})
    return messages


@lru_cache(maxsize=8)
def _compiled(template: str) -> Any:
    from jinja2.exceptions import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(template)


def render(tok: Tokenizer, messages: Sequence[Message], add_generation_prompt: bool) -> str:
    """The conversation as text, by the tokenizer's chat template."""
    from jinja2.exceptions import TemplateError

    template = tok.chat_template
    if template is None:
        raise ChatError("data: rows with 'messages' need a tokenizer with a chat template; "
                        "the byte tokenizer has none (use tokenizer=hf tokenizer.path=DIR, "
                        "or tokenizer.chat_template)")
    try:
        return str(_compiled(template).render(messages=list(messages),
                                              add_generation_prompt=add_generation_prompt,
                                              **tok.special_text()))
    except TemplateError as err:
        raise ChatError(f"tokenizer.chat_template: {err}") from err


def encode_chat_prompt(tok: Tokenizer, messages: Sequence[Message]) -> list[int]:
    """The ids a model continues from: the conversation and the generation prompt."""
    return tok.encode(render(tok, messages, add_generation_prompt=True))


def encode_prompt(tok: Tokenizer, prompt: str,
                  messages: Sequence[Message] | None = None) -> list[int]:
    """A prompt's ids: a conversation through the chat template (which writes its own
    BOS), or plain text after BOS where the tokenizer adds one."""
    if messages:
        return encode_chat_prompt(tok, messages)
    return ([] if tok.bos_id is None else [tok.bos_id]) + tok.encode(prompt)


def encode_chat_turns(tok: Tokenizer, messages: Sequence[Message],
                      where: str) -> tuple[list[int], list[int], list[int]]:
    """(prompt ids, the rest of the ids, a 0/1 loss mask over the rest): the prompt
    runs to the first assistant turn; the loss falls on assistant turns only."""
    if not any(m["role"] == "assistant" for m in messages):
        raise ChatError(f"{where}: an SFT conversation needs at least one assistant turn")
    pieces: list[tuple[str, bool]] = []  # (text, trained)
    done = ""
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            opened = render(tok, messages[:i], add_generation_prompt=True) if i else ""
            pieces.append((_extension(done, opened, where, i), False))
            done = opened
        full = render(tok, messages[: i + 1], add_generation_prompt=False)
        pieces.append((_extension(done, full, where, i), message["role"] == "assistant"))
        done = full
    prompt: list[int] = []
    rest: list[int] = []
    mask: list[int] = []
    for text, trained in pieces:
        ids = tok.encode(text)
        if not rest and not trained:
            prompt += ids
        else:
            rest += ids
            mask += [int(trained)] * len(ids)
    return prompt, rest, mask


def _extension(before: str, after: str, where: str, turn: int) -> str:
    if not after.startswith(before):
        raise ChatError(f"{where}: the chat template renders messages[:{turn + 1}] in a way "
                        "that does not extend the earlier turns' text, so assistant turns "
                        "cannot be told apart; train on the last turn only")
    return after[len(before):]
