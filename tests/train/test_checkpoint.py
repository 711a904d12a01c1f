"""Tenant checkpoints: exact resume, atomic writes, pruning."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from train_data import make_batch

from marlaas.config.specs import GRPOSpec, LoRASpec
from marlaas.errors import ConfigError, ModelError
from marlaas.model.lora import LoRAModel
from marlaas.train import checkpoint as ckpt_mod
from marlaas.train.batch import TrainBatch
from marlaas.train.checkpoint import (
    checkpoint_extra,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)
from marlaas.train.grpo import GRPOTrainer

LORA = LoRASpec(rank=4, alpha=8.0, target_modules=("v_proj", "q_proj", "up_proj"))
ALGO = GRPOSpec(group_size=4, prompts_per_step=2, weight_decay=0.05, kl_coef=0.1)


def _trainer(model: LoRAModel) -> GRPOTrainer:
    trainer = GRPOTrainer(model, max_tokens_per_microbatch=96)
    trainer.register("t", LORA, ALGO, seed=3, temperature=0.9, warmup_steps=2)
    trainer.register("other", LoRASpec(rank=2), ALGO, seed=4)
    return trainer


def _batch(tenant: str, step: int, model: LoRAModel) -> TrainBatch:
    return make_batch(tenant, step, ALGO, seed=step + (0 if tenant == "t" else 50), model=model)


def test_resume_equals_training_straight_through(lora_model: LoRAModel, tmp_path: Path) -> None:
    straight = _trainer(lora_model)
    for k in range(4):
        straight.step([_batch("t", k, lora_model), _batch("other", k, lora_model)])

    first = _trainer(lora_model)
    for k in range(2):
        first.step([_batch("t", k, lora_model), _batch("other", k, lora_model)])
    path = save_checkpoint(tmp_path, first.snapshot("t"), extra={"cursor": 17, "epoch": [1, 2]})
    assert path.name == "ckpt-00000002" and latest_checkpoint(tmp_path) == path

    resumed = GRPOTrainer(lora_model, max_tokens_per_microbatch=96)
    loaded = load_checkpoint(path, lora_model)
    assert loaded.extra == {"cursor": 17, "epoch": [1, 2]}
    assert (loaded.snapshot.lora, loaded.snapshot.algo) == (LORA, ALGO)
    resumed.restore(loaded.snapshot)
    resumed.restore(first.snapshot("other"))  # the other tenant, in memory
    assert resumed.version("t") == 2
    for k in range(2, 4):
        resumed.step([_batch("t", k, lora_model), _batch("other", k, lora_model)])
    for name in ("t", "other"):
        a, b = resumed.adapter(name), straight.adapter(name)
        for p in a:
            assert torch.equal(a[p][0], b[p][0]) and torch.equal(a[p][1], b[p][1])
        assert resumed.snapshot(name).adam.step == 4


def test_a_checkpoint_with_the_old_rng_state_still_loads(
    lora_model: LoRAModel, tmp_path: Path
) -> None:
    """Checkpoints once carried a tenant RNG state that nothing drew from; a file that
    has one loads as before, the state ignored."""
    trainer = _trainer(lora_model)
    trainer.step([_batch("t", 0, lora_model)])
    path = save_checkpoint(tmp_path, trainer.snapshot("t"), extra={"cursor": 5})
    optimizer = path / ckpt_mod.OPTIMIZER_NAME
    flat = load_file(str(optimizer))
    assert set(flat) == {"exp_avg", "exp_avg_sq"}  # new files carry no RNG
    flat["rng_state"] = torch.Generator().manual_seed(3).get_state()
    save_file(flat, str(optimizer))  # the file as the older code wrote it

    loaded = load_checkpoint(path, lora_model)
    assert loaded.extra == {"cursor": 5} and loaded.snapshot.version == 1
    assert loaded.snapshot.state.adam is not None
    torch.testing.assert_close(loaded.snapshot.state.adam.exp_avg_P, flat["exp_avg"])
    restored = GRPOTrainer(lora_model, max_tokens_per_microbatch=96)
    restored.restore(loaded.snapshot)
    a, b = restored.adapter("t"), trainer.adapter("t")
    assert all(torch.equal(a[p][0], b[p][0]) and torch.equal(a[p][1], b[p][1]) for p in a)


def test_crash_mid_write_keeps_the_previous_checkpoint(
    lora_model: LoRAModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    trainer = _trainer(lora_model)
    good = save_checkpoint(tmp_path, trainer.snapshot("t"), extra={"cursor": 0})
    trainer.step([_batch("t", 0, lora_model)])

    real_save_file = ckpt_mod.save_file

    def crash(*args: object, **kwargs: object) -> None:
        real_save_file(*args, **kwargs)  # type: ignore[arg-type]
        raise OSError("disk full (injected)")

    monkeypatch.setattr(ckpt_mod, "save_file", crash)
    with pytest.raises(OSError, match="injected"):
        save_checkpoint(tmp_path, trainer.snapshot("t"), extra={"cursor": 1})
    assert latest_checkpoint(tmp_path) == good
    assert sorted(p.name for p in tmp_path.iterdir()) == [good.name]  # nothing half-written
    assert load_checkpoint(good, lora_model).extra == {"cursor": 0}

    # A hard crash (no cleanup at all) leaves a hidden temporary directory: it is
    # invisible to readers and removed by the next save.
    monkeypatch.setattr(ckpt_mod, "save_file", real_save_file)
    leftover = tmp_path / ".tmp-ckpt-deadbeef"
    (leftover / "adapter").mkdir(parents=True)
    (leftover / "state.json").write_text("{}")
    assert latest_checkpoint(tmp_path) == good
    new = save_checkpoint(tmp_path, trainer.snapshot("t"), extra={"cursor": 1})
    assert latest_checkpoint(tmp_path) == new and not leftover.exists()
    assert load_checkpoint(new, lora_model).snapshot.version == 1


def test_keep_last_and_validation(lora_model: LoRAModel, tmp_path: Path) -> None:
    trainer = _trainer(lora_model)
    for k in range(5):
        save_checkpoint(tmp_path, trainer.snapshot("t"), keep_last=2)
        trainer.step([_batch("t", k, lora_model)])
    assert [p.name for p in list_checkpoints(tmp_path)] == ["ckpt-00000003", "ckpt-00000004"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-00000003", "ckpt-00000004"]
    # Re-saving the same version replaces it.
    save_checkpoint(tmp_path, trainer.snapshot("t"), extra={"again": True}, keep_last=2)
    save_checkpoint(tmp_path, trainer.snapshot("t"), extra={"again": 2}, keep_last=2)
    assert load_checkpoint(latest_checkpoint(tmp_path) or tmp_path, lora_model).extra == {
        "again": 2
    }
    # The extra alone (recovery reads what a checkpoint reported without its tensors).
    assert checkpoint_extra(latest_checkpoint(tmp_path) or tmp_path) == {"again": 2}
    with pytest.raises(ModelError, match="not a readable tenant checkpoint"):
        checkpoint_extra(tmp_path)
    with pytest.raises(ConfigError):
        save_checkpoint(tmp_path, trainer.snapshot("t"), extra={"x": object()})
    with pytest.raises(ConfigError):
        save_checkpoint(tmp_path, trainer.snapshot("t"), keep_last=0)
    assert latest_checkpoint(tmp_path / "missing") is None


def test_adapter_is_plain_peft(lora_model: LoRAModel, tmp_path: Path) -> None:
    """The adapter directory inside a checkpoint loads with PEFT's own code."""
    from peft import PeftModel
    from train_data import tiny_llama

    trainer = _trainer(lora_model)
    trainer.step([_batch("t", 0, lora_model)])
    path = save_checkpoint(tmp_path, trainer.snapshot("t"))
    peft_model = PeftModel.from_pretrained(tiny_llama(), str(path / "adapter"))
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    tensors = trainer.adapter("t")
    lane = lora_model.lane_batch([(LORA, tensors)], torch.zeros(1, dtype=torch.long))
    with torch.no_grad():
        with lora_model.lanes(lane):
            ours = lora_model.base(input_ids=ids).logits
        theirs = peft_model(input_ids=ids).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
