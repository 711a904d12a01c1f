"""Building and loading the native kernels (see `marlaas.model.kernels`): the registry of
C functions, the compiler run, the per-user cache, and the switch to torch's path."""

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
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

_log = logging.getLogger(__name__)
#: Vectorised exp (glibc's libmvec) needs -ffast-math when compiling; linking stays
#: plain, so the library does not switch the process's float mode (crtfastmath).
_COMPILE = ["-O3", "-march=native", "-ffast-math", "-fPIC", "-std=c11"]
_LINK = ["-shared", "-lmvec", "-lm"]
_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p
_F32 = ctypes.c_float
#: Every kernel: the stem of its C source (`<stem>.c`), its function and the
#: function's argument types, in the order of the C signature.
KERNELS: dict[str, tuple[str, str, list[type]]] = {
    "span_attention": (
        "span_attention",
        "span_attention_f32",
        [
            *(_I64, _I64, _I64, _I64, _I64),
            *(_PTR, _I64, _I64, _I64, _PTR, _PTR),
            *(_I64, _I64, _I64),
            *(_PTR, _PTR, _F32, _F32, _PTR, _PTR, _PTR),
            _I64,
        ],
    ),
    "span_attention_backward": (
        "span_attention",
        "span_attention_backward_f32",
        [
            *(_I64, _I64, _I64, _I64, _I64),
            *(_PTR, _I64, _I64, _I64, _PTR, _PTR),
            *(_I64, _I64, _I64),
            *(_PTR, _PTR, _F32),
            *(_PTR, _PTR, _PTR, _PTR, _PTR, _PTR),
        ],
    ),
    "span_tiles": (
        "span_tiles",
        "span_tiles_f32",
        [
            *(_I64, _I64, _I64, _I64, _I64),
            *(_PTR, _I64, _I64, _I64, _PTR, _PTR),
            *(_I64, _I64, _I64),
            *(_PTR, _PTR, _F32, _F32, _PTR, _PTR, _PTR),
            _I64,
        ],
    ),
    "span_tiles_backward": (
        "span_tiles_backward",
        "span_tiles_backward_f32",
        [
            *(_I64, _I64, _I64, _I64, _I64),
            *(_PTR, _I64, _I64, _I64, _PTR, _PTR),
            *(_I64, _I64, _I64),
            *(_PTR, _PTR, _F32),
            *(_PTR, _PTR, _PTR, _PTR, _PTR, _PTR),
        ],
    ),
    "lora_rows": (
        "lora_rows",
        "lora_rows_f32",
        [
            *(_I64, _I64, _I64, _I64, _I64),
            *(_PTR, _PTR),
            *(_PTR, _I64, _I64),
            *(_PTR, _I64, _I64, _I64),
            *(_PTR, _PTR, _PTR, _PTR),
        ],
    ),
    "lora_rows_backward": (
        "lora_rows",
        "lora_rows_backward_f32",
        [
            *(_I64, _I64, _I64, _I64, _I64),
            *(_PTR, _PTR, _PTR),
            *(_PTR, _I64, _I64),
            *(_PTR, _I64, _I64, _I64),
            *(_PTR, _PTR, _PTR),
            *(_PTR, _PTR, _PTR, _I64),
        ],
    ),
    # (the trainer's layers call it from C; exported for its tests)
    "lora_rows_backward_strided": (
        "lora_rows",
        "lora_rows_backward_strided_f32",
        [
            *(_I64, _I64, _I64, _I64, _I64),
            *(_PTR, _PTR, _I64, _PTR),
            *(_PTR, _I64, _I64),
            *(_PTR, _I64, _I64, _I64),
            *(_PTR, _PTR, _PTR),
            *(_PTR, _PTR, _PTR, _I64, _PTR, _PTR),
        ],
    ),
    "lora_gather_grads": (
        "lora_rows",
        "lora_gather_grads_f32",
        [_I64, _PTR, _I64, _PTR, _I64],
    ),
    "add_rms_norm": ("rms_norm", "add_rms_norm_f32", [_I64, _I64, _PTR, _PTR, _PTR, _F32, _PTR]),
    "rms_norm_backward": (
        "rms_norm",
        "rms_norm_backward_f32",
        [_I64, _I64, _PTR, _PTR, _PTR, _F32, _PTR, _PTR],
    ),
    "copy_rows": (
        "copy_rows",
        "copy_rows_f32",
        [*(_I64, _I64, _I64, _I64, _I64, _I64, _I64), *(_PTR, _PTR, _PTR)],
    ),
    "sample_rows": (
        "sample_rows",
        "sample_rows_f32",
        [_I64, _I64, _PTR, _I64, _PTR, _PTR, _PTR, _PTR, _PTR, _I64],
    ),
    "half_linear_rows": (
        "half_linear",
        "half_linear_rows_f32",
        [_I64, _I64, _I64, _PTR, _PTR, _PTR, _PTR, _PTR],
    ),
    "half_pack": ("half_linear", "half_pack_f32", [_I64, _I64, _PTR, _PTR]),
    "linear_f32_rows": (
        "linear_f32",
        "linear_f32_rows",
        [_I64, _I64, _I64, _PTR, _PTR, _PTR, _PTR],
    ),
    "linear_f32_pack": ("linear_f32", "linear_f32_pack", [_I64, _I64, _PTR, _I64, _I64, _PTR]),
    "adamw_clipped": ("adamw", "adamw_clipped_f32", [_I64, _PTR, _PTR, _PTR]),
    "swiglu": ("fused", "swiglu_f32", [_I64, _PTR, _PTR, _PTR]),
    "entropy_rows": ("fused", "entropy_rows_f32", [_I64, _I64, _PTR, _PTR, _PTR]),
    "swiglu_backward": ("fused", "swiglu_backward_f32", [_I64, _PTR, _PTR, _PTR, _PTR, _PTR]),
    "rotary": ("fused", "rotary_f32", [_I64, _I64, _I64, _PTR, _PTR, _PTR, _PTR, _I64]),
    "rope_store": (
        "rope_store",
        "rope_store_f32",
        [
            *(_I64, _I64, _I64, _I64, _I64),
            *(_PTR, _I64, _PTR, _I64, _PTR, _I64, _PTR, _PTR),
            *(_PTR, _PTR, _I64, _I64, _I64),
            *(_PTR, _PTR, _I64),
        ],
    ),
    "decoder_layers": ("decoder_layers", "decoder_layers_f32", [_PTR, _PTR]),
    "fma_peak_f32": ("fma_peak", "fma_peak_f32", [_I64, _PTR]),
    "fma_peak_bf16": ("fma_peak", "fma_peak_bf16", [_I64, _PTR]),
    "fma_peak_amx_bf16": ("fma_peak", "fma_peak_amx_bf16", [_I64, _PTR]),
    "train_layers": ("train_layers", "train_layers_f32", [_PTR, _PTR]),
    "train_layers_backward": ("train_layers", "train_layers_backward_f32", [_PTR, _PTR]),
}
#: Libraries that link other kernels' sources with their own (a stem's functions called
#: from another's C): the stem -> the other stems.
LINKED: dict[str, tuple[str, ...]] = {
    "span_tiles": ("span_attention",),
    "span_tiles_backward": ("span_attention",),
    "decoder_layers": (
        "rms_norm",
        "half_linear",
        "lora_rows",
        "rope_store",
        "span_attention",
        "fused",
    ),
    "train_layers": (
        "rms_norm",
        "half_linear",
        "lora_rows",
        "rope_store",
        "span_attention",
        "span_tiles",
        "span_tiles_backward",
        "fused",
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


def _digest(*parts: bytes) -> str:
    return hashlib.sha256(b"".join(parts)).hexdigest()[:16]


def _object(source: Path, cc: str) -> Path:
    """`source` compiled to an object in the cache unless it has it (keyed on the source,
    the headers beside it that sources include, the flags and the CPU): a source linked
    into several libraries (`LINKED`) is compiled once."""
    # -march=native: a cache shared by machines of other CPUs must not hand them this one.
    headers = b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))
    flags = " ".join([cc, *_COMPILE, _cpu()]).encode()
    target = _kernel_dir() / f"{source.stem}-{_digest(source.read_bytes(), headers, flags)}.o"
    if not target.exists():
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            obj = Path(tmp) / "kernel.o"
            argv = [cc, *_COMPILE, "-c", str(source), "-o", str(obj)]
            subprocess.run(argv, check=True, capture_output=True, timeout=120)
            os.replace(obj, target)
    return target


