/* Decode attention over the engine's slot cache: one query token per row.
 *
 * Row b's query heads h = kv * G + g (G = H / Hkv) attend columns [start[b], end[b]) of
 * key/value head kv of cache row b: each key and value vector is read once per row and
 * kv head and serves the G query heads of its group (no repeat), and only the row's own
 * columns are read (no padding to the longest row, no mask). Softmax in float32 with
 * the running maximum subtracted, as torch.softmax; `softcap` > 0 applies
 * tanh(s / softcap) * softcap to the scaled scores (Gemma 2). Each head's output
 * accumulates in registers (a local array of the constant head size) and is normalised
 * once: kept in `out`, it would be stored and reloaded for every column, as `out` may
 * alias the values for all the compiler knows (measured 3.5x slower at 256 rows, 70
 * columns; now the kernel reads the cache at about the machine's copy bandwidth).
 *
 * Layouts (float32, the last axis contiguous): q [R, H, D] with strides q_sr, q_sh;
 * keys and values [R, Hkv, S, D] with strides kv_sr, kv_sh, kv_ss (both buffers alike);
 * out [R, H, D] contiguous. `scratch` holds G * (max_b end[b] - start[b]) floats.
 */
#include <math.h>
#include <stdint.h>

static inline __attribute__((always_inline)) void attend(int64_t R, int64_t H, int64_t Hkv, const int64_t D,
                          const float *q, int64_t q_sr, int64_t q_sh,
                          const float *k, const float *v,
                          int64_t kv_sr, int64_t kv_sh, int64_t kv_ss,
                          const int64_t *start, const int64_t *end,
                          float scale, float softcap, float *out, float *scratch) {
    const int64_t G = H / Hkv;
    for (int64_t b = 0; b < R; ++b) {
        const int64_t s0 = start[b];
        const int64_t n = end[b] - s0;
        for (int64_t kv = 0; kv < Hkv; ++kv) {
            const float *kb = k + b * kv_sr + kv * kv_sh + s0 * kv_ss;
            const float *vb = v + b * kv_sr + kv * kv_sh + s0 * kv_ss;
            const float *qb = q + b * q_sr + kv * G * q_sh;
            float *ob = out + (b * H + kv * G) * D;
            for (int64_t l = 0; l < n; ++l) {
                const float *kl = kb + l * kv_ss;
                for (int64_t g = 0; g < G; ++g) {
                    const float *qg = qb + g * q_sh;
                    float dot = 0.0f;
                    for (int64_t d = 0; d < D; ++d) dot += qg[d] * kl[d];
                    scratch[g * n + l] = dot * scale;
                }
            }
            for (int64_t g = 0; g < G; ++g) {
                float *p = scratch + g * n;
                if (softcap > 0.0f)
                    for (int64_t l = 0; l < n; ++l) p[l] = tanhf(p[l] / softcap) * softcap;
                float m = p[0];
                for (int64_t l = 1; l < n; ++l) m = p[l] > m ? p[l] : m;
                float sum = 0.0f;
                for (int64_t l = 0; l < n; ++l) {
                    p[l] = expf(p[l] - m);
                    sum += p[l];
                }
                /* The head's output in registers (D is a constant for the common sizes),
                 * normalised once at the end: the values of this kv head are read from
                 * L1 again for each head of the group. */
                float acc[D];
                for (int64_t d = 0; d < D; ++d) acc[d] = 0.0f;
                for (int64_t l = 0; l < n; ++l) {
                    const float w = p[l];
                    const float *vl = vb + l * kv_ss;
                    for (int64_t d = 0; d < D; ++d) acc[d] += w * vl[d];
                }
                const float inv = 1.0f / sum;
                float *og = ob + g * D;
                for (int64_t d = 0; d < D; ++d) og[d] = acc[d] * inv;
            }
        }
    }
}

/* D as a compile-time constant for the common head sizes: the inner loops unroll into a
 * few vector instructions instead of a runtime-length loop and its remainder. */
#define ATTEND(DIM) attend(R, H, Hkv, DIM, q, q_sr, q_sh, k, v, kv_sr, kv_sh, kv_ss, \
                           start, end, scale, softcap, out, scratch)

void decode_attention_f32(int64_t R, int64_t H, int64_t Hkv, int64_t D,
                          const float *q, int64_t q_sr, int64_t q_sh,
                          const float *k, const float *v,
                          int64_t kv_sr, int64_t kv_sh, int64_t kv_ss,
                          const int64_t *start, const int64_t *end,
                          float scale, float softcap, float *out, float *scratch) {
    switch (D) {
        case 32: ATTEND(32); break;
        case 64: ATTEND(64); break;
        case 128: ATTEND(128); break;
        default: ATTEND(D);
    }
}
