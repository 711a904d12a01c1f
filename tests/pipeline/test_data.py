"""A tenant's data: a deterministic train stream, disjoint eval, seeds, task building."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers.pipeline_support import job
from marlaas.envs.datasets import DatasetTask
from marlaas.errors import DataError
from marlaas.pipeline.data import (
    BLOCK,
    ExampleStream,
    build_task,
    episode_seed,
    eval_examples,
    eval_sampling,
    train_sampling,
)


def test_stream_is_deterministic_and_seeded_by_the_job() -> None:
    spec = job("a", seed=1)
    first = ExampleStream(build_task(spec), spec)
    again = ExampleStream(build_task(spec), spec)
    indices = [0, 5, BLOCK - 1, BLOCK, 3 * BLOCK + 7, 2]  # out of order, across blocks
    assert [first[i].id for i in indices] == [again[i].id for i in indices]
    other = job("a", seed=2)
    shuffled = ExampleStream(build_task(other), other)
    ids = {first[i].id for i in range(BLOCK)}
    assert ids == {shuffled[i].id for i in range(BLOCK)}  # same block, another order
    assert [first[i].id for i in range(BLOCK)] != [shuffled[i].id for i in range(BLOCK)]


def test_eval_is_held_out_and_greedy() -> None:
    spec = job("a", eval_episodes=20)
    task = build_task(spec)
    stream = ExampleStream(task, spec)
    evals = eval_examples(task, spec)
    assert len(evals) == 20
    assert not {e.prompt for e in evals} & {stream[i].prompt for i in range(2 * BLOCK)}
    assert eval_sampling(spec).temperature == 0.0
    assert train_sampling(spec).temperature == spec.sampling.temperature
    assert eval_sampling(spec).max_new_tokens == spec.sampling.max_new_tokens


def test_dataset_jobs_use_their_rows_and_grader(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_text(
        "".join(json.dumps({"prompt": f"p{i}", "reference": str(i)}) + "\n" for i in range(10))
    )
    spec = job(
        "d",
        task={"type": "dataset", "path": str(path), "grader": {"type": "exact"}},
        eval_episodes=64,
    )
    task = build_task(spec)
    assert isinstance(task, DatasetTask)
    evals = eval_examples(task, spec)
    assert len(evals) == len(task.eval) == 1  # each held-out row once, not 64 repeats
    stream = ExampleStream(task, spec)
    assert {stream[i].id for i in range(30)} == {e.id for e in task.train}  # epochs repeat


def test_a_dataset_job_may_take_its_eval_rows_from_a_second_file(tmp_path: Path) -> None:
    train, held = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    train.write_text(
        "".join(json.dumps({"prompt": f"t{i}", "reference": "r"}) + "\n" for i in range(6))
    )
    held.write_text(
        "".join(json.dumps({"prompt": f"e{i}", "reference": "r"}) + "\n" for i in range(3))
    )
    task_spec = {"type": "dataset", "path": str(train), "grader": {"type": "exact"}}
    spec = job("d", task={**task_spec, "eval_path": str(held), "eval_fraction": 0.0})
    task = build_task(spec)
    assert isinstance(task, DatasetTask)
    assert [e.prompt for e in task.train] == [f"t{i}" for i in range(6)]  # none held out
    assert sorted(e.prompt for e in eval_examples(task, spec)) == ["e0", "e1", "e2"]
    with pytest.raises(ValueError, match="eval_fraction must be 0"):
        job("d", task={**task_spec, "eval_path": str(held)})


def test_bad_data_fails_when_the_task_is_built(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "x"}\n')
    spec = job("d", task={"type": "dataset", "path": str(path), "grader": {"type": "exact"}})
    with pytest.raises(DataError, match="reference"):
        build_task(spec)


def test_episode_seeds_are_stable_and_distinct() -> None:
    spec = job("a", seed=3)
    seeds = {episode_seed(spec, i, g) for i in range(50) for g in range(8)}
    assert len(seeds) == 400
    assert episode_seed(spec, 4, 2) == episode_seed(job("b", seed=3), 4, 2)
    assert all(0 <= s < 2**62 for s in seeds)
