/* The kernels that other kernels call (`decoder_layers.c` and `train_layers.c` run an
 * engine forward's and a training pass's layers through them): their definitions include this header too, so a signature
 * changed on one side and not the other does not compile. */
#ifndef MARLAAS_KERNELS_H
#define MARLAAS_KERNELS_H

#include <stdint.h>

void add_rms_norm_f32(int64_t T, int64_t E, float *h, const float *delta, const float *weight,
                      float eps, float *out);
void half_linear_rows_f32(int64_t M, int64_t N, int64_t K, const float *x, const uint16_t *Wp,
                          const uint16_t *b, float *y, uint16_t *xb);
void lora_rows_strided_f32(int64_t U, int64_t T, int64_t in, int64_t out, int64_t r,
                           const float *x, float *y, int64_t ys,
                           const float *A, int64_t a_sl, int64_t a_sr,
                           const float *B, int64_t b_sl, int64_t b_so, int64_t b_sr,
                           const int64_t *lane, const int64_t *order, const float *scale,
                           float *scratch, float *tape);
void lora_rows_backward_strided_f32(int64_t U, int64_t T, int64_t in, int64_t out, int64_t r,
                                    const float *x, const float *g, int64_t g_st, float *gx,
                                    const float *A, int64_t a_sl, int64_t a_sr,
                                    const float *B, int64_t b_sl, int64_t b_so, int64_t b_sr,
                                    const int64_t *lane, const int64_t *order,
                                    const float *scale, float *gA, float *gBt, float *scratch,
                                    int64_t add_gx, const float *tape, uint8_t *fresh);
void rms_norm_backward_f32(int64_t T, int64_t E, const float *h, const float *weight,
                           const float *g, float eps, float *gh, float *gw);
void rotary_f32(int64_t T, int64_t H, int64_t D, const float *restrict x,
                const float *restrict cos, const float *restrict sin, float *restrict out,
                int64_t transpose);
void rope_store_f32(int64_t T, int64_t H, int64_t Hkv, int64_t D, int64_t rot,
                    float *q, int64_t q_st, const float *k, int64_t k_st,
                    const float *v, int64_t v_st, const float *cos, const float *sin,
                    void *keys, void *values, int64_t c_sr, int64_t c_sh, int64_t c_ss,
                    const int64_t *row, const int64_t *col, int64_t bf16);
void span_attention_f32(int64_t R, int64_t N, int64_t H, int64_t Hkv, int64_t D,
                        const float *q, int64_t q_sr, int64_t q_sh, int64_t q_sn,
                        const void *k, const void *v,
                        int64_t kv_sr, int64_t kv_sh, int64_t kv_ss,
                        const int64_t *start, const int64_t *end,
                        float scale, float softcap, float *out, float *lse, float *scratch,
                        int64_t kv_bf16);
void span_attention_backward_f32(int64_t R, int64_t N, int64_t H, int64_t Hkv, int64_t D,
                                 const float *q, int64_t q_sr, int64_t q_sh, int64_t q_sn,
                                 const float *k, const float *v,
                                 int64_t kv_sr, int64_t kv_sh, int64_t kv_ss,
                                 const int64_t *start, const int64_t *end, float scale,
                                 const float *out, const float *dout, const float *lse,
                                 float *dq, float *dk, float *dv);
void span_tiles_f32(int64_t R, int64_t N, int64_t H, int64_t Hkv, int64_t D,
                    const float *q, int64_t q_sr, int64_t q_sh, int64_t q_sn,
                    const void *k, const void *v, int64_t kv_sr, int64_t kv_sh, int64_t kv_ss,
                    const int64_t *start, const int64_t *end,
                    float scale, float softcap, float *out, float *lse, float *scratch,
                    int64_t kv_bf16);
void span_tiles_backward_f32(int64_t R, int64_t N, int64_t H, int64_t Hkv, int64_t D,
                             const float *q, int64_t q_sr, int64_t q_sh, int64_t q_sn,
                             const float *k, const float *v,
                             int64_t kv_sr, int64_t kv_sh, int64_t kv_ss,
                             const int64_t *start, const int64_t *end, float scale,
                             const float *out, const float *dout, const float *lse,
                             float *dq, float *dk, float *dv);
void swiglu_f32(int64_t n, const float *restrict g, const float *restrict u, float *restrict y);
void swiglu_backward_f32(int64_t n, const float *restrict g, const float *restrict u,
                         const float *restrict dy, float *restrict dg, float *restrict du);

#endif
