"""The in-process device: the base, the adapter bank, the rollout engine and the
multi-lane trainer in this process, driven by one device thread (`device.executor`),
behind the port (`ExecutorDevice`).

The engine and the trainer share the base's weights (one copy per process); the thread
interleaves engine iterations with training passes and optimizer steps, and publishes
each new version to the bank before the step's result is delivered.
"""

from __future__ import annotations

import asyncio

from transformers import PreTrainedTokenizerBase

from marlaas.device.compute import LocalCompute
from marlaas.device.config import DeviceConfig, resolve_device
from marlaas.device.device import ExecutorDevice
from marlaas.device.gate import RequestGate
from marlaas.model.bank import AdapterBank
from marlaas.model.base import load_base
from marlaas.model.lora import LoRAModel
from marlaas.obs.recorder import Recorder
from marlaas.rollout.engine import RolloutEngine
from marlaas.train.trainer import MultiLaneTrainer


def build_local_compute(config: DeviceConfig) -> tuple[LocalCompute, PreTrainedTokenizerBase]:
    """Load the base and build the compute over it (blocking)."""
    base, tokenizer = load_base(
        config.base_path, dtype=config.dtype, device=resolve_device(config.torch_device)
    )
    model = LoRAModel(base, max_rank=config.engine.max_rank)
    bank = AdapterBank(
        model, num_slots=config.engine.adapter_slots, versions_kept=config.versions_kept
    )
    engine = RolloutEngine(
        model,
        bank,
        tokenizer,
        max_batch_size=config.engine.max_batch_size,
        max_prefill_tokens=config.engine.max_prefill_tokens,
        background=False,
        seed=config.engine.seed,
    )
    trainer = MultiLaneTrainer(
        model, max_tokens_per_microbatch=config.trainer.max_tokens_per_microbatch
    )
    gate = RequestGate(engine, capacity=config.engine.max_batch_size)
    return LocalCompute(model, bank, engine, trainer, gate), tokenizer


async def open_inprocess_device(
    config: DeviceConfig, *, recorder: Recorder | None = None
) -> ExecutorDevice:
    """A ready in-process device (loads the base in a worker thread, then starts the
    device thread on the calling loop)."""
    compute, tokenizer = await asyncio.to_thread(build_local_compute, config)
    return ExecutorDevice.start(
        compute,
        model=compute.model,
        tokenizer=tokenizer,
        base_name=str(config.base_path),
        versions_kept=config.versions_kept,
        recorder=recorder,
    )
