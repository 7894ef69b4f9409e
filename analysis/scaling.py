"""Power-law fits of loss against compute, their bootstrap intervals, and compute multipliers.

Two forms per variant, ``pure`` L = A·C^-α and ``offset`` L = E + A·C^-α, fitted by a Huber loss on
log-loss residuals with a vectorised L-BFGS; the choices (δ, intervals, multiplier) and their
reasons are in docs/ANALYSIS.md under "Methods, briefly". C is in PFLOP/s-days (8.64e19 FLOPs).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import numpy as np

PFLOPS_DAY = 1e15 * 86400  # FLOPs in a PFLOP/s-day, the paper's compute unit
HUBER_DELTA = 1e-3  # the smallest δ, and the first fit's (Besiroglu et al. 2024)
HUBER_TUNING = 1.345  # δ = 1.345·σ̂ (Huber 1964): 95% of least squares' efficiency under normal noise
MIN_COMPUTE_FOR_INTERVAL = 4
FORMS = ("pure", "offset")


# --------------------------------------------------------------------------------------------
# The law itself
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PowerLaw:
    """L(C) = E + A·C^-α (E = 0 for the pure form). C in the unit the law was fitted in."""

    A: float
    alpha: float
    E: float = 0.0

    def __call__(self, C):
        C = np.asarray(C, dtype=float)
        return self.E + self.A * C ** (-self.alpha)

    def inverse(self, L):
        """Compute that reaches loss L; NaN where L is at or below the floor E (never reached)."""
        L = np.asarray(L, dtype=float)
        with np.errstate(divide="ignore", invalid="ignore"):
            gap = L - self.E
            out = (self.A / gap) ** (1.0 / self.alpha)
        return np.where(gap > 0, out, np.nan)

    def label(self, unit: str = "") -> str:
        core = f"{self.A:.4g}·C^-{self.alpha:.4g}"
        return (f"{self.E:.4g} + " + core if self.E else core) + (f" ({unit})" if unit else "")


def compute_multiplier(base: PowerLaw, variant: PowerLaw, C):
    """C_base(L_variant(C)) / C: how much more compute the baseline needs than the variant to
    reach the loss the variant reaches at compute C (> 1 means the variant is more efficient)."""
    C = np.asarray(C, dtype=float)
    return base.inverse(variant(C)) / C


# --------------------------------------------------------------------------------------------
# Batched Huber / L-BFGS solver
# --------------------------------------------------------------------------------------------
def _huber(r, delta):
    """Huber value and its derivative in r, both divided by δ²: the objective then counts
    residuals in units of δ (a run off by 10δ costs about 10), which keeps the solver's stopping
    tolerances meaningful whatever δ is; a constant factor does not move the minimiser."""
    a = np.abs(r)
    quad = a <= delta
    val = np.where(quad, 0.5 * r * r / delta, a - 0.5 * delta) / delta
    grad = np.clip(r, -delta, delta) / delta / delta
    return val, grad


def _predict(theta, X, form):
    """Log-loss prediction and its Jacobian for a batch: theta (B, p), X (B, n) = log(C/C0).

    pure:   log L = a - α x                 theta = (a, α),   a = log A'
    offset: log L = logaddexp(e, a - α x)   theta = (a, α, e), e = log E
    """
    a, alpha = theta[:, :1], theta[:, 1:2]
    lin = a - alpha * X
    if form == "pure":
        return lin, (np.ones_like(X), -X)
    e = theta[:, 2:3]
    pred = np.logaddexp(e, lin)
    w_e = np.exp(e - pred)  # share of the floor in the prediction: d pred / d e
    w_a = 1.0 - w_e
    return pred, (w_a, -w_a * X, w_e)


def _objective(theta, X, Y, W, form, delta):
    """Per-problem objective Σ_i W_i·huber(pred_i − Y_i) and its gradient, for a batch.

    Summed, not averaged, so the gradient does not shrink with the number of runs."""
    pred, jac = _predict(theta, X, form)
    val, g = _huber(pred - Y, delta)
    g = g * W
    grad = np.stack([(g * j).sum(axis=1) for j in jac], axis=1)
    return (val * W).sum(axis=1), grad


def _lbfgs(fun, theta0, *, memory=10, max_iter=2000, gtol=1e-9, ftol=1e-10, c1=1e-4):
    """L-BFGS (Nocedal & Wright 2006, Alg. 7.4-7.5) run on B independent problems at once.

    Why not scipy: its L-BFGS-B solves one problem per Python call, and one joint problem would
    share a single line search and curvature memory among all of them. Here every problem has its
    own curvature pairs, Armijo step and stopping test; only the arithmetic is vectorised, and
    only problems still running are evaluated. A test checks it reaches scipy's optimum.

    fun(theta (b, p), rows (b,)) -> (f (b,), g (b, p)) for the problems ``rows``.
    Returns (theta (B, p), f (B,)).
    """
    x = np.array(theta0, dtype=float)
    B, p = x.shape
    f, g = fun(x, np.arange(B))
    S = np.zeros((memory, B, p))
    Yh = np.zeros((memory, B, p))
    rho = np.zeros((memory, B))  # 0 marks an empty or skipped slot: a no-op in the recursion
    gamma = 1e-2 / np.maximum(np.abs(g).max(axis=1), 1e-12)
    active = np.flatnonzero(np.abs(g).max(axis=1) > gtol)
    slot = 0
    for _ in range(max_iter):
        if not len(active):
            break
        xa, fa, ga = x[active], f[active], g[active]
        # Two-loop recursion: d = -H g.
        q = ga.copy()
        a = np.zeros((memory, len(active)))
        order = [(slot - 1 - i) % memory for i in range(memory)]
        for i in order:
            a[i] = rho[i, active] * (S[i, active] * q).sum(axis=1)
            q -= a[i][:, None] * Yh[i, active]
        r = gamma[active, None] * q
        for i in reversed(order):
            bi = rho[i, active] * (Yh[i, active] * r).sum(axis=1)
            r += S[i, active] * (a[i] - bi)[:, None]
        d = -r
        slope = (d * ga).sum(axis=1)
        bad = slope >= 0  # not a descent direction: restart that problem from steepest descent
        if bad.any():
            d[bad] = -gamma[active[bad], None] * ga[bad]
            slope[bad] = (d[bad] * ga[bad]).sum(axis=1)
            rho[:, active[bad]] = 0.0
        # Armijo backtracking, per problem; only problems still searching are evaluated.
        t = np.ones(len(active))
        pending = np.arange(len(active))
        xn, fn, gn = xa.copy(), fa.copy(), ga.copy()
        for _ in range(60):
            if not len(pending):
                break
            xt = xa[pending] + t[pending, None] * d[pending]
            ft, gt = fun(xt, active[pending])
            ok = np.isfinite(ft) & (ft <= fa[pending] + c1 * t[pending] * slope[pending])
            acc = pending[ok]
            xn[acc], fn[acc], gn[acc] = xt[ok], ft[ok], gt[ok]
            pending = pending[~ok]
            t[pending] *= 0.5
        stalled = np.zeros(len(active), bool)
        stalled[pending] = True  # no acceptable step: as converged as this method gets
        s_vec, y_vec = xn - xa, gn - ga
        sy = (s_vec * y_vec).sum(axis=1)
        yy = np.maximum((y_vec * y_vec).sum(axis=1), 1e-300)
        upd = ~stalled & (sy > 1e-12 * yy)
        S[slot, active] = np.where(upd[:, None], s_vec, 0.0)
        Yh[slot, active] = np.where(upd[:, None], y_vec, 0.0)
        rho[slot, active] = np.where(upd, 1.0 / np.where(upd, sy, 1.0), 0.0)
        gamma[active] = np.where(upd, sy / yy, gamma[active])
        slot = (slot + 1) % memory
        x[active], f[active], g[active] = xn, fn, gn
        keep = (~stalled & (np.abs(gn).max(axis=1) > gtol)
                & (fa - fn > ftol * np.maximum(np.abs(fn), 1.0)))
        active = active[keep]
    return x, f


def _solve_batch(theta0, X, Y, W, form, delta):
    """Minimise Σ_i W_bi · huber(pred_bi − Y_bi) for every row b; returns (theta, loss).
    W holds multiplicities, which is how a bootstrap resample is represented."""
    return _lbfgs(lambda th, rows: _objective(th, X[rows], Y[rows], W[rows], form, delta), theta0)


def _starts(form, y):
    """Grid of starting points in the centred parametrisation."""
    ybar = float(np.mean(y))
    if form == "pure":
        return np.array([[ybar, al] for al in (0.0, 0.05, 0.2, 0.5, 1.0)])
    lmin, lmean = float(np.exp(np.min(y))), float(np.exp(ybar))
    rows = []
    for frac in (0.25, 0.6, 0.9):
        E = frac * lmin
        for al in (0.05, 0.3, 1.0):
            rows.append([np.log(max(lmean - E, 1e-6)), al, np.log(E)])
    return np.array(rows)


def _min_distinct(form):
    return 2 if form == "pure" else 3


def interval_supported(n_runs: int, n_compute: int, n_params: int) -> bool:
    """Whether a bootstrap interval is given (why: docs/ANALYSIS.md): at least
    MIN_COMPUTE_FOR_INTERVAL distinct compute values and n_params + 2 runs."""
    return n_compute >= MIN_COMPUTE_FOR_INTERVAL and n_runs >= n_params + 2


def small_sample_factor(n_runs: int, n_params: int, level: float = 0.95) -> float:
    """How far the bootstrap replicates are spread out around the full-data fit (in the centred
    parameters) before intervals are read from them: t_{n−p} / z × sqrt(n / (n − p)), the two
    corrections that turn a normal interval with the plug-in variance into the t interval of least
    squares. Resampling n units reproduces the plug-in spread, which is too narrow at a handful of
    them. The fits resample G compute sizes and call it with (G, 1): the cluster bootstrap's
    t_{G−1} and G/(G − 1)."""
    from scipy import stats

    dof = max(n_runs - n_params, 1)
    q = (1 + level) / 2
    return float(stats.t.ppf(q, dof) / stats.norm.ppf(q) * np.sqrt(n_runs / dof))


def size_weights(levels: np.ndarray, n_sizes: int, n_boot: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(W, counts) of a bootstrap over compute sizes: each resample draws ``n_sizes`` sizes with
    replacement and takes every run at a drawn size as often as it was drawn (W[b, i] for run i at
    size ``levels[i]``; counts[b, j] for size j). The draws depend on the seed and the number of
    sizes only, so fits over the same sizes (the variants of one ladder) share them: the i-th
    resamples of two such fits are one joint draw of ladder rungs (the j-th smallest compute of
    each), as a multiplier between them needs."""
    rng = np.random.default_rng([int(seed), int(n_sizes)])
    draws = rng.integers(0, n_sizes, size=(n_boot, n_sizes))
    counts = np.zeros((n_boot, n_sizes))
    np.add.at(counts, (np.repeat(np.arange(n_boot), n_sizes), draws.ravel()), 1.0)
    return counts[:, levels], counts


