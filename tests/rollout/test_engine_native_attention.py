"""The engine through the native kernels (decode attention, the per-row LoRA update) and
through torch's batched matmuls gives the same completions: sampled tokens and
log-probs, many rows of mixed lengths and tenants decoding together
(`marlaas.model.kernels`)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from rollout_support import assert_same_completion

from helpers.native import kernels_off
from marlaas.model import kernels
from marlaas.rollout import RolloutEngine
from marlaas.types import Completion, RolloutRequest, SamplingParams


def _requests() -> list[RolloutRequest]:
    gen = torch.Generator().manual_seed(5)
    return [
        RolloutRequest(
            tenant=f"t{i % 3}" if i % 4 else "base",
            prompt_ids=tuple(torch.randint(3, 200, (3 + 5 * i,), generator=gen).tolist()),
            sampling=SamplingParams(temperature=1.0, max_new_tokens=12 + i, seed=i),
        )
        for i in range(10)
    ]


def _generate(make_engine: Callable[..., RolloutEngine]) -> list[Completion]:
    engine = make_engine(eos_token_ids=[], background=False)
    try:
        return engine.generate(_requests())
    finally:
        engine.shutdown()


def test_completions_equal_with_and_without_the_native_kernel(
    make_engine: Callable[..., RolloutEngine],
) -> None:
    assert kernels.native_kernels()
    native = _generate(make_engine)
    with kernels_off():
        assert not kernels.native_kernels()
        plain = _generate(make_engine)
    assert len(native) == len(plain) == 10
    for got, want in zip(native, plain, strict=True):
        assert_same_completion(got, want)
