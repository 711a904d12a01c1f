"""Native CPU kernels for the few steps torch has no fused kernel for, built on first use.

- `span_attention` is the engine's attention over the slot cache, each query token over
  its own span of columns (`span_attention.c`): a decode step's one token per row, one
  pass over the row's own keys and values shared by the query heads of a group; a
  prefill chunk's tokens, each over its causal span, the row's keys and values in cache
  for all its tokens. torch on the CPU runs a decode step as two batched matmuls of
  `rows x kv heads` tiny matrices, whose per-matrix overhead, not the bytes, sets their
  time (~1 ms each per layer at 256 rows and ~90 columns), and a prefill as SDPA's
  masked product over every column of the chunk (~8 ms a layer for 16 prompts of 192
  tokens).
- `lora_rows` adds the LoRA update of rows that each use their own adapter (a decode
  batch of many tenants) in place, reading every lane's weights where they lie
  (`lora_rows.c`). torch's way is a gather of the rows into per-lane pieces, two
  batched matmuls of `lanes` tiny matrices (`[rows per lane, in] x [in, r]`), a scatter
  back and an add: five ops per layer whose per-matrix overhead again sets the time.
- `add_rms_norm` adds a residual and takes the RMS norm of the sum in one pass per
  token (`rms_norm.c`): torch's `rms_norm` on the CPU is six ops, plus the add.
- `rope_store` applies the rotary embedding to a forward's new queries (in place) and
  keys and writes the keys and values into their cache columns (`rope_store.c`): about
  a dozen element-wise ops, a transpose and two indexed copies per layer in torch.

Build: each C source is compiled with the system's C compiler (`cc`, or `$CC`) into a
shared library in the user's cache (`$XDG_CACHE_HOME/marlaas/kernels`, else a private
temporary folder; named by a hash of the source and flags, so a changed source builds
again), written to a temporary
name and renamed, so concurrent processes never load a half-written file. It takes
well under a second. Where there is no compiler, or the build or load fails, or
`MARLAAS_NATIVE_KERNELS=0`, the kernels decline (None or False, logged once) and callers
keep torch's path: the kernels change speed, never results beyond float rounding.

Only float32 CPU tensors whose last axis is contiguous are taken; anything else is
None too. The kernel runs in the calling thread (one core, as the engine's default).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "add_rms_norm",
    "lora_rows",
    "native_kernels",
    "rope_store",
    "span_attention",
    "torch_path",
    "torch_path_on",
]

_log = logging.getLogger(__name__)
#: Vectorised exp (glibc's libmvec) needs -ffast-math when compiling; linking stays
#: plain, so the library does not switch the process's float mode (crtfastmath).
_COMPILE = ["-O3", "-march=native", "-ffast-math", "-fPIC", "-std=c11"]
_LINK = ["-shared", "-lmvec", "-lm"]
_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p
_F32 = ctypes.c_float
#: The largest rank `lora_rows` takes (its per-token buffer in `lora_rows.c`).
LORA_ROWS_MAX_RANK = 64
#: Every kernel: its source's stem (`<stem>.c`), its function and the function's
#: argument types, in the order of the C signature.
_KERNELS: dict[str, tuple[str, list[type]]] = {
    "span_attention": (
        "span_attention_f32",
        [
            *(_I64, _I64, _I64, _I64, _I64),
            *(_PTR, _I64, _I64, _I64, _PTR, _PTR),
            *(_I64, _I64, _I64),
            *(_PTR, _PTR, _F32, _F32, _PTR, _PTR),
        ],
    ),
    "lora_rows": (
        "lora_rows_f32",
        [
            *(_I64, _I64, _I64, _I64, _I64),
            *(_PTR, _PTR),
            *(_PTR, _I64, _I64),
            *(_PTR, _I64, _I64, _I64),
            *(_PTR, _PTR, _PTR, _PTR),
        ],
    ),
    "rms_norm": ("add_rms_norm_f32", [_I64, _I64, _PTR, _PTR, _PTR, _F32, _PTR]),
    "rope_store": (
        "rope_store_f32",
        [
            *(_I64, _I64, _I64, _I64, _I64),
            *(_PTR, _I64, _PTR, _I64, _PTR, _I64, _PTR, _PTR),
            *(_PTR, _PTR, _I64, _I64, _I64),
            *(_PTR, _PTR),
        ],
    ),
}


def _kernel_dir() -> Path:
    """The user cache's kernel folder, else (a read-only home) a private temporary one."""
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    folder = Path(root) / "marlaas" / "kernels"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if not os.access(folder, os.W_OK):
            raise PermissionError(folder)
    except OSError:
        folder = Path(tempfile.gettempdir()) / f"marlaas-kernels-{os.getuid()}"
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    return folder


