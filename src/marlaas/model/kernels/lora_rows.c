/* The LoRA update of rows that each use their own adapter, added in place:
 *
 *     y[u, t] += scale[lane[u]] * B[lane[u]] (A[lane[u]] x[u, t])
 *
 * for the `T` tokens t of every unit u (a decode row, or a row of a few tokens). Each
 * token reads its lane's weights where they lie (no per-row copy of the weights, no
 * gather of the activations into per-lane pieces, no scatter back): two small
 * matrix-vector products per token, in vector registers.
 *
 * - down, h = A x: eight rank rows at a time, each a vector accumulator over `in`.
 * - up, y += B h: along `out`, one vector of y at a time kept in a register while the
 *   `r` columns of B add into it.
 * - one-token units of one lane (decode rows, a packed forward's tokens) go two at a
 *   time (`down2`, `up2`), each load of the weights serving both: 256 rows of 32 lanes,
 *   `[128] -> [352]` rank 8, 27.6-27.8 -> 22.8-22.9 us a call; 2,048 rows 155 -> 118-124.
 * `up` reads B rank-major (`out` contiguous), which is how the adapter bank stores it;
 * B in PEFT's own layout (`r` contiguous) is transposed into `scratch` once per run of a
 * lane's units, visited in `order` (the caller sorts them by lane).
 *
 * Layouts (float32): x [U * T, in] and y [U * T, out] contiguous; A [L, r, in] with
 * strides a_sl, a_sr (the last axis contiguous); B [L, out, r] with strides b_sl, b_so,
 * b_sr (one of b_so, b_sr is 1); lane and order [U]; scale [L], or NULL for weights
 * that carry their scale; r <= 64. `scratch` holds r * out floats (used when b_so != 1).
 */
#include <string.h>

#include "simd.h"
#include "kernels.h"

#define GROUP 8

/* h[k] = s * (A_k . x) for k < r. A group past r repeats row r - 1 (results unused). */
static inline void down(const float *A, int64_t a_sr, int64_t r, const float *x, int64_t in,
                        float s, float *h) {
    for (int64_t k0 = 0; k0 < r; k0 += GROUP) {
        const float *row[GROUP];
        for (int g = 0; g < GROUP; ++g) row[g] = A + (k0 + g < r ? k0 + g : r - 1) * a_sr;
        vf acc[GROUP] = {{0}};
        int64_t i = 0;
        for (; i + W <= in; i += W) {
            const vf xv = *(const vf *)(x + i);
            for (int g = 0; g < GROUP; ++g) acc[g] += *(const vf *)(row[g] + i) * xv;
        }
        const vf dots = sums8(acc);
        for (int g = 0; g < GROUP && k0 + g < r; ++g) {
            float dot = dots[g];
            for (int64_t j = i; j < in; ++j) dot += row[g][j] * x[j];
            h[k0 + g] = dot * s;
        }
    }
}

/* y[o] += sum_k h[k] * Bt[k * bt_sk + o], `V` vectors of y at a time: V independent
 * chains of `r` multiply-adds, which overlap (a multiply-add's latency is several of its
 * issue slots: four chains kept the units half idle). */
#define UP_BLOCK(V)                                                                   \
    for (; o + V * W <= out; o += V * W) {                                            \
        vf a[V];                                                                      \
        for (int v = 0; v < V; ++v) a[v] = *(vf *)(y + o + v * W);                   \
        for (int64_t k = 0; k < r; ++k) {                                             \
            const float hk = h[k];                                                    \
            const float *b = Bt + k * bt_sk + o;                                      \
            for (int v = 0; v < V; ++v) a[v] += hk * *(const vf *)(b + v * W);        \
        }                                                                             \
        for (int v = 0; v < V; ++v) *(vf *)(y + o + v * W) = a[v];                   \
    }
static inline void up(const float *Bt, int64_t bt_sk, int64_t r, const float *h, float *y,
                      int64_t out) {
    int64_t o = 0;
    UP_BLOCK(8)
    UP_BLOCK(4)
    UP_BLOCK(1)
    for (; o < out; ++o) {
        float acc = y[o];
        for (int64_t k = 0; k < r; ++k) acc += h[k] * Bt[k * bt_sk + o];
        y[o] = acc;
    }
}

