/* One depth read on the CPU, forward and backward: the C counterpart of triton_kernels.py, one
 * function per direction, any number of readers at once (same math, same arguments, fp32).
 *
 *     s_ri = (q_r · v_i) · ρ_i       ρ_i = 1/rms(v_i) (1 without key norm)
 *     t_ri = s_ri (softmax)  or  log σ(s_ri) (sigmoid, renormalised)
 *     out_r = Σ_i softmax_i(t_ri) v_i,   lse_r = log Σ_i exp(t_ri)
 *
 * plus an optional initial state (o0, lse0) per reader, a pseudo-source with a given logit: the
 * phase-2 merge of the paper's Algorithm 1. With H heads the d channels split into H groups of
 * W = d/H, each with its own softmax over sources (one rms per token, shared by the groups).
 *
 * Design decisions:
 * - Tiles of TT tokens, sources in the inner-outer loop: within a tile each source is one
 *   contiguous TT·d run (what hardware prefetchers follow; a token-at-a-time loop over many
 *   sources was latency-bound on a CPU), and the tile's slices of all sources stay in L1/L2 while
 *   all R readers score and mix them: each source streams from memory once per call, forward and
 *   backward; nothing of size (tokens × d) is written except the outputs themselves.
 * - Two passes over the cache-resident tile instead of an online softmax (no rescaling); the
 *   exponentials of a tile are one vectorised loop.
 * - The backward recomputes the scores from the sources and the saved lse (weights are never
 *   stored) and knows Δ = g·out − g_lse before it writes anything, so the query gradient is
 *   accumulated directly (no cancellation trick needed, unlike the Triton kernel). A merge's
 *   backward takes g·out from its own output rather than its initial state (see below), so
 *   phase-1 outputs need not outlive the forward.
 * - With fold_rms, the key norm's gradient is added into each source's gradient here, so 1/rms
 *   needs no autograd node of its own.
 * - The static-query gradient is summed over a tile in float and flushed into double per tile:
 *   fp32 arithmetic, no drift over long sequences.
 * - Each call handles a token range [t0, t1) and adds its query gradient into its own buffer, so
 *   a caller may split the tokens across threads.
 * - Vector-friendly math (own exp/log, no fminf/fmaxf) from vector_math.h; rows are prefetched a
 *   tile ahead.
 * Pointers are raw; shapes and contiguity are checked by the Python wrapper (cpu_kernels.py).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vector_math.h"

typedef int64_t i64;

/* Ask for the row a tile ahead: within a tile the loops jump between sources every TT rows,
 * runs too short for the hardware prefetcher to ramp up on, and the sources are usually out of
 * cache by the time a read (or its backward) comes. */
static inline void prefetch_row(const float *row, int d) {
    for (int c = 0; c < d; c += 16) __builtin_prefetch(row + c, 0, 1);
}

static inline float log_sigmoid(float s) { return smaller(s, 0.f) - log_f(1.f + exp_f(-fabsf(s))); }

#define TT 64 /* tokens per tile */

/* Forward. srcs: n pointers to (N, d); rms: n pointers to (N,) or NULL (raw keys); q: (R, d)
 * static queries, or (N, d) per token (R = 1); o0 (R, N, d) and lse0 (R, N, H), or NULL;
 * out (R, N, d), lse (R, N, H). scratch: TT·(n + 2)·R·H floats. Returns 0. */
