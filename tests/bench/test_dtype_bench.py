"""`marlaas bench dtype`: the verdict on synthetic results (no loss, a loss, a run that
learned nothing, failed tenants), the learning workload, and the command end to end on
one tenant and one step."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from marlaas.bench.dtype import compare, markdown
from marlaas.bench.workloads import resolve_workload
from marlaas.cli.main import app
from marlaas.errors import ConfigError


def _tenants(after: dict[str, float], before: float = 0.3) -> dict[str, dict[str, Any]]:
    return {
        name: {"status": "done", "eval_before": before, "eval_after": a, "eval_episodes": 128}
        for name, a in after.items()
    }


FP32 = {"arith-000": 0.50, "arith-003": 0.54, "reverse-001": 0.60, "reverse-004": 0.62}


def test_within_the_tolerance_is_no_loss() -> None:
    bf16 = {"arith-000": 0.49, "arith-003": 0.52, "reverse-001": 0.63, "reverse-004": 0.60}
    c = compare({"float32": _tenants(FP32), "bfloat16": _tenants(bf16)})
    assert c["conclusive"] and c["no_loss"]
    arith = c["templates"]["arith"]
    assert arith["tenants"] == 2 and arith["learned"]
    assert arith["delta"] == pytest.approx(-0.015)
    assert arith["paired_deltas"] == pytest.approx([-0.01, -0.02])
    # The tolerance is the largest of 0.02, the float32 spread and one episode.
    assert arith["tolerance"] == pytest.approx(max(0.02, 0.02828427, 1 / 128), rel=1e-6)
    assert "loses no accuracy" in markdown(_result(c))


def test_a_template_below_the_tolerance_is_a_loss() -> None:
    bf16 = {**FP32, "reverse-001": 0.50, "reverse-004": 0.52}  # 0.10 below
    c = compare({"float32": _tenants(FP32), "bfloat16": _tenants(bf16)})
    assert c["conclusive"] and not c["no_loss"]
    assert c["templates"]["arith"]["no_loss"] and not c["templates"]["reverse"]["no_loss"]
    assert "loses accuracy" in markdown(_result(c))


def test_a_run_that_did_not_learn_or_failed_proves_nothing() -> None:
    flat = compare({"float32": _tenants(FP32, before=0.6), "bfloat16": _tenants(FP32)})
    assert not flat["conclusive"] and not flat["no_loss"]
    failed = _tenants(FP32)
    failed["arith-000"]["status"] = "failed"
    c = compare({"float32": _tenants(FP32), "bfloat16": failed})
    assert c["failed_tenants"] == ["arith-000"] and not c["no_loss"]
    assert "inconclusive" in markdown(_result(c))
    with pytest.raises(ConfigError, match="different tenants: arith-003"):
        compare({"float32": _tenants(FP32), "bfloat16": _tenants({"arith-000": 0.5})})


def _result(comparison: dict[str, Any]) -> dict[str, Any]:
    return {
        "comparison": comparison,
        "config": {"workload": {"file": "learning-v1.yaml"}, "tenants": 4},
        "runs": {"float32": {"wall_s": 10.0}, "bfloat16": {"wall_s": 8.0}},
    }


def test_the_learning_workload_evaluates_enough_episodes() -> None:
    w = resolve_workload("learning")
    assert w.regime == "compute" and w.path.name == "learning-v1.yaml"
    jobs = w.instantiate(6).jobs
    assert {j.eval_episodes for j in jobs} == {128}
    assert len({j.seed for j in jobs}) == 6 and jobs[0].steps == w.spec.steps


@pytest.mark.slow
def test_bench_dtype_end_to_end(base_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "dtype.json"
    result = CliRunner().invoke(
        app,
        ["bench", "dtype", "--json", str(out), "--tenants", "1", "--steps", "1"],
    )
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["schema"] == "marlaas.bench.dtype/1"
    assert set(data["runs"]) == {"float32", "bfloat16"}
    for run in data["runs"].values():
        assert run["wall_s"] > 0 and run["tenants"]["reverse-000"]["status"] == "done"
    assert set(data["comparison"]["templates"]) == {"reverse"}
    assert out.with_suffix(".md").read_text().startswith("# marlaas bench dtype")
