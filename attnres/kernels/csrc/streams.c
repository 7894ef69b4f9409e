/* The stream mixing of mHC (manifold-constrained Hyper-Connections) on the CPU, forward and
 * backward, fp32: the same function as the reference in attnres/residuals/hyper_connections.py
 * (same math, same arguments). The state is one (N, n, d) array: per token the n streams of width
 * d, contiguous. Per sublayer, with proj = vec(H) @ (g ∘ φ) computed by the caller (a matmul):
 *
 *     rstd = 1/sqrt(|vec H|²/(n·d) + eps),   z = rstd · proj                    (m = 2n + n² values)
 *     pre  = σ(α_pre·z[:n] + b),   post = 2σ(α_post·z[n:2n] + b),
 *     res  = Sinkhorn-Knopp(exp(α_res·z[2n:] + b − max)),   h = Σ_k pre_k · H_k        ("mix")
 *     H'_i = post_i · v + Σ_j res_ij · H_j                                           ("update")
 *
 * How:
 * - Everything that is per token and small (gates, sigmoid, the n×n Sinkhorn iterations) runs on
 *   tiles of TT tokens laid out token-last, a[k][lane]: every loop over a matrix entry is a loop
 *   over TT lanes that the compiler vectorises, and all 2·iters normalisation steps of a tile stay
 *   in L1 (the reference spends dozens of dispatched tensor ops on the same work).
 * - Whole streams are touched once per pass, per token: the update reads each H_j and writes
 *   each H'_i once (n² multiply-adds from cache), the mix reads H once for |H|² and the pre-mix.
 * - The Sinkhorn backward is the exact gradient of the unrolled iterations, recomputed per tile
 *   from the logits (the iterates and their sums are kept in a per-call scratch, TT tokens at a
 *   time) rather than stored per token for the whole sequence.
 * - The backward of the mix returns the gradient reaching H (pre-mix and rstd terms, plus the
 *   incoming gradient) and d proj; the caller adds d proj @ wᵀ with a matmul before the update's
 *   backward, so H's gradient is one array written by one kernel, never a sum of autograd
 *   branches.
 * - Sinkhorn multiplies by the reciprocal of each row or column sum where the reference
 *   divides (n divisions per step instead of n²; results differ in the last bits). A
 *   vectorisable exp (libm's is a scalar call), and no fminf/fmaxf (library calls unless NaNs
 *   are ruled out): plain comparisons.
 * - The matmuls stay with the caller (torch): they are most of the arithmetic, a BLAS does them
 *   well, and FLOP counters (torch.utils.flop_counter) see them there.
 * - Every function takes a thread count and splits its tokens (whole tiles) over that many
 *   OpenMP threads, torch's own (native.py builds this file with -fopenmp only where the two
 *   share libgomp). The mix backward's parameter gradients are summed per thread and added in
 *   thread order, so a given thread count always gives the same result.
 * Pointers are raw; shapes, dtype and contiguity are checked by the wrapper (cpu_streams.py).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vector_math.h"

#ifdef _OPENMP
#include <omp.h>
#endif

typedef int64_t i64;

#define TT 16 /* tokens per tile: one AVX-512 register of lanes */

static inline float sigmoid(float u) { return 1.f / (1.f + exp_f(-u)); }


static inline void scale_into(float *restrict y, float a, const float *restrict x, int w) {
#pragma omp simd
    for (int c = 0; c < w; c++) y[c] = a * x[c];
}

/* ---- Sinkhorn-Knopp on one tile: M[(i·n + j)·TT + lane] ---------------------------------- */

/* Floats of scratch a tile's Sinkhorn backward needs: the 2·iters + 1 iterates, the 2·iters
 * vectors of reciprocal sums and one working matrix. */
static i64 sinkhorn_scratch(int n, int iters) { return ((i64)(2 * iters + 2) * n * n + (i64)2 * iters * n) * TT; }

/* One tile row: TT lanes as one vector (GCC/Clang vector extension; an AVX-512 register here,
 * split by the compiler where vectors are narrower). Tile buffers are 64-byte aligned. */
typedef float vf __attribute__((vector_size(TT * sizeof(float))));

