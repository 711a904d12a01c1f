/* The core's own ceiling: multiply-adds in registers, nothing loaded or stored, twelve
 * independent chains (more than the units' latency times their number), so the loop
 * runs at the vector units' issue rate: float32 fused multiply-adds and, where the CPU
 * has AVX512-BF16, bfloat16 pair dot products (`vdpbf16ps`, two products a lane).
 * `marlaas.bench.machine` times them beside the matmul peaks: a library's matmul may
 * not reach the silicon's rate (MKL's float32 kernels on AMD run 256-bit), so the
 * roofline shows both.
 *
 * `n` iterations of twelve vector instructions each; the chains' sum into `out` (read
 * first as the multiplier, so nothing is known at compile time). With AMX-BF16 the tile
 * multiply-add's rate too (`fma_peak_amx_bf16`: twelve `tdpbf16ps` an iteration, into six
 * tiles in turn, 16 x 16 x 32 pairs of products each), which is then bfloat16's ceiling. */
#include <stdint.h>

#include "simd.h"
#include "amx.h"

#ifdef __AVX512BF16__
#include <immintrin.h>
#endif

#define STEP(a) a = a * b + c

void fma_peak_f32(int64_t n, float *out) {
    vf a0 = {0}, a1 = a0 + 1.0f, a2 = a0 + 2.0f, a3 = a0 + 3.0f, a4 = a0 + 4.0f;
    vf a5 = a0 + 5.0f, a6 = a0 + 6.0f, a7 = a0 + 7.0f, a8 = a0 + 8.0f, a9 = a0 + 9.0f;
    vf a10 = a0 + 10.0f, a11 = a0 + 11.0f;
    const vf b = (vf){0} + *out, c = (vf){0} + 1e-3f;
    for (int64_t i = 0; i < n; ++i) {
        STEP(a0), STEP(a1), STEP(a2), STEP(a3), STEP(a4), STEP(a5);
        STEP(a6), STEP(a7), STEP(a8), STEP(a9), STEP(a10), STEP(a11);
    }
    const vf s = a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7 + a8 + a9 + a10 + a11;
    float total = 0.0f;
    for (int i = 0; i < W; ++i) total += s[i];
    *out = total;
}

/* Writes -1 where the CPU has no AVX512-BF16 (nothing measured). */
void fma_peak_bf16(int64_t n, float *out) {
#ifdef __AVX512BF16__
    __m512 acc[12];
    for (int k = 0; k < 12; ++k) acc[k] = _mm512_set1_ps((float)k);
    const __m512bh x = (__m512bh)_mm512_set1_epi16((short)0x3f80);          /* 1.0 */
    const __m512bh y = (__m512bh)_mm512_set1_epi16((short)(*out > 0 ? 0x3c00 : 0));
#define DP(k) acc[k] = _mm512_dpbf16_ps(acc[k], x, y)
    for (int64_t i = 0; i < n; ++i) {
        DP(0), DP(1), DP(2), DP(3), DP(4), DP(5), DP(6), DP(7), DP(8), DP(9), DP(10), DP(11);
    }
#undef DP
    float total = 0.0f;
    for (int k = 0; k < 12; ++k) total += _mm512_reduce_add_ps(acc[k]);
    *out = total;
#else
    (void)n;
    *out = -1.0f;
#endif
}

/* Writes -1 where the CPU (or the kernel) gives no AMX-BF16 (nothing measured). */
void fma_peak_amx_bf16(int64_t n, float *out) {
#ifdef HAVE_AMX
    if (!amx_allowed()) {
        *out = -1.0f;
        return;
    }
    const uint8_t rows[8] = {16, 16, 16, 16, 16, 16, 16, 16};
    amx_configure(rows);
    _tile_zero(0); /* tile numbers are immediates */
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
#define DP(k) _tile_dpbf16ps(k, 6, 7)
    for (int64_t i = 0; i < n; ++i) {
        DP(0); DP(1); DP(2); DP(3); DP(4); DP(5);
        DP(0); DP(1); DP(2); DP(3); DP(4); DP(5);
    }
#undef DP
    float sums[16 * 16] __attribute__((aligned(64)));
    _tile_stored(0, sums, 64);
    _tile_release();
    *out = sums[0] + 1.0f; /* zeros times zeros: 1, and the loop is not dead */
#else
    (void)n;
    *out = -1.0f;
#endif
}
