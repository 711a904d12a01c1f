/* What the tiled span attention's forward (`span_tiles.c`, whose comment says how the
 * tiles work) and backward (`span_tiles_backward.c`) share: the vector helpers, the
 * tiles' gathering and setup, the transposes, the score blocks and small products,
 * the prefetch and the driver loop over the tiles (`FOR_TILES`). Static: each file's
 * object has its own copies, inlined where they are used. */
#ifndef MARLAAS_SPAN_TILES_H
#define MARLAAS_SPAN_TILES_H

#include <math.h>
#include <stdint.h>

#include "simd.h"
#include "vexp.h"
#include "kernels.h"

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#define CMAX 64  /* columns per chunk: the tile's stack buffers are [CMAX][16] floats */
#define CB 8     /* columns per block of the products (eight accumulators, or sixteen) */
#define DMAX 128 /* the largest head size taken */

/* A masked-out score: below any real one, and finite (-ffast-math assumes no
 * infinities). */
#define NEG (-1e30f)

static const float zeros[DMAX] __attribute__((aligned(64)));

/* The log of the forward's sums: one libmvec (or libm) call per tile. */
#ifdef __AVX512F__
extern va _ZGVeN16v_logf(va);
static inline va vlog(va x) { return _ZGVeN16v_logf(x); }
#else
static inline va vlog(va x) {
    for (int i = 0; i < W; ++i) x[i] = logf(x[i]);
    return x;
}
#endif

/* A lane mask (which of the sixteen lanes), lane-wise a where set else b, the
 * lane-wise maximum, and exp(x) where set else 0 (a masked lane's argument is anything,
 * -1e30 included). With AVX-512 a mask register: one compare, a blend or a zeroing
 * move (the vector extensions' lane masks took a compare, a move to a vector and a
 * ternary logic op each, ~4% of a forward tile's time in the running maximum alone). */
#ifdef __AVX512F__
typedef __mmask16 lanes;
static inline lanes lanes_where_ge(vi a, vi b) {
    return _mm512_cmpge_epi32_mask((__m512i)a, (__m512i)b);
}
static inline lanes lanes_where_lt(vi a, vi b) {
    return _mm512_cmplt_epi32_mask((__m512i)a, (__m512i)b);
}
static inline lanes lanes_and(lanes a, lanes b) { return a & b; }
static inline va vselect(lanes ok, va a, va b) {
    return (va)_mm512_mask_blend_ps(ok, (__m512)b, (__m512)a);
}
static inline va vmax(va a, va b) { return (va)_mm512_max_ps((__m512)a, (__m512)b); }
static inline va vexp_in(va x, lanes ok) { return (va)_mm512_maskz_mov_ps(ok, (__m512)vexp(x)); }
static const lanes ALL = 0xFFFF;
#else
typedef vi lanes;
static inline lanes lanes_where_ge(vi a, vi b) { return a >= b; }
static inline lanes lanes_where_lt(vi a, vi b) { return a < b; }
static inline lanes lanes_and(lanes a, lanes b) { return a & b; }
static inline va vselect(lanes ok, va a, va b) { return (va)(((vi)a & ok) | ((vi)b & ~ok)); }
static inline va vmax(va a, va b) { return vselect(a > b, a, b); }
static inline va vexp_in(va x, lanes ok) { return (va)((vi)vexp(x) & ok); }
static const lanes ALL = {-1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1};
#endif

static inline float vsum(va x) {
    float s = 0.0f;
    for (int i = 0; i < W; ++i) s += x[i];
    return s;
}

/* The dot product of two vectors of D floats. */
static inline __attribute__((always_inline)) float dot(const int64_t D, const float *a,
                                                       const float *b) {
    va s = (va){0};
    for (int64_t d = 0; d < D; d += W) s += (va)(*(const vf *)(a + d)) * (va)(*(const vf *)(b + d));
    return vsum(s);
}

/* One tile: sixteen lanes, lane i the query head G * qi + g of the tile's qi-th query
 * token (16 / G tokens; lanes past the tile's tokens are unused: their query reads
 * zeros, their span is empty, their results go to a sink). Keys and values, and their
 * gradients, are rows of D floats (the stride taken), column c at c * D. */
