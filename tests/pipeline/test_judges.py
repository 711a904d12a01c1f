"""Model graders (`score_model`, `label_model`) in pipeline jobs: the judge comes from
the factory whoever runs the pipeline injects; a job that no judge can answer is refused
when it is submitted, naming the grader field; the run's base judges `marlaas run`."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import pytest

from helpers.pipeline_support import MemoryRecorder, job
from marlaas.backends import open_backend
from marlaas.config.job import EngineSpec, JobSpec, PipelineSpec, RunSpec
from marlaas.device.port import DevicePort
from marlaas.envs.openai_graders import Judge, JudgeReply
from marlaas.errors import ConfigError
from marlaas.obs.recorder import NullRecorder
from marlaas.pipeline import PipelineOptions, run_jobs
from marlaas.pipeline.context import Backend, PipelineContext
from marlaas.pipeline.envpool import EnvPool
from marlaas.pipeline.judges import base_judge, job_judges
from marlaas.pipeline.runtime import PipelineRuntime

CPU = PipelineOptions(device="cpu")


def grader(model: str = "base") -> dict[str, Any]:
    """0.5 when the answer is not the row's `never` text, plus a twentieth of the judge's
    score out of 10."""
    return {
        "type": "multi",
        "name": "judged",
        "graders": {
            "judge": {
                "type": "score_model",
                "name": "judge",
                "model": model,
                "input": [
                    {
                        "role": "user",
                        "content": "Rate {{sample.output_text}} for {{item.answer}}",
                    }
                ],
                "range": [0, 10],
                "sampling_params": {"temperature": 0, "max_completions_tokens": 3},
            },
            "differs": {
                "type": "string_check",
                "name": "differs",
                "input": "{{sample.output_text}}",
                "reference": "{{item.never}}",
                "operation": "ne",
            },
        },
        "calculate_output": "0.5 * differs + 0.05 * judge",
    }


def judged_job(name: str, data: Path, model: str = "base") -> JobSpec:
    task = {
        "type": "dataset",
        "path": str(data),
        "grader": {"type": "openai", "grader": grader(model)},
    }
    return job(name, task=task, steps=2, G=2, max_new_tokens=4)


class Scripted:
    """A judge that always scores 7, keeping what it was asked."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, list[tuple[str, str]], int]] = []

    async def __call__(
        self,
        model: str,
        messages: Sequence[tuple[str, str]],
        *,
        max_tokens: int,
        temperature: float,
        top_p: float,
        seed: int | None,
    ) -> JudgeReply:
        self.asked.append((model, list(messages), max_tokens))
        return JudgeReply("7", 5, 1)


class Counting:
    """Passes calls on to `inner`, counting them and the tokens of the replies."""

    def __init__(self, inner: Judge) -> None:
        self.inner = inner
        self.replies: list[JudgeReply] = []

    async def __call__(
        self, model: str, messages: Sequence[tuple[str, str]], **kw: Any
    ) -> JudgeReply:
        reply = await self.inner(model, messages, **kw)
        self.replies.append(reply)
        return reply


async def test_jobs_are_judged_by_the_injected_factory(base_dir: Path, tmp_path: Path) -> None:
    rows = [
        {
            "prompt": f"Q: {i}+1\nA: ",
            "reference": str(i + 1),
            "answer": str(i + 1),
            "never": "\u2603" * 40,
        }
        for i in range(12)
    ]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    scripted = Scripted()
    counted: dict[str, Counting] = {}
    asked_for: list[str] = []

    def judges(device: DevicePort, spec: JobSpec) -> Judge:
        asked_for.append(spec.name)
        if spec.name == "scripted":
            return scripted
        return counted.setdefault(spec.name, Counting(base_judge(device, spec)))

    recorder = MemoryRecorder()
    spec = PipelineSpec(base_model=str(base_dir), engine=EngineSpec(max_rank=4), max_staleness=2)
    rt = await PipelineRuntime.start(
        spec, tmp_path / "out", backend=open_backend, options=CPU, recorder=recorder, judges=judges
    )
    try:
        # base_judge refuses another model when the job is submitted, naming the field.
        with pytest.raises(ConfigError, match=r"task\.grader\.grader\.graders\.judge\.model"):
            rt.submit(judged_job("elsewhere", data, model="ft:base:acme::job"), restore=False)
        assert "elsewhere" not in rt.states()
        rt.submit(judged_job("scripted", data), restore=False)
        rt.submit(judged_job("based", data), restore=False)
        ended = await asyncio.wait_for(asyncio.gather(rt.wait("scripted"), rt.wait("based")), 300)
    finally:
        await rt.close()
    assert [s.status for s in ended] == ["done", "done"], [s.reason for s in ended]
    # Asked at submission and again at setup, for each job; never shared between jobs.
    assert sorted(asked_for) == ["based", "based", "elsewhere", "scripted", "scripted"]
    # The scripted judge's 7 is the reward: 0.5 + 0.05 x 7, at every sample.
    rewards = [m["reward_mean"] for m in recorder.train_metrics("scripted")]
    assert rewards == pytest.approx([0.85, 0.85])
    model, messages, max_tokens = scripted.asked[0]
    assert model == "base" and max_tokens == 3
    assert messages[0] == (
        "system",
        "Answer with one number from 0 to 10, the score, and nothing else.",
    )
    assert messages[1][0] == "user" and messages[1][1].startswith("Rate ")
    # Each judge prompt is rendered from the sample and its own row.
    answers = {f" for {r['answer']}" for r in rows}
    assert all(any(msgs[1][1].endswith(a) for a in answers) for _, msgs, _ in scripted.asked)
    # The base judged every sample of the other job (2 steps x 2 prompts x 2 samples,
    # and its evals), within the grader's token limit.
    replies = counted["based"].replies
    assert len(replies) >= 8
    assert all(r.prompt_tokens > 0 and 0 < r.completion_tokens <= 3 for r in replies)
    for m in recorder.train_metrics("based"):
        assert 0.0 <= m["reward_mean"] <= 1.0


