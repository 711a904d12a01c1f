"""OpenAI-compatible fine-tuning on a real `marlaas serve` process (the in-process
pipeline backend on the embedded base, SQLite, a loopback port), driven by the official
`openai` client only: files, and `alpha/graders/run` on every grader type, the model
judges running on the pipeline's own engine."""

from __future__ import annotations

import io
import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

pytestmark = pytest.mark.slow

ADMIN_KEY = "rft-serve-admin-key-0123456789"


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    root = tmp_path_factory.mktemp("serve")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    base = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if k != "MARLAAS_DB_URL"}
    env.update(MARLAAS_ADMIN_KEY=ADMIN_KEY, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    argv = [sys.executable, "-m", "marlaas.cli", "serve", "--port", str(port)]
    argv += ["--data-dir", str(root / "data"), "--device", "cpu"]
    log = root / "serve.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        for _ in range(600):  # bounded: ~60 s
            if proc.poll() is not None:
                pytest.fail(f"marlaas serve exited early:\n{log.read_text()}")
            try:
                if httpx.get(f"{base}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        else:
            pytest.fail(f"marlaas serve did not become ready:\n{log.read_text()}")
        admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
        r = httpx.post(f"{base}/v1/admin/tenants", json={"name": "acme"}, headers=admin)
        assert r.status_code == 201, r.text
        key = httpx.post(f"{base}/v1/admin/tenants/acme/keys", json={}, headers=admin).json()
        yield openai.OpenAI(base_url=f"{base}/v1", api_key=key["key"], max_retries=0, timeout=120)
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def sample_grader(kind: str) -> dict[str, Any]:
    judge = [{"role": "user", "content": "Q: {{item.question}}"}]
    return {
        "string_check": {
            "type": "string_check",
            "name": "g",
            "input": "{{sample.output_text}}",
            "reference": "{{item.answer}}",
            "operation": "eq",
        },
        "text_similarity": {
            "type": "text_similarity",
            "name": "g",
            "input": "{{sample.output_text}}",
            "reference": "{{item.answer}}",
            "evaluation_metric": "bleu",
        },
        "python": {
            "type": "python",
            "name": "g",
            "source": "def grade(sample, item):\n    return float(sample['output_text'] == item['answer'])\n",
        },
        "score_model": {
            "type": "score_model",
            "name": "g",
            "model": "base",
            "input": judge,
            "range": [0, 1000],
            "sampling_params": {"temperature": 0, "max_completions_tokens": 6},
        },
        "label_model": {
            "type": "label_model",
            "name": "g",
            "model": "base",
            "input": judge,
            "labels": ["19", "20"],
            "passing_labels": ["19"],
        },
        "multi": {
            "type": "multi",
            "name": "g",
            "graders": {
                "a": {
                    "type": "string_check",
                    "name": "a",
                    "input": "{{sample.output_text}}",
                    "reference": "{{item.answer}}",
                    "operation": "eq",
                }
            },
            "calculate_output": "a",
        },
    }[kind]


@pytest.mark.parametrize(
    "kind", ["string_check", "text_similarity", "python", "score_model", "label_model", "multi"]
)
def test_graders_run_on_a_real_server(client: openai.OpenAI, kind: str) -> None:
    result = client.fine_tuning.alpha.graders.run(
        grader=sample_grader(kind),  # type: ignore[arg-type]
        model_sample="19",
        item={"question": "12+7", "answer": "19"},
    )
    errors = result.metadata.errors
    assert not (errors.api_model_grader_server_error or errors.python_grader_runtime_error)
    if kind in ("score_model", "label_model"):
        # The judge is the base behind /v1/chat/completions: the same messages (with the
        # system message that states the answer's form) give the same greedy answer.
        usage = result.model_grader_token_usage_per_model["base"]
        assert usage["completion_tokens"] > 0  # type: ignore[index]
        form = (
            "Answer with one number from 0 to 1000, the score, and nothing else."
            if kind == "score_model"
            else "Answer with exactly one of these labels and nothing else: 19, 20"
        )
        reply = client.chat.completions.create(
            model="base",
            messages=[{"role": "system", "content": form}, {"role": "user", "content": "Q: 12+7"}],
            temperature=0,
            max_tokens=6,
        )
        text = reply.choices[0].message.content or ""
        found = re.search(r"\d+(?:\.\d+)?", text)
        if kind == "score_model":
            expected = float(found.group()) if found and float(found.group()) <= 1000 else None
        else:
            expected = {"19": 1.0, "20": 0.0}.get(found.group() if found else "")
        if expected is None:
            assert errors.api_model_grader_parse_error and result.reward == 0.0, text
        else:
            assert result.reward == expected and not errors.api_model_grader_parse_error, text
    else:
        assert result.reward == pytest.approx(1.0)


def test_rft_needs_a_base_with_a_chat_template(client: openai.OpenAI) -> None:
    """The embedded base has no chat template, and RFT prompts are chat messages."""
    rows = [{"messages": [{"role": "user", "content": "12+7"}], "answer": "19"}] * 4
    data = "".join(json.dumps(r) + "\n" for r in rows).encode()
    training = client.files.create(file=("t.jsonl", io.BytesIO(data)), purpose="fine-tune")
    grader = sample_grader("string_check")
    with pytest.raises(openai.BadRequestError) as caught:
        client.fine_tuning.jobs.create(
            model="base",
            training_file=training.id,
            method={"type": "reinforcement", "reinforcement": {"grader": grader}},  # type: ignore[typeddict-item]
        )
    assert caught.value.param == "model" and "no chat template" in caught.value.message
    assert client.fine_tuning.jobs.list().data == []


def test_files_round_trip_on_a_real_server(client: openai.OpenAI, tmp_path: Path) -> None:
    rows = [{"messages": [{"role": "user", "content": "12+7"}], "answer": "19"}] * 3
    data = "".join(json.dumps(r) + "\n" for r in rows).encode()
    uploaded = client.files.create(file=("t.jsonl", io.BytesIO(data)), purpose="fine-tune")
    assert uploaded.status == "processed"
    assert client.files.content(uploaded.id).content == data
    assert client.files.delete(uploaded.id).deleted
