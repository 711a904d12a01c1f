"""Helpers shared by the rollout tests (a plain module: `conftest` names clash across
test folders). Specs of the test tenants, random adapters, merging into a plain base,
comparing completions."""

from __future__ import annotations

import torch
from torch import Tensor
from transformers import PreTrainedModel

from helpers.tiny_archs import tiny_model
from marlaas.config.specs import LoRASpec
from marlaas.model.bank import AdapterBank
from marlaas.model.lora import AdapterTensors, LoRAModel
from marlaas.model.mixed import half_linears
from marlaas.model.tokenizer import build_tokenizer
from marlaas.rollout.forward import RowForward
from marlaas.rollout.kv import SlotKV, kv_geometry
from marlaas.types import Completion

MAX_POSITIONS = 64
SPEC = LoRASpec(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj", "o_proj", "up_proj"))
BASE_SPEC = LoRASpec(rank=0, target_modules=("q_proj",))
VOCAB = len(build_tokenizer())
#: Every linear layer: each projection's update runs.
ALL_SPEC = LoRASpec(rank=4, alpha=8.0)


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


def decoder_model(
    arch: str, dtype: torch.dtype, spec: LoRASpec = ALL_SPEC, half: torch.dtype | None = None
) -> tuple[LoRAModel, AdapterBank]:
    """A tiny `arch` model in `dtype` (its linear layers' weights in `half`, as a half
    dtype on the CPU loads them: `mixed.half_linears` before the adapters' layers wrap
    them) and a bank of three random adapters of `spec`."""
    base = tiny_model(arch, VOCAB).to(dtype)
    if half is not None:
        half_linears(base, half)
    model = LoRAModel(base, max_rank=4)
    spec = model.resolve(spec)
    bank = AdapterBank(model, num_slots=4, dtype=torch.float32)
    for i in range(3):
        bank.register(f"t{i}", spec, tensors=random_adapter(model, 20 + i, spec))
    return model, bank


def forwards(model: LoRAModel, bank: AdapterBank) -> tuple[list[Tensor], SlotKV, list[int]]:
    """Prefill three rows (left-padded, each its own adapter), continue two of them with
    a second turn, then decode all three for three steps (`RowForward`); every
    forward's logits, the cache, and the rows' lengths."""
    kv = SlotKV(kv_geometry(model.base.config), model.kv_dtype, model.device, 4, 128)
    forward = RowForward(model, bank, kv)
    slot_R = torch.tensor([bank.acquire(f"t{i}").slot for i in range(3)])
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(4, VOCAB, (n,), generator=gen).tolist() for n in (5, 13, 9)]
    logits = [forward.prefill(0, slot_R, [0, 0, 0], prompts, 0, all_logits=True)]
    lengths = [len(p) for p in prompts]
    turn = [torch.randint(4, VOCAB, (n,), generator=gen).tolist() for n in (4, 2)]
    logits.append(forward.prefill(0, slot_R[:2], lengths[:2], turn, 0, all_logits=True))
    lengths = [lengths[0] + 4, lengths[1] + 2, lengths[2]]
    for _ in range(3):
        ids = torch.randint(4, VOCAB, (3, 1), generator=gen)
        pos = torch.tensor(lengths)[:, None]
        kv.reserve(3, max(lengths) + 1)
        logits.append(forward.rows(0, slot_R, ids, pos, max(lengths) + 1))
        lengths = [n + 1 for n in lengths]
    return logits, kv, lengths