int attnres_read_forward(const float *const *srcs, const float *const *rms, int n, const float *q, int per_token,
                         const float *o0, const float *lse0, float *out, float *lse, i64 N, int d, int H, int R,
                         int use_sigmoid, i64 t0, i64 t1, float *scratch) {
    const int W = d / H, RH = R * H, nRH = n * RH;
    float *S = scratch;        /* S[(u·n + i)·RH + k], u: token in tile, k = r·H + h: logit, then weight */
    float *M = S + TT * nRH;   /* max logit per (u, k), then log-sum-exp */
    float *Z = M + TT * RH;    /* weight of the initial state, then the sum of weights */
    for (i64 ta = t0; ta < t1; ta += TT) {
        const int T = (int)(t1 - ta < TT ? t1 - ta : TT);
        for (int i = 0; i < n; i++) {
            for (int u = 0; u < T; u++) {
                const i64 t = ta + u;
                const float *v = srcs[i] + t * d;
                if (t + TT < t1) prefetch_row(v + TT * d, d);
                const float rho = rms ? rms[i][t] : 1.f;
                float *Su = S + ((i64)u * n + i) * RH;
                for (int r = 0; r < R; r++) {
                    const float *qr = per_token ? q + t * d : q + (i64)r * d;
                    for (int h = 0; h < H; h++) Su[r * H + h] = dot(qr + h * W, v + h * W, W) * rho;
                }
            }
        }
        if (use_sigmoid)
            for (int j = 0; j < T * nRH; j++) S[j] = log_sigmoid(S[j]);
        for (int u = 0; u < T; u++) {
            float *Mu = M + u * RH, *Zu = Z + u * RH;
            for (int r = 0; r < R; r++)
                for (int h = 0; h < H; h++) {
                    Mu[r * H + h] = o0 ? lse0[((i64)r * N + ta + u) * H + h] : -INFINITY;
                    Zu[r * H + h] = Mu[r * H + h];
                }
            for (int i = 0; i < n; i++)
                for (int k = 0; k < RH; k++) Mu[k] = larger(Mu[k], S[((i64)u * n + i) * RH + k]);
            for (int i = 0; i < n; i++)
                for (int k = 0; k < RH; k++) S[((i64)u * n + i) * RH + k] -= Mu[k];
            for (int k = 0; k < RH; k++) Zu[k] -= Mu[k]; /* -inf without an initial state */
        }
#pragma omp simd
        for (int j = 0; j < T * nRH; j++) S[j] = exp_f(S[j]);
#pragma omp simd
        for (int j = 0; j < T * RH; j++) Z[j] = exp_f(Z[j]);
        /* out = (a0·o0 + Σ_i e_i v_i) / Σ, sources in the outer loop (each read as one run) */
        for (int r = 0; r < R; r++)
            for (int u = 0; u < T; u++) {
                float *o = out + ((i64)r * N + ta + u) * d;
                if (o0) {
                    const float *p0 = o0 + ((i64)r * N + ta + u) * d;
                    for (int h = 0; h < H; h++) {
                        const float a0 = Z[u * RH + r * H + h];
#pragma omp simd
                        for (int c = 0; c < W; c++) o[h * W + c] = a0 * p0[h * W + c];
                    }
                } else {
                    memset(o, 0, sizeof(float) * d);
                }
            }
        for (int i = 0; i < n; i++)
            for (int u = 0; u < T; u++) {
                const float *v = srcs[i] + (ta + u) * d;
                const float *Su = S + ((i64)u * n + i) * RH;
                for (int r = 0; r < R; r++) {
                    float *o = out + ((i64)r * N + ta + u) * d;
                    for (int h = 0; h < H; h++) axpy(o + h * W, Su[r * H + h], v + h * W, W);
                }
            }
        for (int u = 0; u < T; u++)
            for (int k = 0; k < RH; k++) {
                float sum = Z[u * RH + k];
                for (int i = 0; i < n; i++) sum += S[((i64)u * n + i) * RH + k];
                Z[u * RH + k] = sum;
            }
#pragma omp simd
        for (int j = 0; j < T * RH; j++) M[j] += log_f(Z[j]);
        for (int r = 0; r < R; r++)
            for (int u = 0; u < T; u++)
                for (int h = 0; h < H; h++) {
                    const float inv = 1.f / Z[u * RH + r * H + h];
                    float *o = out + ((i64)r * N + ta + u) * d + h * W;
#pragma omp simd
                    for (int c = 0; c < W; c++) o[c] *= inv;
                    lse[((i64)r * N + ta + u) * H + h] = M[u * RH + r * H + h];
                }
    }
    return 0;
}

