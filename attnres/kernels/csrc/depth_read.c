/* One depth read on the CPU, forward and backward, fp32: the C counterpart of triton_kernels.py,
 * any number of readers at once.
 *
 *     s_ri = (q_r · v_i) · ρ_i       ρ_i = 1/rms(v_i) (1 without key norm)
 *     t_ri = s_ri (softmax)  or  log σ(s_ri) (sigmoid, renormalised)
 *     out_r = Σ_i softmax_i(t_ri) v_i,   lse_r = log Σ_i exp(t_ri)
 *
 * plus an optional running read (o0, lse0) per reader, a pseudo-source with a given logit: the
 * two-phase schedule's merge. With H heads the d channels split into H groups of W = d/H, each
 * with its own softmax over sources (one rms per token, shared by the groups).
 *
 * Two inner paths, one entry point per direction:
 * - one reader and one head (merges, the output read, per-sublayer reads): 16 tokens in the lanes
 *   of a vector, 1/rms computed in the same sweep as the scores (one_forward/one_backward);
 * - otherwise tiles of TT tokens, sources streamed once per call for all R readers, 1/rms given
 *   by the caller; dot products reduced four at a time and weighted sums blocked in registers
 *   (AVX-512 where the compiler targets it), since at small d a read is bound by instructions.
 * Both recompute the weights in the backward from the saved lse, divided by their sum (see
 * normalise_lanes), add the key norm's gradient into the sources' (fold_rms), and sum a static
 * query's gradient per tile in float, then per range in double (a given thread count always gives
 * the same result). A merge's backward takes its own output (Δ = g·out), not the running read.
 * Pointers are raw; shapes and contiguity are checked by the Python wrapper (cpu_read.py).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vector_math.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

typedef int64_t i64;

/* Ask for the row a tile ahead: within a tile the loops jump between sources every TT rows,
 * runs too short for the hardware prefetcher to ramp up on, and the sources are usually out of
 * cache by the time a read (or its backward) comes. */
static inline void prefetch_row(const float *row, int d) {
    for (int c = 0; c < d; c += 16) __builtin_prefetch(row + c, 0, 1);
}

/* The same for a row about to be written: a store to a line that is not in cache waits for the
 * line to be read first, and a read's outputs and gradients are fresh allocations. */
static inline void prefetch_write(float *row, int d) {
    for (int c = 0; c < d; c += 16) __builtin_prefetch(row + c, 1, 1);
}

#define TT 64 /* tokens per tile */

/* ---- dot products in batches of four ----------------------------------------------------------
 * A read scores every (token, reader, head) against every source: many short dot products (W =
 * d/H channels). Each one alone ends in a horizontal sum, which costs more than its
 * multiply-adds at W ≤ 64; four reduced together share the shuffles (AVX-512: 11 instructions
 * for four sums instead of 4 × 8). Products are queued in the order their results are stored. */
typedef struct {
    const float *a[4], *b[4];
    int m;
    float *out; /* where the next result goes; results are contiguous */
} dot_batch;

#if defined(__AVX512F__)
/* The sums of four vectors, as the four lanes of one. */
static inline __m128 sum4(__m512 a, __m512 b, __m512 c, __m512 d) {
    const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
    const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xEE));
    __m512 s = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));
    s = _mm512_add_ps(s, _mm512_permute_ps(s, 0xB1));
    s = _mm512_add_ps(s, _mm512_permute_ps(s, 0x4E)); /* each 128-bit lane: its sum, four times */
    return _mm512_castps512_ps128(_mm512_permutexvar_ps(_mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 12, 8, 4, 0), s));
}
#endif

static inline __attribute__((always_inline)) void batch_flush(dot_batch *bt, int W) {
    const int m = bt->m;
    if (!m) return;
#if defined(__AVX512F__)
    if (W % 16 == 0) {
        for (int j = m; j < 4; j++) bt->a[j] = bt->a[0], bt->b[j] = bt->b[0];
        __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
        for (int c = 0; c < W; c += 16) {
            s0 = _mm512_fmadd_ps(_mm512_loadu_ps(bt->a[0] + c), _mm512_loadu_ps(bt->b[0] + c), s0);
            s1 = _mm512_fmadd_ps(_mm512_loadu_ps(bt->a[1] + c), _mm512_loadu_ps(bt->b[1] + c), s1);
            s2 = _mm512_fmadd_ps(_mm512_loadu_ps(bt->a[2] + c), _mm512_loadu_ps(bt->b[2] + c), s2);
            s3 = _mm512_fmadd_ps(_mm512_loadu_ps(bt->a[3] + c), _mm512_loadu_ps(bt->b[3] + c), s3);
        }
        _mm_mask_storeu_ps(bt->out, (__mmask8)((1 << m) - 1), sum4(s0, s1, s2, s3));
        bt->out += m;
        bt->m = 0;
        return;
    }
#endif
    for (int j = 0; j < m; j++) bt->out[j] = dot(bt->a[j], bt->b[j], W);
    bt->out += m;
    bt->m = 0;
}