static float *tile_alloc(i64 floats) {
    const size_t bytes = ((size_t)floats * sizeof(float) + 63) / 64 * 64;
    return aligned_alloc(64, bytes ? bytes : 64);
}

/* In place on M (n·n rows of TT lanes): logits in, the doubly stochastic matrices out. With
 * `iterates` (and `sums`), keeps every step's output (iterates[0] = exp(logits − max)) and the
 * reciprocals of every step's row or column sums. The steps are explicit vector code, rows and
 * columns in separate loops: with a step-dependent index the compiler vectorised over the wrong
 * axis (gathers). Inlined into callers that pass n = 4 as a constant, so that case unrolls. */
static inline __attribute__((always_inline)) void sinkhorn_tile(float *restrict M, int n, int iters,
                                                                float *restrict iterates, float *restrict sums) {
    const int nn = n * n;
    float top[TT];
    for (int u = 0; u < TT; u++) top[u] = -INFINITY;
    for (int k = 0; k < nn; k++)
#pragma omp simd
        for (int u = 0; u < TT; u++) top[u] = larger(top[u], M[k * TT + u]);
    for (int k = 0; k < nn; k++)
#pragma omp simd
        for (int u = 0; u < TT; u++) M[k * TT + u] = exp_f(M[k * TT + u] - top[u]);
    vf *V = (vf *)M, *I = (vf *)iterates, *S = (vf *)sums;
    if (I)
        for (int k = 0; k < nn; k++) I[k] = V[k];
    for (int it = 0; it < iters; it++) {
        for (int i = 0; i < n; i++) { /* rows: a sum over j */
            vf t = V[i * n];
            for (int j = 1; j < n; j++) t += V[i * n + j];
            const vf r = 1.f / t;
            for (int j = 0; j < n; j++) V[i * n + j] *= r;
            if (S) S[2 * it * n + i] = r;
        }
        if (I)
            for (int k = 0; k < nn; k++) I[(2 * it + 1) * nn + k] = V[k];
        for (int j = 0; j < n; j++) { /* columns: a sum over i */
            vf t = V[j];
            for (int i = 1; i < n; i++) t += V[i * n + j];
            const vf r = 1.f / t;
            for (int i = 0; i < n; i++) V[i * n + j] *= r;
            if (S) S[(2 * it + 1) * n + j] = r;
        }
        if (I)
            for (int k = 0; k < nn; k++) I[(2 * it + 2) * nn + k] = V[k];
    }
}

/* G (the gradient of the output, in place) becomes the gradient of the logits L (read-only).
 * Each step y = x / Σ_axis x has dx = (dy − Σ_axis dy·y) / Σ_axis x. */
static inline __attribute__((always_inline)) void sinkhorn_tile_backward(const float *restrict L, float *restrict G, int n,
                                                                         int iters, float *restrict scratch) {
    const int nn = n * n;
    float *iterates = scratch, *sums = scratch + (i64)(2 * iters + 1) * nn * TT;
    float *work = sums + (i64)2 * iters * n * TT;
    memcpy(work, L, sizeof(float) * nn * TT);
    sinkhorn_tile(work, n, iters, iterates, sums);
    const vf *I = (const vf *)iterates, *S = (const vf *)sums;
    vf *D = (vf *)G;
    for (int it = iters - 1; it >= 0; it--) {
        const vf *y = I + (2 * it + 2) * nn; /* the output of the column step */
        for (int j = 0; j < n; j++) {
            vf c = D[j] * y[j];
            for (int i = 1; i < n; i++) c += D[i * n + j] * y[i * n + j];
            const vf r = S[(2 * it + 1) * n + j];
            for (int i = 0; i < n; i++) D[i * n + j] = (D[i * n + j] - c) * r;
        }
        y = I + (2 * it + 1) * nn; /* the output of the row step */
        for (int i = 0; i < n; i++) {
            vf c = D[i * n] * y[i * n];
            for (int j = 1; j < n; j++) c += D[i * n + j] * y[i * n + j];
            const vf r = S[2 * it * n + i];
            for (int j = 0; j < n; j++) D[i * n + j] = (D[i * n + j] - c) * r;
        }
    }
    for (int k = 0; k < nn; k++) D[k] *= I[k];
}

