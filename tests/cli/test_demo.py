"""`marlaas demo`: the packaged job set, and the command end to end on a tiny job file
(table, estimate, run folder)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from marlaas.cli.demo_cmd import load_demo_spec
from marlaas.cli.main import app
from marlaas.config.specs import TaskSpec
from marlaas.errors import ConfigError

torch.set_num_threads(1)

TINY = """
engine: {max_batch_size: 32, adapter_slots: 4, max_rank: 4}
jobs:
  - name: tiny-arith
    task: {family: arithmetic}
    lora: {rank: 4, alpha: 8}
    algorithm: {group_size: 4, prompts_per_step: 2}
    sampling: {temperature: 0.8, max_new_tokens: 8}
    steps: 2
    eval_episodes: 4
  - name: tiny-calc
    task: {family: calculator, tool_latency_s: [0.01, 0.02]}
    lora: {rank: 4, alpha: 8}
    algorithm: {group_size: 4, prompts_per_step: 2}
    sampling: {temperature: 0.8, max_new_tokens: 12}
    steps: 1
    eval_episodes: 4
"""


def test_packaged_demo_set_is_many_tenants_over_many_families() -> None:
    spec = load_demo_spec(None)
    families = {job.task.family for job in spec.jobs if isinstance(job.task, TaskSpec)}
    assert len(spec.jobs) >= 8 and len(families) >= 4
    assert spec.base_model is None  # the embedded base
    for job in spec.jobs:
        assert 3e-4 <= job.algorithm.learning_rate <= 1e-3
        assert 0.7 <= job.sampling.temperature <= 1.0
        assert job.algorithm.group_size == 8 and 4 <= job.algorithm.prompts_per_step <= 8
        assert 32 <= job.eval_episodes <= 64


def _invoke(*args: str) -> tuple[int, str, BaseException | None]:
    result = CliRunner().invoke(app, ["demo", *args], env={"COLUMNS": "200"})
    return result.exit_code, result.output, result.exception


def test_demo_runs_a_job_file_end_to_end(tmp_path: Path) -> None:
    jobs = tmp_path / "jobs.yaml"
    jobs.write_text(TINY)
    out = tmp_path / "run"
    code, output, exc = _invoke(
        "--jobs", str(jobs), "--out", str(out), "--no-live", "--slice-steps", "1"
    )
    assert code == 0, f"{output}\n{exc!r}"

    result = json.loads((out / "result.json").read_text())
    estimate = json.loads((out / "sync_estimate.json").read_text())
    assert result["mode"] == "async"
    # the table: one row per tenant with its task, steps, eval before/after and estimate
    rows = (("tiny-arith", "arithmetic", "2/2"), ("tiny-calc", "calculator", "1/1"))
    for name, family, steps in rows:
        tenant = result["tenants"][name]
        row = next(line for line in output.splitlines() if f" {name} " in line)
        cells = [c.strip() for c in row.split("│")[1:-1]]
        change = 100 * (tenant["eval_after"] - tenant["eval_before"])
        assert cells == [
            name,
            family,
            steps,
            f"{tenant['eval_before']:.1%}",
            f"{tenant['eval_after']:.1%}",
            f"{change:+.1f} pt",
            f"{estimate['tenants'][name]['total_s']:.1f} s",
        ]
    for header in ("tenant", "task", "steps", "eval before", "eval after", "sync time (est.)"):
        assert header in output
    assert f"{result['wall_s']:.1f} s wall" in output
    assert f"device busy {result['device_busy_fraction']:.1%}" in output
    assert f"synchronous baseline, same work: {estimate['total_s']:.1f} s estimated" in output
    assert "how the sync time was estimated: measured, then extrapolated" in output
    assert f"run folder: {out}" in output.replace("\n", " ")

    # the estimate's inputs: a real synchronous slice of 1 step per tenant
    assert estimate["slice_steps"] == 1 and estimate["missing"] == []
    assert estimate["tenants"]["tiny-arith"]["steps"] == 2
    slice_result = json.loads((out / "sync-slice" / "result.json").read_text())
    assert slice_result["mode"] == "sync"
    assert {t["steps_done"] for t in slice_result["tenants"].values()} == {1}

    # the run folder is a `marlaas run` folder
    for name in ("run.json", "metrics.jsonl", "events.jsonl", "summary.json", "trace.json"):
        assert (out / name).is_file(), name
    for name in ("curves.png", "utilization.png"):
        assert (out / name).stat().st_size > 0
    for name in ("tiny-arith", "tiny-calc"):
        assert (out / "tenants" / name / "adapter" / "adapter_config.json").is_file()


def test_demo_refuses_a_used_folder(tmp_path: Path) -> None:
    (tmp_path / "old.txt").write_text("a previous run")
    code, _, exc = _invoke("--out", str(tmp_path), "--no-live")
    assert code != 0 and isinstance(exc, ConfigError)
    assert "not an empty folder" in str(exc)


def test_demo_names_a_missing_job_file(tmp_path: Path) -> None:
    code, _, exc = _invoke("--jobs", str(tmp_path / "nope.yaml"), "--no-live")
    assert code != 0 and isinstance(exc, ConfigError)
    assert "cannot read" in str(exc)


@pytest.mark.parametrize("bad", ["--slice-steps=0", "--threads=0"])
def test_demo_rejects_bad_numbers(bad: str) -> None:
    code, output, _ = _invoke(bad, "--no-live")
    assert code == 2 and "Invalid value" in output
