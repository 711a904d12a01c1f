/* A residual add and the RMS norm after it, in one pass per token (Llama's pre-norm
 * decoder: h = h + delta; x = weight * h / rms(h)):
 *
 *     h[t] += delta[t]                                       (when delta is given)
 *     out[t] = weight * (h[t] * 1 / sqrt(mean(h[t]^2) + eps))
 *
 * torch's `rms_norm` on the CPU is a composite of six element-wise and reduction ops
 * (the square, the mean, the add, the reciprocal square root, two multiplies), plus the
 * add before it: seven dispatches and passes over the activations per norm, eighteen
 * per decoder layer-pair.
 *
 * Layouts (float32, contiguous): h, delta and out [T, E]; weight [E].
 */
#include <math.h>
#include <stdint.h>
#include "kernels.h"

/* How many tokens ahead the backward prefetches a token's rows (a cache line is sixteen
 * floats). */
#define AHEAD 4

void add_rms_norm_f32(int64_t T, int64_t E, float *h, const float *delta, const float *weight,
                      float eps, float *out) {
    for (int64_t t = 0; t < T; ++t) {
        float *ht = h + t * E;
        float *ot = out + t * E;
        float sum = 0.0f;
        if (delta) {
            const float *dt = delta + t * E;
            for (int64_t i = 0; i < E; ++i) {
                const float x = ht[i] + dt[i];
                ht[i] = x;
                sum += x * x;
            }
        } else {
            for (int64_t i = 0; i < E; ++i) sum += ht[i] * ht[i];
        }
        const float inv = 1.0f / sqrtf(sum / (float)E + eps);
        for (int64_t i = 0; i < E; ++i) ot[i] = weight[i] * (ht[i] * inv);
    }
}

/* The backward of the RMS norm (no residual add) for the output's gradient g: per token,
 * with r = 1 / sqrt(mean(h^2) + eps) recomputed and u = g * weight,
 *
 *     gh[t] = r * u - h[t] * r^3 * (u . h[t]) / E        (written)
 *     gw   += g[t] * h[t] * r                             (when gw is given)
 *
 * the one pass of it that torch's composite backward makes in six. Layouts as the
 * forward's; g and gh [T, E], gw [E]. */
void rms_norm_backward_f32(int64_t T, int64_t E, const float *h, const float *weight,
                           const float *g, float eps, float *gh, float *gw) {
    for (int64_t t = 0; t < T; ++t) {
        const float *ht = h + t * E, *gt = g + t * E;
        float *ot = gh + t * E;
        if (t + AHEAD < T)  /* h: a tape's rows, from memory by the backward's turn */
            for (int64_t i = 0; i < E; i += 16) {
                __builtin_prefetch(ht + AHEAD * E + i, 0, 3);
                __builtin_prefetch(gt + AHEAD * E + i, 0, 3);
            }
        float sum = 0.0f, dot = 0.0f;
        for (int64_t i = 0; i < E; ++i) {
            sum += ht[i] * ht[i];
            dot += gt[i] * weight[i] * ht[i];
        }
        const float r = 1.0f / sqrtf(sum / (float)E + eps);
        const float c = r * r * r * dot / (float)E;
        for (int64_t i = 0; i < E; ++i) ot[i] = r * gt[i] * weight[i] - c * ht[i];
        if (gw)
            for (int64_t i = 0; i < E; ++i) gw[i] += gt[i] * ht[i] * r;
    }
}
