"""A pipeline is opened from its one spec: the backend builds the device the spec's
window of versions needs, a device with fewer is refused, and the engine settings that
moved to the spec are named where they now live."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from marlaas.backends import open_backend
from marlaas.config.job import EngineSpec, PipelineSpec
from marlaas.config.specs import LoRASpec
from marlaas.device.config import DeviceConfig
from marlaas.device.executor import ExecutorClosed
from marlaas.device.inprocess import open_inprocess_device
from marlaas.errors import ConfigError
from marlaas.obs.recorder import NullRecorder, Recorder
from marlaas.pipeline.context import Backend, PipelineContext, PipelineOptions
from marlaas.pipeline.envpool import EnvPool

CPU = PipelineOptions(device="cpu")


def spec(base: Path, max_staleness: int) -> PipelineSpec:
    return PipelineSpec(
        base_model=str(base),
        max_staleness=max_staleness,
        engine=EngineSpec(max_batch_size=4, max_rank=4, max_prefill_tokens=64, seed=7),
    )


def test_the_device_config_of_a_pipeline_comes_from_its_spec(tmp_path: Path) -> None:
    pipeline = spec(tmp_path, max_staleness=3)
    config = DeviceConfig.for_pipeline(pipeline, torch_device="cpu")
    assert config.versions_kept == pipeline.versions_kept == 5
    assert config.engine.max_prefill_tokens == 64 and config.engine.seed == 7
    assert (config.base_model, config.torch_device) == (str(tmp_path), "cpu")


@pytest.mark.parametrize(
    ("old", "new"),
    [("max_prefill_tokens", "engine.max_prefill_tokens"), ("engine_seed", "engine.seed")],
)
def test_engine_settings_moved_off_the_options_are_named_where_they_are(old: str, new: str) -> None:
    with pytest.raises(ValidationError, match=f"{old} is now {new}"):
        PipelineOptions.model_validate({old: 1})


async def test_the_opened_device_keeps_the_spec_window(tiny_dir: Path, tmp_path: Path) -> None:
    pipeline = spec(tiny_dir, max_staleness=2)
    ctx = await PipelineContext.open(
        pipeline, tmp_path, backend=open_backend, recorder=NullRecorder(), options=CPU
    )
    try:
        assert ctx.device.versions_kept == pipeline.versions_kept == 4
    finally:
        await ctx.backend.close()


async def test_a_backend_whose_device_keeps_too_few_versions_is_refused(
    tiny_dir: Path, tmp_path: Path
) -> None:
    opened: list[Backend] = []

    async def too_small(
        spec: PipelineSpec, *, options: PipelineOptions, recorder: Recorder
    ) -> Backend:
        config = DeviceConfig.for_pipeline(spec, torch_device="cpu")
        device = await open_inprocess_device(
            DeviceConfig(base_model=config.base_model, engine=config.engine, versions_kept=2)
        )
        opened.append(Backend(device, EnvPool(4, 10.0, recorder)))
        return opened[-1]

    with pytest.raises(ConfigError, match="keeps 2 versions per tenant, the spec needs 4"):
        await PipelineContext.open(
            spec(tiny_dir, max_staleness=2), tmp_path, backend=too_small, recorder=NullRecorder()
        )
    assert len(opened) == 1
    with pytest.raises(ExecutorClosed):  # the refused backend was closed
        await opened[0].device.add_tenant("t", LoRASpec(rank=4))