/* `down` for two tokens of one lane: each load of A serves both (the one-token loop
 * loads as many vectors as it multiplies). */
static inline void down2(const float *A, int64_t a_sr, int64_t r, const float *x0,
                         const float *x1, int64_t in, float s, float *h0, float *h1) {
    for (int64_t k0 = 0; k0 < r; k0 += GROUP) {
        const float *row[GROUP];
        for (int g = 0; g < GROUP; ++g) row[g] = A + (k0 + g < r ? k0 + g : r - 1) * a_sr;
        vf acc0[GROUP] = {{0}}, acc1[GROUP] = {{0}};
        int64_t i = 0;
        for (; i + W <= in; i += W) {
            const vf xv0 = *(const vf *)(x0 + i), xv1 = *(const vf *)(x1 + i);
            for (int g = 0; g < GROUP; ++g) {
                const vf a = *(const vf *)(row[g] + i);
                acc0[g] += a * xv0;
                acc1[g] += a * xv1;
            }
        }
        const vf dots0 = sums8(acc0), dots1 = sums8(acc1);
        for (int g = 0; g < GROUP && k0 + g < r; ++g) {
            float dot0 = dots0[g], dot1 = dots1[g];
            for (int64_t j = i; j < in; ++j) {
                dot0 += row[g][j] * x0[j];
                dot1 += row[g][j] * x1[j];
            }
            h0[k0 + g] = dot0 * s;
            h1[k0 + g] = dot1 * s;
        }
    }
}

/* `up` for two tokens of one lane: each load of B serves both. */
static inline void up2(const float *Bt, int64_t bt_sk, int64_t r, const float *h0,
                       const float *h1, float *y0, float *y1, int64_t out) {
    int64_t o = 0;
    for (; o + 4 * W <= out; o += 4 * W) {
        vf a0 = *(vf *)(y0 + o), a1 = *(vf *)(y0 + o + W);
        vf a2 = *(vf *)(y0 + o + 2 * W), a3 = *(vf *)(y0 + o + 3 * W);
        vf c0 = *(vf *)(y1 + o), c1 = *(vf *)(y1 + o + W);
        vf c2 = *(vf *)(y1 + o + 2 * W), c3 = *(vf *)(y1 + o + 3 * W);
        for (int64_t k = 0; k < r; ++k) {
            const float p = h0[k], q = h1[k];
            const float *b = Bt + k * bt_sk + o;
            const vf b0 = *(const vf *)b, b1 = *(const vf *)(b + W);
            const vf b2 = *(const vf *)(b + 2 * W), b3 = *(const vf *)(b + 3 * W);
            a0 += p * b0;
            a1 += p * b1;
            a2 += p * b2;
            a3 += p * b3;
            c0 += q * b0;
            c1 += q * b1;
            c2 += q * b2;
            c3 += q * b3;
        }
        *(vf *)(y0 + o) = a0;
        *(vf *)(y0 + o + W) = a1;
        *(vf *)(y0 + o + 2 * W) = a2;
        *(vf *)(y0 + o + 3 * W) = a3;
        *(vf *)(y1 + o) = c0;
        *(vf *)(y1 + o + W) = c1;
        *(vf *)(y1 + o + 2 * W) = c2;
        *(vf *)(y1 + o + 3 * W) = c3;
    }
    if (o < out) {  /* the last columns: one token at a time */
        up(Bt + o, bt_sk, r, h0, y0 + o, out - o);
        up(Bt + o, bt_sk, r, h1, y1 + o, out - o);
    }
}

/* An 8 x 16 block of a lane's B or its gradient between its two layouts, in registers:
 * rank-major a[k] (rank k's sixteen outputs) and PEFT's p[q] (outputs 2q and 2q + 1,
 * their eight ranks each). Three rounds of two-source shuffles, each interleaving (or,
 * back, separating) lanes by ones, twos and fours (simd.h's masks); a strided copy
 * element by element costs ~10x more (the trainer's per-lane transposes of B, ~2.5 ms
 * of a 32-tenant step). */
