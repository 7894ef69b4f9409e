/* RMSNorm over the last dimension on the CPU, forward and backward: the PreNorm of every sublayer
 * and the model's final norm, for every residual variant alike (attnres/kernels/rms_norm.py).
 *
 *     ρ = (Σ_c x_c² / d + eps)^(-1/2)      y = (x·ρ) ∘ w            (torch.nn.RMSNorm's math)
 *     backward, with u = g ∘ w:  dx = ρ·u − x·ρ³·(u·x)/d      dw = Σ_tokens g ∘ x·ρ
 *
 * Why a kernel: torch's CPU RMSNorm is a composite of elementwise ops and reductions (about six
 * passes over the tensor forward and ten backward, each a dispatched op with its own output), and
 * a training step runs one per sublayer. Here each row is read once forward (its sum of squares,
 * then its output while it is in L1) and once backward.
 *
 * How:
 * - ρ per row is an output: the backward reuses it instead of recomputing the root, and it is all
 *   the backward needs beside x, g and w (x is saved, as torch's own RMSNorm saves it).
 * - dw does not depend on the thread count: the k token ranges (one per OpenMP thread, see
 *   native.py) are whole blocks of BLOCK tokens, each block's terms are summed in fp32 into a slot
 *   of its own, and the block sums are added in block order in double at the end. torch's own
 *   RMSNorm gave the same bits at one and two threads, so a run's loss did not depend on
 *   train.threads; this keeps that (and the error of the sum does not grow with the token count).
 * - w may be NULL (an RMSNorm without gain), and dw NULL (no gain, or a frozen one): not summed.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "vector_math.h"

typedef int64_t i64;

#define BLOCK 64 /* tokens whose dw terms are summed in fp32 before the double sum over blocks */

/* The first token of range j of k: whole blocks (for the backward's dw), the last range to N. */
static inline i64 range_start(i64 N, int k, int j) {
    const i64 blocks = (N + BLOCK - 1) / BLOCK;
    return j == k ? N : blocks * j / k * BLOCK;
}

static void forward_rows(const float *x, const float *w, float *y, float *rho, i64 t0, i64 t1, int d, float eps) {
    for (i64 t = t0; t < t1; t++) {
        const float *restrict xt = x + t * d;
        float *restrict yt = y + t * d;
        const float r = 1.f / sqrtf(dot(xt, xt, d) / (float)d + eps);
        rho[t] = r;
        if (w) {
#pragma omp simd
            for (int c = 0; c < d; c++) yt[c] = xt[c] * r * w[c];
        } else {
#pragma omp simd
            for (int c = 0; c < d; c++) yt[c] = xt[c] * r;
        }
    }
}

static void backward_rows(const float *x, const float *w, const float *rho, const float *g, float *dx,
                          float *sums, i64 t0, i64 t1, int d) {
    for (i64 b0 = t0; b0 < t1; b0 += BLOCK) {
        const i64 b1 = b0 + BLOCK < t1 ? b0 + BLOCK : t1;
        float *restrict block = sums ? sums + b0 / BLOCK * d : NULL;
        if (block)
            for (int c = 0; c < d; c++) block[c] = 0.f;
        for (i64 t = b0; t < b1; t++) {
            const float *restrict xt = x + t * d, *restrict gt = g + t * d;
            float *restrict o = dx + t * d;
            const float r = rho[t];
            float s = 0.f;
            if (w) {
#pragma omp simd reduction(+ : s)
                for (int c = 0; c < d; c++) s += gt[c] * w[c] * xt[c];
            } else {
                s = dot(gt, xt, d);
            }
            const float coef = r * r * r * s / (float)d;
            if (w) {
#pragma omp simd
                for (int c = 0; c < d; c++) o[c] = r * gt[c] * w[c] - coef * xt[c];
            } else {
#pragma omp simd
                for (int c = 0; c < d; c++) o[c] = r * gt[c] - coef * xt[c];
            }
            if (block) {
#pragma omp simd
                for (int c = 0; c < d; c++) block[c] += gt[c] * xt[c] * r;
            }
        }
    }
}

/* x (N, d) → y (N, d), rho (N); w (d) or NULL. k token ranges, one per thread. Returns 0. */
int attnres_rms_norm_forward(const float *x, const float *w, float *y, float *rho, i64 N, int d, float eps, int k) {
#pragma omp parallel for num_threads(k) schedule(static, 1) if (k > 1)
    for (int j = 0; j < k; j++)
        forward_rows(x, w, y, rho, range_start(N, k, j), range_start(N, k, j + 1), d, eps);
    return 0;
}

/* From g (N, d), the gradient of y: dx (N, d) and, unless dw is NULL, dw (d). Returns 0, or 1 if
 * memory for the accumulators ran out. */
int attnres_rms_norm_backward(const float *x, const float *w, const float *rho, const float *g, float *dx, float *dw,
                              i64 N, int d, int k) {
    const i64 blocks = (N + BLOCK - 1) / BLOCK;
    float *sums = dw ? malloc(sizeof(float) * (size_t)(blocks > 0 ? blocks : 1) * d) : NULL;
    if (dw && !sums) return 1;
#pragma omp parallel for num_threads(k) schedule(static, 1) if (k > 1)
    for (int j = 0; j < k; j++)
        backward_rows(x, w, rho, g, dx, sums, range_start(N, k, j), range_start(N, k, j + 1), d);
    if (dw)
        for (int c = 0; c < d; c++) {
            double s = 0.0;
            for (i64 b = 0; b < blocks; b++) s += sums[b * d + c];
            dw[c] = (float)s;
        }
    free(sums);
    return 0;
}