typedef struct {
    int64_t o[W];      /* the lane's query head b * H + h (its row of out, lse, dq); -1 unused */
    const float *q[W]; /* its query vector (zeros where unused) */
    vi s, e;           /* its span [s, e) relative to u0 (0, 0 where unused) */
    int64_t u0, u1;    /* the union of the lanes' spans: columns [u0, u1) */
    int64_t hs[2], he[2]; /* lanes 0-7's and 8-15's union, relative to u0 (0, 0: unused) */
} Tile;

/* The query tokens a tile gathers, while their spans nearly coincide. */
typedef struct {
    int64_t b[W];                /* the tokens' queries b = row * N + n */
    int64_t count, cap;          /* how many, and how many it takes */
    int64_t u0, u1, widest;      /* the union of their spans, the widest span */
} Gather;

/* Whether span [s, e) joins gather `t`: it has room, the span overlaps the union (the
 * trainer's one row of all tokens: the next sequence's first token does not), and the
 * union stays within `slack` columns of the widest span (a causal row: the union is the
 * last token's span; a sliding window: one column wider a token). */
static inline int joins(const Gather *t, int64_t s, int64_t e, int64_t slack) {
    const int64_t u0 = s < t->u0 ? s : t->u0, u1 = e > t->u1 ? e : t->u1;
    const int64_t widest = e - s > t->widest ? e - s : t->widest;
    return t->count < t->cap && s < t->u1 && e > t->u0 && u1 - u0 <= widest + slack;
}

/* The end of the run of tokens from n on (of row b0's N) whose spans are wider than one
 * column and overlap their predecessor's: the tokens a row's tiles cover. */
static inline int64_t run_end(const int64_t *start, const int64_t *end, int64_t b0,
                              int64_t n, int64_t N) {
    int64_t m = n + 1;
    while (m < N && end[b0 + m] - start[b0 + m] > 1 && start[b0 + m] < end[b0 + m - 1] &&
           end[b0 + m] > start[b0 + m - 1])
        ++m;
    return m;
}

static inline void gather_add(Gather *t, int64_t b, int64_t s, int64_t e) {
    if (t->count == 0) {
        t->u0 = s, t->u1 = e, t->widest = e - s;
    } else {
        t->u0 = s < t->u0 ? s : t->u0;
        t->u1 = e > t->u1 ? e : t->u1;
        t->widest = e - s > t->widest ? e - s : t->widest;
    }
    t->b[t->count++] = b;
}

/* The tile of a gather's tokens for kv head kv (qr: the row's first query of the kv
 * head's first query head). */
static inline __attribute__((always_inline)) void tile_of(
    Tile *t, const Gather *gt, int64_t row, int64_t N, int64_t H, int64_t kv, const int64_t G,
    const float *qr, int64_t q_sh, int64_t q_sn, const int64_t *start, const int64_t *end) {
    vi s = {0}, e = {0};
    for (int i = 0; i < W; ++i) {
        const int qi = i / (int)G;
        if (qi < gt->count) {
            const int64_t b = gt->b[qi], g = i % G;
            t->o[i] = b * H + kv * G + g;
            t->q[i] = qr + (b - row * N) * q_sn + g * q_sh;
            s[i] = (int32_t)(start[b] - gt->u0);
            e[i] = (int32_t)(end[b] - gt->u0);
        } else {
            t->o[i] = -1;
            t->q[i] = zeros;
        }
    }
    t->s = s, t->e = e, t->u0 = gt->u0, t->u1 = gt->u1;
    for (int h = 0; h < 2; ++h) {
        t->hs[h] = t->he[h] = 0;
        for (int i = 8 * h; i < 8 * h + 8; ++i)
            if (t->o[i] >= 0) {
                const int first = t->he[h] == 0;
                t->hs[h] = first || s[i] < t->hs[h] ? s[i] : t->hs[h];
                t->he[h] = first || e[i] > t->he[h] ? e[i] : t->he[h];
            }
    }
}

/* The lanes whose span meets columns [rel, rel + nc) (relative to u0), a bit each:
 * those whose weights in those columns are not all zero (none of the unused ones). */
