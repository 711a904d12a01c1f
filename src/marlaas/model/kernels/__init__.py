"""Native CPU kernels for the few steps torch has no fused kernel for, built on first use.

- `span_attention` is the engine's attention over the slot cache, each query token over
  its own span of columns (`span_attention.c`): a decode step's one token per row, one
  pass over the row's own keys and values shared by the query heads of a group; a
  prefill chunk's tokens, each over its causal span, the row's keys and values in cache
  for all its tokens. torch on the CPU runs a decode step as two batched matmuls of
  `rows x kv heads` tiny matrices, whose per-matrix overhead, not the bytes, sets their
  time (~1 ms each per layer at 256 rows and ~90 columns), and a prefill as SDPA's
  masked product over every column of the chunk (~8 ms a layer for 16 prompts of 192
  tokens). With the log-sum-exp of each query head kept (`span_attention_lse`), its
  backward (`span_attention_backward`) is the trainer's attention, both a tile of
  sixteen query heads at a time where they apply (`span_tiles.c`: the same results;
  float32 keys and values, head sizes a multiple of 16): the trainer's suffix pass of
  1,911 tokens over 40 columns, forward 0.57 -> 0.22 ms, backward 0.79 -> 0.44 ms.
- `lora_rows` adds the LoRA update of rows that each use their own adapter (a decode
  batch of many tenants) in place, reading every lane's weights where they lie
  (`lora_rows.c`). torch's way is a gather of the rows into per-lane pieces, two
  batched matmuls of `lanes` tiny matrices (`[rows per lane, in] x [in, r]`), a scatter
  back and an add: five ops per layer whose per-matrix overhead again sets the time.
- `add_rms_norm` adds a residual and takes the RMS norm of the sum in one pass per
  token (`rms_norm.c`): torch's `rms_norm` on the CPU is six ops, plus the add.
- `swiglu` / `swiglu_backward` and `rotary` (with its transpose, the backward) are the
  trainer's element-wise steps of a decoder layer, one pass each instead of torch's
  several (`fused.c`).
- `half_linear_rows` is a bfloat16 linear layer on a CPU with AVX512-BF16 over a weight
  `half_pack` packed once (`half_linear.c`): at the embedded base's shapes ahead of
  oneDNN, whose ~15 us per call is more than the product up to ~32 rows, at every row
  count on one thread (on more, oneDNN keeps more than `HALF_LINEAR_MAX_ROWS` rows).
- `f32_linear_rows` is a small float32 linear layer (the output head) over a weight
  `f32_pack` packed once (`linear_f32.c`), on the 512-bit units where torch's float32
  matmul is MKL's, which runs 256-bit on AMD CPUs (the embedded base's head: 240 vs
  ~116 GFLOP/s; its input gradient through the packed transpose 276 vs 118).
- `entropy_rows` is the trainer's entropy metric, one pass per row (`fused.c`).
- `adamw_clipped` is the trainer's AdamW update of every tenant of a step in one call,
  each gradient clipped by its own norm (or not) and each flat vector in one pass
  (`adamw.c`), where torch's norm, multiply and multi-tensor ops make ten.
- `copy_rows` moves slot-cache rows (a finished row's place taken by a live one, a
  prompt's cache copied to the rows that share it) in one pass with no temporary.
- `sample_rows` samples a decode batch's tokens (without top-k / top-p) and their
  log-probs in one call (`sample_rows.c`), where torch's way is about fifteen ops over
  the batch (256 rows x 258 tokens: 181 -> 49 us).
- `rope_store` applies the rotary embedding to a forward's new queries (in place) and
  keys and writes the keys and values into their cache columns (`rope_store.c`): about
  a dozen element-wise ops, a transpose and two indexed copies per layer in torch.
- `decoder_layers` runs every decoder layer of an engine forward in one call
  (`decoder_layers.c`, linked with the kernels above): the same kernels in the same
  order as the compact forward's Python path, without its ~70 wrapper calls a step
  (`marlaas.rollout.native`). `train_layers` / `train_layers_backward` do the same for
  one pass of the trainer's compact forward and its backward (`train_layers.c`,
  `marlaas.train.native`), keeping what the backward reads.

Build: each C source is compiled with the system's C compiler (`cc`, or `$CC`) into an
object in the user's cache (`$XDG_CACHE_HOME/marlaas/kernels`, else a private temporary
folder; named by a hash of the source, the shared headers beside it, the flags and the
CPU, so a changed source or header builds again), and the objects into a shared library
(one kernel's source, and those `build.LINKED` to it: `decoder_layers` and
`train_layers` link six each),
each written to a temporary name and renamed, so concurrent processes never load a
half-written file. The first build on a machine takes ~15 s (the span attention's
specialisations ~12 of them), later ones are loads. Where there is no compiler, or the
build or load fails, or `MARLAAS_NATIVE_KERNELS=0`, the kernels decline (None or False,
logged once) and callers keep torch's path: the kernels change speed, never results
beyond float rounding.

Only float32 CPU tensors whose last axis is contiguous are taken; anything else is
None too. The kernel runs in the calling thread (one core, as the engine's default).
"""

from marlaas.model.kernels.attention import (
    Spans,
    span_attention,
    span_attention_backward,
    span_attention_lse,
    span_attention_trains,
)
from marlaas.model.kernels.build import _library, native_kernels, torch_path, torch_path_on
from marlaas.model.kernels.decoder import (
    add_rms_norm,
    copy_rows,
    rms_norm_backward,
    rope_store,
    sample_rows,
)
from marlaas.model.kernels.fused import (
    HALF_LINEAR_MAX_ROWS,
    adamw_clipped,
    adamw_clipped_applies,
    entropy_rows,
    f32_linear_rows,
    f32_pack,
    half_linear_rows,
    half_linear_takes,
    half_pack,
    rotary,
    rotary_applies,
    swiglu,
    swiglu_applies,
    swiglu_backward,
)
from marlaas.model.kernels.lora import (
    LORA_ROWS_MAX_RANK,
    gather_grads,
    lane_weights_take,
    lora_rows,
    lora_rows_backward,
    lora_rows_trains,
)

__all__ = [
    "HALF_LINEAR_MAX_ROWS",
    "LORA_ROWS_MAX_RANK",
    "Spans",
    "_library",
    "adamw_clipped",
    "adamw_clipped_applies",
    "add_rms_norm",
    "copy_rows",
    "entropy_rows",
    "f32_linear_rows",
    "f32_pack",
    "gather_grads",
    "half_linear_rows",
    "half_linear_takes",
    "half_pack",
    "lane_weights_take",
    "lora_rows",
    "lora_rows_backward",
    "lora_rows_trains",
    "native_kernels",
    "rms_norm_backward",
    "rope_store",
    "rotary",
    "rotary_applies",
    "sample_rows",
    "span_attention",
    "span_attention_backward",
    "span_attention_lse",
    "span_attention_trains",
    "swiglu",
    "swiglu_applies",
    "swiglu_backward",
    "torch_path",
    "torch_path_on",
]
