/* The engine's decoder layers in one call: every layer of a compact forward
 * (`marlaas.rollout.decoder`) over rows of the slot cache, through the same kernels the
 * forward calls one by one from Python, in the same order, on the same values:
 *
 *     x = add_rms_norm(h, delta)                     (h += delta: the last block's output)
 *     qkv = x [W_q; W_k; W_v]^T (+ b)                half_linear_rows_f32, one product
 *     qkv += LoRA of q, k and v                      lora_rows_strided_f32, in place
 *     [Qwen3: q, k = RMS norm of each head]          add_rms_norm_f32, in place
 *     rotary on q; k and v into the cache            rope_store_f32 (every feature)
 *     att = attention over each query's span         span_attention_f32 (no softcap)
 *     out = att W_o^T (+ b) + LoRA                   and the next norm: add_rms_norm
 *     gu = x [W_gate; W_up]^T (+ b) + LoRA of each
 *     gated = silu(gate) * up                        swiglu_f32, row by row
 *     delta = gated W_down^T (+ b) + LoRA
 *
 * A decode step of the embedded base calls about seventy kernels through ctypes and
 * their Python wrappers (checks, views, a new tensor for each output: ~7 us a LoRA
 * call, of which the kernel is ~0.3 at one row), ~0.5 ms a step whatever its rows; here
 * one call, its buffers reused from layer to layer. q, k and v stay side by side in
 * the product's output (the kernels take their row stride) where the Python path splits
 * them into three tensors, and so do gate and up.
 *
 * `p` holds the forward's fields (`F_*`) and then each layer's (`L_*`, `L_FIELDS` a
 * layer, each LoRA module `M_FIELDS` of them); `f` each layer's floats (`FL_*`). The
 * Python side (`marlaas.rollout.native`) writes them in this order; pointers as
 * integers, a LoRA module without an update has a null A.
 */
#include "kernels.h"

/* The forward's fields. */
enum {
    F_LAYERS, F_T, F_R, F_N, F_E, F_H, F_HKV, F_D, F_INTER, F_KV_BF16,
    F_UNITS, F_UNIT_TOKENS, F_ROW0,
    F_HIDDEN, F_COS, F_SIN, F_ROW, F_COL, F_LANE, F_ORDER, F_SCALE,
    F_X, F_QKV, F_ATT, F_OUT, F_GU, F_GATED, F_DELTA, F_XB, F_SCORES, F_LORA_SCRATCH,
    F_FIELDS
};
/* A LoRA module's fields (A null: no update). */
enum { M_A, M_A_SL, M_A_SR, M_B, M_B_SL, M_B_SO, M_B_SR, M_RANK, M_FIELDS };
/* The modules, in a layer's order. */
enum { Q, K, V, O, GATE, UP, DOWN, MODULES };
/* A layer's fields. */
enum {
    L_NORM1, L_NORM2, L_QKV_W, L_QKV_B, L_Q_OUT, L_K_OUT, L_V_OUT,
    L_O_W, L_O_B, L_GU_W, L_GU_B, L_DOWN_W, L_DOWN_B,
    L_Q_NORM, L_K_NORM, /* Qwen3's per-head norms' weights (null: none) */
    L_KEYS, L_VALUES, L_KV_SR, L_KV_SH, L_KV_SS, L_START, L_END,
    L_LORA, L_FIELDS = L_LORA + MODULES * M_FIELDS
};
/* A layer's floats. */
enum { FL_EPS1, FL_EPS2, FL_SCALING, FL_Q_EPS, FL_K_EPS, FL_FIELDS };

#define PTR(type, v) ((type)(intptr_t)(v))

/* The RMS norm of each of the `heads` heads (D features) of every token (row stride
 * `st`) of x, in place (Qwen3's queries and keys, before the rotary). */
static void head_norm(int64_t T, int64_t heads, int64_t D, float *x, int64_t st,
                      const float *weight, float eps) {
    for (int64_t t = 0; t < T; ++t) add_rms_norm_f32(heads, D, x + t * st, 0, weight, eps, x + t * st);
}

/* y (row stride ys) += the LoRA update of module m over x [T, in]. */
static void lora(const int64_t *p, const int64_t *m, int64_t in, int64_t out, const float *x,
                 float *y, int64_t ys) {
    if (!m[M_A]) return;
    lora_rows_strided_f32(p[F_UNITS], p[F_UNIT_TOKENS], in, out, m[M_RANK], x, y, ys,
                          PTR(const float *, m[M_A]), m[M_A_SL], m[M_A_SR],
                          PTR(const float *, m[M_B]), m[M_B_SL], m[M_B_SO], m[M_B_SR],
                          PTR(const int64_t *, p[F_LANE]), PTR(const int64_t *, p[F_ORDER]),
                          PTR(const float *, p[F_SCALE]), PTR(float *, p[F_LORA_SCRATCH]), 0);
}

