"""Where a run's stages live: the one place that chooses between the in-process device
and the Ray one, above the pipeline. The command line, the service and the benchmarks
pass `open_backend` to the pipeline (`run_jobs`, `PipelineRuntime.start`), which only
ever sees the device port and the environment pool it returns.

`open_backend` reads the spec's `backend`: "inprocess" builds the device in this process
(`marlaas.device.inprocess`) and an `EnvPool` on the event loop; "ray" joins Ray on the
calling thread (Ray ties the processes it starts to the thread that called `ray.init`)
and builds the actors (`marlaas.distributed`, imported only then).
"""

from __future__ import annotations

from marlaas.config.job import PipelineSpec
from marlaas.device.config import DeviceConfig
from marlaas.device.inprocess import open_inprocess_device
from marlaas.obs.recorder import Recorder
from marlaas.pipeline.context import Backend, PipelineOptions
from marlaas.pipeline.envpool import EnvPool


async def open_backend(
    spec: PipelineSpec, *, options: PipelineOptions, recorder: Recorder
) -> Backend:
    """The backend `spec.backend` names, ready (a `BackendOpener`)."""
    if spec.backend == "ray":  # the optional extra: imported only when asked for
        from marlaas.distributed import open_ray_backend

        return await open_ray_backend(spec, options=options, recorder=recorder)
    return await open_inprocess_backend(spec, options=options, recorder=recorder)


async def open_inprocess_backend(
    spec: PipelineSpec, *, options: PipelineOptions, recorder: Recorder
) -> Backend:
    """The device in this process and an environment pool on the event loop."""
    device = await open_inprocess_device(
        DeviceConfig.for_pipeline(spec, torch_device=options.device), recorder=recorder
    )
    return Backend(device, EnvPool(options.env_concurrency, options.env_timeout_s, recorder))
