"""The Ray runtime backend: the pipeline's engine, trainer and environment workers as
Ray actors placed by resources, behind the interfaces the orchestrator already drives.

Only this package imports Ray (`pip install 'marlaas[ray]'`). Entry point:
`build_ray_context(run, out_dir, options, ray_spec=RaySpec(...))` (the spec lives in
`marlaas.config.ray`, importable without Ray) returns a
`PipelineContext`; see `ray_backend` for the mapping, `engine_client`,
`trainer_client` and `envs` for the fault handling, `cluster` for placement.

Exports load lazily: an environment worker imports `env_worker` without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from marlaas.distributed.cluster import connect
    from marlaas.distributed.engine_client import RayEngineClient
    from marlaas.distributed.envs import RayEnvPool
    from marlaas.distributed.executor import RayExecutor
    from marlaas.distributed.ray_backend import RayBank, build_ray_context
    from marlaas.distributed.trainer_client import RayTrainerClient

_EXPORTS = {
    "RayBank": "ray_backend",
    "build_ray_context": "ray_backend",
    "connect": "cluster",
    "RayEngineClient": "engine_client",
    "RayEnvPool": "envs",
    "RayExecutor": "executor",
    "RayTrainerClient": "trainer_client",
}

__all__ = [
    "RayBank",
    "RayEngineClient",
    "RayEnvPool",
    "RayExecutor",
    "RayTrainerClient",
    "build_ray_context",
    "connect",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        return getattr(importlib.import_module(f"{__name__}.{module}"), name)
    except ImportError as e:
        if e.name == "ray" or (e.name or "").startswith("ray."):
            raise ImportError(
                "the Ray backend needs Ray: install it with `pip install 'marlaas[ray]'`"
            ) from e
        raise
