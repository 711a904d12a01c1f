"""Pydantic specs for jobs, tasks, graders, LoRA and algorithms.

Importable without torch: the service validates specs without loading a model.
"""

from marlaas.config.graders import GraderSpec, parse_grader
from marlaas.config.job import (
    DatasetSpec,
    EngineSpec,
    JobSpec,
    PipelineSpec,
    RunSpec,
    TrainerSpec,
)
from marlaas.config.specs import GRPOSpec, LoRASpec, SamplingSpec, TaskSpec

__all__ = [
    "DatasetSpec",
    "EngineSpec",
    "GRPOSpec",
    "GraderSpec",
    "JobSpec",
    "LoRASpec",
    "PipelineSpec",
    "RunSpec",
    "SamplingSpec",
    "TaskSpec",
    "TrainerSpec",
    "parse_grader",
]
