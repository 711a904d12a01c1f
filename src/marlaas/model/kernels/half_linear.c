/* A bfloat16 linear layer over float32 rows, on a CPU with AVX512-BF16:
 *
 *     y[m, n] = bf16(sum_k bf16(x[m, k]) * W[n, k] + b[n])       (b optional)
 *
 * as `model.mixed.linear` computes it through torch (x rounded to bfloat16 to nearest
 * even, products summed in float32, the sum with the bias rounded to bfloat16) but
 * without oneDNN's ~15 us per call, which at the embedded base's 128-wide layers is more
 * than the product itself up to ~32 rows (a decode step makes 17 such calls), and with
 * the conversions of x and y in the same pass: ahead of oneDNN at every row count at
 * those shapes (one thread), 250-470 GFLOP/s from 32 rows on.
 *
 * The weight is read packed (`half_pack_f32`, once per weight): for each block of 16
 * outputs and each pair of inputs k, 2k + 1, the 16 outputs' two weights side by side
 * (64 bytes, one vector), so that one multiply-add of a row's pair of inputs, broadcast,
 * serves 16 outputs (`vdpbf16ps`), four blocks of outputs for four rows at a time in
 * sixteen accumulators: no horizontal sums. Each output sums its products in the
 * same order whatever the rows and whatever other outputs share the call (q, k and v
 * as one product or three give the same values).
 *
 * Layouts: x [M, K] float32 contiguous, K even; Wp as `half_pack_f32` writes it; b [N]
 * bfloat16 (uint16 bits); y [M, N] float32; `xb` scratch of M * K bfloat16. Built
 * without AVX512-BF16 (the caller then never calls it: `model.mixed`) it computes the
 * same in plain C, so that the source builds on every CPU.
 */
#include <stdint.h>
#ifdef __AVX512BF16__
#include <immintrin.h>
#endif

#include "simd.h"
#include "kernels.h"

#define OUT 16 /* outputs of a packed block */

static inline float round_bf16(float f) { return bf16_widen(bf16_nearest(f)); }

/* Wp[((nb * K / 2) + k2) * 32 + 2 j + i] = Wt[16 nb + j, 2 k2 + i] (zero past N): the
 * weight W [N, K] (`Wt`: `W` is the vector width) packed. */
void half_pack_f32(int64_t N, int64_t K, const uint16_t *Wt, uint16_t *Wp) {
    const int64_t blocks = (N + OUT - 1) / OUT, K2 = K / 2;
    for (int64_t nb = 0; nb < blocks; ++nb)
        for (int64_t k2 = 0; k2 < K2; ++k2)
            for (int64_t j = 0; j < OUT; ++j) {
                const int64_t n = nb * OUT + j;
                uint16_t *dst = Wp + ((nb * K2 + k2) * OUT + j) * 2;
                dst[0] = n < N ? Wt[n * K + 2 * k2] : 0;
                dst[1] = n < N ? Wt[n * K + 2 * k2 + 1] : 0;
            }
}

#ifdef __AVX512BF16__
/* Rows m0 .. m0 + MS of outputs blocks nb0 .. nb0 + NBS (MS, NBS <= 4: constants where
 * inlined, the accumulators in registers). */
static inline __attribute__((always_inline)) void tile(
    const int MS, const int NBS, int64_t m0, int64_t nb0, int64_t N, int64_t K,
    const uint16_t *xb, const uint16_t *Wp, const uint16_t *b, float *y) {
    const int64_t K2 = K / 2;
    __m512 acc[4][4];
    for (int m = 0; m < MS; ++m)
        for (int j = 0; j < NBS; ++j) acc[m][j] = _mm512_setzero_ps();
    for (int64_t k2 = 0; k2 < K2; ++k2) {
        __m512bh w[4];
        for (int j = 0; j < NBS; ++j)
            w[j] = (__m512bh)_mm512_loadu_si512((const void *)(Wp + ((nb0 + j) * K2 + k2) * 2 * OUT));
        for (int m = 0; m < MS; ++m) {
            int32_t pair;
            __builtin_memcpy(&pair, xb + (m0 + m) * K + 2 * k2, sizeof pair);
            const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
            for (int j = 0; j < NBS; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], xv, w[j]);
        }
    }
    for (int j = 0; j < NBS; ++j) {
        const int64_t n0 = (nb0 + j) * OUT;
        const int64_t valid = N - n0 < OUT ? N - n0 : OUT;
        float bias[OUT] = {0};
        if (b)
            for (int64_t l = 0; l < valid; ++l) bias[l] = bf16_widen(b[n0 + l]);
        for (int m = 0; m < MS; ++m) {
            float out[OUT];
            _mm512_storeu_ps(out, acc[m][j]);
            float *ym = y + (m0 + m) * N + n0;
            for (int64_t l = 0; l < valid; ++l) ym[l] = round_bf16(out[l] + bias[l]);
        }
    }
}

#define TILE(MS, NBS) tile(MS, NBS, m0, nb0, N, K, xb, Wp, b, y)
#endif

void half_linear_rows_f32(int64_t M, int64_t N, int64_t K, const float *x, const uint16_t *Wp,
                          const uint16_t *b, float *y, uint16_t *xb) {
    for (int64_t i = 0; i < M * K; ++i) xb[i] = bf16_nearest(x[i]);
#ifdef __AVX512BF16__
    FOR_PACKED_TILES(M, N, TILE)
#else
    const int64_t K2 = K / 2;
    for (int64_t m = 0; m < M; ++m)
        for (int64_t n = 0; n < N; ++n) {
            const int64_t nb = n / OUT, j = n % OUT;
            float sum = 0.0f;
            for (int64_t k2 = 0; k2 < K2; ++k2) {
                const uint16_t *w = Wp + ((nb * K2 + k2) * OUT + j) * 2;
                sum += bf16_widen(xb[m * K + 2 * k2]) * bf16_widen(w[0]) +
                       bf16_widen(xb[m * K + 2 * k2 + 1]) * bf16_widen(w[1]);
            }
            y[m * N + n] = round_bf16(sum + (b ? bf16_widen(b[n]) : 0.0f));
        }
#endif
}