def scaled_delta(residuals) -> float:
    """Huber's δ for these residuals: HUBER_TUNING·σ̂, σ̂ = 1.4826·MAD, at least HUBER_DELTA."""
    r = np.asarray(residuals, dtype=float)
    sigma = 1.4826 * float(np.median(np.abs(r - np.median(r))))
    return max(HUBER_DELTA, HUBER_TUNING * sigma)


def _usable(C, L, what: str):
    """(C, L, dropped) with the runs a law can use: positive finite compute and loss. A diverged
    run (NaN loss) is dropped and counted; arrays of different lengths are an error."""
    C, L = np.asarray(C, dtype=float).ravel(), np.asarray(L, dtype=float).ravel()
    if len(C) != len(L):
        raise ValueError(f"{what}: {len(C)} compute values but {len(L)} losses")
    ok = np.isfinite(C) & np.isfinite(L) & (C > 0) & (L > 0)
    return C[ok], L[ok], int((~ok).sum())


# A floor under 0.01% of the smallest loss is where the optimiser stopped at E's lower edge (set by
# tolerances and host rounding, not data); snapped to 0 so a report regenerates digit for digit.
E_ZERO = 1e-4


def _to_law(theta, logC0, form, lmin: float = 1.0):
    a, alpha = theta[..., 0], theta[..., 1]
    A = np.exp(a + alpha * logC0)
    E = np.exp(theta[..., 2]) if form == "offset" else np.zeros_like(A)
    return A, alpha, np.where(E < E_ZERO * lmin, 0.0, E)


