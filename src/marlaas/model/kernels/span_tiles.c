/* The trainer's span attention (`span_attention.c`: the same arguments, layouts and
 * results up to float rounding) computed a tile at a time (this file the forward,
 * `span_tiles_backward.c` the backward, `span_tiles.h` what they share): sixteen query heads of one
 * row and kv head against the union of their spans, as small matrix products.
 *
 * Why: at the trainer's shapes (head size 32, spans of 17-40 columns) the per-query
 * kernels are bound by instructions, not arithmetic. Each query head's score of a column
 * is a dot product of D = 32, two multiply-adds, whose sixteen results a block must sum
 * across lanes (`sums16`: ~45 shuffles and adds per sixteen scores), and the softmax,
 * the value sums and the backward's five products run per query head over short columns:
 * ~35 GFLOP/s forward and ~58 backward on one core of this machine (an AMD EPYC core
 * with AVX-512, where torch's float32 matmul reaches ~120 GFLOP/s and a loop of
 * independent multiply-adds in registers ~285).
 *
 * How: a tile's sixteen query heads are the sixteen lanes of a vector (16 / G
 * consecutive query tokens of the row times the G heads of the kv group: their spans
 * nearly coincide, the trainer's causal ends one apart). Their queries are transposed
 * once into qT [D][16] (`transpose_lanes`, in registers), so that the scores of a column
 * are sum_d k[c][d] * qT[d]: one multiply-add per d with the key element broadcast from
 * memory, no reduction across lanes (`dots`, eight columns at a time in eight
 * accumulators). With the query heads in lanes, the softmax over the columns is
 * element-wise too: the mask, the running maximum, the exponentials (inline, `vexp`) and
 * their sum are one vector per column for all sixteen heads. The weighted value sums,
 * and in the backward the key, value and query gradients, are products of the
 * [columns x 16] probability or score-gradient tile with the lanes' rows or the columns' rows
 * (`lane_gemm`, `column_gemm`), the tile's weight broadcast from memory and sixteen
 * accumulators in registers. In isolation each of these products runs at 250-285
 * GFLOP/s; a backward tile of 30 columns in cache at ~210 (the transposes, the
 * exponentials and the tile's setup are the rest), a forward one at ~175.
 *
 * A tile reads the union of its lanes' spans, each lane masked to its own columns
 * (scores of others -> -1e30 before the softmax, probabilities 0): correct for any
 * spans, fast where they nearly coincide (`FOR_TILES` gathers tokens while they do). The
 * trainer's do: a row's valid tokens share one start and their ends rise by one a token,
 * so a tile of eight tokens (G = 2) computes ~3.5 columns a lane it does not need over
 * ~28 it does; at the suffix pass below, with partial tiles, 1.28 lane-columns are
 * computed per one used. Single-column queries (padding queries, a left-padded row's
 * first token) skip the tiles (`column_forward`, `column_backward`). Columns are taken
 * 64 at a time (`CMAX`), the forward's softmax online across such chunks (flash
 * attention's rescaling), so any span length works in fixed memory: a trainer tile (at
 * most 40 columns) is one chunk.
 *
 * Taken: float32 keys and values in rows of D (kv_ss == D, the trainer's), no
 * soft-capping, head sizes a multiple of sixteen up to 128, groups up to sixteen heads;
 * D 32, 64 and 128 compiled as constants (the tiles), G 1, 2, 4 and 8 too (the drivers),
 * as span_attention.c does. Anything else is passed on to `span_attention_f32` /
 * `span_attention_backward_f32` (linked in). Nothing is allocated: the tiles use no
 * `scratch`, but the forward hands it on where it passes the call on, so a caller that
 * may meet such a shape passes span_attention_f32's (G * widest span floats); the stack
 * holds ~25 KB forward and ~32 KB backward at D 128, ~14 / ~19 KB at D 32 (the
 * compiler's -fstack-usage, the entry point and the tile function together).
 *
 * Measured on one core, best of 50, the old and the tiled kernels alternating in one run
 * (the trainer's benchmark: suffix pass 128 rows x 24 query slots, H 4, Hkv 2, D 32, 40
 * columns of which 16 past, 8-24 valid tokens a row, the rest padding; prefix pass 32
 * rows x 16, 16 columns, left-padded):
 *     suffix  forward 0.69 -> 0.26 ms        backward 1.05 -> 0.53-0.54 ms (2.2x)
 *     prefix  forward 0.072-0.075 -> 0.029   backward 0.110 -> 0.053-0.054  (2.2x)
 *     suffix, D 64 and G 1: 1.8-1.9x; D 32 and G 4: 2.1-2.15x
 * and in train_layers.c's layout (one row of the valid tokens, keys [Hkv, rows, S, D]):
 *     suffix  forward 0.63 -> 0.24 ms        backward 0.87-0.89 -> 0.48 ms (2.1x)
 *     prefix  forward 0.070 -> 0.027 ms      backward 0.090 -> 0.048 ms     (2.1x)
 * Each change measured the same way: libmvec's expf took a vector holding a masked
 * lane's -1e30 through one scalar expf per lane (the tiles at first half the old
 * kernels' speed); rows read at a runtime stride kept eight pointers, which the compiler
 * put in vector registers and moved out for each load (switching its vectoriser off
 * there: backward 1.45 -> 0.94 ms at that stage; rows at constant offsets, as now, need
 * no pointers); inline exp instead of libmvec's (which spilled the loop's registers
 * around each call): backward 0.79 -> 0.69 ms; tiles aligned to a run's end: 1.38 ->
 * 1.28 lane-columns per used one; prefetching the token 16 / G ahead: backward 7.8 ->
 * 4.8 us a row at 128 rows (4.7 at 16 rows, in L2); the transpose by in-lane
 * interleaves: 66 -> 19 ns a 16 x 32 block; scores with their softmax in registers: 0.92
 * -> 0.88 ms forward and backward.
 */
