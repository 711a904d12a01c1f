"""Supervised (SFT) tenants in the async pipeline: the loss falls on a tiny dataset,
tenants trained together get the adapters each gets alone, an SFT tenant runs next to
a GRPO one, and a resume continues at the right example."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from helpers.pipeline_support import MemoryRecorder, job
from marlaas.backends import open_backend
from marlaas.config.job import EngineSpec, JobSpec, RunSpec
from marlaas.errors import ConfigError
from marlaas.model.mixed import native_bfloat16
from marlaas.obs.progress import EvalDone, StepDone
from marlaas.pipeline import Orchestrator, PipelineContext, PipelineOptions, RunResult, run_jobs

CPU = PipelineOptions(device="cpu")
ROWS = [
    {"prompt": f"Q: {a}+{b}\nA: ", "completion": f"{a + b}\n"}
    for a, b in [(1, 2), (3, 4), (5, 1), (2, 2), (6, 3), (4, 4), (7, 1), (2, 5), (3, 3), (1, 1)]
]
CHAT = [
    {
        "messages": [
            {"role": "system", "content": "Add."},
            {"role": "user", "content": f"{a}+{b}"},
            {"role": "assistant", "content": f"{a + b}"},
        ]
    }
    for a, b in [(1, 2), (3, 4), (5, 1), (2, 2), (6, 3), (4, 4), (7, 1), (2, 5)]
]


def write(path: Path, rows: list[dict[str, Any]]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def sft_job(name: str, data: str, **extra: Any) -> JobSpec:
    fields: dict[str, Any] = {
        "name": name,
        "task": {"type": "dataset", "path": data, "eval_fraction": 0.2},
        "algorithm": {"type": "sft", "batch_size": 4, "learning_rate": 3e-3},
        "steps": 6,
        "eval_every": 3,
        "lora": {"rank": 4},
        **extra,
    }
    return JobSpec.model_validate(fields)


def run_on(base: Path, out: Path, *jobs: JobSpec, **kw: Any) -> Coroutine[Any, Any, RunResult]:
    engine = EngineSpec.model_validate({"max_batch_size": 32, "max_rank": 4})
    # float32: together-equals-alone is exact up to its rounding noise.
    run = RunSpec(base_model=str(base), engine=engine, jobs=jobs, dtype="float32")
    return run_jobs(run, out, backend=open_backend, options=CPU, **kw)


def adapter(out: Path, name: str) -> dict[str, torch.Tensor]:
    return load_file(str(out / "tenants" / name / "adapter" / "adapter_model.safetensors"))


def eval_losses(recorder: MemoryRecorder, name: str) -> dict[int, float]:
    return {
        r.version: r.loss
        for r in recorder.records
        if isinstance(r, EvalDone) and r.tenant == name and r.loss is not None
    }


def test_a_supervised_job_is_a_dataset_job_without_grader(tmp_path: Path) -> None:
    data = write(tmp_path / "d.jsonl", ROWS)
    with pytest.raises(ValueError, match=r"task\.grader: a supervised job"):
        sft_job("x", data, task={"type": "dataset", "path": data, "grader": {"type": "exact"}})
    with pytest.raises(ValueError, match="not a built-in family"):
        sft_job("x", data, task={"family": "arithmetic"})
    with pytest.raises(ValueError, match=r"task\.grader is required by an RL job"):
        JobSpec.model_validate({"name": "rl", "task": {"type": "dataset", "path": data}})
    assert job("rl").algorithm.type == "grpo"  # the default, `type` left out
    for kind in ("dpo", {}, None):
        with pytest.raises(ValueError, match="type must be one of grpo, sft"):
            job("x", algorithm={"type": kind})
    with pytest.raises(ConfigError, match="supervised job: it has no GRPO settings"):
        _ = sft_job("x", data).grpo


async def test_the_loss_falls(base_dir: Path, tmp_path: Path) -> None:
    recorder = MemoryRecorder()
    data = write(tmp_path / "chat.jsonl", CHAT)
    # Scored on its own rows: how well the job learns the data it is given.
    task = {"type": "dataset", "path": data, "eval_fraction": 0, "eval_path": data}
    spec = sft_job("sft", data, task=task)
    result = await run_on(base_dir, tmp_path / "out", spec, recorder=recorder)
    r = result.tenants["sft"]
    assert r.status == "done", r.failure_reason
    assert r.steps_done == 6 and recorder.train_steps("sft") == [1, 2, 3, 4, 5, 6]
    losses = eval_losses(recorder, "sft")
    assert sorted(losses) == [0, 3, 6]
    assert losses[6] < 0.5 * losses[0], losses
    accuracy = recorder.evals("sft")  # token accuracy
    assert accuracy[6] > accuracy[0], accuracy
    steps = [rec.metrics for rec in recorder.records if isinstance(rec, StepDone)]
    assert steps[-1].loss < steps[0].loss
    assert all(m.reward_mean is None and m.token_accuracy is not None for m in steps)
    tenant = tmp_path / "out" / "tenants" / "sft"
    assert (tenant / "adapter" / "adapter_config.json").is_file()
    state = json.loads((tenant / "checkpoints" / "ckpt-00000006" / "state.json").read_text())
    assert state["algo"]["type"] == "sft" and state["extra"]["cursor"] == 6 * 4
    assert sorted(state["extra"]["eval_loss"]) == ["0", "3", "6"]


async def test_tenants_together_train_as_each_alone(base_dir: Path, tmp_path: Path) -> None:
    a = sft_job("a", write(tmp_path / "a.jsonl", ROWS), steps=3, eval_every=0)
    b = sft_job("b", write(tmp_path / "b.jsonl", CHAT), steps=3, eval_every=0, seed=7)
    together = await run_on(base_dir, tmp_path / "both", a, b)
    assert all(r.status == "done" for r in together.tenants.values())
    for spec in (a, b):
        alone = await run_on(base_dir, tmp_path / spec.name, spec)
        assert alone.tenants[spec.name].status == "done"
        got, want = adapter(tmp_path / "both", spec.name), adapter(tmp_path / spec.name, spec.name)
        assert got.keys() == want.keys()
        # Up to float32 noise: when the two tenants happen to share a pass, its rows sum
        # in another order, and Adam's normalisation lifts that noise in an element whose
        # gradient is near zero; so the whole tensor is compared, as the trainer's own
        # together-equals-alone test does. Where the base's linears are bfloat16 (a CPU
        # with native bfloat16 loads the embedded base so), a float32 ulp of difference
        # in a product's input may round to another bfloat16 (~4e-3 of that element):
        # 8e-4 of a tensor seen, in runs where the two tenants shared passes.
        tolerance = 5e-3 if native_bfloat16("cpu") else 1e-4
        for key in want:
            assert float((got[key] - want[key]).norm() / want[key].norm()) < tolerance, key


async def test_a_supervised_and_an_rl_tenant_run_together(base_dir: Path, tmp_path: Path) -> None:
    recorder = MemoryRecorder()
    sft = sft_job("sft", write(tmp_path / "d.jsonl", ROWS), steps=3, eval_every=0)
    rl = job("rl", steps=2)
    result = await run_on(base_dir, tmp_path / "out", sft, rl, recorder=recorder)
    for name, steps in (("sft", 3), ("rl", 2)):
        assert result.tenants[name].status == "done", result.tenants[name].failure_reason
        assert recorder.train_steps(name) == list(range(1, steps + 1))
    rl_steps = [r.metrics for r in recorder.records if isinstance(r, StepDone) and r.tenant == "rl"]
    assert all(m.reward_mean is not None for m in rl_steps)


async def test_resume_continues_at_the_next_example(base_dir: Path, tmp_path: Path) -> None:
    data = write(tmp_path / "d.jsonl", ROWS)  # 8 train rows, batch 4: epochs change at step 3

    def spec(steps: int) -> JobSpec:
        return sft_job("s", data, steps=steps, eval_every=0, checkpoint_every=1)

    straight = await run_on(base_dir, tmp_path / "straight", spec(5))
    assert straight.tenants["s"].status == "done"
    first = await run_on(base_dir, tmp_path / "resumed", spec(3))
    assert first.tenants["s"].steps_done == 3
    second = MemoryRecorder()
    resumed = await run_on(base_dir, tmp_path / "resumed", spec(5), recorder=second, restore=True)
    assert resumed.tenants["s"].status == "done", resumed.tenants["s"].failure_reason
    assert second.train_steps("s") == [4, 5]
    assert second.event_names("tenant_restored") == ["s"]
    got, want = adapter(tmp_path / "resumed", "s"), adapter(tmp_path / "straight", "s")
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-4, atol=1e-5)


async def test_sync_mode_refuses_supervised_jobs(base_dir: Path, tmp_path: Path) -> None:
    sft = sft_job("sft", write(tmp_path / "d.jsonl", ROWS))
    with pytest.raises(ConfigError, match="sync baseline runs RL jobs only"):
        await run_on(base_dir, tmp_path / "out", sft, mode="sync")


async def test_pause_and_a_graceful_close_checkpoint_the_cursor(
    base_dir: Path, tmp_path: Path
) -> None:
    recorder = MemoryRecorder()
    data = write(tmp_path / "d.jsonl", ROWS)
    jobs = tuple(sft_job(n, data, steps=500, eval_every=0) for n in ("p", "q"))
    engine = EngineSpec.model_validate({"max_batch_size": 32, "max_rank": 4})
    run = RunSpec(base_model=str(base_dir), engine=engine, jobs=jobs)
    ctx = await PipelineContext.open(
        run, tmp_path / "out", backend=open_backend, recorder=recorder, options=CPU
    )
    orch = Orchestrator(ctx, run.jobs)
    try:
        task = asyncio.create_task(orch.run())
        second = asyncio.Event()
        recorder.on_metrics = lambda tenant, step: second.set() if step == 2 else None
        await asyncio.wait_for(second.wait(), 60)
        orch.pause("p")
        paused_at = len(recorder.train_steps("p"))
        await asyncio.sleep(0.2)
        assert len(recorder.train_steps("p")) <= paused_at + 1  # at most the step in flight
        orch.close(checkpoint=True)  # p paused, q running
        states = await asyncio.wait_for(task, 60)
    finally:
        await ctx.backend.close()
    for name in ("p", "q"):
        state = states[name]
        assert state.status == "cancelled" and "stopped with the pipeline" in str(state.reason)
        assert 0 < state.version < 500
        ckpt = tmp_path / "out" / "tenants" / name / "checkpoints" / f"ckpt-{state.version:08d}"
        saved = json.loads((ckpt / "state.json").read_text())
        assert saved["extra"]["cursor"] == 4 * state.version  # batch_size examples a step


async def test_a_checkpoint_resumes_only_its_own_algorithm(base_dir: Path, tmp_path: Path) -> None:
    rl = await run_on(base_dir, tmp_path, job("s", steps=1))
    assert rl.tenants["s"].status == "done"
    sft = sft_job("s", write(tmp_path / "d.jsonl", ROWS), steps=2)
    resumed = await run_on(base_dir, tmp_path, sft, restore=True)
    assert resumed.tenants["s"].status == "failed"
    assert "is an RL tenant's, and job 's' is a supervised job" in str(
        resumed.tenants["s"].failure_reason
    )


async def test_a_row_beyond_the_context_fails_its_tenant_naming_it(
    base_dir: Path, tmp_path: Path
) -> None:
    long = {"prompt": "Q: " + "1+" * 400 + "1\nA: ", "completion": "401\n"}
    data = write(tmp_path / "d.jsonl", [*ROWS, long])
    result = await run_on(base_dir, tmp_path / "out", sft_job("s", data, steps=1))
    reason = str(result.tenants["s"].failure_reason)
    assert result.tenants["s"].status == "failed"
    assert "d.jsonl:11 is" in reason and "the base model's context" in reason