static inline void ranks_to_outputs(const vf *a, vf *p) {
    vf b[8], c[4][2];
    for (int m = 0; m < 4; ++m) {  /* b[4h + m]: ranks 2m, 2m + 1 of outputs 8h .. 8h + 7 */
        b[m] = __builtin_shuffle(a[2 * m], a[2 * m + 1], I1_LO);
        b[m + 4] = __builtin_shuffle(a[2 * m], a[2 * m + 1], I1_HI);
    }
    for (int h = 0; h < 2; ++h)  /* c[q][g]: ranks 4g .. 4g + 3 of outputs 4q .. 4q + 3 */
        for (int g = 0; g < 2; ++g) {
            c[2 * h][g] = __builtin_shuffle(b[4 * h + 2 * g], b[4 * h + 2 * g + 1], I2_LO);
            c[2 * h + 1][g] = __builtin_shuffle(b[4 * h + 2 * g], b[4 * h + 2 * g + 1], I2_HI);
        }
    for (int q = 0; q < 4; ++q) {
        p[2 * q] = __builtin_shuffle(c[q][0], c[q][1], I4_LO);
        p[2 * q + 1] = __builtin_shuffle(c[q][0], c[q][1], I4_HI);
    }
}

/* The inverse of `ranks_to_outputs` (each round's inverse: the separating masks, simd.h). */
static inline void outputs_to_ranks(const vf *p, vf *a) {
    vf b[8], c[4][2];
    for (int q = 0; q < 4; ++q) {
        c[q][0] = __builtin_shuffle(p[2 * q], p[2 * q + 1], LO8);
        c[q][1] = __builtin_shuffle(p[2 * q], p[2 * q + 1], HI8);
    }
    for (int h = 0; h < 2; ++h)
        for (int g = 0; g < 2; ++g) {
            b[4 * h + 2 * g] = __builtin_shuffle(c[2 * h][g], c[2 * h + 1][g], LO4);
            b[4 * h + 2 * g + 1] = __builtin_shuffle(c[2 * h][g], c[2 * h + 1][g], HI4);
        }
    for (int m = 0; m < 4; ++m) {
        a[2 * m] = __builtin_shuffle(b[m], b[m + 4], LO2);
        a[2 * m + 1] = __builtin_shuffle(b[m], b[m + 4], HI2);
    }
}

/* A lane's B rank-major (`r` rows of `out`, row stride `*bt_sk`): in place where it
 * already is (b_so == 1), else transposed into `scratch`. */
static inline const float *rank_major(const float *Bl, int64_t b_so, int64_t b_sr, int64_t r,
                                      int64_t out, float *scratch, int64_t *bt_sk) {
    if (b_so == 1) {
        *bt_sk = b_sr;
        return Bl;
    }
    int64_t o0 = 0;
    if (r == 8 && b_so == 8 && b_sr == 1)  /* PEFT's, dense: sixteen outputs at a time */
        for (; o0 + W <= out; o0 += W) {
            vf p[8], a[8];
            for (int q = 0; q < 8; ++q) p[q] = *(const vf *)(Bl + (o0 + 2 * q) * 8);
            outputs_to_ranks(p, a);
            for (int k = 0; k < 8; ++k) *(vf *)(scratch + k * out + o0) = a[k];
        }
    for (int64_t k = 0; k < r; ++k)  /* contiguous stores: the loads are the strided side */
        for (int64_t o = o0; o < out; ++o) scratch[k * out + o] = Bl[o * b_so + k * b_sr];
    *bt_sk = out;
    return scratch;
}