/* Backward. Inputs as in the forward, except that a merge passes its own output out (R, N, d)
 * with lse0, not its initial state o0 (see Δ below); plus lse (R, N, H), gout (R, N, d), glse
 * (R, N, H) or NULL.
 * Outputs: dsrc: n pointers to (N, d), written; drms: n pointers to (N,) or NULL, written;
 * with fold_rms, drms is not written: the key norm's path ρ(v) is added to dsrc instead
 * (dv += dρ · ∂ρ/∂v = −dρ·ρ³·v/d), so that 1/rms needs no autograd node of its own;
 * dq: per token (N, d) written, or static (R, d) in double, added to; do0 (R, N, d) and
 * dlse0 (R, N, H) written when o0 is given. scratch: TT·(4·n + 2)·R·H + R·d floats. */
int attnres_read_backward(const float *const *srcs, const float *const *rms, int n, const float *q, int per_token,
                          const float *out, const float *lse0, const float *lse, const float *gout,
                          const float *glse, float *const *dsrc, float *const *drms, float *dq_tok, double *dq_static,
                          float *do0, float *dlse0, i64 N, int d, int H, int R, int use_sigmoid, int fold_rms,
                          i64 t0, i64 t1, float *scratch) {
    const int W = d / H, RH = R * H, nRH = n * RH;
    float *A = scratch;             /* α per (u, i, k), k = r·H + h */
    float *B = A + TT * nRH;        /* g_r · v_i */
    float *QV = B + TT * nRH;       /* q_r · v_i (the score before ρ) */
    float *SG = QV + TT * nRH;      /* σ(−s) for the sigmoid normaliser */
    float *delta = SG + TT * nRH;   /* Δ per (u, k) */
    float *a0 = delta + TT * RH;    /* weight of the initial state per (u, k) */
    float *dq_tile = a0 + TT * RH;  /* static query gradient of the current tile (R, d) */
    for (i64 ta = t0; ta < t1; ta += TT) {
        const int T = (int)(t1 - ta < TT ? t1 - ta : TT);
        if (per_token) memset(dq_tok + ta * d, 0, sizeof(float) * T * d);
        else memset(dq_tile, 0, sizeof(float) * R * d);
        /* pass 1: q·v and g·v of every (token, source, reader, head) */
        for (int i = 0; i < n; i++)
            for (int u = 0; u < T; u++) {
                const i64 t = ta + u;
                const float *v = srcs[i] + t * d;
                if (t + TT < t1) prefetch_row(v + TT * d, d);
                const i64 at = ((i64)u * n + i) * RH;
                for (int r = 0; r < R; r++) {
                    const float *qr = per_token ? q + t * d : q + (i64)r * d;
                    const float *g = gout + ((i64)r * N + t) * d;
                    if (i == 0 && t + TT < t1) prefetch_row(g + TT * d, d);
                    for (int h = 0; h < H; h++) {
                        QV[at + r * H + h] = dot(qr + h * W, v + h * W, W);
                        B[at + r * H + h] = dot(g + h * W, v + h * W, W);
                    }
                }
            }
        for (int u = 0; u < T; u++)
            for (int i = 0; i < n; i++) {
                const float rho = rms ? rms[i][ta + u] : 1.f;
                const i64 at = ((i64)u * n + i) * RH;
                for (int k = 0; k < RH; k++) A[at + k] = QV[at + k] * rho;
            }
        if (use_sigmoid) {
#pragma omp simd
            for (int j = 0; j < T * nRH; j++) SG[j] = 1.f / (1.f + exp_f(A[j])); /* σ(−s) = d log σ(s)/ds */
            for (int j = 0; j < T * nRH; j++) A[j] = log_sigmoid(A[j]);
        }
        for (int u = 0; u < T; u++)
            for (int r = 0; r < R; r++)
                for (int h = 0; h < H; h++) {
                    const i64 row = ((i64)r * N + ta + u) * H + h;
                    const float l = lse[row];
                    for (int i = 0; i < n; i++) A[((i64)u * n + i) * RH + r * H + h] -= l;
                    a0[u * RH + r * H + h] = lse0 ? lse0[row] - l : -INFINITY;
                }
#pragma omp simd
        for (int j = 0; j < T * nRH; j++) A[j] = exp_f(A[j]);
#pragma omp simd
        for (int j = 0; j < T * RH; j++) a0[j] = exp_f(a0[j]);
        /* Δ = g·out − g_lse. Without an initial state g·out = Σ_i α_i b_i, from the sources.
         * With one (a merge), out = a0·o0 + Σ_i α_i v_i: g·out is taken from the saved output
         * (which is the next sublayer's input, kept anyway) and a0·(g·o0) = g·out − Σ_i α_i b_i,
         * so o0 itself is never needed: a phase-1 read's outputs die with the forward. */
        for (int u = 0; u < T; u++) {
            float *du = delta + u * RH;
            for (int k = 0; k < RH; k++) du[k] = 0.f;
            for (int i = 0; i < n; i++)
                for (int k = 0; k < RH; k++) du[k] += A[((i64)u * n + i) * RH + k] * B[((i64)u * n + i) * RH + k];
            for (int r = 0; r < R; r++)
                for (int h = 0; h < H; h++) {
                    const i64 row = ((i64)r * N + ta + u) * H + h;
                    const int k = r * H + h;
                    float a0b0 = 0.f;
                    if (out) {
                        const i64 at = ((i64)r * N + ta + u) * d + h * W;
                        const float g_out = dot(gout + at, out + at, W);
                        a0b0 = g_out - du[k];
                        du[k] = g_out;
                        const float a = a0[u * RH + k];
#pragma omp simd
                        for (int c = 0; c < W; c++) do0[at + c] = a * gout[at + c];
                    }
                    if (glse) du[k] -= glse[row];
                    if (out) dlse0[row] = a0b0 - a0[u * RH + k] * du[k];
                }
        }
        /* pass 2: each source's gradient, written once (summed over readers), and dρ, dq */
        for (int i = 0; i < n; i++)
            for (int u = 0; u < T; u++) {
                const i64 t = ta + u;
                const float *v = srcs[i] + t * d;
                const float rho = rms ? rms[i][t] : 1.f;
                const i64 at = ((i64)u * n + i) * RH;
                float *dv = dsrc[i] + t * d;
                memset(dv, 0, sizeof(float) * d);
                float drho = 0.f;
                for (int r = 0; r < R; r++) {
                    const float *qr = per_token ? q + t * d : q + (i64)r * d;
                    const float *g = gout + ((i64)r * N + t) * d;
                    float *dqr = per_token ? dq_tok + t * d : dq_tile + (i64)r * d;
                    for (int h = 0; h < H; h++) {
                        const int k = r * H + h;
                        float ds = A[at + k] * (B[at + k] - delta[u * RH + k]); /* dL/dt, then dL/ds */
                        if (use_sigmoid) ds *= SG[at + k];
                        drho += ds * QV[at + k];
                        axpy(dv + h * W, A[at + k], g + h * W, W);       /* value path */
                        axpy(dv + h * W, ds * rho, qr + h * W, W);       /* key path */
                        axpy(dqr + h * W, ds * rho, v + h * W, W);       /* query gradient */
                    }
                }
                if (fold_rms && rms) {
                    const float coef = -drho * rho * rho * rho / d;
#pragma omp simd
                    for (int c = 0; c < d; c++) dv[c] += coef * v[c];
                } else if (drms) {
                    drms[i][t] = drho;
                }
            }
        if (!per_token)
            for (int c = 0; c < R * d; c++) dq_static[c] += dq_tile[c];
    }
    return 0;
}

/* 1/rms of each row of x (N, d): rho[t] = (mean x² + eps)^(-1/2). */
int attnres_inv_rms_forward(const float *x, float *rho, i64 N, int d, float eps) {
    for (i64 t = 0; t < N; t++) rho[t] = 1.f / sqrtf(dot(x + t * d, x + t * d, d) / d + eps);
    return 0;
}

/* dx = dρ · ∂ρ/∂x = −dρ · ρ³ · x / d. */
int attnres_inv_rms_backward(const float *x, const float *rho, const float *drho, float *dx, i64 N, int d) {
    for (i64 t = 0; t < N; t++) {
        const float coef = -drho[t] * rho[t] * rho[t] * rho[t] / d;
        const float *xt = x + t * d;
        float *o = dx + t * d;
#pragma omp simd
        for (int c = 0; c < d; c++) o[c] = coef * xt[c];
    }
    return 0;
}
