"""Workload files: the shipped ones load, bad ones fail naming the field, and tenants
are instantiated by cycling the templates with distinct seeds."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import yaml

from marlaas.bench.workloads import (
    WorkloadError,
    builtin_workloads,
    is_single_turn,
    load_workload,
    resolve_workload,
    template_of,
)
from marlaas.errors import ConfigError

GOOD = {
    "workload": "mini",
    "version": 1,
    "regime": "paper",
    "samples_per_step": 4,
    "steps": 3,
    "quick_steps": 1,
    "seed": 100,
    "run": {"engine": {"max_batch_size": 32, "adapter_slots": 8, "max_rank": 4}},
    "defaults": {
        "lora": {"rank": 4, "alpha": 8},
        "algorithm": {"group_size": 2, "prompts_per_step": 2},
        "eval_episodes": 4,
    },
    "tenants": [
        {"name": "calc", "task": {"family": "calculator", "tool_latency_s": [0.5, 1.0]}},
        {"name": "arith", "task": {"family": "arithmetic"}, "sampling": {"max_new_tokens": 8}},
        {"name": "rev", "task": {"family": "reverse"}},
    ],
}


def write(tmp_path: Path, data: object, name: str = "mini-v1.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    return path


def with_changes(**changes: object) -> dict[str, object]:
    data: dict[str, object] = {**GOOD, **changes}
    return data


@pytest.mark.parametrize("name", ["paper", "compute", "paper-v1", "compute-v1"])
def test_shipped_workloads_load_and_are_named_by_hash(name: str) -> None:
    w = resolve_workload(name)
    assert w.path.parent.name == "workloads"
    assert w.sha256 == hashlib.sha256(w.path.read_bytes()).hexdigest()
    described = w.describe()
    assert described["file"] == f"{w.name}-v{w.spec.version}.yaml"
    assert described["regime"] == w.regime == w.name
    for job in w.instantiate(len(w.spec.tenants)).jobs:
        assert job.algorithm.samples_per_step == w.spec.samples_per_step


def test_shipped_regimes_match_the_issue() -> None:
    paper, compute = resolve_workload("paper"), resolve_workload("compute")
    assert paper.spec.samples_per_step == 16 and compute.spec.samples_per_step == 64
    paper_jobs = paper.instantiate(len(paper.spec.tenants)).jobs
    assert any(is_single_turn(j) for j in paper_jobs)
    tools = [j for j in paper_jobs if not is_single_turn(j)]
    assert tools and all(j.task.tool_latency_s == (0.5, 1.0) for j in tools)  # type: ignore[union-attr]
    lengths = {j.sampling.max_new_tokens for j in paper_jobs}
    assert max(lengths) >= 4 * min(lengths)  # a long tail of completion limits
    assert all(is_single_turn(j) for j in compute.instantiate(3).jobs)


def test_builtin_workloads_map_names_to_newest_version() -> None:
    shipped = builtin_workloads()
    assert shipped["paper"] == shipped["paper-v1"]
    assert shipped["compute"].name == "compute-v1.yaml"


def test_instantiate_cycles_templates_with_distinct_seeds(tmp_path: Path) -> None:
    w = load_workload(write(tmp_path, GOOD))
    run = w.instantiate(7)
    names = [j.name for j in run.jobs]
    assert names == [
        "calc-000",
        "arith-001",
        "rev-002",
        "calc-003",
        "arith-004",
        "rev-005",
        "calc-006",
    ]
    assert [template_of(n) for n in names] == ["calc", "arith", "rev"] * 2 + ["calc"]
    assert [j.seed for j in run.jobs] == list(range(100, 107))
    assert all(j.steps == 3 for j in run.jobs)
    assert run.engine.max_batch_size == 32
    # Template overrides merge over the defaults, field by field.
    arith = run.jobs[1]
    assert arith.sampling.max_new_tokens == 8 and arith.lora.rank == 4
    assert run.jobs[0].sampling.max_new_tokens == 48  # JobSpec's default


def test_a_prefix_of_tenants_is_the_same_jobs(tmp_path: Path) -> None:
    w = load_workload(write(tmp_path, GOOD))
    assert w.instantiate(2, steps=5).jobs == w.instantiate(6, steps=5).jobs[:2]
    assert all(j.steps == 5 for j in w.instantiate(2, steps=5).jobs)


def test_zero_tenants_is_an_error(tmp_path: Path) -> None:
    w = load_workload(write(tmp_path, GOOD))
    with pytest.raises(WorkloadError, match="number of tenants"):
        w.instantiate(0)


BAD_CASES = [
    (
        with_changes(
            tenants=[
                {"name": "a", "task": {"family": "arithmetic"}, "algorithm": {"group_size": 1}}
            ]
        ),
        r"tenants\[0\] \(a\)\.algorithm\.group_size",
    ),
    (
        with_changes(
            tenants=[
                {"name": "a", "task": {"family": "arithmetic"}, "algorithm": {"group_size": 4}}
            ]
        ),
        r"tenants\[0\] \(a\)\.algorithm: group_size x prompts_per_step = 8.*samples_per_step is 4",
    ),
    (
        with_changes(tenants=[{"name": "a", "task": {"family": "nope"}}]),
        r"tenants\[0\] \(a\)\.task\.family: must be a built-in family",
    ),
    (with_changes(regime="compute"), r"tenants\[0\] \(calc\)\.task\.family: .*single-turn"),
    (
        with_changes(
            regime="compute",
            tenants=[{"name": "a", "task": {"family": "arithmetic", "tool_latency_s": [0, 1]}}],
        ),
        r"task\.tool_latency_s: the compute regime has no tool latency",
    ),
    (with_changes(samples_per_step="many"), r"samples_per_step"),
    (with_changes(regime="fast"), r"regime"),
    (with_changes(tenants=[]), r"tenants"),
    (with_changes(version=2), r"file name says mini v1 .* version 2"),
    (with_changes(surprise=1), r"surprise"),
    (
        with_changes(tenants=[{"name": "a", "task": {"family": "arithmetic"}, "lora": {"rnk": 2}}]),
        r"tenants\[0\] \(a\)\.lora\.rnk",
    ),
    (
        with_changes(tenants=[GOOD["tenants"][1], GOOD["tenants"][1]]),  # type: ignore[index]
        r"repeated: arith",
    ),
    (with_changes(run={"engine": {"max_rank": 2}}), r"run: .*max_rank"),
]


@pytest.mark.parametrize(("data", "message"), BAD_CASES)
def test_bad_workload_fails_naming_the_field(
    tmp_path: Path, data: dict[str, object], message: str
) -> None:
    path = write(tmp_path, data)
    with pytest.raises(WorkloadError, match=message) as info:
        load_workload(path).instantiate(3)
    assert isinstance(info.value, ConfigError)
    assert "mini-v1.yaml" in str(info.value)


def test_unreadable_or_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(WorkloadError, match="cannot read"):
        load_workload(tmp_path / "missing-v1.yaml")
    bad = tmp_path / "bad-v1.yaml"
    bad.write_text("workload: [unclosed", encoding="utf-8")
    with pytest.raises(WorkloadError, match="not valid YAML"):
        load_workload(bad)
    bad.write_text("- just\n- a list\n", encoding="utf-8")
    with pytest.raises(WorkloadError, match="mapping at the top level"):
        load_workload(bad)
    with pytest.raises(WorkloadError, match=r"unknown workload 'nosuch'.*paper"):
        resolve_workload("nosuch")
