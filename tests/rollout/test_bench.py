"""The rollout benchmark runs end to end on a tiny model and reports comparable figures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from marlaas.rollout.bench import run_rollout_bench


def test_bench_reports_all_systems_with_agreeing_outputs(tiny_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    result = run_rollout_bench(
        tiny_dir,
        tenant_counts=(1, 3),
        requests_per_tenant=2,
        max_new_tokens=4,
        json_path=out,
        num_threads=None,
        repeats=1,
        print_table=False,
    )
    assert json.loads(out.read_text()) == result
    assert [r["tenants"] for r in result["rows"]] == [1, 3]
    for row in result["rows"]:
        assert row["new_tokens"] == row["requests"] * 4
        for key in ("engine_mixed_tok_s", "engine_single_tok_s", "hf_peft_mixed_tok_s"):
            assert row[key] > 0
        assert row["outputs_agree"] == 1.0  # same greedy tokens as HF + PEFT, every request
        # The roofline's efficiency: an iteration per new token after the first, FLOPs and
        # bytes from the shapes, scored against the machine measured in the same run.
        assert row["iterations"] >= 3 and row["flops"] > 0 and row["bytes"] > 0
        machine = result["machine"]
        roofline = max(row["flops"] / machine["peak_flops"], row["bytes"] / machine["bandwidth"])
        seconds = row["new_tokens"] / row["engine_mixed_tok_s"]
        assert row["efficiency"] == pytest.approx(roofline / seconds)