static inline void batch_push(dot_batch *bt, const float *a, const float *b, int W) {
    bt->a[bt->m] = a;
    bt->b[bt->m] = b;
    if (++bt->m == 4) batch_flush(bt, W);
}

/* Narrow heads (W < 16 dividing 16, d a multiple of 16): a 16-channel product holds 16/W heads;
 * each group of W lanes is summed in place (log2 W shuffles) and the group sums gathered. */
#if defined(__AVX512F__)
static inline int narrow_heads(int d, int W) { return W < 16 && 16 % W == 0 && d % 16 == 0; }

static inline void head_dots(const float *a, const float *b, int d, int W, float *out) {
    const int per = 16 / W;
    const __m512i pick = _mm512_set_epi32(15 * W % 16, 14 * W % 16, 13 * W % 16, 12 * W % 16, 11 * W % 16,
                                          10 * W % 16, 9 * W % 16, 8 * W % 16, 7 * W, 6 * W, 5 * W, 4 * W, 3 * W, 2 * W,
                                          W, 0);
    for (int c = 0; c < d; c += 16, out += per) {
        __m512 p = _mm512_mul_ps(_mm512_loadu_ps(a + c), _mm512_loadu_ps(b + c));
        if (W >= 2) p = _mm512_add_ps(p, _mm512_permute_ps(p, 0xB1));
        if (W >= 4) p = _mm512_add_ps(p, _mm512_permute_ps(p, 0x4E));
        if (W >= 8) p = _mm512_add_ps(p, _mm512_shuffle_f32x4(p, p, 0xB1));
        _mm512_mask_storeu_ps(out, (__mmask16)((1u << per) - 1), _mm512_permutexvar_ps(pick, p));
    }
}
#else
static inline int narrow_heads(int d, int W) { (void)d, (void)W; return 0; }
static inline void head_dots(const float *a, const float *b, int d, int W, float *out) { (void)a, (void)b, (void)d, (void)W, (void)out; }
#endif

/* ---- register-blocked mixing (AVX-512, W a multiple of 16) ---------------------------------------
 * A row of the output is a weighted sum of n source rows. Accumulating it in memory, source by
 * source, costs a load and a store per multiply-add (the tile's output rows do not fit in L1);
 * here up to 4 rows × 64 channels accumulate in 16 registers over all the sources and are
 * stored once, and each source row, loaded once, serves 4 rows. */
#define BLOCK_ROWS 4

#if defined(__AVX512F__)
/* rows[r][c0:c0+64] = base_r + Σ_i coef(i, r, head) · x_i[c0:...] for r < nr: x: n rows (pointers,
 * already offset), coef(i, r, h) = w[i·wstride + r·rstride + h]; base: a[r·H + h]·b_r (b may be
 * NULL: zero). Channels c0 .. c0 + 16·nc. wide: a head spans the 64 channels (W a multiple of 64),
 * so each row has one weight per source, broadcast once for its 4 chunks; the general form kept
 * 16 weight addresses live and spilled them. */
static inline __attribute__((always_inline)) void mix_block(
    float *const *rows, int nr, const float *const *x, int n, const float *w, i64 wstride, i64 rstride, int H, int W,
    int c0, int nc, const float *a, const float *const *b, int wide) {
    __m512 acc[BLOCK_ROWS][4];
    i64 off[BLOCK_ROWS][4], aoff[BLOCK_ROWS][4]; /* where the weights of (row, 16-channel chunk) sit */
    for (int r = 0; r < BLOCK_ROWS; r++)
        for (int c = 0; c < 4; c++) {
            off[r][c] = r * rstride + (c0 + 16 * c) / W;
            aoff[r][c] = r * H + (c0 + 16 * c) / W;
        }
    /* narrow heads: a chunk's 16/W weights, each spread over its W lanes */
    const int narrow = W < 16;
    const __m512i spread = _mm512_srli_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                             W == 8 ? 3 : W == 4 ? 2 : W == 2 ? 1 : 0);
    const __mmask16 nw = (__mmask16)((1u << (narrow ? 16 / W : 1)) - 1);
#define WEIGHT(p) (narrow ? _mm512_permutexvar_ps(spread, _mm512_maskz_loadu_ps(nw, (p))) : _mm512_set1_ps(*(p)))
#pragma GCC unroll 4
    for (int r = 0; r < BLOCK_ROWS; r++)
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++)
            acc[r][c] = (r < nr && c < nc && b) ? _mm512_mul_ps(WEIGHT(a + aoff[r][c]), _mm512_loadu_ps(b[r] + c0 + 16 * c))
                                                 : _mm512_setzero_ps();
    for (int i = 0; i < n; i++) {
        const float *xi = x[i] + c0, *wi = w + i * wstride;
        __m512 v[4];
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++) v[c] = c < nc ? _mm512_loadu_ps(xi + 16 * c) : _mm512_setzero_ps();
        if (wide) { /* one weight per row: broadcast once, used by its 4 chunks */
#pragma GCC unroll 4
            for (int r = 0; r < BLOCK_ROWS; r++) {
                if (r >= nr) continue;
                const __m512 wr = _mm512_set1_ps(wi[off[r][0]]);
#pragma GCC unroll 4
                for (int c = 0; c < 4; c++)
                    if (c < nc) acc[r][c] = _mm512_fmadd_ps(wr, v[c], acc[r][c]);
            }
            continue;
        }
