/* The depth reads of one reader and one head on the CPU, forward and backward: every phase-2
 * merge of the two-phase schedule — a running read (o0, lse0), the phase-1 read of the sources
 * completed before the chunk, continued by n more sources u_i (Block: the partial sum b_n^{i-1};
 * Full: the chunk's earlier outputs) — and every read of a sublayer on its own (no running read:
 * the per-read schedule, sliding window, per-token queries), with the key norm computed here:
 *
 *     ρ_i = 1/rms(u_i) (1 without key norm)   s_i = (q · u_i) · ρ_i   t_i = s_i or log σ(s_i)
 *     lse = log(e^lse0 + Σ_i e^t_i)           out = e^(lse0 − lse)·o0 + Σ_i e^(t_i − lse)·u_i
 *
 * (without a running read, lse0 = −∞), q static or per token: the same read as
 * attnres_read_forward in depth_read.c with R = H = 1, for the reads that run once or twice per
 * sublayer.
 *
 * Design decisions:
 * - Rows, then lanes, then rows. Per group of G tokens, pass 1 sweeps each token's rows once and
 *   takes all its sums at once (u·u and q·u; backward also g·u, and g·out for a merge); pass 2 runs the
 *   softmax and every per-token coefficient with the G tokens in the lanes of one vector; pass 3
 *   writes each output row once, while the group's rows are still in L1. Each sum is a plain
 *   reduction over d with d a compile-time constant at the common widths (no pointer tables, no
 *   batched horizontal sums): at d 64 a merge ran at ~1/3 of the speed of an elementwise op moving
 *   the same bytes in depth_read.c's general path, and close to it here; plain reads of 2 to 16
 *   sources 10–25% faster than there (benchmarks/RESULTS.md).
 * - 1/rms from the u·u of pass 1 instead of an input: the partial sum b changes every sublayer,
 *   and its 1/rms was a kernel call (and a sweep of b) of its own; the backward recomputes it the
 *   same way and adds the key norm's gradient to du directly (no 1/rms autograd node).
 * - The backward takes the merge's own output instead of o0 (Δ = g·out; α0·(g·o0) = Δ − Σ α_i g·u_i,
 *   as in depth_read.c), so the phase-1 output o0 need not outlive the forward. A plain read
 *   takes Δ = Σ α_i g·u_i from its sources instead (more precise, see one_backward_body).
 * - The backward's weights e^(t − lse) are divided by their sum (1 but for the rounding of the
 *   forward's fp32 lse), and its scores are rounded as the forward's (row_score): through a nearly
 *   one-hot softmax the gradients are differences that cancel only if the weights sum to 1.
 * - A static query's gradient is summed over a group in float and flushed into double per group;
 *   ranges on OpenMP threads keep one double accumulator each, summed in range order at the end
 *   (a given thread count always gives the same result).
 * Pointers are raw; shapes and contiguity are checked by the Python wrapper (cpu_kernels.py).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vector_math.h"

typedef int64_t i64;

#define G LANES /* tokens per group: the lanes of pass 2 (vector_math.h) */
#define MAX_SOURCES 64 /* bound of the per-group tables on the stack; the entry points check it */

/* Ask for a row two groups ahead: within a group the loop jumps between n + 1 tensors every
 * row, runs too short for the hardware prefetcher to follow. */
static inline void prefetch_ahead(const float *row, int d, i64 t, i64 t1) {
    if (t + 2 * G < t1)
        for (int c = 0; c < d; c += 16) __builtin_prefetch(row + 2 * G * d + c, 0, 1);
}

/* The score s = (q·u)·ρ of one row and its ρ = 1/rms(u) (1 without key norm), one function for
 * the forward and the backward so that both round it the same way, to the bit: the backward's
 * weights e^(t − lse) take t from its own scores and lse from the forward's, so a score rounded
 * differently (another order of the sums, a division instead of a product) shifts its weight by
 * that rounding error times |s| (6e-2 relative at |s| ~ 1e6, 1e-2 in the query's gradient at
 * |s| ~ 200). */
static inline __attribute__((always_inline)) float row_score(const float *restrict x, const float *restrict qt,
                                                              int d, float eps, int key_norm, float *rho) {
    float xx = 0.f, qx = 0.f;
#pragma omp simd reduction(+ : xx, qx)
    for (int c = 0; c < d; c++) {
        xx += x[c] * x[c];
        qx += qt[c] * x[c];
    }
    *rho = key_norm ? 1.f / sqrtf(xx / d + eps) : 1.f;
    return qx * *rho;
}