def _cpu() -> str:
    """What `-march=native` compiles for: the machine and its CPU's feature flags."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return platform.machine() + " " + flags.strip()


def _source(stem: str) -> Path:
    return Path(__file__).with_name(f"{stem}.c")


def _build(source: Path, cc: str) -> Path:
    """The shared library of `source`, compiled unless the cache has it."""
    # -march=native: a cache shared by machines of other CPUs must not hand them this one.
    digest = hashlib.sha256(
        source.read_bytes() + " ".join([cc, *_COMPILE, *_LINK, _cpu()]).encode()
    ).hexdigest()[:16]
    target = _kernel_dir() / f"{source.stem}-{digest}.so"
    if target.exists():
        return target
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        obj, lib = Path(tmp) / "kernel.o", Path(tmp) / "kernel.so"
        for argv in (
            [cc, *_COMPILE, "-c", str(source), "-o", str(obj)],
            [cc, str(obj), "-o", str(lib), *_LINK],
        ):
            subprocess.run(argv, check=True, capture_output=True, timeout=120)
        os.replace(lib, target)
    return target


@functools.cache
def _library(stem: str) -> Any:
    """Kernel `stem`'s C function, built and loaded on first use; None where it cannot
    be (see the module doc)."""
    if os.environ.get("MARLAAS_NATIVE_KERNELS", "1") == "0":
        return None
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        _log.warning("no C compiler: the native kernels are off, torch's path is used")
        return None
    name, argtypes = _KERNELS[stem]
    try:
        lib = ctypes.CDLL(str(_build(_source(stem), cc)))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        _log.warning(
            "could not build the native kernel %s (%s %s); torch's path is used",
            stem,
            exc,
            detail.decode(errors="replace")[-500:],
        )
        return None
    fn = getattr(lib, name)
    fn.restype = None
    fn.argtypes = argtypes
    return fn


_switched_off = 0


@contextlib.contextmanager
def torch_path() -> Iterator[None]:
    """Every kernel declines inside the block (the whole process): how the benchmarks
    time torch's path against the kernels in one run (`marlaas bench roofline`)."""
    global _switched_off
    _switched_off += 1
    try:
        yield
    finally:
        _switched_off -= 1


def torch_path_on() -> bool:
    """Whether a `torch_path()` block is active (the fast paths built on the kernels,
    such as the engine's compact decoder, step aside too)."""
    return _switched_off > 0


def _kernel(stem: str) -> Any:
    return None if _switched_off else _library(stem)


def native_kernels(*stems: str) -> bool:
    """Whether the named native kernels (every one when none is named) are built and
    loaded in this process."""
    return all(_library(stem) is not None for stem in stems or _KERNELS)


