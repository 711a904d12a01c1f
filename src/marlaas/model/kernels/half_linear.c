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
 * Where the CPU has AMX-BF16 (and K is a multiple of 32) the tiles compute it instead
 * (`amx_rows`): the packed layout is theirs too. On this project's Xeon (2 cores, one
 * thread) [256, 128] x [128, 704]: 1,150 GFLOP/s against the vector path's 108 (its
 * `vdpbf16ps` issues at half the float32 FMA's rate there) and oneDNN's 930.
 *
 * Layouts: x [M, K] float32 contiguous, K even; Wp as `half_pack_f32` writes it; b [N]
 * bfloat16 (uint16 bits); y [M, N] float32; `xb` scratch of M * K bfloat16. Built
 * without AVX512-BF16 (the caller then never calls it: `model.mixed`) it computes the
 * same in plain C, so that the source builds on every CPU.
 */
#include <stdint.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include "amx.h"

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

#ifdef __AVX512F__
/* `bf16_nearest` of sixteen floats' bits, the result in each lane's high half (the low
 * half's bits are left over: shifted out, or masked off, by the caller). */
static inline __m512i bf16_nearest_bits(__m512i u) {
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    return _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), odd);
}
#endif

#ifdef HAVE_AMX
/* The same product on the AMX tiles (CPUs with AMX-BF16: Intel's since Sapphire Rapids),
 * whose multiply-adds run several times the vector units' rate: a tile multiply-add
 * `tdpbf16ps` takes 16 rows of x's bfloat16 pairs (one 64-byte row each: 32 inputs) and
 * 16 rows of the packed weight (`Wp`'s layout is the tiles': a block of 16 outputs, 16
 * pairs of inputs, 64 bytes each) into a 16 x 16 float32 tile. Tiles 0-3 hold the sums
 * of two row blocks by two output blocks, 4-5 the row blocks' inputs, 6-7 the output
 * blocks' weights; a row block of fewer than 16 rows (the last) takes tiles of its
 * height. Each output's sum runs over the inputs in the same order whatever the rows and
 * the other outputs of the call. K a multiple of 32 (the caller's other path else). */

/* Tiles 0-7 of 64-byte rows: the row blocks' sums and inputs (0-5) `rows` high (the
 * short last block's height runs alone, on tiles 0, 1 and 4), the weights' (6-7) 16. */
static void configure(int rows) {
    const uint8_t r = (uint8_t)rows, heights[8] = {r, r, r, r, r, r, 16, 16};
    amx_configure(heights);
}

/* y's rows m0 .. m0 + rows of output block nb from a 16 x 16 sum tile (bias added,
 * rounded to bfloat16 as `tile` does), sixteen outputs a vector. */
static inline void amx_store(const float *sums, int64_t rows, int64_t m0, int64_t nb, int64_t N,
                             const uint16_t *b, float *y) {
    const int64_t n0 = nb * OUT, valid = N - n0 < OUT ? N - n0 : OUT;
    const __mmask16 keep = (__mmask16)((1u << valid) - 1u);
    __m512 bias = _mm512_setzero_ps();
    if (b)
        bias = _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(keep, b + n0)), 16));
    for (int64_t m = 0; m < rows; ++m) {
        const __m512 v = _mm512_add_ps(_mm512_loadu_ps(sums + m * OUT), bias);
        const __m512i h = _mm512_and_si512(bf16_nearest_bits(_mm512_castps_si512(v)),
                                           _mm512_set1_epi32((int)0xFFFF0000u));
        _mm512_mask_storeu_ps(y + (m0 + m) * N + n0, keep, _mm512_castsi512_ps(h));
    }
}

/* The sums of the blocks a pass computed (`amx_pass`), waiting for their epilogue. */
typedef struct {
    float sums[4][16 * OUT] __attribute__((aligned(64)));
    int64_t nb; /* the first output block; -1: none */
    int two_cols;
} amx_done;

/* `done`'s sums into y (rows m0 .. m0 + rows of the first row block, the second's 16). */
static inline void amx_finish(const amx_done *done, const int two_rows, int64_t rows, int64_t m0,
                              int64_t N, const uint16_t *b, float *y) {
    if (done->nb < 0) return;
    amx_store(done->sums[0], rows, m0, done->nb, N, b, y);
    if (done->two_cols) amx_store(done->sums[1], rows, m0, done->nb + 1, N, b, y);
    if (two_rows) {
        amx_store(done->sums[2], 16, m0 + 16, done->nb, N, b, y);
        if (done->two_cols) amx_store(done->sums[3], 16, m0 + 16, done->nb + 1, N, b, y);
    }
}