void decoder_layers_f32(const int64_t *p, const float *f) {
    const int64_t T = p[F_T], R = p[F_R], N = p[F_N], E = p[F_E], H = p[F_H], Hkv = p[F_HKV];
    const int64_t D = p[F_D], I = p[F_INTER], bf16 = p[F_KV_BF16];
    float *h = PTR(float *, p[F_HIDDEN]), *x = PTR(float *, p[F_X]);
    float *qkv = PTR(float *, p[F_QKV]), *att = PTR(float *, p[F_ATT]);
    float *out = PTR(float *, p[F_OUT]), *gu = PTR(float *, p[F_GU]);
    float *gated = PTR(float *, p[F_GATED]), *delta = PTR(float *, p[F_DELTA]);
    uint16_t *xb = PTR(uint16_t *, p[F_XB]);
    const int64_t elem = bf16 ? 2 : 4;
    for (int64_t l = 0; l < p[F_LAYERS]; ++l) {
        const int64_t *L = p + F_FIELDS + l * L_FIELDS;
        const int64_t *lora_m = L + L_LORA;
        const float *fl = f + l * FL_FIELDS;
        const int64_t qo = L[L_Q_OUT], ko = L[L_K_OUT], vo = L[L_V_OUT], C = qo + ko + vo;
        add_rms_norm_f32(T, E, h, l ? delta : 0, PTR(const float *, L[L_NORM1]), fl[FL_EPS1], x);
        half_linear_rows_f32(T, C, E, x, PTR(const uint16_t *, L[L_QKV_W]),
                             PTR(const uint16_t *, L[L_QKV_B]), qkv, xb);
        lora(p, lora_m + Q * M_FIELDS, E, qo, x, qkv, C);
        lora(p, lora_m + K * M_FIELDS, E, ko, x, qkv + qo, C);
        lora(p, lora_m + V * M_FIELDS, E, vo, x, qkv + qo + ko, C);
        if (L[L_Q_NORM]) {
            head_norm(T, H, D, qkv, C, PTR(const float *, L[L_Q_NORM]), fl[FL_Q_EPS]);
            head_norm(T, Hkv, D, qkv + qo, C, PTR(const float *, L[L_K_NORM]), fl[FL_K_EPS]);
        }
        char *keys = PTR(char *, L[L_KEYS]), *values = PTR(char *, L[L_VALUES]);
        rope_store_f32(T, H, Hkv, D, D, qkv, C, qkv + qo, C, qkv + qo + ko, C,
                       PTR(const float *, p[F_COS]), PTR(const float *, p[F_SIN]), keys, values,
                       L[L_KV_SR], L[L_KV_SH], L[L_KV_SS], PTR(const int64_t *, p[F_ROW]),
                       PTR(const int64_t *, p[F_COL]), bf16);
        const int64_t at = p[F_ROW0] * L[L_KV_SR] * elem; /* the forward's first row */
        span_attention_f32(R, N, H, Hkv, D, qkv, N * C, D, C, keys + at, values + at,
                           L[L_KV_SR], L[L_KV_SH], L[L_KV_SS], PTR(const int64_t *, L[L_START]),
                           PTR(const int64_t *, L[L_END]), fl[FL_SCALING], 0.0f, att,
                           0, PTR(float *, p[F_SCORES]), bf16);
        half_linear_rows_f32(T, E, H * D, att, PTR(const uint16_t *, L[L_O_W]),
                             PTR(const uint16_t *, L[L_O_B]), out, xb);
        lora(p, lora_m + O * M_FIELDS, H * D, E, att, out, E);
        add_rms_norm_f32(T, E, h, out, PTR(const float *, L[L_NORM2]), fl[FL_EPS2], x);
        half_linear_rows_f32(T, 2 * I, E, x, PTR(const uint16_t *, L[L_GU_W]),
                             PTR(const uint16_t *, L[L_GU_B]), gu, xb);
        lora(p, lora_m + GATE * M_FIELDS, E, I, x, gu, 2 * I);
        lora(p, lora_m + UP * M_FIELDS, E, I, x, gu + I, 2 * I);
        for (int64_t t = 0; t < T; ++t) swiglu_f32(I, gu + t * 2 * I, gu + t * 2 * I + I, gated + t * I);
        half_linear_rows_f32(T, E, I, gated, PTR(const uint16_t *, L[L_DOWN_W]),
                             PTR(const uint16_t *, L[L_DOWN_B]), delta, xb);
        lora(p, lora_m + DOWN * M_FIELDS, I, E, gated, delta, E);
    }
}
