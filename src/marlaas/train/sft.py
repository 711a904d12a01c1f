"""Supervised fine-tuning in terms of the trainer's primitives.

`conversation_datum` turns a supervised example (`marlaas.envs.conversations`) into one
next-token `Datum`: the tokens the model would see, weight 1 on the tokens of each
trained assistant turn (its text and the template's end-of-turn marker), 0 on the rest.
The rendering is the one inference uses, so the adapter learns to answer the prompts
it will be served:

- with the base's chat template, each assistant turn is what the template adds to the
  conversation before it (rendered with the generation prompt) when the turn is
  appended; the context between turns is tokenized as one piece, as the serving
  routes tokenize a prompt. `tools` and `tool_calls` go to the template, which must
  render them (checked: a template that never mentions them would drop them);
- without one (the embedded base), the plain format of `marlaas.model.chat.chat_prompt`:
  system text as is, `Q: <user>`, `A: <assistant>`, one line each, BOS as the tokenizer
  adds it; tools cannot be written there and are refused;
- a text row is its prompt (BOS as the tokenizer adds it) then its completion, as is
  (no end token added: end the completion with the stop the model should learn).

One optimizer step of one tenant is `forward_backward` of its batch with the
`CrossEntropy` objective and weights normalised per token over the whole step batch
(each trained token's weight is 1 / the batch's trained tokens, so the loss is the mean
token NLL of the batch, independent of how rows split into micro-batches), then
`optim_step` with the job's AdamW parameters (`SFTTraining`). Eval is `forward` with
unit weights: mean token NLL and the fraction of targets that are the argmax.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from marlaas.config.specs import SFTSpec
from marlaas.envs.conversations import WEIGHT, Conversation
from marlaas.errors import DataError
from marlaas.model.chat import (
    PLAIN_TURN_END,
    encode_rendered,
    encode_text,
    has_chat_template,
    render_chat,
)
from marlaas.train.objectives import CrossEntropy
from marlaas.train.optim import AdamParams, AlgorithmSnapshot
from marlaas.train.records import TrainInput
from marlaas.types import Datum

_PLAIN = {"system": "", "developer": "", "user": "Q: ", "assistant": "A: "}


def _render(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]],
    generation_prompt: bool,
    where: str,
) -> str:
    try:
        return render_chat(tokenizer, messages, tools=tools, generation_prompt=generation_prompt)
    except Exception as e:  # jinja's errors (roles that must alternate, ...) are the data's
        raise DataError(f"{where}: the base's chat template cannot render messages: {e}") from e


def _template_pieces(
    tokenizer: PreTrainedTokenizerBase, conv: Conversation, where: str
) -> list[tuple[str, float]]:
    messages = conv.messages or ()
    template = str(getattr(tokenizer, "chat_template", "") or "")
    if conv.tools and "tools" not in template:
        raise DataError(f"{where}: field 'tools': the base's chat template does not render tools")
    clean = [{k: v for k, v in m.items() if k != WEIGHT} for m in messages]
    pieces: list[tuple[str, float]] = []
    before = ""
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        if message.get("tool_calls") and "tool_calls" not in template:
            raise DataError(
                f"{where}: messages[{i}].tool_calls: the base's chat template does not "
                "render tool calls"
            )
        head = _render(tokenizer, clean[:i], conv.tools, True, where)
        turn = _render(tokenizer, clean[: i + 1], conv.tools, False, where)
        if not head.startswith(before) or not turn.startswith(head):
            raise DataError(
                f"{where}: messages[{i}]: the base's chat template does not render this "
                "conversation turn by turn (an earlier turn changes when one is added), so "
                "its assistant tokens cannot be told apart; give one assistant turn per row"
            )
        pieces += [(head[len(before) :], 0.0), (turn[len(head) :], float(message[WEIGHT]))]
        before = turn
    return pieces


def _plain_pieces(conv: Conversation, where: str) -> list[tuple[str, float]]:
    if conv.tools:
        raise DataError(f"{where}: field 'tools': the base has no chat template to render tools")
    pieces: list[tuple[str, float]] = []
    context = ""
    for i, message in enumerate(conv.messages or ()):
        role = message["role"]
        if role == "tool" or message.get("tool_calls"):
            field = "role" if role == "tool" else "tool_calls"
            raise DataError(
                f"{where}: messages[{i}].{field}: the base has no chat template to render "
                "tool calls; use a chat model, or rows without tools"
            )
        text = str(message["content"])
        if role == "assistant":
            pieces += [(context + _PLAIN["assistant"], 0.0)]
            pieces += [(text + PLAIN_TURN_END, float(message[WEIGHT]))]
            context = ""
        else:
            context += f"{_PLAIN[role]}{text}{PLAIN_TURN_END}"
    return pieces


def conversation_datum(tokenizer: PreTrainedTokenizerBase, conv: Conversation, where: str) -> Datum:
    """The next-token `Datum` of `conv` (see the module docstring); `DataError` naming
    `where` and the field for what the base cannot render."""
    templated = conv.messages is not None and has_chat_template(tokenizer)
    if conv.messages is None:
        pieces = [(conv.prompt, 0.0), (conv.completion, 1.0)]
    elif templated:
        pieces = _template_pieces(tokenizer, conv, where)
    else:
        pieces = _plain_pieces(conv, where)
    ids: list[int] = []
    weights: list[float] = []
    for k, (text, weight) in enumerate(pieces):
        if k == 0 and not templated:
            piece = encode_text(tokenizer, text)  # BOS as the tokenizer adds it
        else:
            piece = encode_rendered(tokenizer, text)
        ids += piece
        weights += [weight] * len(piece)
    if len(ids) < 2 or not any(weights[1:]):
        raise DataError(f"{where}: the example has no target tokens to train on")
    return Datum(input_ids=tuple(ids[:-1]), target_ids=tuple(ids[1:]), weights_T=tuple(weights[1:]))


def trained_tokens(datum: Datum) -> int:
    return sum(1 for w in datum.weights_T if w != 0)


@dataclass(frozen=True)
class SFTTraining:
    """A tenant's supervised settings; makes the arguments of its train and eval calls."""

    algo: SFTSpec

    @property
    def objective(self) -> CrossEntropy:
        return CrossEntropy()

    @property
    def adam(self) -> AdamParams:
        return AdamParams.from_spec(self.algo)

    def train_input(self, tenant: str, data: Sequence[Datum], version: int) -> TrainInput:
        """One step's `forward_backward` input: weights divided by the batch's trained
        tokens (the per-token mean over the step's batch)."""
        total = sum(trained_tokens(d) for d in data)
        scaled = tuple(
            Datum(d.input_ids, d.target_ids, tuple(w / total for w in d.weights_T)) for d in data
        )
        return TrainInput(tenant=tenant, data=scaled, loss=self.objective, version=version)

    def eval_input(self, tenant: str, data: Sequence[Datum], version: int) -> TrainInput:
        """A `forward` input over held-out rows with their own (unit) weights."""
        return TrainInput(tenant=tenant, data=tuple(data), loss=self.objective, version=version)


@dataclass(frozen=True)
class SFTSnapshot(AlgorithmSnapshot):
    """A supervised tenant's whole state: what its checkpoint holds."""

    algo: SFTSpec
