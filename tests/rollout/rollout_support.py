"""Helpers shared by the rollout tests (a plain module: `conftest` names clash across
test folders). Specs of the test tenants, random adapters, merging into a plain base,
comparing completions."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from marlaas.config.specs import LoRASpec
from marlaas.model.lora import AdapterTensors, LoRAModel
from marlaas.types import Completion

MAX_POSITIONS = 64
SPEC = LoRASpec(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj", "o_proj", "up_proj"))
BASE_SPEC = LoRASpec(rank=0, target_modules=("q_proj",))


def random_adapter(model: LoRAModel, seed: int, spec: LoRASpec = SPEC) -> AdapterTensors:
    """An adapter with non-zero A and B, large enough to change greedy outputs."""
    g = torch.Generator().manual_seed(seed)
    out: AdapterTensors = {}
    for path in model.module_paths(spec):
        fan_in, fan_out = model.module_shapes[path]
        A = torch.randn(spec.rank, fan_in, generator=g) * 0.3
        B = torch.randn(fan_out, spec.rank, generator=g) * 0.3
        out[path] = (A, B)
    return out


def merged(base: PreTrainedModel, tensors: AdapterTensors, spec: LoRASpec) -> PreTrainedModel:
    """`base` with `W + scale * B @ A` merged into every adapted linear (in place)."""
    with torch.no_grad():
        for path, (A, B) in tensors.items():
            linear = base.get_submodule(path)
            assert isinstance(linear, torch.nn.Linear)
            linear.weight += spec.scaling * (B @ A)
    return base


def assert_same_completion(got: Completion, want: Completion) -> None:
    """The same tokens, and log-probs equal up to float noise."""
    assert got.token_ids == want.token_ids
    torch.testing.assert_close(
        torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=1e-5, rtol=0
    )
