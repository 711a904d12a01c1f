/* A bfloat16 linear layer of a few rows (a decode step of one to four rows), on a CPU
 * with AVX512-BF16:
 *
 *     y[m, n] = bf16(sum_k bf16(x[m, k]) * W[n, k] + b[n])       (b optional)
 *
 * as `model.mixed.linear` computes it through torch (x rounded to bfloat16 to nearest
 * even, products summed in float32, the sum with the bias rounded to bfloat16) but
 * without oneDNN's ~10 us per call, which at the embedded base's 128-wide layers is
 * three times the product itself: a one-row decode step made 28 such calls.
 *
 * Layouts: x [M, K] float32 contiguous; W [N, K] (`Wt`) and b [N] bfloat16 (uint16 bits);
 * y [M, N] float32. K a multiple of 32 and at most 4096, M at most 4 (the caller checks).
 * Built without AVX512-BF16 (the caller then never calls it: `model.mixed`) it computes
 * the same in plain C, so that the source builds on every CPU.
 */
#include <stdint.h>
#ifdef __AVX512BF16__
#include <immintrin.h>
#endif

#include "simd.h"

static inline float round_bf16(float f) { return bf16_widen(bf16_nearest(f)); }

void half_linear_small_f32(int64_t M, int64_t N, int64_t K, const float *x, const uint16_t *Wt,
                           const uint16_t *b, float *y) {
#ifdef __AVX512BF16__
    enum { MAX_M = 4, MAX_CHUNKS = 4096 / 32 };
    __m512bh xb[MAX_M][MAX_CHUNKS];
    const int64_t C = K / 32;
    for (int64_t m = 0; m < M; ++m)
        for (int64_t c = 0; c < C; ++c) {
            const float *xc = x + m * K + c * 32;
            xb[m][c] = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(xc + 16), _mm512_loadu_ps(xc));
        }
    for (int64_t n = 0; n < N; ++n) {
        __m512 acc[MAX_M];
        for (int64_t m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
        const uint16_t *wn = Wt + n * K;
        for (int64_t c = 0; c < C; ++c) {
            const __m512bh w = (__m512bh)_mm512_loadu_si512((const void *)(wn + c * 32));
            for (int64_t m = 0; m < M; ++m) acc[m] = _mm512_dpbf16_ps(acc[m], xb[m][c], w);
        }
        const float bias = b ? bf16_widen(b[n]) : 0.0f;
        for (int64_t m = 0; m < M; ++m)
            y[m * N + n] = round_bf16(_mm512_reduce_add_ps(acc[m]) + bias);
    }
#else
    for (int64_t m = 0; m < M; ++m)
        for (int64_t n = 0; n < N; ++n) {
            float sum = 0.0f;
            for (int64_t k = 0; k < K; ++k)
                sum += round_bf16(x[m * K + k]) * bf16_widen(Wt[n * K + k]);
            y[m * N + n] = round_bf16(sum + (b ? bf16_widen(b[n]) : 0.0f));
        }
#endif
}