def _build(source: Path, cc: str, linked: Sequence[Path] = ()) -> Path:
    """The shared library of `source` (linked with the `linked` sources), built from
    their cached objects (`_object`) unless the cache has it."""
    objects = [_object(s, cc) for s in (source, *linked)]
    names = " ".join([cc, *_LINK, *(o.name for o in objects)]).encode()
    target = _kernel_dir() / f"{source.stem}-{_digest(names)}.so"
    if target.exists():
        return target
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        lib = Path(tmp) / "kernel.so"
        argv = [cc, *map(str, objects), "-o", str(lib), *_LINK]
        subprocess.run(argv, check=True, capture_output=True, timeout=120)
        os.replace(lib, target)
    return target


@functools.cache
def _library(name: str) -> Any:
    """Kernel `name`'s C function, built and loaded on first use; None where it cannot
    be (see `marlaas.model.kernels`)."""
    if os.environ.get("MARLAAS_NATIVE_KERNELS", "1") == "0":
        return None
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        _log.warning("no C compiler: the native kernels are off, torch's path is used")
        return None
    stem, function, argtypes = KERNELS[name]
    try:
        linked = [_source(s) for s in LINKED.get(stem, ())]
        lib = ctypes.CDLL(str(_build(_source(stem), cc, linked)))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        _log.warning(
            "could not build the native kernel %s (%s %s); torch's path is used",
            stem,
            exc,
            detail.decode(errors="replace")[-500:],
        )
        return None
    fn = getattr(lib, function)
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


def kernel(name: str) -> Any:
    """Kernel `name`'s C function, or None (not built here, or inside `torch_path()`)."""
    return None if _switched_off else _library(name)


#: Per thread: what a long native call runs inside (`set_away`), if anything.
_away = threading.local()


def set_away(away: AbstractContextManager[object] | None) -> None:
    """Run this thread's long native calls (`long_call`) inside `away` (entered once per
    call): the device thread leaves the interpreter to the event loop there
    (`marlaas.device.turns`); None: nothing around them."""
    _away.cm = away


def long_call(fn: Callable[..., object], *args: object) -> None:
    """`fn(*args)`: a native call of milliseconds (a forward's or a pass's layers),
    inside this thread's `set_away` context where it has one."""
    away = getattr(_away, "cm", None)
    if away is None:
        fn(*args)
        return
    with away:
        fn(*args)


def native_kernels(*names: str) -> bool:
    """Whether the named native kernels (every one when none is named) are built and
    loaded in this process."""
    return all(_library(name) is not None for name in names or KERNELS)
