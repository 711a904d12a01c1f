"""This machine's limits, measured: matmul FLOP/s and memory bandwidth.

- Matmul peak at the model's own shapes: `[rows, in]` by every weight matrix of the
  model (the decoder layers' and the output head's, each as often as the model has it),
  FLOPs of that pass over its time: what a forward of `rows` tokens could reach if it
  did nothing but its matmuls. Each shape at the faster of torch's `F.linear` and the
  project's own kernel where the model's layers would run it (`_native_linear`: the
  packed float32 and bfloat16 products of `marlaas.model.mixed` on a CPU), so that no
  row's efficiency counts against a ceiling its own code outruns (torch's float32
  matmul on AMD CPUs is MKL's 256-bit one: ~120 GFLOP/s where the packed kernel runs
  ~240 at the embedded base's shapes).
- Matmul peak at a large square (`n x n` by `n x n`): the machine's best case.
- Memory bandwidth: a copy of a tensor much larger than the last-level cache, bytes
  read plus bytes written over its time.
- bfloat16: whether the hardware computes it natively (AVX512-BF16 or AMX on a CPU,
  `torch.cuda.is_bf16_supported` on a GPU) and, for a float32 run, its matmul peak at
  the model's shapes: the measurement behind the engine's dtype default (float32 on a
  CPU unless bfloat16 is measured faster).
- A model whose linear weights are of another dtype than its activations (a half dtype
  on the CPU, `marlaas.model.mixed`): the matmul peak at the model's shapes in the
  weights' dtype, the ceiling of the FLOPs of those weights (`roofline_s`'s
  `half_flops`); the attention, the LoRA updates and the head stay at the activations'.
- On a CPU, the cores' own ceiling beside the matmul peaks (`fma_roofline_s`):
  multiply-adds in registers (`kernels/fma_peak.c`), float32 and, with AVX512-BF16,
  bfloat16 (the faster of the vector dot product and, with AMX-BF16, the tile
  multiply-add: on a Sapphire Rapids-class Xeon the tiles run ~20x the vector rate), on
  as many threads as the run's. A library's matmul can stay well under it (MKL's float32
  kernels run 256-bit on AMD CPUs: on a Zen 5 machine ~120 GFLOP/s of the core's ~290),
  so the roofline reports both.

Every figure is the best of several timed repeats after a warm-up (the least disturbed
by other processes), in the thread count and dtype of the run.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import platform
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from marlaas import __version__
from marlaas.bench.cost import weight_matrices
from marlaas.model import kernels, mixed
from marlaas.model.kernels.build import kernel as load
from marlaas.model.lora import LoRAModel
from marlaas.model.mixed import native_bfloat16


@dataclass(frozen=True)
class Machine:
    """Measured limits (FLOP/s, bytes/s) and where they were measured."""

    device: str
    dtype: str
    threads: int
    #: Rows of the model-shape matmuls.
    rows: int
    model_shape_flops: float
    square_size: int
    square_flops: float
    bandwidth: float
    bf16_hardware: bool = False
    #: bfloat16 matmul FLOP/s at the model's shapes (measured in float32 runs; else 0).
    bf16_model_shape_flops: float = 0.0
    #: Matmul FLOP/s at the model's shapes in its linear weights' dtype, where that is
    #: not the activations' `dtype` (a half dtype on the CPU); else 0.
    weights_flops: float = 0.0
    weights_dtype: str | None = None
    #: The cores' multiply-add rate in registers (float32; bfloat16 where native): 0
    #: where not measured (a GPU, or kernels not built).
    fma_flops: float = 0.0
    bf16_fma_flops: float = 0.0

    @property
    def peak_flops(self) -> float:
        """The roofline's compute ceiling: the better of the two matmul peaks."""
        return max(self.model_shape_flops, self.square_flops)

    def compute_s(self, flops: float, half_flops: float = 0.0) -> float:
        """The time of `flops` at the matmul peak, `half_flops` of them (those of linear
        weights in `weights_dtype`) at that dtype's peak."""
        if not self.weights_flops:
            return flops / self.peak_flops
        return (flops - half_flops) / self.peak_flops + half_flops / self.weights_flops

    def roofline_s(self, flops: float, nbytes: float, half_flops: float = 0.0) -> float:
        """The time the work needs at this machine's limits: max(compute, memory)."""
        return max(self.compute_s(flops, half_flops), nbytes / self.bandwidth)

    def fma_roofline_s(self, flops: float, nbytes: float, half_flops: float = 0.0) -> float | None:
        """`roofline_s` with the cores' multiply-add rates for the matmul peaks (the
        half weights' FLOPs at the bfloat16 rate where they are bfloat16); None where
        they were not measured."""
        half_rate = self.bf16_fma_flops if self.weights_dtype == "bfloat16" else self.fma_flops
        if not self.fma_flops or (half_flops and not half_rate):
            return None
        compute = (flops - half_flops) / self.fma_flops + (
            half_flops / half_rate if half_flops else 0.0
        )
        return max(compute, nbytes / self.bandwidth)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"peak_flops": self.peak_flops}

    @staticmethod
    def best(a: Machine, b: Machine) -> Machine:
        """The better figures of two measurements of one machine (the less disturbed)."""
        return Machine(
            device=a.device,
            dtype=a.dtype,
            threads=a.threads,
            rows=a.rows,
            model_shape_flops=max(a.model_shape_flops, b.model_shape_flops),
            square_size=a.square_size,
            square_flops=max(a.square_flops, b.square_flops),
            bandwidth=max(a.bandwidth, b.bandwidth),
            bf16_hardware=a.bf16_hardware,
            bf16_model_shape_flops=max(a.bf16_model_shape_flops, b.bf16_model_shape_flops),
            weights_flops=max(a.weights_flops, b.weights_flops),
            weights_dtype=a.weights_dtype,
            fma_flops=max(a.fma_flops, b.fma_flops),
            bf16_fma_flops=max(a.bf16_fma_flops, b.bf16_fma_flops),
        )


