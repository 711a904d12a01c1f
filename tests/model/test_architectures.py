"""Every supported decoder architecture: LoRA targets come from the base, the multi-LoRA
layers compute what PEFT computes from the adapter marlaas exports (two different
adapters in one batch), and what a model cannot do is refused with the option to
change. The two-job training runs over the same matrix are in `test_arch_runs.py`."""

from __future__ import annotations

import asyncio
import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from arch_support import ARCHS, CONFIGS, WINDOWED, char_tokenizer, save_model
from peft import LoraConfig, PeftModel, get_peft_model
from torch import Tensor
from transformers import AutoModelForCausalLM

from marlaas.backends import open_backend
from marlaas.config.job import RunSpec
from marlaas.config.specs import LoRASpec
from marlaas.errors import ConfigError, ModelError
from marlaas.model.arch import check_attention
from marlaas.model.base import load_base
from marlaas.model.lora import AdapterTensors, LoRAModel
from marlaas.model.peft_io import load_peft, model_fan_in_fan_out, save_peft
from marlaas.pipeline.context import PipelineOptions
from marlaas.pipeline.runner import run_jobs

IDS = torch.randint(4, 128, (2, 9), generator=torch.Generator().manual_seed(0))

#: Each architecture's layers, as marlaas resolves `all-linear` (module order).
LAYERS = {
    "llama": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    "phi3": ("o_proj", "qkv_proj", "gate_up_proj", "down_proj"),
    "gpt_neox": ("query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"),
    "mixtral": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "opt": ("k_proj", "v_proj", "q_proj", "out_proj", "fc1", "fc2"),
    "qwen2_moe": (
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
        "shared_expert_gate",
    ),
    "gpt2": ("c_attn", "c_proj", "c_fc"),
}


#: Each architecture's attention projections (the rest of `LAYERS` is feed-forward;
#: GPT-2's `c_proj` is both the attention's and the MLP's output projection).
ATTENTION = {
    "phi3": {"o_proj", "qkv_proj"},
    "gpt_neox": {"query_key_value", "dense"},
    "opt": {"k_proj", "v_proj", "q_proj", "out_proj"},
    "gpt2": {"c_attn", "c_proj"},
}