/* The next lane's weights (and, for the backward, its gradients) brought into L2 while
 * the current lane's units run, a share of the lines at each unit (or pair of one-token
 * units) rather than all of them at the lane's first: the per-row kernels visit lanes in
 * turn and each lane's weights come from memory otherwise. Prefetched in one burst, the
 * ~240 lines of a lane's module (rank 8, 128 -> 352) filled the core's queue of misses
 * and the prefetch instructions waited on memory (half of `lora_rows_strided_f32`'s own
 * samples in a decode step at 256 rows x 32 adapters, on an Intel Xeon whose memory
 * copies ~11 GB/s). Spread, in-process A/B by iteration (decode) or by step (trainer, 32
 * tenants): decode 0.97-0.99 of the time while the machine's memory was slow, 0.99-1.0
 * while it was fast; the trainer's step 0.977-0.981 (three runs). Up to four regions
 * (A's rows, B's, the backward's gradients of each, written), each `rows` rows `stride`
 * floats apart of `lines` cache lines. */
#define REGIONS 4
typedef struct {
    const float *base[REGIONS];
    int64_t rows[REGIONS], stride[REGIONS], lines[REGIONS];
    int write[REGIONS];
    int64_t regions, region, row, line, left;
} Ahead;

static inline void ahead_add(Ahead *a, const float *base, int64_t rows, int64_t stride,
                             int64_t floats, int write) {
    if (a->regions == REGIONS || rows <= 0) return;
    const int64_t k = a->regions++;
    a->base[k] = base, a->rows[k] = rows, a->stride[k] = stride;
    a->lines[k] = (floats + W - 1) / W, a->write[k] = write;
    a->left += rows * a->lines[k];
}

static inline Ahead ahead_of(const float *A, int64_t a_sr, int64_t r, int64_t in,
                             const float *B, int64_t b_so, int64_t b_sr, int64_t out) {
    Ahead a;
    memset(&a, 0, sizeof a);
    ahead_add(&a, A, r, a_sr, in, 0);
    if (b_so == 1) /* rank-major: each rank's row of B is contiguous */
        ahead_add(&a, B, r, b_sr, out, 0);
    else if (b_sr == 1) /* PEFT's: out rows of r contiguous floats, one run */
        ahead_add(&a, B, 1, 0, out * b_so, 0);
    return a;
}

/* The next `count` lines of `a` into L2. */
static inline void ahead_step(Ahead *a, int64_t count) {
    for (; count > 0 && a->left > 0; --count, --a->left) {
        while (a->row >= a->rows[a->region]) ++a->region, a->row = 0, a->line = 0;
        const float *at = a->base[a->region] + a->row * a->stride[a->region] + a->line * W;
        if (a->write[a->region])
            __builtin_prefetch(at, 1, 2);
        else
            __builtin_prefetch(at, 0, 2);
        if (++a->line == a->lines[a->region]) a->line = 0, ++a->row;
    }
}

/* The end of the run of unit order[j]'s lane: the first k > j whose unit is of another
 * lane (U: none), so the run has k - j units and the next lane is lane[order[k]]. */
static inline int64_t run_end(int64_t U, const int64_t *lane, const int64_t *order, int64_t j) {
    int64_t k = j + 1;
    while (k < U && lane[order[k]] == lane[order[j]]) ++k;
    return k;
}

/* The lines of `a` to prefetch at each of `steps` steps (all of them by the last). */
static inline int64_t ahead_share(const Ahead *a, int64_t steps) {
    return steps > 1 ? (a->left + steps - 1) / steps : a->left;
}

/* Token t's h = s A x (r floats) into row t of `tape` where there is one (the backward
 * reads it there instead of computing it again). */
static inline __attribute__((always_inline)) void keep(float *tape, int64_t t, const int64_t r,
                                                       const float *h) {
    if (tape) memcpy(tape + t * r, h, (size_t)r * sizeof(float));
}

/* The `T` tokens of unit `u`, two at a time (`down2`, `up2`: each load of the lane's
 * weights serves both; a prefill's rows of 64 tokens, rank 8, 128 -> 352: 124 -> 143
 * GFLOP/s): `r` as a compile-time constant for the common ranks (the loops over it
 * unroll); r <= 64 (the caller checks). */