static inline unsigned lanes_meeting(const Tile *t, int64_t rel, int64_t nc) {
    const vi meet = (t->s < (int32_t)(rel + nc)) & (t->e > (int32_t)rel);
#ifdef __AVX512F__
    return (unsigned)_mm512_test_epi32_mask((__m512i)meet, (__m512i)meet);
#else
    unsigned bits = 0;
    for (int i = 0; i < W; ++i) bits |= meet[i] ? 1u << i : 0u;
    return bits;
#endif
}

/* Lanes whose span holds column `rel` (relative to the tile's u0): all ones, else 0. */
static inline lanes in_span(const Tile *t, int64_t rel) {
    const vi c = (vi){0} + (int32_t)rel;
    return lanes_and(lanes_where_ge(c, t->s), lanes_where_lt(c, t->e));
}

/* T [D][16] = the sixteen lanes' vectors `rows[i]` [D], transposed sixteen dimensions
 * at a time in registers. With AVX-512: interleaves of floats, then of pairs (in-lane
 * shuffles), then two rounds of 128-bit block shuffles, 64 in all: 19 ns per 16 x 32
 * block, where four rounds of two-source permutes (each swapping one bit of the lane
 * index with the dimension's: the portable version below) took 66. A backward tile
 * transposes two (its queries, their output gradients), a forward one. */
#ifdef __AVX512F__
static inline __attribute__((always_inline)) void transpose16(va *r) {
    __m512 t[W], u[W];
    for (int i = 0; i < W; i += 2) {
        t[i] = _mm512_unpacklo_ps((__m512)r[i], (__m512)r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps((__m512)r[i], (__m512)r[i + 1]);
    }
    for (int i = 0; i < W; i += 4)
        for (int j = 0; j < 2; ++j) {
            u[i + 2 * j] = (__m512)_mm512_unpacklo_pd((__m512d)t[i + j], (__m512d)t[i + j + 2]);
            u[i + 2 * j + 1] = (__m512)_mm512_unpackhi_pd((__m512d)t[i + j], (__m512d)t[i + j + 2]);
        }
    /* u[4a + c] holds, in each 128-bit block k, column 4k + c of rows 4a .. 4a + 3. */
    for (int h = 0; h < 2; ++h)
        for (int c = 0; c < 4; ++c) {
            t[8 * h + c] = _mm512_shuffle_f32x4(u[8 * h + c], u[8 * h + 4 + c], 0x88);
            t[8 * h + 4 + c] = _mm512_shuffle_f32x4(u[8 * h + c], u[8 * h + 4 + c], 0xDD);
        }
    for (int c = 0; c < 8; ++c) {
        r[c] = (va)_mm512_shuffle_f32x4(t[c], t[8 + c], 0x88);
        r[8 + c] = (va)_mm512_shuffle_f32x4(t[c], t[8 + c], 0xDD);
    }
}
#else
static const vi SWAP_LO[4] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23},
    {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27},
    {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29},
    {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30},
};
static const vi SWAP_HI[4] = {
    {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31},
    {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31},
    {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31},
    {1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31},
};
static inline void transpose16(va *r) {
    for (int s = 0; s < 4; ++s) {
        const int bit = 8 >> s;
        for (int i = 0; i < W; ++i)
            if (!(i & bit)) {
                const va x = r[i], y = r[i | bit];
                r[i] = __builtin_shuffle(x, y, SWAP_LO[s]);
                r[i | bit] = __builtin_shuffle(x, y, SWAP_HI[s]);
            }
    }
}
#endif

static inline __attribute__((always_inline)) void transpose_lanes(const int64_t D,
                                                                  const float *const *rows,
                                                                  float *T) {
    for (int64_t d0 = 0; d0 < D; d0 += W) {
        va r[W];
        for (int i = 0; i < W; ++i) r[i] = (va)(*(const vf *)(rows[i] + d0));
        transpose16(r);
        for (int j = 0; j < W; ++j) *(va *)(T + (d0 + j) * W) = r[j];
    }
}

