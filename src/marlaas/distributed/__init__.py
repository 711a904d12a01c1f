"""The Ray backend: the device port's Ray implementation (engine replicas and a trainer
as Ray actors behind `RayCompute`) and environment workers, placed by resources.

Only this package imports Ray (`pip install 'marlaas[ray]'`). Entry point:
`open_ray_backend(run, options=..., recorder=..., max_staleness=...)`, a
`BackendOpener` (`marlaas.backends.open_backend` calls it for `backend: ray`; the spec,
`run.ray`, lives in `marlaas.config.ray`, importable without Ray); see `ray_backend`
for the mapping, `compute` for the device's work on the actors, `engine_client`,
`trainer_client` and `envs` for the fault handling, `cluster` for placement.

Exports load lazily: an environment worker imports `env_worker` without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from marlaas.distributed.cluster import connect
    from marlaas.distributed.compute import RayCompute
    from marlaas.distributed.engine_client import RayEngineClient
    from marlaas.distributed.envs import RayEnvPool
    from marlaas.distributed.ray_backend import open_ray_backend
    from marlaas.distributed.trainer_client import RayTrainerClient

_EXPORTS = {
    "open_ray_backend": "ray_backend",
    "connect": "cluster",
    "RayCompute": "compute",
    "RayEngineClient": "engine_client",
    "RayEnvPool": "envs",
    "RayTrainerClient": "trainer_client",
}

__all__ = [
    "RayCompute",
    "RayEngineClient",
    "RayEnvPool",
    "RayTrainerClient",
    "connect",
    "open_ray_backend",
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
