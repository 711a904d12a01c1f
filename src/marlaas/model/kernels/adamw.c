/* One AdamW update of a flat parameter vector in one pass (`train.optim.adamw_step_`):
 *
 *     p = p * decay                          decay = 1 - lr * weight_decay
 *     m = m + (1 - beta1) * (g - m)          (torch's lerp)
 *     v = v * beta2 + (1 - beta2) * g * g
 *     p = p + step * m / (sqrt(v) / bias2_sqrt + eps)      step = -lr / (1 - beta1^t)
 *
 * torch's multi-tensor ops make that eight passes over the tenants' vectors (and a
 * temporary for the denominator): at 32 tenants of 75k parameters ~190 MB moved for
 * the ~67 MB this reads and writes once.
 *
 * Layouts (float32, contiguous): p, g, m, v [n].
 */
#include <math.h>
#include <stdint.h>

void adamw_f32(int64_t n, float *p, const float *g, float *m, float *v, float decay,
               float lerp, float beta2, float bias2_sqrt, float eps, float step) {
    const float one_minus_beta2 = 1.0f - beta2;
    const float inv_bias2 = 1.0f / bias2_sqrt;
    for (int64_t i = 0; i < n; ++i) {
        const float gi = g[i];
        const float mi = m[i] + lerp * (gi - m[i]);
        const float vi = v[i] * beta2 + one_minus_beta2 * gi * gi;
        m[i] = mi;
        v[i] = vi;
        p[i] = p[i] * decay + step * mi / (sqrtf(vi) * inv_bias2 + eps);
    }
}
