/* Rotary position embedding of a forward's new queries and keys, and the keys and values
 * stored into the engine's slot cache, in one pass over the projections' outputs:
 *
 *     q[t, h]            = rotate(q[t, h], cos[t], sin[t])           (in place)
 *     keys[row[t], h, col[t]]   = rotate(k[t, h], cos[t], sin[t])
 *     values[row[t], h, col[t]] = v[t, h]
 *
 * for every new token t. `rotate` is Hugging Face's `x * cos + rotate_half(x) * sin` on
 * the first `rot` features (the halves [0, rot/2) and [rot/2, rot)), the rest passed
 * through (partial rotary). torch's way is about a dozen element-wise ops over the
 * queries and keys (multiplies, the halves' negation and concatenation) plus a
 * transpose and an indexed copy per buffer, each a pass over memory and a dispatch.
 *
 * Layouts (float32): q [T, H, D] with token stride q_st (heads contiguous); k and v
 * [T, Hkv, D] with token strides k_st and v_st; cos and sin [T, rot] contiguous; the
 * cache buffers (float32, or bfloat16 with `bf16`) [rows, Hkv, S, D] with
 * strides c_sr, c_sh, c_ss (the last axis contiguous), written at row row[t], column
 * col[t].
 */
#include "simd.h"
#include "kernels.h"

static inline __attribute__((always_inline)) void rotate(
    float *restrict dst, const float *restrict x, const float *c, const float *s,
    const int64_t D, const int64_t rot) {
    const int64_t half = rot / 2;
    for (int64_t i = 0; i < half; ++i) {
        const float a = x[i], b = x[i + half];
        dst[i] = a * c[i] - b * s[i];
        dst[i + half] = b * c[i + half] + a * s[i + half];
    }
    for (int64_t i = rot; i < D; ++i) dst[i] = x[i];
}

/* One pass over the tokens (see the file doc); the cache buffers are float32, or
 * bfloat16 (`bf16`, a compile-time constant in each entry point: the keys and values
 * rounded to it as they are stored). */
static inline __attribute__((always_inline)) void rope_store(
    int64_t T, int64_t H, int64_t Hkv, const int64_t D, const int64_t rot, float *q,
    int64_t q_st, const float *k, int64_t k_st, const float *v, int64_t v_st, const float *cos,
    const float *sin, void *keys, void *values, int64_t c_sr, int64_t c_sh, int64_t c_ss,
    const int64_t *row, const int64_t *col, const int bf16) {
    for (int64_t t = 0; t < T; ++t) {
        const float *c = cos + t * rot, *s = sin + t * rot;
        float *qt = q + t * q_st;
        for (int64_t h = 0; h < H; ++h) {  /* in place: from a copy, so the loop vectorises */
            float x[D];
            for (int64_t i = 0; i < D; ++i) x[i] = qt[h * D + i];
            rotate(qt + h * D, x, c, s, D, rot);
        }
        const int64_t at = row[t] * c_sr + col[t] * c_ss;
        for (int64_t h = 0; h < Hkv; ++h) {
            const float *src = v + t * v_st + h * D;
            const int64_t to = at + h * c_sh;
            if (bf16) {
                float x[D];
                rotate(x, k + t * k_st + h * D, c, s, D, rot);
                uint16_t *kd = (uint16_t *)keys + to, *vd = (uint16_t *)values + to;
                for (int64_t i = 0; i < D; ++i) kd[i] = bf16_nearest(x[i]);
                for (int64_t i = 0; i < D; ++i) vd[i] = bf16_nearest(src[i]);
            } else {
                rotate((float *)keys + to, k + t * k_st + h * D, c, s, D, rot);
                float *dst = (float *)values + to;
                for (int64_t i = 0; i < D; ++i) dst[i] = src[i];
            }
        }
    }
}

/* `rope_store` of rotary size ROT, and of full-rotary heads of size DIM (`half`, the cache
 * dtype, a constant in scope). The head size is a constant for the common full-rotary
 * ones (`HEAD_SIZED`): the loops over a head's features unroll and vectorise, their copies
 * in registers. */
#define ROPE(DIM, ROT)                                                                          \
    rope_store(T, H, Hkv, DIM, ROT, q, q_st, k, k_st, v, v_st, cos, sin, keys, values, c_sr,   \
               c_sh, c_ss, row, col, half)
#define FULL_ROTARY(DIM) ROPE(DIM, DIM)
#define ROPE_ANY_SIZE()                                                                         \
    if (rot == D) {                                                                             \
        HEAD_SIZED(FULL_ROTARY)                                                                 \
    } else {                                                                                    \
        ROPE(D, rot);                                                                           \
    }

/* `bf16` 0: float32 cache buffers; 1: bfloat16 ones (`keys` and `values` of that type). */
void rope_store_f32(int64_t T, int64_t H, int64_t Hkv, int64_t D, int64_t rot,
                    float *q, int64_t q_st, const float *k, int64_t k_st,
                    const float *v, int64_t v_st, const float *cos, const float *sin,
                    void *keys, void *values, int64_t c_sr, int64_t c_sh, int64_t c_ss,
                    const int64_t *row, const int64_t *col, int64_t bf16) {
    if (bf16) {
        const int half = 1;
        ROPE_ANY_SIZE()
    } else {
        const int half = 0;
        ROPE_ANY_SIZE()
    }
}
