"""A dataset job scored by an OpenAI grader trains on the real pipeline like any other:
the multi grader's sub-graders (a string check and a python grader in the sandbox) see
the row as `item` and the completion as `sample`, and their formula is the reward."""

from __future__ import annotations

import json
from pathlib import Path

from helpers.pipeline_support import MemoryRecorder, job
from marlaas.backends import open_backend
from marlaas.config.job import EngineSpec, RunSpec
from marlaas.pipeline import PipelineOptions, run_jobs

# The reward is known whatever the model writes: 0.25 from the row's weight field (a
# python grader), plus 0.5 when the completion is not the row's `never` text.
GRADER = {
    "type": "multi",
    "name": "known",
    "graders": {
        "weight": {
            "type": "python",
            "name": "weight",
            "source": "def grade(sample, item):\n    return item['weight'] / 4\n",
        },
        "differs": {
            "type": "string_check",
            "name": "differs",
            "input": "{{sample.output_text}}",
            "reference": "{{item.never}}",
            "operation": "ne",
        },
    },
    "calculate_output": "weight + 0.5 * differs",
}


async def test_an_openai_grader_scores_a_pipeline_job(base_dir: Path, tmp_path: Path) -> None:
    rows = [
        {"prompt": f"Q: {i}+1\nA: ", "reference": str(i + 1), "weight": 1, "never": "\u2603" * 40}
        for i in range(12)
    ]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = job(
        "openai_graded",
        task={"type": "dataset", "path": str(data), "grader": {"type": "openai", "grader": GRADER}},
        steps=2,
        G=2,
        max_new_tokens=4,
    )
    recorder = MemoryRecorder()
    result = await run_jobs(
        RunSpec(base_model=str(base_dir), jobs=(spec,), engine=EngineSpec(max_rank=4)),
        tmp_path / "out",
        backend=open_backend,
        recorder=recorder,
        options=PipelineOptions(device="cpu"),
    )
    tenant = result.tenants["openai_graded"]
    assert tenant.status == "done", tenant.failure_reason
    rewards = [m["reward_mean"] for m in recorder.train_metrics("openai_graded")]
    assert rewards == [0.75, 0.75]
    assert tenant.eval_after == 0.75
