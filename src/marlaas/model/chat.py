"""Prompts as the base's tokenizer expects them: plain text with the BOS token the
tokenizer adds itself, and conversations rendered with its chat template.

Invariants:
- A text prompt gets the tokenizer's BOS token exactly when the tokenizer adds one
  itself (`add_special_tokens=True` starts with it) and the text does not already
  start with it; never an EOS or any other special token. Observations appended later
  in an episode get no special tokens.
- A rendered chat carries the special tokens its template writes, and nothing more
  (as `apply_chat_template(..., tokenize=True)` does).
- Rendering never mutates the tokenizer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

from marlaas.errors import ConfigError

#: An OpenAI-format chat message: `{"role": ..., "content": ...}` and, for assistant
#: turns that call tools, `tool_calls`.
Message = Mapping[str, Any]


def adds_bos(tokenizer: PreTrainedTokenizerBase) -> int | None:
    """The BOS id the tokenizer puts in front of text by itself, or None."""
    bos = tokenizer.bos_token_id
    if not isinstance(bos, int):
        return None
    ids = tokenizer("a", add_special_tokens=True)["input_ids"]
    return bos if ids and ids[0] == bos else None


def encode_text(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """A plain-text prompt's ids: the text, with BOS as the tokenizer expects."""
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    bos = adds_bos(tokenizer)
    if bos is not None and (not ids or ids[0] != bos):
        ids.insert(0, bos)
    return ids


def encode_rendered(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """The ids of text a chat template rendered: its special tokens, nothing added."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def has_chat_template(tokenizer: PreTrainedTokenizerBase) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def require_template(tokenizer: PreTrainedTokenizerBase, what: str) -> None:
    """`ConfigError` unless the tokenizer has a chat template; `what` needs it."""
    if not has_chat_template(tokenizer):
        raise ConfigError(
            f"{what} needs the base model's chat template, and its tokenizer has none; "
            "use a chat model (a tokenizer_config.json or chat_template.jinja with a "
            "`chat_template`), or give the data as plain `prompt` text"
        )


def render_chat(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Message],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    generation_prompt: bool = True,
) -> str:
    """The conversation as the tokenizer's chat template writes it (`tools` handed to
    the template when given), ending with the assistant's generation prompt."""
    require_template(tokenizer, "a chat prompt")
    text = tokenizer.apply_chat_template(
        [dict(m) for m in messages],
        tools=[dict(t) for t in tools] if tools else None,
        tokenize=False,
        add_generation_prompt=generation_prompt,
    )
    return str(text)
