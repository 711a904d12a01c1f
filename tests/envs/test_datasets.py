"""User datasets: strict JSONL / Hugging Face loading, the split, DatasetTask episodes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from marlaas.envs.base import Example, Segment
from marlaas.envs.datasets import (
    DatasetTask,
    from_hf_dataset,
    load_jsonl,
    split_examples,
)
from marlaas.envs.graders import build_grader
from marlaas.errors import DataError, GraderError


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def row(prompt: str = "2+2=", reference: str = "4", **extra: Any) -> str:
    return json.dumps({"prompt": prompt, "reference": reference, **extra})


def make_examples(n: int) -> list[Example]:
    return [Example(id=f"ex-{i}", prompt=f"{i}+1=", reference=str(i + 1)) for i in range(n)]


# --- JSONL -----------------------------------------------------------------------------


def test_load_jsonl_good_file(tmp_path: Path) -> None:
    path = write_lines(
        tmp_path / "data.jsonl",
        [row("2+2=", "4", level="easy"), "", row("3+3=", "6", id="q-b"), row("1+0=", "1", id=7)],
    )
    examples = load_jsonl(path)
    assert [ex.id for ex in examples] == ["row-1", "q-b", "7"]
    assert examples[0] == Example(id="row-1", prompt="2+2=", reference="4", meta={"level": "easy"})
    assert examples[1].meta == {}
    assert load_jsonl(str(path), max_rows=2) == examples[:2]


def test_load_jsonl_custom_fields(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "d.jsonl", [json.dumps({"question": "Q?", "answer": "A"})])
    (example,) = load_jsonl(path, prompt_field="question", reference_field="answer")
    assert (example.prompt, example.reference, dict(example.meta)) == ("Q?", "A", {})


@pytest.mark.parametrize(
    ("bad_line", "problem"),
    [
        ('{"prompt": "x", "reference": ', "invalid JSON"),
        ("[1, 2]", "must be a JSON object, got list"),
        ('"just a string"', "must be a JSON object, got str"),
        (json.dumps({"reference": "4"}), "missing field 'prompt'"),
        (json.dumps({"prompt": "2+2="}), "missing field 'reference'"),
        (row(reference="   "), "field 'reference' is empty"),
        (row(prompt=""), "field 'prompt' is empty"),
        (json.dumps({"prompt": "2+2=", "reference": 4}), "'reference' must be a string, got int"),
        (json.dumps({"prompt": ["a"], "reference": "4"}), "'prompt' must be a string, got list"),
        (row(id="first"), "duplicate id 'first'"),
        (row(id=True), "'id' must be a string or an integer"),
    ],
)
def test_load_jsonl_bad_row_names_file_and_line(
    tmp_path: Path, bad_line: str, problem: str
) -> None:
    path = write_lines(tmp_path / "bad.jsonl", [row(id="first"), row(), "", bad_line, row()])
    with pytest.raises(DataError) as info:
        load_jsonl(path)
    message = str(info.value)
    assert f"{path}:4" in message
    assert problem in message


def test_load_jsonl_generated_id_collision_is_a_duplicate(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "d.jsonl", [row(), row(id="row-1")])
    with pytest.raises(DataError, match=r":2: duplicate id 'row-1' \(first seen at .*:1\)"):
        load_jsonl(path)


def test_load_jsonl_file_problems(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="cannot read"):
        load_jsonl(tmp_path / "missing.jsonl")
    empty = write_lines(tmp_path / "empty.jsonl", ["", "  "])
    with pytest.raises(DataError, match="no rows"):
        load_jsonl(empty)
    binary = tmp_path / "bin.jsonl"
    binary.write_bytes(row().encode() + b"\n\xff\xfe\n")
    with pytest.raises(DataError, match=r"bin.jsonl:2: not valid UTF-8"):
        load_jsonl(binary)
    with pytest.raises(DataError, match="max_rows"):
        load_jsonl(binary, max_rows=0)


def test_max_rows_stops_before_later_bad_rows(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "d.jsonl", [row(), "not json"])
    assert len(load_jsonl(path, max_rows=1)) == 1


# --- Hugging Face ----------------------------------------------------------------------


def test_from_hf_dataset() -> None:
    from datasets import Dataset

    ds = Dataset.from_dict(
        {"question": ["1+1=", "2+2="], "answer": ["2", "4"], "source": ["a", "b"]}
    )
    examples = from_hf_dataset(ds, "question", "answer")
    assert examples == [
        Example(id="row-0", prompt="1+1=", reference="2", meta={"source": "a"}),
        Example(id="row-1", prompt="2+2=", reference="4", meta={"source": "b"}),
    ]


def test_from_hf_dataset_bad_rows() -> None:
    from datasets import Dataset, DatasetDict

    ds = Dataset.from_dict({"prompt": ["a", "b", ""], "reference": ["1", "2", "3"]})
    with pytest.raises(DataError, match="dataset row 2: field 'prompt' is empty"):
        from_hf_dataset(ds)
    ints = Dataset.from_dict({"prompt": ["a"], "reference": [1]})
    with pytest.raises(DataError, match="dataset row 0: field 'reference' must be a string"):
        from_hf_dataset(ints)
    with pytest.raises(DataError, match=r"no column 'answer' \(columns: prompt, reference\)"):
        from_hf_dataset(ds, reference_field="answer")
    with pytest.raises(DataError, match="pass one split"):
        from_hf_dataset(DatasetDict({"train": ds}))  # type: ignore[arg-type]
    dup = Dataset.from_dict({"prompt": ["a", "b"], "reference": ["1", "2"], "id": ["x", "x"]})
    with pytest.raises(DataError, match="dataset row 1: duplicate id 'x'"):
        from_hf_dataset(dup)


# --- split -----------------------------------------------------------------------------


def test_split_is_deterministic_and_disjoint() -> None:
    examples = make_examples(50)
    train, evals = split_examples(examples, 0.2, seed=3)
    assert split_examples(examples, 0.2, seed=3) == (train, evals)
    assert len(evals) == 10 and len(train) == 40
    assert {ex.id for ex in train}.isdisjoint({ex.id for ex in evals})
    assert {ex.id for ex in train} | {ex.id for ex in evals} == {ex.id for ex in examples}
    # Each part keeps the input order.
    assert train == [ex for ex in examples if ex in train]
    other_train, _ = split_examples(examples, 0.2, seed=4)
    assert other_train != train


def test_split_edge_cases() -> None:
    assert split_examples(make_examples(5), 0.0, seed=0) == (make_examples(5), [])
    train, evals = split_examples(make_examples(3), 0.01, seed=0)
    assert (len(train), len(evals)) == (2, 1)
    with pytest.raises(DataError, match="eval_fraction"):
        split_examples(make_examples(3), 1.0, seed=0)
    with pytest.raises(DataError, match="duplicate ids"):
        split_examples(make_examples(2) * 2, 0.5, seed=0)


# --- DatasetTask -----------------------------------------------------------------------


def make_task(n: int = 20) -> DatasetTask:
    return DatasetTask(make_examples(n), build_grader({"type": "numeric"}), eval_fraction=0.25)


def test_task_examples_are_seeded_and_split() -> None:
    task = make_task()
    train = task.examples("train", 10, seed=1)
    assert task.examples("train", 10, seed=1) == train
    assert task.examples("train", 10, seed=2) != train
    assert task.examples("train", 4, seed=1) == train[:4]  # a smaller n gives a prefix
    assert len({ex.id for ex in train}) == 10
    evals = task.examples("eval", 5, seed=1)
    assert {ex.id for ex in train}.isdisjoint({ex.id for ex in evals})
    # More than the split holds: whole epochs, each a permutation of the split.
    many = task.examples("eval", 12, seed=0)
    assert len(many) == 12
    assert {ex.id for ex in many[:5]} == {ex.id for ex in task.eval}
    assert task.examples("train", 0) == []


def test_task_explicit_eval_must_be_disjoint() -> None:
    grader = build_grader({"type": "exact"})
    task = DatasetTask(make_examples(3), grader, eval_examples=make_examples(5)[3:])
    assert [ex.id for ex in task.eval] == ["ex-3", "ex-4"]
    with pytest.raises(DataError, match="share ids"):
        DatasetTask(make_examples(3), grader, eval_examples=make_examples(1))
    with pytest.raises(DataError, match="train split is empty"):
        DatasetTask([], grader)


async def test_dataset_task_episode_end_to_end(tmp_path: Path) -> None:
    path = write_lines(
        tmp_path / "d.jsonl", [row(f"What is {i} + {i}?", str(2 * i)) for i in range(10)]
    )
    grader = build_grader(
        {
            "type": "weighted",
            "graders": [
                {"weight": 3, "grader": {"type": "numeric"}},
                {"weight": 1, "grader": {"type": "regex", "pattern": r"\d+"}},
            ],
        }
    )
    task = DatasetTask(load_jsonl(path), grader, name="doubling", eval_fraction=0.2)
    (example,) = task.examples("eval", 1, seed=0)
    env = task.make_env(example)
    assert env.max_turns == 1
    assert await env.initial_observation() == example.prompt
    result = await env.step(f" {example.reference}")
    assert result.done and result.observation is None
    assert result.reward == 1.0 and result.metrics["score"] == 1.0
    wrong = await task.make_env(example).step(f"I think {int(example.reference) + 1}")
    assert wrong.done and wrong.reward == 0.0
    demo = task.demonstration(example)
    assert demo == [Segment(example.prompt, False), Segment(example.reference + "\n", True)]


async def test_dataset_env_propagates_grader_errors() -> None:
    bad = Example(id="x", prompt="p", reference="not a number")
    task = DatasetTask([bad, *make_examples(3)], build_grader({"type": "numeric"}))
    with pytest.raises(GraderError, match="not a number"):
        await task.make_env(bad).step("1")


async def test_row_fields_reach_the_grader() -> None:
    seen: list[dict[str, object]] = []

    async def grader(completion: str, reference: str, row: Any) -> float:
        seen.append(dict(row))
        return 0.5

    example = Example(id="a", prompt="p", reference="r", meta={"level": "easy"})
    result = await DatasetTask([example], grader).make_env(example).step("c")
    assert result.reward == 0.5 and seen == [{"level": "easy"}]
