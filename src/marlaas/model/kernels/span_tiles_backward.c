/* The backward of the tiled span attention (`span_tiles.c` says how the tiles work):
 * per tile, the probabilities again from the forward's log-sum-exp, the score
 * gradients, and the value, key and query gradients as small products; the same
 * arguments and results as `span_attention_backward_f32` (its fallback, linked in). */
#include "span_tiles.h"

/* One tile's backward (p = exp(scale q.k - lse), delta = dout.out, ds = p (dout.v -
 * delta) scale): per chunk, the scores and dout.v of its columns (score blocks over qT
 * and doutT), p and ds for the sixteen lanes a vector at a time, then dv += p^T dout,
 * dk += ds^T q (`column_gemm`) and dq (+)= ds k (`lane_gemm`). */
static inline __attribute__((always_inline)) void backward_tile(
    const int64_t D, const Tile *t, const float *kb, const float *vb, float *dkb, float *dvb,
    float scale, const float *out, const float *dout, const float *lse, float *dq) {
    float qT[D * W] __attribute__((aligned(64))), doT[D * W] __attribute__((aligned(64)));
    float ps[CMAX][W] __attribute__((aligned(64)));
    float ds[CMAX][W] __attribute__((aligned(64)));
    float sink[D] __attribute__((aligned(64)));
    const float *dop[W], *op[W];
    float *dqp[W];
    va lg = (va){0};
    for (int i = 0; i < W; ++i) {
        const int64_t o = t->o[i];
        dop[i] = o < 0 ? zeros : dout + o * D;
        op[i] = o < 0 ? zeros : out + o * D;
        dqp[i] = o < 0 ? sink : dq + o * D;
        lg[i] = o < 0 ? 0.0f : lse[o];
    }
    transpose_lanes(D, t->q, qT);
    transpose_lanes(D, dop, doT);
    va prod[W];
    for (int i = 0; i < W; ++i) {
        prod[i] = (va){0};
        for (int64_t d = 0; d < D; d += W)
            prod[i] += (va)(*(const vf *)(dop[i] + d)) * (va)(*(const vf *)(op[i] + d));
    }
    const va delta = (va)sums16((const vf *)prod);
    for (int64_t c0 = t->u0; c0 < t->u1; c0 += CMAX) {
        const int64_t cols = t->u1 - c0 < CMAX ? t->u1 - c0 : CMAX;
        backward_scores(D, t, qT, doT, kb + c0 * D, vb + c0 * D, c0, cols, scale, lg, delta, ps,
                        ds);
        const float(*pw)[W] = (const float(*)[W])ps, (*dw)[W] = (const float(*)[W])ds;
        column_gemm(D, t, c0, pw, cols, dop, dvb + c0 * D);
        column_gemm(D, t, c0, dw, cols, t->q, dkb + c0 * D);
        int64_t lo[2], hi[2];
        half_ranges(t, c0, cols, lo, hi);
        lane_gemm(D, dw, lo, hi, kb + c0 * D, c0 == t->u0 ? 0 : dqp, 0, dqp, 0);
    }
}

/* The tile function once per head size (32, 64, 128 and any other): it depends on D
 * only, the drivers below on D and G. */
#define TILE_FUNCTIONS(DIM, NAME)                                                              \
    static __attribute__((noinline)) void backward_tile_##NAME(                                \
        int64_t D, const Tile *t, const float *kb, const float *vb, float *dkb, float *dvb,    \
        float scale, const float *out, const float *dout, const float *lse, float *dq) {       \
        (void)D;                                                                               \
        backward_tile(DIM, t, kb, vb, dkb, dvb, scale, out, dout, lse, dq);                    \
    }
TILE_FUNCTIONS(32, 32)
TILE_FUNCTIONS(64, 64)
TILE_FUNCTIONS(128, 128)
TILE_FUNCTIONS(D, any)

static inline __attribute__((always_inline)) void column_backward(
    const int64_t D, const int64_t G, const float *qn, int64_t q_sh, const float *kc,
    const float *vc, float *dkc, float *dvc, float scale, const float *out, const float *dout,
    const float *lse, float *dq, int64_t h0) {
    for (int64_t g = 0; g < G; ++g) {
        const float *qg = qn + g * q_sh, *dog = dout + (h0 + g) * D;
        const float *og = out + (h0 + g) * D;
        const float p = expf(dot(D, qg, kc) * scale - lse[h0 + g]);
        va dd = (va){0};
        for (int64_t d = 0; d < D; d += W)
            dd += (va)(*(const vf *)(dog + d)) *
                  (va)(*(const vf *)(vc + d) - *(const vf *)(og + d));
        const float ds = p * vsum(dd) * scale;
        for (int64_t d = 0; d < D; d += W) {
            *(vf *)(dvc + d) += p * *(const vf *)(dog + d);
            *(vf *)(dkc + d) += ds * *(const vf *)(qg + d);
            *(vf *)(dq + (h0 + g) * D + d) = ds * *(const vf *)(kc + d);
        }
    }
}

static inline __attribute__((always_inline)) void tiles_backward(
    int64_t R, int64_t N, int64_t H, int64_t Hkv, const int64_t D, const int64_t G,
    const float *q, int64_t q_sr, int64_t q_sh, int64_t q_sn, const float *k, const float *v,
    int64_t kv_sr, int64_t kv_sh, const int64_t *start, const int64_t *end, float scale,
    const float *out, const float *dout, const float *lse, float *dq, float *dk, float *dv) {
    FOR_TILES(column_backward(D, G, qr + n * q_sn, q_sh, k + at + s * D, v + at + s * D,
                              dk + at + s * D, dv + at + s * D, scale, out, dout, lse, dq,
                              b * H + kv * G),
              BY_HEAD_SIZE(backward_tile, &t, k + at, v + at, dk + at, dv + at, scale, out, dout,
                           lse, dq),
              ARRAY(out, dout, dq), 3, ARRAY(k, v, dk, dv), 4)
}

#define BACKWARD(DIM, GROUP) tiles_backward(R, N, H, Hkv, DIM, GROUP, q, q_sr, q_sh, q_sn, k, \
                                            v, kv_sr, kv_sh, start, end, scale, out, dout, \
                                            lse, dq, dk, dv)

void span_tiles_backward_f32(int64_t R, int64_t N, int64_t H, int64_t Hkv, int64_t D,
                             const float *q, int64_t q_sr, int64_t q_sh, int64_t q_sn,
                             const float *k, const float *v,
                             int64_t kv_sr, int64_t kv_sh, int64_t kv_ss,
                             const int64_t *start, const int64_t *end, float scale,
                             const float *out, const float *dout, const float *lse,
                             float *dq, float *dk, float *dv) {
    if (!tiles_take(H, Hkv, D, kv_ss)) {
        span_attention_backward_f32(R, N, H, Hkv, D, q, q_sr, q_sh, q_sn, k, v, kv_sr, kv_sh,
                                    kv_ss, start, end, scale, out, dout, lse, dq, dk, dv);
        return;
    }
    const int64_t G = H / Hkv;
    SPECIALISED(BACKWARD)
}