def best_time(run: Callable[[], object], device: torch.device, repeats: int = 5) -> float:
    """Seconds of the fastest of `repeats` calls of `run`, after two warm-up calls."""
    for _ in range(2):
        run()
    _sync(device)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def measure_machine(
    model: LoRAModel, rows: int = 256, square: int | None = None, copy_mb: int | None = None
) -> Machine:
    """Measure matmul peaks and bandwidth on the model's device and dtype."""
    device, dtype = model.device, model.dtype
    gpu = device.type == "cuda"
    square = square or (8192 if gpu else 1024)
    copy_mb = copy_mb or (1024 if gpu else 256)
    matrices = weight_matrices(model.base)
    shapes = Counter(tuple(w.shape) for w in matrices)
    model_shape_flops = _shape_flops(shapes, rows, device, dtype)
    bf16 = 0.0
    if dtype == torch.float32:
        bf16 = _shape_flops(shapes, rows, device, torch.bfloat16)
    half = next((w.dtype for w in matrices if w.dtype != dtype), None)
    weights_flops = 0.0
    if half is not None:
        weights_flops = bf16 if half == torch.bfloat16 else _shape_flops(shapes, rows, device, half)
    a = torch.randn(square, square, device=device, dtype=dtype)
    t_square = best_time(lambda: a @ a, device, repeats=3)
    n = copy_mb * 2**20 // 4
    src = torch.ones(n, device=device, dtype=torch.float32)
    dst = torch.empty_like(src)
    t_copy = best_time(lambda: dst.copy_(src), device, repeats=5)
    return Machine(
        device=str(device),
        dtype=str(dtype).removeprefix("torch."),
        threads=torch.get_num_threads(),
        rows=rows,
        model_shape_flops=model_shape_flops,
        square_size=square,
        square_flops=2.0 * square**3 / t_square,
        bandwidth=2.0 * n * 4 / t_copy,
        bf16_hardware=native_bfloat16(device),
        bf16_model_shape_flops=bf16,
        weights_flops=weights_flops,
        weights_dtype=None if half is None else str(half).removeprefix("torch."),
        fma_flops=0.0 if gpu else fma_flops("fma_peak_f32", 32),
        bf16_fma_flops=0.0
        if gpu
        else max(
            fma_flops("fma_peak_bf16", 64),
            fma_flops("fma_peak_amx_bf16", 16 * 16 * 32 * 2, iterations=20_000),
        ),
    )


