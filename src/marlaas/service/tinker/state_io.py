"""The files of a Tinker run's saved weights.

- Sampler weights (`tinker://RUN/sampler_weights/NAME`): a PEFT LoRA directory
  (`adapter_config.json`, `adapter_model.safetensors`), loadable by PEFT itself and
  served by the OpenAI-compatible routes.
- A saved state (`tinker://RUN/weights/NAME`): `adapter/` (that PEFT directory),
  `optimizer.safetensors` (AdamW moments; older states also hold an `rng_state`, which
  reading ignores: nothing draws from it) and `state.json` (format, adapter version,
  optimizer step, LoRA spec, base model).

A directory is complete or absent: everything is written into a hidden sibling, then
renamed into place in one step (a replaced one is moved aside first and removed
after). Readers only ever see whole directories.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from safetensors.torch import load_file, save_file

from marlaas.config.specs import LoRASpec
from marlaas.errors import ModelError
from marlaas.model.lora import AdapterTensors, LoRAModel
from marlaas.model.peft_io import CONFIG_NAME, load_peft, save_peft
from marlaas.train.optim import AdamState, TenantSnapshot

FORMAT = "marlaas-tinker-state/1"
ADAPTER_DIR = "adapter"
OPTIMIZER_NAME = "optimizer.safetensors"
STATE_NAME = "state.json"


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _size(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


def _atomic_dir(final: Path, write: Callable[[Path], None]) -> int:
    """Run `write(tmp)` on a fresh hidden sibling of `final`, then rename it to `final`
    (replacing what was there); returns the directory's size in bytes."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.tmp-{uuid.uuid4().hex}"
    tmp.mkdir()
    old: Path | None = None
    try:
        write(tmp)
        for path in tmp.rglob("*"):
            _fsync(path)
        _fsync(tmp)
        if final.exists():
            old = final.parent / f".{final.name}.old-{uuid.uuid4().hex}"
            os.replace(final, old)
        os.replace(tmp, final)
        _fsync(final.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and not final.exists():
            os.replace(old, final)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return _size(final)


def write_sampler_weights(
    directory: Path, lora: LoRASpec, tensors: AdapterTensors, base_model: str
) -> int:
    """Write sampler weights (a PEFT directory); returns their size in bytes."""
    return _atomic_dir(directory, lambda tmp: _write_peft(tmp, lora, tensors, base_model))


def _write_peft(tmp: Path, lora: LoRASpec, tensors: AdapterTensors, base_model: str) -> None:
    written = save_peft(tmp / ADAPTER_DIR, lora, tensors, base_model)
    for path in written.iterdir():  # the PEFT files at the top of the directory
        os.replace(path, tmp / path.name)
    written.rmdir()


def write_state(directory: Path, snapshot: TenantSnapshot, base_model: str) -> int:
    """Write a saved state of `snapshot`; returns its size in bytes."""
    if snapshot.adam is None:
        raise ModelError("a saved state needs the optimizer state of the device")
    adam = snapshot.adam
    state = {
        "format": FORMAT,
        "version": snapshot.version,
        "optimizer_step": adam.step,
        "lora": snapshot.lora.model_dump(mode="json"),
        "base_model": base_model,
    }

    def write(tmp: Path) -> None:
        save_peft(tmp / ADAPTER_DIR, snapshot.lora, snapshot.tensors, base_model)
        save_file(
            {
                "exp_avg": adam.exp_avg_P.detach().cpu().contiguous(),
                "exp_avg_sq": adam.exp_avg_sq_P.detach().cpu().contiguous(),
            },
            str(tmp / OPTIMIZER_NAME),
        )
        (tmp / STATE_NAME).write_text(json.dumps(state, indent=2) + "\n", encoding="utf-8")

    return _atomic_dir(directory, write)


def read_state(
    directory: Path, model: LoRAModel, tenant: str, *, optimizer: bool
) -> TenantSnapshot:
    """A saved state as a snapshot for `tenant`: adapter and version always; the AdamW
    moments and optimizer step when `optimizer` (else a fresh optimizer)."""
    try:
        state: dict[str, Any] = json.loads((directory / STATE_NAME).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ModelError(f"the saved state at {directory} cannot be read: {e}") from e
    if state.get("format") != FORMAT:
        raise ModelError(f"{directory} is not a saved Tinker state ({state.get('format')!r})")
    lora = LoRASpec.model_validate(state["lora"])
    _, tensors = load_peft(directory / ADAPTER_DIR, model)
    adam: AdamState | None = None
    if optimizer:
        flat = load_file(str(directory / OPTIMIZER_NAME))
        adam = AdamState(
            step=int(state["optimizer_step"]),
            exp_avg_P=flat["exp_avg"],
            exp_avg_sq_P=flat["exp_avg_sq"],
        )
    return TenantSnapshot(
        tenant=tenant,
        lora=lora,
        version=int(state["version"]),
        tensors=tensors,
        adam=adam,
    )


def read_adapter(directory: Path, model: LoRAModel) -> tuple[LoRASpec, AdapterTensors]:
    """The adapter of sampler weights, or of a saved state (its `adapter/`)."""
    peft = directory if (directory / CONFIG_NAME).is_file() else directory / ADAPTER_DIR
    return load_peft(peft, model)


def remove(directory: Path) -> None:
    """Remove saved weights: renamed out of sight first, so no half-deleted directory
    ever carries a checkpoint's name."""
    if not directory.exists():
        return
    trash = directory.parent / f".{directory.name}.trash-{uuid.uuid4().hex}"
    os.replace(directory, trash)
    shutil.rmtree(trash, ignore_errors=True)