/* The lanes' dot products with NC columns from ka (rows of D): a[j][i] =
 * sum_d ka[j][d] * Ta[d][i], and with `two` the same of Tb and kb into b (the
 * backward's scores and dout.v of the same columns, whose p and ds then follow in
 * registers). One multiply-add per column and dimension, the key element broadcast from
 * memory (at a constant offset from ka: rows at a runtime stride held eight pointers,
 * which the compiler kept in vector registers and moved out for every load), in eight
 * or more independent accumulators (the multiply-add's latency times its two ports): P
 * partial sums a column where there are fewer columns. */
static inline __attribute__((always_inline)) void dots(const int64_t D, const int NC,
                                                       const int two, const float *Ta,
                                                       const float *ka, va *a, const float *Tb,
                                                       const float *kb, va *b) {
    const int chains = two ? 2 * NC : NC;
    const int P = chains >= 8 ? 1 : chains >= 4 ? 2 : chains >= 2 ? 4 : 8;
    va x[CB][8], y[CB][8];
    for (int j = 0; j < NC; ++j)
        for (int p = 0; p < P; ++p) x[j][p] = y[j][p] = (va){0};
    for (int64_t d = 0; d < D; d += P)
        for (int p = 0; p < P; ++p) {
            const va ta = *(const va *)(Ta + (d + p) * W);
            for (int j = 0; j < NC; ++j) x[j][p] += ka[j * D + d + p] * ta;
            if (two) {
                const va tb = *(const va *)(Tb + (d + p) * W);
                for (int j = 0; j < NC; ++j) y[j][p] += kb[j * D + d + p] * tb;
            }
        }
    for (int j = 0; j < NC; ++j) {
        for (int p = 1; p < P; ++p) x[j][0] += x[j][p], y[j][0] += y[j][p];
        a[j] = x[j][0];
        if (two) b[j] = y[j][0];
    }
}

/* Blocks of eight columns, then one of the rest, which takes about its share of a
 * block's time (the first version computed the last eight columns again instead: ~12%
 * of the scores' work at the trainer's spans). `BLOCK(j0, NC)` runs block j0 of NC
 * columns (NC a constant). */
#define BY_BLOCKS(cols, BLOCK)                              \
    do {                                                    \
        int64_t j0 = 0;                                     \
        for (; j0 + CB <= (cols); j0 += CB) BLOCK(j0, CB);  \
        switch ((cols) - j0) {                              \
            case 0: break;                                  \
            case 1: BLOCK(j0, 1); break;                    \
            case 2: BLOCK(j0, 2); break;                    \
            case 3: BLOCK(j0, 3); break;                    \
            case 4: BLOCK(j0, 4); break;                    \
            case 5: BLOCK(j0, 5); break;                    \
            case 6: BLOCK(j0, 6); break;                    \
            default: BLOCK(j0, 7); break;                   \
        }                                                   \
    } while (0)

/* The forward's scores of a chunk's `cols` columns from kc (column c0 of the tile):
 * scaled, -1e30 off each lane's span, into sc, and their running maximum into *m
 * (folded in as each block leaves its registers, not in a pass of its own). */
static inline __attribute__((always_inline)) void forward_scores(
    const int64_t D, const Tile *t, const float *qT, const float *kc, int64_t c0,
    int64_t cols, float scale, float (*sc)[W], va *m) {
    va mc = *m;
#define FORWARD_BLOCK(j0, NC)                                                            \
    do {                                                                                 \
        va s[CB];                                                                        \
        dots(D, NC, 0, qT, kc + (j0) * D, s, 0, 0, 0);                                   \
        for (int j = 0; j < NC; ++j) {                                                   \
            s[j] = vselect(in_span(t, c0 - t->u0 + (j0) + j), s[j] * scale,              \
                           (va){0} + NEG);                                               \
            *(va *)sc[(j0) + j] = s[j];                                                  \
            mc = vmax(mc, s[j]);                                                         \
        }                                                                                \
    } while (0)
    BY_BLOCKS(cols, FORWARD_BLOCK);
#undef FORWARD_BLOCK
    *m = mc;
}

