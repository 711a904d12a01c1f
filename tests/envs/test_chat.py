"""Chat-format data and chat episodes: `messages` rows rendered with the base tokenizer's
chat template, BOS as the tokenizer expects, and tool calls in the template's own
format (Qwen-style tags, JSON function calls, or the text protocol's line). The
tokenizers are the embedded one plus a chat template written here."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from tokenizers import processors
from transformers import PreTrainedTokenizerFast

from marlaas.config.job import JobSpec
from marlaas.envs.base import Example, Tool
from marlaas.envs.chat import ChatEnv, ChatFamily
from marlaas.envs.datasets import DatasetTask, load_jsonl
from marlaas.envs.tasks import get_family
from marlaas.errors import ConfigError, DataError
from marlaas.model.chat import ToolChat, encode_rendered, encode_text, tool_style
from marlaas.model.tokenizer import build_tokenizer
from marlaas.pipeline.data import build_task
from marlaas.rollout.episode import run_episode
from marlaas.types import Completion, RolloutRequest, SamplingParams

#: A Qwen-style template: `<|im_start|>role ... <|im_end|>` turns, tools in a system
#: turn, calls as `<tool_call>` JSON, results as `<tool_response>` in a user turn.
TAGS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:\n<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n"
    'Call one as <tool_call>{"name": ..., "arguments": {...}}</tool_call><|im_end|>\n'
    "{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n"
    "</tool_response><|im_end|>\n"
    "{% elif m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n"
    "{% for c in m.tool_calls %}<tool_call>\n"
    '{{ {"name": c.function.name, "arguments": c.function.arguments} | tojson }}\n'
    "</tool_call>{% endfor %}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

#: A template that takes tools but has no tags: the model answers with a JSON call.
JSON_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}[AVAILABLE]{{ tools | tojson }}[/AVAILABLE]{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'tool' %}[RESULT]{{ m.content }}[/RESULT]"
    "{% elif m.role == 'assistant' and m.tool_calls %}[CALL]"
    '{{ {"name": m.tool_calls[0].function.name, '
    '"parameters": m.tool_calls[0].function.arguments} | tojson }}<|im_end|>'
    "{% elif m.role == 'assistant' %}{{ m.content }}<|im_end|>"
    "{% else %}[{{ m.role | upper }}]{{ m.content }}{% endif %}"
    "{% endfor %}"
)

#: No tool support at all.
PLAIN_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

CALC = get_family("calculator")


def chat_tokenizer(template: str, bos: bool = False) -> PreTrainedTokenizerFast:
    """The embedded byte-level tokenizer with chat turn tokens and `template`; `bos`:
    it also puts `<s>` in front of every text, as Llama and Gemma tokenizers do."""
    tok = build_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.eos_token = "<|im_end|>"
    if bos:
        tok.add_special_tokens({"bos_token": "<s>"})
        bos_id = tok.convert_tokens_to_ids("<s>")
        tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", bos_id)]
        )
    tok.chat_template = template
    return tok


def write_rows(path: Path, rows: Sequence[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


CHAT_ROWS = [
    {
        "messages": [
            {"role": "system", "content": "Answer with a number."},
            {"role": "user", "content": "What is 2+3?"},
            {"role": "assistant", "content": "5"},  # after the last user turn: not shown
        ],
        "reference": "5",
        "difficulty": "easy",
    },
    {
        "messages": [{"role": "user", "content": [{"type": "text", "text": "1+1?"}]}],
        "reference": "2",
    },
]


def dataset_job(path: Path, **task: Any) -> JobSpec:
    return JobSpec.model_validate(
        {
            "name": "chat",
            "task": {
                "type": "dataset",
                "path": str(path),
                "grader": {"type": "numeric"},
                "eval_fraction": 0.0,
                **task,
            },
        }
    )


# -- datasets ---------------------------------------------------------------------------


def test_messages_rows_load_up_to_the_last_user_turn(tmp_path: Path) -> None:
    examples = load_jsonl(write_rows(tmp_path / "d.jsonl", CHAT_ROWS))
    first, second = examples
    assert first.prompt == "" and first.messages is not None
    assert [m["role"] for m in first.messages] == ["system", "user"]
    assert first.meta == {"difficulty": "easy"}  # extra fields reach the grader
    assert second.messages == ({"role": "user", "content": "1+1?"},)
    # The messages may also sit in the prompt field itself.
    moved = [{"prompt": r["messages"], "reference": r["reference"]} for r in CHAT_ROWS]
    assert load_jsonl(write_rows(tmp_path / "p.jsonl", moved))[0].messages == first.messages


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"reference": "1"}, "missing field 'prompt' (or 'messages' for chat rows"),
        ({"messages": [], "reference": "1"}, "non-empty list of chat messages"),
        ({"messages": [{"role": "bot", "content": "x"}], "reference": "1"}, "role must be"),
        ({"messages": [{"role": "user", "content": 3}], "reference": "1"}, "string or a list"),
        ({"messages": [{"role": "system", "content": "x"}], "reference": "1"}, "no user message"),
    ],
)
def test_bad_chat_rows_name_the_line(tmp_path: Path, row: dict[str, Any], message: str) -> None:
    path = write_rows(tmp_path / "d.jsonl", [CHAT_ROWS[1], row])
    with pytest.raises(DataError, match=rf"d\.jsonl:2: .*{re.escape(message)}"):
        load_jsonl(path)


def test_a_chat_dataset_renders_with_the_template(tmp_path: Path) -> None:
    tok = chat_tokenizer(PLAIN_TEMPLATE)
    task = build_task(dataset_job(write_rows(tmp_path / "d.jsonl", CHAT_ROWS)), tok)
    assert isinstance(task, DatasetTask) and task.chat
    prompts = {ex.id: ex.prompt for ex in task.train}
    assert prompts["row-1"] == (
        "<|im_start|>system\nAnswer with a number.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n"
    )
    env = task.make_env(task.train[0])
    assert env.chat
    # `format: chat` wraps text rows as one user message; `format: text` keeps them.
    text_rows = write_rows(tmp_path / "t.jsonl", [{"prompt": "7*6=", "reference": "42"}])
    wrapped = build_task(dataset_job(text_rows, format="chat"), tok)
    assert wrapped.examples("train", 1)[0].prompt.startswith("<|im_start|>user\n7*6=<|im_end|>")
    plain = build_task(dataset_job(text_rows), tok)
    assert plain.examples("train", 1)[0].prompt == "7*6="


def test_a_chat_dataset_without_a_template_is_refused(tmp_path: Path) -> None:
    path = write_rows(tmp_path / "d.jsonl", CHAT_ROWS)
    with pytest.raises(ConfigError, match="has none; use a chat model"):
        build_task(dataset_job(path), build_tokenizer())
    with pytest.raises(DataError, match=r"task\.format is text"):
        build_task(dataset_job(path, format="text"), chat_tokenizer(PLAIN_TEMPLATE))
    with pytest.raises(DataError, match="not rendered"):
        DatasetTask(load_jsonl(path), grader=None, eval_fraction=0.0)  # type: ignore[arg-type]


# -- BOS --------------------------------------------------------------------------------


def test_bos_as_the_tokenizer_expects() -> None:
    tok = chat_tokenizer("{{ bos_token }}" + PLAIN_TEMPLATE, bos=True)
    bos = tok.bos_token_id
    assert encode_text(tok, "12") == [bos, *tok("12", add_special_tokens=False)["input_ids"]]
    assert encode_text(tok, "<s>12").count(bos) == 1
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert encode_rendered(tok, str(rendered)).count(bos) == 1  # the template's own
    no_bos = build_tokenizer()  # the embedded base's tokenizer adds nothing
    assert encode_text(no_bos, "12") == no_bos("12", add_special_tokens=False)["input_ids"]


# -- tool calls -------------------------------------------------------------------------


CALL_QWEN = '<tool_call>\n{"name": "calc", "arguments": {"expression": "3*4+5"}}\n</tool_call>'


@pytest.mark.parametrize(
    ("template", "style", "said"),
    [
        (TAGS_TEMPLATE, "tags", CALL_QWEN),
        (JSON_TEMPLATE, "json", '{"name": "calc", "parameters": {"expression": "3*4+5"}}'),
        (PLAIN_TEMPLATE, "text", "calc 3*4+5"),
    ],
)
def test_tool_calls_in_the_templates_own_format(template: str, style: str, said: str) -> None:
    chat = ToolChat(chat_tokenizer(template))
    assert chat.style == style == tool_style(chat.tokenizer)
    tools = CALC.make_env(CALC.examples("train", 1)[0]).tools
    call = chat.parse(said, tools)
    assert call is not None and (call.name, call.argument("expression")) == ("calc", "3*4+5")
    assert chat.parse("The answer is 17.", tools) is None
    assert chat.parse(said.replace("calc", "shell"), tools) is None  # not one of its tools
    prompt = chat.prompt("Q: 3 times 4 plus 5", tools)
    assert "3 times 4 plus 5" in prompt
    assert ("expression" in prompt) and ("Evaluates an integer expression" in prompt)


def test_openai_style_calls_are_read_too() -> None:
    chat = ToolChat(chat_tokenizer(JSON_TEMPLATE))
    tools = (Tool("calc", "calculator", "expression"),)
    openai_style = {"type": "function", "function": {"name": "calc", "arguments": '{"x": "1"}'}}
    call = chat.parse(f"sure: {json.dumps(openai_style)}", tools)
    assert call is not None and call.argument("expression") == "1"  # its only argument


def test_the_text_after_a_tool_call_is_the_templates() -> None:
    tok = chat_tokenizer(TAGS_TEMPLATE)
    chat = ToolChat(tok)
    call = chat.parse(CALL_QWEN, (Tool("calc", "c", "expression"),))
    assert call is not None
    turn = chat.tool_turn(call, "= 17")
    # After the model's own end-of-turn token: the template's newline, the result in a
    # user turn, the next generation prompt.
    assert turn == (
        "\n<|im_start|>user\n<tool_response>\n= 17\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


# -- chat episodes ----------------------------------------------------------------------


class Scripted:
    """The engine's place: answers each turn with the next scripted text + EOS."""

    def __init__(self, tok: PreTrainedTokenizerFast, turns: Sequence[str]) -> None:
        self.tok = tok
        self.turns = list(turns)
        self.requests: list[RolloutRequest] = []

    async def __call__(self, request: RolloutRequest) -> Completion:
        self.requests.append(request)
        text = self.turns.pop(0)
        ids = (*self.tok(text, add_special_tokens=False)["input_ids"], self.tok.eos_token_id)
        return Completion(
            request_id=request.request_id,
            tenant=request.tenant,
            version=0,
            prompt_len=len(request.prompt_ids),
            token_ids=ids,
            logprobs=tuple(-0.5 for _ in ids),
            text=text,
            finish_reason="eos",
        )