#include "span_tiles.h"

/* One tile's forward: scores, softmax online across chunks of CMAX columns, value sums
 * (into `acc` between chunks, into out at the last), log-sum-exp. */
static inline __attribute__((always_inline)) void forward_tile(
    const int64_t D, const Tile *t, const float *kb, const float *vb, float scale, float *out,
    float *lse) {
    float qT[D * W] __attribute__((aligned(64)));
    float sc[CMAX][W] __attribute__((aligned(64)));
    float acc[W][D] __attribute__((aligned(64)));
    float sink[D] __attribute__((aligned(64)));
    float alpha_l[W] __attribute__((aligned(64))), inv_l[W] __attribute__((aligned(64)));
    float *accp[W], *outp[W];
    for (int i = 0; i < W; ++i) {
        accp[i] = acc[i];
        outp[i] = t->o[i] < 0 ? sink : out + t->o[i] * D;
    }
    transpose_lanes(D, t->q, qT);
    va m = (va){0} + NEG, l = (va){0};
    for (int64_t c0 = t->u0; c0 < t->u1; c0 += CMAX) {
        const int64_t cols = t->u1 - c0 < CMAX ? t->u1 - c0 : CMAX;
        const int first = c0 == t->u0, last = c0 + cols == t->u1;
        va mc = m;
        forward_scores(D, t, qT, kb + c0 * D, c0, cols, scale, sc, &mc);
        const va alpha = vexp_in(m - mc, ALL);  /* ~0 where m was NEG */
        l *= alpha;
        for (int64_t j = 0; j < cols; ++j) {
            /* A lane with no column yet has mc = NEG: exp(0) = 1, masked off. */
            const va p = vexp_in(*(va *)sc[j] - mc, in_span(t, c0 - t->u0 + j));
            *(va *)sc[j] = p;
            l += p;
        }
        m = mc;
        *(va *)alpha_l = alpha;
        *(va *)inv_l = 1.0f / vmax(l, (va){0} + 1e-30f);  /* used lanes: l >= 1 */
        int64_t lo[2], hi[2];
        half_ranges(t, c0, cols, lo, hi);
        lane_gemm(D, (const float(*)[W])sc, lo, hi, vb + c0 * D, first ? 0 : accp, alpha_l,
                  last ? outp : accp, last ? inv_l : 0);
    }
    if (lse) {
        const va ls = m + vlog(l);
        for (int i = 0; i < W; ++i)
            if (t->o[i] >= 0) lse[t->o[i]] = ls[i];
    }
}

