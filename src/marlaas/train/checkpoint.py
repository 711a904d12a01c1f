"""Atomic tenant checkpoints of GRPO tenants (`GRPOSnapshot`) and supervised ones
(`SFTSnapshot`): adapter, optimizer state, version, the algorithm's settings and an
opaque `extra` dict (the pipeline's data cursor), in one directory per checkpoint.

Layout of `<root>/ckpt-<version, 8 digits>/`:
- `adapter/`: the adapter in PEFT format (`save_peft`), loadable by PEFT itself;
- `optimizer.safetensors`: AdamW moments (`exp_avg`, `exp_avg_sq`); older files also
  hold a tenant RNG state (`rng_state`), which loading ignores (nothing draws from it);
- `state.json`: format, tenant, version, optimizer step, the LoRA and algorithm specs
  (`algo.type` says which), temperature, schedule, `constant_norm_tokens` (GRPO's; a
  supervised checkpoint writes 1.0, 0 and null) and `extra`.

Invariants:
- A checkpoint directory is complete or absent. Everything is written into a hidden
  temporary sibling (`.tmp-...` in the same parent, so the rename never crosses a file
  system), every file and directory is fsynced, then one `os.replace` gives it its
  name and the parent is fsynced. A crash at any moment leaves the previous checkpoints
  intact; `latest_checkpoint` only ever sees complete ones, and the next save removes
  leftovers of a crashed one.
- Old checkpoints are renamed out of sight before they are deleted, so pruning never
  leaves a half-deleted directory under a checkpoint name.
- One writer per root directory (the tenant's own); readers may run at any time.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors.torch import load_file, save_file

from marlaas.config.specs import GRPOSpec, LoRASpec, SFTSpec
from marlaas.errors import ConfigError, ModelError
from marlaas.model.lora import LoRAModel
from marlaas.model.peft_io import load_peft, save_peft
from marlaas.train.grpo import GRPOSnapshot, GRPOTraining
from marlaas.train.optim import AdamState, TenantSnapshot
from marlaas.train.sft import SFTSnapshot

FORMAT = "marlaas-tenant-checkpoint/1"
ADAPTER_DIR = "adapter"
OPTIMIZER_NAME = "optimizer.safetensors"
STATE_NAME = "state.json"
_NAME = re.compile(r"^ckpt-(?P<version>\d{8,})$")
_TMP_PREFIX = ".tmp-ckpt-"
_TRASH_PREFIX = ".trash-ckpt-"


@dataclass(frozen=True)
class Checkpoint:
    """A loaded checkpoint: the tenant's state and settings, and the caller's `extra`."""

    path: Path
    snapshot: GRPOSnapshot | SFTSnapshot
    extra: dict[str, Any]


def checkpoint_name(version: int) -> str:
    return f"ckpt-{version:08d}"


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest (lowest version) first."""
    base = Path(root)
    if not base.is_dir():
        return []
    found = [
        (int(match["version"]), p)
        for p in base.iterdir()
        if (match := _NAME.match(p.name)) is not None and (p / STATE_NAME).is_file()
    ]
    return [p for _, p in sorted(found)]


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest complete checkpoint under `root`, or None."""
    found = list_checkpoints(root)
    return found[-1] if found else None


def save_checkpoint(
    root: str | Path,
    snapshot: GRPOSnapshot | SFTSnapshot,
    extra: Mapping[str, Any] | None = None,
    keep_last: int = 3,
    *,
    fan_in_fan_out: bool = False,
) -> Path:
    """Write `snapshot` (the device's `TenantSnapshot` and the tenant's GRPO settings)
    and `extra` (JSON-able) as `<root>/ckpt-<version>`, atomically; keep the newest
    `keep_last` checkpoints. `fan_in_fan_out`: the adapter's layers are Conv1D
    (`save_peft`)."""
    if keep_last < 1:
        raise ConfigError(f"keep_last must be >= 1, got {keep_last}")
    snap = snapshot.state
    training = snapshot.training if isinstance(snapshot, GRPOSnapshot) else None
    algo = snapshot.algo
    if snap.adam is None:
        raise ConfigError(
            f"tenant {snap.tenant!r}: a checkpoint needs the optimizer state; take the "
            "snapshot from the device"
        )
    adam = snap.adam
    extra_dict = dict(extra or {})
    try:
        state = {
            "format": FORMAT,
            "tenant": snap.tenant,
            "version": snap.version,
            "optimizer_step": adam.step,
            "lora": snap.lora.model_dump(mode="json"),
            "algo": algo.model_dump(mode="json"),
            "temperature": training.temperature if training else 1.0,
            "warmup_steps": training.warmup_steps if training else 0,
            "constant_norm_tokens": training.constant_norm_tokens if training else None,
            "extra": extra_dict,
        }
        state_text = json.dumps(state, indent=2, sort_keys=True, allow_nan=False) + "\n"
    except (TypeError, ValueError) as e:
        raise ConfigError(f"checkpoint extra must be JSON-serialisable: {e}") from e

    base = Path(root)
    base.mkdir(parents=True, exist_ok=True)
    _remove_leftovers(base)
    final = base / checkpoint_name(snap.version)
    tmp = base / f"{_TMP_PREFIX}{uuid.uuid4().hex}"
    tmp.mkdir()
    try:
        save_peft(tmp / ADAPTER_DIR, snap.lora, snap.tensors, fan_in_fan_out=fan_in_fan_out)
        save_file(
            {
                "exp_avg": adam.exp_avg_P.detach().cpu().contiguous(),
                "exp_avg_sq": adam.exp_avg_sq_P.detach().cpu().contiguous(),
            },
            str(tmp / OPTIMIZER_NAME),
        )
        (tmp / STATE_NAME).write_text(state_text, encoding="utf-8")
        for path in (*(tmp / ADAPTER_DIR).iterdir(), tmp / OPTIMIZER_NAME, tmp / STATE_NAME):
            _fsync(path)
        _fsync(tmp / ADAPTER_DIR)
        _fsync(tmp)
        if final.exists():  # re-saving a version: move the old one out of sight first
            os.replace(final, base / f"{_TRASH_PREFIX}{uuid.uuid4().hex}")
        os.replace(tmp, final)
        _fsync(base)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for old in list_checkpoints(base)[:-keep_last]:
        trash = base / f"{_TRASH_PREFIX}{uuid.uuid4().hex}"
        os.replace(old, trash)
        shutil.rmtree(trash, ignore_errors=True)
    _remove_leftovers(base)
    return final


def load_checkpoint(path: str | Path, model: LoRAModel) -> Checkpoint:
    """Read a checkpoint directory written by `save_checkpoint`, for `model`."""
    root = Path(path)
    try:
        state: dict[str, Any] = json.loads((root / STATE_NAME).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ModelError(f"{str(root)!r} is not a readable tenant checkpoint: {e}") from e
    if state.get("format") != FORMAT:
        raise ModelError(f"{str(root)!r} has format {state.get('format')!r}, expected {FORMAT!r}")
    lora = LoRASpec.model_validate(state["lora"])
    peft_spec, tensors = load_peft(root / ADAPTER_DIR, model)
    if (peft_spec.rank, peft_spec.alpha, peft_spec.target_modules) != (
        lora.rank,
        lora.alpha,
        model.resolve(lora).target_modules,
    ):
        raise ModelError(f"{str(root)!r}: the adapter does not match the recorded LoRA spec")
    try:
        flat = load_file(str(root / OPTIMIZER_NAME))
    except (OSError, ValueError, RuntimeError) as e:
        raise ModelError(f"cannot read {str(root / OPTIMIZER_NAME)!r}: {e}") from e
    tenant = TenantSnapshot(
        tenant=str(state["tenant"]),
        lora=lora,
        version=int(state["version"]),
        tensors=tensors,
        adam=AdamState(
            step=int(state["optimizer_step"]),
            exp_avg_P=flat["exp_avg"],
            exp_avg_sq_P=flat["exp_avg_sq"],
        ),
    )
    snapshot: GRPOSnapshot | SFTSnapshot
    if state["algo"].get("type") == "sft":
        snapshot = SFTSnapshot(tenant, SFTSpec.model_validate(state["algo"]))
    else:
        snapshot = GRPOSnapshot(
            tenant,
            GRPOTraining(
                algo=GRPOSpec.model_validate(state["algo"]),
                temperature=float(state["temperature"]),
                warmup_steps=int(state["warmup_steps"]),
                constant_norm_tokens=state["constant_norm_tokens"],
            ),
        )
    return Checkpoint(path=root, snapshot=snapshot, extra=dict(state["extra"]))


def checkpoint_extra(path: str | Path) -> dict[str, Any]:
    """The `extra` of the checkpoint at `path` alone (no tensors read); `ModelError`
    where it is not a readable checkpoint."""
    root = Path(path)
    try:
        state = json.loads((root / STATE_NAME).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ModelError(f"{str(root)!r} is not a readable tenant checkpoint: {e}") from e
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ModelError(f"{str(root)!r} is not a {FORMAT!r} checkpoint")
    extra = state.get("extra")
    return dict(extra) if isinstance(extra, dict) else {}


def _remove_leftovers(base: Path) -> None:
    """Delete temporary and trash directories of earlier (possibly crashed) saves."""
    for p in base.iterdir():
        if p.name.startswith((_TMP_PREFIX, _TRASH_PREFIX)):
            shutil.rmtree(p, ignore_errors=True)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
