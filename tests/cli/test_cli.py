"""One subprocess smoke test per CLI entry point: the installed `marlaas` command."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

MARLAAS = [sys.executable, "-m", "marlaas.cli"]


def run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "COLUMNS": "120"}
    proc = subprocess.run(
        [*MARLAAS, *args], capture_output=True, text=True, timeout=timeout, env=env
    )
    assert proc.returncode == 0, f"marlaas {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc


def refused(*args: str) -> str:
    """The standard error of `marlaas *args`, which must refuse its input as a usage error
    (exit status 2) with a message, not a traceback."""
    proc = subprocess.run([*MARLAAS, *args], capture_output=True, text=True)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    return proc.stderr


def test_help_lists_commands() -> None:
    out = run("--help").stdout
    for command in ("base", "bench", "demo", "version"):
        assert command in out


def test_bad_option_fails_with_a_message() -> None:
    proc = subprocess.run(
        [*MARLAAS, "bench", "rollout", "--tenants", "x"], capture_output=True, text=True
    )
    assert proc.returncode != 0
    assert "comma-separated integers" in proc.stdout + proc.stderr


def test_base_build_writes_a_loadable_model(tmp_path: Path) -> None:
    out = tmp_path / "base"
    run("base", "build", "--out", str(out), "--max-steps", "5")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    assert model.config.model_type == "llama"
    assert tok.decode(tok("Q: 1+2\nA: ")["input_ids"]) == "Q: 1+2\nA: "
    facts = json.loads((out / "build.json").read_text())
    assert facts["recipe"]["max_steps"] == 5 and facts["steps"] == 5


def test_base_eval_writes_per_family_json(tmp_path: Path) -> None:
    path = tmp_path / "eval.json"
    run("base", "eval", "--episodes", "4", "--json", str(path))
    data = json.loads(path.read_text())
    families = {f["family"] for f in data["families"]}
    assert families == {"arithmetic", "reverse", "countdown", "calculator", "search"}
    for f in data["families"]:
        assert f["episodes"] == 4
        assert 0.0 <= f["greedy"] <= 1.0 and 0.0 <= f["sampled"] <= 1.0


def test_bench_rollout_smoke(tmp_path: Path) -> None:
    path = tmp_path / "rollout.json"
    run(
        "bench",
        "rollout",
        "--tenants",
        "1,2",
        "--requests-per-tenant",
        "1",
        "--max-new-tokens",
        "3",
        "--repeats",
        "1",
        "--json",
        str(path),
    )
    data = json.loads(path.read_text())
    assert [row["tenants"] for row in data["rows"]] == [1, 2]
    assert all(row["outputs_agree"] == 1.0 for row in data["rows"])


@pytest.mark.slow
def test_demo_smoke(tmp_path: Path) -> None:
    # the demo itself is tested in test_demo.py; here: the installed command runs it
    jobs = tmp_path / "jobs.yaml"
    jobs.write_text(
        "jobs: [{name: one, task: {family: reverse}, steps: 1, eval_episodes: 2,"
        " algorithm: {group_size: 2, prompts_per_step: 1}, sampling: {max_new_tokens: 4}}]"
    )
    out = tmp_path / "run"
    text = run("demo", "--jobs", str(jobs), "--out", str(out), "--no-live", "--slice-steps", "1")
    assert "synchronous baseline, same work" in text.stdout
    assert (out / "result.json").is_file() and (out / "sync_estimate.json").is_file()


def test_bench_trainer_smoke(tmp_path: Path) -> None:
    path = tmp_path / "trainer.json"
    run("bench", "trainer", "--tenants", "1,2", "--steps", "1", "--json", str(path))
    data = json.loads(path.read_text())
    assert data  # the figures themselves are checked by the benchmark's reader, not here
    assert "2" in json.dumps(data)


def test_bench_trainer_times_the_modes_asked_for(tmp_path: Path) -> None:
    path = tmp_path / "trainer.json"
    options = ["--tenants", "2", "--steps", "1", "--modes", "multi-lane,single-lane"]
    run("bench", "trainer", *options, "--json", str(path))
    data = json.loads(path.read_text())
    assert [r["mode"] for r in data["results"]] == ["multi-lane", "single-lane"]
    assert set(data["speedup"]["2"]) == {"multi_vs_single", "multi_vs_single_paired"}
    error = refused("bench", "trainer", "--modes", "multi-lane,lora")
    assert "--modes takes some of multi-lane, single-lane, peft" in error
    assert "lora unknown" in error


def test_missing_model_is_one_clear_error(tmp_path: Path) -> None:
    error = refused("base", "eval", "--model", str(tmp_path / "nope"), "--episodes", "1")
    assert error.startswith("error: base model directory")


def test_run_writes_a_run_folder_and_names_failed_jobs(tmp_path: Path) -> None:
    jobs = tmp_path / "jobs.yaml"
    jobs.write_text(
        "jobs:\n"
        "  - name: a\n"
        "    task: {family: arithmetic}\n"
        "    algorithm: {group_size: 2, prompts_per_step: 2}\n"
        "    sampling: {max_new_tokens: 8}\n"
        "    steps: 2\n"
        "    eval_episodes: 4\n"
        "  - name: b\n"
        "    task: {family: calculator}\n"
        "    algorithm: {group_size: 2, prompts_per_step: 2, max_staleness: 0}\n"
        "    sampling: {max_new_tokens: 12}\n"
        "    steps: 1\n"
        "    eval_episodes: 4\n"
        f"  - {{name: broken, task: {{type: dataset, path: '{tmp_path}/missing.jsonl',"
        " grader: {type: math}}}\n"
    )
    out = tmp_path / "run"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "COLUMNS": "120"}
    proc = subprocess.run(
        [*MARLAAS, "run", str(jobs), "--out", str(out), "--no-live"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    # A failed job makes the exit status 1, naming it and why; the others finish.
    assert proc.returncode == 1, proc.stderr
    assert "job broken failed:" in proc.stderr and "missing.jsonl" in proc.stderr
    assert "1 of 3 jobs failed" in proc.stderr and "job a " not in proc.stderr
    result = json.loads((out / "result.json").read_text())
    steps = {t["name"]: t["steps_done"] for t in result["tenants"].values()}
    assert steps == {"a": 2, "b": 1, "broken": 0}
    assert result["staleness_violations"] == 0
    assert (out / "tenants" / "a" / "adapter" / "adapter_config.json").is_file()
    trace = json.loads((out / "trace.json").read_text())
    assert any(e.get("ph") == "X" for e in trace["traceEvents"])
    assert (out / "curves.png").read_bytes().startswith(b"\x89PNG")


def test_run_rejects_a_bad_spec_naming_the_field(tmp_path: Path) -> None:
    jobs = tmp_path / "jobs.yaml"
    jobs.write_text("jobs:\n  - name: a\n    task: {family: arithmetic}\n    steps: 0\n")
    assert "jobs.0.steps" in refused("run", str(jobs))


def test_bench_sandbox_smoke(tmp_path: Path) -> None:
    path = tmp_path / "sandbox.json"
    run("bench", "sandbox", "--calls", "2", "--json", str(path))
    rows = {r["backend"]: r for r in json.loads(path.read_text())["rows"]}
    assert rows["rlimit"]["available"] and rows["rlimit"]["calls"] == 2


def test_run_trains_a_supervised_job(tmp_path: Path) -> None:
    data = tmp_path / "sft.jsonl"
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"{a}+{a}"},
                {"role": "assistant", "content": f"{2 * a}"},
            ]
        }
        for a in range(1, 7)
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    jobs = tmp_path / "jobs.yaml"
    jobs.write_text(
        "jobs:\n"
        "  - name: tuned\n"
        f"    task: {{type: dataset, path: '{data}', eval_fraction: 0.3}}\n"
        "    algorithm: {type: sft, batch_size: 2, learning_rate: 0.003}\n"
        "    steps: 3\n"
    )
    out = tmp_path / "run"
    run("run", str(jobs), "--out", str(out), "--no-live")
    result = json.loads((out / "result.json").read_text())
    tenant = result["tenants"]["tuned"]
    assert tenant["status"] == "done" and tenant["steps_done"] == 3
    assert sorted(tenant["eval_accuracy"]) == ["0", "3"]  # token accuracy before and after
    assert (out / "tenants" / "tuned" / "adapter" / "adapter_config.json").is_file()