/* The backward's p = exp(scale q.k - lse) (0 off each lane's span) and ds = p (dout.v -
 * delta) scale of a chunk's `cols` columns (column c0 of the tile) into ps and ds, the
 * scores and dout.v of a block in registers together. */
static inline __attribute__((always_inline)) void backward_scores(
    const int64_t D, const Tile *t, const float *qT, const float *doT, const float *kc,
    const float *vc, int64_t c0, int64_t cols, float scale, va lg, va delta,
    float (*ps)[W], float (*ds)[W]) {
#define BACKWARD_BLOCK(j0, NC)                                                           \
    do {                                                                                 \
        va s[CB], dp[CB];                                                                \
        dots(D, NC, 1, qT, kc + (j0) * D, s, doT, vc + (j0) * D, dp);                    \
        for (int j = 0; j < NC; ++j) {                                                   \
            const va p = vexp_in(s[j] * scale - lg, in_span(t, c0 - t->u0 + (j0) + j));  \
            *(va *)ps[(j0) + j] = p;                                                     \
            *(va *)ds[(j0) + j] = p * (dp[j] - delta) * scale;                           \
        }                                                                                \
    } while (0)
    BY_BLOCKS(cols, BACKWARD_BLOCK);
#undef BACKWARD_BLOCK
}

/* Per lane i: dst_i = [src_i * sin_i] + (sum_{j < cols} w[j][i] * row_j) [* sout_i], the
 * rows of D from `rows` (the forward's value sums; the backward's query gradients):
 * eight lanes by 32 dimensions at a time in sixteen accumulators, each column's row
 * loaded once for the eight lanes, their weights broadcast from the tile. Each eight
 * lanes sum only the columns [lo, hi) their spans meet (`jlo`, `jhi`: the others'
 * weights are zeros). `src` NULL: from zero; `sin` / `sout` NULL: no scaling. */
static inline __attribute__((always_inline)) void lane_gemm(
    const int64_t D, const float (*w)[W], const int64_t *jlo, const int64_t *jhi,
    const float *rows, float *const *src, const float *sin, float *const *dst,
    const float *sout) {
    const int DB = D % (2 * W) == 0 ? 2 : 1;
    for (int i0 = 0; i0 < W; i0 += 8)
        for (int64_t d0 = 0; d0 < D; d0 += DB * W) {
            va a[8][2];
            for (int i = 0; i < 8; ++i)
                for (int x = 0; x < DB; ++x)
                    a[i][x] = src ? (va)(*(const vf *)(src[i0 + i] + d0 + x * W)) *
                                        (sin ? sin[i0 + i] : 1.0f)
                                  : (va){0};
            for (int64_t j = jlo[i0 / 8]; j < jhi[i0 / 8]; ++j) {
                va r[2];
                for (int x = 0; x < DB; ++x) r[x] = (va)(*(const vf *)(rows + j * D + d0 + x * W));
                for (int i = 0; i < 8; ++i)
                    for (int x = 0; x < DB; ++x) a[i][x] += w[j][i0 + i] * r[x];
            }
            for (int i = 0; i < 8; ++i)
                for (int x = 0; x < DB; ++x)
                    *(vf *)(dst[i0 + i] + d0 + x * W) =
                        (vf)(sout ? a[i][x] * sout[i0 + i] : a[i][x]);
        }
}

/* A chunk's columns [lo, hi) each eight lanes of `t` meet (chunk from column c0, `cols`
 * of them). */
static inline void half_ranges(const Tile *t, int64_t c0, int64_t cols, int64_t *lo,
                               int64_t *hi) {
    for (int h = 0; h < 2; ++h) {
        const int64_t a = t->hs[h] - (c0 - t->u0), b = t->he[h] - (c0 - t->u0);
        lo[h] = a < 0 ? 0 : a;
        hi[h] = b > cols ? cols : b;
    }
}

/* Per column j < NC: dst_j += sum_i w[j][i] * x_i, for the lanes' rows x_i [D] and
 * dst's rows of D (the key and value gradients): NC columns by 32 dimensions in up to
 * sixteen accumulators over the lanes, eight at a time where one of them is in `bits`
 * (those whose span meets the block: the others' weights are zeros; skipped, a partial
 * tile's unused lanes and a causal tile's lanes whose span ends before the block), then
 * one add to memory per column vector (the per-query kernel read and wrote each
 * column's gradients once per query head). */
