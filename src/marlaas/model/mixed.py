"""Half-precision linear layers over float32 activations: a half dtype on the CPU.

A CPU with native bfloat16 arithmetic (AVX512-BF16, AMX) multiplies bfloat16 matrices
about three times as fast as float32 ones (`marlaas bench roofline --dtype bfloat16`
prints both peaks: 111 vs 341 GFLOP/s at the embedded base's shapes on a 2-core EPYC),
but torch's element-wise CPU ops in bfloat16 are slower than in float32 and the native
kernels (`marlaas.model.kernels`) are float32 only: a whole base in bfloat16 decoded 256
rows in 14.7 ms where float32 took 8.6. So on the CPU a half dtype applies to the
weights of the base's linear layers only (`half_linears`): each becomes a `HalfLinear`
that rounds its float32 input to the half dtype, multiplies (products summed in float32
by the hardware) and returns float32. The embeddings, norms and output head stay float32,
and with them the residual stream, attention's arithmetic, the LoRA updates and every
log-prob; keys and values are held in bfloat16 (`cache_dtype`: half the bytes a decode
step reads; the span kernels widen them as they load, the trainer rounds alike). The compact
forwards multiply through `linear` the same way, so they and the Hugging Face modules
still compute the same thing.

torch's bfloat16 matmul on the CPU is oneDNN's, with two fixed costs that the embedded
base's small layers make visible: a kernel built per shape on first use (as long as
running it: `bucket_rows` pads rows to shapes that repeat) and ~15 us a call. Small
layers go through `kernels.half_linear_rows` instead, rounding alike, over a packed copy
of the weight made on first use (`packed`): any rows on one torch thread, up to
`kernels.HALF_LINEAR_MAX_ROWS` on more.

Small float32 layers (the output head above all) go through `kernels.f32_linear_rows`
on a CPU with AVX-512 (`_f32_product`): torch's float32 matmul there is MKL's, which on
AMD CPUs runs 256-bit (the embedded base's head, `[M, 128] x [128, 258]`: ~117 GFLOP/s
at 256 or 1,600 rows against the kernel's 240; its input gradient 119 against 275).

Invariants:
- The weights are converted in place and exist once (the float32 copy is freed).
- `linear(x, w, b)` on a float32 `x` with a half `w` equals `HalfLinear`'s forward
  exactly (one function: the compact forwards and the modules round alike).
- The output head is never converted: logits, and the log-probs behind every importance
  ratio, come from float32 arithmetic over the final norm.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from marlaas.model import kernels

#: The dtypes `half_linears` takes.
HALF_DTYPES = (torch.bfloat16, torch.float16)


def native_bfloat16(device: str | torch.device) -> bool:
    """Whether `device` computes bfloat16 natively (AVX512-BF16 or AMX on a CPU; else
    torch emulates it, several times slower than float32)."""
    device = torch.device(device)
    if device.type == "cuda":
        return bool(torch.cuda.is_bf16_supported())
    return device.type == "cpu" and _cpu_bfloat16()


@functools.cache
def _cpu_bfloat16() -> bool:
    cpu = torch.cpu
    return bool(cpu._is_avx512_bf16_supported() or cpu._is_amx_tile_supported())


def linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """`x W^T (+ b)` in `x`'s dtype; a weight of another dtype (a `HalfLinear`'s)
    multiplies `x` rounded to its dtype and the result is cast back. Without gradient
    to `x`, its rows are padded to their bucket (`bucket_rows`) first."""
    if weight.dtype == x.dtype:
        out = _f32_product(x, weight, bias)
        return F.linear(x, weight, bias) if out is None else out
    if torch.is_grad_enabled() and x.requires_grad:
        if weight.requires_grad or (bias is not None and bias.requires_grad):
            return F.linear(x.to(weight.dtype), weight, bias).to(x.dtype)
        return _FrozenHalfLinear.apply(x, weight, bias)  # type: ignore[no-any-return]
    out = _half_product(x, weight, bias)
    return out.to(x.dtype).view(*x.shape[:-1], out.shape[-1])


def _half_product(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """`x W^T (+ b)` for a half `weight`, as `[rows, out]` (`x`'s rows flattened): through
    `_packed_product` where it applies, else oneDNN at the rows' bucket."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    x_2d = x.reshape(rows, x.shape[-1])
    out = _packed_product(x_2d, weight, bias, transposed=False)
    if out is not None:
        return out
    return F.linear(_half_rows(x_2d, weight.dtype), weight, bias)[:rows]


def _packed_product(
    a: Tensor, weight: Tensor, bias: Tensor | None, transposed: bool
) -> Tensor | None:
    """`a W^T (+ b)`, or with `transposed` `a W`, float32, through
    `kernels.half_linear_rows` over the packed weight (a small layer's, on a CPU with
    native bfloat16; on more than one torch thread, up to `kernels.HALF_LINEAR_MAX_ROWS`
    rows); None where that does not apply."""
    if a.shape[0] == 0 or a.device.type != "cpu" or not _cpu_bfloat16():
        return None
    weights = packed(weight, transposed)
    if weights is None:
        return None
    out_features = int(weight.shape[1] if transposed else weight.shape[0])
    return kernels.half_linear_rows(a.contiguous(), weights, out_features, bias)


#: Float32 weights of at most this many elements go through `kernels.f32_linear_rows`
#: (`_f32_product`); a larger one's packed copy would not stay in cache, where MKL's
#: blocking does better.
F32_PACK_MAX_ELEMENTS = 1 << 18


def _f32_product(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor | None:
    """`x W^T (+ b)` for a small frozen float32 weight through `kernels.f32_linear_rows`
    over its packed copy (a CPU with AVX-512; with gradient to `x`, its input gradient
    through the packed transpose); None where that does not apply (a weight or bias
    that trains, a large weight, another device or CPU)."""
    if (
        x.dtype != torch.float32
        or x.device.type != "cpu"
        or not f32_takes(weight)
        or (bias is not None and bias.requires_grad)
        or x.numel() == 0
    ):
        return None
    if torch.is_grad_enabled() and x.requires_grad:
        if f32_packed(weight, transposed=True) is None:
            return None
        return _FrozenF32Linear.apply(x, weight, bias)  # type: ignore[no-any-return]
    return _f32_rows(x, weight, bias, transposed=False)


def _f32_rows(x: Tensor, weight: Tensor, bias: Tensor | None, transposed: bool) -> Tensor | None:
    """`x W^T (+ b)` (with `transposed`: `x W`) over the packed float32 weight, in `x`'s
    leading shape; None where the kernel declines."""
    weights = f32_packed(weight, transposed)
    if weights is None:
        return None
    features = int(weight.shape[1] if transposed else weight.shape[0])
    rows = x.numel() // x.shape[-1]
    out = kernels.f32_linear_rows(
        x.reshape(rows, x.shape[-1]).contiguous(), weights, features, bias
    )
    return None if out is None else out.view(*x.shape[:-1], features)


class _FrozenF32Linear(torch.autograd.Function):
    """`_f32_product` with gradient to `x` alone (the weight frozen): `g W` through the
    packed transpose."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        ctx.save_for_backward(weight)
        with torch.no_grad():
            out = _f32_rows(x, weight, bias, transposed=False)
        return F.linear(x, weight, bias) if out is None else out

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor, None, None]:
        (weight,) = ctx.saved_tensors
        g = grads[0]
        out = _f32_rows(g, weight, None, transposed=True)
        return (g @ weight if out is None else out), None, None


def f32_takes(weight: Tensor) -> bool:
    """Whether a model layer of `weight` runs the packed float32 kernel
    (`_f32_product`): a small frozen float32 weight on a CPU with AVX-512."""
    return (
        weight.dtype == torch.float32
        and weight.device.type == "cpu"
        and weight.numel() <= F32_PACK_MAX_ELEMENTS
        and not weight.requires_grad
        and cpu_avx512()
    )


@functools.cache
def cpu_avx512() -> bool:
    """Whether torch runs this CPU's AVX-512 code (the packed float32 kernel's route)."""
    return torch.backends.cpu.get_cpu_capability() in ("AVX512", "AVX512_BF16")


#: Weights of more elements are not packed (`packed`): their products are large enough
#: at a few rows that oneDNN's fixed cost does not matter, and a packed copy is a copy.
PACK_MAX_ELEMENTS = 1 << 21


class _Kept:
    """Values kept per live objects, found by identity (never by equality: tensors
    compare element-wise), each dropped when the first of its objects is collected."""

    def __init__(self) -> None:
        self._entries: dict[tuple[int, ...], tuple[tuple[Any, ...], Any]] = {}

    def get(self, objects: tuple[Any, ...]) -> Any:
        """The value kept for `objects` (None: none). A plain loop: a hot path's lookup
        (each half product of the engine's forwards makes one)."""
        entry = self._entries.get(tuple(map(id, objects)))
        if entry is None:
            return None
        refs, value = entry
        for ref, o in zip(refs, objects, strict=True):  # kept for objects since collected
            if ref() is not o:
                return None
        return value

    def put(self, objects: tuple[Any, ...], value: Any) -> None:
        key = tuple(map(id, objects))
        if key not in self._entries:
            weakref.finalize(objects[0], self._entries.pop, key, None)
        refs = tuple(_none if o is None else weakref.ref(o) for o in objects)
        self._entries[key] = (refs, value)


def _none() -> None:
    """The reference `_Kept` holds for a None (a layer without bias)."""
    return None


#: Per weight, and per weight for its transpose: (its version when packed, the copy).
_PACKED, _PACKED_T = _Kept(), _Kept()


def packed(weight: Tensor, transposed: bool = False) -> Tensor | None:
    """`weight` (with `transposed`, its transpose: a layer's input gradient multiplies
    by it) packed for `kernels.half_linear_rows`, made on first use and kept while the
    weight lives (made again if it is written to); None for a weight too large to be
    worth a copy (`PACK_MAX_ELEMENTS`) or one the kernel does not take."""
    if weight.numel() > PACK_MAX_ELEMENTS:
        return None

    def pack(source: Tensor) -> Tensor | None:
        return kernels.half_pack(source.t().contiguous() if transposed else source)

    return _kept_copy(_PACKED_T if transposed else _PACKED, weight, pack)


#: Per float32 weight, and per weight for its transpose: (its version when packed, the
#: copy).
_F32_PACKED, _F32_PACKED_T = _Kept(), _Kept()


def f32_packed(weight: Tensor, transposed: bool = False) -> Tensor | None:
    """`weight` packed for `kernels.f32_linear_rows` (with `transposed`, its transpose),
    kept as `packed` keeps the half weights'."""
    return _kept_copy(
        _F32_PACKED_T if transposed else _F32_PACKED,
        weight,
        lambda source: kernels.f32_pack(source, transposed),
    )


def _kept_copy(
    kept: _Kept, weight: Tensor, pack: Callable[[Tensor], Tensor | None]
) -> Tensor | None:
    """`pack(weight)` (detached), made on first use and kept in `kept` while the weight
    lives, made again once it is written to (its version moved on); None (nothing kept)
    where `pack` declines."""
    entry = kept.get((weight,))
    if entry is not None and entry[0] == weight._version:
        return entry[1]  # type: ignore[no-any-return]
    copy = pack(weight.detach())
    if copy is not None:
        kept.put((weight,), (weight._version, copy))
    return copy


class _FrozenHalfLinear(torch.autograd.Function):
    """`linear` of a frozen half weight with gradient to `x` alone: autograd's own
    backward of the same ops, `g` rounded to the weight's dtype times the weight, with
    the rows in buckets both ways."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        ctx.save_for_backward(weight)
        ctx.shape = x.shape
        with torch.no_grad():
            return linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor, None, None]:
        (weight,) = ctx.saved_tensors
        g = grads[0].reshape(-1, grads[0].shape[-1])
        return matmul(g, weight).view(ctx.shape), None, None


def matmul(a: Tensor, weight: Tensor) -> Tensor:
    """`a W` for `a [n, out]` in `a`'s dtype and a weight `[out, in]` (a layer's input
    gradient); a weight of another dtype multiplies `a` rounded as `linear` rounds `x`
    (through `kernels.half_linear_rows` over the packed transpose where `linear` takes
    that kernel, else oneDNN with rows in buckets)."""
    if weight.dtype == a.dtype:
        return torch.mm(a, weight)
    out = _packed_product(a, weight, None, transposed=True)
    if out is not None:
        return out
    rows = int(a.shape[0])
    return torch.mm(_half_rows(a, weight.dtype), weight)[:rows].to(a.dtype)


#: Row counts below this run unpadded (`bucket_rows`).
SMALL_ROWS = 32


def bucket_rows(rows: int) -> int:
    """The row count a half product of `rows` rows runs at: under `SMALL_ROWS` as it is
    (a few shapes, each built once; padding would cost more ops than the product),
    else up to a multiple of 16, and of an eighth of the power of two below it from 128
    rows on (at most 1/8 padding). oneDNN, torch's half matmul on the CPU, builds a
    kernel per shape on first use: ~0.3 ms for a `[1000-1400, 128] x [128, 352]` (0.26
    ms to run it), every time a forward's token count is new (a trainer's packed
    micro-batches, a decode batch's rows); with buckets their shapes repeat."""
    if rows < SMALL_ROWS:
        return rows
    step = max(16, 1 << max(rows.bit_length() - 4, 0))
    return -(-rows // step) * step


def _half_rows(a: Tensor, dtype: torch.dtype) -> Tensor:
    """The rows of `a [n, k]` in `dtype`, zero rows after them up to `bucket_rows(n)`."""
    rows = int(a.shape[0])
    padded = bucket_rows(rows)
    if padded == rows:
        return a.to(dtype)
    out = torch.empty((padded, a.shape[1]), dtype=dtype, device=a.device)
    out[:rows].copy_(a)
    out[rows:].zero_()
    return out


class HalfLinear(nn.Linear):
    """An `nn.Linear` whose weight (and bias) are half precision, used on float32 inputs
    and returning float32 (the module doc)."""

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)


def half_dtype(model: nn.Module) -> torch.dtype | None:
    """The dtype of `model`'s `HalfLinear` layers (None: it has none)."""
    return next((m.weight.dtype for m in model.modules() if isinstance(m, HalfLinear)), None)


def cache_dtype(base: nn.Module, dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype keys and values are held in, for a `base` computing in `dtype` on
    `device`: `dtype`, except on a CPU whose base runs bfloat16 linear layers over
    float32 activations: there bfloat16, what a model of that dtype caches (as Hugging
    Face's bfloat16 models do). The engine's slot cache holds them so (a decode step at
    many rows mostly reads the cache: half the bytes; the span kernels widen them as
    they load), and the trainer's compact forward rounds its keys and values alike, so
    both compute the same policy and the importance ratio of on-policy data stays at
    rounding noise."""
    half = half_dtype(base)
    if device.type == "cpu" and dtype == torch.float32 and half == torch.bfloat16:
        return half
    return dtype


def half_linears(model: nn.Module, dtype: torch.dtype) -> int:
    """Make every `nn.Linear` of `model` but its output head a `HalfLinear` in `dtype`
    (in place, weights converted); returns how many. The rest of the model keeps its
    dtype. The half layers of one parent that read the same input are stored one after
    another in one tensor (`_store_together`)."""
    if dtype not in HALF_DTYPES:
        raise ValueError(f"half_linears takes {HALF_DTYPES}, got {dtype}")
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    converted = 0
    for module in model.modules():
        if type(module) is nn.Linear and module is not head:
            module.to(dtype)
            module.__class__ = HalfLinear
            converted += 1
    for module in list(model.modules()):
        _store_together(module)
    return converted


def _store_together(parent: nn.Module) -> None:
    """Store the `HalfLinear` children of `parent` of the same input size and dtype (and
    bias or not) one after another, in declaration order, in one weight tensor (and one
    bias), each layer's parameters views of its rows: a decoder's q/k/v projections, its
    MLP's gate and up projections. The weights still exist once; `Together` finds such
    layers and multiplies them as one product."""
    groups: dict[tuple[int, torch.dtype, bool], list[HalfLinear]] = {}
    for child in parent.children():
        if isinstance(child, HalfLinear):
            key = (child.in_features, child.weight.dtype, child.bias is not None)
            groups.setdefault(key, []).append(child)
    for layers in groups.values():
        if len(layers) < 2:
            continue
        weight = torch.cat([layer.weight.detach() for layer in layers])
        biases = [layer.bias.detach() for layer in layers if layer.bias is not None]
        bias = torch.cat(biases) if biases else None
        row = 0
        for layer in layers:
            rows = slice(row, row + layer.out_features)
            grad = layer.weight.requires_grad
            layer.weight = nn.Parameter(weight[rows], requires_grad=grad)
            if bias is not None and layer.bias is not None:
                layer.bias = nn.Parameter(bias[rows], requires_grad=layer.bias.requires_grad)
            row += layer.out_features


#: The layers (weights, then biases) -> their `Together` (`Together.of`).
_TOGETHER = _Kept()


@dataclass(frozen=True)
class Together:
    """Layers whose weights lie one after another in one tensor (`_store_together`): the
    weight and bias spanning them all, and each layer's output size."""

    weight: Tensor
    bias: Tensor | None
    sizes: tuple[int, ...]

    @staticmethod
    def of(weights: Sequence[Tensor], biases: Sequence[Tensor | None]) -> Together | None:
        """The span of `weights` (and `biases`) where each starts where the one before
        ends in the same storage, all half and row-major; else None. The same layers
        give the same `Together` while they live (each forward built over them finds
        the span's packed weight, `packed`, already made)."""
        layers = (*weights, *biases)
        kept = _TOGETHER.get(layers)
        if kept is not None:
            return kept  # type: ignore[no-any-return]
        weight = _span(weights)
        present = [b for b in biases if b is not None]
        bias = _span(present) if present else None
        if weight is None or weight.dtype not in HALF_DTYPES:
            return None
        if present and (len(present) < len(biases) or bias is None):
            return None  # some layers with a bias and some without, or biases apart
        together = Together(weight, bias, tuple(int(w.shape[0]) for w in weights))
        _TOGETHER.put(layers, together)
        return together

    def linear(self, x: Tensor) -> list[Tensor]:
        """Each layer's `linear(x, W, b)`, from one product: contiguous outputs in `x`'s
        dtype (no gradient: the engine's forwards)."""
        out = _half_product(x, self.weight, self.bias)
        lead = x.shape[:-1]
        return [
            part.to(x.dtype).contiguous().view(*lead, part.shape[-1])
            for part in out.split(self.sizes, dim=-1)
        ]


def _span(parts: Sequence[Tensor]) -> Tensor | None:
    """One tensor viewing `parts` (contiguous, of the same trailing shape and dtype, each
    starting in storage where the previous one ends), else None."""
    first = parts[0]
    if not all(p.is_contiguous() and p.dtype == first.dtype for p in parts):
        return None
    if any(p.shape[1:] != first.shape[1:] for p in parts):
        return None
    storage = first.untyped_storage().data_ptr()
    end = first.data_ptr()
    for p in parts:
        if p.untyped_storage().data_ptr() != storage or p.data_ptr() != end:
            return None
        end += p.numel() * p.element_size()
    rows = sum(int(p.shape[0]) for p in parts)
    return first.detach().as_strided((rows, *first.shape[1:]), first.stride())