# --------------------------------------------------------------------------------------------
# Public fit
# --------------------------------------------------------------------------------------------
@dataclass
class Fit:
    """A fitted law with its bootstrap sample of (A, α, E)."""

    name: str
    form: str
    law: PowerLaw
    n_runs: int
    n_compute: int
    compute_range: tuple[float, float]
    boot: np.ndarray = field(repr=False)  # (n_valid, 3): A, alpha, E
    n_boot: int = 0
    delta: float = HUBER_DELTA  # the Huber δ the fit used
    n_dropped: int = 0  # runs without a positive finite compute and loss

    @property
    def n_boot_valid(self) -> int:
        return int(len(self.boot))

    def ci(self, level: float = 0.95) -> dict[str, tuple[float, float]]:
        """Percentile bootstrap interval for A, α and E."""
        if not len(self.boot):
            return {k: (np.nan, np.nan) for k in ("A", "alpha", "E")}
        q = 100 * np.array([(1 - level) / 2, (1 + level) / 2])
        return {k: tuple(np.percentile(self.boot[:, i], q))
                for i, k in enumerate(("A", "alpha", "E"))}

    def band(self, C, level: float = 0.95):
        """Pointwise percentile band of the fitted curve over the bootstrap sample."""
        C = np.asarray(C, dtype=float)
        if not len(self.boot):
            return np.full_like(C, np.nan), np.full_like(C, np.nan)
        A, al, E = (self.boot[:, i:i + 1] for i in range(3))
        curves = E + A * C[None, :] ** (-al)
        q = 100 * np.array([(1 - level) / 2, (1 + level) / 2])
        lo, hi = np.percentile(curves, q, axis=0)
        return lo, hi