#pragma GCC unroll 4
        for (int r = 0; r < BLOCK_ROWS; r++)
#pragma GCC unroll 4
            for (int c = 0; c < 4; c++)
                if (r < nr && c < nc) acc[r][c] = _mm512_fmadd_ps(WEIGHT(wi + off[r][c]), v[c], acc[r][c]);
    }
#pragma GCC unroll 4
    for (int r = 0; r < BLOCK_ROWS; r++)
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++)
            if (r < nr && c < nc) _mm512_storeu_ps(rows[r] + c0 + 16 * c, acc[r][c]);
#undef WEIGHT
}
#endif

/* rows[r] = a[r·H + h]·b_r + Σ_i w[i·wstride + r·rstride + h] · x_i (per head h), for r < R, each row
 * d wide; b may be NULL (no base term) and may be rows itself (accumulate). */
static void mix_rows(float *const *rows, int R, const float *const *x, int n, const float *w, i64 wstride, i64 rstride,
                     int d, int H, const float *a, const float *const *b) {
    const int W = d / H;
#if defined(__AVX512F__)
    if (W % 16 == 0 || narrow_heads(d, W)) {
        for (int r0 = 0; r0 < R; r0 += BLOCK_ROWS) {
            const int nr = R - r0 < BLOCK_ROWS ? R - r0 : BLOCK_ROWS;
            for (int c0 = 0; c0 < d; c0 += 64) {
                const int nc = (d - c0) / 16 < 4 ? (d - c0) / 16 : 4;
                float *const *rr = rows + r0;
                const float *wr = w + r0 * rstride, *ar = a ? a + r0 * H : NULL;
                const float *const *br = b ? b + r0 : NULL;
                /* constant block shapes, so that the guards of mix_block fold away; a head at
                 * least 64 channels wide has one weight per row of the block */
#define MIX(NR, WIDE) mix_block(rr, NR, x, n, wr, wstride, rstride, H, W, c0, 4, ar, br, WIDE)
#define MIX_ROWS(WIDE) (nr == 4 ? MIX(4, WIDE) : nr == 1 ? MIX(1, WIDE) : nr == 2 ? MIX(2, WIDE) : MIX(3, WIDE))
                if (nc == 4 && W % 64 == 0) MIX_ROWS(1);
                else if (nc == 4) MIX_ROWS(0);
                else mix_block(rr, nr, x, n, wr, wstride, rstride, H, W, c0, nc, ar, br, 0);
#undef MIX_ROWS
#undef MIX
            }
        }
        return;
    }
#endif
    for (int r = 0; r < R; r++) {
        float *o = rows[r];
        for (int h = 0; h < H; h++) {
            const float ah = b ? a[r * H + h] : 0.f;
#pragma omp simd
            for (int c = 0; c < W; c++) o[h * W + c] = b ? ah * b[r][h * W + c] : 0.f;
        }
        for (int i = 0; i < n; i++)
            for (int h = 0; h < H; h++) axpy(o + h * W, w[i * wstride + r * rstride + h], x[i] + h * W, W);
    }
}

/* The H head-wise dot products of two d-wide rows, queued (wide heads) or computed at once
 * (narrow heads); results go to consecutive places of bt->out. */
static inline void score_row(dot_batch *bt, const float *a, const float *b, int d, int H) {
    const int W = d / H;
    if (narrow_heads(d, W)) {
        head_dots(a, b, d, W, bt->out);
        bt->out += H;
        return;
    }
    for (int h = 0; h < H; h++) batch_push(bt, a + h * W, b + h * W, W);
}

/* out[j] = rows[j] · v for j < m (one head, d a multiple of 16; AVX-512): the products of one
 * source row with every reader's query or gradient row, four at a time and reduced together,
 * with no queue in between. */
static inline int row_dots_apply(int d, int H) {
#if defined(__AVX512F__)
    return H == 1 && d % 16 == 0;
#else
    (void)d, (void)H;
    return 0;
#endif
}

static inline void row_dots(const float *v, const float *const *rows, int m, int d, float *out) {
#if defined(__AVX512F__)
    for (int j = 0; j < m; j += 4) {
        const int k = m - j < 4 ? m - j : 4;
        const float *r0 = rows[j], *r1 = rows[j + (k > 1)], *r2 = rows[j + (k > 2 ? 2 : 0)], *r3 = rows[j + (k > 3 ? 3 : 0)];
        __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
        for (int c = 0; c < d; c += 16) {
            const __m512 x = _mm512_loadu_ps(v + c);
            s0 = _mm512_fmadd_ps(_mm512_loadu_ps(r0 + c), x, s0);
            s1 = _mm512_fmadd_ps(_mm512_loadu_ps(r1 + c), x, s1);
            s2 = _mm512_fmadd_ps(_mm512_loadu_ps(r2 + c), x, s2);
            s3 = _mm512_fmadd_ps(_mm512_loadu_ps(r3 + c), x, s3);
        }
        _mm_mask_storeu_ps(out + j, (__mmask8)((1 << k) - 1), sum4(s0, s1, s2, s3));
    }
#else
    for (int j = 0; j < m; j++) out[j] = dot(rows[j], v, d);
#endif
}

