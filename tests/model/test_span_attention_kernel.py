"""The native span attention (`marlaas.model.kernels`) equals plain attention over each
query's own columns, for decode steps and prefill chunks (grouped heads, windows,
soft-capping, padding queries, strided cache and query views), and declines what it
does not take."""

from __future__ import annotations

import ctypes
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

from marlaas.model import kernels
from marlaas.model.attention import AttentionPlan, slot_attention
from marlaas.model.kernels import Spans, build


def reference(
    q: Tensor, k: Tensor, v: Tensor, pos_RN: Tensor, window: int | None, softcap: float | None
) -> Tensor:
    """`[R, N, H, D]`: each query token over its own columns (a padding query, position
    -1, over column 0, as its mask), in float64."""
    R, H, N, D = q.shape
    G = H // k.shape[1]
    out = torch.zeros(R, N, H, D, dtype=torch.float64)
    for b in range(R):
        for n in range(N):
            end = max(int(pos_RN[b, n]) + 1, 1)
            start = 0 if window is None or pos_RN[b, n] < 0 else max(0, end - window)
            for h in range(H):
                keys = k[b, h // G, start:end].double()
                s = keys @ q[b, h, n].double() * D**-0.5
                if softcap is not None:
                    s = torch.tanh(s / softcap) * softcap
                out[b, n, h] = torch.softmax(s, 0) @ v[b, h // G, start:end].double()
    return out


def test_the_kernel_builds_where_there_is_a_compiler() -> None:
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler on this machine")
    assert kernels.native_kernels()


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "window", "softcap"),
    [
        (4, 2, 32, None, None),
        (4, 4, 64, None, None),
        (8, 2, 24, 5, None),  # a head size without a specialised loop, a sliding window
        (2, 1, 128, None, 30.0),
        (6, 3, 32, 7, 20.0),
        # Groups off a power of two, past the eight heads the values' pass takes at once,
        # past the sixteen a block of scores takes.
        (6, 2, 64, 3, None),
        (12, 1, 32, None, None),
        (32, 1, 16, None, None),
    ],
)
def test_equals_attention_over_each_rows_own_columns(
    heads: int, kv_heads: int, dim: int, window: int | None, softcap: float | None
) -> None:
    assert kernels.native_kernels()
    g = torch.Generator().manual_seed(heads * 100 + dim)
    R, cap = 9, 40
    pos_R = torch.tensor([0, 1, 3, 11, 20, 31, 5, 17, 2])
    columns = int(pos_R.max()) + 1
    # Views of a bigger cache buffer, as the slot cache hands them over.
    k = torch.randn(R + 2, kv_heads, cap, dim, generator=g)[1 : R + 1, :, :columns]
    v = torch.randn(R + 2, kv_heads, cap, dim, generator=g)[1 : R + 1, :, :columns]
    q = torch.randn(R, heads, 1, dim, generator=g)
    plan = AttentionPlan.build(pos_R[:, None], columns, [window])
    out = kernels.span_attention(q, k, v, plan.span(window), dim**-0.5, softcap)
    assert out is not None
    want = reference(q, k, v, pos_R[:, None], window, softcap)
    torch.testing.assert_close(out.double(), want, atol=2e-6, rtol=1e-5)
    # And slot_attention, which routes decode queries to it, gives the same.
    got = slot_attention(q, k, v, plan, scaling=dim**-0.5, softcap=softcap, window=window)
    torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "window", "softcap"),
    [(4, 2, 32, None, None), (8, 2, 24, 3, None), (2, 1, 64, None, 30.0), (9, 3, 32, None, None)],
)
def test_a_prefill_chunk_attends_each_tokens_causal_span(
    heads: int, kv_heads: int, dim: int, window: int | None, softcap: float | None
) -> None:
    g = torch.Generator().manual_seed(heads * 10 + dim)
    N, cap = 5, 24
    # A left-padded prompt, a full one, and a continued turn's chunk after 9 cached tokens.
    pos_RN = torch.tensor([[-1, -1, 0, 1, 2], [0, 1, 2, 3, 4], [9, 10, 11, 12, 13]])
    R, columns = int(pos_RN.shape[0]), int(pos_RN.max()) + 1
    k = torch.randn(R, kv_heads, cap, dim, generator=g)[:, :, :columns]
    v = torch.randn(R, kv_heads, cap, dim, generator=g)[:, :, :columns]
    q = torch.randn(R, N, heads, dim, generator=g).transpose(1, 2)  # as the HF modules pass it
    plan = AttentionPlan.build(pos_RN, columns, [window])
    out = kernels.span_attention(q, k, v, plan.span(window), dim**-0.5, softcap)
    assert out is not None
    want = reference(q, k, v, pos_RN, window, softcap)
    torch.testing.assert_close(out.double(), want, atol=2e-6, rtol=1e-5)
    got = slot_attention(q, k, v, plan, scaling=dim**-0.5, softcap=softcap, window=window)
    torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize(("N", "dim"), [(1, 32), (1, 24), (4, 64)])
