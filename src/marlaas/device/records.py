"""The device port's own records (the training calls' records are `train.records`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class DeviceFigures:
    """Counters over the device's life.

    Busy time is the time inside engine iterations (decode) and training passes,
    optimizer steps and publication (train); `busy_fraction` is busy time over elapsed
    time and accelerators (1 in-process; the trainer and every replica on Ray).
    `train_passes` counts multi-lane forward/backward passes, `pass_tenants` the tenants
    they held in all and `max_pass_tenants` the most one held; `forward_passes` counts
    passes without gradient. Per tenant: tokens sampled (`tokens_by_tenant`) and
    sampling requests waiting for the engine (`waiting_by_tenant`).
    """

    elapsed_s: float
    busy_s: float
    busy_decode_s: float
    busy_train_s: float
    idle_s: float
    busy_fraction: float
    decode_steps: int
    tokens_sampled: int
    train_passes: int
    pass_tenants: int
    max_pass_tenants: int
    forward_passes: int
    optim_steps: int
    prefill_tokens: int
    shared_prefill_tokens: int
    rows_running: int
    tokens_by_tenant: Mapping[str, int] = field(default_factory=dict)
    waiting_by_tenant: Mapping[str, int] = field(default_factory=dict)

    @property
    def mean_decode_batch(self) -> float:
        """Tokens sampled per decode iteration: how full the engine's batches were."""
        return self.tokens_sampled / self.decode_steps if self.decode_steps else 0.0

    @property
    def mean_pass_tenants(self) -> float:
        """Tenants per forward/backward pass: how much training was shared."""
        return self.pass_tenants / self.train_passes if self.train_passes else 0.0