/* Gather a (R, N, H) per-token array into tile order j = u·RH + r·H + h. */
static void gather_rows(const float *x, float *dst, i64 N, i64 ta, int T, int R, int H) {
    for (int u = 0; u < T; u++)
        for (int r = 0; r < R; r++)
            for (int h = 0; h < H; h++) dst[(u * R + r) * H + h] = x[((i64)r * N + ta + u) * H + h];
}

/* ---- shared by both paths ---------------------------------------------------------------------- */
/* The recomputed weights α_i = e^(t_i − lse) (n rows of m lanes; a0: the initial state's, or
 * NULL), divided by their sum. In exact arithmetic the sum is 1; in fp32 it is off by about
 * |lse|·2⁻²⁴, because lse is rounded to a float, and every gradient through a nearly one-hot
 * softmax is a difference of terms that cancel only if the weights sum to 1: with the raw
 * weights, Δ = Σ α_i (g·v_i) is off by that much times g·v, which at |logits| ~ 30 already
 * made the query's gradient 10× less precise than the PyTorch path's. */
static inline void normalise_lanes(float *restrict A, int n, int m, float *restrict a0) {
    for (int j0 = 0; j0 < m; j0 += 64) {
        const int mm = m - j0 < 64 ? m - j0 : 64;
        float z[64];
        for (int j = 0; j < mm; j++) z[j] = a0 ? a0[j0 + j] : 0.f;
        for (int i = 0; i < n; i++) {
#pragma omp simd
            for (int j = 0; j < mm; j++) z[j] += A[(i64)i * m + j0 + j];
        }
        for (int j = 0; j < mm; j++) z[j] = 1.f / z[j];
        for (int i = 0; i < n; i++) {
#pragma omp simd
            for (int j = 0; j < mm; j++) A[(i64)i * m + j0 + j] *= z[j];
        }
        if (a0)
            for (int j = 0; j < mm; j++) a0[j0 + j] *= z[j];
    }
}


/* ---- one reader, one head: 16 tokens in the lanes ---------------------------------------------------
 * A read of one reader and one head (every two-phase merge, the output read, every read of the
 * per-read schedule) has one softmax per token: 16 tokens form a group, their scores the 16 lanes
 * of one vector per source. Pass 1 sweeps each token's rows once and takes all its sums at once
 * (u·u, q·u; backward also g·u, and g·out for a merge), so 1/rms comes from the same sweep instead
 * of an input; pass 2 runs the softmax and every per-token coefficient over the lanes; pass 3
 * writes each output row once, while the group's rows are still in L1. */
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

/* Whether a read takes the one-reader path, which computes 1/rms itself (rms must be NULL). */
static inline int one_reader(int R, int H, int n, const float *const *rms, const float *glse) {
    return R == 1 && H == 1 && n >= 1 && n <= MAX_SOURCES && !rms && !glse;
}

int attnres_read_max_one_reader_sources(void) { return MAX_SOURCES; }

/* Forward. srcs: n pointers to (N, d); rms: n pointers to (N,), or NULL (one reader: computed here
 * if key_norm; otherwise raw keys); q: (R, d) static queries, or (N, d) per token (R = 1); o0
 * (R, N, d) and lse0 (R, N, H), or NULL; out: R pointers to (N, d) (one tensor per reader), lse
 * (R, N, H). scratch: TT·(n + 3)·R·H floats. Returns 0. */