/* ---- the mix: coefficients and pre-mix of one sublayer ----------------------------------- */

/* Loads a tile's z = rstd·proj token-last, and its rstd (computed from H when `find_rstd`, else
 * read from rstd). Lanes past the end get z = 0, rstd = 1. */
static void load_z(const float *H, const float *proj, float *rstd, int find_rstd, float eps, i64 ta, int T, int n,
                   int d, int m, float *restrict Z, float *restrict rs) {
    const int nd = n * d;
    for (int u = 0; u < TT; u++) {
        float r = 1.f;
        if (u < T) {
            if (find_rstd) {
                const float *Ht = H + (ta + u) * nd;
                r = 1.f / sqrtf(dot(Ht, Ht, nd) / (float)nd + eps);
                rstd[ta + u] = r;
            } else {
                r = rstd[ta + u];
            }
        }
        rs[u] = r;
        for (int k = 0; k < m; k++) Z[k * TT + u] = u < T ? proj[(ta + u) * m + k] * r : 0.f;
    }
}

/* Forward. H (N, n, d), proj (N, m), gates (3): α_pre, α_post, α_res; bias (m). Writes rstd (N),
 * h (N, d), post (N, n), res (N, n, n), and pre (N, n) unless NULL. Returns 0, -1 without memory. */
int mhc_mix_forward(const float *H, const float *proj, const float *gates, const float *bias, float *rstd, float *h,
                    float *pre_out, float *post, float *res, i64 N, int n, int d, int iters, float eps, int threads) {
    const int nn = n * n, m = 2 * n + nn, nd = n * d;
    const float a_pre = gates[0], a_post = gates[1], a_res = gates[2];
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1) reduction(| : failed)
    {
        float *Z = tile_alloc((i64)(m + n) * TT);
        failed |= !Z;
        float *P = Z ? Z + m * TT : NULL, rs[TT];
#pragma omp for schedule(static)
        for (i64 ta = 0; ta < N; ta += TT) {
            if (!Z) continue;
            const int T = (int)(N - ta < TT ? N - ta : TT);
            load_z(H, proj, rstd, 1, eps, ta, T, n, d, m, Z, rs);
            for (int k = 0; k < n; k++)
#pragma omp simd
                for (int u = 0; u < TT; u++) {
                    P[k * TT + u] = sigmoid(a_pre * Z[k * TT + u] + bias[k]);
                    Z[(n + k) * TT + u] = 2.f * sigmoid(a_post * Z[(n + k) * TT + u] + bias[n + k]);
                }
            float *R = Z + 2 * n * TT;
            for (int k = 0; k < nn; k++)
#pragma omp simd
                for (int u = 0; u < TT; u++) R[k * TT + u] = a_res * R[k * TT + u] + bias[2 * n + k];
            if (n == 4) sinkhorn_tile(R, 4, iters, NULL, NULL);
            else sinkhorn_tile(R, n, iters, NULL, NULL);
            for (int u = 0; u < T; u++) {
                const i64 t = ta + u;
                for (int k = 0; k < n; k++) {
                    post[t * n + k] = Z[(n + k) * TT + u];
                    if (pre_out) pre_out[t * n + k] = P[k * TT + u];
                }
                for (int k = 0; k < nn; k++) res[t * nn + k] = R[k * TT + u];
                const float *Ht = H + t * nd;
                float *ht = h + t * d;
                scale_into(ht, P[u], Ht, d);
                for (int k = 1; k < n; k++) axpy(ht, P[k * TT + u], Ht + k * d, d);
            }
        }
        free(Z);
    }
    return failed ? -1 : 0;
}

/* Backward of the mix. Gradients in: dh (N, d), dpost (N, n), dres (N, n, n), gH (N, n, d) (the
 * gradient H receives elsewhere); any may be NULL (zero). Out: G (N, n, d) = gH + the pre-mix and
 * rstd terms (not the projection's: the caller adds dproj @ wᵀ), dproj (N, m), and
 * dgates (3), dbias (m) added into (double). Returns 0, -1 without memory. */