/* Row blocks at m0 (two where `two_rows`, the second full; the first `rows` high) times
 * every output block, two at a time. A block's epilogue (bias, rounding, the stores into
 * y: at K = 128 as much work as its multiply-adds) runs on the vector units after the
 * next block's tile multiply-adds are issued, while the tiles compute them. */
static inline __attribute__((always_inline)) void amx_pass(
    const int two_rows, int64_t rows, int64_t m0, int64_t N, int64_t K, const uint16_t *xb,
    const uint16_t *Wp, const uint16_t *b, float *y) {
    const int64_t NB = (N + OUT - 1) / OUT, K2 = K / 2;
    amx_done done[2];
    done[0].nb = done[1].nb = -1;
    int cur = 0;
    for (int64_t nb = 0; nb < NB; nb += 2, cur ^= 1) {
        const int two_cols = nb + 1 < NB;
        _tile_zero(0);
        _tile_zero(1);
        if (two_rows) {
            _tile_zero(2);
            _tile_zero(3);
        }
        const uint16_t *w0 = Wp + nb * K2 * 2 * OUT, *w1 = w0 + K2 * 2 * OUT;
        for (int64_t k0 = 0; k0 < K; k0 += 32) {
            _tile_loadd(4, xb + m0 * K + k0, K * 2);
            _tile_loadd(6, w0 + k0 * OUT, 64);
            if (two_cols) _tile_loadd(7, w1 + k0 * OUT, 64);
            _tile_dpbf16ps(0, 4, 6);
            if (two_cols) _tile_dpbf16ps(1, 4, 7);
            if (two_rows) {
                _tile_loadd(5, xb + (m0 + 16) * K + k0, K * 2);
                _tile_dpbf16ps(2, 5, 6);
                if (two_cols) _tile_dpbf16ps(3, 5, 7);
            }
        }
        amx_finish(&done[cur ^ 1], two_rows, rows, m0, N, b, y);
        amx_done *d = &done[cur];
        d->nb = nb;
        d->two_cols = two_cols;
        _tile_stored(0, d->sums[0], 64);
        if (two_cols) _tile_stored(1, d->sums[1], 64);
        if (two_rows) {
            _tile_stored(2, d->sums[2], 64);
            if (two_cols) _tile_stored(3, d->sums[3], 64);
        }
    }
    amx_finish(&done[cur ^ 1], two_rows, rows, m0, N, b, y);
}

static void amx_rows(int64_t M, int64_t N, int64_t K, const uint16_t *xb, const uint16_t *Wp,
                     const uint16_t *b, float *y) {
    const int64_t full = M / 16 * 16;
    int64_t m0 = 0;
    if (full > 0) {
        configure(16);
        for (; m0 + 32 <= full; m0 += 32) amx_pass(1, 16, m0, N, K, xb, Wp, b, y);
        if (m0 < full) {
            amx_pass(0, 16, m0, N, K, xb, Wp, b, y);
            m0 += 16;
        }
    }
    if (m0 < M) {
        configure((int)(M - m0));
        amx_pass(0, M - m0, m0, N, K, xb, Wp, b, y);
    }
    _tile_release();
}
#endif

/* xb[i] = bf16_nearest(x[i]) for i < n, sixteen a vector where the CPU has AVX-512. */
static void to_bf16(int64_t n, const float *x, uint16_t *xb) {
    int64_t i = 0;
#ifdef __AVX512F__
    for (; i + 16 <= n; i += 16) {
        const __m512i r = bf16_nearest_bits(_mm512_loadu_si512((const void *)(x + i)));
        _mm256_storeu_si256((__m256i *)(xb + i), _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16)));
    }
#endif
    for (; i < n; ++i) xb[i] = bf16_nearest(x[i]);
}

void half_linear_rows_f32(int64_t M, int64_t N, int64_t K, const float *x, const uint16_t *Wp,
                          const uint16_t *b, float *y, uint16_t *xb) {
    to_bf16(M * K, x, xb);
#ifdef HAVE_AMX
    if (K % 32 == 0 && amx_allowed()) {
        amx_rows(M, N, K, xb, Wp, b, y);
        return;
    }
#endif
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
