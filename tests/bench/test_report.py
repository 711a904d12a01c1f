"""The report builder on synthetic results: ratios, extrapolation flags, TRL coverage,
eval tolerance, targets, and the JSON / Markdown / PNG outputs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from marlaas.bench.paper import SCHEMA, write_outputs
from marlaas.bench.report import build_row, check_targets, markdown


def tenant(
    after: float | None, *, before: float = 0.25, status: str = "done", stale: float = 0.5
) -> dict[str, Any]:
    return {
        "status": status,
        "eval_before": before,
        "eval_after": after,
        "staleness_max": 1,
        "staleness_mean": stale,
        "groups_dropped_stale": 1,
        "failure_reason": "boom" if status == "failed" else None,
    }


def run(wall: float, tenants: dict[str, dict[str, Any]], busy: float = 0.9) -> dict[str, Any]:
    return {
        "wall_s": wall,
        "device_busy_fraction": busy,
        "tokens_generated": 1000 * len(tenants),
        "mean_decode_batch": 12.0,
        "decode_busy_s": wall / 2,
        "train_busy_s": wall / 4,
        "decode_steps": 10,
        "train_steps": 4,
        "max_tenants_per_train_step": 2,
        "staleness_max": max(t["staleness_max"] for t in tenants.values()),
        "staleness_violations": 0,
        "prefill_tokens": 300,
        "shared_prefill_tokens": 900,
        "tenants": tenants,
    }


def trl(name: str, wall: float) -> dict[str, Any]:
    return {
        "name": name,
        "steps": 2,
        "wall_s": wall,
        "train_s": wall / 2,
        "tokens_generated": 500,
        "reward_mean": 0.3,
        "adapter_delta_norm": 0.1,
        "adapter_changed": True,
        "eval_before": 0.25,
        "eval_after": 0.5,
    }


NAMES = ["calc-000", "arith-001", "rev-002", "calc-003"]


def test_row_measured_in_full() -> None:
    async_run = run(10.0, {n: tenant(0.5) for n in NAMES}, busy=0.97)
    sync_run = run(40.0, {n: tenant(0.5) for n in NAMES}, busy=0.5)
    row = build_row(
        "paper",
        4,
        2,
        async_run,
        sync_run,
        [trl("arith-001", 20.0), trl("rev-002", 30.0)],
        single_turn=["arith-001", "rev-002"],
    )
    assert row["sync"]["wall_s"] == 40.0 and row["sync"]["extrapolated_from"] is None
    assert row["ratios"]["async_vs_sync"] == pytest.approx(0.25)
    assert row["ratios"]["speedup_vs_sync"] == pytest.approx(4.0)
    assert row["trl"]["wall_s"] == 50.0 and row["trl"]["extrapolated_from"] is None
    assert row["trl"]["covers"] == "2 of 4 tenants (single-turn only)"
    # TRL did only part of the work (the single-turn tenants): no marlaas/TRL ratio.
    assert row["ratios"]["async_vs_trl"] is None and row["ratios"]["speedup_vs_trl"] is None
    assert row["marlaas_async"]["tokens_per_s"] == pytest.approx(400.0)
    assert row["marlaas_async"]["device"]["decode_s_per_iteration"] == pytest.approx(0.5)
    assert row["marlaas_async"]["staleness"] == {
        "max": 1,
        "mean": 0.5,
        "violations": 0,
        "groups_dropped_stale": 4,
    }
    assert row["eval"]["within_tolerance"] is True
    assert row["eval"]["tenants"]["arith-001"]["trl_after"] == 0.5
    assert row["eval"]["tenants"]["calc-000"]["trl_after"] is None


def test_row_extrapolated_from_a_prefix() -> None:
    names8 = [f"{t}-{i:03d}" for i, t in enumerate(["calc", "arith"] * 4)]
    async_run = run(16.0, {n: tenant(0.5) for n in names8})
    sync_run = run(20.0, {n: tenant(0.5) for n in names8[:2]})
    single = [n for n in names8 if n.startswith("arith")]
    row = build_row("paper", 8, 2, async_run, sync_run, [trl("arith-001", 5.0)], single_turn=single)
    assert row["sync"]["extrapolated_from"] == 2
    assert row["sync"]["wall_s_measured"] == 20.0 and row["sync"]["wall_s"] == 80.0
    assert row["trl"]["extrapolated_from"] == 1
    assert row["trl"]["wall_s"] == 20.0  # 4 single-turn tenants x 5 s
    assert row["ratios"]["async_vs_sync"] == pytest.approx(0.2)
    assert list(row["eval"]["tenants"]) == names8[:2]  # quality only where measured
    text = markdown(result_of([row]))
    assert "~80.0" in text and "sync from 2" in text and "TRL from 1" in text


def test_row_rejects_mismatched_inputs() -> None:
    async_run = run(1.0, {n: tenant(0.5) for n in NAMES})
    with pytest.raises(ValueError, match="prefix"):
        build_row(
            "paper", 4, 1, async_run, run(1.0, {"rev-002": tenant(0.5)}), None, single_turn=[]
        )
    with pytest.raises(ValueError, match="single-turn measured tenants"):
        build_row(
            "paper",
            4,
            1,
            async_run,
            run(1.0, {n: tenant(0.5) for n in NAMES}),
            [trl("calc-000", 1.0)],
            single_turn=["arith-001"],
        )


def test_no_trl_and_no_single_turn_tenant() -> None:
    async_run = run(3.0, {"calc-000": tenant(0.5)})
    sync_run = run(6.0, {"calc-000": tenant(0.5)})
    row = build_row("paper", 1, 1, async_run, sync_run, None, single_turn=[])
    assert row["trl"] is None and row["ratios"]["async_vs_trl"] is None
    row = build_row("paper", 1, 1, async_run, sync_run, [], single_turn=[])
    assert row["trl"]["wall_s"] is None and row["ratios"]["speedup_vs_trl"] is None
    assert "no TRL" in markdown(result_of([row]))


def test_eval_tolerance_uses_the_seed_spread() -> None:
    names = ["arith-000", "arith-001", "arith-002", "rev-003"]
    alone = {"arith-000": 0.2, "arith-001": 0.4, "arith-002": 0.3, "rev-003": 0.5}
    ours = {"arith-000": 0.28, "arith-001": 0.4, "arith-002": 0.3, "rev-003": 0.53}
    row = build_row(
        "paper",
        4,
        1,
        run(1.0, {n: tenant(ours[n]) for n in names}),
        run(2.0, {n: tenant(alone[n]) for n in names}),
        None,
        single_turn=[],
    )
    e = row["eval"]
    assert e["spread_by_template"]["arith"] == pytest.approx(0.1)  # stdev of .2 .4 .3
    assert e["spread_by_template"]["rev"] == 0.0
    assert e["tenants"]["arith-000"]["within"] is True  # 0.08 <= spread 0.1
    assert e["tenants"]["rev-003"]["within"] is False  # 0.03 > 0.02, no spread
    assert e["within_tolerance"] is False
    assert e["max_abs_delta"] == pytest.approx(0.08)


def test_eval_tolerance_is_at_least_one_held_out_episode() -> None:
    """32 held-out episodes resolve accuracy in steps of 1/32: one episode answered
    differently is within tolerance, two are not (no seed spread here)."""
    names = ["calc-000", "rev-001"]
    alone = {"calc-000": 0.25, "rev-001": 0.25}
    ours = {"calc-000": 0.25 + 1 / 32, "rev-001": 0.25 - 2 / 32}

    def tenants(acc: dict[str, float]) -> dict[str, dict[str, Any]]:
        return {n: {**tenant(acc[n]), "eval_episodes": 32} for n in names}

    row = build_row(
        "paper", 2, 1, run(1.0, tenants(ours)), run(2.0, tenants(alone)), None, single_turn=[]
    )
    e = row["eval"]
    assert e["tenants"]["calc-000"]["tolerance"] == pytest.approx(1 / 32)
    assert e["tenants"]["calc-000"]["within"] is True
    assert e["tenants"]["rev-001"]["within"] is False
    assert e["within_tolerance"] is False


def test_failed_tenants_are_reported() -> None:
    async_run = run(1.0, {"calc-000": tenant(None, status="failed")})
    row = build_row(
        "paper", 1, 1, async_run, run(1.0, {"calc-000": tenant(0.5)}), None, single_turn=[]
    )
    assert row["marlaas_async"]["failed"] == {"calc-000": "boom"}
    assert row["eval"]["tenants"]["calc-000"]["delta"] is None
    assert row["eval"]["within_tolerance"] is False
    assert "FAILED: calc-000" in markdown(result_of([row]))


def big_row(regime: str, ratio: float, busy: float, trl_wall: float) -> dict[str, Any]:
    names = [f"arith-{i:03d}" for i in range(32)]
    return build_row(
        regime,
        32,
        1,
        run(ratio * 100.0, {n: tenant(0.5) for n in names}, busy=busy),
        run(25.0, {n: tenant(0.5) for n in names[:8]}),
        [trl(n, trl_wall / 8) for n in names[:8]],
        single_turn=names,
    )


def test_targets_at_32_tenants() -> None:
    assert all(t["met"] is None for t in check_targets([]))
    rows = [big_row("paper", 0.08, 0.96, 100.0), big_row("compute", 0.8, 0.9, 20.0)]
    targets = {(t["regime"], t["metric"]): t for t in check_targets(rows)}
    assert targets[("paper", "async_vs_sync")]["met"] is True
    assert targets[("paper", "async_vs_sync")]["value"] == pytest.approx(0.08)
    assert targets[("paper", "device_busy_fraction")]["met"] is True
    assert targets[("paper", "eval_within_tolerance")]["met"] is True
    assert targets[("paper", "eval_within_tolerance")]["note"] == (
        "over the 8 tenants the baseline ran"
    )
    assert targets[("paper", "async_vs_sync")]["note"] == "extrapolated from 8 tenants"
    assert targets[("compute", "async_vs_sync")]["met"] is False
    assert ("paper", "speedup_vs_trl") not in targets  # TRL cannot run the tool tasks
    assert targets[("compute", "speedup_vs_trl")]["value"] == pytest.approx(1.0)
    assert targets[("compute", "speedup_vs_trl")]["met"] is False  # 80 / 80 = 1x


def result_of(rows: list[dict[str, Any]]) -> dict[str, Any]:
    workload = {
        "workload": "paper",
        "version": 1,
        "regime": "paper",
        "file": "paper-v1.yaml",
        "sha256": "0" * 64,
        "samples_per_step": 16,
        "templates": ["calc", "arith"],
    }
    return {
        "schema": SCHEMA,
        "config": {
            "quick": True,
            "device": "cpu",
            "torch_threads": 1,
            "base_model": "/x/embedded",
        },
        "regimes": [{"workload": workload, "steps": 1, "rows": rows}],
        "targets": check_targets(rows),
    }


def test_outputs_are_json_markdown_and_png(tmp_path: Path) -> None:
    rows = [
        build_row(
            "paper",
            n,
            2,
            run(2.0 * n, {f"arith-{i:03d}": tenant(0.5) for i in range(n)}),
            run(5.0 * n, {f"arith-{i:03d}": tenant(0.5) for i in range(n)}),
            [trl(f"arith-{i:03d}", 4.0) for i in range(n)],
            single_turn=[f"arith-{i:03d}" for i in range(n)],
        )
        for n in (1, 4)
    ]
    result = result_of(rows)
    paths = write_outputs(result, tmp_path / "paper.json")
    assert [p.suffix for p in paths] == [".json", ".md", ".png"]
    assert json.loads(paths[0].read_text()) == json.loads(json.dumps(result))
    assert paths[2].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = paths[1].read_text()
    assert "| 4 | 2 | 8.0 | 20.0 | 16.0 | 0.40x | 0.50x |" in md
    assert "paper-v1.yaml" in md and "not run" in md
    assert "| paper | 4 | marlaas | 4.0 | 2.0 | 10 | 12.0 | 400.0 | 4 | 300 | 900 |" in md
