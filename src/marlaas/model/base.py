"""Loading the shared base: any Hugging Face causal-LM directory, frozen.

Invariants:
- The returned model is in eval mode and every one of its parameters has
  `requires_grad == False`; nothing in marlaas ever writes to these weights.
- Loading never touches the network (`local_files_only=True`).
- `dtype="auto"` is the checkpoint's own dtype (`config.json` `dtype`): on an
  accelerator as it is; on the CPU bfloat16 where the checkpoint is bfloat16 and the
  CPU computes it natively (`mixed.native_bfloat16`), float32 otherwise (an emulated or
  float16 half is slower than float32 there). An explicit dtype is the whole model's on
  an accelerator; on the CPU a half dtype is the linear layers' weights only, over
  float32 activations (`marlaas.model.mixed`: torch's half-precision element-wise CPU
  ops are slow, its matmuls fast where the CPU has native bfloat16). Training with
  bfloat16 linears learns as float32 does (`marlaas bench dtype`: 24 tenants of four
  templates, each template's final accuracy -0.005..+0.004 of float32's on gains of
  +0.06..+0.18), which is why `auto` takes a bfloat16 checkpoint's dtype on the CPU
  too; the embedded base declares bfloat16 (its weights are stored in float32).
- A bad path fails with `ModelError` naming the path, never with a bare Hugging Face
  traceback.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from marlaas.config.specs import ModelDType
from marlaas.errors import ConfigError, ModelError
from marlaas.model.mixed import HALF_DTYPES, half_linears, native_bfloat16

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def default_base_path() -> Path:
    """The embedded default base shipped inside the package (`marlaas/model/embedded`).

    The directory may not exist in a fresh checkout before `marlaas base build` ran.
    """
    return Path(__file__).resolve().parent / "embedded"


def resolve_dtype(
    dtype: ModelDType | torch.dtype, device: str | torch.device, config: object = None
) -> torch.dtype:
    """The torch dtype of the base for `dtype` on `device` (see the module docstring);
    `config` is the model's config, whose own dtype `auto` takes where the device
    computes it."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in _DTYPES:
        return _DTYPES[dtype]
    if dtype != "auto":
        raise ConfigError(f"dtype must be auto, {', '.join(_DTYPES)}; got {dtype!r}")
    own = getattr(config, "dtype", None)  # config.json's `dtype` (`torch_dtype` before v5)
    if isinstance(own, str):
        own = _DTYPES.get(own.removeprefix("torch."))
    if not isinstance(own, torch.dtype) or own not in _DTYPES.values():
        return torch.float32
    if torch.device(device).type == "cpu":
        return own if own == torch.bfloat16 and native_bfloat16(device) else torch.float32
    return own


def load_weights(
    root: str | Path, config: object, dtype: torch.dtype, device: str | torch.device
) -> PreTrainedModel:
    """`AutoModelForCausalLM.from_pretrained` in `dtype` as placed on `device`: the whole
    model's on an accelerator; on the CPU a half dtype is the linear layers' only
    (`half_linears`, the module doc). Hugging Face's errors pass through."""
    half = torch.device(device).type == "cpu" and dtype in HALF_DTYPES
    model = AutoModelForCausalLM.from_pretrained(
        root, config=config, dtype=torch.float32 if half else dtype, local_files_only=True
    )
    if half:
        half_linears(model, dtype)
    return model


def load_base(
    path: str | Path,
    dtype: ModelDType | torch.dtype = "auto",
    device: str | torch.device = "cpu",
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer from a local directory, frozen and in eval mode,
    with its weights in `dtype` (see `resolve_dtype`) on `device`.

    Raises `ModelError` when the directory is missing, holds no model config, is not a
    causal LM, or has no tokenizer.
    """
    root = Path(path)
    if not root.is_dir():
        raise ModelError(
            f"base model directory {str(root)!r} does not exist; pass a local Hugging Face "
            "model directory (or build the embedded base with `marlaas base build`)"
        )
    if not (root / "config.json").is_file():
        raise ModelError(
            f"{str(root)!r} has no config.json; it is not a Hugging Face model directory"
        )
    try:
        config = AutoConfig.from_pretrained(root, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise ModelError(f"cannot read the model config in {str(root)!r}: {e}") from e
    torch_dtype = resolve_dtype(dtype, device, config)
    try:
        model = load_weights(root, config, torch_dtype, device)
    except ValueError as e:
        raise ModelError(
            f"{str(root)!r} holds a {type(config).__name__}, which is not a causal language "
            f"model Hugging Face can load: {e}"
        ) from e
    except (OSError, KeyError, RuntimeError) as e:
        raise ModelError(f"cannot load the model weights in {str(root)!r}: {e}") from e
    try:
        tokenizer = AutoTokenizer.from_pretrained(root, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelError(f"cannot load a tokenizer from {str(root)!r}: {e}") from e
    if not isinstance(tokenizer, PreTrainedTokenizerBase):
        raise ModelError(f"{str(root)!r} does not hold a Hugging Face tokenizer")

    model = model.to(torch.device(device))  # type: ignore[arg-type]  # HF's to() stub
    model.eval()
    model.requires_grad_(False)
    return model, tokenizer
