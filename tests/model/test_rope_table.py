"""The compact forwards' rotary tables (`DecoderStack.rope`): rows of a table the
rotary module computed once equal the module's own tables at those positions."""

from __future__ import annotations

import pytest
import torch

from helpers.tiny_archs import tiny_model
from marlaas.model.decoder import DecoderStack
from marlaas.model.lora import LoRAModel


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_table_rows_equal_the_modules_tables(arch: str) -> None:
    stack = DecoderStack.of(LoRAModel(tiny_model(arch, 64), max_rank=4))
    assert stack is not None
    h = torch.zeros(2, 6, 8)
    for positions in (
        torch.tensor([[0, 1, 2, 3, 4, 5], [30, 31, 32, 33, 34, 35]]),
        torch.tensor([[700, 701, 702, 703, 704, 705], [5, 5, 5, 0, 0, 0]]),  # grows it
    ):
        got, want = stack.rope(h, positions), stack.rotary(h, positions)
        for g, w in zip(got, want, strict=True):
            assert g.shape == w.shape and g.dtype == w.dtype
            torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-6)
    assert stack._rope_table is not None and stack._rope_table[0].shape[0] > 705
    # A negative position, or a scaling that depends on the positions: the module's.
    negative = torch.tensor([[-1, 0, 1, 2, 3, 4]])
    for g, w in zip(stack.rope(h[:1], negative), stack.rotary(h[:1], negative), strict=True):
        assert torch.equal(g, w)


def test_dynamic_scaling_is_left_to_the_module() -> None:
    stack = DecoderStack.of(LoRAModel(tiny_model("llama", 64), max_rank=4))
    assert stack is not None

    class Dynamic:
        """A rotary module whose scaling depends on the positions it sees."""

        rope_type = "dynamic"

        def __init__(self) -> None:
            self.calls: list[torch.Tensor] = []

        def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
            self.calls.append(positions)
            return torch.zeros(*positions.shape, 8), torch.zeros(*positions.shape, 8)

    dynamic = Dynamic()
    stack.rotary = dynamic  # type: ignore[assignment]
    positions = torch.tensor([[3, 4, 5]])
    stack.rope(torch.zeros(1, 3, 8), positions)
    assert len(dynamic.calls) == 1 and torch.equal(dynamic.calls[0], positions)
    assert stack._rope_table is None