int attnres_read_forward(const float *const *srcs, const float *const *rms, int n, const float *q, int per_token,
                         const float *o0, const float *lse0, float *const *out, float *lse, i64 N, int d, int H, int R,
                         int use_sigmoid, int key_norm, float eps, i64 t0, i64 t1, float *scratch) {
    if (one_reader(R, H, n, rms, NULL)) {
        one_forward(srcs, n, q, per_token, o0, lse0, out[0], lse, d, eps, key_norm, use_sigmoid, t0, t1);
        return 0;
    }
    const int W = d / H, RH = R * H;
    const int TRH = TT * RH;
    float *S = scratch;      /* S[i·T·RH + j], j = u·RH + r·H + h: logit, then normalised weight */
    float *M = S + TT * n * RH; /* running max, then log-sum-exp, per j */
    float *Z = M + TRH;      /* sum of exponentials per j */
    float *A0 = Z + TRH;     /* initial state: its lse, then its weight, per j */
    for (i64 ta = t0; ta < t1; ta += TT) {
        const int T = (int)(t1 - ta < TT ? t1 - ta : TT), TJ = T * RH;
        /* logits, source by source (each read as one run of T rows) */
        dot_batch bt = {.m = 0, .out = S};
        const int direct = row_dots_apply(d, H);
        const float *qrows[R];
        for (int i = 0; i < n; i++) {
            bt.out = S + (i64)i * TJ;
            for (int u = 0; u < T; u++) {
                const i64 t = ta + u;
                const float *v = srcs[i] + t * d;
                if (t + TT < t1) prefetch_row(v + TT * d, d);
                for (int r = 0; r < R; r++) qrows[r] = per_token ? q + t * d : q + (i64)r * d;
                if (direct) {
                    row_dots(v, qrows, R, d, bt.out);
                    bt.out += R;
                } else {
                    for (int r = 0; r < R; r++) score_row(&bt, qrows[r], v, d, H);
                }
            }
            batch_flush(&bt, W);
            if (rms) {
                float *Si = S + (i64)i * TJ;
                const float *rho = rms[i] + ta;
                for (int u = 0; u < T; u++)
                    for (int k = 0; k < RH; k++) Si[u * RH + k] *= rho[u];
            }
        }
        if (use_sigmoid)
            for (int j = 0; j < n * TJ; j++) S[j] = log_sigmoid(S[j]);
        /* softmax over the sources (and the initial state), every j at once */
        if (o0) {
            gather_rows(lse0, A0, N, ta, T, R, H);
            for (int j = 0; j < TJ; j++) M[j] = A0[j];
        } else {
            for (int j = 0; j < TJ; j++) M[j] = -INFINITY;
        }
        for (int i = 0; i < n; i++) {
            const float *Si = S + (i64)i * TJ;
#pragma omp simd
            for (int j = 0; j < TJ; j++) M[j] = larger(M[j], Si[j]);
        }
        if (o0) {
#pragma omp simd
            for (int j = 0; j < TJ; j++) Z[j] = A0[j] = exp_f(A0[j] - M[j]);
        } else {
            for (int j = 0; j < TJ; j++) Z[j] = 0.f;
        }
        for (int i = 0; i < n; i++) {
            float *Si = S + (i64)i * TJ;
#pragma omp simd
            for (int j = 0; j < TJ; j++) {
                Si[j] = exp_f(Si[j] - M[j]);
                Z[j] += Si[j];
            }
        }
#pragma omp simd
        for (int j = 0; j < TJ; j++) {
            M[j] += log_f(Z[j]);
            Z[j] = 1.f / Z[j];
        }
        for (int i = 0; i < n; i++) {
            float *Si = S + (i64)i * TJ;
#pragma omp simd
            for (int j = 0; j < TJ; j++) Si[j] *= Z[j];
        }
        for (int u = 0; u < T; u++)
            for (int r = 0; r < R; r++)
                for (int h = 0; h < H; h++) lse[((i64)r * N + ta + u) * H + h] = M[(u * R + r) * H + h];
        /* out = a0·o0 + Σ_i w_i v_i, the weights already normalised, row by row (mix_rows) */
        if (o0) {
#pragma omp simd
            for (int j = 0; j < TJ; j++) A0[j] *= Z[j];
        }
        const float *xs[n];
        float *rows[R];
        const float *base[R];
        for (int u = 0; u < T; u++) {
            const i64 t = ta + u;
            for (int i = 0; i < n; i++) xs[i] = srcs[i] + t * d;
            for (int r = 0; r < R; r++) {
                rows[r] = out[r] + t * d;
                base[r] = o0 ? o0 + ((i64)r * N + t) * d : NULL;
                if (t + TT < t1) prefetch_write(rows[r] + TT * d, d);
            }
            mix_rows(rows, R, xs, n, S + u * RH, TJ, H, d, H, o0 ? A0 + u * RH : NULL, o0 ? base : NULL);
        }
    }
    return 0;
}

/* Backward. Inputs as in the forward, except that a merge passes its own output out (R, N, d)
 * with lse0, not its initial state o0 (see Δ below), and out and gout are R pointers to (N, d), one per
 * reader; plus lse (R, N, H), glse
 * (R, N, H) or NULL.
 * Outputs: dsrc: n pointers to (N, d), written; drms: n pointers to (N,) or NULL, written;
 * with fold_rms, drms is not written: the key norm's path ρ(v) is added to dsrc instead
 * (dv += dρ · ∂ρ/∂v = −dρ·ρ³·v/d), so that 1/rms needs no autograd node of its own;
 * dq: per token (N, d) written, or static (R, d) in double, added to; do0 (R, N, d) and
 * dlse0 (R, N, H) written when o0 is given. scratch: TT·(4·n + 4)·R·H + R·d + (TT + 2)·n·H + R·H floats. */