static inline __attribute__((always_inline)) void column_block(
    const int64_t D, const float (*w)[W], const int NC, const float *const *x, float *dst,
    unsigned bits) {
    const int DB = D % (2 * W) == 0 ? 2 : 1;
    for (int64_t d0 = 0; d0 < D; d0 += DB * W) {
        va a[CB][2];
        for (int j = 0; j < NC; ++j) a[j][0] = a[j][1] = (va){0};
        for (int i0 = 0; i0 < W; i0 += 8) {
            if (!((bits >> i0) & 0xFF)) continue;
            for (int i = i0; i < i0 + 8; ++i) {
                va r[2];
                for (int y = 0; y < DB; ++y) r[y] = (va)(*(const vf *)(x[i] + d0 + y * W));
                for (int j = 0; j < NC; ++j)
                    for (int y = 0; y < DB; ++y) a[j][y] += w[j][i] * r[y];
            }
        }
        for (int j = 0; j < NC; ++j)
            for (int y = 0; y < DB; ++y) *(vf *)(dst + j * D + d0 + y * W) += (vf)a[j][y];
    }
}

/* column_block over a chunk's `cols` columns from c0 (blocks of eight, then the rest). */
static inline __attribute__((always_inline)) void column_gemm(
    const int64_t D, const Tile *t, int64_t c0, const float (*w)[W], int64_t cols,
    const float *const *x, float *dst) {
    int64_t j0 = 0;
    for (; j0 + CB <= cols; j0 += CB)
        column_block(D, w + j0, CB, x, dst + j0 * D, lanes_meeting(t, c0 - t->u0 + j0, CB));
    const unsigned bits = lanes_meeting(t, c0 - t->u0 + j0, cols - j0);
    switch (cols - j0) {
        case 0: break;
        case 1: column_block(D, w + j0, 1, x, dst + j0 * D, bits); break;
        case 2: column_block(D, w + j0, 2, x, dst + j0 * D, bits); break;
        case 3: column_block(D, w + j0, 3, x, dst + j0 * D, bits); break;
        case 4: column_block(D, w + j0, 4, x, dst + j0 * D, bits); break;
        case 5: column_block(D, w + j0, 5, x, dst + j0 * D, bits); break;
        case 6: column_block(D, w + j0, 6, x, dst + j0 * D, bits); break;
        default: column_block(D, w + j0, 7, x, dst + j0 * D, bits); break;
    }
}

/* A tile function of the head size D: its copy for D 32, 64 or 128 (constants), else
 * the one for any D (each file defines its `_32`, `_64`, `_128` and `_any`). */
#define BY_HEAD_SIZE(F, ...)                                      \
    (D == 32 ? F##_32(D, __VA_ARGS__) : D == 64 ? F##_64(D, __VA_ARGS__) \
     : D == 128 ? F##_128(D, __VA_ARGS__) : F##_any(D, __VA_ARGS__))

/* Prefetch what token b (row b / N) reads and writes for kv head kv: its G query heads'
 * queries (q, with stride q_sh), their rows of the `nh` arrays `hr` (out, dout and dq,
 * or the forward's out: contiguous, G * D floats from (b H + kv G) D; rows written are
 * fetched ahead too, not on the store), and its span's key / value rows in the `nkv`
 * arrays `kvs` (only the last column where the token before started at the same
 * column: a causal row's tokens each add one). At 128 rows the backward's arrays (~11
 * MB) come from the last-level cache, whose latency the tiles otherwise waited on: 7.8
 * us a row at 128 rows against 4.7 at 16 (in L2); prefetched, 4.8. */
static inline __attribute__((always_inline)) void prefetch_token(
    const int64_t D, const int64_t G, int64_t b, int64_t N, int64_t H, int64_t kv,
    const float *q, int64_t q_sr, int64_t q_sh, int64_t q_sn, const float *const *hr, int nh,
    const float *const *kvs, int nkv, int64_t kv_sr, int64_t kv_sh, const int64_t *start,
    const int64_t *end) {
    const int64_t row = b / N, n = b % N;
    for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; d += W)
            __builtin_prefetch(q + row * q_sr + n * q_sn + (kv * G + g) * q_sh + d, 0, 3);
    for (int a = 0; a < nh; ++a)
        for (int64_t d = 0; d < G * D; d += W)
            __builtin_prefetch(hr[a] + (b * H + kv * G) * D + d, 0, 3);
    const int64_t from = n && start[b] == start[b - 1] ? end[b] - 1 : start[b];
    for (int a = 0; a < nkv; ++a)
        for (int64_t c = from; c < end[b]; ++c)
            for (int64_t d = 0; d < D; d += W)
                __builtin_prefetch(kvs[a] + row * kv_sr + kv * kv_sh + c * D + d, 0, 3);
}

