"""`marlaas bench paper` end to end on a minimal setting: one tenant, one step, one
regime; the JSON names its workload and carries every system's figures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from marlaas.cli.main import app


@pytest.mark.slow
def test_bench_paper_minimal(base_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "paper.json"
    result = CliRunner().invoke(
        app,
        [
            "bench",
            "paper",
            "--json",
            str(out),
            "--tenants",
            "1",
            "--steps",
            "1",
            "--regime",
            "compute",
            "--out",
            str(tmp_path / "runs"),
        ],
    )
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["schema"] == "marlaas.bench.paper/1"
    assert data["config"]["tenant_counts"] == [1] and data["config"]["trl"]
    assert data["config"]["backend"] == "inprocess" and data["config"]["ray"] is None
    (regime,) = data["regimes"]
    assert regime["workload"]["file"] == "compute-v1.yaml"
    assert len(regime["workload"]["sha256"]) == 64
    (row,) = regime["rows"]
    assert row["n_tenants"] == 1 and row["steps"] == 1
    for system in ("marlaas_async", "sync", "trl"):
        assert row[system]["wall_s"] > 0
    assert row["sync"]["extrapolated_from"] is None
    assert row["trl"]["covers"] == "all 1 tenants" and row["trl"]["adapters_changed"]
    assert row["ratios"]["async_vs_sync"] > 0 and row["ratios"]["async_vs_trl"] > 0
    assert 0 < row["marlaas_async"]["device_busy_fraction"] <= 1
    assert row["marlaas_async"]["staleness"]["violations"] == 0
    (name,) = row["eval"]["tenants"]
    assert row["eval"]["tenants"][name]["alone_after"] is not None
    assert {t["met"] for t in data["targets"]} == {None}  # N = 32 was not run
    assert out.with_suffix(".md").read_text().startswith("# marlaas bench paper")
    assert out.with_suffix(".png").stat().st_size > 0
    assert (tmp_path / "runs" / "compute" / "n001" / "async" / "result.json").is_file()
    assert "| 1 | 1 |" in result.output


def test_bench_paper_rejects_a_bad_regime(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        app, ["bench", "paper", "--json", str(tmp_path / "x.json"), "--regime", "gpu"]
    )
    assert result.exit_code != 0
    assert "paper, compute or both" in result.output


def test_bench_paper_rejects_a_bad_backend_and_a_bad_ray_spec(tmp_path: Path) -> None:
    out = str(tmp_path / "x.json")
    result = CliRunner().invoke(app, ["bench", "paper", "--json", out, "--backend", "gpu"])
    assert result.exit_code != 0
    assert "backend must be 'inprocess' or 'ray'" in str(result.exception or result.output)
    bad = tmp_path / "ray.yaml"
    bad.write_text("engine_replicas: 0\n")
    result = CliRunner().invoke(
        app, ["bench", "paper", "--json", out, "--backend", "ray", "--ray-spec", str(bad)]
    )
    assert result.exit_code != 0
    assert "engine_replicas" in str(result.exception or result.output)
