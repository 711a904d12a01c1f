"""The tiled span attention (`span_tiles.c`) equals the per-query kernels
(`span_attention.c`) up to float rounding: the forward's output and log-sum-exp, the
backward's query, key and value gradients (the last two added to what the buffers held),
over the trainer's spans (a suffix pass with padding queries, a left-padded prefix pass,
the pass's tokens as one row), sliding windows and arbitrary spans, grouped heads, spans
past one chunk of columns, unaligned buffers; and it hands what it does not tile to them
unchanged."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import Tensor

from marlaas.model.kernels import build
from marlaas.model.kernels.build import kernel as load

KERNELS = ("span_attention", "span_attention_backward", "span_tiles", "span_tiles_backward")


@pytest.fixture(autouse=True)
def _built() -> None:
    if any(load(name) is None for name in KERNELS):
        pytest.skip("the native kernels are not built here")


def _unaligned(shape: tuple[int, ...], g: torch.Generator | None = None) -> Tensor:
    """A float32 tensor of `shape` one float past an aligned address (random where `g`
    is given, else zeros): the kernels must not assume 64-byte alignment."""
    n = 1
    for s in shape:
        n *= s
    flat = torch.randn(n + 1, generator=g) if g is not None else torch.zeros(n + 1)
    return flat[1:].view(shape)


def _spans(kind: str, R: int, N: int, S: int, g: torch.Generator) -> tuple[Tensor, Tensor]:
    """Each query's columns `[start, end)` (`R * N`, row-major) of one of the shapes."""
    start_RN = torch.empty(R, N, dtype=torch.int64)
    end_RN = torch.empty(R, N, dtype=torch.int64)
    for r in range(R):
        if kind == "suffix":  # past columns, then valid tokens from a start, then padding
            past = S - N
            valid = int(torch.randint(N // 3, N + 1, (1,), generator=g))
            first = int(torch.randint(0, min(4, past) + 1, (1,), generator=g))
            for t in range(N):
                end_RN[r, t] = past + t + 1
                start_RN[r, t] = first if t < valid else past + t
        elif kind == "prefix":  # left padding: tokens before `first` attend their own column
            first = int(torch.randint(0, N // 2 + 1, (1,), generator=g))
            for t in range(N):
                end_RN[r, t] = S - N + t + 1
                start_RN[r, t] = first if t >= first else S - N + t
        elif kind == "window":
            for t in range(N):
                end_RN[r, t] = S - N + t + 1
                start_RN[r, t] = max(0, int(end_RN[r, t]) - 7)
        else:  # arbitrary spans
            end = torch.randint(1, S + 1, (N,), generator=g)
            start_RN[r] = (torch.rand(N, generator=g) * end).long()
            end_RN[r] = end
    return start_RN.reshape(-1).contiguous(), end_RN.reshape(-1).contiguous()


@dataclass
class Case:
    """Queries, keys and values in a layout the kernels take, and each query's span."""

    R: int
    N: int
    H: int
    Hkv: int
    D: int
    q: Tensor
    q_strides: tuple[int, int, int]
    k: Tensor
    v: Tensor
    kv_strides: tuple[int, int, int]
    start: Tensor
    end: Tensor

    @property
    def queries(self) -> int:
        return self.R * self.N

    def leading(self) -> tuple[Any, ...]:
        return (
            self.R,
            self.N,
            self.H,
            self.Hkv,
            self.D,
            self.q.data_ptr(),
            *self.q_strides,
            self.k.data_ptr(),
            self.v.data_ptr(),
            *self.kv_strides,
            self.start.data_ptr(),
            self.end.data_ptr(),
        )


def rows_case(kind: str, R: int, N: int, H: int, Hkv: int, D: int, S: int, seed: int) -> Case:
    """The rows layout: queries `[R, N, H, D]`, keys and values `[R, Hkv, S, D]`."""
    g = torch.Generator().manual_seed(seed)
    start, end = _spans(kind, R, N, S, g)
    q = _unaligned((R, N, H, D), g)
    k, v = _unaligned((R, Hkv, S, D), g), _unaligned((R, Hkv, S, D), g)
    return Case(
        R, N, H, Hkv, D, q, (N * H * D, D, H * D), k, v, (Hkv * S * D, S * D, D), start, end
    )


def one_row_case(R: int, N: int, H: int, Hkv: int, D: int, S: int, seed: int) -> Case:
    """train_layers.c's layout: the valid tokens of R rows as one row of T queries inside
    the fused q/k/v product `[T, (H + 2 Hkv) D]`, keys and values `[Hkv, R, S, D]`, each
    token's span a run of its own row's columns."""
    g = torch.Generator().manual_seed(seed)
    start, end = _spans("suffix", R, N, S, g)
    row = torch.arange(R).repeat_interleave(N)
    valid = end - start > 1  # no padding queries
    start, end = (start + row * S)[valid].contiguous(), (end + row * S)[valid].contiguous()
    T, C = int(valid.sum()), (H + 2 * Hkv) * D
    qkv = _unaligned((T, C), g)
    k, v = _unaligned((Hkv, R, S, D), g), _unaligned((Hkv, R, S, D), g)
    return Case(1, T, H, Hkv, D, qkv, (0, D, C), k, v, (0, R * S * D, D), start, end)


def forward(case: Case, name: str, with_lse: bool = True) -> tuple[Tensor, Tensor]:
    """`out [queries, H, D]` and `lse [queries, H]` of kernel `name` (scale D^-0.5)."""
    out = _unaligned((case.queries, case.H, case.D))
    lse = _unaligned((case.queries, case.H))
    widest = int((case.end - case.start).max())
    scratch = torch.empty((case.H // case.Hkv) * widest)
    load(name)(
        *case.leading(),
        case.D**-0.5,
        0.0,
        out.data_ptr(),
        lse.data_ptr() if with_lse else 0,
        scratch.data_ptr(),
        0,
    )
    return out, lse


def backward(case: Case, name: str, out: Tensor, lse: Tensor, seed: int) -> list[Tensor]:
    """`dq`, and `dk`, `dv` added to the same random values for every kernel."""
    g = torch.Generator().manual_seed(seed + 1)
    dout = _unaligned(tuple(out.shape), g)
    dq = _unaligned(tuple(out.shape))
    if case.k.is_contiguous():
        dk, dv = _unaligned(tuple(case.k.shape), g), _unaligned(tuple(case.v.shape), g)
    else:  # the gradients take the keys' strides
        shape, strides = case.k.shape, case.k.stride()
        dk = torch.empty_strided(shape, strides).copy_(torch.randn(shape, generator=g))
        dv = torch.empty_strided(shape, strides).copy_(torch.randn(shape, generator=g))
    load(name)(
        *case.leading(),
        case.D**-0.5,
        out.data_ptr(),
        dout.data_ptr(),
        lse.data_ptr(),
        dq.data_ptr(),
        dk.data_ptr(),
        dv.data_ptr(),
    )
    return [dq, dk, dv]


def assert_tiles_equal_per_query(case: Case, seed: int) -> None:
    out, lse = forward(case, "span_tiles")
    want_out, want_lse = forward(case, "span_attention")
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-6)
    # Both backwards from the per-query forward's output, so that they differ only in
    # their own rounding.
    got = backward(case, "span_tiles_backward", want_out, want_lse, seed)
    want = backward(case, "span_attention_backward", want_out, want_lse, seed)
    for name, a, b in zip(("dq", "dk", "dv"), got, want, strict=True):
        error = float((a - b).norm() / b.norm())
        assert error < 1e-5, f"{name}: relative error {error:.2e}"


@pytest.mark.parametrize(
    ("kind", "R", "N", "H", "Hkv", "D", "S"),
    [
        ("suffix", 9, 24, 4, 2, 32, 40),  # the trainer's suffix pass, smaller
        ("prefix", 7, 16, 4, 2, 32, 16),  # its left-padded prefix pass
        ("suffix", 5, 24, 2, 2, 64, 40),  # G 1, head size 64
        ("suffix", 5, 12, 8, 2, 32, 30),  # G 4
        ("prefix", 4, 10, 16, 2, 32, 10),  # G 8
        ("window", 4, 20, 4, 2, 64, 28),
        ("random", 6, 11, 4, 2, 32, 23),
        ("random", 3, 9, 4, 1, 64, 17),
        ("random", 3, 9, 3, 1, 48, 17),  # a head size and group off the specialised ones
        ("random", 2, 7, 4, 4, 128, 12),
        ("suffix", 2, 40, 4, 2, 32, 150),  # spans past one chunk of 64 columns
        ("random", 2, 30, 2, 1, 16, 200),
    ],
)
def test_tiles_equal_the_per_query_kernels(
    kind: str, R: int, N: int, H: int, Hkv: int, D: int, S: int
) -> None:
    seed = R * 1000 + N * 10 + D
    assert_tiles_equal_per_query(rows_case(kind, R, N, H, Hkv, D, S, seed), seed)


@pytest.mark.parametrize(("H", "Hkv", "D"), [(4, 2, 32), (8, 2, 64)])
def test_tiles_equal_the_per_query_kernels_over_one_row_of_tokens(H: int, Hkv: int, D: int) -> None:
    assert_tiles_equal_per_query(one_row_case(6, 24, H, Hkv, D, 40, seed=D), seed=D)


def test_the_forward_without_a_log_sum_exp_gives_the_same_output() -> None:
    case = rows_case("suffix", 3, 24, 4, 2, 32, 40, seed=5)
    out, _ = forward(case, "span_tiles", with_lse=False)
    torch.testing.assert_close(out, forward(case, "span_tiles")[0], rtol=0, atol=0)


@pytest.mark.parametrize(
    "what", ["head size 24", "group of 32", "key stride", "bfloat16", "softcap"]
)
def test_what_the_tiles_do_not_take_goes_to_the_per_query_kernels(what: str) -> None:
    """Results identical to the per-query kernels' (the same code runs)."""
    H, Hkv, D = {"head size 24": (4, 2, 24), "group of 32": (32, 1, 32)}.get(what, (4, 2, 32))
    case = rows_case("suffix", 3, 12, H, Hkv, D, 20, seed=3)
    half, softcap = 0, 0.0
    if what == "key stride":  # keys and values inside rows of D + 16
        g = torch.Generator().manual_seed(4)
        case.k = torch.randn(3, Hkv, 20, D + 16, generator=g)[..., :D]
        case.v = torch.randn(3, Hkv, 20, D + 16, generator=g)[..., :D]
        case.kv_strides = tuple(case.k.stride()[:3])  # type: ignore[assignment]
    elif what == "bfloat16":
        case.k, case.v = case.k.bfloat16(), case.v.bfloat16()
        case.kv_strides = tuple(case.k.stride()[:3])  # type: ignore[assignment]
        half = 1
    elif what == "softcap":
        softcap = 30.0
    results = []
    for name in ("span_tiles", "span_attention"):
        out, lse = _unaligned((case.queries, H, D)), _unaligned((case.queries, H))
        scratch = torch.empty((H // Hkv) * 20)
        load(name)(
            *case.leading(),
            D**-0.5,
            softcap,
            out.data_ptr(),
            lse.data_ptr(),
            scratch.data_ptr(),
            half,
        )
        results.append((out, lse))
    assert torch.equal(results[0][0], results[1][0])
    assert torch.equal(results[0][1], results[1][1])
    if half or softcap:
        return
    out, lse = results[1]
    got = backward(case, "span_tiles_backward", out, lse, seed=3)
    want = backward(case, "span_attention_backward", out, lse, seed=3)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def test_the_kernels_take_the_per_query_kernels_arguments() -> None:
    """Registered with the same ctypes argument types (a caller swaps one for the other)."""
    assert build.KERNELS["span_tiles"][2] == build.KERNELS["span_attention"][2]
    assert build.KERNELS["span_tiles_backward"][2] == build.KERNELS["span_attention_backward"][2]
