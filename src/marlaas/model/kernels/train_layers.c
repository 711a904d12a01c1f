/* The trainer's decoder layers in one call each way: the forward of every layer of one
 * pass of the trainer's compact forward (`marlaas.train.decoder`), keeping what its
 * backward reads (the tape), and that backward, through the kernels the pass calls one
 * by one from Python (`marlaas.train.native`). The forward, per layer:
 *
 *     x1 = rms_norm(h)                               (h: the layer's input, kept)
 *     qkv = x1 [W_q; W_k; W_v]^T (+ b) + LoRA of q, k and v
 *     [Qwen3: q, k = RMS norm of each head (q and k before it kept)]
 *     rotary on q (in place); k rotated and v into the pass's keys and values
 *       [Hkv, B, P + TQ, D] (zeros, the past's P columns first: row b's from row
 *       rows[b] of the past's [Hkv, G, P, D], the G prompts a suffix pass's B samples
 *       share), rounded to bfloat16 where the engine's cache holds that (`round`)
 *     att = attention of each token's query over its span of columns (`span_tiles.c`)
 *     h += att W_o^T (+ b) + LoRA;  x2 = rms_norm(h) (h kept)
 *     gu = x2 [W_gate; W_up]^T (+ b) + LoRA of each;  gated = silu(gate) * up
 *     h += gated W_down^T (+ b) + LoRA
 *
 * over the pass's `T` tokens (a packed pass's valid tokens, or every column of its rows;
 * the forward takes them a run of whole units at a time, except for the attention:
 * `chunks.h`),
 * token t in row row[t] at key column col[t] = P + its column, attending its span of
 * columns (start[t], end[t]: counted across the rows, see `Shape`). The backward runs the
 * same steps in reverse for the gradient of the last layer's h (and of each layer's keys
 * and values, where a later pass attended them: added into dK and dV before the call),
 * writing each LoRA module's gradients (`gA [L, r, in]`, `gBt [L, r, out]`, added to),
 * the past's (each sample row's past columns summed into its prompt's row, added to)
 * and, where the input needs one (`P_INPUT_GRAD`), the input's gradient (in place of the
 * output's), the base frozen: the products' input gradients through the packed
 * transposes of the half weights, as `mixed.matmul`. The keys' and values' rounding
 * passes their gradient straight through, as `fused.round_to`.
 *
 * `p` holds the pass's fields (`P_*`), then each layer's (`L_*`, with `M_FIELDS` per
 * LoRA module); `f` each layer's floats (`FL_*`). Pointers as integers; a module without
 * an update has a null A. The Python side writes them in this order.
 */
#include <string.h>

#include "chunks.h"
#include "simd.h"
#include "kernels.h"

enum {
    P_LAYERS, P_T, P_B, P_TQ, P_PAST, P_E, P_H, P_HKV, P_D, P_INTER, P_ROUND,
    P_UNITS, P_UNIT_TOKENS,
    P_HIDDEN, P_COS, P_SIN, P_ROW, P_COL, P_LANE, P_ORDER, P_SCALE,
    P_XB, P_SCORES, P_LORA_SCRATCH, P_OUT, P_WIDE, P_GRAD2, P_DQ,
    P_PAST_GROUPS, P_PAST_ROWS, /* the past's rows [Hkv, G, P, D]; each row's (B) */
    P_ZERO_DKV, /* the backward's: no later pass attended the keys and values (dK and dV
                 * hold no values: zeroed here, a layer's just before its attention) */
    P_INPUT_GRAD, /* the backward's: whether the pass's input (the first layer's h) needs
                   * its gradient (not for a prompt's embeddings: the first layer's q, k
                   * and v input gradient and its norm's backward are then skipped) */
    P_FIELDS
};
/* A module's fields: its lanes' weights and rank, its gradients (the backward's) and
 * their lanes' `fresh` flags (none: added into), and the tape of its tokens' h = s A x
 * ([T, r]: the forward's LoRA keeps it, the backward's reads it; `lora_rows.c`). */
