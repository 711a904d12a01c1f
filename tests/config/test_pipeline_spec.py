"""The one spec every pipeline is built from (`PipelineSpec`; a `RunSpec` is one plus
its jobs): the window of adapter versions is derived in one place, bad fields get errors
that name them, and a validated copy validates again."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from marlaas.config.job import (
    DEFAULT_MAX_STALENESS,
    JobSpec,
    PipelineSpec,
    RunSpec,
    load_run_spec,
)
from marlaas.errors import ConfigError
from marlaas.service.settings import ServiceSettings


def job(name: str, staleness: int = 1, rank: int = 4) -> dict[str, Any]:
    return {
        "name": name,
        "task": {"family": "arithmetic"},
        "lora": {"rank": rank},
        "algorithm": {"max_staleness": staleness},
    }


@pytest.mark.parametrize(
    ("max_staleness", "limit", "kept"),
    [(None, DEFAULT_MAX_STALENESS, DEFAULT_MAX_STALENESS + 2), (0, 0, 2), (7, 7, 9)],
)
def test_a_pipeline_keeps_its_staleness_limit_plus_two_versions(
    max_staleness: int | None, limit: int, kept: int
) -> None:
    spec = PipelineSpec(max_staleness=max_staleness)
    assert spec.staleness_limit == limit
    assert spec.versions_kept == kept


def test_a_run_without_a_limit_keeps_the_window_its_stalest_job_needs() -> None:
    run = RunSpec.model_validate({"jobs": [job("a", 1), job("b", 3), job("c", 0)]})
    assert run.max_staleness is None
    assert run.staleness_limit == 3
    assert run.versions_kept == 5
    given = RunSpec.model_validate({"max_staleness": 6, "jobs": [job("a", 1)]})
    assert (given.staleness_limit, given.versions_kept) == (6, 8)


def test_a_run_refuses_a_job_staler_than_its_limit_naming_both() -> None:
    with pytest.raises(
        ValidationError,
        match=r"jobs b ask for an algorithm.max_staleness above max_staleness \(2\)",
    ):
        RunSpec.model_validate({"max_staleness": 2, "jobs": [job("a", 2), job("b", 3)]})


@pytest.mark.parametrize(
    ("fields", "where"),
    [
        ({"max_staleness": 65}, "max_staleness"),
        ({"max_staleness": -1}, "max_staleness"),
        ({"engine": {"max_prefill_tokens": 0}}, "engine.max_prefill_tokens"),
        ({"engine": {"seed": -1}}, "engine.seed"),
        ({"backend": "gpu"}, "backend"),
        ({"max_stalenes": 2}, "max_stalenes"),
    ],
)
def test_a_bad_field_of_either_spec_is_named(fields: dict[str, Any], where: str) -> None:
    with pytest.raises(ValidationError) as caught:
        PipelineSpec.model_validate(fields)
    assert where in {".".join(str(p) for p in e["loc"]) for e in caught.value.errors()}
    with pytest.raises(ValidationError) as caught:
        RunSpec.model_validate({**fields, "jobs": [job("a")]})
    assert where in {".".join(str(p) for p in e["loc"]) for e in caught.value.errors()}


def test_a_jobs_file_with_a_bad_pipeline_field_names_file_and_field(tmp_path: Path) -> None:
    path = tmp_path / "jobs.yaml"
    path.write_text(
        "max_staleness: 1\nengine: {max_prefill_tokens: 0}\n"
        "jobs: [{name: a, task: {family: arithmetic}}]\n"
    )
    with pytest.raises(
        ConfigError, match=r"jobs.yaml: invalid run spec: engine.max_prefill_tokens"
    ):
        load_run_spec(path)


def test_updated_validates_the_copy_again() -> None:
    run = RunSpec.model_validate({"jobs": [job("a", rank=4)]})
    assert run.updated(backend="ray").backend == "ray"
    assert run.updated(backend="ray").jobs == run.jobs
    with pytest.raises(ValidationError, match="backend"):
        run.updated(backend="gpu")
    with pytest.raises(ValidationError, match=r"above engine.max_rank \(16\)"):
        run.updated(jobs=(JobSpec.model_validate(job("big", rank=32)),))
    with pytest.raises(ValidationError, match="max_staleness"):
        run.updated(max_staleness=0)  # job a asks 1


def test_the_service_sizes_its_pipeline_from_its_settings(tmp_path: Path) -> None:
    settings = ServiceSettings(
        data_dir=tmp_path,
        max_lora_rank=32,
        max_staleness=3,
        max_batch_rows=12,
        max_tokens_per_microbatch=1024,
        serve_base_model=tmp_path / "base",
        serve_dtype="bfloat16",
        default_target_modules=("q_proj",),
    )
    spec = settings.pipeline_spec(backend="inprocess", max_active_tenants=5)
    assert spec.engine.max_rank == 32 and spec.engine.max_batch_size == 12
    assert spec.trainer.max_tokens_per_microbatch == 1024
    assert (spec.staleness_limit, spec.versions_kept) == (3, 5)
    assert spec.base_model == str(tmp_path / "base") and spec.dtype == "bfloat16"
    assert spec.default_target_modules == ("q_proj",)
    assert spec.max_active_tenants == 5
