/* What the native kernels share: vectors of sixteen floats, the shuffle reduction that
 * sums several vectors at once, lane by lane (a few shuffles a vector instead of a
 * horizontal sum each), bfloat16's conversions, and the attention kernels' dispatch on
 * their common shapes. Included by the kernels' sources;
 * their build cache keys on it too (`kernels.build`). */
#ifndef MARLAAS_SIMD_H
#define MARLAAS_SIMD_H

#include <stdint.h>

#define W 16
typedef float vf __attribute__((vector_size(W * sizeof(float)), aligned(4), may_alias));
typedef int32_t vi __attribute__((vector_size(W * sizeof(int32_t))));

/* One level of the reduction: x and y hold partial sums in groups of s lanes; the result
 * holds x's then y's in groups of s / 2. */
static inline vf halve(vf x, vf y, vi lo, vi hi) {
    return __builtin_shuffle(x, y, lo) + __builtin_shuffle(x, y, hi);
}

static const vi LO16 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
static const vi HI16 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
static const vi LO8 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
static const vi HI8 = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
static const vi LO4 = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
static const vi HI4 = {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31};
static const vi LO2 = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
static const vi HI2 = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
/* Their inverses: two vectors' lanes interleaved one, two or four at a time (lo: the
 * first halves', hi: the second halves'). */
static const vi I1_LO = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23};
static const vi I1_HI = {8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
static const vi I2_LO = {0, 1, 16, 17, 2, 3, 18, 19, 4, 5, 20, 21, 6, 7, 22, 23};
static const vi I2_HI = {8, 9, 24, 25, 10, 11, 26, 27, 12, 13, 28, 29, 14, 15, 30, 31};
static const vi I4_LO = {0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23};
static const vi I4_HI = {8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31};

/* Lane c of the result: the sum of the lanes of v[c], for the sixteen vectors v. */
static inline vf sums16(const vf *v) {
    vf p[8];
    for (int c = 0; c < 8; ++c) p[c] = halve(v[2 * c], v[2 * c + 1], LO16, HI16);
    for (int c = 0; c < 4; ++c) p[c] = halve(p[2 * c], p[2 * c + 1], LO8, HI8);
    for (int c = 0; c < 2; ++c) p[c] = halve(p[2 * c], p[2 * c + 1], LO4, HI4);
    return halve(p[0], p[1], LO2, HI2);
}

/* Lanes 0 .. 7 of the result: the sums of the lanes of the eight vectors v. */
static inline vf sums8(const vf *v) {
    vf p[4];
    for (int c = 0; c < 4; ++c) p[c] = halve(v[2 * c], v[2 * c + 1], LO16, HI16);
    for (int c = 0; c < 2; ++c) p[c] = halve(p[2 * c], p[2 * c + 1], LO8, HI8);
    p[0] = halve(p[0], p[1], LO4, HI4);
    return halve(p[0], p[0], LO2, HI2);
}

/* bfloat16 is a float32's upper half: widened exactly by a shift; narrowed to the
 * nearest, ties to even (torch's rounding; none of the callers hold a NaN). */
static inline float bf16_widen(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    __builtin_memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t bf16_nearest(float f) {
    uint32_t u;
    __builtin_memcpy(&u, &f, sizeof u);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* The packed products' driver (`half_linear.c`, `linear_f32.c`): the outputs' blocks of
 * sixteen four at a time (nb0, and nbs of them), the rows four at a time (m0), each tile
 * `TILE(MS, NBS)` with its row and block counts as compile-time constants. */
#define TILE_BLOCKS(TILE, MS)       \
    switch (nbs) {                  \
        case 4: TILE(MS, 4); break; \
        case 3: TILE(MS, 3); break; \
        case 2: TILE(MS, 2); break; \
        default: TILE(MS, 1);       \
    }
#define FOR_PACKED_TILES(M, N, TILE)                                               \
    for (int64_t nb0 = 0; nb0 < ((N) + 15) / 16; nb0 += 4) {                      \
        const int nbs = ((N) + 15) / 16 - nb0 < 4 ? (int)(((N) + 15) / 16 - nb0) : 4; \
        for (int64_t m0 = 0; m0 < (M); m0 += 4) {                                  \
            switch ((M) - m0 < 4 ? (int)((M) - m0) : 4) {                          \
                case 4: TILE_BLOCKS(TILE, 4) break;                                \
                case 3: TILE_BLOCKS(TILE, 3) break;                                \
                case 2: TILE_BLOCKS(TILE, 2) break;                                \
                default: TILE_BLOCKS(TILE, 1)                                      \
            }                                                                      \
        }                                                                          \
    }

/* The head size D and the group size G (variables in scope) as compile-time constants
 * for the attention kernels' common shapes: the inner loops unroll into a few vector
 * instructions and a group's accumulators stay in registers. `SPECIALISED(CALL)` expands
 * `CALL(D, G)` once per common shape and once with the runtime values. */
#define BY_GROUP(CALL, DIM)                    \
    switch (G) {                               \
        case 1: CALL(DIM, 1); break;           \
        case 2: CALL(DIM, 2); break;           \
        case 4: CALL(DIM, 4); break;           \
        case 8: CALL(DIM, 8); break;           \
        default: CALL(DIM, G);                 \
    }
#define SPECIALISED(CALL)                      \
    switch (D) {                               \
        case 32: BY_GROUP(CALL, 32); break;    \
        case 64: BY_GROUP(CALL, 64); break;    \
        case 128: BY_GROUP(CALL, 128); break;  \
        default: CALL(D, G);                   \
    }
/* The same for a kernel that depends on the head size alone: `HEAD_SIZED(CALL)` expands
 * `CALL(D)` once per common head size and once with the runtime value. */
#define HEAD_SIZED(CALL)                       \
    switch (D) {                               \
        case 32: CALL(32); break;              \
        case 64: CALL(64); break;              \
        case 128: CALL(128); break;            \
        default: CALL(D);                      \
    }

#endif
