"""Pydantic specs for jobs, tasks, graders, LoRA and algorithms.

Importable without torch: the service validates specs without loading a model.
"""

from marlaas.config.specs import (
    AlgorithmSpec,
    GRPOSpec,
    LoRASpec,
    SamplingSpec,
    TaskSpec,
)

__all__ = ["AlgorithmSpec", "GRPOSpec", "LoRASpec", "SamplingSpec", "TaskSpec"]
