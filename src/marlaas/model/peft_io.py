"""Adapters in the standard PEFT LoRA format, so tenants can take them anywhere.

A PEFT directory holds `adapter_config.json` and `adapter_model.safetensors` with keys
`base_model.model.<module path>.lora_A.weight` (`[r, in]`) and `...lora_B.weight`
(`[out, r]`). `PeftModel.from_pretrained(base, dir)` loads what `save_peft` writes and
computes the same function as our multi-LoRA layers. GPT-2's `Conv1D` layers store
their weight `[in, out]`: their adapters are written with PEFT's `fan_in_fan_out: true`
(the LoRA tensors keep the layout above; the flag tells PEFT how to merge them).

Invariants:
- `save_peft` writes into a temporary sibling directory and renames it into place: a
  reader sees the previous complete directory, no directory, or the new complete one,
  never a half-written one.
- `load_peft` accepts only what the multi-LoRA layers compute exactly: plain LoRA (no
  DoRA, biases, per-module rank or alpha patterns, extra trained modules) on modules
  that are injected, where an adapter covers every injected module of each leaf name it
  targets. `fan_in_fan_out` may take either value: PEFT itself sets it from the layer
  type on load, and the LoRA tensors have one layout. Anything else is a `ModelError`
  that names the option.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError
from safetensors.torch import load_file, save_file
from torch import Tensor

from marlaas.config.specs import ALL_LINEAR, LoRASpec
from marlaas.errors import ModelError
from marlaas.model.lora import AdapterTensors, LoRAModel

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
_PREFIX = "base_model.model."
_KEY = re.compile(r"^base_model\.model\.(?P<path>.+)\.lora_(?P<ab>[AB])\.weight$")

#: PEFT options whose non-empty / true values change the computation in ways the
#: multi-LoRA layers do not reproduce.
_UNSUPPORTED = (
    "use_dora",
    "lora_bias",
    "modules_to_save",
    "rank_pattern",
    "alpha_pattern",
    "layer_replication",
    "target_parameters",
    "trainable_token_indices",
    "megatron_config",
    "use_qalora",
    "alora_invocation_tokens",
    "use_bdlora",
    "arrow_config",
    "kasa_config",
    "monteclora_config",
    "velora_config",
)


def save_peft(
    directory: str | Path,
    spec: LoRASpec,
    tensors: Mapping[str, tuple[Tensor, Tensor]],
    base_model_name_or_path: str | None = None,
    *,
    fan_in_fan_out: bool = False,
) -> Path:
    """Write `tensors` (module path -> (A [r, in], B [out, r])) as a PEFT LoRA directory.

    `target_modules` are the leaf names of the tensors' modules. `fan_in_fan_out`: the
    modules are Conv1D layers (`LoRAModel.fan_in_fan_out`). Replaces `directory` if it
    exists. Returns the directory's path.
    """
    target = Path(directory)
    leaves = _check_for_save(spec, tensors)
    config: dict[str, Any] = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "use_rslora": spec.use_rslora,
        "target_modules": leaves,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": fan_in_fan_out,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "revision": None,
    }
    flat: dict[str, Tensor] = {}
    for path, (A, B) in tensors.items():
        flat[f"{_PREFIX}{path}.lora_A.weight"] = A.detach().to("cpu").contiguous().clone()
        flat[f"{_PREFIX}{path}.lora_B.weight"] = B.detach().to("cpu").contiguous().clone()

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.tmp-{uuid.uuid4().hex}"
    tmp.mkdir()
    old: Path | None = None
    try:
        save_file(flat, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        with open(tmp / CONFIG_NAME, "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2, sort_keys=True)
            f.write("\n")
        for name in (WEIGHTS_NAME, CONFIG_NAME):
            _fsync(tmp / name)
        if target.exists():
            old = target.parent / f".{target.name}.old-{uuid.uuid4().hex}"
            os.replace(target, old)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and not target.exists():
            os.replace(old, target)  # put the previous complete directory back
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return target


def load_peft(directory: str | Path, model: LoRAModel) -> tuple[LoRASpec, AdapterTensors]:
    """Read a PEFT LoRA directory for `model`: its spec and tensors (float32, CPU)."""
    root = Path(directory)
    config_path, weights_path = root / CONFIG_NAME, root / WEIGHTS_NAME
    if not config_path.is_file():
        raise ModelError(f"{str(root)!r} is not a PEFT adapter directory: no {CONFIG_NAME}")
    if not weights_path.is_file():
        hint = " (only .safetensors is supported)" if (root / "adapter_model.bin").exists() else ""
        raise ModelError(f"{str(root)!r} has no {WEIGHTS_NAME}{hint}")
    try:
        config: dict[str, Any] = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ModelError(f"cannot read {str(config_path)!r}: {e}") from e
    _check_config(config, config_path)

    try:
        flat = load_file(str(weights_path))
    except (OSError, ValueError, RuntimeError) as e:
        raise ModelError(f"cannot read {str(weights_path)!r}: {e}") from e
    parts: dict[str, dict[str, Tensor]] = {}
    for key, value in flat.items():
        match = _KEY.match(key)
        if match is None:
            raise ModelError(
                f"{str(weights_path)!r} holds {key!r}, which is not a plain LoRA weight "
                "(embedding adapters, biases and saved modules are not supported)"
            )
        parts.setdefault(match["path"], {})[match["ab"]] = value

    shapes = model.module_shapes
    not_injected = sorted(p for p in parts if p not in shapes)
    if not_injected:
        raise ModelError(
            f"the adapter in {str(root)!r} targets modules that are not injected: "
            f"{not_injected[:3]}; the model injects {list(model.target_modules)}"
        )
    leaves = {p.rsplit(".", 1)[-1] for p in parts}
    uncovered = [p for p in shapes if p.rsplit(".", 1)[-1] in leaves and p not in parts]
    if uncovered:
        raise ModelError(
            f"the adapter in {str(root)!r} covers only some of the {sorted(leaves)} modules "
            f"(missing {uncovered[:3]}); marlaas adapters target every layer of a module name"
        )
    tensors: AdapterTensors = {}
    for path in shapes:
        if path not in parts:
            continue
        pair = parts[path]
        if set(pair) != {"A", "B"}:
            raise ModelError(f"{str(weights_path)!r}: {path} lacks lora_A or lora_B")
        tensors[path] = (pair["A"].to(torch.float32), pair["B"].to(torch.float32))

    rank = int(config.get("r", 0))
    if rank > model.max_rank:
        raise ModelError(
            f"the adapter in {str(root)!r} has rank {rank}, above this model's max_rank "
            f"{model.max_rank}"
        )
    try:
        spec = LoRASpec(
            rank=rank,
            alpha=float(config.get("lora_alpha", 8)),
            target_modules=tuple(m for m in model.target_modules if m in leaves),
            use_rslora=bool(config.get("use_rslora", False)),
        )
    except ValidationError as e:
        raise ModelError(f"{str(config_path)!r} describes an unsupported adapter: {e}") from e
    model.check_tensors(spec, tensors)
    return spec, tensors


def peft_target_modules(spec: LoRASpec) -> list[str] | str:
    """`spec`'s targets as a PEFT `LoraConfig` takes them: the names, or "all-linear"
    (PEFT's shorthand, also for unset targets: marlaas's default)."""
    if isinstance(spec.target_modules, tuple):
        return list(spec.target_modules)
    return ALL_LINEAR


def model_fan_in_fan_out(model: LoRAModel, paths: Iterable[str]) -> bool:
    """The `fan_in_fan_out` PEFT sets for an adapter of these modules: true when they are
    Conv1D layers."""
    return any(model.fan_in_fan_out(p) for p in paths)


def _check_config(config: dict[str, Any], config_path: Path) -> None:
    if config.get("peft_type") != "LORA":
        raise ModelError(
            f"{str(config_path)!r} has peft_type {config.get('peft_type')!r}; only LORA is supported"
        )
    bad = [key for key in _UNSUPPORTED if config.get(key)]
    if config.get("bias", "none") != "none":
        bad.append("bias")
    if bad:
        raise ModelError(
            f"{str(config_path)!r} uses PEFT options marlaas does not support: "
            f"{', '.join(f'{k}={config[k]!r}' for k in bad)}"
        )


def _check_for_save(spec: LoRASpec, tensors: Mapping[str, tuple[Tensor, Tensor]]) -> list[str]:
    """The tensors' leaf names (sorted); `ModelError` unless they fit `spec`."""
    if spec.rank < 1:
        raise ModelError("a rank-0 adapter is the plain base; PEFT cannot store it")
    if not tensors:
        raise ModelError("no adapter tensors to save")
    leaves = sorted({path.rsplit(".", 1)[-1] for path in tensors})
    named = spec.target_modules
    if isinstance(named, tuple) and set(leaves) != set(named):
        raise ModelError(f"tensors cover modules {leaves} but the spec targets {sorted(named)}")
    for path, (A, B) in tensors.items():
        if A.dim() != 2 or B.dim() != 2 or A.shape[0] != spec.rank or B.shape[1] != spec.rank:
            raise ModelError(
                f"{path}: expected A [r, in] and B [out, r] with r = {spec.rank}, got "
                f"A {list(A.shape)} and B {list(B.shape)}"
            )
    return leaves


def _fsync(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())