enum {
    M_A, M_A_SL, M_A_SR, M_B, M_B_SL, M_B_SO, M_B_SR, M_RANK, M_GA, M_GBT, M_H, M_FRESH,
    M_FIELDS
};
enum { Q, K, V, O, GATE, UP, DOWN, MODULES };
enum {
    L_NORM1, L_NORM2, L_QKV_W, L_QKV_WT, L_QKV_B, L_Q_OUT, L_K_OUT, L_V_OUT,
    L_O_W, L_O_WT, L_O_B, L_GU_W, L_GU_WT, L_GU_B, L_DOWN_W, L_DOWN_WT, L_DOWN_B,
    L_Q_NORM, L_K_NORM, /* Qwen3's per-head norms' weights (null: none) */
    L_START, L_END, L_PAST_K, L_PAST_V, L_KEYS, L_VALUES, L_DK, L_DV, L_DPAST_K, L_DPAST_V,
    /* the tape */
    L_HIN, L_X1, L_QKV, L_QK, L_LSE, L_ATT, L_HMID, L_X2, L_GU, L_GATED,
    L_LORA, L_FIELDS = L_LORA + MODULES * M_FIELDS
};
enum { FL_EPS1, FL_EPS2, FL_SCALING, FL_Q_EPS, FL_K_EPS, FL_FIELDS };

#define PTR(type, v) ((type)(intptr_t)(v))
/* How many tokens ahead an element-wise loop over the tape prefetches a token's rows. */
#define AHEAD 2

/* y (row stride ys) += the LoRA update of module m over x [T, in], for run c's units. */
static void lora(const int64_t *p, const Chunk *c, const int64_t *m, int64_t in, int64_t out,
                 const float *x, float *y, int64_t ys) {
    if (!m[M_A]) return;
    lora_rows_strided_f32(c->units, p[P_UNIT_TOKENS], in, out, m[M_RANK], x, y, ys,
                          PTR(const float *, m[M_A]), m[M_A_SL], m[M_A_SR],
                          PTR(const float *, m[M_B]), m[M_B_SL], m[M_B_SO], m[M_B_SR],
                          PTR(const int64_t *, p[P_LANE]), c->order,
                          PTR(const float *, p[P_SCALE]), PTR(float *, p[P_LORA_SCRATCH]),
                          PTR(float *, m[M_H]));
}

/* Module m's gradients for the gradient g (row stride gs) of its output; its input's
 * added into gx [T, in]. */
static void lora_back(const int64_t *p, const int64_t *m, int64_t in, int64_t out,
                      const float *x, const float *g, int64_t gs, float *gx) {
    if (!m[M_A]) return;
    lora_rows_backward_strided_f32(
        p[P_UNITS], p[P_UNIT_TOKENS], in, out, m[M_RANK], x, g, gs, gx,
        PTR(const float *, m[M_A]), m[M_A_SL], m[M_A_SR], PTR(const float *, m[M_B]),
        m[M_B_SL], m[M_B_SO], m[M_B_SR], PTR(const int64_t *, p[P_LANE]),
        PTR(const int64_t *, p[P_ORDER]), PTR(const float *, p[P_SCALE]),
        PTR(float *, m[M_GA]), PTR(float *, m[M_GBT]), PTR(float *, p[P_LORA_SCRATCH]), 1,
        PTR(const float *, m[M_H]), PTR(uint8_t *, m[M_FRESH]));
}

/* y[i] += x[i] for i < n (separate arrays). */
static inline void add_into(float *restrict y, const float *restrict x, int64_t n) {
    for (int64_t i = 0; i < n; ++i) y[i] += x[i];
}

/* The pass's shapes, and a layer's keys' and values' strides: [Hkv, B, P + TQ, D], so
 * that each row's columns of a kv head follow the row before's and the tokens' spans are
 * runs of one sequence of columns (the attention sees one row of T queries: no query
 * slots for padding, no copies into and out of the rows' layout). */
typedef struct {
    int64_t T, B, TQ, P, E, H, Hkv, D, I, HD, C, S, sr, sh, ss;
} Shape;

