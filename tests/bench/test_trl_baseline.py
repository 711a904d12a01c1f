"""The TRL baseline really trains: one tenant, one GRPO step with TRL's GRPOTrainer and
a PEFT LoRA, rewarded by our grader, moves the adapter; its config mirrors the job."""

from __future__ import annotations

from pathlib import Path

import pytest

from marlaas.bench.trl_baseline import grpo_config_kwargs, run_trl_tenant
from marlaas.config.job import JobSpec
from marlaas.errors import ConfigError

pytest.importorskip("trl")


def job(**changes: object) -> JobSpec:
    raw: dict[str, object] = {
        "name": "arith-000",
        "task": {"family": "arithmetic"},
        "lora": {"rank": 4, "alpha": 8},
        "algorithm": {"group_size": 4, "prompts_per_step": 4, "learning_rate": 5e-4},
        "sampling": {"temperature": 1.0, "max_new_tokens": 8},
        "steps": 1,
        "eval_episodes": 8,
        "seed": 3,
        **changes,
    }
    return JobSpec.model_validate(raw)


def test_config_mirrors_the_job() -> None:
    spec = job(
        algorithm={
            "group_size": 8,
            "prompts_per_step": 2,
            "learning_rate": 1e-3,
            "clip_high": 0.28,
            "loss_norm": "sequence",
            "kl_coef": 0.01,
            "scale_rewards": False,
        },
        steps=5,
    )
    kw = grpo_config_kwargs(spec, "/tmp/x")
    assert kw["num_generations"] == 8
    assert kw["per_device_train_batch_size"] == kw["generation_batch_size"] == 16
    assert kw["gradient_accumulation_steps"] == 1 and kw["num_iterations"] == 1
    assert kw["max_steps"] == 5 and kw["learning_rate"] == 1e-3
    assert (kw["epsilon"], kw["epsilon_high"]) == (0.2, 0.28)
    assert kw["loss_type"] == "grpo" and kw["beta"] == 0.01 and kw["scale_rewards"] == "none"
    assert kw["max_completion_length"] == 8 and kw["temperature"] == 1.0
    assert kw["report_to"] == [] and kw["save_strategy"] == "no" and not kw["bf16"]
    assert kw["shuffle_dataset"] is False and kw["lr_scheduler_type"] == "constant"


def test_multi_turn_jobs_are_refused(base_dir: Path) -> None:
    with pytest.raises(ConfigError, match="single-turn"):
        run_trl_tenant(job(task={"family": "calculator"}), base_dir)


def test_one_step_trains_the_adapter(base_dir: Path, tmp_path: Path) -> None:
    result = run_trl_tenant(job(), base_dir, work_dir=tmp_path)
    assert result.steps == 1
    assert result.adapter_changed and result.adapter_delta_norm > 0
    assert result.tokens_generated > 0
    assert 0.0 < result.reward_mean < 1.0  # mixed rewards: a non-zero advantage
    assert result.eval_before is not None and result.eval_after is not None
    assert result.wall_s >= result.train_s > 0
    assert result.to_json()["adapter_changed"] is True


def test_only_the_trl_baseline_imports_trl() -> None:
    import subprocess
    import sys

    code = (
        "import sys, marlaas.cli.main, marlaas.bench.paper, marlaas.bench.report\n"
        "assert 'trl' not in sys.modules, 'trl imported eagerly'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