static inline __attribute__((always_inline)) void one_forward_body(
    const float *const *u, int n, const float *restrict q, int per_token, const float *restrict o0,
    const float *restrict lse0, float *restrict out, float *restrict lse, int d, float eps, int key_norm,
    int use_sigmoid, i64 t0, i64 t1) {
    float S[MAX_SOURCES * G]; /* per (source, lane): score, then weight */
    float A0[G], L[G];
    for (i64 ta = t0; ta < t1; ta += G) {
        const int T = (int)(t1 - ta < G ? t1 - ta : G);
        for (int k = 0; k < T; k++) { /* pass 1: sums per row */
            const i64 t = ta + k;
            const float *restrict qt = per_token ? q + t * d : q;
            if (o0) prefetch_ahead(o0 + t * d, d, t, t1);
            if (per_token) prefetch_ahead(qt, d, t, t1);
            for (int i = 0; i < n; i++) {
                const float *restrict x = u[i] + t * d;
                prefetch_ahead(x, d, t, t1);
                float rho;
                S[i * G + k] = row_score(x, qt, d, eps, key_norm, &rho);
            }
            L[k] = o0 ? lse0[t] : -INFINITY; /* no running read: its weight is e^−∞ = 0 */
        }
        for (int k = T; k < G; k++) { /* idle lanes: finite, never written out */
            for (int i = 0; i < n; i++) S[i * G + k] = 0.f;
            L[k] = o0 ? 0.f : -INFINITY;
        }
        if (use_sigmoid) /* σ_i / (e^lse0 + Σ σ_j) = softmax over (lse0, log σ_i) */
            for (int j = 0; j < n * G; j++) S[j] = log_sigmoid(S[j]);
        lane_softmax(S, n, L, A0);
        for (int k = 0; k < T; k++) { /* pass 3: each output row once */
            const i64 t = ta + k;
            float *restrict y = out + t * d;
            const float *restrict x0 = o0 ? o0 + t * d : u[0] + t * d; /* the first term */
            const float a0 = o0 ? A0[k] : S[k];
#pragma omp simd
            for (int c = 0; c < d; c++) y[c] = a0 * x0[c];
            for (int i = o0 ? 0 : 1; i < n; i++) {
                const float a = S[i * G + k];
                const float *restrict x = u[i] + t * d;
#pragma omp simd
                for (int c = 0; c < d; c++) y[c] += a * x[c];
            }
            lse[t] = L[k];
        }
    }
}

/* The gradients, with α_i ∝ e^(t_i − lse), α0 ∝ e^(lse0 − lse) (normalised), Δ = g·out (a plain
 * read: Σ α_i g·u_i) and no gradient into lse (a merge's lse is not an output of the model); per
 * token, q_t for q and dq_t for dq:
 *     dt_i = α_i (g·u_i − Δ)     ds_i = dt_i (softmax) or dt_i σ(−s_i) (sigmoid)
 *     du_i = α_i g + ds_i ρ_i q − ds_i s_i ρ_i² u_i / d     (the last term: the key norm's)
 *     dq = Σ_t Σ_i ds_i ρ_i u_i     do0 = α0 g     dlse0 = −Σ_i dt_i  (= α0 (g·o0 − Δ))
 */