def fit_power_law(C, L, form: str = "pure", *, n_boot: int = 1000, seed: int = 0,
                  name: str = "", delta: float | None = None, boot_starts: int | None = None
                  ) -> Fit:
    """Fit one law to runs (C_i, L_i) and bootstrap it over compute sizes (:func:`size_weights`).

    delta: Huber's δ; None (default) scales it to the residuals (`scaled_delta`); the bootstrap
    keeps the full-data δ.

    The full-data fit always uses the whole grid of starts. ``boot_starts`` is how many starts each
    resample gets: the full-data optimum first, then grid starts. Default 1 (warm start only): the
    pure form is convex (a Huber loss of a function affine in (log A, α)), so any start reaches its
    optimum; for the offset form a resample's optimum sits next to the full-data one, and extra
    starts multiply the cost.
    """
    if boot_starts is None:
        boot_starts = 1
    if form not in FORMS:
        raise ValueError(f"form must be one of {FORMS}, got {form!r}")
    what = name or "fit"
    C, L, dropped = _usable(C, L, what)
    n = len(C)
    n_distinct = len(np.unique(C))
    if n_distinct < _min_distinct(form):
        raise ValueError(f"{what}: the {form} law needs at least {_min_distinct(form)} distinct "
                         f"compute values among runs with positive finite compute and loss, got "
                         f"{n_distinct} ({dropped} runs dropped)")
    # Centring log C at its mean removes the near collinearity of log A and α (tiny runs have
    # C ~ 1e-7), which makes L-BFGS crawl; A is mapped back in _to_law, so the optimum is unchanged.
    logC0 = float(np.mean(np.log(C)))
    x, y = np.log(C) - logC0, np.log(L)

    starts = _starts(form, y)

    def solve_all_starts(d, extra=()):
        inits = np.vstack([starts, *extra])
        B = len(inits)
        theta, loss = _solve_batch(inits, np.tile(x, (B, 1)), np.tile(y, (B, 1)), np.ones((B, n)), form, d)
        return theta[int(np.argmin(loss))]

    best = solve_all_starts(HUBER_DELTA)
    if delta is None:
        delta = scaled_delta(_predict(best[None], x[None], form)[0][0] - y)
    if delta != HUBER_DELTA:
        best = solve_all_starts(delta, [best[None]])
    A, alpha, E = (float(v) for v in _to_law(best, logC0, form, L.min()))
    law = PowerLaw(A, alpha, E)

    boot = np.empty((0, 3))
    if n_boot > 0 and interval_supported(n, n_distinct, _min_distinct(form)):
        # Resample compute sizes, not runs: the runs of one size share its shape and budget, and
        # their error is shared too, so the sizes are the independent units.
        levels = np.unique(C, return_inverse=True)[1]
        W, present = size_weights(levels, n_distinct, n_boot, seed)
        # Resamples with too few distinct compute values cannot identify the law: left out, counted.
        valid = (present > 0).sum(axis=1) >= _min_distinct(form)
        Wv = W[valid]
        inits = [best] + [s for s in starts[: max(boot_starts - 1, 0)]]
        Bv = len(Wv)
        thetas, losses = [], []
        for init in inits:
            t, loss_b = _solve_batch(np.tile(init, (Bv, 1)), np.tile(x, (Bv, 1)),
                                     np.tile(y, (Bv, 1)), Wv, form, delta)
            thetas.append(t)
            losses.append(loss_b)
        pick = np.argmin(np.stack(losses), axis=0)
        tb = np.stack(thetas)[pick, np.arange(Bv)]
        tb = best + small_sample_factor(n_distinct, 1) * (tb - best)
        boot = np.column_stack(_to_law(tb, logC0, form, L.min()))
    return Fit(name=name, form=form, law=law, n_runs=n, n_compute=n_distinct,
               compute_range=(float(C.min()), float(C.max())), boot=boot, n_boot=n_boot,
               delta=float(delta), n_dropped=dropped)


