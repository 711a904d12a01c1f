/* Element-wise steps of a decoder layer that torch runs as several passes over memory,
 * each with its backward, for the trainer (float32, contiguous):
 *
 * - SwiGLU: y = silu(g) * u, the gated MLP's activation (torch: silu, then a multiply;
 *   backward: two multiplies, silu's backward, and their saved outputs). Backward:
 *   dg = dy * u * s * (1 + g * (1 - s)), du = dy * g * s, with s = sigmoid(g)
 *   recomputed rather than saved.
 * - rotary: Hugging Face's `x * cos + rotate_half(x) * sin` over [T, H, D] with tables
 *   [T, D] (torch: two multiplies, an add, and rotate_half's two slices, negation and
 *   concatenation, each also in the backward). Its backward is the transposed rotation,
 *   dx = dy * cos - rotate_half(dy * sin): the same pass with `transpose` set.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vexp.h"
#include "kernels.h"

/* SwiGLU's forward (`backward` 0: y = silu(g) * u) or its backward (dy given: dg, du)
 * over n elements, sixteen at a time with the inline exp (`vexp.h`; a libmvec call a
 * vector cost the backward two thirds of its time), the last few through a zero-padded
 * vector: every element the same arithmetic wherever it lies. */
static inline __attribute__((always_inline)) void swiglu_vector(
    const float *g, const float *u, const float *dy, float *a, float *b, int64_t n,
    int backward) {
    va gv = {0}, uv = {0}, dv = {0};
    memcpy(&gv, g, (size_t)n * sizeof(float));
    memcpy(&uv, u, (size_t)n * sizeof(float));
    if (backward) memcpy(&dv, dy, (size_t)n * sizeof(float));
    const va s = 1.0f / (1.0f + vexp(-gv));
    if (!backward) {
        const va y = gv * s * uv;
        memcpy(a, &y, (size_t)n * sizeof(float));
        return;
    }
    const va du = dv * gv * s, dg = dv * uv * s * (1.0f + gv * (1.0f - s));
    memcpy(a, &dg, (size_t)n * sizeof(float));
    memcpy(b, &du, (size_t)n * sizeof(float));
}

void swiglu_f32(int64_t n, const float *restrict g, const float *restrict u, float *restrict y) {
    int64_t i = 0;
    for (; i + W <= n; i += W) swiglu_vector(g + i, u + i, 0, y + i, 0, W, 0);
    if (i < n) swiglu_vector(g + i, u + i, 0, y + i, 0, n - i, 0);
}

void swiglu_backward_f32(int64_t n, const float *restrict g, const float *restrict u,
                         const float *restrict dy, float *restrict dg, float *restrict du) {
    int64_t i = 0;
    for (; i + W <= n; i += W) swiglu_vector(g + i, u + i, dy + i, dg + i, du + i, W, 1);
    if (i < n) swiglu_vector(g + i, u + i, dy + i, dg + i, du + i, n - i, 1);
}

/* Each of N rows' entropy of softmax(z) (z [N, V]; *nonfinite set, the values none,
 * where a logit is not finite: an exponent of all ones, tested on the bits, which
 * -ffast-math leaves alone), two passes over the row: its maximum m, then s = sum e and
 * t = sum (z - m) e with e = exp(z - m) (the inline exp, sixteen at a time):
 * H = log s - t / s, both terms non-negative (no cancellation against m). torch's way,
 * a log-softmax then its exp, a product and a sum, made six passes and four [N, V]
 * temporaries (the trainer's entropy metric). */
void entropy_rows_f32(int64_t N, int64_t V, const float *z, float *out, int64_t *nonfinite) {
    const uint32_t *bits = (const uint32_t *)z;
    uint32_t all_ones = 0;
    for (int64_t i = 0; i < N * V; ++i) all_ones |= ((bits[i] & 0x7f800000u) == 0x7f800000u);
    *nonfinite = all_ones;
    if (all_ones) return;
    for (int64_t n = 0; n < N; ++n) {
        const float *row = z + n * V;
        const float m = row_max(row, V);
        va s = {0}, t = {0};
        int64_t v = 0;
        for (; v + W <= V; v += W) {
            va x;
            memcpy(&x, row + v, sizeof x);
            const va d = x - m, e = vexp(d);
            s += e;
            t += d * e;
        }
        float ss = 0.0f, tt = 0.0f;
        for (int i = 0; i < W; ++i) ss += s[i], tt += t[i];
        for (; v < V; ++v) {
            const float d = row[v] - m, e = expf(d);
            ss += e;
            tt += d * e;
        }
        out[n] = logf(ss) - tt / ss;
    }
}

void rotary_f32(int64_t T, int64_t H, int64_t D, const float *restrict x,
                const float *restrict cos, const float *restrict sin, float *restrict out,
                int64_t transpose) {
    const int64_t half = D / 2;
    for (int64_t t = 0; t < T; ++t) {
        const float *c = cos + t * D, *s = sin + t * D;
        for (int64_t h = 0; h < H; ++h) {
            const float *xh = x + (t * H + h) * D;
            float *oh = out + (t * H + h) * D;
            if (transpose)
                for (int64_t i = 0; i < half; ++i) {
                    const float a = xh[i], b = xh[i + half];
                    oh[i] = a * c[i] + b * s[i + half];
                    oh[i + half] = b * c[i + half] - a * s[i];
                }
            else
                for (int64_t i = 0; i < half; ++i) {
                    const float a = xh[i], b = xh[i + half];
                    oh[i] = a * c[i] - b * s[i];
                    oh[i + half] = b * c[i + half] + a * s[i + half];
                }
        }
    }
}