static inline __attribute__((always_inline)) void one_backward_body(
    const float *const *u, int n, const float *restrict q, int per_token, const float *restrict out,
    const float *restrict lse0, const float *restrict lse, const float *restrict g, float *const *du,
    double *restrict dq, float *restrict dq_tok, float *restrict do0, float *restrict dlse0, int d, float eps,
    int key_norm, int use_sigmoid, i64 t0, i64 t1, float *restrict dq_group) {
    float S[MAX_SOURCES * G];  /* score s, then α */
    float GU[MAX_SOURCES * G]; /* g·u, then ds·ρ (the coefficient of q) */
    float RH[MAX_SOURCES * G]; /* ρ, then −ds·s·ρ²/d (the coefficient of u) */
    float E[MAX_SOURCES * G]; /* e^(t − lse) */
    float GO[G], L[G], A0[G], DL0[G], Z[G];
    for (i64 ta = t0; ta < t1; ta += G) {
        const int T = (int)(t1 - ta < G ? t1 - ta : G);
        for (int k = 0; k < T; k++) { /* pass 1: sums per row */
            const i64 t = ta + k;
            const float *restrict gt = g + t * d;
            prefetch_ahead(gt, d, t, t1);
            if (lse0) { /* a merge: Δ = g·out (a plain read sums it from its sources below) */
                const float *restrict yt = out + t * d;
                prefetch_ahead(yt, d, t, t1);
                float gy = 0.f;
#pragma omp simd reduction(+ : gy)
                for (int c = 0; c < d; c++) gy += gt[c] * yt[c];
                GO[k] = gy;
            }
            const float *restrict qt = per_token ? q + t * d : q;
            if (per_token) prefetch_ahead(qt, d, t, t1);
            for (int i = 0; i < n; i++) {
                const float *restrict x = u[i] + t * d;
                prefetch_ahead(x, d, t, t1);
                float rho, gx = 0.f;
                S[i * G + k] = row_score(x, qt, d, eps, key_norm, &rho);
#pragma omp simd reduction(+ : gx)
                for (int c = 0; c < d; c++) gx += gt[c] * x[c];
                RH[i * G + k] = rho;
                GU[i * G + k] = gx;
            }
            L[k] = lse[t];
            A0[k] = lse0 ? lse0[t] : -INFINITY;
        }
        for (int k = T; k < G; k++) {
            for (int i = 0; i < n; i++) S[i * G + k] = 0.f, RH[i * G + k] = 1.f, GU[i * G + k] = 0.f;
            GO[k] = L[k] = A0[k] = 0.f;
        }
#pragma omp simd
        for (int k = 0; k < G; k++) {
            A0[k] = Z[k] = exp_f(A0[k] - L[k]);
            DL0[k] = 0.f;
        }
        /* The weights e^(t − lse) divided by their sum, 1 but for lse's rounding (|lse|·2⁻²⁴):
         * gradients through a nearly one-hot softmax cancel only if the weights sum to 1 (see
         * normalise_lanes in depth_read.c). */
        for (int i = 0; i < n; i++) {
#pragma omp simd
            for (int k = 0; k < G; k++) {
                const float s = S[i * G + k];
                E[i * G + k] = exp_f((use_sigmoid ? log_sigmoid(s) : s) - L[k]);
                Z[k] += E[i * G + k];
            }
        }
#pragma omp simd
        for (int k = 0; k < G; k++) {
            Z[k] = 1.f / Z[k];
            A0[k] *= Z[k];
        }
        if (!lse0) { /* a plain read: Δ = Σ α_i (g·u_i), in which g·u of the heaviest source cancels
                      * against itself; g·out, a dot product of its own, would not cancel it exactly,
                      * and the query's gradient through a nearly one-hot softmax was 10× less
                      * precise */
            for (int k = 0; k < G; k++) GO[k] = 0.f;
            for (int i = 0; i < n; i++) {
#pragma omp simd
                for (int k = 0; k < G; k++) GO[k] += E[i * G + k] * Z[k] * GU[i * G + k];
            }
        }
        for (int i = 0; i < n; i++) { /* pass 2: coefficients, tokens in the lanes */
#pragma omp simd
            for (int k = 0; k < G; k++) {
                const int j = i * G + k;
                const float s = S[j];
                const float a = E[j] * Z[k];
                const float dt = a * (GU[j] - GO[k]);
                const float ds = use_sigmoid ? dt / (1.f + exp_f(s)) : dt;
                DL0[k] -= dt;
                S[j] = a;
                GU[j] = ds * RH[j];
                RH[j] = key_norm ? -ds * s * RH[j] * RH[j] / d : 0.f;
            }
        }
        if (!per_token) memset(dq_group, 0, sizeof(float) * d);
        for (int k = 0; k < T; k++) { /* pass 3: each gradient row once */
            const i64 t = ta + k;
            const float *restrict gt = g + t * d;
            const float *restrict qt = per_token ? q + t * d : q;
            if (do0) {
                float *restrict o = do0 + t * d;
                const float a0 = A0[k];
#pragma omp simd
                for (int c = 0; c < d; c++) o[c] = a0 * gt[c];
                dlse0[t] = DL0[k];
            }
            float *restrict dqt = per_token ? dq_tok + t * d : dq_group; /* a row, or the group's sum */
            if (per_token) memset(dqt, 0, sizeof(float) * d);
            for (int i = 0; i < n; i++) {
                const int j = i * G + k;
                const float a = S[j], cq = GU[j], cu = RH[j];
                const float *restrict x = u[i] + t * d;
                float *restrict dx = du[i] + t * d;
#pragma omp simd
                for (int c = 0; c < d; c++) {
                    dx[c] = a * gt[c] + cq * qt[c] + cu * x[c];
                    dqt[c] += cq * x[c];
                }
            }
        }
        if (!per_token)
            for (int c = 0; c < d; c++) dq[c] += dq_group[c];
    }
}