def fit_shared_exponent(data: dict[str, tuple[np.ndarray, np.ndarray]], *, n_boot: int = 1000,
                        seed: int = 0, delta: float | None = None) -> dict[str, Fit]:
    """Pure laws L_v = A_v·C^-α with one exponent shared by all variants.

    With a shared α the multiplier of v over b is the constant (A_b/A_v)^(1/α), the paper-style
    single number without a "read at C" caveat. Solved exactly like the separate fits: the shared
    objective is Σ_v Σ_i huber(a_v − α x_i − y_i), δ scaled to the pooled residuals unless given;
    each bootstrap replicate resamples compute sizes, one draw for every variant. α is identified
    only by variants with runs at two or more compute values (an error if none has); intervals
    need such a variant with MIN_COMPUTE_FOR_INTERVAL of them and k + 3 runs in all (k + 1
    parameters).
    """
    names = list(data)
    k = len(names)
    Cs, Ls, dropped = [], [], []
    for v in names:
        c, loss, d = _usable(data[v][0], data[v][1], f"shared-exponent fit, {v}")
        if not len(c):
            raise ValueError(f"shared-exponent fit: no runs of {v!r} with positive finite compute and loss")
        Cs.append(c)
        Ls.append(loss)
        dropped.append(d)
    spans = [len(np.unique(c)) for c in Cs]
    if max(spans) < 2:
        raise ValueError("shared-exponent fit: no variant has runs at 2 or more distinct compute values, "
                         "so the exponent is not identified")
    logC0 = float(np.mean(np.log(np.concatenate(Cs))))
    xs = [np.log(c) - logC0 for c in Cs]
    ys = [np.log(loss) for loss in Ls]

    def solve(Ws, init, delta):
        B = len(Ws[0])

        def fun(th, rows):
            total, grad = np.zeros(len(rows)), np.zeros_like(th)
            for j in range(k):
                pred = th[:, j:j + 1] - th[:, k:k + 1] * xs[j][None, :]
                val, g = _huber(pred - ys[j][None, :], delta)
                g = g * Ws[j][rows]
                total += (val * Ws[j][rows]).sum(axis=1)
                grad[:, j] = g.sum(axis=1)
                grad[:, k] -= (g * xs[j][None, :]).sum(axis=1)
            return total, grad

        return _lbfgs(fun, np.tile(init, (B, 1)))[0]

    init = np.array([float(np.mean(y)) for y in ys] + [0.05])
    ones = [np.ones((1, len(x))) for x in xs]
    best = solve(ones, init, HUBER_DELTA)[0]
    if delta is None:
        delta = scaled_delta(np.concatenate([best[j] - best[k] * xs[j] - ys[j] for j in range(k)]))
    if delta != HUBER_DELTA:
        best = solve(ones, best, delta)[0]
    boot = np.empty((0, k + 1))
    if n_boot > 0 and interval_supported(sum(map(len, xs)), max(spans), k + 1):
        # One draw of ladder rungs for every variant, a rung being the j-th smallest compute of
        # each (the variants' C differ a little at one shape): clusters are sizes.
        rungs = max(spans)
        counts = size_weights(np.arange(rungs), rungs, n_boot, seed)[1]
        Ws = [counts[:, np.unique(c, return_inverse=True)[1]] for c in Cs]
        # α is identified only if some variant's resample spans two compute values.
        valid = np.zeros(n_boot, bool)
        for x, W in zip(xs, Ws):
            drawn = np.where(W > 0, x[None, :], np.nan)
            valid |= np.nanmax(drawn, axis=1) > np.nanmin(drawn, axis=1)
        boot = solve([W[valid] for W in Ws], best, delta)
        boot = best + small_sample_factor(rungs, 1) * (boot - best)
    out = {}
    for j, v in enumerate(names):
        alpha = float(best[k])
        A = float(np.exp(best[j] + alpha * logC0))
        bA = np.exp(boot[:, j] + boot[:, k] * logC0)
        bt = np.column_stack([bA, boot[:, k], np.zeros(len(boot))])
        out[v] = Fit(name=v, form="shared", law=PowerLaw(A, alpha), n_runs=len(Cs[j]),
                     n_compute=len(np.unique(Cs[j])),
                     compute_range=(float(Cs[j].min()), float(Cs[j].max())), boot=bt,
                     n_boot=n_boot, delta=float(delta), n_dropped=dropped[j])
    return out