def span_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    start_Q: Tensor,
    end_Q: Tensor,
    widest: int,
    scale: float,
    softcap: float | None,
) -> Tensor | None:
    """Attention of `query [R, H, N, D]` (N tokens per cache row) where query token `n`
    of row `r`, `q = r * N + n`, attends columns `[start_Q[q], end_Q[q])` of row `r` of
    `key`/`value [R, Hkv, S, D]`; `[R, N, H, D]`, or None where the kernel does not
    apply (see the module doc). `start_Q`/`end_Q` are contiguous int64 CPU tensors of
    `R * N` entries with `0 <= start < end <= S`; `widest` is the largest `end - start`
    (0: some query attends no column, which the kernel does not take)."""
    kernel = _kernel("span_attention")
    R, H, N, D = query.shape
    Hkv = int(key.shape[1])
    if (
        kernel is None
        or widest < 1
        or widest > int(key.shape[2])
        or H % Hkv
        or not (query.is_cpu and key.is_cpu and value.is_cpu)
        or not (query.dtype == key.dtype == value.dtype == torch.float32)
        or key.stride() != value.stride()
        or key.stride(-1) != 1
        or query.stride(-1) != 1
        or start_Q.dtype != torch.int64
        or int(start_Q.shape[0]) != R * N
        or not (start_Q.is_contiguous() and end_Q.is_contiguous())
    ):
        return None
    out = torch.empty((R, N, H, D), dtype=torch.float32)
    scratch = torch.empty((H // Hkv) * widest, dtype=torch.float32)
    kernel(
        R,
        N,
        H,
        Hkv,
        D,
        query.data_ptr(),
        query.stride(0),
        query.stride(1),
        query.stride(2),
        key.data_ptr(),
        value.data_ptr(),
        key.stride(0),
        key.stride(1),
        key.stride(2),
        start_Q.data_ptr(),
        end_Q.data_ptr(),
        float(scale),
        float(softcap or 0.0),
        out.data_ptr(),
        scratch.data_ptr(),
    )
    return out


def lora_rows(
    x_NTi: Tensor,
    y_NTo: Tensor,
    A_Lri: Tensor,
    B_Lor: Tensor,
    lane_N: Tensor,
    order_N: Tensor,
    scale_L: Tensor | None,
) -> bool:
    """Add `scale_L[l] * (x A_L[l]^T) B_L[l]^T` to the `T` tokens of every row `n` of
    `y_NTo [N, T, out]`, `l = lane_N[n]`, in place; False (nothing written) where the
    kernel does not apply (see the module doc). `order_N` is the rows sorted by lane
    (any order is exact; sorted, each lane's `B` is prepared once); `scale_L` None: the
    weights carry their scales. `x_NTi` and `y_NTo` must be contiguous, `B_Lor` either
    contiguous along `r` (PEFT's layout) or along `out` (rank-major, read in place),
    `lane_N` and `order_N` contiguous int64 with lanes in `[0, L)`; ranks up to
    `LORA_ROWS_MAX_RANK`."""
    kernel = _kernel("lora_rows")
    N, T, fan_in = x_NTi.shape
    L, r, _ = A_Lri.shape
    fan_out = int(y_NTo.shape[-1])
    if (
        kernel is None
        or not (x_NTi.is_cpu and y_NTo.is_cpu and A_Lri.is_cpu and B_Lor.is_cpu)
        or not (x_NTi.dtype == y_NTo.dtype == A_Lri.dtype == B_Lor.dtype == torch.float32)
        or not (x_NTi.is_contiguous() and y_NTo.is_contiguous())
        or r > LORA_ROWS_MAX_RANK
        or A_Lri.stride(-1) != 1
        or 1 not in (B_Lor.stride(1), B_Lor.stride(2))
        or tuple(B_Lor.shape) != (L, fan_out, r)
        or tuple(y_NTo.shape[:2]) != (N, T)
        or lane_N.dtype != torch.int64
        or not (lane_N.is_contiguous() and order_N.is_contiguous())
        or (scale_L is not None and (scale_L.dtype != torch.float32 or not scale_L.is_contiguous()))
    ):
        return False
    # B rank-major (`out` contiguous, the adapter bank's layout) is read in place, with
    # no scratch (a per-call allocation fewer on the engine's path).
    scratch = None if B_Lor.stride(1) == 1 else torch.empty(r * fan_out, dtype=torch.float32)
    kernel(
        N,
        T,
        fan_in,
        fan_out,
        r,
        x_NTi.data_ptr(),
        y_NTo.data_ptr(),
        A_Lri.data_ptr(),
        A_Lri.stride(0),
        A_Lri.stride(1),
        B_Lor.data_ptr(),
        B_Lor.stride(0),
        B_Lor.stride(1),
        B_Lor.stride(2),
        lane_N.data_ptr(),
        order_N.data_ptr(),
        0 if scale_L is None else scale_L.data_ptr(),
        0 if scratch is None else scratch.data_ptr(),
    )
    return True


def rope_store(
    q_THD: Tensor,
    k_THD: Tensor,
    v_THD: Tensor,
    cos_TR: Tensor,
    sin_TR: Tensor,
    keys: Tensor,
    values: Tensor,
    row_T: Tensor,
    col_T: Tensor,
) -> bool:
    """Rotate the queries `q_THD` in place and write the rotated keys `k_THD` and the
    values `v_THD` of token `t` into cache row `row_T[t]`, column `col_T[t]` of `keys` /
    `values [rows, Hkv, S, D]`; False (nothing written) where the kernel does not apply
    (see the module doc). The rotation is Hugging Face's `x * cos + rotate_half(x) * sin`
    on the first `rot` features (`cos_TR`/`sin_TR [T, rot]`, contiguous, `rot` even and
    at most `D`). Queries, keys and values have their heads and features contiguous (any
    token stride); `row_T`/`col_T` are contiguous int64 and inside the buffers (the
    caller's guarantee: the kernel writes there unchecked)."""
    kernel = _kernel("rope_store")
    T, H, D = q_THD.shape
    Hkv = int(k_THD.shape[1])
    rot = int(cos_TR.shape[-1])
    tensors = (q_THD, k_THD, v_THD, cos_TR, sin_TR, keys, values)
    if (
        kernel is None
        or not all(t.is_cpu and t.dtype == torch.float32 for t in tensors)
        or any(t.stride(-1) != 1 or t.stride(-2) != D for t in (q_THD, k_THD, v_THD))
        or tuple(v_THD.shape) != tuple(k_THD.shape)
        or int(k_THD.shape[0]) != T
        or int(keys.shape[1]) != Hkv
        or int(keys.shape[-1]) != D
        or keys.stride() != values.stride()
        or keys.stride(-1) != 1
        or rot % 2
        or rot > D
        or tuple(cos_TR.shape) != (T, rot)
        or not (cos_TR.is_contiguous() and sin_TR.is_contiguous())
        or not all(t.dtype == torch.int64 and t.is_contiguous() for t in (row_T, col_T))
        or int(row_T.shape[0]) != T
        or int(col_T.shape[0]) != T
    ):
        return False
    kernel(
        T,
        H,
        Hkv,
        D,
        rot,
        q_THD.data_ptr(),
        q_THD.stride(0),
        k_THD.data_ptr(),
        k_THD.stride(0),
        v_THD.data_ptr(),
        v_THD.stride(0),
        cos_TR.data_ptr(),
        sin_TR.data_ptr(),
        keys.data_ptr(),
        values.data_ptr(),
        keys.stride(0),
        keys.stride(1),
        keys.stride(2),
        row_T.data_ptr(),
        col_T.data_ptr(),
    )
    return True


def add_rms_norm(
    h_TE: Tensor, delta_TE: Tensor | None, weight_E: Tensor, eps: float
) -> Tensor | None:
    """`h_TE += delta_TE` in place (when given), then `weight_E * h / sqrt(mean(h^2) +
    eps)` per token as a new tensor (Llama's RMS norm); None (nothing written) where the
    kernel does not apply (see the module doc): float32 CPU tensors, contiguous."""
    kernel = _kernel("rms_norm")
    T, E = h_TE.shape
    if (
        kernel is None
        or not (h_TE.is_cpu and weight_E.is_cpu and h_TE.dtype == weight_E.dtype == torch.float32)
        or not (h_TE.is_contiguous() and weight_E.is_contiguous())
        or tuple(weight_E.shape) != (E,)
        or (
            delta_TE is not None
            and (
                not delta_TE.is_cpu
                or delta_TE.dtype != torch.float32
                or not delta_TE.is_contiguous()
                or tuple(delta_TE.shape) != (T, E)
            )
        )
    ):
        return None
    out = torch.empty((T, E), dtype=torch.float32)
    kernel(
        T,
        E,
        h_TE.data_ptr(),
        0 if delta_TE is None else delta_TE.data_ptr(),
        weight_E.data_ptr(),
        float(eps),
        out.data_ptr(),
    )
    return out
