"""A run of chat-format jobs on a tiny chat model (the embedded tokenizer with a
Qwen-style template): a `messages` dataset and the calculator played as a chat with
`<tool_call>` tags both train through the whole pipeline (task built with the base's
tokenizer, turns ended by the end-of-turn token)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from test_chat import CHAT_ROWS, TAGS_TEMPLATE, chat_tokenizer, write_rows
from transformers import LlamaConfig, LlamaForCausalLM

from marlaas.backends import open_backend
from marlaas.config.job import RunSpec
from marlaas.obs.memory import RunRecorder
from marlaas.pipeline.context import PipelineOptions
from marlaas.pipeline.runner import run_jobs

pytestmark = pytest.mark.slow


def test_chat_jobs_train_on_a_chat_model(tmp_path: Path) -> None:
    tok = chat_tokenizer(TAGS_TEMPLATE)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=len(tok),
        max_position_embeddings=1024,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    base = tmp_path / "chat-model"
    LlamaForCausalLM(config).save_pretrained(base)
    tok.save_pretrained(base)
    data = write_rows(tmp_path / "chat.jsonl", CHAT_ROWS * 3)
    common = {
        "algorithm": {"group_size": 2, "prompts_per_step": 1},
        "sampling": {"max_new_tokens": 8},
        "steps": 1,
        "eval_episodes": 1,
    }
    run = RunSpec.model_validate(
        {
            "base_model": str(base),
            "engine": {"max_rank": 8, "max_batch_size": 16},
            "jobs": [
                {
                    "name": "messages",
                    "task": {
                        "type": "dataset",
                        "path": str(data),
                        "grader": {"type": "numeric"},
                        "eval_fraction": 0.0,
                    },
                    **common,
                },
                {"name": "tools", "task": {"family": "calculator", "format": "chat"}, **common},
            ],
        }
    )
    out = tmp_path / "run"
    recorder = RunRecorder(out)
    try:
        result = asyncio.run(
            run_jobs(
                run,
                out,
                backend=open_backend,
                recorder=recorder,
                options=PipelineOptions(device="cpu"),
            )
        )
    finally:
        recorder.close()
    for name, tenant in result.tenants.items():
        assert (tenant.status, tenant.steps_done) == ("done", 1), (name, tenant.failure_reason)
        assert tenant.tokens_trained > 0