static inline __attribute__((always_inline)) void tokens(
    int64_t T, int64_t in, int64_t out, int64_t ys, const int64_t r, const float *x, float *y,
    const float *Al, int64_t a_sr, const float *Bt, int64_t bt_sk, float s, int64_t u,
    float *tape) {
    float h0[64], h1[64];
    int64_t t = 0;
    for (; t + 2 <= T; t += 2) {
        const int64_t t0 = u * T + t;
        down2(Al, a_sr, r, x + t0 * in, x + (t0 + 1) * in, in, s, h0, h1);
        up2(Bt, bt_sk, r, h0, h1, y + t0 * ys, y + (t0 + 1) * ys, out);
        keep(tape, t0, r, h0);
        keep(tape, t0 + 1, r, h1);
    }
    if (t < T) {
        down(Al, a_sr, r, x + (u * T + t) * in, in, s, h0);
        up(Bt, bt_sk, r, h0, y + (u * T + t) * ys, out);
        keep(tape, u * T + t, r, h0);
    }
}

/* Two one-token units `u0`, `u1` of one lane. */
static inline __attribute__((always_inline)) void pair(
    int64_t in, int64_t out, int64_t ys, const int64_t r, const float *x, float *y,
    const float *Al, int64_t a_sr, const float *Bt, int64_t bt_sk, float s, int64_t u0,
    int64_t u1, float *tape) {
    float h0[64], h1[64];
    down2(Al, a_sr, r, x + u0 * in, x + u1 * in, in, s, h0, h1);
    up2(Bt, bt_sk, r, h0, h1, y + u0 * ys, y + u1 * ys, out);
    keep(tape, u0, r, h0);
    keep(tape, u1, r, h1);
}

/* `lora_rows_f32` into the tokens of a wider y: token t's `out` features at y + t * ys
 * (ys >= out: q, k and v, or gate and up, side by side in one product's output, as the
 * engine's decoder layers leave them: `decoder_layers.c`), each token's h = s A x kept
 * in its row of `tape` [U * T, r] where given (the trainer's: `train_layers.c`). */
void lora_rows_strided_f32(int64_t U, int64_t T, int64_t in, int64_t out, int64_t r,
                           const float *x, float *y, int64_t ys,
                           const float *A, int64_t a_sl, int64_t a_sr,
                           const float *B, int64_t b_sl, int64_t b_so, int64_t b_sr,
                           const int64_t *lane, const int64_t *order, const float *scale,
                           float *scratch, float *tape) {
    int64_t current = -1;
    const float *Bt = scratch;
    int64_t bt_sk = out;
    Ahead ahead;
    memset(&ahead, 0, sizeof ahead);
    int64_t share = 0;
    for (int64_t j = 0; j < U; ++j) {
        const int64_t u = order[j];
        const int64_t l = lane[u];
        if (l != current) {
            Bt = rank_major(B + l * b_sl, b_so, b_sr, r, out, scratch, &bt_sk);
            current = l;
            /* The next lane's weights into L2 while this lane's rows run (`Ahead`; from
             * memory otherwise, at the first row of each lane: engine decode iteration
             * at 256 rows x 32 adapters, in-process A/B, 0.945-0.982). */
            ahead_step(&ahead, ahead.left); /* what the lane before left of this one */
            const int64_t end = run_end(U, lane, order, j);
            if (end < U) {
                const int64_t n = lane[order[end]];
                ahead = ahead_of(A + n * a_sl, a_sr, r, in, B + n * b_sl, b_so, b_sr, out);
                /* A share at each of this lane's steps: a unit, or a pair of one-token units. */
                const int64_t units = end - j;
                share = ahead_share(&ahead, T == 1 ? (units + 1) / 2 : units);
            }
        }
        ahead_step(&ahead, share);
        const float *Al = A + l * a_sl;
        const float s = scale ? scale[l] : 1.0f;
        /* One-token units (decode rows, a packed forward's tokens) of one lane go two at
         * a time: each load of the lane's weights serves both. */
        if (T == 1 && j + 1 < U && lane[order[j + 1]] == l) {
            const int64_t u1 = order[++j];
            switch (r) {
                case 8: pair(in, out, ys, 8, x, y, Al, a_sr, Bt, bt_sk, s, u, u1, tape); break;
                case 16: pair(in, out, ys, 16, x, y, Al, a_sr, Bt, bt_sk, s, u, u1, tape); break;
                default: pair(in, out, ys, r, x, y, Al, a_sr, Bt, bt_sk, s, u, u1, tape);
            }
            continue;
        }
        switch (r) {
            case 8: tokens(T, in, out, ys, 8, x, y, Al, a_sr, Bt, bt_sk, s, u, tape); break;
            case 16: tokens(T, in, out, ys, 16, x, y, Al, a_sr, Bt, bt_sk, s, u, tape); break;
            default: tokens(T, in, out, ys, r, x, y, Al, a_sr, Bt, bt_sk, s, u, tape);
        }
    }
}

