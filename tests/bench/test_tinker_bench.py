"""`marlaas bench tinker`, end to end at its smallest: one and two SDK clients, one RL
step each, together and one after another on one real server; the JSON has every run
with its counts (what was computed, never how fast)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def test_bench_tinker_runs_both_modes_and_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "tinker.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "marlaas.cli",
            "bench",
            "tinker",
            "--clients",
            "1,2",
            "--steps",
            "1",
            "--prompts-per-step",
            "2",
            "--group-size",
            "4",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "one after another" in done.stdout
    result = json.loads(out.read_text())
    runs = {(r["clients"], r["mode"]): r for r in result["runs"]}
    assert set(runs) == {(n, m) for n in (1, 2) for m in ("together", "one_after_another")}
    for (n, _), r in runs.items():
        assert r["tokens"] > 0 and r["server_cpu_s"] > 0
        assert r["forward_backward_calls"] <= n  # a group with one reward trains nothing
    assert set(result["ratios"]) == {"1", "2"}
    assert result["engine_rows"] == 2 * 4 * 2  # one step of both clients of N = 2
    for r in runs.values():
        assert r["device_decode_s"] > 0 and r["device_train_s"] >= 0
    with pytest.raises(subprocess.CalledProcessError):
        subprocess.run(
            [sys.executable, "-m", "marlaas.cli", "bench", "tinker", "--loss-fn", "gspo"],
            check=True,
            capture_output=True,
            timeout=120,
        )
