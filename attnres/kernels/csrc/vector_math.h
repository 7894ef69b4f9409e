/* Vector-friendly scalar math shared by the CPU kernels (depth_read.c, streams.c).
 *
 * Written so that the compiler vectorises the loops they sit in (flags in native.py):
 * - no fminf/fmaxf (library calls unless NaNs are ruled out): plain comparisons;
 * - own exp and log (libm's are scalar calls): range reduction and polynomials, within 2 ulp of
 *   libm over the ranges used here;
 * - dot products and axpy with the common widths as compile-time constants.
 */
#ifndef ATTNRES_VECTOR_MATH_H
#define ATTNRES_VECTOR_MATH_H

#include <math.h>
#include <stdint.h>

static inline float larger(float a, float b) { return a > b ? a : b; }
static inline float smaller(float a, float b) { return a < b ? a : b; }

/* e^x: x = k·ln2 + r with |r| ≤ ln2/2 (ln2 split in two for an exact k·ln2), e^r by its Taylor
 * polynomial to degree 7 (truncation < 1e-8 relative), 2^k by the exponent bits. Underflow gives
 * 0 below -87 (torch gives denormals there), overflow +inf above 88; NaN passes through. */
static inline float exp_f(float x) {
    const float c = smaller(larger(x, -87.f), 88.f);
    const float k = floorf(c * 1.44269504089f + 0.5f);
    const float r = (c - k * 0.693145751953125f) - k * 1.428606765330187e-06f;
    float p = 1.f / 5040.f;
    p = p * r + 1.f / 720.f;
    p = p * r + 1.f / 120.f;
    p = p * r + 1.f / 24.f;
    p = p * r + 1.f / 6.f;
    p = p * r + 0.5f;
    p = p * r + 1.f;
    p = p * r + 1.f;
    union { int32_t i; float f; } two_k = {.i = ((int32_t)k + 127) << 23};
    float y = p * two_k.f;
    y = x < -87.f ? 0.f : y;
    y = x > 88.f ? INFINITY : y;
    return x != x ? x : y;
}

/* log x for finite x > 0: x = 2^e·m with m in [√½, √2), the Cephes minimax polynomial in m − 1. */
static inline float log_f(float x) { /* x > 0, finite */
    union { float f; int32_t i; } u = {.f = x};
    float e = (float)(((u.i >> 23) & 0xff) - 126);
    u.i = (u.i & 0x007fffff) | 0x3f000000; /* mantissa in [0.5, 1) */
    float m = u.f;
    const int lo = m < 0.707106781f;
    e = lo ? e - 1.f : e;
    m = lo ? m + m - 1.f : m - 1.f;
    const float z = m * m;
    float y = 7.0376836292e-2f;
    y = y * m - 1.1514610310e-1f;
    y = y * m + 1.1676998740e-1f;
    y = y * m - 1.2420140846e-1f;
    y = y * m + 1.4249322787e-1f;
    y = y * m - 1.6668057665e-1f;
    y = y * m + 2.0000714765e-1f;
    y = y * m - 2.4999993993e-1f;
    y = y * m + 3.3333331174e-1f;
    y = y * m * z;
    y += -2.12194440e-4f * e;
    y += -0.5f * z;
    return m + y + 0.693359375f * e;
}

/* log σ(s) without overflow: min(s, 0) − log(1 + e^−|s|). */
static inline float log_sigmoid(float s) { return smaller(s, 0.f) - log_f(1.f + exp_f(-fabsf(s))); }

/* Softmax over depth with LANES tokens in the lanes of a vector (the one-reader reads of
 * depth_read.c and depth_read_one.c): S[i·LANES + k], the logits of n sources for token k, and
 * L[k], the logit of a running read's initial state (−∞: none), become the normalised weights
 * (S in place, A0[k] the initial state's) and L[k] the log-sum-exp. Every loop runs over whole
 * vectors; lanes past a short last group only need finite entries. */
#define LANES 16

static inline void lane_softmax(float *restrict S, int n, float *restrict L, float *restrict A0) {
    float m[LANES], z[LANES];
#pragma omp simd
    for (int k = 0; k < LANES; k++) m[k] = L[k];
    for (int i = 0; i < n; i++) {
#pragma omp simd
        for (int k = 0; k < LANES; k++) m[k] = larger(m[k], S[i * LANES + k]);
    }
#pragma omp simd
    for (int k = 0; k < LANES; k++) z[k] = A0[k] = exp_f(L[k] - m[k]);
    for (int i = 0; i < n; i++) {
#pragma omp simd
        for (int k = 0; k < LANES; k++) {
            S[i * LANES + k] = exp_f(S[i * LANES + k] - m[k]);
            z[k] += S[i * LANES + k];
        }
    }
#pragma omp simd
    for (int k = 0; k < LANES; k++) {
        L[k] = m[k] + log_f(z[k]);
        z[k] = 1.f / z[k];
        A0[k] *= z[k];
    }
    for (int i = 0; i < n; i++) {
#pragma omp simd
        for (int k = 0; k < LANES; k++) S[i * LANES + k] *= z[k];
    }
}

static inline float dot_n(const float *restrict a, const float *restrict b, int w) {
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int c = 0; c < w; c++) s += a[c] * b[c];
    return s;
}

static inline void axpy_n(float *restrict y, float a, const float *restrict x, int w) {
#pragma omp simd
    for (int c = 0; c < w; c++) y[c] += a * x[c];
}

/* The common head widths as compile-time constants: the loops become a few straight vector
 * instructions instead of a vector loop with run-time trip count and tail (which, with 16-wide
 * heads, cost more than the arithmetic: a multi-head read does H times as many short products). */
#define FIXED(w, call) ((w) == 16 ? call(16) : (w) == 32 ? call(32) : (w) == 64 ? call(64) : (w) == 128 ? call(128) : call(w))

static inline float dot(const float *restrict a, const float *restrict b, int w) {
#define DOT(k) dot_n(a, b, k)
    return FIXED(w, DOT);
#undef DOT
}

static inline void axpy(float *restrict y, float a, const float *restrict x, int w) {
#define AXPY(k) axpy_n(y, a, x, k)
    FIXED(w, AXPY);
#undef AXPY
}

#endif