void lora_rows_f32(int64_t U, int64_t T, int64_t in, int64_t out, int64_t r,
                   const float *x, float *y,
                   const float *A, int64_t a_sl, int64_t a_sr,
                   const float *B, int64_t b_sl, int64_t b_so, int64_t b_sr,
                   const int64_t *lane, const int64_t *order, const float *scale,
                   float *scratch) {
    lora_rows_strided_f32(U, T, in, out, r, x, y, out, A, a_sl, a_sr, B, b_sl, b_so, b_sr, lane,
                          order, scale, scratch, 0);
}

/* acc[k * ld + i] += sum_t c[t * r + k] * v_t[i] for k < r, i < n over the `nt` rows
 * v_t (written instead where `init`: acc's values are none yet): a rank-by-features
 * product added into a lane's gradient (rank-major, `n` contiguous), eight ranks of one
 * vector of features held in registers while every row adds into them (one load of v_t
 * per eight multiply-adds, one load and store of the gradient per block of rows, not per
 * row). */
static inline void outer_add(float *acc, int64_t ld, int64_t r, const float *c,
                             const float *const *v, int64_t nt, int64_t n, int init) {
    for (int64_t k0 = 0; k0 < r; k0 += GROUP) {
        const int64_t kn = r - k0 < GROUP ? r - k0 : GROUP;
        int64_t i = 0;
        for (; i + W <= n; i += W) {
            vf a[GROUP];
            for (int g = 0; g < GROUP; ++g)
                a[g] = g < kn && !init ? *(vf *)(acc + (k0 + g) * ld + i) : (vf){0};
            for (int64_t t = 0; t < nt; ++t) {
                const vf vt = *(const vf *)(v[t] + i);
                const float *ct = c + t * r + k0;
                for (int g = 0; g < GROUP; ++g) a[g] += ct[g < kn ? g : 0] * vt;
            }
            for (int g = 0; g < kn; ++g) *(vf *)(acc + (k0 + g) * ld + i) = a[g];
        }
        for (; i < n; ++i)
            for (int64_t g = 0; g < kn; ++g) {
                float s = init ? 0.0f : acc[(k0 + g) * ld + i];
                for (int64_t t = 0; t < nt; ++t) s += c[t * r + k0 + g] * v[t][i];
                acc[(k0 + g) * ld + i] = s;
            }
    }
}

/* The block of `nt` tokens of lane l (their e and h, rows xs and gs) added into the
 * lane's gradients, written where the lane is `fresh` (then no longer). */
static inline void add_block(int64_t l, int64_t r, int64_t in, int64_t out, const float *e,
                             const float *h, const float *const *xs, const float *const *gs,
                             int64_t nt, float *gA, float *gBt, uint8_t *fresh) {
    const int init = fresh && fresh[l];
    outer_add(gA + l * r * in, in, r, e, xs, nt, in, init);
    outer_add(gBt + l * r * out, out, r, h, gs, nt, out, init);
    if (init) fresh[l] = 0;
}

/* Tokens of one lane taken together by the backward (its scratch of h and e). */
#define BLOCK 32
/* How many tokens ahead the backward prefetches a token's rows. */
#define AHEAD 4

