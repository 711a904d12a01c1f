"""Each supported architecture trains: a run of two jobs (one on the default targets,
one on two named layers at another rank) takes two steps each on a tiny random model,
and each job's exported adapter, loaded with `PeftModel.from_pretrained`, gives the
logits of the multi-LoRA layers. A regex grader on random text gives rewards that vary
within a group, so the adapters move."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from arch_support import ARCHS, CONFIGS, char_tokenizer, save_model
from peft import PeftModel

from marlaas.backends import open_backend
from marlaas.config.job import RunSpec
from marlaas.model.base import load_base
from marlaas.model.lora import LoRAModel
from marlaas.model.peft_io import load_peft
from marlaas.pipeline.context import PipelineOptions
from marlaas.pipeline.runner import run_jobs

pytestmark = pytest.mark.slow

IDS = torch.randint(4, 128, (1, 11), generator=torch.Generator().manual_seed(1))


def write_dataset(path: Path, rows: int = 6) -> Path:
    lines = [
        json.dumps({"prompt": f"Q{i}:" + "xyz"[: 1 + i % 3] + "=", "reference": "a"})
        for i in range(rows)
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def two_jobs(data: Path, second_targets: tuple[str, ...], **run: Any) -> RunSpec:
    common: dict[str, Any] = {
        "task": {
            "type": "dataset",
            "path": str(data),
            "grader": {"type": "regex", "pattern": "[a-m]", "mode": "search"},
            "eval_fraction": 0.0,
        },
        "algorithm": {"group_size": 4, "prompts_per_step": 2, "learning_rate": 0.02},
        "sampling": {"max_new_tokens": 6},
        "steps": 2,
        "eval_episodes": 1,
    }
    jobs = [
        {**common, "name": "every", "lora": {"rank": 4, "alpha": 8.0}},
        {
            **common,
            "name": "some",
            "seed": 1,
            "lora": {"rank": 2, "alpha": 4.0, "target_modules": list(second_targets)},
        },
    ]
    return RunSpec.model_validate(
        {"engine": {"max_rank": 4, "max_batch_size": 16}, "jobs": jobs, **run}
    )


def peft_logits(base_dir: Path, adapter: Path, dtype: torch.dtype) -> torch.Tensor:
    fresh, _ = load_base(base_dir, dtype=dtype)
    model = PeftModel.from_pretrained(fresh, str(adapter))
    with torch.no_grad():
        return model(input_ids=IDS).logits[0].float()


def marlaas_logits(model: LoRAModel, adapter: Path | None) -> torch.Tensor:
    adapters = [None] if adapter is None else [load_peft(adapter, model)]
    batch = model.lane_batch(adapters, torch.zeros(1, dtype=torch.long))
    with torch.no_grad(), model.lanes(batch):
        return model.base(input_ids=IDS).logits[0].float()


def check_run(base_dir: Path, out: Path, dtype: torch.dtype, tol: float) -> dict[str, torch.Tensor]:
    """Both jobs' exported adapters against PEFT; returns the logits per job."""
    model = LoRAModel(load_base(base_dir, dtype=dtype)[0], max_rank=4)
    plain = marlaas_logits(model, None)
    logits: dict[str, torch.Tensor] = {}
    for job in ("every", "some"):
        adapter = out / "tenants" / job / "adapter"
        ours = marlaas_logits(model, adapter)
        theirs = peft_logits(base_dir, adapter, dtype)
        # Trained well past the tolerance, so that the comparison below can fail.
        assert (ours - plain).abs().max() > 3 * tol, f"{job}: the adapter did not train"
        torch.testing.assert_close(ours, theirs, rtol=tol, atol=tol)
        logits[job] = ours
    return logits


@pytest.mark.parametrize("arch", ARCHS)
def test_two_jobs_train_and_export_peft_adapters(arch: str, tmp_path: Path) -> None:
    base_dir = save_model(CONFIGS[arch](), tmp_path / "base", char_tokenizer())
    layers = LoRAModel(load_base(base_dir)[0], max_rank=4).target_modules
    run = two_jobs(write_dataset(tmp_path / "data.jsonl"), layers[:2], base_model=str(base_dir))
    result = asyncio.run(
        run_jobs(run, tmp_path / "run", backend=open_backend, options=PipelineOptions(device="cpu"))
    )
    for name, tenant in result.tenants.items():
        assert (tenant.status, tenant.steps_done) == ("done", 2), (name, tenant.failure_reason)
    config = json.loads((tmp_path / "run/tenants/some/adapter/adapter_config.json").read_text())
    assert config["target_modules"] == sorted(layers[:2])
    assert config["fan_in_fan_out"] is (arch == "gpt2")
    check_run(base_dir, tmp_path / "run", torch.float32, 1e-4)


def test_a_bfloat16_base_trains_float32_adapters_peft_agrees(tmp_path: Path) -> None:
    """`dtype: bfloat16` on the CPU: the base runs in bfloat16, the trainer's adapters
    and log-probs stay float32, and PEFT on the same bfloat16 base agrees within
    bfloat16's tolerance."""
    base_dir = save_model(CONFIGS["qwen2"](), tmp_path / "base", char_tokenizer())
    run = two_jobs(
        write_dataset(tmp_path / "data.jsonl"),
        ("q_proj", "v_proj"),
        base_model=str(base_dir),
        dtype="bfloat16",
    )
    result = asyncio.run(
        run_jobs(run, tmp_path / "run", backend=open_backend, options=PipelineOptions(device="cpu"))
    )
    assert {t.status for t in result.tenants.values()} == {"done"}
    from safetensors.torch import load_file

    weights = load_file(str(tmp_path / "run/tenants/every/adapter/adapter_model.safetensors"))
    assert {w.dtype for w in weights.values()} == {torch.float32}
    check_run(base_dir, tmp_path / "run", torch.bfloat16, 2e-2)