int mhc_mix_backward(const float *H, const float *proj, const float *rstd, const float *gates, const float *bias,
                     const float *dh, const float *dpost, const float *dres, const float *gH, float *G, float *dproj,
                     double *dgates, double *dbias, i64 N, int n, int d, int iters, int threads) {
    const int nn = n * n, m = 2 * n + nn, nd = n * d;
    const float alpha[3] = {gates[0], gates[1], gates[2]};
    /* each thread sums dgates and dbias over its own tokens; the sums are added in thread order
     * afterwards, so a given thread count always gives the same result */
    double *acc = calloc((size_t)(threads > 1 ? threads : 1) * (3 + m), sizeof(double));
    if (!acc) return -1;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1) reduction(| : failed)
    {
        float *Z = tile_alloc((i64)(2 * m + n + n * n) * TT + sinkhorn_scratch(n, iters));
        failed |= !Z;
        float *U = Z ? Z + m * TT : NULL;      /* logits, then the gradient of the pre-activations u = α·z + b */
        float *P = Z ? U + m * TT : NULL;      /* pre */
        float *scratch = Z ? P + n * TT : NULL;
        float rs[TT], coef[TT];
#ifdef _OPENMP
        double *dgate_acc = acc + (i64)omp_get_thread_num() * (3 + m);
#else
        double *dgate_acc = acc;
#endif
        double *dbias_acc = dgate_acc + 3;
#pragma omp for schedule(static)
        for (i64 ta = 0; ta < N; ta += TT) {
            if (!Z) continue;
            const int T = (int)(N - ta < TT ? N - ta : TT);
            load_z(H, proj, (float *)rstd, 0, 0.f, ta, T, n, d, m, Z, rs);
            /* pre and its gradient dpre_k = dh · H_k */
            for (int k = 0; k < n; k++) {
#pragma omp simd
                for (int u = 0; u < TT; u++) P[k * TT + u] = sigmoid(alpha[0] * Z[k * TT + u] + bias[k]);
                for (int u = 0; u < TT; u++) {
                    const float g = (dh && u < T) ? dot(dh + (ta + u) * d, H + (ta + u) * nd + k * d, d) : 0.f;
                    U[k * TT + u] = g * (1.f - P[k * TT + u]) * P[k * TT + u];
                }
            }
            /* post = 2σ(u): du = 2·dpost·σ(1−σ) */
            for (int k = 0; k < n; k++) {
                float *Uk = U + (n + k) * TT;
                for (int u = 0; u < TT; u++) Uk[u] = (dpost && u < T) ? dpost[(ta + u) * n + k] : 0.f;
#pragma omp simd
                for (int u = 0; u < TT; u++) {
                    const float s = sigmoid(alpha[1] * Z[(n + k) * TT + u] + bias[n + k]);
                    Uk[u] = 2.f * Uk[u] * (1.f - s) * s;
                }
            }
            /* res: the Sinkhorn backward from its logits */
            float *Ur = U + 2 * n * TT;
            if (dres) {
                float *Lg = scratch; /* the logits, read-only for the backward; its scratch follows */
                float *work = scratch + nn * TT;
                for (int k = 0; k < nn; k++)
#pragma omp simd
                    for (int u = 0; u < TT; u++) Lg[k * TT + u] = alpha[2] * Z[(2 * n + k) * TT + u] + bias[2 * n + k];
                for (int k = 0; k < nn; k++)
                    for (int u = 0; u < TT; u++) Ur[k * TT + u] = u < T ? dres[(ta + u) * nn + k] : 0.f;
                if (n == 4) sinkhorn_tile_backward(Lg, Ur, 4, iters, work);
                else sinkhorn_tile_backward(Lg, Ur, n, iters, work);
            } else {
                memset(Ur, 0, sizeof(float) * nn * TT);
            }
            /* u = α_g·z + b: dα_g = Σ du·z, db = Σ du, dz = α_g·du; z = rstd·proj */
            for (int u = 0; u < TT; u++) coef[u] = 0.f;
            for (int k = 0; k < m; k++) {
                const int g = k < n ? 0 : (k < 2 * n ? 1 : 2);
                float sz = 0.f, su = 0.f;
                for (int u = 0; u < T; u++) {
                    const float du = U[k * TT + u];
                    sz += du * Z[k * TT + u];
                    su += du;
                    const float dz = alpha[g] * du;
                    dproj[(ta + u) * m + k] = rs[u] * dz;
                    coef[u] += dz * proj[(ta + u) * m + k]; /* d rstd */
                }
                dgate_acc[g] += sz;
                dbias_acc[k] += su;
            }
            /* G_k = gH_k + pre_k·dh + d rstd · (−rstd³/(n·d)) · H_k */
            for (int u = 0; u < T; u++) {
                const i64 t = ta + u;
                const float c = coef[u] * -(rs[u] * rs[u] * rs[u]) / (float)nd;
                for (int k = 0; k < n; k++) { /* one pass per stream: G written once */
                    const float *restrict Hk = H + t * nd + k * d, *restrict gk = gH ? gH + t * nd + k * d : NULL;
                    const float *restrict dht = dh ? dh + t * d : NULL;
                    float *restrict Gk = G + t * nd + k * d;
                    const float p = P[k * TT + u];
                    if (gk && dht) {
#pragma omp simd
                        for (int e = 0; e < d; e++) Gk[e] = gk[e] + c * Hk[e] + p * dht[e];
                    } else {
                        scale_into(Gk, c, Hk, d);
                        if (gk) axpy(Gk, 1.f, gk, d);
                        if (dht) axpy(Gk, p, dht, d);
                    }
                }
            }
        }
        free(Z);
    }
    for (int j = 0; j < (threads > 1 ? threads : 1); j++) {
        for (int g = 0; g < 3; g++) dgates[g] += acc[(i64)j * (3 + m) + g];
        for (int k = 0; k < m; k++) dbias[k] += acc[(i64)j * (3 + m) + 3 + k];
    }
    free(acc);
    return failed ? -1 : 0;
}