static Shape shape_of(const int64_t *p, const int64_t *L) {
    Shape s;
    s.T = p[P_T], s.B = p[P_B], s.TQ = p[P_TQ], s.P = p[P_PAST], s.E = p[P_E], s.H = p[P_H];
    s.Hkv = p[P_HKV], s.D = p[P_D], s.I = p[P_INTER], s.HD = s.H * s.D;
    s.C = L[L_Q_OUT] + L[L_K_OUT] + L[L_V_OUT];
    s.S = s.P + s.TQ, s.ss = s.D, s.sr = s.S * s.D, s.sh = s.B * s.S * s.D;
    return s;
}

static void layer_forward(const int64_t *p, const Chunks *chunks, const int64_t *L,
                          const float *fl, float *h) {
    const Shape s = shape_of(p, L);
    const int64_t *m = L + L_LORA;
    const int64_t qo = L[L_Q_OUT], ko = L[L_K_OUT];
    float *x1 = PTR(float *, L[L_X1]), *qkv = PTR(float *, L[L_QKV]);
    float *att = PTR(float *, L[L_ATT]), *x2 = PTR(float *, L[L_X2]);
    float *gu = PTR(float *, L[L_GU]), *gated = PTR(float *, L[L_GATED]);
    float *keys = PTR(float *, L[L_KEYS]), *values = PTR(float *, L[L_VALUES]);
    float *out = PTR(float *, p[P_OUT]);
    float *hin = PTR(float *, L[L_HIN]), *hmid = PTR(float *, L[L_HMID]);
    uint16_t *xb = PTR(uint16_t *, p[P_XB]);
    const int64_t *row = PTR(const int64_t *, p[P_ROW]), *col = PTR(const int64_t *, p[P_COL]);
    const size_t cells = (size_t)(s.B * s.Hkv * s.S * s.D) * sizeof(float);

    /* Up to the attention, a run of tokens at a time (its rows stay in L2 from one step
     * to the next: `chunks.h`). */
    for (int64_t k = 0; k < chunks->count; ++k) {
        const Chunk c = chunk_at(chunks, k);
        const int64_t t0 = c.t0, n = c.n;
        memcpy(hin + t0 * s.E, h + t0 * s.E, (size_t)(n * s.E) * sizeof(float));
        add_rms_norm_f32(n, s.E, h + t0 * s.E, 0, PTR(const float *, L[L_NORM1]), fl[FL_EPS1],
                         x1 + t0 * s.E);
        half_linear_rows_f32(n, s.C, s.E, x1 + t0 * s.E, PTR(const uint16_t *, L[L_QKV_W]),
                             PTR(const uint16_t *, L[L_QKV_B]), qkv + t0 * s.C, xb);
        lora(p, &c, m + Q * M_FIELDS, s.E, qo, x1, qkv, s.C);
        lora(p, &c, m + K * M_FIELDS, s.E, ko, x1, qkv + qo, s.C);
        lora(p, &c, m + V * M_FIELDS, s.E, L[L_V_OUT], x1, qkv + qo + ko, s.C);
        if (L[L_Q_NORM]) {  /* Qwen3: each head's RMS norm, in place; the queries and keys kept */
            float *qk = PTR(float *, L[L_QK]);
            for (int64_t t = t0; t < t0 + n; ++t) {
                float *q = qkv + t * s.C;
                memcpy(qk + t * (qo + ko), q, (size_t)(qo + ko) * sizeof(float));
                add_rms_norm_f32(s.H, s.D, q, 0, PTR(const float *, L[L_Q_NORM]), fl[FL_Q_EPS],
                                 q);
                add_rms_norm_f32(s.Hkv, s.D, q + qo, 0, PTR(const float *, L[L_K_NORM]),
                                 fl[FL_K_EPS], q + qo);
            }
        }
    }
    /* The keys and values: zeros, the past's columns, the new tokens' (rounded). */
    memset(keys, 0, cells);
    memset(values, 0, cells);
    if (s.P) {  /* the past: [Hkv, G, P, D] contiguous, row b's at its row rows[b] */
        const float *pk = PTR(const float *, L[L_PAST_K]), *pv = PTR(const float *, L[L_PAST_V]);
        const int64_t *rows = PTR(const int64_t *, p[P_PAST_ROWS]), G = p[P_PAST_GROUPS];
        const size_t run = (size_t)(s.P * s.D) * sizeof(float);
        for (int64_t b = 0; b < s.B; ++b)
            for (int64_t kv = 0; kv < s.Hkv; ++kv) {
                const int64_t from = (kv * G + rows[b]) * s.P * s.D, to = kv * s.sh + b * s.sr;
                memcpy(keys + to, pk + from, run);
                memcpy(values + to, pv + from, run);
            }
    }
    rope_store_f32(s.T, s.H, s.Hkv, s.D, s.D, qkv, s.C, qkv + qo, s.C, qkv + qo + ko, s.C,
                   PTR(const float *, p[P_COS]), PTR(const float *, p[P_SIN]), keys, values,
                   s.sr, s.sh, s.ss, row, col, 0);
    if (p[P_ROUND])
        for (int64_t t = 0; t < s.T; ++t)
            for (int64_t kv = 0; kv < s.Hkv; ++kv) {
                float *kt = keys + row[t] * s.sr + kv * s.sh + col[t] * s.ss;
                float *vt = values + (kt - keys);
                for (int64_t d = 0; d < s.D; ++d) {
                    kt[d] = bf16_widen(bf16_nearest(kt[d]));
                    vt[d] = bf16_widen(bf16_nearest(vt[d]));
                }
            }
    /* The tokens' queries where the product left them, over their spans of columns. */
    span_tiles_f32(1, s.T, s.H, s.Hkv, s.D, qkv, 0, s.D, s.C, keys, values, 0, s.sh, s.ss,
                   PTR(const int64_t *, L[L_START]), PTR(const int64_t *, L[L_END]),
                   fl[FL_SCALING], 0.0f, att, PTR(float *, L[L_LSE]),
                   PTR(float *, p[P_SCORES]), 0);
    /* From the attention's output on, a run at a time. */
    for (int64_t k = 0; k < chunks->count; ++k) {
        const Chunk c = chunk_at(chunks, k);
        const int64_t t0 = c.t0, n = c.n;
        float *ht = h + t0 * s.E, *outt = out + t0 * s.E;
        half_linear_rows_f32(n, s.E, s.HD, att + t0 * s.HD, PTR(const uint16_t *, L[L_O_W]),
                             PTR(const uint16_t *, L[L_O_B]), outt, xb);
        lora(p, &c, m + O * M_FIELDS, s.HD, s.E, att, out, s.E);
        add_rms_norm_f32(n, s.E, ht, outt, PTR(const float *, L[L_NORM2]), fl[FL_EPS2],
                         x2 + t0 * s.E);
        memcpy(hmid + t0 * s.E, ht, (size_t)(n * s.E) * sizeof(float));
        half_linear_rows_f32(n, 2 * s.I, s.E, x2 + t0 * s.E, PTR(const uint16_t *, L[L_GU_W]),
                             PTR(const uint16_t *, L[L_GU_B]), gu + t0 * 2 * s.I, xb);
        lora(p, &c, m + GATE * M_FIELDS, s.E, s.I, x2, gu, 2 * s.I);
        lora(p, &c, m + UP * M_FIELDS, s.E, s.I, x2, gu + s.I, 2 * s.I);
        for (int64_t t = t0; t < t0 + n; ++t)
            swiglu_f32(s.I, gu + t * 2 * s.I, gu + t * 2 * s.I + s.I, gated + t * s.I);
        half_linear_rows_f32(n, s.E, s.I, gated + t0 * s.I, PTR(const uint16_t *, L[L_DOWN_W]),
                             PTR(const uint16_t *, L[L_DOWN_B]), outt, xb);
        lora(p, &c, m + DOWN * M_FIELDS, s.I, s.E, gated, out, s.E);
        add_into(ht, outt, n * s.E);
    }
}

