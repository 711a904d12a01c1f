/* Attention over the engine's slot cache, each query over its own span of columns:
 * `N` query tokens per cache row (1 for a decode step, a prompt chunk's tokens for a
 * prefill).
 *
 * Query b (= r * N + n: token n of cache row r) has heads h = kv * G + g (G = H / Hkv)
 * that attend columns [start[b], end[b]) of key/value head kv of cache row r: each key
 * and value vector is read once per query and kv head and serves the G query heads of
 * its group (no repeat), and only the query's own columns are read (no padding to the
 * longest row, no mask: a causal prefill reads half the columns a masked product does,
 * and the N queries of a row find its keys and values in cache). Softmax in float32 with
 * the running maximum subtracted, as torch.softmax; `softcap` > 0 applies
 * tanh(s / softcap) * softcap to the scaled scores (Gemma 2). The G heads of a group
 * sum the values in one pass, each value vector loaded once, their outputs in registers.
 *
 * Decode at 256 rows is memory-bound: each (row, kv head) block is a short run of its
 * own, where the hardware's stream prefetcher starts cold, so the kernel prefetches the
 * block it reads next (its values during its keys, the next block's keys during its
 * values). One layer at 256 rows (every version reading buffers of its own, 12 MB from
 * memory at ~100 columns): 0.74 -> 0.68 ms against the version that prefetched during
 * the values only and summed them once per head; ~200 columns no change (1.54 / 1.59
 * ms); 32 rows, in cache, 0.049 -> 0.045 ms. That is ~18 GB/s: a plain sum over the
 * same blocks reads 16 GB/s without prefetching and 29 GB/s with it, a contiguous sum
 * 55 GB/s (interleaving keys and values per row, or one online-softmax pass over
 * them, measured no faster). What decides it is whether the cache fits the last-level
 * cache: four layers of 256 rows x ~65 columns (Hkv 2, D 32) are 34 MB in float32, read
 * from memory at 15-23 GB/s (1.35-2.2 ms a step); one layer's 8.6 MB, read over and
 * over, at 40-43 GB/s. A bfloat16 cache (17 MB) reads in 0.93-0.97 ms, where this
 * kernel's arithmetic (~0.2 ms a layer, the same in either dtype) was most of the time.
 * Then: the keys loaded and widened once per group of heads, not once per head
 * (`group_scores`; a bfloat16 vector widened in one load and a shift), and the values'
 * sums kept in registers (a variable-length array of them lived in memory): one bfloat16
 * layer of 256 rows x ~65 columns in cache 0.190 -> 0.136-0.143 ms, four from memory
 * 0.955 -> 0.68-0.70 ms, the decode step of 256 rows x 32 adapters 5.07 -> 4.67 ms
 * (medians of three runs each); a causal prefill of 16 x 64 over a bfloat16 cache
 * 423 -> 327 us, over a float32 one 498 -> 361-377 us.
 *
 * Layouts (float32, the last axis contiguous): q [R, H, N, D] with strides q_sr, q_sh,
 * q_sn; keys and values [R, Hkv, S, D] (float32, or bfloat16 with `kv_bf16`: the
 * engine's cache on a CPU running bfloat16 linears) with strides kv_sr, kv_sh, kv_ss
 * (both buffers alike); start, end [R * N]; out [R, N, H, D] contiguous. `scratch` holds
 * G * (max_b end[b] - start[b]) floats. `lse` [R * N, H], when not NULL, receives each
 * query head's log-sum-exp of its scaled scores (what the backward needs: p = exp(s -
 * lse)).
 */
#include <math.h>

#include "simd.h"
#include "kernels.h"
#include "vexp.h"

#ifdef __AVX512F__
#include <immintrin.h>
#endif

/* exp of sixteen floats at once: glibc's vector math library (libmvec, linked) where the
 * compiler targets AVX-512, whose loops it does not always vectorise into that call by
 * itself; else one expf each. */