/* ---- the update: H'_i = post_i·v + Σ_j res_ij·H_j ---------------------------------------- */

/* Hp (N, n, d), v (N, d), post (N, n), res (N, n, n) → Hn (N, n, d). Returns 0. */
int mhc_update_forward(const float *Hp, const float *v, const float *post, const float *res, float *Hn, i64 N, int n,
                       int d, int threads) {
    const i64 nd = (i64)n * d;
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (i64 t = 0; t < N; t++) {
        const float *Hpt = Hp + t * nd, *vt = v + t * d, *rt = res + t * n * n;
        float *Hnt = Hn + t * nd;
        for (int i = 0; i < n; i++) {
            float *o = Hnt + i * d;
            scale_into(o, post[t * n + i], vt, d);
            for (int j = 0; j < n; j++) axpy(o, rt[i * n + j], Hpt + j * d, d);
        }
    }
    return 0;
}

/* Backward of the update from G (N, n, d), the gradient of Hn: dHp (N, n, d), dv (N, d),
 * dpost (N, n), dres (N, n, n). Returns 0. */
int mhc_update_backward(const float *G, const float *Hp, const float *v, const float *post, const float *res,
                        float *dHp, float *dv, float *dpost, float *dres, i64 N, int n, int d, int threads) {
    const i64 nd = (i64)n * d;
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (i64 t = 0; t < N; t++) {
        const float *Gt = G + t * nd, *Hpt = Hp + t * nd, *vt = v + t * d, *rt = res + t * n * n;
        float *dHt = dHp + t * nd, *dvt = dv + t * d;
        for (int i = 0; i < n; i++) {
            dpost[t * n + i] = dot(Gt + i * d, vt, d);
            for (int j = 0; j < n; j++) dres[(t * n + i) * n + j] = dot(Gt + i * d, Hpt + j * d, d);
        }
        scale_into(dvt, post[t * n], Gt, d);
        for (int i = 1; i < n; i++) axpy(dvt, post[t * n + i], Gt + i * d, d);
        for (int j = 0; j < n; j++) {
            float *o = dHt + j * d;
            scale_into(o, rt[j], Gt, d);
            for (int i = 1; i < n; i++) axpy(o, rt[i * n + j], Gt + i * d, d);
        }
    }
    return 0;
}
