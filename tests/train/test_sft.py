"""Supervised examples as training data: the loader's line-numbered refusals, the
datum builder's targets (assistant turns only, OpenAI's weights honoured, the same
rendering inference uses), the per-token normalisation of a step and the token
accuracy the cross-entropy objective counts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from marlaas.config.specs import SFTSpec
from marlaas.envs.conversations import (
    Conversation,
    in_format,
    load_conversations,
    parse_conversation,
)
from marlaas.errors import DataError
from marlaas.model.chat import chat_prompt
from marlaas.model.tokenizer import build_tokenizer
from marlaas.train.objectives import CrossEntropy, LossInputs
from marlaas.train.sft import SFTTraining, conversation_datum

#: `<|im_start|>role ... <|im_end|>` turns, tools listed in a system turn.
TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def chat_tokenizer(template: str = TEMPLATE) -> Any:
    tok = build_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = template
    return tok


def chat(*turns: tuple[str, str], **extra: Any) -> Conversation:
    messages = [{"role": r, "content": c} for r, c in turns]
    return parse_conversation({"messages": messages, **extra}, "f.jsonl:1", "row-1")


def targets(tok: Any, datum: Any) -> str:
    """The weighted target tokens, decoded."""
    ids = [t for t, w in zip(datum.target_ids, datum.weights_T, strict=True) if w]
    return str(tok.decode(ids))


def test_plain_format_trains_the_assistant_turns_as_inference_prompts_them() -> None:
    tok = build_tokenizer()  # the embedded base's: no chat template
    conv = chat(("system", "Be brief."), ("user", "1+2"), ("assistant", "3"))
    datum = conversation_datum(tok, conv, "f.jsonl:1")
    assert targets(tok, datum) == "3\n"
    # The context the target follows is the serving routes' prompt of the same chat.
    prompt_ids, _ = chat_prompt(tok, [("system", "Be brief."), ("user", "1+2")])
    n_prompt = len(prompt_ids)
    assert list(datum.input_ids[:n_prompt]) == prompt_ids
    assert set(datum.weights_T[: n_prompt - 1]) == {0.0} and datum.weights_T[n_prompt - 1] == 1.0


def test_template_format_and_per_message_weights() -> None:
    tok = chat_tokenizer()
    conv = chat(
        ("user", "hi"),
        ("assistant", "skip me"),
        ("user", "2+2"),
        ("assistant", "4"),
        ("user", "trailing turns are not part of the example"),
    )
    weighted = parse_conversation(
        {
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "skip me", "weight": 0},
                {"role": "user", "content": "2+2"},
                {"role": "assistant", "content": "4"},
            ]
        },
        "f.jsonl:2",
        "row-2",
    )
    both = conversation_datum(tok, conv, "f.jsonl:1")
    assert targets(tok, both) == "skip me<|im_end|>\n4<|im_end|>\n"
    one = conversation_datum(tok, weighted, "f.jsonl:2")
    assert targets(tok, one) == "4<|im_end|>\n"
    # The whole sequence is the template's rendering up to the last trained turn.
    text = tok.decode([one.input_ids[0], *one.target_ids])
    assert text == tok.apply_chat_template(
        [{k: v for k, v in m.items() if k != "weight"} for m in weighted.messages or ()],
        tokenize=False,
    )


def test_text_rows_train_the_completion() -> None:
    tok = build_tokenizer()
    conv = parse_conversation({"prompt": "Q: 1+1\nA: ", "completion": "2\n"}, "f:1", "r")
    assert targets(tok, conversation_datum(tok, conv, "f:1")) == "2\n"


def test_tools_need_a_template_that_renders_them() -> None:
    tool = {"type": "function", "function": {"name": "calc", "parameters": {}}}
    conv = chat(("user", "1+2"), ("assistant", "3"), tools=[tool])
    rendered = conversation_datum(chat_tokenizer(), conv, "f.jsonl:1")
    assert "calc" in build_tokenizer().decode(list(rendered.input_ids))
    no_tools = "{% for m in messages %}{{ m.content }}\n{% endfor %}"
    with pytest.raises(DataError, match=r"f.jsonl:1: field 'tools'.*does not render tools"):
        conversation_datum(chat_tokenizer(no_tools), conv, "f.jsonl:1")
    with pytest.raises(DataError, match=r"f.jsonl:1: field 'tools'.*no chat template"):
        conversation_datum(build_tokenizer(), conv, "f.jsonl:1")


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"messages": [{"role": "user", "content": "hi"}]}, r"line.jsonl:2: .*no assistant"),
        (
            {"messages": [{"role": "robot", "content": "hi"}]},
            r"line.jsonl:2: messages\[0\]\.role must be one of",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "hi", "weight": 1},
                    {"role": "assistant", "content": "x"},
                ]
            },
            r"messages\[0\]\.weight: only assistant",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": "x", "weight": 0.5},
                ]
            },
            r"messages\[1\]\.weight must be 0 or 1",
        ),
        ({"prompt": "x"}, r"line.jsonl:2: field 'completion' must be a non-empty string"),
        ({"text": "x"}, r"needs 'messages' \(chat\) or 'prompt' and 'completion'"),
        ({"messages": [], "functions": []}, r"'functions' is the legacy function format"),
    ],
)
def test_bad_rows_are_refused_with_their_line_and_field(
    tmp_path: Path, row: dict[str, Any], message: str
) -> None:
    good = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    path = tmp_path / "line.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(DataError, match=message):
        load_conversations(path)


def test_a_step_is_the_mean_token_nll_of_its_batch() -> None:
    tok = build_tokenizer()
    short = conversation_datum(tok, chat(("user", "a"), ("assistant", "b")), "f:1")
    long = conversation_datum(tok, chat(("user", "a"), ("assistant", "bcdefg")), "f:2")
    train = SFTTraining(SFTSpec()).train_input("t", [short, long], version=0)
    total = sum(w for d in train.data for w in d.weights_T)
    assert total == pytest.approx(1.0)  # every trained token weighs 1 / the batch's tokens
    assert {w for d in train.data for w in d.weights_T} == {0.0, 1.0 / 9}  # 2 + 7 targets


def test_cross_entropy_counts_the_targets_that_are_the_argmax() -> None:
    logits_BTV = torch.tensor([[[2.0, 0.0, 0.0], [0.0, 3.0, 0.0], [0.0, 0.0, 1.0]]])
    target_BT = torch.tensor([[0, 2, 2]])
    lp_BT = torch.log_softmax(logits_BTV, -1).gather(-1, target_BT[..., None])[..., 0]
    zeros = torch.zeros_like(lp_BT)
    weights_BT = torch.tensor([[1.0, 1.0, 0.0]])  # the third, correct, is not trained
    _, sums = CrossEntropy()(
        LossInputs(lp_BT, logits_BTV[weights_BT != 0], weights_BT, zeros, zeros)
    )
    assert float(sums["correct"]) == 1.0 and float(sums["tokens"]) == 2.0


def test_the_datasets_format_applies() -> None:
    text = parse_conversation({"prompt": "1+1", "completion": "2"}, "f:1", "r")
    as_chat = in_format(text, "chat")
    assert targets(chat_tokenizer(), conversation_datum(chat_tokenizer(), as_chat, "f:1")) == (
        "2<|im_end|>\n"
    )
    assert in_format(text, "text") is text and in_format(text, "auto") is text
    with pytest.raises(
        DataError, match=r"f.jsonl:1: the row carries chat 'messages'.*format is text"
    ):
        in_format(chat(("user", "a"), ("assistant", "b")), "text")
    custom = parse_conversation({"q": "1+1", "completion": "2"}, "f:1", "r", prompt_field="q")
    assert custom.prompt == "1+1"


#: Assistant tool calls as `<call>name</call>`, tool results as `<result>` turns.
TOOL_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<call>{{ c.function.name }}</call>"
    "{% endfor %}{% else %}{{ m.content }}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_tool_call_turns_are_trained_where_the_template_renders_them() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "calc", "arguments": "{}"}}
    conv = parse_conversation(
        {
            "messages": [
                {"role": "user", "content": "1+2"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "content": "3", "tool_call_id": "c1"},
                {"role": "assistant", "content": "3"},
            ]
        },
        "f.jsonl:4",
        "row-4",
    )
    tok = chat_tokenizer(TOOL_TEMPLATE)
    datum = conversation_datum(tok, conv, "f.jsonl:4")
    assert targets(tok, datum) == "<call>calc</call><|im_end|>\n3<|im_end|>\n"  # not the result
    with pytest.raises(DataError, match=r"f.jsonl:4: messages\[1\]\.tool_calls: .*does not render"):
        conversation_datum(chat_tokenizer(), conv, "f.jsonl:4")
    with pytest.raises(
        DataError, match=r"f.jsonl:4: messages\[1\]\.tool_calls: .*no chat template"
    ):
        conversation_datum(build_tokenizer(), conv, "f.jsonl:4")
