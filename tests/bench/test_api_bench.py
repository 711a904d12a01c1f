"""`marlaas bench api` end to end on a tiny setting, and its percentile helper."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from marlaas.bench.api import job_body, percentiles, run_api_bench


def test_percentiles_in_milliseconds() -> None:
    p = percentiles([0.001 * i for i in range(1, 101)])
    assert p["n"] == 100
    assert p["p50_ms"] == pytest.approx(51.0)
    assert p["p95_ms"] == pytest.approx(96.0)
    assert p["max_ms"] == pytest.approx(100.0)
    assert percentiles([])["n"] == 0


def test_jobs_cycle_the_families_with_distinct_names_and_seeds() -> None:
    bodies = [job_body(i, steps=2) for i in range(6)]
    assert [b["task"]["family"] for b in bodies][:5] == [
        "reverse",
        "arithmetic",
        "countdown",
        "calculator",
        "search",
    ]
    assert len({b["name"] for b in bodies}) == 6 and len({b["seed"] for b in bodies}) == 6


@pytest.mark.slow
def test_bench_api_runs_a_real_server_to_the_end(tmp_path: Path) -> None:
    out = tmp_path / "api.json"
    result = run_api_bench(jobs=2, clients=2, steps=2, json_path=out, rate=20.0, idle_s=1.0)
    assert result["statuses"] == {"done": 2}
    assert result["error_count"] == 0
    saved = json.loads(out.read_text())
    assert saved["create"]["n"] == 2 and saved["config"]["rate_per_client"] == 20.0
    assert set(saved["phases"]) == {"training", "idle"}
    for phase in saved["phases"].values():
        # The pollers' four endpoints, and the completions of the one inference client.
        assert set(phase["latency"]) == {"list", "get", "metrics", "checkpoints", "complete"}
        assert phase["latency"]["get"]["n"] > 0 and phase["requests_per_s"] > 0
        assert phase["latency"]["complete"]["n"] > 0
    # On its schedule, a client sends at most `rate` requests per second.
    idle = saved["phases"]["idle"]
    assert idle["requests_per_s"] <= 2 * 20.0 * 1.05