/* The backward of `lora_rows_f32` for the incoming gradient g [U * T, out] of y: per
 * token, with h = s A x and e = s B^T g (the lane's scale s),
 *
 *     gx = A^T e (written),   gA[lane] += e x^T,   gBt[lane] += h g^T,
 *
 * gBt rank-major ([L, r, out], the transpose of B's gradient; the caller transposes it);
 * h read from `tape` where given (`lora_rows_strided_f32`'s), else computed. A lane l
 * with fresh[l] set (`fresh` given) has no gradient yet: its first block writes its
 * gradients' rows (no zeros made for them beforehand) and clears the flag.
 * gA [L, r, in] and gBt contiguous, accumulated into; gx [U * T, in] contiguous, written
 * (`add_gx` 0), added into (`add_gx` 1: a base layer's input gradient already there) or
 * not computed (NULL: the input needs none). Units
 * are visited in `order` (sorted by lane: a lane's gradients stay in cache, its B is
 * transposed into `scratch` once); the tokens of up to `BLOCK` consecutive units of one
 * lane add into its gradients together. g's tokens are g_st apart (g_st >= out: q, k
 * and v's gradients side by side, `train_layers.c`). Other arguments as `lora_rows_f32`. */
void lora_rows_backward_strided_f32(int64_t U, int64_t T, int64_t in, int64_t out, int64_t r,
                                    const float *x, const float *g, int64_t g_st, float *gx,
                                    const float *A, int64_t a_sl, int64_t a_sr,
                                    const float *B, int64_t b_sl, int64_t b_so, int64_t b_sr,
                                    const int64_t *lane, const int64_t *order,
                                    const float *scale, float *gA, float *gBt, float *scratch,
                                    int64_t add_gx, const float *tape, uint8_t *fresh) {
    int64_t current = -1, nt = 0;
    const float *Bt = scratch;
    int64_t bt_sk = out;
    float h[BLOCK * 64], e[BLOCK * 64];
    const float *xs[BLOCK], *gs[BLOCK];
    Ahead ahead;
    memset(&ahead, 0, sizeof ahead);
    int64_t share = 0;
    for (int64_t j = 0; j <= U; ++j) {
        const int64_t l = j < U ? lane[order[j]] : -1;
        if (l != current && nt > 0) { /* the block of the lane before: its gradients */
            add_block(current, r, in, out, e, h, xs, gs, nt, gA, gBt, fresh);
            nt = 0;
        }
        if (j == U) break;
        if (l != current) {
            Bt = rank_major(B + l * b_sl, b_so, b_sr, r, out, scratch, &bt_sk);
            current = l;
            /* The next lane's weights and gradients into L2 while this lane's tokens run
             * (each lane's are read, and its gradients written, once a call; `Ahead`). */
            ahead_step(&ahead, ahead.left);
            const int64_t end = run_end(U, lane, order, j);
            if (end < U) {
                const int64_t n = lane[order[end]];
                ahead = ahead_of(A + n * a_sl, a_sr, r, in, B + n * b_sl, b_so, b_sr, out);
                ahead_add(&ahead, gA + n * r * in, 1, 0, r * in, 1);
                ahead_add(&ahead, gBt + n * r * out, 1, 0, r * out, 1);
                share = ahead_share(&ahead, (end - j) * T); /* a token's */
            }
        }
        const float *Al = A + l * a_sl;
        const float s = scale ? scale[l] : 1.0f;
        const int64_t u = order[j];
        for (int64_t t = 0; t < T; ++t) {
            if (nt == BLOCK) {
                add_block(l, r, in, out, e, h, xs, gs, nt, gA, gBt, fresh);
                nt = 0;
            }
            const int64_t tok = u * T + t;
            ahead_step(&ahead, share);
            /* The rows of the token AHEAD further on into L1 (activations and gradients
             * the layers wrote earlier, from L3 by now). */
            const int64_t next = T == 1 ? (j + AHEAD < U ? order[j + AHEAD] : -1)
                                        : (t + AHEAD < T ? tok + AHEAD : -1);
            if (next >= 0) {
                for (int64_t i = 0; i < in; i += W) {
                    __builtin_prefetch(x + next * in + i, 0, 3);
                    if (gx) __builtin_prefetch(gx + next * in + i, 1, 3);
                }
                for (int64_t o = 0; o < out; o += W) __builtin_prefetch(g + next * g_st + o, 0, 3);
                if (tape) __builtin_prefetch(tape + next * r, 0, 3);
            }
            xs[nt] = x + tok * in;
            gs[nt] = g + tok * g_st;
            if (tape)
                memcpy(h + nt * r, tape + tok * r, (size_t)r * sizeof(float));
            else
                down(Al, a_sr, r, xs[nt], in, s, h + nt * r);
            down(Bt, bt_sk, r, gs[nt], out, s, e + nt * r);
            if (gx) {
                float *gxt = gx + tok * in;
                if (!add_gx)
                    for (int64_t i = 0; i < in; ++i) gxt[i] = 0.0f;
                up(Al, a_sr, r, e + nt * r, gxt, in);
            }
            ++nt;
        }
    }
}

