"""The roofline benchmark: FLOPs and bytes counted from the shapes, every row scored
against the measured machine, and the GPU script's path (a random-weight model built
from a config file alone) run end to end on the CPU with a tiny config."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from helpers.tiny_archs import WINDOW, tiny_config, tiny_model
from marlaas.bench.cost import ModelCost, TrainGroup
from marlaas.bench.machine import fma_flops
from marlaas.bench.random_model import build_random_model
from marlaas.bench.roofline import run_roofline_bench
from marlaas.config.specs import ModelDType
from marlaas.model import kernels
from marlaas.model.base import load_base
from marlaas.model.lora import LoRAModel
from marlaas.model.mixed import half_linears

HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 64, 128, 2, 4, 2, 16, 258


def test_costs_follow_the_shapes_and_the_windows() -> None:
    model = LoRAModel(tiny_model("llama", VOCAB), max_rank=8)
    cost = ModelCost.of(model)
    q, kv, o = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, HEADS * HEAD_DIM
    per_layer = HIDDEN * (q + 2 * kv) + o * HIDDEN + 3 * HIDDEN * INTER
    assert cost.weight_flops == 2 * (LAYERS * per_layer + HIDDEN * VOCAB)
    assert cost.kv_bytes == LAYERS * 2 * KV_HEADS * HEAD_DIM * 4
    assert cost.attention_flops(10) == LAYERS * 4 * HEADS * HEAD_DIM * 10
    # Rank 8 on q_proj only: 2 r (in + out) per layer.
    assert cost.lora_flops(8, ["q_proj"]) == LAYERS * 2 * 8 * (HIDDEN + q)
    # A prefill: the head at the last position only.
    assert cost.prefill_flops(3, 0.0) == (
        3 * cost.weight_flops - 2 * cost.head_flops + cost.attention_flops(1) * 6
    )
    # Gemma3's first layer slides: a token attends at most WINDOW tokens there.
    gemma = ModelCost.of(LoRAModel(tiny_model("gemma3_text", VOCAB), max_rank=8))
    per_context = 4 * HEADS * HEAD_DIM
    assert gemma.windows == (WINDOW, None)
    assert gemma.attention_flops(50) == per_context * (WINDOW + 50)
    n = 3 * WINDOW
    causal = per_context * (WINDOW * (WINDOW + 1) // 2 + (n - WINDOW) * WINDOW + n * (n + 1) // 2)
    assert gemma.causal_attention_flops(n) == causal
    # A training step: a GRPO group's prompt once (its samples share it), each sample's
    # fed tokens after it attending the prompt and themselves; the head at the prompt's
    # last position and every fed token; backward 2x the weights, 3x LoRA and attention.
    head = 2 * HIDDEN * VOCAB
    assert cost.head_flops == head
    lora = cost.lora_flops(8, ["q_proj"])
    group = TrainGroup(prompt=5, fed=(2, 0, 3))
    body, positions = 5 + 5, 1 + 5
    attention = cost.causal_attention_flops(5) + sum(
        cost.causal_attention_flops(5 + f) - cost.causal_attention_flops(5) for f in (2, 0, 3)
    )
    assert attention == cost.attention_flops_per_context * LAYERS * (15 + 6 + 7 + 6 + 7 + 8)
    want = body * (2 * (cost.weight_flops - head) + 3 * lora) + positions * 2 * head
    assert cost.train_flops([group], lora) == want + 3 * attention
    assert cost.train_flops([group, group], lora) == 2 * cost.train_flops([group], lora)
    assert cost.train_tokens([group]) == 10 and cost.logit_positions([group]) == 6
    # Half linear weights over float32 activations: every matrix but the head's.
    assert cost.half_weight_flops == 0.0
    half_linears(model.base, torch.bfloat16)
    half = ModelCost.of(model)
    assert half.half_weight_flops == 2 * LAYERS * per_layer
    assert half.half_flops(3) == 3 * half.half_weight_flops
    assert half.kv_bytes == cost.kv_bytes / 2  # the engine caches bfloat16 (kv_dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_row_is_scored_against_the_machine(tmp_path: Path, dtype: ModelDType) -> None:
    """In float32, and with bfloat16 linear weights over float32 activations, whose FLOPs
    count at the machine's bfloat16 peak and the rest at its float32 one."""
    path = tmp_path / "model"
    (tmp_path / "config.json").write_text(json.dumps(tiny_config("qwen2", VOCAB).to_dict()))
    build_random_model(tmp_path / "config.json", path)
    base, tokenizer = load_base(path, dtype=dtype)
    model = LoRAModel(base, max_rank=8)
    out = tmp_path / "roofline.json"
    result = run_roofline_bench(
        model,
        tokenizer,
        out,
        batches=(1, 4),
        adapters=(1, 3),
        contexts=(12,),
        trainer_tenants=(2,),
        iterations=2,
        trainer_steps=1,
        square=128,
        copy_mb=8,
        print_table=False,
    )
    assert json.loads(out.read_text()) == result
    machine = result["machine"]
    assert machine["peak_flops"] >= machine["model_shape_flops"] > 0 and machine["bandwidth"] > 0
    # The cores' multiply-add rates (the kernels build here; bfloat16 where native).
    assert machine["fma_flops"] > 0
    assert (machine["bf16_fma_flops"] > 0) == bool(machine["bf16_hardware"])
    if _cpu_has("amx_bf16"):  # the tiles' rate is bfloat16's ceiling there
        amx = fma_flops("fma_peak_amx_bf16", 16 * 16 * 32 * 2, iterations=1000)
        assert amx > 0
    half_peak = machine["weights_flops"]
    assert (half_peak > 0) == (dtype == "bfloat16")
    assert machine["weights_dtype"] == (None if dtype == "float32" else dtype)
    kinds = [(r["kind"], r["rows"], r["adapters"]) for r in result["rows"]]
    assert kinds == [
        ("prefill", 16, 1),
        ("prefill", 16, 3),
        ("decode", 1, 1),
        ("decode", 4, 1),
        ("decode", 1, 1),
        ("decode", 4, 3),
        ("train", 8, 2),
    ]
    for r in result["rows"]:
        half = r["half_flops"]
        assert (half > 0) == (dtype == "bfloat16") and half < r["flops"]
        compute = (r["flops"] - half) / machine["peak_flops"] + (half / half_peak if half else 0)
        memory = r["bytes"] / machine["bandwidth"]
        assert r["roofline_s"] == pytest.approx(max(compute, memory))
        assert r["efficiency"] == pytest.approx(r["roofline_s"] / r["seconds"])
        fma_peak = machine["bf16_fma_flops"] if half else machine["fma_flops"]
        fma_compute = (r["flops"] - half) / machine["fma_flops"] + (half / fma_peak if half else 0)
        assert r["fma_efficiency"] == pytest.approx(max(fma_compute, memory) / r["seconds"])
        assert r["bound"] == ("compute" if compute >= memory else "memory")
        # Engine rows are timed on torch's path too (the kernels build here), the
        # trainer's are not.
        if r["kind"] == "train":
            assert r["torch_seconds"] is None
            # The host's part of a step (the tenants' inputs and results) timed beside
            # the device's, not in it.
            assert r["host_seconds"] > 0
        else:
            assert r["torch_seconds"] > 0