def _quantiles(samples, level, axis=0):
    q = 100 * np.array([(1 - level) / 2, (1 + level) / 2])
    return np.nanpercentile(samples, q, axis=axis)


def multiplier_curve(base: Fit, variant: Fit, C, level: float = 0.95):
    """Compute multiplier of ``variant`` over ``base`` at each C, with a pointwise bootstrap
    interval. The i-th resample of one fit is paired with the i-th of the other: for separate
    fits they are independent resamples of independent runs, so each pair is a valid joint draw;
    for :func:`fit_shared_exponent` fits the i-th rows come from the same joint resample.
    Returns (value, lo, hi) arrays shaped like C; NaN where the baseline never reaches the
    variant's loss (possible with the offset form)."""
    C = np.atleast_1d(np.asarray(C, dtype=float))
    point = compute_multiplier(base.law, variant.law, C)
    m = min(len(base.boot), len(variant.boot))
    if m == 0:
        return point, np.full_like(C, np.nan), np.full_like(C, np.nan)
    b, v = base.boot[:m, :, None], variant.boot[:m, :, None]
    Lv = v[:, 2] + v[:, 0] * C[None, :] ** (-v[:, 1])
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        gap = Lv - b[:, 2]
        Cb = np.where(gap > 0, (b[:, 0] / gap) ** (1.0 / b[:, 1]), np.nan)
    samples = Cb / C[None, :]
    samples[~np.isfinite(samples)] = np.nan
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # an all-NaN column stays NaN
        lo, hi = _quantiles(samples, level)
    return point, lo, hi


def multiplier_at(base: Fit, variant: Fit, C: float, level: float = 0.95):
    """Compute multiplier read at one compute C: (value, lo, hi)."""
    point, lo, hi = multiplier_curve(base, variant, [C], level)
    return float(point[0]), float(lo[0]), float(hi[0])
