"""What a device is built from, whichever backend builds it (`inprocess`, or the Ray
backend): the base, the engine's and trainer's sizes, how many versions the sampler
keeps, and the torch device."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from marlaas.config.job import EngineSpec, PipelineSpec, TrainerSpec
from marlaas.config.specs import ModelDType
from marlaas.errors import ConfigError
from marlaas.model.base import default_base_path


@dataclass(frozen=True)
class DeviceConfig:
    """A device's sizes. `base_model=None` is the embedded base, `dtype` its weights'
    (`PipelineSpec.dtype`); `versions_kept` is the sampler's window of versions per
    tenant (a pipeline's is `PipelineSpec.versions_kept`: `for_pipeline`);
    `torch_device` "auto" is cuda when available."""

    base_model: str | None = None
    dtype: ModelDType = "auto"
    engine: EngineSpec = field(default_factory=EngineSpec)
    trainer: TrainerSpec = field(default_factory=TrainerSpec)
    versions_kept: int = 2
    torch_device: str = "auto"

    @classmethod
    def for_pipeline(cls, spec: PipelineSpec, *, torch_device: str = "auto") -> DeviceConfig:
        """The device a pipeline built from `spec` needs."""
        return cls(
            base_model=spec.base_model,
            dtype=spec.dtype,
            engine=spec.engine,
            trainer=spec.trainer,
            versions_kept=spec.versions_kept,
            torch_device=torch_device,
        )

    def __post_init__(self) -> None:
        if self.versions_kept < 1:
            raise ConfigError(f"versions_kept must be >= 1, got {self.versions_kept}")

    @property
    def base_path(self) -> Path:
        return Path(self.base_model) if self.base_model else default_base_path()


def resolve_device(device: str) -> str:
    """A torch device name: "auto" is cuda when available, else cpu."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device
