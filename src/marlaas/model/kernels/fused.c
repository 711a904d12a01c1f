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
#include "kernels.h"

void swiglu_f32(int64_t n, const float *restrict g, const float *restrict u, float *restrict y) {
    for (int64_t i = 0; i < n; ++i) {
        const float s = 1.0f / (1.0f + expf(-g[i]));
        y[i] = g[i] * s * u[i];
    }
}

void swiglu_backward_f32(int64_t n, const float *restrict g, const float *restrict u,
                         const float *restrict dy, float *restrict dg, float *restrict du) {
    for (int64_t i = 0; i < n; ++i) {
        const float s = 1.0f / (1.0f + expf(-g[i]));
        du[i] = dy[i] * g[i] * s;
        dg[i] = dy[i] * u[i] * s * (1.0f + g[i] * (1.0f - s));
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
