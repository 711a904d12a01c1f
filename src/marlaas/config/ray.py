"""Knobs of the Ray backend: where it connects, how many actors of each role it starts,
and the resources each role asks Ray for. Pure data (no Ray, no torch import).

Placement is by resources only: a role's actors go to nodes that offer its `num_cpus`,
`num_gpus` and custom `resources`. Start the nodes with matching custom resources
(`ray start --resources '{"engine": 1}'`) to pin roles to machines.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from pydantic import Field, ValidationError

from marlaas.config.specs import Spec, describe_problems, read_yaml
from marlaas.errors import ConfigError

#: What to tell someone who asked for the Ray backend without Ray installed.
RAY_INSTALL_HINT = "the Ray backend needs Ray: install it with `pip install 'marlaas[ray]'`"


class ActorResources(Spec):
    """What one actor of a role asks Ray for."""

    num_cpus: float = Field(1.0, ge=0, description="Logical CPUs reserved per actor.")
    num_gpus: float | None = Field(
        None,
        ge=0,
        description="GPUs per actor; None: 1 for engine replicas and the trainer when the "
        "cluster has GPUs, else 0 (environment workers never get one by default).",
    )
    resources: dict[str, float] = Field(
        default_factory=dict,
        description="Custom resources per actor, e.g. {'engine': 1}: the actor only runs on "
        "nodes started with them.",
    )


class RaySpec(Spec):
    """How the Ray backend connects and places its actors."""

    address: str | None = Field(
        None,
        description="Ray cluster to join ('auto' or 'host:port'); None: start a private "
        "single-node Ray bound to 127.0.0.1. Ignored when Ray is already initialised.",
    )
    engine_replicas: int = Field(2, ge=1, le=1024, description="Rollout engine replicas.")
    env_workers: int = Field(2, ge=1, le=4096, description="Environment worker actors.")
    engine: ActorResources = Field(default_factory=ActorResources)
    trainer: ActorResources = Field(default_factory=ActorResources)
    env: ActorResources = Field(default_factory=ActorResources)
    max_restarts: int = Field(
        3,
        ge=0,
        description="Restarts Ray grants a dead engine replica or environment worker.",
    )
    request_retries: int = Field(
        3,
        ge=0,
        description="Times one generation request is re-sent after its replica died.",
    )
    torch_threads: int | None = Field(
        None, ge=1, description="torch threads in each model actor; None: torch's default."
    )
    num_cpus: int | None = Field(
        None, ge=1, description="CPUs of a private local Ray (address=None); None: all."
    )
    object_store_mb: int | None = Field(
        None, ge=64, description="Object store of a private local Ray; None: Ray's default."
    )


def load_ray_spec(path: str | Path) -> RaySpec:
    """Read and validate a Ray spec file (YAML or JSON mapping of `RaySpec` fields; an
    empty file is all defaults). `ConfigError` names the file and the field at fault."""
    source = Path(path)
    raw = read_yaml(source, "the Ray spec ")
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(
            f"{source}: expected a mapping of Ray spec fields (engine_replicas, env_workers, "
            "address, ...) at the top level"
        )
    try:
        return RaySpec.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(f"{source}: invalid Ray spec: {describe_problems(e)}") from e


def check_ray_installed() -> None:
    """Raise `ConfigError` (with the install command) unless Ray can be imported."""
    try:
        importlib.import_module("ray")
    except ImportError as e:
        raise ConfigError(f"{RAY_INSTALL_HINT} ({e})") from e