/* The common widths as compile-time constants (see vector_math.h's FIXED). */
#define WIDTHS(call) \
    switch (d) {     \
    case 64: call(64); break; \
    case 128: call(128); break; \
    case 256: call(256); break; \
    default: call(d); \
    }

static void one_forward(const float *const *u, int n, const float *q, int per_token, const float *o0, const float *lse0,
                          float *out, float *lse, int d, float eps, int key_norm, int use_sigmoid, i64 t0, i64 t1) {
#define FWD(w) one_forward_body(u, n, q, per_token, o0, lse0, out, lse, w, eps, key_norm, use_sigmoid, t0, t1)
    WIDTHS(FWD)
#undef FWD
}

static void one_backward(const float *const *u, int n, const float *q, int per_token, const float *out,
                           const float *lse0, const float *lse, const float *g, float *const *du, double *dq,
                           float *dq_tok, float *do0, float *dlse0, int d, float eps, int key_norm, int use_sigmoid,
                           i64 t0, i64 t1, float *dq_group) {
#define BWD(w)                                                                                                       \
    one_backward_body(u, n, q, per_token, out, lse0, lse, g, du, dq, dq_tok, do0, dlse0, w, eps, key_norm,          \
                        use_sigmoid, t0, t1, dq_group)
    WIDTHS(BWD)
#undef BWD
}

int attnres_read_one_max_sources(void) { return MAX_SOURCES; }

/* Forward over the k token ranges [bounds[j], bounds[j + 1]), one per OpenMP thread (where the
 * library is built with OpenMP, see native.py). u: n pointers to (N, d); q: (d) static, or (N, d)
 * per token; o0 (N, d) and lse0 (N): the running read, or both NULL (a plain read of the n
 * sources); out (N, d), lse (N). Returns 0, or 2 if n is not in 1 .. MAX_SOURCES. */
int attnres_read_one_forward(const float *const *u, int n, const float *q, int per_token, const float *o0,
                          const float *lse0, float *out, float *lse, int d, float eps, int key_norm, int use_sigmoid,
                          const i64 *bounds, int k) {
    if (n < 1 || n > MAX_SOURCES) return 2;
#pragma omp parallel for num_threads(k) schedule(static, 1) if (k > 1)
    for (int j = 0; j < k; j++)
        one_forward(u, n, q, per_token, o0, lse0, out, lse, d, eps, key_norm, use_sigmoid, bounds[j], bounds[j + 1]);
    return 0;
}

/* Backward over the k ranges; out is the read's own output, g its gradient, lse0 NULL for a plain
 * read; writes du (n pointers to (N, d)), dq ((d) static, (N, d) per token), and for a merge
 * do0 (N, d) and dlse0 (N) (else NULL). Returns 0, 1 if memory ran out, or 2 if n is not in
 * 1 .. MAX_SOURCES. */
int attnres_read_one_backward(const float *const *u, int n, const float *q, int per_token, const float *out,
                           const float *lse0, const float *lse, const float *g, float *const *du, float *dq,
                           float *do0, float *dlse0, int d, float eps, int key_norm, int use_sigmoid,
                           const i64 *bounds, int k) {
    if (n < 1 || n > MAX_SOURCES) return 2;
    double *acc = per_token ? NULL : calloc((size_t)k * d, sizeof(double));
    float *groups = per_token ? NULL : malloc(sizeof(float) * (size_t)k * d);
    if (!per_token && (!acc || !groups)) {
        free(acc);
        free(groups);
        return 1;
    }
#pragma omp parallel for num_threads(k) schedule(static, 1) if (k > 1)
    for (int j = 0; j < k; j++)
        one_backward(u, n, q, per_token, out, lse0, lse, g, du, per_token ? NULL : acc + (i64)j * d,
                       per_token ? dq : NULL, do0, dlse0, d, eps, key_norm, use_sigmoid, bounds[j], bounds[j + 1],
                       per_token ? NULL : groups + (i64)j * d);
    if (!per_token)
        for (int c = 0; c < d; c++) {
            double s = 0.0;
            for (int j = 0; j < k; j++) s += acc[(i64)j * d + c];
            dq[c] = (float)s;
        }
    free(acc);
    free(groups);
    return 0;
}