/* g [T, E]: the gradient of the layer's output in, of its input out where `input` (else
 * g is left partial and nobody reads it: the LoRA gradients are all written before). */
static void layer_backward(const int64_t *p, const int64_t *L, const float *fl, float *g,
                           const int input) {
    const Shape s = shape_of(p, L);
    const int64_t *m = L + L_LORA;
    const int64_t qo = L[L_Q_OUT], ko = L[L_K_OUT];
    const float *x1 = PTR(const float *, L[L_X1]), *qkv = PTR(const float *, L[L_QKV]);
    const float *att = PTR(const float *, L[L_ATT]), *x2 = PTR(const float *, L[L_X2]);
    const float *gu = PTR(const float *, L[L_GU]), *gated = PTR(const float *, L[L_GATED]);
    const float *cos = PTR(const float *, p[P_COS]), *sin = PTR(const float *, p[P_SIN]);
    float *dk = PTR(float *, L[L_DK]), *dv = PTR(float *, L[L_DV]);
    /* Scratch: wide [T, max(E, HD, C, 2I)], g2 [T, E], dq [T, HD]. */
    float *wide = PTR(float *, p[P_WIDE]), *g2 = PTR(float *, p[P_GRAD2]);
    float *dq = PTR(float *, p[P_DQ]);
    uint16_t *xb = PTR(uint16_t *, p[P_XB]);
    const int64_t *row = PTR(const int64_t *, p[P_ROW]), *col = PTR(const int64_t *, p[P_COL]);

    /* The MLP: g of gated (in the forward's `out` scratch), of gate and up (in wide), of
     * x2 (g2). */
    float *g_gated = PTR(float *, p[P_OUT]);  /* [T, I] */
    half_linear_rows_f32(s.T, s.I, s.E, g, PTR(const uint16_t *, L[L_DOWN_WT]), 0, g_gated, xb);
    lora_back(p, m + DOWN * M_FIELDS, s.I, s.E, gated, g, s.E, g_gated);
    for (int64_t t = 0; t < s.T; ++t) {
        if (t + AHEAD < s.T) {  /* the tape's rows from memory ahead (the forward's, evicted) */
            const float *next = gu + (t + AHEAD) * 2 * s.I;
            for (int64_t i = 0; i < 2 * s.I; i += W) __builtin_prefetch(next + i, 0, 3);
            for (int64_t i = 0; i < s.I; i += W)
                __builtin_prefetch(g_gated + (t + AHEAD) * s.I + i, 0, 3);
        }
        swiglu_backward_f32(s.I, gu + t * 2 * s.I, gu + t * 2 * s.I + s.I, g_gated + t * s.I,
                            wide + t * 2 * s.I, wide + t * 2 * s.I + s.I);
    }
    half_linear_rows_f32(s.T, s.E, 2 * s.I, wide, PTR(const uint16_t *, L[L_GU_WT]), 0, g2, xb);
    lora_back(p, m + GATE * M_FIELDS, s.E, s.I, x2, wide, 2 * s.I, g2);
    lora_back(p, m + UP * M_FIELDS, s.E, s.I, x2, wide + s.I, 2 * s.I, g2);
    rms_norm_backward_f32(s.T, s.E, PTR(const float *, L[L_HMID]),
                          PTR(const float *, L[L_NORM2]), g2, fl[FL_EPS2], wide, 0);
    add_into(g, wide, s.T * s.E);
    /* The attention's output projection, then the attention. */
    half_linear_rows_f32(s.T, s.HD, s.E, g, PTR(const uint16_t *, L[L_O_WT]), 0, wide, xb);
    lora_back(p, m + O * M_FIELDS, s.HD, s.E, att, g, s.E, wide);
    if (p[P_ZERO_DKV]) {
        const size_t cells = (size_t)(s.B * s.Hkv * s.S * s.D) * sizeof(float);
        memset(dk, 0, cells);
        memset(dv, 0, cells);
    }
    span_tiles_backward_f32(1, s.T, s.H, s.Hkv, s.D, qkv, 0, s.D, s.C,
                            PTR(const float *, L[L_KEYS]), PTR(const float *, L[L_VALUES]), 0,
                            s.sh, s.ss, PTR(const int64_t *, L[L_START]),
                            PTR(const int64_t *, L[L_END]), fl[FL_SCALING], att, wide,
                            PTR(const float *, L[L_LSE]), dq, dk, dv);
    /* Each token's q, k and v gradients side by side (the rotary transposed). */
    float *gqkv = wide;  /* [T, C] */
    for (int64_t t = 0; t < s.T; ++t) {
        float *gt = gqkv + t * s.C;
        rotary_f32(1, s.H, s.D, dq + t * s.HD, cos + t * s.D, sin + t * s.D, gt, 1);
        float kt[s.Hkv * s.D];
        for (int64_t kv = 0; kv < s.Hkv; ++kv) {
            const int64_t at = row[t] * s.sr + kv * s.sh + col[t] * s.ss;
            memcpy(kt + kv * s.D, dk + at, (size_t)s.D * sizeof(float));
            memcpy(gt + qo + ko + kv * s.D, dv + at, (size_t)s.D * sizeof(float));
        }
        rotary_f32(1, s.Hkv, s.D, kt, cos + t * s.D, sin + t * s.D, gt + qo, 1);
        if (L[L_Q_NORM]) {  /* through each head's norm (in place: a head read, then written) */
            const float *qk = PTR(const float *, L[L_QK]) + t * (qo + ko);
            rms_norm_backward_f32(s.H, s.D, qk, PTR(const float *, L[L_Q_NORM]), gt,
                                  fl[FL_Q_EPS], gt, 0);
            rms_norm_backward_f32(s.Hkv, s.D, qk + qo, PTR(const float *, L[L_K_NORM]), gt + qo,
                                  fl[FL_K_EPS], gt + qo, 0);
        }
    }
    if (s.P && L[L_DPAST_K]) {  /* the past's columns' gradients, summed into its rows */
        const int64_t *rows = PTR(const int64_t *, p[P_PAST_ROWS]), G = p[P_PAST_GROUPS];
        float *gk = PTR(float *, L[L_DPAST_K]), *gv = PTR(float *, L[L_DPAST_V]);
        const int64_t run = s.P * s.D;
        for (int64_t b = 0; b < s.B; ++b)
            for (int64_t kv = 0; kv < s.Hkv; ++kv) {
                const int64_t to = (kv * G + rows[b]) * run, from = kv * s.sh + b * s.sr;
                add_into(gk + to, dk + from, run);
                add_into(gv + to, dv + from, run);
            }
    }
    float *gx = input ? g2 : 0;
    if (input)
        half_linear_rows_f32(s.T, s.E, s.C, gqkv, PTR(const uint16_t *, L[L_QKV_WT]), 0, g2, xb);
    lora_back(p, m + Q * M_FIELDS, s.E, qo, x1, gqkv, s.C, gx);
    lora_back(p, m + K * M_FIELDS, s.E, ko, x1, gqkv + qo, s.C, gx);
    lora_back(p, m + V * M_FIELDS, s.E, L[L_V_OUT], x1, gqkv + qo + ko, s.C, gx);
    if (!input) return;
    rms_norm_backward_f32(s.T, s.E, PTR(const float *, L[L_HIN]),
                          PTR(const float *, L[L_NORM1]), g2, fl[FL_EPS1], wide, 0);
    add_into(g, wide, s.T * s.E);
}

void train_layers_f32(const int64_t *p, const float *f) {
    float *h = PTR(float *, p[P_HIDDEN]);
    Chunks chunks = chunks_of(p[P_UNITS], p[P_UNIT_TOKENS], PTR(const int64_t *, p[P_ORDER]),
                              CHUNK_TOKENS);
    for (int64_t l = 0; l < p[P_LAYERS]; ++l)
        layer_forward(p, &chunks, p + P_FIELDS + l * L_FIELDS, f + l * FL_FIELDS, h);
    chunks_free(&chunks);
}

void train_layers_backward_f32(const int64_t *p, const float *f) {
    float *g = PTR(float *, p[P_HIDDEN]);
    for (int64_t l = p[P_LAYERS] - 1; l >= 0; --l)
        layer_backward(p, p + P_FIELDS + l * L_FIELDS, f + l * FL_FIELDS, g,
                       l > 0 || p[P_INPUT_GRAD]);
}
