"""The Tinker hub's own device (`--backend none`) is sized and placed by the service's
settings, as a job backend's device is: engine rows, LoRA rank, trainer budget, dtype."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import torch

from marlaas.device.compute import LocalCompute
from marlaas.device.device import ExecutorDevice
from marlaas.service.settings import ServiceSettings
from marlaas.service.tinker import _own_device


def test_own_device_follows_the_service_settings(tmp_path: Path) -> None:
    settings = ServiceSettings(
        data_dir=tmp_path,
        max_batch_rows=8,
        max_lora_rank=4,
        max_tokens_per_microbatch=512,
        serve_device="cpu",
        serve_dtype="bfloat16",
    )

    async def main() -> None:
        shared = await _own_device(SimpleNamespace(settings=settings))  # type: ignore[arg-type]
        port = shared.port
        try:
            assert isinstance(port, ExecutorDevice)
            compute = port.compute
            assert isinstance(compute, LocalCompute)
            assert compute.gate.capacity == 8
            assert compute.trainer.max_tokens_per_microbatch == 512
            assert compute.model.max_rank == 4
            # On the CPU bfloat16 is the linear layers' weights (`marlaas.model.mixed`).
            assert compute.model.base.model.layers[0].mlp.up_proj.base_layer.weight.dtype == (
                torch.bfloat16
            )
        finally:
            await port.close()

    asyncio.run(main())