int attnres_read_backward(const float *const *srcs, const float *const *rms, int n, const float *q, int per_token,
                          const float *const *out, const float *lse0, const float *lse, const float *const *gout,
                          const float *glse, float *const *dsrc, float *const *drms, float *dq_tok, double *dq_static,
                          float *do0, float *dlse0, i64 N, int d, int H, int R, int use_sigmoid, int fold_rms,
                          int key_norm, float eps, i64 t0, i64 t1, float *scratch) {
    if (one_reader(R, H, n, rms, glse)) {
        one_backward(srcs, n, q, per_token, out ? out[0] : NULL, lse0, lse, gout[0], dsrc, dq_static, dq_tok, do0, dlse0,
                     d, eps, key_norm, use_sigmoid, t0, t1, scratch);
        return 0;
    }
    const int W = d / H, RH = R * H, TRH = TT * RH;
    const i64 nTRH = (i64)n * TRH;
    float *A = scratch;         /* α per (i, j), j = u·RH + r·H + h */
    float *B = A + nTRH;        /* g_r · v_i */
    float *QV = B + nTRH;       /* q_r · v_i (the score before ρ) */
    float *SG = QV + nTRH;      /* σ(−s) for the sigmoid normaliser */
    float *delta = SG + nTRH;   /* Δ per j */
    float *a0 = delta + TRH;    /* weight of the initial state per j */
    float *Lg = a0 + TRH;       /* the read's lse per j */
    float *GO = Lg + TRH;       /* g · out per j (merges) */
    float *dq_tile = GO + TRH;  /* static query gradient of the current tile (R, d) */
    float *FC = dq_tile + R * d;       /* the key norm's coefficient per (source, token) */
    float *FCu = FC + (i64)n * TT;     /* one token's, per (source, head) */
    float *ones = FCu + (i64)n * H;    /* (n + R)·H ones: base coefficients that accumulate */
    for (int k = 0; k < (n + R) * H; k++) ones[k] = 1.f;
    const float *xs[2 * R], *vs[n], *xall[n * TT], *qrows[R], *grows[R];
    const int direct = row_dots_apply(d, H);
    float *rows[n], *dqrows[R];
    for (i64 ta = t0; ta < t1; ta += TT) {
        const int T = (int)(t1 - ta < TT ? t1 - ta : TT), TJ = T * RH;
        if (!per_token) memset(dq_tile, 0, sizeof(float) * R * d); /* per-token rows are written whole */
        /* pass 1: q·v and g·v of every (source, token, reader, head). One head: token by token,
         * so that a token's R gradient rows stay in L1 while all n sources are scored against
         * them (source by source, the tile's R·TT gradient rows were read from L2 n times). */
        if (direct) {
            for (int u = 0; u < T; u++) {
                const i64 t = ta + u;
                for (int r = 0; r < R; r++) {
                    qrows[r] = per_token ? q + t * d : q + (i64)r * d;
                    grows[r] = gout[r] + t * d;
                    if (t + TT < t1) prefetch_row(grows[r] + TT * d, d);
                }
                for (int i = 0; i < n; i++) {
                    const float *v = srcs[i] + t * d;
                    if (t + TT < t1) prefetch_row(v + TT * d, d);
                    row_dots(v, qrows, R, d, QV + (i64)i * TJ + u * R);
                    row_dots(v, grows, R, d, B + (i64)i * TJ + u * R);
                }
            }
        } else {
            for (int i = 0; i < n; i++) {
                dot_batch bq = {.m = 0, .out = QV + (i64)i * TJ}, bg = {.m = 0, .out = B + (i64)i * TJ};
                for (int u = 0; u < T; u++) {
                    const i64 t = ta + u;
                    const float *v = srcs[i] + t * d;
                    if (t + TT < t1) prefetch_row(v + TT * d, d);
                    for (int r = 0; r < R; r++) {
                        if (i == 0 && t + TT < t1) prefetch_row(gout[r] + (t + TT) * d, d);
                        score_row(&bq, per_token ? q + t * d : q + (i64)r * d, v, d, H);
                        score_row(&bg, gout[r] + t * d, v, d, H);
                    }
                }
                batch_flush(&bq, W);
                batch_flush(&bg, W);
            }
        }
        for (int i = 0; i < n; i++) {
            float *Ai = A + (i64)i * TJ;
            const float *QVi = QV + (i64)i * TJ;
            const float *rho = rms ? rms[i] + ta : NULL;
            for (int u = 0; u < T; u++) {
                const float p = rho ? rho[u] : 1.f;
                for (int k = 0; k < RH; k++) Ai[u * RH + k] = QVi[u * RH + k] * p;
            }
        }
        if (use_sigmoid) {
#pragma omp simd
            for (int j = 0; j < n * TJ; j++) SG[j] = 1.f / (1.f + exp_f(A[j])); /* σ(−s) = d log σ(s)/ds */
            for (int j = 0; j < n * TJ; j++) A[j] = log_sigmoid(A[j]);
        }
        gather_rows(lse, Lg, N, ta, T, R, H);
        for (int i = 0; i < n; i++) {
            float *Ai = A + (i64)i * TJ;
#pragma omp simd
            for (int j = 0; j < TJ; j++) Ai[j] = exp_f(Ai[j] - Lg[j]);
        }
        if (out) {
            gather_rows(lse0, a0, N, ta, T, R, H);
#pragma omp simd
            for (int j = 0; j < TJ; j++) a0[j] = exp_f(a0[j] - Lg[j]);
        }
        normalise_lanes(A, n, TJ, out ? a0 : NULL);
        /* Δ = g·out − g_lse. Without an initial state g·out = Σ_i α_i b_i, from the sources.
         * With one (a merge), out = a0·o0 + Σ_i α_i v_i: g·out is taken from the saved output
         * (which is the next sublayer's input, kept anyway) and a0·(g·o0) = g·out − Σ_i α_i b_i,
         * so o0 itself is never needed: a phase-1 read's outputs die with the forward. */
        for (int j = 0; j < TJ; j++) delta[j] = 0.f;
        for (int i = 0; i < n; i++) {
            const float *Ai = A + (i64)i * TJ, *Bi = B + (i64)i * TJ;
#pragma omp simd
            for (int j = 0; j < TJ; j++) delta[j] += Ai[j] * Bi[j];
        }
        if (out) {
            dot_batch bo = {.m = 0, .out = GO};
            for (int u = 0; u < T; u++)
                for (int r = 0; r < R; r++) {
                    score_row(&bo, gout[r] + (ta + u) * d, out[r] + (ta + u) * d, d, H);
                }
            batch_flush(&bo, W);
        }
        for (int u = 0; u < T; u++)
            for (int r = 0; r < R; r++)
                for (int h = 0; h < H; h++) {
                    const i64 row = ((i64)r * N + ta + u) * H + h;
                    const int j = (u * R + r) * H + h;
                    float a0b0 = 0.f;
                    if (out) {
                        const i64 at = ((i64)r * N + ta + u) * d + h * W;
                        const float *g = gout[r] + (ta + u) * d + h * W;
                        a0b0 = GO[j] - delta[j];
                        delta[j] = GO[j];
                        const float a = a0[j];
#pragma omp simd
                        for (int c = 0; c < W; c++) do0[at + c] = a * g[c];
                    }
                    if (glse) delta[j] -= glse[row];
                    if (out) dlse0[row] = a0b0 - a0[j] * delta[j];
                }
        /* dL/dt = α(b − Δ), then dL/ds (sigmoid: times σ(−s)), in place of B */
        for (int i = 0; i < n; i++) {
            const float *Ai = A + (i64)i * TJ;
            float *Bi = B + (i64)i * TJ;
            if (use_sigmoid) {
                const float *SGi = SG + (i64)i * TJ;
#pragma omp simd
                for (int j = 0; j < TJ; j++) Bi[j] = Ai[j] * (Bi[j] - delta[j]) * SGi[j];
            } else {
#pragma omp simd
                for (int j = 0; j < TJ; j++) Bi[j] = Ai[j] * (Bi[j] - delta[j]);
            }
        }
        /* pass 2: dρ per (source, token), then K = dL/ds · ρ in place of dL/ds */
        for (int i = 0; i < n; i++) {
            float *Ki = B + (i64)i * TJ;
            const float *QVi = QV + (i64)i * TJ;
            for (int u = 0; u < T; u++) {
                const i64 t = ta + u;
                const float rho = rms ? rms[i][t] : 1.f;
                float drho = 0.f;
                for (int k = 0; k < RH; k++) drho += Ki[u * RH + k] * QVi[u * RH + k];
                if (rms && fold_rms) FC[i * T + u] = -drho * rho * rho * rho / d;
                else if (drms) drms[i][t] = drho;
                for (int k = 0; k < RH; k++) Ki[u * RH + k] *= rho;
            }
        }
        /* each source row's gradient, written once: Σ_r α·g_r + K·q_r (+ the key norm's term) */
        const int fold = fold_rms && rms;
        for (int u = 0; u < T; u++) {
            const i64 t = ta + u;
            for (int r = 0; r < R; r++) {
                xs[r] = gout[r] + t * d;
                xs[R + r] = per_token ? q + t * d : q + (i64)r * d;
            }
            for (int i = 0; i < n; i++) {
                rows[i] = dsrc[i] + t * d;
                vs[i] = srcs[i] + t * d;
                if (t + TT < t1) prefetch_write(rows[i] + TT * d, d);
            }
            if (fold)
                for (int i = 0; i < n; i++)
                    for (int h = 0; h < H; h++) FCu[i * H + h] = FC[i * T + u];
            /* row i's coefficients sit at i·TJ + u·RH + r·H + h: the value path, then the key path added */
            mix_rows(rows, n, xs, R, A + u * RH, H, TJ, d, H, fold ? FCu : NULL, fold ? vs : NULL);
            mix_rows(rows, n, xs + R, R, B + u * RH, H, TJ, d, H, ones, (const float *const *)rows);
        }
        /* the query gradient: Σ over (source, token) of K·v */
        if (per_token) {
            for (int u = 0; u < T; u++) {
                const i64 t = ta + u;
                for (int i = 0; i < n; i++) vs[i] = srcs[i] + t * d;
                float *row = dq_tok + t * d;
                mix_rows(&row, 1, vs, n, B + u * RH, TJ, H, d, H, NULL, NULL);
            }
        } else {
            for (int i = 0; i < n; i++)
                for (int u = 0; u < T; u++) xall[i * T + u] = srcs[i] + (ta + u) * d;
            for (int r = 0; r < R; r++) dqrows[r] = dq_tile + (i64)r * d;
            mix_rows(dqrows, R, xall, n * T, B, RH, H, d, H, ones, (const float *const *)dqrows);
        }
        if (!per_token)
            for (int c = 0; c < R * d; c++) dq_static[c] += dq_tile[c];
    }
    return 0;
}

