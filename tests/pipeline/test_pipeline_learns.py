"""End to end, the asynchronous pipeline improves its tenants (issue: pipeline).

Two tenants of the reverse family on the embedded base, one strictly on-policy and one
allowed to run two versions ahead of its trainer (off-policy data corrected by the
importance ratios against the behaviour log-probs), trained together by `run_jobs`.
Both must raise their greedy held-out accuracy; the threshold is generous (about half
of the gain this configuration shows on this machine).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from marlaas.backends import open_backend
from marlaas.config.job import JobSpec, RunSpec
from marlaas.model.base import default_base_path
from marlaas.pipeline import PipelineOptions, run_jobs

pytestmark = pytest.mark.slow


def reverse_job(name: str, staleness: int, seed: int) -> JobSpec:
    return JobSpec.model_validate(
        {
            "name": name,
            "task": {"family": "reverse"},
            "lora": {"rank": 8, "alpha": 16},
            "algorithm": {
                "group_size": 8,
                "prompts_per_step": 8,
                "learning_rate": 5e-4,
                "max_staleness": staleness,
            },
            "sampling": {"temperature": 1.0, "max_new_tokens": 24},
            "steps": 16,
            "eval_episodes": 128,
            "seed": seed,
        }
    )


async def test_async_pipeline_raises_held_out_accuracy(tmp_path: Path) -> None:
    spec = RunSpec(
        base_model=str(default_base_path()),
        jobs=(reverse_job("on-policy", 0, seed=0), reverse_job("off-policy", 2, seed=1)),
    )
    result = await run_jobs(
        spec, tmp_path, backend=open_backend, options=PipelineOptions(device="cpu")
    )
    summary = {
        n: (r.status, r.eval_before, r.eval_after, r.staleness_max)
        for n, r in result.tenants.items()
    }
    print(summary)
    for r in result.tenants.values():
        assert r.status == "done", summary
        assert r.eval_before is not None and r.eval_after is not None
        assert r.eval_after >= r.eval_before + 0.08, summary
        assert r.staleness_violations == 0
    assert result.tenants["on-policy"].staleness_max == 0