@pytest.mark.parametrize("arch", ARCHS)
def test_layers_have_the_role_of_where_they_sit(arch: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        base = AutoModelForCausalLM.from_config(CONFIGS[arch]())
    roles = LoRAModel(base, max_rank=4).target_roles
    layers = LAYERS.get(arch, LAYERS["llama"])
    assert tuple(roles) == layers
    attention = ATTENTION.get(arch, {"q_proj", "k_proj", "v_proj", "o_proj"})
    both = {"c_proj"} if arch == "gpt2" else set()
    for name, of in roles.items():
        expected = (
            {"attention", "mlp"}
            if name in both
            else {"attention"}
            if name in attention
            else {"mlp"}
        )
        assert of == expected, name


@pytest.fixture(scope="module")
def arch_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("archs")
    return {
        name: save_model(make(), root / name, char_tokenizer(), seed=i)
        for i, (name, make) in enumerate(CONFIGS.items())
    }


def _random(model: LoRAModel, spec: LoRASpec, seed: int) -> AdapterTensors:
    """Random A and B, so that a wrong computation shows in the logits."""
    g = torch.Generator().manual_seed(seed)
    out: AdapterTensors = {}
    for path, (A, B) in model.init_adapter(spec, seed).items():
        out[path] = (A, torch.randn(B.shape, generator=g) * 0.3)
    return out


def _peft_logits(base_dir: Path, adapter_dir: Path, row: int) -> Tensor:
    fresh, _ = load_base(base_dir)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*fan_in_fan_out")  # PEFT corrects it
        peft_model = PeftModel.from_pretrained(fresh, str(adapter_dir))
    with torch.no_grad():
        return peft_model(input_ids=IDS[row : row + 1]).logits[0]


@pytest.mark.parametrize("arch", ARCHS)
def test_exported_adapters_give_peft_logits(
    arch: str, arch_dirs: dict[str, Path], tmp_path: Path
) -> None:
    base, _ = load_base(arch_dirs[arch])
    model = LoRAModel(base, max_rank=4)
    every = model.resolve(LoRASpec(rank=4, alpha=8.0))
    if arch in LAYERS:
        assert every.target_modules == LAYERS[arch]
    else:
        assert every.target_modules == LAYERS["llama"]
    assert "lm_head" not in every.target_modules
    # Two adapters of different shapes in one batch: all layers, and the first two.
    names = every.target_modules
    assert isinstance(names, tuple)
    some = LoRASpec(rank=2, alpha=3.0, target_modules=names[1::2], use_rslora=True)
    adapters = [(spec, _random(model, spec, seed)) for seed, spec in enumerate((every, some))]
    batch = model.lane_batch(adapters, torch.tensor([0, 1]))
    with torch.no_grad(), model.lanes(batch):
        ours = base(input_ids=IDS).logits
    with torch.no_grad():
        plain = base(input_ids=IDS).logits
    for row, (spec, tensors) in enumerate(adapters):
        out = save_peft(
            tmp_path / f"a{row}",
            spec,
            tensors,
            fan_in_fan_out=model_fan_in_fan_out(model, tensors),
        )
        config = json.loads((out / "adapter_config.json").read_text())
        assert config["fan_in_fan_out"] is (arch == "gpt2")
        theirs = _peft_logits(arch_dirs[arch], out, row)
        assert (ours[row] - plain[row]).abs().max() > 1e-2  # the adapter matters
        torch.testing.assert_close(ours[row], theirs, rtol=1e-4, atol=1e-4)
        spec_back, tensors_back = load_peft(out, model)
        assert spec_back == model.resolve(spec)
        assert all(torch.equal(tensors[p][i], tensors_back[p][i]) for p in tensors for i in (0, 1))


def test_an_adapter_peft_trained_on_gpt2_loads(arch_dirs: dict[str, Path], tmp_path: Path) -> None:
    """PEFT's own GPT-2 adapter (Conv1D layers: `fan_in_fan_out: true`) is read as is."""
    fresh, _ = load_base(arch_dirs["gpt2"])
    config = LoraConfig(r=2, lora_alpha=4, target_modules=["c_attn", "c_fc"], fan_in_fan_out=True)
    peft_model = get_peft_model(fresh, config)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    peft_model.save_pretrained(tmp_path / "peft")
    with torch.no_grad():
        theirs = peft_model(input_ids=IDS).logits
    base, _ = load_base(arch_dirs["gpt2"])
    model = LoRAModel(base, max_rank=4)
    spec, tensors = load_peft(tmp_path / "peft", model)
    assert spec.target_modules == ("c_attn", "c_fc")
    batch = model.lane_batch([(spec, tensors)], torch.zeros(2, dtype=torch.long))
    with torch.no_grad(), model.lanes(batch):
        ours = base(input_ids=IDS).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_moe_expert_weights_are_refused_by_name(arch_dirs: dict[str, Path]) -> None:
    model = LoRAModel(load_base(arch_dirs["mixtral"])[0], max_rank=4)
    with pytest.raises(ConfigError, match=r"lora\.target_modules: 'gate_up_proj' is a fused"):
        model.resolve(LoRASpec(target_modules=("q_proj", "gate_up_proj")))
    with pytest.raises(ConfigError, match=r"'lm_head' is the output head"):
        model.resolve(LoRASpec(target_modules=("lm_head",)))
    with pytest.raises(ConfigError, match=r"'w1' matches no linear layer.*'q_proj', 'k_proj'"):
        model.resolve(LoRASpec(target_modules=("w1",)))
    # Qwen2-MoE: `down_proj` is the shared expert's layer; the experts' stay frozen.
    moe = LoRAModel(load_base(arch_dirs["qwen2_moe"])[0], max_rank=4)
    paths = moe.module_paths(LoRASpec(rank=2, target_modules=("down_proj",)))
    assert paths == [f"model.layers.{i}.mlp.shared_expert.down_proj" for i in range(2)]


def test_a_run_default_and_a_job_override_resolve(arch_dirs: dict[str, Path]) -> None:
    model = LoRAModel(load_base(arch_dirs["gpt_neox"])[0], max_rank=4)
    default = ("dense_h_to_4h", "query_key_value")
    spec = model.resolve(LoRASpec(), default=default)
    assert spec.target_modules == ("query_key_value", "dense_h_to_4h")  # module order
    own = model.resolve(LoRASpec(target_modules=("dense",)), default=default)
    assert own.target_modules == ("dense",)
    assert model.resolve(own) is own  # already explicit: unchanged


@pytest.mark.parametrize("arch", sorted(WINDOWED))
def test_sliding_windows_load(arch: str, tmp_path: Path) -> None:
    make, _ = WINDOWED[arch]
    base, _ = load_base(save_model(make(), tmp_path / arch, char_tokenizer()))
    assert len(LoRAModel(base, max_rank=4).module_shapes) > 0  # windows are supported


def test_other_attention_layer_types_are_refused_naming_them() -> None:
    config = WINDOWED["qwen2"][0]()
    config.layer_types = ["full_attention", "chunked_attention"]
    with pytest.raises(ModelError, match=r"\['chunked_attention'\] layers.*config\.json"):
        check_attention(config)


@pytest.mark.parametrize(
    ("job", "message"),
    [
        (
            {"lora": {"rank": 2, "target_modules": ["query_key_value"]}},
            r"lora\.target_modules: 'query_key_value' matches no linear layer",
        ),
        ({"task": {"family": "calculator", "format": "chat"}}, r"task\.format chat needs"),
    ],
)
def test_a_run_refuses_what_the_base_cannot_do_before_any_work(
    job: dict[str, Any], message: str, tmp_path: Path
) -> None:
    """On the embedded base (a Llama, no chat template), before any tenant starts."""
    fine = {"name": "fine", "task": {"family": "reverse"}, "steps": 1}
    run = RunSpec.model_validate(
        {"jobs": [fine, {"name": "bad", "task": {"family": "reverse"}, **job}]}
    )
    with pytest.raises(ConfigError, match=message):
        asyncio.run(
            run_jobs(run, tmp_path, backend=open_backend, options=PipelineOptions(device="cpu"))
        )
    assert not (tmp_path / "tenants").exists() and not (tmp_path / "result.json").exists()
