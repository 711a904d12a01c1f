/* Sixteen floats' exp inline, for the kernels whose loops would otherwise call libmvec
 * (`span_tiles.h`, `fused.c`). Included by their sources; the build cache keys on it
 * (`kernels.build`). */
#ifndef MARLAAS_VEXP_H
#define MARLAAS_VEXP_H

#include <math.h>

#include "simd.h"

#ifdef __AVX512F__
#include <immintrin.h>
#endif

/* A vector of sixteen floats kept in a register (64-byte aligned in memory). */
typedef float va __attribute__((vector_size(W * sizeof(float))));

/* exp of sixteen floats, inline: exp(x) = 2^n e^r, n = round(x / ln 2), |r| <= ln 2 / 2,
 * e^r by Cephes' expf polynomial (degree 7 in all, ~1 ulp), 2^n by the exponent scaling
 * instruction. A call to libmvec's expf (as span_attention.c makes) spilled and
 * reloaded the loop's vector registers around it (all are caller-saved) and waited on
 * its latency: a third of the tiled attention's backward tile's time, two thirds of
 * SwiGLU's backward (`fused.c`). x is held in [-87, 88] (exp(-87) = 1.6e-38 where the
 * exact value would be smaller still, next to a maximum's 1). Without AVX-512, libm's
 * expf a lane. */
#ifdef __AVX512F__
static inline va vexp(va x) {
    const __m512 xc = _mm512_min_ps(_mm512_max_ps((__m512)x, _mm512_set1_ps(-87.0f)),
                                    _mm512_set1_ps(88.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(1.44269504f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    /* r = x - n ln 2 in two steps (Cody and Waite: ln 2's high part has few bits, so
     * n times it is exact), as multiply-adds the compiler cannot reassociate. */
    const va r = (va)_mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f),
                                      _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), xc));
    va p = (va){0} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    return (va)_mm512_scalef_ps((__m512)p, n);
}
#else
static inline va vexp(va x) {
    for (int i = 0; i < W; ++i) x[i] = expf(x[i] < -87.0f ? -87.0f : x[i]);
    return x;
}
#endif

/* The largest of p[0 .. n) (n >= 1): sixteen at a time where the compiler targets
 * AVX-512, the last vector masked (a softmax's maximum: `span_attention.c`, `fused.c`). */
static inline float row_max(const float *p, int64_t n) {
#ifdef __AVX512F__
    __m512 m = _mm512_set1_ps(p[0]);
    int64_t i = 0;
    for (; i + W <= n; i += W) m = _mm512_max_ps(m, _mm512_loadu_ps(p + i));
    const __mmask16 tail = (__mmask16)((1u << (n - i)) - 1u);
    if (i < n) m = _mm512_mask_max_ps(m, tail, m, _mm512_maskz_loadu_ps(tail, p + i));
    return _mm512_reduce_max_ps(m);
#else
    float m = p[0];
    for (int64_t i = 1; i < n; ++i) m = p[i] > m ? p[i] : m;
    return m;
#endif
}

#endif