void lora_rows_backward_f32(int64_t U, int64_t T, int64_t in, int64_t out, int64_t r,
                            const float *x, const float *g, float *gx,
                            const float *A, int64_t a_sl, int64_t a_sr,
                            const float *B, int64_t b_sl, int64_t b_so, int64_t b_sr,
                            const int64_t *lane, const int64_t *order, const float *scale,
                            float *gA, float *gBt, float *scratch, int64_t add_gx) {
    lora_rows_backward_strided_f32(U, T, in, out, r, x, g, out, gx, A, a_sl, a_sr, B, b_sl, b_so,
                                   b_sr, lane, order, scale, gA, gBt, scratch, add_gx, 0, 0);
}

/* Each of `L` lanes' rank-major gradient of B, src [r, out] (lanes out * r apart), into
 * PEFT's layout dst [out, r] (lanes d_sl apart): y[o, k] = x[k, o]; rank 8 sixteen
 * outputs at a time (`ranks_to_outputs`), other ranks element by element. */
static void peft_layout(int64_t L, int64_t r, int64_t out, const float *src, float *dst,
                        int64_t d_sl) {
    for (int64_t l = 0; l < L; ++l) {
        const float *x = src + l * r * out;
        float *y = dst + l * d_sl;
        int64_t o = 0;
        if (r == 8)
            for (; o + W <= out; o += W) {
                vf a[8], p[8];
                for (int k = 0; k < 8; ++k) a[k] = *(const vf *)(x + k * out + o);
                ranks_to_outputs(a, p);
                for (int q = 0; q < 8; ++q) *(vf *)(y + (o + 2 * q) * 8) = p[q];
            }
        for (; o < out; ++o)
            for (int64_t k = 0; k < r; ++k) y[o * r + k] = x[k * out + o];
    }
}

/* A micro-batch's lanes' gradients laid out as their flat parameter vectors: for each of
 * `count` modules (`fields`: gA's address, r, in, gBt's address, out, the address of its
 * lanes' `fresh` flags or 0; an address 0 for a module no pass reached), lane l's gA
 * [r, in] and then its B's gradient in PEFT's layout [out, r] (from gBt [r, out],
 * `peft_layout`) go one after the other into row l of dst (rows d_sl apart), zeros
 * where a module has none or the lane none yet (fresh): one call for what was a copy
 * per module and lane block. */
void lora_gather_grads_f32(int64_t count, const int64_t *fields, int64_t L, float *dst,
                           int64_t d_sl) {
    int64_t at = 0;
    for (int64_t m = 0; m < count; ++m) {
        const int64_t *f = fields + 6 * m;
        const float *gA = (const float *)(intptr_t)f[0], *gBt = (const float *)(intptr_t)f[3];
        const uint8_t *fresh = (const uint8_t *)(intptr_t)f[5];
        const int64_t r = f[1], in = f[2], out = f[4];
        for (int64_t l = 0; l < L; ++l) {
            float *row = dst + l * d_sl + at;
            const int none = fresh && fresh[l];
            if (gA && !none)
                memcpy(row, gA + l * r * in, (size_t)(r * in) * sizeof(float));
            else
                memset(row, 0, (size_t)(r * in) * sizeof(float));
            if (gBt && !none)
                peft_layout(1, r, out, gBt + l * r * out, row + r * in, d_sl);
            else
                memset(row + r * in, 0, (size_t)(r * out) * sizeof(float));
        }
        at += r * (in + out);
    }
}
