"""PEFT-format I/O: PEFT loads what we save, we load what PEFT saves, and both compute
the same logits; mixed batches equal PEFT's per-adapter logits."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from torch import Tensor

from marlaas.config.specs import LoRASpec
from marlaas.errors import ModelError
from marlaas.model import peft_io
from marlaas.model.base import load_base
from marlaas.model.lora import AdapterTensors, LoRAModel
from marlaas.model.peft_io import load_peft, save_peft

MakeAdapter = Callable[[LoRAModel, LoRASpec, int], AdapterTensors]
IDS = torch.randint(4, 128, (3, 9), generator=torch.Generator().manual_seed(0))


def _ours(model: LoRAModel, adapters: list[tuple[LoRASpec, AdapterTensors] | None]) -> Tensor:
    batch = model.lane_batch(adapters, torch.arange(len(adapters)))
    with torch.no_grad(), model.lanes(batch):
        return model.base(input_ids=IDS[: len(adapters)]).logits


def _peft_logits(base_dir: Path, adapter_dir: Path, rows: slice) -> Tensor:
    fresh, _ = load_base(base_dir)
    peft_model = PeftModel.from_pretrained(fresh, str(adapter_dir))
    with torch.no_grad():
        return peft_model(input_ids=IDS[rows]).logits


def test_peft_loads_what_we_save(tiny_dir: Path, tmp_path: Path, make_adapter: MakeAdapter) -> None:
    base, _ = load_base(tiny_dir)
    model = LoRAModel(base, max_rank=8)
    spec = LoRASpec(rank=4, alpha=8.0)
    tensors = make_adapter(model, spec, 0)
    out = save_peft(tmp_path / "adapter", spec, tensors, str(tiny_dir))
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["peft_type"] == "LORA"

    ours = _ours(model, [(spec, tensors)])
    theirs = _peft_logits(tiny_dir, out, slice(0, 1))
    plain = _ours(model, [None])
    assert (ours - theirs).abs().max() < 1e-4
    assert (ours - plain).abs().max() > 1e-3  # the adapter matters, so the test can fail

    spec_back, tensors_back = load_peft(out, model)
    assert spec_back == model.resolve(spec)  # explicit names, in module order
    assert all(torch.equal(tensors[p][i], tensors_back[p][i]) for p in tensors for i in (0, 1))


def test_we_load_what_peft_saves(tiny_llama_dir: Path, tmp_path: Path) -> None:
    fresh, _ = load_base(tiny_llama_dir)
    config = LoraConfig(
        r=3, lora_alpha=5, target_modules=["q_proj", "v_proj", "gate_proj"], use_rslora=True
    )
    peft_model = get_peft_model(fresh, config)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.2)
        theirs = peft_model(input_ids=IDS).logits
    peft_model.save_pretrained(tmp_path / "theirs")

    base, _ = load_base(tiny_llama_dir)
    model = LoRAModel(base, max_rank=8)
    spec, tensors = load_peft(tmp_path / "theirs", model)
    assert spec == LoRASpec(
        rank=3, alpha=5.0, target_modules=("q_proj", "v_proj", "gate_proj"), use_rslora=True
    )
    ours = _ours(model, [(spec, tensors)] * 3)
    assert (ours - theirs).abs().max() < 1e-4


def test_mixed_batch_equals_peft_per_adapter(
    tiny_dir: Path, tmp_path: Path, make_adapter: MakeAdapter
) -> None:
    base, _ = load_base(tiny_dir)
    model = LoRAModel(base, max_rank=8)
    specs = [
        LoRASpec(rank=4, alpha=8.0),
        LoRASpec(rank=2, alpha=6.0, target_modules=("k_proj", "o_proj", "up_proj")),
    ]
    adapters: list[tuple[LoRASpec, AdapterTensors] | None] = [
        (spec, make_adapter(model, spec, 10 + i)) for i, spec in enumerate(specs)
    ]
    adapters.insert(1, None)  # the middle row is the plain base
    mixed = _ours(model, adapters)
    for row, adapter in enumerate(adapters):
        alone = model.lane_batch([adapter], torch.zeros(1, dtype=torch.long))
        with torch.no_grad(), model.lanes(alone):
            single = model.base(input_ids=IDS[row : row + 1]).logits
        assert (mixed[row] - single[0]).abs().max() < 1e-5
        if adapter is None:
            fresh, _ = load_base(tiny_dir)
            with torch.no_grad():
                reference = fresh(input_ids=IDS[row : row + 1]).logits
        else:
            out = save_peft(tmp_path / f"a{row}", *adapter)
            reference = _peft_logits(tiny_dir, out, slice(row, row + 1))
        assert (mixed[row] - reference[0]).abs().max() < 1e-4


def test_save_is_atomic(
    tiny_llama_dir: Path, tmp_path: Path, make_adapter: MakeAdapter, monkeypatch: pytest.MonkeyPatch
) -> None:
    base, _ = load_base(tiny_llama_dir)
    model = LoRAModel(base, max_rank=8)
    spec = LoRASpec(rank=2, target_modules=("q_proj",))
    first, second = make_adapter(model, spec, 0), make_adapter(model, spec, 1)
    target = save_peft(tmp_path / "ckpt", spec, first)
    save_peft(target, spec, second)  # replacing an existing directory
    assert torch.equal(
        load_peft(target, model)[1]["model.layers.0.self_attn.q_proj"][1],
        second["model.layers.0.self_attn.q_proj"][1],
    )

    def crash(*args: object, **kwargs: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(peft_io, "save_file", crash)
    with pytest.raises(OSError, match="disk full"):
        save_peft(target, spec, first)
    with pytest.raises(OSError, match="disk full"):
        save_peft(tmp_path / "new", spec, first)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temp dirs left
    monkeypatch.undo()
    assert torch.equal(
        load_peft(target, model)[1]["model.layers.0.self_attn.q_proj"][1],
        second["model.layers.0.self_attn.q_proj"][1],
    )


def test_load_errors_are_specific(
    tiny_llama_dir: Path, tmp_path: Path, make_adapter: MakeAdapter
) -> None:
    base, _ = load_base(tiny_llama_dir)
    model = LoRAModel(base, max_rank=4, target_modules=("q_proj", "v_proj", "o_proj"))
    with pytest.raises(ModelError, match=r"no adapter_config\.json"):
        load_peft(tmp_path, model)

    spec = LoRASpec(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj"))
    good = save_peft(tmp_path / "good", spec, make_adapter(model, spec, 0))

    def variant(name: str, **config_changes: object) -> Path:
        path = save_peft(tmp_path / name, spec, make_adapter(model, spec, 0))
        config = json.loads((path / "adapter_config.json").read_text())
        config.update(config_changes)
        (path / "adapter_config.json").write_text(json.dumps(config))
        return path

    with pytest.raises(ModelError, match="use_dora"):
        load_peft(variant("dora", use_dora=True), model)
    with pytest.raises(ModelError, match="bias"):
        load_peft(variant("bias", bias="all"), model)
    with pytest.raises(ModelError, match="peft_type"):
        load_peft(variant("ia3", peft_type="IA3"), model)

    (tmp_path / "noweights").mkdir()
    (tmp_path / "noweights" / "adapter_config.json").write_text(
        (good / "adapter_config.json").read_text()
    )
    with pytest.raises(ModelError, match=r"no adapter_model\.safetensors"):
        load_peft(tmp_path / "noweights", model)

    small = LoRAModel(load_base(tiny_llama_dir)[0], max_rank=2, target_modules=("q_proj", "v_proj"))
    with pytest.raises(ModelError, match="max_rank 2"):
        load_peft(good, small)
    only_q = LoRAModel(load_base(tiny_llama_dir)[0], max_rank=8, target_modules=("q_proj",))
    with pytest.raises(ModelError, match="not injected"):
        load_peft(good, only_q)

    partial = dict(make_adapter(model, spec, 0))
    del partial["model.layers.1.self_attn.v_proj"]
    part_dir = save_peft(tmp_path / "partial", spec, partial)
    with pytest.raises(ModelError, match="covers only some"):
        load_peft(part_dir, model)