/* Each kv head, each row: its query tokens in order, each single-column one by itself,
 * the others gathered into tiles of up to 16 / G tokens while their spans join
 * (`joins`). A run's tiles are aligned to its end, the partial one first: a causal
 * tile's cost is its last token's span (the union), so the short tile goes where spans
 * are short (the suffix pass, G 2: 1.38 -> 1.28 lane-columns computed per one used).
 * The token 16 / G ahead is prefetched as each is taken (`prefetch_token`). */
#define ARRAY(...) {__VA_ARGS__}
#define FOR_TILES(SINGLE, TILE, HR, NH, KVS, NKV)                                           \
    const int64_t QN = W / G;                                                               \
    const float *const hr_[] = HR;                                                          \
    const float *const kvs_[] = KVS;                                                        \
    for (int64_t kv = 0; kv < Hkv; ++kv)                                                    \
        for (int64_t row = 0; row < R; ++row) {                                             \
            const int64_t at = row * kv_sr + kv * kv_sh;                                    \
            const float *qr = q + row * q_sr + kv * G * q_sh;                               \
            Gather gt = {.count = 0};                                                       \
            Tile t;                                                                         \
            int64_t run = 0;                                                                \
            for (int64_t n = 0; n < N; ++n) {                                               \
                const int64_t b = row * N + n, s = start[b], e = end[b];                    \
                if (b + QN < R * N)                                                         \
                    prefetch_token(D, G, b + QN, N, H, kv, q, q_sr, q_sh, q_sn, hr_, NH,    \
                                   kvs_, NKV, kv_sr, kv_sh, start, end);                    \
                if (e - s == 1) {                                                           \
                    SINGLE;                                                                 \
                    continue;                                                               \
                }                                                                           \
                if (gt.count && !joins(&gt, s, e, QN)) {                                    \
                    tile_of(&t, &gt, row, N, H, kv, G, qr, q_sh, q_sn, start, end);         \
                    TILE;                                                                   \
                    gt.count = 0;                                                           \
                }                                                                           \
                if (gt.count == 0) {                                                        \
                    if (n >= run) run = run_end(start, end, row * N, n, N);                 \
                    gt.cap = (run - n) % QN ? (run - n) % QN : QN;                          \
                }                                                                           \
                gather_add(&gt, b, s, e);                                                   \
            }                                                                               \
            if (gt.count) {                                                                 \
                tile_of(&t, &gt, row, N, H, kv, G, qr, q_sh, q_sn, start, end);             \
                TILE;                                                                       \
            }                                                                               \
        }

/* Whether the tiles take the shape: a head size of whole vectors the stack buffers
 * hold, a group that fits the sixteen lanes, keys and values in rows of D (the
 * trainer's; a cache's other strides go to the per-query kernels). */
static inline int tiles_take(int64_t H, int64_t Hkv, int64_t D, int64_t kv_ss) {
    return Hkv > 0 && H % Hkv == 0 && H / Hkv <= W && D > 0 && D % W == 0 && D <= DMAX &&
           kv_ss == D;
}

/* D and G as compile-time constants for the common shapes (`SPECIALISED`, simd.h): here
 * the drivers (the lane setup divides by G), each calling the tile functions of its head
 * size. */

#endif