def test_a_pipeline_without_judges_refuses_a_job_that_needs_one(tmp_path: Path) -> None:
    weighted = {
        "type": "weighted",
        "graders": [
            {"weight": 1, "grader": {"type": "exact"}},
            {"weight": 1, "grader": {"type": "openai", "grader": grader("base")}},
        ],
    }
    spec = job("nested", task={"type": "dataset", "path": "rows.jsonl", "grader": weighted})
    assert job_judges(spec) == [("task.grader.graders.1.grader.grader.graders.judge.model", "base")]
    assert job_judges(job("plain")) == []
    ctx = PipelineContext(
        run=RunSpec.model_construct(jobs=()),
        out_dir=tmp_path,
        backend=cast(Any, None),  # never reached: the refusal comes first
        recorder=NullRecorder(),
        options=CPU,
    )
    assert ctx.judge_for(job("plain")) is None
    with pytest.raises(
        ConfigError, match=r"graders\.1\.grader\.grader\.graders\.judge\.model.*without judges"
    ):
        ctx.judge_for(spec)


class _RemotePool(EnvPool):
    """A pool whose environments run elsewhere (as the Ray backend's do)."""

    in_process = False


def test_a_judge_is_refused_where_graders_run_on_remote_workers(tmp_path: Path) -> None:
    ctx = PipelineContext(
        run=RunSpec.model_construct(jobs=()),
        out_dir=tmp_path,
        backend=Backend(device=cast(Any, None), envs=_RemotePool()),
        recorder=NullRecorder(),
        options=CPU,
        judges=base_judge,
    )
    spec = judged_job("remote", tmp_path / "rows.jsonl")
    with pytest.raises(ConfigError, match=r"graders\.judge\.model.*remote environment workers"):
        ctx.judge_for(spec)


async def test_run_jobs_judges_with_the_runs_base_by_default(
    base_dir: Path, tmp_path: Path
) -> None:
    """`marlaas run`'s path: no judge given, the base judges."""
    data = tmp_path / "rows.jsonl"
    rows = [
        {"prompt": f"Q: {i}+2\nA: ", "reference": str(i + 2), "answer": str(i + 2)}
        for i in range(6)
    ]
    data.write_text("".join(json.dumps({**r, "never": "x" * 30}) + "\n" for r in rows))
    run = RunSpec(
        base_model=str(base_dir), jobs=(judged_job("run", data),), engine=EngineSpec(max_rank=4)
    )
    recorder = MemoryRecorder()
    result = await run_jobs(
        run, tmp_path / "out", backend=open_backend, options=CPU, recorder=recorder
    )
    tenant = result.tenants["run"]
    assert tenant.status == "done", tenant.failure_reason
    # The judge's rows were the job's: its generated tokens are its rollouts' (the tokens
    # it trained on), its evals' (2 evals of 1 held-out row, at most 4 tokens each) and
    # its judge's, at least one token for each of the 8 samples it trained on.
    rollouts = sum(m["tokens"] for m in recorder.train_metrics("run"))
    assert tenant.tokens_generated - rollouts - 2 * 4 >= 8