/* The tile function once per head size (32, 64, 128 and any other): it depends on D
 * only, the drivers below on D and G. */
#define TILE_FUNCTIONS(DIM, NAME)                                                            \
    static __attribute__((noinline)) void forward_tile_##NAME(                               \
        int64_t D, const Tile *t, const float *kb, const float *vb, float scale, float *out, \
        float *lse) {                                                                        \
        (void)D;                                                                             \
        forward_tile(DIM, t, kb, vb, scale, out, lse);                                       \
    }
TILE_FUNCTIONS(32, 32)
TILE_FUNCTIONS(64, 64)
TILE_FUNCTIONS(128, 128)
TILE_FUNCTIONS(D, any)

/* The single-column query (a padding query, a causal row's first token): its output is
 * that column's value (p = 1), its log-sum-exp its score; in the backward p ~ 1 and
 * ds = p dout.(v - out) scale ~ 0 (0 where out is the forward's, exactly v). Outside
 * the tiles, where a sixteen-lane tile for it would compute its neighbours' columns.
 * `h0`: its first query head's index b * H + kv * G. */
static inline __attribute__((always_inline)) void column_forward(
    const int64_t D, const int64_t G, const float *qn, int64_t q_sh, const float *kc,
    const float *vc, float scale, float *out, float *lse, int64_t h0) {
    for (int64_t g = 0; g < G; ++g) {
        for (int64_t d = 0; d < D; d += W) *(vf *)(out + (h0 + g) * D + d) = *(const vf *)(vc + d);
        if (lse) lse[h0 + g] = dot(D, qn + g * q_sh, kc) * scale;
    }
}

static inline __attribute__((always_inline)) void tiles_forward(
    int64_t R, int64_t N, int64_t H, int64_t Hkv, const int64_t D, const int64_t G,
    const float *q, int64_t q_sr, int64_t q_sh, int64_t q_sn, const float *k, const float *v,
    int64_t kv_sr, int64_t kv_sh, const int64_t *start, const int64_t *end, float scale,
    float *out, float *lse) {
    FOR_TILES(column_forward(D, G, qr + n * q_sn, q_sh, k + at + s * D, v + at + s * D, scale,
                             out, lse, b * H + kv * G),
              BY_HEAD_SIZE(forward_tile, &t, k + at, v + at, scale, out, lse), ARRAY(out), 1,
              ARRAY(k, v), 2)
}

#define FORWARD(DIM, GROUP) tiles_forward(R, N, H, Hkv, DIM, GROUP, q, q_sr, q_sh, q_sn, \
                                          (const float *)k, (const float *)v, kv_sr, kv_sh, \
                                          start, end, scale, out, lse)

void span_tiles_f32(int64_t R, int64_t N, int64_t H, int64_t Hkv, int64_t D,
                    const float *q, int64_t q_sr, int64_t q_sh, int64_t q_sn,
                    const void *k, const void *v, int64_t kv_sr, int64_t kv_sh, int64_t kv_ss,
                    const int64_t *start, const int64_t *end,
                    float scale, float softcap, float *out, float *lse, float *scratch,
                    int64_t kv_bf16) {
    if (kv_bf16 || softcap > 0.0f || !tiles_take(H, Hkv, D, kv_ss)) {
        span_attention_f32(R, N, H, Hkv, D, q, q_sr, q_sh, q_sn, k, v, kv_sr, kv_sh, kv_ss,
                           start, end, scale, softcap, out, lse, scratch, kv_bf16);
        return;
    }
    const int64_t G = H / Hkv;
    SPECIALISED(FORWARD)
}