async def test_a_calculator_episode_played_as_a_qwen_style_chat() -> None:
    tok = chat_tokenizer(TAGS_TEMPLATE)
    family = ChatFamily(CALC, tok)
    example = Example(
        id="e", prompt="Q: 3 times 4 plus 5\nA: ", reference="17", meta={"expression": "3*4+5"}
    )
    env = family.make_env(example)
    assert isinstance(env, ChatEnv) and env.chat
    submit = Scripted(tok, [CALL_QWEN, "17"])
    traj = await run_episode(
        submit, tok, env, tenant="t", example_id="e", sampling=SamplingParams(max_new_tokens=64)
    )
    assert traj.reward == 1.0 and traj.turns == 2
    first, second = submit.requests
    assert "\n" not in first.sampling.stop  # chat turns end at the end-of-turn token
    prompt = tok.decode(first.prompt_ids)
    assert prompt.startswith("<|im_start|>system\nTools:") and "Q: 3 times 4 plus 5" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")
    # The second turn continues the whole conversation as the template renders it.
    said = {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"type": "function", "function": {"name": "calc", "arguments": {"expression": "3*4+5"}}}
        ],
    }
    conversation = [
        {"role": "user", "content": "Q: 3 times 4 plus 5"},
        said,
        {"role": "tool", "content": "= 17"},
    ]
    whole = tok.apply_chat_template(
        conversation,
        tools=[t.schema() for t in env.tools],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert tok.decode(second.prompt_ids) == whole
    # Loss mask: the model's turns (with their end-of-turn token), not the tool result.
    n_call = len(tok(CALL_QWEN, add_special_tokens=False)["input_ids"]) + 1
    assert traj.loss_mask_T[:n_call] == (1,) * n_call
    assert traj.token_ids[n_call - 1] == tok.eos_token_id
    assert 0 in traj.loss_mask_T[n_call:] and traj.loss_mask_T[-3:] == (1, 1, 1)