/* ---- token ranges on OpenMP threads -----------------------------------------------------------
 * Built with -fopenmp only where torch's runtime is GNU libgomp (native.py): this library then
 * uses torch's own worker threads, and a range per thread runs while torch's ops wait. */
int attnres_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

/* Scratch floats of one range (the sizes stated at attnres_read_forward/backward). */
static i64 forward_scratch(int n, int R, int H) { return (i64)TT * (n + 3) * R * H; }
static i64 backward_scratch(int n, int R, int H, int d) {
    return (i64)TT * (4 * n + 4) * R * H + (i64)R * d + (i64)(TT + 2) * n * H + (i64)R * H;
}

/* attnres_read_forward over the k ranges [bounds[j], bounds[j + 1]), one per thread, each with
 * scratch of its own. Returns 0, or 1 if memory ran out. */
int attnres_read_forward_ranges(const float *const *srcs, const float *const *rms, int n, const float *q, int per_token,
                                const float *o0, const float *lse0, float *const *out, float *lse, i64 N, int d, int H,
                                int R, int use_sigmoid, int key_norm, float eps, const i64 *bounds, int k) {
    const i64 floats = forward_scratch(n, R, H);
    float *scratch = malloc(sizeof(float) * (size_t)(k * floats));
    if (!scratch) return 1;
#pragma omp parallel for num_threads(k) schedule(static, 1) if (k > 1)
    for (int j = 0; j < k; j++)
        attnres_read_forward(srcs, rms, n, q, per_token, o0, lse0, out, lse, N, d, H, R, use_sigmoid, key_norm, eps,
                             bounds[j], bounds[j + 1], scratch + j * floats);
    free(scratch);
    return 0;
}