def test_a_bfloat16_cache_reads_as_its_values_widened(N: int, dim: int) -> None:
    """Keys and values in bfloat16 (`LoRAModel.kv_dtype`): the float32 kernel's output
    over those values widened, decode and prefill, with and without the vector loops (a
    head size off the vector width)."""
    g = torch.Generator().manual_seed(N * 100 + dim)
    R, cap = 6, 48
    pos_RN = torch.tensor([[3, 17, 33, 40, 0, 25]]).T + torch.arange(N)
    columns = int(pos_RN.max()) + 1
    k = torch.randn(R + 1, 2, cap, dim, generator=g).bfloat16()[1:, :, :columns]
    v = torch.randn(R + 1, 2, cap, dim, generator=g).bfloat16()[1:, :, :columns]
    q = torch.randn(R, 4, N, dim, generator=g)
    spans = AttentionPlan.build(pos_RN, columns, [None]).span(None)
    got = kernels.span_attention(q, k, v, spans, dim**-0.5, None)
    want = kernels.span_attention(q, k.float(), v.float(), spans, dim**-0.5, None)
    assert got is not None and want is not None
    # Up to float rounding: the two dtypes' loops are compiled apart, and may associate
    # their sums differently.
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(
        got.double(), reference(q, k, v, pos_RN, None, None), atol=2e-6, rtol=1e-5
    )
    # slot_attention takes the half cache on torch's ops too (widened first).
    plan = AttentionPlan.build(pos_RN, columns, [None])
    with kernels.torch_path():
        plain = slot_attention(q, k, v, plan, scaling=dim**-0.5)
    torch.testing.assert_close(plain, want, atol=2e-6, rtol=1e-5)


def test_declines_what_it_does_not_take() -> None:
    q, k = torch.randn(2, 2, 1, 8), torch.randn(2, 1, 4, 8)
    start, end = torch.tensor([0, 0]), torch.tensor([2, 4])
    assert kernels.span_attention(q, k, k, Spans(start, end, 4), 1.0, None) is not None
    assert (
        kernels.span_attention(q.double(), k.double(), k.double(), Spans(start, end, 4), 1.0, None)
        is None
    )
    assert (
        kernels.span_attention(
            q.bfloat16(), k.bfloat16(), k.bfloat16(), Spans(start, end, 4), 1.0, None
        )
        is None
    )
    half = k.bfloat16()
    assert kernels.span_attention_lse(q, half, half, Spans(start, end, 4), 1.0) is None
    assert (
        kernels.span_attention(q, k.bfloat16(), k, Spans(start, end, 4), 1.0, None) is None
    )  # keys and values of two dtypes
    assert (
        kernels.span_attention(q, k, k, Spans(start, end, 0), 1.0, None) is None
    )  # a row of no column
    assert (
        kernels.span_attention(q, k, k, Spans(start, end, 5), 1.0, None) is None
    )  # past the columns
    # Spans for another number of queries than the query holds.
    assert (
        kernels.span_attention(torch.randn(2, 2, 3, 8), k, k, Spans(start, end, 4), 1.0, None)
        is None
    )
    assert (
        kernels.span_attention(
            q, k.transpose(2, 3).contiguous().transpose(2, 3), k, Spans(start, end, 4), 1.0, None
        )
        is None
    )


def test_switched_off_it_declines_everything(no_native_kernels: None) -> None:
    q, k = torch.randn(2, 2, 1, 8), torch.randn(2, 1, 4, 8)
    assert not kernels.native_kernels()
    out = kernels.span_attention(
        q, k, k, Spans(torch.tensor([0, 0]), torch.tensor([2, 4]), 4), 1.0, None
    )
    assert out is None


def test_builds_in_a_temporary_folder_without_a_writable_cache(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    readonly = tmp_path / "cache"
    readonly.mkdir(mode=0o500)
    monkeypatch.setenv("XDG_CACHE_HOME", str(readonly / "sub"))
    monkeypatch.setattr(build.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    if os.geteuid() == 0:  # root writes anywhere: make the cache a file instead
        readonly.chmod(0o700)
        (readonly / "sub").write_text("not a folder")
    built = build._build(build._source("span_attention"), shutil.which("cc") or "gcc")
    assert built.parent == tmp_path / "tmp" / f"marlaas-kernels-{os.getuid()}"
    assert built.exists()


def _sources(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, files: dict[str, str]) -> Path:
    """A folder of `files` (name -> text) to build, with a kernel cache of the test's own."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    folder = tmp_path / "src"
    folder.mkdir()
    for name, text in files.items():
        (folder / name).write_text(text)
    return folder


def test_a_changed_shared_header_builds_again(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The cache keys on the headers beside a source (`simd.h`), not the source alone: a
    source that includes a changed header is compiled again."""
    files = {"k.c": '#include "v.h"\nint k(void) { return V; }\n', "v.h": "#define V 1\n"}
    folder = _sources(monkeypatch, tmp_path, files)
    cc = shutil.which("cc") or "gcc"
    first = build._build(folder / "k.c", cc)
    assert build._build(folder / "k.c", cc) == first  # cached
    (folder / "v.h").write_text("#define V 2\n")
    second = build._build(folder / "k.c", cc)
    assert second != first and second.exists()


def test_a_source_linked_into_two_libraries_compiles_once(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Objects are cached per source: a library that links another kernel's source
    (`build.LINKED`) and that kernel's own library share its object."""
    files = {
        "a.c": "int b(void);\nint a(void) { return b() + 1; }\n",
        "b.c": "int b(void) { return 41; }\n",
    }
    folder = _sources(monkeypatch, tmp_path, files)
    cc = shutil.which("cc") or "gcc"
    runs: list[list[str]] = []
    run = build.subprocess.run

    def spy(argv: list[str], **kwargs: Any) -> Any:
        runs.append(argv)
        return run(argv, **kwargs)

    monkeypatch.setattr(build.subprocess, "run", spy)
    lib_a = build._build(folder / "a.c", cc, [folder / "b.c"])
    lib_b = build._build(folder / "b.c", cc)
    assert len([argv for argv in runs if "-c" in argv]) == 2  # a.c and b.c, once each
    assert ctypes.CDLL(str(lib_a)).a() == 42
    assert ctypes.CDLL(str(lib_b)).b() == 41