def fma_flops(name: str, per_instruction: int, iterations: int = 2_000_000) -> float:
    """FLOP/s of kernel `name` (`fma_peak.c`: `iterations` of twelve instructions, vector
    or tile, of `per_instruction` FLOPs each) on as many threads at once as torch's (the kernel
    runs in the calling thread, outside the GIL), the best of three; 0 where the kernel
    is not built or the CPU lacks the instruction."""
    kernel = load(name)
    if kernel is None:
        return 0.0
    threads = torch.get_num_threads()

    def run() -> None:
        out = ctypes.c_float(1.0)
        kernel(iterations, ctypes.addressof(out))
        if out.value < 0:
            raise _Unsupported

    best = float("inf")
    try:
        run()  # warm-up (and the check)
        with ThreadPoolExecutor(threads) as pool:
            for _ in range(3):
                start = time.perf_counter()
                for f in [pool.submit(run) for _ in range(threads)]:
                    f.result()
                best = min(best, time.perf_counter() - start)
    except _Unsupported:
        return 0.0
    return threads * iterations * 12.0 * per_instruction / best


class _Unsupported(Exception):
    """The CPU lacks the kernel's instruction (`fma_peak_bf16` without AVX512-BF16,
    `fma_peak_amx_bf16` without AMX-BF16 or the kernel's grant of the tiles)."""


def _shape_flops(
    shapes: Counter[tuple[int, ...]], rows: int, device: torch.device, dtype: torch.dtype
) -> float:
    """FLOP/s of one pass of `rows` rows through every weight matrix (with multiplicity)."""
    flops = 0.0
    seconds = 0.0
    for (fan_out, fan_in), count in shapes.items():
        x = torch.randn(rows, fan_in, device=device, dtype=dtype)
        w = torch.randn(fan_out, fan_in, device=device, dtype=dtype)
        t = best_time(functools.partial(F.linear, x, w), device, repeats=7)
        native = _native_linear(x, w)
        if native is not None:
            t = min(t, best_time(native, device, repeats=7))
        flops += count * 2.0 * rows * fan_in * fan_out
        seconds += count * t
    return flops / seconds


def _native_linear(x: Tensor, w: Tensor) -> Callable[[], object] | None:
    """The project's own product of `x` (float32 rows) by `w` where a model layer of that
    weight would run it (`marlaas.model.mixed`: the packed float32 kernel for a small
    frozen weight on an AVX-512 CPU, the packed bfloat16 one on a CPU with native
    bfloat16); None elsewhere. The kernel itself over its packed weight, as the native
    layers call it from C: through `mixed.linear`'s dispatch (a packed copy looked up per
    call) the bfloat16 peak at the embedded base's shapes measured ~15% lower (549-553 vs
    645-649 GFLOP/s), a ceiling the layers outrun."""
    if x.device.type != "cpu":
        return None
    rows, out = x.float().contiguous(), int(w.shape[0])
    if mixed.f32_takes(w):
        packed = mixed.f32_packed(w)
        product = kernels.f32_linear_rows
    elif w.dtype == torch.bfloat16 and native_bfloat16("cpu"):
        packed = mixed.packed(w)
        product = kernels.half_linear_rows
    else:
        return None
    if packed is None or product(rows, packed, out, None) is None:
        return None
    return functools.partial(product, rows, packed, out, None)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def torch_threads(threads: int | None) -> Iterator[int]:
    """Run the body with `threads` torch threads (None: as they are), restored after;
    yields the count in effect (what a result records)."""
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(previous)


def software() -> dict[str, Any]:
    """The versions and machine facts a benchmark's result records beside its figures."""
    return {
        "torch": torch.__version__,
        "marlaas": __version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
    }
