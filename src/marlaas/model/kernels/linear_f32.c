/* A float32 linear layer over float32 rows with AVX-512 multiply-adds:
 *
 *     y[m, n] = sum_k x[m, k] * W[n, k] + b[n]                     (b optional)
 *
 * for the output head (float32 weights, `model.decoder.DecoderStack.logits`) and its
 * input's gradient (the same product with W^T packed). torch's float32 matmul here is
 * MKL's, which on AMD CPUs runs 256-bit: ~120 GFLOP/s of a Zen 5 core's ~290 at the
 * embedded base's head (`[M, 128] x [128, 258]`); this runs the 512-bit units.
 *
 * The weight is read packed (`linear_f32_pack`, once per weight): per block of 16
 * outputs and per input k, the 16 outputs' weights (one vector), so that one
 * multiply-add of a row's input k, broadcast, serves 16 outputs: four blocks of
 * outputs for four rows at a time in sixteen accumulators. Each output sums its
 * products in input order whatever the rows and whatever other outputs share the call
 * (a row's logits do not depend on the batch around it).
 *
 * Layouts: x [M, K] contiguous; W read at Wt[n * s_out + k * s_in] (W [N, K] contiguous:
 * s_out K, s_in 1; its transpose: s_out 1, s_in N); Wp as `linear_f32_pack` writes it,
 * [ceil(N / 16), K, 16]; b [N] or NULL; y [M, N] contiguous, written.
 */
#include <stdint.h>

#include "simd.h"

#define OUT 16 /* outputs of a packed block */

void linear_f32_pack(int64_t N, int64_t K, const float *Wt, int64_t s_out, int64_t s_in,
                     float *Wp) {
    const int64_t blocks = (N + OUT - 1) / OUT;
    for (int64_t nb = 0; nb < blocks; ++nb)
        for (int64_t k = 0; k < K; ++k)
            for (int64_t j = 0; j < OUT; ++j) {
                const int64_t n = nb * OUT + j;
                Wp[(nb * K + k) * OUT + j] = n < N ? Wt[n * s_out + k * s_in] : 0.0f;
            }
}

/* Rows m0 .. m0 + MS of output blocks nb0 .. nb0 + NBS (MS, NBS <= 4: constants where
 * inlined, the accumulators in registers). */
static inline __attribute__((always_inline)) void tile(const int MS, const int NBS, int64_t m0,
                                                       int64_t nb0, int64_t N, int64_t K,
                                                       const float *x, const float *Wp,
                                                       const float *b, float *y) {
    vf acc[4][4];
    for (int m = 0; m < MS; ++m)
        for (int j = 0; j < NBS; ++j) acc[m][j] = (vf){0};
    for (int64_t k = 0; k < K; ++k) {
        vf w[4];
        for (int j = 0; j < NBS; ++j) w[j] = *(const vf *)(Wp + ((nb0 + j) * K + k) * OUT);
        for (int m = 0; m < MS; ++m) {
            const float xv = x[(m0 + m) * K + k];
            for (int j = 0; j < NBS; ++j) acc[m][j] += xv * w[j];
        }
    }
    for (int j = 0; j < NBS; ++j) {
        const int64_t n0 = (nb0 + j) * OUT;
        const int64_t valid = N - n0 < OUT ? N - n0 : OUT;
        for (int m = 0; m < MS; ++m) {
            float *ym = y + (m0 + m) * N + n0;
            if (valid == OUT && !b) {
                *(vf *)ym = acc[m][j];
                continue;
            }
            for (int64_t l = 0; l < valid; ++l) ym[l] = acc[m][j][l] + (b ? b[n0 + l] : 0.0f);
        }
    }
}

#define TILE(MS, NBS) tile(MS, NBS, m0, nb0, N, K, x, Wp, b, y)

void linear_f32_rows(int64_t M, int64_t N, int64_t K, const float *x, const float *Wp,
                     const float *b, float *y) {
    FOR_PACKED_TILES(M, N, TILE)
}
