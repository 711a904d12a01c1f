"""The Tinker-compatible training API: the unmodified `tinker` SDK (Thinking Machines',
0.38) trains and samples against `marlaas serve`, every tenant's calls batched together
on the shared device.

Point the SDK at the server (`TINKER_BASE_URL=http://127.0.0.1:8321`) with a tenant's
`tml-` key (`TINKER_API_KEY`). A training client is a trainable tenant of the device
port (`marlaas.device.port`); `forward_backward` calls of different clients pending at
once run in one multi-lane pass, `optim_step` publishes the next adapter version, and
sampling goes to the shared continuous-batching engine. Training runs and saved
weights (`tinker://RUN/weights/NAME`, `tinker://RUN/sampler_weights/NAME`) are rows of
the service's database; sampler weights are PEFT directories, downloadable and
callable through the OpenAI-compatible routes by their path.

Modules: `wire` (the SDK's JSON shapes), `protobuf` (its protobuf bodies), `convert`
(wire -> marlaas records), `futures`, `sequence` (per-model `seq_id` order),
`sessions`, `samplers`, `store` and `state_io` (what survives a restart), `hub` (the
state of one app), `training` and `sampling` (the calls), `routes` and `rest` (HTTP).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fastapi import FastAPI

    from marlaas.service.context import ServiceContext
    from marlaas.service.tinker.hub import SharedDevice, TinkerHub


def install(app: FastAPI, ctx: ServiceContext) -> TinkerHub:
    """Add the Tinker routes to `app` and return their hub (the app's lifespan starts
    and closes it). The device is the job backend's when it shares one
    (`hub.DeviceSource`), else an in-process device of the hub's own, opened on first
    use over `settings.serve_base_model` (default: the embedded base)."""
    from marlaas.service.tinker import rest, routes
    from marlaas.service.tinker.hub import DeviceSource, TinkerHub
    from marlaas.service.tinker.metrics import TinkerMetrics

    async def open_device() -> tuple[SharedDevice, bool]:
        backend = ctx.backend
        if isinstance(backend, DeviceSource):
            shared = await backend.shared_device()
            if shared is not None:
                return shared, False
        return await _own_device(ctx), True

    hub = TinkerHub(ctx.db, ctx.settings.artifact_dir, open_device)
    app.state.tinker = hub
    ctx.registry.register(TinkerMetrics(hub))
    app.include_router(routes.router)
    app.include_router(rest.router)
    return hub


async def _own_device(ctx: ServiceContext) -> SharedDevice:
    """The hub's own device, sized and placed as the service's settings size a job
    backend's (`ServiceSettings.pipeline_spec`: engine rows, LoRA rank, trainer budget,
    dtype; `serve_device`), keeping the device's default window of versions (Tinker
    samplers are saved weights, not versions of a run)."""
    from marlaas.device.config import DeviceConfig
    from marlaas.device.inprocess import open_inprocess_device
    from marlaas.model.base import default_base_path
    from marlaas.service.tinker.hub import SharedDevice

    settings = ctx.settings
    spec = settings.pipeline_spec()
    base = str((settings.serve_base_model or default_base_path()).resolve())
    config = DeviceConfig(
        base_model=base,
        dtype=spec.dtype,
        engine=spec.engine,
        trainer=spec.trainer,
        torch_device=settings.serve_device,
    )
    return SharedDevice(await open_inprocess_device(config), base)