#ifdef __AVX512F__
typedef float vf16 __attribute__((vector_size(64)));
extern vf16 _ZGVeN16v_expf(vf16);
static inline void exp16(const float *x, float *out) {
    vf16 v;
    __builtin_memcpy(&v, x, sizeof v);
    v = _ZGVeN16v_expf(v);
    __builtin_memcpy(out, &v, sizeof v);
}
#else
static inline void exp16(const float *x, float *out) {
    for (int c = 0; c < W; ++c) out[c] = expf(x[c]);
}
#endif

/* p[l] = exp(p[l] - m) for l < n (n >= 1), m the largest p[l] (`row_max`, into *max);
 * their sum. Sixteen at a time with the inline exp (`vexp.h`) where the compiler targets AVX-512
 * (the scalar loop compiled to libmvec's eight-wide calls, a tenth of the decode
 * attention's time, and spilled the loop's registers around each); the last vector
 * masked. */
static inline float softmax_numerators(float *p, int64_t n, float *max) {
    const float m = row_max(p, n);
#ifdef __AVX512F__
    const __m512 mm = _mm512_set1_ps(m);
    __m512 sum = _mm512_setzero_ps();
    int64_t l = 0;
    for (; l + W <= n; l += W) {
        const __m512 e = (__m512)vexp((va)_mm512_sub_ps(_mm512_loadu_ps(p + l), mm));
        _mm512_storeu_ps(p + l, e);
        sum = _mm512_add_ps(sum, e);
    }
    if (l < n) {
        const __mmask16 tail = (__mmask16)((1u << (n - l)) - 1u);
        const __m512 e = (__m512)vexp((va)_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, p + l), mm));
        _mm512_mask_storeu_ps(p + l, tail, e);
        sum = _mm512_mask_add_ps(sum, tail, sum, e);
    }
    *max = m;
    return _mm512_reduce_add_ps(sum);
#else
    float sum = 0.0f;
    for (int64_t l = 0; l < n; ++l) {
        p[l] = expf(p[l] - m);
        sum += p[l];
    }
    *max = m;
    return sum;
#endif
}

/* Keys and values are float32, or bfloat16 where the cache holds the half dtype (`bf16`,
 * a compile-time constant in each entry point): element `i` of buffer `p` as a float, a
 * vector of sixteen from `i` on (a bfloat16 is a float32's upper half: widened, shifted),
 * and its address (to prefetch). */
typedef uint16_t vh __attribute__((vector_size(W * sizeof(uint16_t)), aligned(2), may_alias));

static inline __attribute__((always_inline)) vf kv_vec(const void *p, int64_t i, const int bf16) {
    if (bf16) {
#ifdef __AVX512F__
        /* One widening load and a shift (the generic conversion compiles to two half
         * widenings and an insert). */
        const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i));
        return (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
#else
        return (vf)(__builtin_convertvector(*(const vh *)((const uint16_t *)p + i), vi) << 16);
#endif
    }
    return *(const vf *)((const float *)p + i);
}