/* attnres_read_backward over the k ranges, one per thread, each with scratch and (static query)
 * a double accumulator of its own; dq: per token (N, d), or static (R, d), the ranges' sums added
 * in range order (a given thread count always gives the same result). Returns 0, or 1 if memory
 * ran out. */
int attnres_read_backward_ranges(const float *const *srcs, const float *const *rms, int n, const float *q, int per_token,
                                 const float *const *out, const float *lse0, const float *lse, const float *const *gout,
                                 const float *glse, float *const *dsrc, float *const *drms, float *dq, float *do0,
                                 float *dlse0, i64 N, int d, int H, int R, int use_sigmoid, int fold_rms, int key_norm,
                                 float eps, const i64 *bounds, int k) {
    const i64 floats = backward_scratch(n, R, H, d);
    float *scratch = malloc(sizeof(float) * (size_t)(k * floats));
    double *acc = per_token ? NULL : calloc((size_t)k * R * d, sizeof(double));
    if (!scratch || (!per_token && !acc)) {
        free(scratch);
        free(acc);
        return 1;
    }
#pragma omp parallel for num_threads(k) schedule(static, 1) if (k > 1)
    for (int j = 0; j < k; j++)
        attnres_read_backward(srcs, rms, n, q, per_token, out, lse0, lse, gout, glse, dsrc, drms, per_token ? dq : NULL,
                              per_token ? NULL : acc + (i64)j * R * d, do0, dlse0, N, d, H, R, use_sigmoid, fold_rms,
                              key_norm, eps, bounds[j], bounds[j + 1], scratch + j * floats);
    if (!per_token)
        for (i64 c = 0; c < (i64)R * d; c++) {
            double sum = 0.0;
            for (int j = 0; j < k; j++) sum += acc[(i64)j * R * d + c];
            dq[c] = (float)sum;
        }
    free(scratch);
    free(acc);
    return 0;
}

/* 1/rms of every row of n sources (each (N, d)): rhos[i][t] = (mean x² + eps)^(-1/2), on k threads. */
int attnres_inv_rms(const float *const *xs, float *const *rhos, int n, i64 N, int d, float eps, int k) {
#pragma omp parallel for num_threads(k) schedule(static) if (k > 1)
    for (i64 t = 0; t < N; t++)
        for (int i = 0; i < n; i++) rhos[i][t] = 1.f / sqrtf(dot(xs[i] + t * d, xs[i] + t * d, d) / d + eps);
    return 0;
}