@pytest.mark.slow
def test_the_gpu_scripts_path_runs_on_the_cpu_with_a_tiny_config(tmp_path: Path) -> None:
    """`bench/gpu.sh` with a tiny config instead of Qwen2.5-1.5B's and the CPU."""
    (tmp_path / "tiny.json").write_text(json.dumps(tiny_config("qwen2", VOCAB).to_dict()))
    script = Path(__file__).resolve().parents[2] / "bench" / "gpu.sh"
    env = {
        **os.environ,
        "MARLAAS": f"{sys.executable} -m marlaas.cli",
        "PYTHON": sys.executable,
        "CONFIG": str(tmp_path / "tiny.json"),
        "OUT": str(tmp_path / "out"),
        "DEVICE": "cpu",
        "DTYPE": "float32",
        "ROOFLINE_ARGS": "--batches 1,4 --adapters 1,2 --contexts 8 --tenants 1 --iterations 1 "
        "--square 128 --copy-mb 8",
        "PAPER_ARGS": "--tenants 1 --steps 1 --regime paper --no-trl",
    }
    proc = subprocess.run(
        ["bash", str(script)], capture_output=True, text=True, timeout=900, env=env
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    roofline = json.loads((tmp_path / "out" / "roofline.json").read_text())
    assert {r["kind"] for r in roofline["rows"]} == {"prefill", "decode", "train"}
    assert (tmp_path / "out" / "paper.json").is_file()


def test_the_model_shape_peak_times_the_projects_own_products_too() -> None:
    """The machine's matmul peak at the model's shapes times, beside torch's `F.linear`,
    the product a model layer of that weight runs (`_native_linear`: the packed float32
    kernel for a small weight on an AVX-512 CPU, the packed bfloat16 one with native
    bfloat16): the same product (so the ceiling is one the code can reach, never one it
    outruns), and none for a weight the runtime leaves to torch."""
    from marlaas.bench.machine import _native_linear
    from marlaas.model import mixed

    g = torch.Generator().manual_seed(5)
    x = torch.randn(8, 64, generator=g)
    w = torch.randn(40, 64, generator=g)
    run = _native_linear(x, w)
    if mixed.cpu_avx512() and kernels.native_kernels("linear_f32_rows"):
        assert run is not None
        torch.testing.assert_close(run(), F.linear(x, w), rtol=1e-5, atol=1e-5)
    big = torch.zeros(mixed.F32_PACK_MAX_ELEMENTS // 64 + 1, 64)
    assert _native_linear(x, big) is None
    half = _native_linear(x, w.bfloat16())
    if mixed.native_bfloat16("cpu") and kernels.native_kernels("half_linear_rows"):
        assert half is not None
        want = F.linear(x.bfloat16(), w.bfloat16()).float()
        torch.testing.assert_close(half(), want, rtol=1e-2, atol=1e-2)


def _cpu_has(flag: str) -> bool:
    """Whether Linux lists `flag` among the CPU's (False off Linux)."""
    info = Path("/proc/cpuinfo")
    return info.is_file() and f" {flag}" in info.read_text()