static inline __attribute__((always_inline)) float kv_at(const void *p, int64_t i, const int bf16) {
    return bf16 ? bf16_widen(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline __attribute__((always_inline)) const char *kv_addr(const void *p, int64_t i,
                                                               const int bf16) {
    return (const char *)p + i * (bf16 ? 2 : 4);
}

/* Prefetch a key or value vector of D elements (a cache line at a time) into the L2
 * cache, not the L1 (`prefetcht1`): a block is prefetched whole while another is read,
 * more lines than the L1's miss buffers hold, and on an AMD Zen 4 (2 cores, 32 MB L3)
 * a prefetch into the L1 that finds them full waits for one. Four bfloat16 layers of
 * 256 rows x ~80 columns (21 MB, from memory): 2.75-3.17 -> 1.15-1.60 ms; ~160 columns
 * 4.2-5.5 -> 2.3-2.5 ms; one layer in cache unchanged (0.26 ms). */
static inline __attribute__((always_inline)) void prefetch_kv(const void *p, int64_t i,
                                                            const int64_t D, const int bf16) {
    const int64_t per_line = bf16 ? 32 : 16;
    for (int64_t d = 0; d < D; d += per_line) __builtin_prefetch(kv_addr(p, i + d, bf16), 0, 2);
}

/* The scaled scores of the G query heads of a group (q + g * q_sh; G <= 16) over `cols`
 * columns c = at, at + kv_ss, ... of `k` (at most C = 16 / G: a block): head g's score
 * of column c is stored at scores[g * stride + c]. Each key vector is loaded (and
 * widened) once for the G heads, and the G x C products, each summed down to one
 * vector, are reduced together (a few shuffles a product instead of a horizontal sum
 * each). A span's last block of fewer columns goes the same way (zeros past it, only its
 * own scores stored), not one scalar dot product per column: half the columns of a causal
 * span of ~30 (a trainer's row, a prefill chunk) are such. Read per head instead, a decode
 * step of a two-head group loaded and widened every key twice. */
static inline __attribute__((always_inline)) void group_scores(
    const float *q, int64_t q_sh, const int64_t G, const void *k, int64_t at, int64_t kv_ss,
    const int64_t D, float scale, float *scores, int64_t stride, const int bf16, const int cols) {
    const int C = W / (int)G;
    vf p[W];
    for (int c = 0; c < W; ++c) p[c] = (vf){0};
    for (int c = 0; c < C; ++c) {
        if (c >= cols) break;
        const int64_t kc = at + c * kv_ss;
        for (int64_t j = 0; j < D; j += W) {
            const vf kj = kv_vec(k, kc + j, bf16);
            for (int64_t g = 0; g < G; ++g) p[g * C + c] += *(const vf *)(q + g * q_sh + j) * kj;
        }
    }
    float lanes[W];
    *(vf *)lanes = sums16(p) * scale;
    if (cols == C)  /* a whole block: each head's scores in one copy (one vector for G 1) */
        for (int64_t g = 0; g < G; ++g)
            __builtin_memcpy(scores + g * stride, lanes + g * C, (size_t)C * sizeof(float));
    else
        for (int64_t g = 0; g < G; ++g)
            for (int c = 0; c < cols; ++c) scores[g * stride + c] = lanes[g * C + c];
}

/* scores[c] = scale * (q . k_c) for `cols` (at most 16) columns: one head's block. */
static inline __attribute__((always_inline)) void scores16(const float *q, const void *k,
                                                           int64_t at, int64_t kv_ss,
                                                           const int64_t D, float scale,
                                                           float *scores, const int bf16,
                                                           const int cols) {
    group_scores(q, 0, 1, k, at, kv_ss, D, scale, scores, 0, bf16, cols);
}

static inline __attribute__((always_inline)) void attend(
    int64_t R, int64_t N, int64_t H, int64_t Hkv, const int64_t D, const int64_t G,
    const float *q, int64_t q_sr, int64_t q_sh, int64_t q_sn, const void *k, const void *v,
    int64_t kv_sr, int64_t kv_sh, int64_t kv_ss, const int64_t *start, const int64_t *end,
    float scale, float softcap, float *out, float *lse, float *scratch, const int bf16) {
    for (int64_t b = 0; b < R * N; ++b) {
        const int64_t row = b / N;
        const int64_t s0 = start[b];
        const int64_t n = end[b] - s0;
        for (int64_t kv = 0; kv < Hkv; ++kv) {
            const int64_t at = row * kv_sr + kv * kv_sh + s0 * kv_ss;  /* column s0's */
            const float *qb = q + row * q_sr + (b % N) * q_sn + kv * G * q_sh;
            float *ob = out + (b * H + kv * G) * D;
            /* The blocks are read in the order keys, values, next keys, ...: while one is
             * read, the next one is prefetched, a column of it per column of this one (a
             * block is a short run of its own, where the hardware's stream prefetcher
             * starts cold). Here: the next kv head's keys, or the next row's first; none
             * where the next query token of a prefill row reads the columns this one
             * just did. */
            const int64_t nb = kv + 1 < Hkv ? b : b + 1;
            const int64_t nkv = kv + 1 < Hkv ? kv + 1 : 0;
            const int64_t nn = nb < R * N && (nkv || nb / N != row) ? end[nb] - start[nb] : 0;
            const int64_t nat = nn ? (nb / N) * kv_sr + nkv * kv_sh + start[nb] * kv_ss : 0;
            int64_t l0 = 0;
            if (D % W == 0) {  /* a block of C columns at a time, the last one fewer */
                /* The group's heads GS at a time (all of them up to sixteen). */
                const int64_t GS = G <= W ? G : 1, C = W / GS;
                for (; l0 < n; l0 += C) {
                    const int cols = l0 + C <= n ? (int)C : (int)(n - l0);
                    for (int64_t c = 0; c < cols; ++c)  /* this block's values */
                        prefetch_kv(v, at + (l0 + c) * kv_ss, D, bf16);
                    for (int64_t g0 = 0; g0 < G; g0 += GS) {
                        if (cols == C)  /* a whole block: its column count a constant */
                            group_scores(qb + g0 * q_sh, q_sh, GS, k, at + l0 * kv_ss, kv_ss, D,
                                         scale, scratch + g0 * n + l0, n, bf16, (int)C);
                        else
                            group_scores(qb + g0 * q_sh, q_sh, GS, k, at + l0 * kv_ss, kv_ss, D,
                                         scale, scratch + g0 * n + l0, n, bf16, cols);
                    }
                }
            }
            for (int64_t l = l0; l < n; ++l) {  /* a head size off the vector width */
                const int64_t kl = at + l * kv_ss;
                prefetch_kv(v, kl, D, bf16);
                for (int64_t g = 0; g < G; ++g) {
                    const float *qg = qb + g * q_sh;
                    float dot = 0.0f;
                    for (int64_t d = 0; d < D; ++d) dot += qg[d] * kv_at(k, kl + d, bf16);
                    scratch[g * n + l] = dot * scale;
                }
            }
            float inv[G];
            for (int64_t g = 0; g < G; ++g) {
                float *p = scratch + g * n;
                if (softcap > 0.0f)
                    for (int64_t l = 0; l < n; ++l) p[l] = tanhf(p[l] / softcap) * softcap;
                float m;
                const float sum = softmax_numerators(p, n, &m);
                inv[g] = 1.0f / sum;
                if (lse) lse[b * H + kv * G + g] = m + logf(sum);
            }
            /* The values, a block of up to eight heads of the group by as many sixteen-
             * dimension vectors as make eight at most (all of them for the embedded
             * base's two heads of 32) a pass over the columns: each value vector loaded
             * once for the block's heads, their outputs in registers (local arrays of
             * constant size, as G and D are constants for the common shapes: sized by
             * them, they would be variable-length arrays the compiler keeps in memory, a
             * store and reload per column), two columns at a time into separate sums
             * (independent chains of multiply-adds), normalised once at the end. A pass
             * per sixteen dimensions read the weights and walked the columns again for
             * each: 5.9 -> 5.3 ns a row's kv head's column at 64 rows (in L2), 6.7 -> 6.3
             * at 256; the same sums in the same order. */
            if (D % W == 0) {
                const int64_t GS = G < 8 ? G : 8, DB = 8 / GS < D / W ? 8 / GS : D / W;
                for (int64_t d0 = 0; d0 < D; d0 += DB * W)
                    for (int64_t g0 = 0; g0 < G; g0 += GS) {
                        const int64_t gs = G - g0 < GS ? G - g0 : GS;
                        const int64_t dn = (D - d0) / W < DB ? (D - d0) / W : DB;
                        const float *w = scratch + g0 * n;
                        va even[8], odd[8]; /* head g's vector dv at g * DB + dv */
                        for (int64_t i = 0; i < 8; ++i) even[i] = odd[i] = (va){0};
                        const int first = d0 == 0 && g0 == 0;  /* prefetch during the first pass */
                        int64_t l = 0;
                        for (; l + 2 <= n; l += 2) {
                            if (first && l < nn) prefetch_kv(k, nat + l * kv_ss, D, bf16);
                            if (first && l + 1 < nn) prefetch_kv(k, nat + (l + 1) * kv_ss, D, bf16);
                            va x0[8], x1[8];
                            for (int64_t dv = 0; dv < dn; ++dv) {
                                x0[dv] = (va)kv_vec(v, at + l * kv_ss + d0 + dv * W, bf16);
                                x1[dv] = (va)kv_vec(v, at + (l + 1) * kv_ss + d0 + dv * W, bf16);
                            }
                            for (int64_t g = 0; g < gs; ++g) {
                                const float w0 = w[g * n + l], w1 = w[g * n + l + 1];
                                for (int64_t dv = 0; dv < dn; ++dv) {
                                    even[g * DB + dv] += w0 * x0[dv];
                                    odd[g * DB + dv] += w1 * x1[dv];
                                }
                            }
                        }
                        if (l < n) {
                            if (first && l < nn) prefetch_kv(k, nat + l * kv_ss, D, bf16);
                            for (int64_t dv = 0; dv < dn; ++dv) {
                                const va x0 = (va)kv_vec(v, at + l * kv_ss + d0 + dv * W, bf16);
                                for (int64_t g = 0; g < gs; ++g) even[g * DB + dv] += w[g * n + l] * x0;
                            }
                        }
                        for (int64_t g = 0; g < gs; ++g)
                            for (int64_t dv = 0; dv < dn; ++dv)
                                *(vf *)(ob + (g0 + g) * D + d0 + dv * W) =
                                    (vf)((even[g * DB + dv] + odd[g * DB + dv]) * inv[g0 + g]);
                    }
            } else {
                for (int64_t g = 0; g < G; ++g)
                    for (int64_t d = 0; d < D; ++d) ob[g * D + d] = 0.0f;
                for (int64_t l = 0; l < n; ++l) {
                    const int64_t vl = at + l * kv_ss;
                    if (l < nn) prefetch_kv(k, nat + l * kv_ss, D, bf16);
                    for (int64_t g = 0; g < G; ++g) {
                        const float w = scratch[g * n + l] * inv[g];
                        for (int64_t d = 0; d < D; ++d) ob[g * D + d] += w * kv_at(v, vl + d, bf16);
                    }
                }
            }
            for (int64_t l = n; l < nn; ++l) prefetch_kv(k, nat + l * kv_ss, D, bf16);
        }
    }
}

/* The head size D and the group size G as compile-time constants for the common shapes
 * (`SPECIALISED`, simd.h). */
#define ATTEND(DIM, GROUP) attend(R, N, H, Hkv, DIM, GROUP, q, q_sr, q_sh, q_sn, k, v, kv_sr, \
                                  kv_sh, kv_ss, start, end, scale, softcap, out, lse, scratch, \
                                  bf16)

/* `bf16` 0: float32 keys and values; 1: bfloat16 ones (the engine's cache on a CPU
 * running bfloat16 linears: half the bytes a decode step reads, which is most of what it
 * reads at many rows). */
void span_attention_f32(int64_t R, int64_t N, int64_t H, int64_t Hkv, int64_t D,
                          const float *q, int64_t q_sr, int64_t q_sh, int64_t q_sn,
                          const void *k, const void *v,
                          int64_t kv_sr, int64_t kv_sh, int64_t kv_ss,
                          const int64_t *start, const int64_t *end,
                          float scale, float softcap, float *out, float *lse, float *scratch,
                          int64_t kv_bf16) {
    const int64_t G = H / Hkv;
    if (kv_bf16) {
        const int bf16 = 1;
        SPECIALISED(ATTEND)
    } else {
        const int bf16 = 0;
        SPECIALISED(ATTEND)
    }
}

/* The backward of `span_attention_f32` (the trainer's attention): given the forward's
 * output `out`, its log-sum-exp `lse` and the output's gradient `dout`, the gradients of
 * the queries (`dq`, written), keys and values (`dk`, `dv`, added to: the caller zeroes
 * them). Per query head and attended column l, with p_l = exp(scale q.k_l - lse) and
 * delta = dout.out:
 *
 *     dv_l += p_l dout        ds_l = p_l (dout.v_l - delta)
 *     dq   += scale ds_l k_l  dk_l += scale ds_l q
 *
 * The scores and dout.v of sixteen columns are reduced together (`scores16`); the query
 * gradients of a group accumulate in registers. No soft-capping (the caller declines
 * it). Layouts as the forward's; out, dout and dq [R, N, H, D] contiguous; dk and dv
 * with the keys' strides. */
/* One block of `cols` (at most 16) columns from l0 of `attend_backward`, for the G heads
 * of a group: the block's probabilities and score gradients for every head (the sixteen
 * exponentials in one vector call), then each column's key and value gradients read and
 * written once for all the heads, a vector of D at a time (the backward was bound by
 * those stores, and by scalar expf calls); the query gradients accumulate in `acc`. */
static inline __attribute__((always_inline)) void backward_block(
    const int64_t D, const int64_t G, const float *qb, int64_t q_sh, const float *kb,
    const float *vb, float *dkb, float *dvb, int64_t kv_ss, const float *dout, int64_t h0,
    const float *lg, const float *delta, float scale, float acc[G][D], int64_t l0,
    const int cols) {
    float p[G][W], ds[G][W];
    for (int64_t g = 0; g < G; ++g) {
        float s[W] = {0}, dp[W] = {0};
        scores16(qb + g * q_sh, kb, l0 * kv_ss, kv_ss, D, scale, s, 0, cols);
        scores16(dout + (h0 + g) * D, vb, l0 * kv_ss, kv_ss, D, 1.0f, dp, 0, cols);
        for (int c = 0; c < W; ++c) s[c] -= lg[g];
        exp16(s, p[g]);
        for (int c = 0; c < W; ++c) ds[g][c] = p[g][c] * (dp[c] - delta[g]) * scale;
    }
    /* Sixteen dimensions at a time for up to eight heads: their queries, output
     * gradients and the block's query gradients in registers (local arrays of constant
     * size; `acc`, a variable-length array, lives in memory and is added to once). */
    for (int64_t g0 = 0; g0 < G; g0 += 8) {
        const int64_t gs = G - g0 < 8 ? G - g0 : 8;
        for (int64_t d = 0; d < D; d += W) {
            va qd[8], dod[8], dqd[8];
            for (int64_t g = 0; g < gs; ++g) {
                qd[g] = (va)(*(const vf *)(qb + (g0 + g) * q_sh + d));
                dod[g] = (va)(*(const vf *)(dout + (h0 + g0 + g) * D + d));
                dqd[g] = (va){0};
            }
            for (int c = 0; c < cols; ++c) {
                const int64_t at = (l0 + c) * kv_ss + d;
                const va kd = (va)(*(const vf *)(kb + at));
                va dvd = (va)(*(vf *)(dvb + at)), dkd = (va)(*(vf *)(dkb + at));
                for (int64_t g = 0; g < gs; ++g) {
                    dvd += p[g0 + g][c] * dod[g];
                    dkd += ds[g0 + g][c] * qd[g];
                    dqd[g] += ds[g0 + g][c] * kd;
                }
                *(vf *)(dvb + at) = (vf)dvd;
                *(vf *)(dkb + at) = (vf)dkd;
            }
            for (int64_t g = 0; g < gs; ++g) *(vf *)(acc[g0 + g] + d) += (vf)dqd[g];
        }
    }
}

static inline __attribute__((always_inline)) void attend_backward(
    int64_t R, int64_t N, int64_t H, int64_t Hkv, const int64_t D, const int64_t G,
    const float *q, int64_t q_sr, int64_t q_sh, int64_t q_sn, const float *k, const float *v,
    int64_t kv_sr, int64_t kv_sh, int64_t kv_ss, const int64_t *start, const int64_t *end,
    float scale, const float *out, const float *dout, const float *lse, float *dq, float *dk,
    float *dv) {
    for (int64_t b = 0; b < R * N; ++b) {
        const int64_t row = b / N;
        const int64_t s0 = start[b];
        const int64_t n = end[b] - s0;
        for (int64_t kv = 0; kv < Hkv; ++kv) {
            const int64_t at = row * kv_sr + kv * kv_sh + s0 * kv_ss;
            const float *kb = k + at, *vb = v + at;
            float *dkb = dk + at, *dvb = dv + at;
            const float *qb = q + row * q_sr + (b % N) * q_sn + kv * G * q_sh;
            const int64_t h0 = b * H + kv * G;
            float delta[G], lg[G], acc[G][D];
            for (int64_t g = 0; g < G; ++g) {
                float d0 = 0.0f;
                for (int64_t d = 0; d < D; ++d) d0 += dout[(h0 + g) * D + d] * out[(h0 + g) * D + d];
                delta[g] = d0;
                lg[g] = lse[h0 + g];
                for (int64_t d = 0; d < D; ++d) acc[g][d] = 0.0f;
            }
            int64_t l0 = 0;
            if (D % W == 0)  /* sixteen columns at a time, the last block fewer */
                for (; l0 < n; l0 += W) {
                    if (l0 + W <= n)
                        backward_block(D, G, qb, q_sh, kb, vb, dkb, dvb, kv_ss, dout, h0, lg,
                                       delta, scale, acc, l0, W);
                    else
                        backward_block(D, G, qb, q_sh, kb, vb, dkb, dvb, kv_ss, dout, h0, lg,
                                       delta, scale, acc, l0, (int)(n - l0));
                }
            for (int64_t l = l0; l < n; ++l) {
                const float *kl = kb + l * kv_ss, *vl = vb + l * kv_ss;
                float *dkl = dkb + l * kv_ss, *dvl = dvb + l * kv_ss;
                for (int64_t g = 0; g < G; ++g) {
                    const float *qg = qb + g * q_sh, *dog = dout + (h0 + g) * D;
                    float sd = 0.0f, pd = 0.0f;
                    for (int64_t d = 0; d < D; ++d) {
                        sd += qg[d] * kl[d];
                        pd += dog[d] * vl[d];
                    }
                    const float p = expf(sd * scale - lg[g]);
                    const float ds = p * (pd - delta[g]) * scale;
                    for (int64_t d = 0; d < D; ++d) {
                        dvl[d] += p * dog[d];
                        acc[g][d] += ds * kl[d];
                        dkl[d] += ds * qg[d];
                    }
                }
            }
            for (int64_t g = 0; g < G; ++g)
                for (int64_t d = 0; d < D; ++d) dq[(h0 + g) * D + d] = acc[g][d];
        }
    }
}

#define BACKWARD(DIM, GROUP) attend_backward(R, N, H, Hkv, DIM, GROUP, q, q_sr, q_sh, q_sn, k, v, \
                                             kv_sr, kv_sh, kv_ss, start, end, scale, out, dout, \
                                             lse, dq, dk, dv)

void span_attention_backward_f32(int64_t R, int64_t N, int64_t H, int64_t Hkv, int64_t D,
                                 const float *q, int64_t q_sr, int64_t q_sh, int64_t q_sn,
                                 const float *k, const float *v,
                                 int64_t kv_sr, int64_t kv_sh, int64_t kv_ss,
                                 const int64_t *start, const int64_t *end, float scale,
                                 const float *out, const float *dout, const float *lse,
                                 float *dq, float *dk, float *dv) {
    const int64_t G = H / Hkv;
    SPECIALISED(BACKWARD)
}
