"""The moment functions against independent oracles: quadrature, closed forms, Monte Carlo."""

import functools
import math
import itertools

import keras
import numpy as np
import pytest
from scipy import integrate, special, stats

from keras_dvi import moments
from tests.conftest import gradients, to_numpy

GRID_MU = np.linspace(-3.0, 3.0, 7)
RHO_CORE = [-0.9, -0.5, 0.1, 0.5, 0.9]
RHO_WIDE = RHO_CORE + [-0.99, 0.99, -0.1]

# ------------------------------------------------------------------ quadrature oracles


def _relu(a):
    return np.maximum(a, 0.0)


def _heaviside(a):
    return (a > 0).astype(float)


def _leaky(a):
    return np.where(a > 0, a, 0.2 * a)


def _normal_pdf(x, m, s):
    """N(x; m, s^2) in plain Python floats (scipy.stats' per-call overhead would dominate the
    quadratures below)."""
    return math.exp(-0.5 * ((x - m) / s) ** 2) / (s * math.sqrt(2.0 * math.pi))


def _normal_cdf(z):
    return 0.5 * math.erfc(-z / math.sqrt(2.0))


ACTIVATION_FNS = {"relu": _relu, "heaviside": _heaviside, "leaky_relu": _leaky, "linear": lambda a: a,
                  "relu6": lambda a: np.clip(a, 0.0, 6.0)}


@functools.lru_cache(maxsize=None)
def quad_one_unit(activation, m, v):
    """E[f(a)] and Var[f(a)] for a ~ N(m, v) by adaptive quadrature split at the kink."""
    s = np.sqrt(v)
    f = ACTIVATION_FNS[activation]

    def expect(g):
        lo, hi = m - 12 * s, m + 12 * s
        pts = [p for p in (0.0, 6.0) if lo < p < hi]
        val, _ = integrate.quad(lambda a: g(a) * _normal_pdf(a, m, s), lo, hi, points=pts or None, epsabs=1e-13, epsrel=1e-12, limit=200)
        return val

    e1 = expect(lambda a: f(np.asarray(a)))
    e2 = expect(lambda a: f(np.asarray(a)) ** 2)
    return e1, e2 - e1**2


def quad_cross(activation, mj, ml, vj, vl, rho):
    """Cov(f(a_j), f(a_l)) by a 1-D quadrature over a_j of a closed-form inner expectation."""
    sj, sl = np.sqrt(vj), np.sqrt(vl)
    c = rho * sj * sl
    cond_sd = sl * np.sqrt(1 - rho**2)

    def inner(x):  # E[f(a_l) | a_j = x]
        cm = ml + c / vj * (x - mj)
        z = cm / cond_sd
        relu_mean = cond_sd * _normal_pdf(z, 0.0, 1.0) + cm * _normal_cdf(z)
        if activation == "relu":
            return relu_mean
        if activation == "leaky_relu":
            return 0.2 * cm + 0.8 * relu_mean
        return _normal_cdf(z)

    f = ACTIVATION_FNS[activation]
    lo, hi = mj - 12 * sj, mj + 12 * sj
    if activation != "leaky_relu":  # f = 0 below 0
        lo = max(0.0, lo)
    pts = [0.0] if lo < 0.0 < hi else None
    if hi <= lo:
        joint = 0.0
    else:
        joint, _ = integrate.quad(lambda x: f(np.asarray(x)) * inner(x) * _normal_pdf(x, mj, sj), lo, hi, points=pts, epsabs=1e-14, epsrel=1e-12, limit=400)
    ej, _ = quad_one_unit(activation, mj, vj)
    el, _ = quad_one_unit(activation, ml, vl)
    return joint - ej * el


def _grid(rhos, vj=1.0, vl=1.0):
    rows = [(mj, ml, rho) for mj, ml, rho in itertools.product(GRID_MU, GRID_MU, rhos)]
    mj, ml, rho = (np.array(c) for c in zip(*rows))
    return mj * np.sqrt(vj), ml * np.sqrt(vl), rho


def _cross(activation, method, mj, ml, vj, vl, rho, dtype="float64"):
    cov = rho * np.sqrt(vj * vl)
    args = [keras.ops.convert_to_tensor(np.broadcast_to(a, mj.shape), dtype) for a in (mj, ml, vj, vl, cov)]
    return to_numpy(moments.cross_covariance(*args, activation, method))


_ORACLE_CACHE = {}


def _oracle(activation, mj, ml, vj, vl, rho):
    key = (activation, vj, vl, tuple(rho))
    if key not in _ORACLE_CACHE:
        _ORACLE_CACHE[key] = np.array([quad_cross(activation, a, b, vj, vl, r) for a, b, r in zip(mj, ml, rho)])
    return _ORACLE_CACHE[key]


# ------------------------------------------------------------------ one unit


@pytest.mark.parametrize("activation", ["relu", "heaviside", "leaky_relu", "linear", "relu6"])
@pytest.mark.parametrize("variance", [0.04, 1.0, 6.25])
def test_one_unit_moments_match_quadrature(activation, variance, floatx):
    means = np.linspace(-3, 3, 13) * np.sqrt(variance)
    oracle = np.array([quad_one_unit(activation, m, variance) for m in means])
    mean_h, var_h = moments.activation_moments(
        keras.ops.convert_to_tensor(means, floatx), keras.ops.convert_to_tensor(np.full_like(means, variance), floatx), activation
    )
    tol = 1e-10 if floatx == "float64" else 2e-6
    scale = max(1.0, variance)
    np.testing.assert_allclose(to_numpy(mean_h), oracle[:, 0], atol=tol * scale)
    np.testing.assert_allclose(to_numpy(var_h), oracle[:, 1], atol=tol * scale)


def _quadrature_oracle(f, derivative, m, v, points, epsabs=1e-16):
    """`(E[f(a)], Var[f(a)], E[f'(a)])` for `a ~ N(m, v)` by adaptive quadrature over 14 sd,
    split at `points` (an activation's kinks or bend); the variance taken about the mean (no
    cancellation where it is tiny)."""
    s = math.sqrt(v)
    lo, hi = m - 14 * s, m + 14 * s
    quad = lambda g: integrate.quad(lambda a: g(a) * _normal_pdf(a, m, s), lo, hi,  # noqa: E731
                                    points=[p for p in points if lo < p < hi] or None,
                                    epsabs=epsabs, epsrel=1e-12, limit=400)[0]
    first = quad(f)
    return first, quad(lambda a: (f(a) - first) ** 2), quad(derivative)


def test_relu6_moments_match_quadrature_around_both_kinks_and_in_the_tails(floatx):
    """ReLU6 (`min(max(a, 0), 6)`, MobileNets): means across both kinks and far beyond them,
    variances from 1e-8 (the mass at one point: no cancellation in the variance) to 25."""
    means, variances = (np.array(c, "float64") for c in zip(*itertools.product(
        [-40.0, -4.0, -0.5, 0.0, 0.3, 3.0, 5.9, 6.0, 6.5, 9.0, 46.0], [1e-8, 0.01, 1.0, 25.0])))
    inside = lambda a: 1.0 if 0.0 < a < 6.0 else 0.0  # noqa: E731 - ReLU6's slope
    oracle = np.array([_quadrature_oracle(ACTIVATION_FNS["relu6"], inside, m, v, points=(0.0, 6.0))
                       for m, v in zip(means, variances)])
    mean_h, var_h, slope = (to_numpy(t) for t in moments.activation_moments_and_slope(
        keras.ops.convert_to_tensor(means, floatx), keras.ops.convert_to_tensor(variances, floatx), "relu6"))
    sd = np.sqrt(variances)
    if floatx == "float64":
        np.testing.assert_allclose(mean_h, oracle[:, 0], rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(var_h, oracle[:, 1], rtol=1e-7, atol=1e-13)
    else:  # float32: relative to the unit's scale (its mean's round-off, its sd's)
        scale = np.maximum(np.abs(means), 1.0)
        np.testing.assert_array_less(np.abs(mean_h - oracle[:, 0]), 2e-6 * scale + 1e-6 * sd)
        np.testing.assert_array_less(np.abs(var_h - oracle[:, 1]), 1e-3 * oracle[:, 1] + 1e-6 * scale * sd + 1e-12)
    np.testing.assert_allclose(slope, oracle[:, 2], atol=1e-12 if floatx == "float64" else 1e-6)


def _hard_silu(a):
    return a * min(max(a + 3.0, 0.0), 6.0) / 6.0


def test_hard_silu_moments_match_quadrature_across_both_kinks_and_in_the_tails(floatx):
    """Hard SiLU (`a relu6(a + 3) / 6`, MobileNetV3) in closed form against adaptive quadrature:
    means across both kinks (-3, 3) and far beyond, variances from 1e-8 (no cancellation in the
    variance) to 400; the slope against the quadrature of `f'`. Values and gradients stay finite
    for means up to +-1e4 and variances from 0 to 1e6."""
    means, variances = (np.array(c, "float64") for c in zip(*itertools.product(
        [-40.0, -6.0, -3.2, -3.0, -1.0, 0.0, 0.4, 2.9, 3.0, 3.5, 8.0, 46.0], [1e-8, 0.01, 1.0, 25.0, 400.0])))

    slope = lambda a: 0.0 if a < -3.0 else ((2.0 * a + 3.0) / 6.0 if a < 3.0 else 1.0)  # noqa: E731
    want = np.array([_quadrature_oracle(_hard_silu, slope, m, v, points=(-3.0, 3.0)) for m, v in zip(means, variances)])
    got = np.stack([to_numpy(t).astype("float64") for t in moments.activation_moments_and_slope(
        keras.ops.convert_to_tensor(means, floatx), keras.ops.convert_to_tensor(variances, floatx), "hard_silu")], 1)
    scale, sd = np.maximum(np.abs(means), 1.0), np.sqrt(variances)
    if floatx == "float64":  # (measured: variances within 5e-11, means within 3e-12 of the scale)
        np.testing.assert_array_less(np.abs(got[:, 1] - want[:, 1]), 1e-9 * want[:, 1] + 1e-13 * scale * sd)
        np.testing.assert_array_less(np.abs(got[:, 0] - want[:, 0]), 1e-10 * scale)
        np.testing.assert_allclose(got[:, 2], want[:, 2], atol=1e-10)
    else:  # (measured: variances within 3.3e-4, means within 1.8e-6 of the scale)
        np.testing.assert_array_less(np.abs(got[:, 1] - want[:, 1]), 1e-3 * want[:, 1] + 1e-6 * scale * sd + 1e-12)
        np.testing.assert_array_less(np.abs(got[:, 0] - want[:, 0]), 4e-6 * scale + 1e-6 * sd)
        np.testing.assert_allclose(got[:, 2], want[:, 2], atol=1e-6)
    edges_m, edges_v = (np.array(c, floatx) for c in zip(*itertools.product(
        [-1e4, -60.0, -3.0, 0.0, 3.0, 60.0, 1e4], [0.0, 1e-30, 1e-12, 0.25, 3.0, 1e6])))

    def total(m, v):
        return sum(keras.ops.sum(o) for o in moments.activation_moments_and_slope(m, v, "hard_silu"))

    value, grads = gradients(total, [edges_m, edges_v])
    assert np.isfinite(value) and all(np.isfinite(g).all() for g in grads)
    mean_h, var_h, _ = (to_numpy(t) for t in moments.activation_moments_and_slope(
        keras.ops.convert_to_tensor(edges_m[edges_v <= 1e-12]), keras.ops.convert_to_tensor(edges_v[edges_v <= 1e-12]),
        "hard_silu"))
    np.testing.assert_allclose(mean_h, [_hard_silu(float(a)) for a in edges_m[edges_v <= 1e-12]], rtol=1e-6, atol=1e-6)
    assert (var_h >= 0).all() and (var_h <= 1e-10 * np.maximum(np.abs(edges_m[edges_v <= 1e-12]), 1) ** 2).all()


def test_hard_sigmoid_moments_match_quadrature_across_both_kinks(floatx):
    """The hard sigmoid `relu6(a + 3) / 6` (`keras.activations.hard_sigmoid`) against adaptive
    quadrature: means across both kinks and beyond, variances from 1e-8 to 100, and the slope
    `P(-3 < a < 3) / 6`."""
    f = lambda a: min(max(a + 3.0, 0.0), 6.0) / 6.0  # noqa: E731
    means, variances = (np.array(c, "float64") for c in zip(*itertools.product(
        [-30.0, -3.5, -3.0, -1.0, 0.0, 2.5, 3.0, 9.0], [1e-8, 0.3, 4.0, 100.0])))

    slope = lambda a: 1.0 / 6.0 if -3.0 < a < 3.0 else 0.0  # noqa: E731
    want = np.array([_quadrature_oracle(f, slope, m, v, points=(-3.0, 3.0)) for m, v in zip(means, variances)])
    got = np.stack([to_numpy(t).astype("float64") for t in moments.activation_moments_and_slope(
        keras.ops.convert_to_tensor(means, floatx), keras.ops.convert_to_tensor(variances, floatx), "hard_sigmoid")], 1)
    tol = 1e-10 if floatx == "float64" else 2e-6
    np.testing.assert_array_less(np.abs(got[:, 1] - want[:, 1]), (1e-7 if floatx == "float64" else 1e-3) * want[:, 1]
                                 + tol * np.sqrt(variances) + 1e-14)
    np.testing.assert_allclose(got[:, 0], want[:, 0], atol=tol)
    np.testing.assert_allclose(got[:, 2], want[:, 2], atol=tol)


#: The smooth activations and their derivatives, in plain floats (the oracle's integrands).
SMOOTH_FNS = {
    "silu": (lambda a: a / (1.0 + math.exp(-a)) if a > -700 else 0.0,
             lambda a: (lambda s: s * (1.0 + a * (1.0 - s)))(1.0 / (1.0 + math.exp(-a))) if a > -700 else 0.0),
    "gelu": (lambda a: a * _normal_cdf(a), lambda a: _normal_cdf(a) + a * math.exp(-0.5 * a * a) / math.sqrt(2 * math.pi)),
    "sigmoid": (lambda a: 1.0 / (1.0 + math.exp(-a)) if a > -700 else 0.0,
                lambda a: (lambda s: s * (1.0 - s))(1.0 / (1.0 + math.exp(-a))) if a > -700 else 0.0),
    "tanh": (math.tanh, lambda a: 1.0 - math.tanh(a) ** 2),
}
#: The smooth activations' stated accuracy (float64, `|m| <= 4 sd`): `(below SMOOTH_SWITCH, S <= 4,
#: 4 < S <= 100)`, each `(variance relative, mean / sd, slope absolute)`; GELU is exact (closed form).
#: (tanh, `2 sigmoid(2a) - 1`, bends at half the sigmoid's scale: its quadrature below the switch
#: is as accurate as the sigmoid's at `4 S`, its errors above it those of the sigmoid at `4 S`.)
SMOOTH_ERRORS = {
    "silu": ((1e-9, 1e-9, 1e-9), (2e-3, 1e-4, 1e-3), (5e-2, 5e-3, 2e-3)),
    "sigmoid": ((1e-9, 1e-9, 1e-9), (1e-3, 1e-4, 1e-4), (4e-2, 1e-2, 1e-3)),
    "tanh": ((1e-7, 1e-9, 1e-8), (1e-2, 3e-3, 1e-3), (4e-2, 1e-2, 1e-3)),
    "gelu": ((1e-9, 1e-9, 1e-9),) * 3,
}


@pytest.mark.parametrize("activation", sorted(SMOOTH_FNS))
def test_smooth_activations_match_quadrature_within_the_stated_error(activation):
    """SiLU, GELU, sigmoid and tanh against adaptive quadrature of the exact integrals: the mean, the
    variance (taken about the mean: no cancellation where it is tiny) and `E[f'(a)]`, on means
    within 4 sd of 0 and beyond (the tails: absolute errors against `S`), variances from 1e-8 to
    100 on both sides of `SMOOTH_SWITCH`. Exact to round-off below the switch and for GELU;
    above it, the errors `SMOOTH_ERRORS` states (the docs' table quotes them)."""
    f, derivative = SMOOTH_FNS[activation]
    means = [-40.0, -12.0, -4.0, -1.5, 0.0, 0.7, 3.0, 9.0, 30.0]
    variances = [1e-8, 0.1, 0.2499, 0.25, 1.0, 4.0, 16.0, 100.0]
    grid = np.array(list(itertools.product(means, variances)))

    want = np.array([_quadrature_oracle(f, derivative, m, v, points=(0.0,), epsabs=1e-300) for m, v in grid])
    got = np.stack([to_numpy(t) for t in moments.activation_moments_and_slope(
        keras.ops.convert_to_tensor(grid[:, 0], "float64"), keras.ops.convert_to_tensor(grid[:, 1], "float64"),
        activation)], axis=1)
    m, v = grid[:, 0], grid[:, 1]
    core = np.abs(m) <= 4 * np.sqrt(v)
    for band, (var_rel, mean_sd, slope_abs) in zip(
            [v < moments.SMOOTH_SWITCH, (v >= moments.SMOOTH_SWITCH) & (v <= 4), v > 4], SMOOTH_ERRORS[activation]):
        rows = band & core
        assert rows.any()
        np.testing.assert_array_less(np.abs(got[rows, 1] - want[rows, 1]), var_rel * want[rows, 1] + 1e-300)
        np.testing.assert_array_less(np.abs(got[rows, 0] - want[rows, 0]), mean_sd * np.sqrt(want[rows, 1]) + 1e-12)
        np.testing.assert_array_less(np.abs(got[rows, 2] - want[rows, 2]), slope_abs + 1e-12)
    tails = ~core  # far from 0 the unit is (nearly) linear or constant: errors small against S itself
    np.testing.assert_array_less(np.abs(got[tails, 1] - want[tails, 1]), 1e-4 * v[tails] + 1e-13)
    np.testing.assert_array_less(np.abs(got[tails, 0] - want[tails, 0]), 1e-4 * np.sqrt(v[tails]) + 1e-12)
    np.testing.assert_array_less(np.abs(got[tails, 2] - want[tails, 2]), 1e-4)


@pytest.mark.parametrize("activation", sorted(SMOOTH_FNS))
def test_smooth_activations_are_finite_at_the_edges_and_deterministic_in_the_limit(activation, floatx):
    """Values and gradients finite for means up to +-1e4 and variances from 0 to 1e6 (float32
    too); at variance 0 and 1e-12 the unit is `f(m)` with slope `f'(m)` and no variance."""
    means, variances = (np.array(c, floatx) for c in zip(*itertools.product(
        [-1e4, -60.0, -3.0, -1e-3, 0.0, 1e-3, 3.0, 60.0, 1e4], [0.0, 1e-30, 1e-12, 0.2499, 0.25, 3.0, 1e6])))

    def total(m, v):
        return sum(keras.ops.sum(o) for o in moments.activation_moments_and_slope(m, v, activation))

    value, grads = gradients(total, [means, variances])
    assert np.isfinite(value) and all(np.isfinite(g).all() for g in grads)
    f, derivative = SMOOTH_FNS[activation]
    sure = variances <= 1e-12
    mean_h, var_h, slope = (to_numpy(t).astype("float64") for t in moments.activation_moments_and_slope(
        keras.ops.convert_to_tensor(means[sure]), keras.ops.convert_to_tensor(variances[sure]), activation))
    tol = 1e-6 if floatx == "float32" else 1e-12
    np.testing.assert_allclose(mean_h, [f(float(a)) for a in means[sure]], rtol=tol, atol=tol)
    np.testing.assert_allclose(slope, [derivative(float(a)) for a in means[sure]], rtol=1e-5, atol=tol)
    assert (var_h >= 0).all() and (var_h <= 1e-10).all()


@pytest.mark.parametrize("activation", ["relu", "heaviside", "leaky_relu", "relu6"])
def test_expected_derivative_matches_closed_form(activation):
    means = np.linspace(-3, 3, 13)
    variance = 2.0
    got = to_numpy(moments.expected_derivative(keras.ops.convert_to_tensor(means, "float64"), keras.ops.convert_to_tensor(np.full_like(means, variance), "float64"), activation))
    sd = np.sqrt(variance)
    want = {
        "relu": stats.norm.sf(0, means, sd),
        "heaviside": stats.norm.pdf(0, means, sd),
        "leaky_relu": 0.2 + 0.8 * stats.norm.sf(0, means, sd),
        "relu6": stats.norm.cdf(6, means, sd) - stats.norm.cdf(0, means, sd),
    }[activation]
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("activation", ["relu", "leaky_relu", "heaviside", "relu6", "hard_silu", "hard_sigmoid", "silu", "gelu",
                                        "sigmoid", "tanh"])
def test_moments_and_slope_gradients_match_finite_differences(activation):
    """`activation_moments_and_slope` (ReLU's with its hand-written gradient): ReLU's values are
    the closed forms, and every activation's gradient matches central finite differences in
    float64, in both tails and where the variance is tiny (`mu` clipped)."""
    rng = np.random.default_rng(4)
    variance = np.concatenate([rng.uniform(0.05, 3.0, 30), [1e-9, 1e-9, 0.5, 0.5]])
    mean = np.concatenate([rng.normal(0, 2, 30), [0.3, -0.3, 12.0, -12.0]])
    weights = rng.normal(size=(3, mean.size))

    def objective(m, v):
        outs = moments.activation_moments_and_slope(m, v, activation)
        return sum(keras.ops.sum(o * w) for o, w in zip(outs, weights))

    _, (g_mean, g_var) = gradients(objective, [mean, variance])
    mean_h, var_h, slope = (to_numpy(t) for t in moments.activation_moments_and_slope(mean, variance, activation))
    if activation == "relu":  # the closed forms, by SciPy (E[h], E[h^2] - E[h]^2, Phi)
        sd = np.sqrt(variance)
        cdf, pdf = stats.norm.cdf(mean / sd), stats.norm.pdf(mean / sd)
        first = mean * cdf + sd * pdf
        np.testing.assert_allclose(mean_h, first, rtol=1e-10, atol=1e-14)
        np.testing.assert_allclose(var_h, (mean ** 2 + variance) * cdf + mean * sd * pdf - first ** 2, rtol=1e-8, atol=1e-12)
        np.testing.assert_allclose(slope, cdf, rtol=1e-12, atol=1e-15)

    def weighted(m, v):
        return sum(w * to_numpy(o) for w, o in zip(weights, moments.activation_moments_and_slope(m, v, activation)))

    h = 1e-7
    fd_mean = (weighted(mean + h, variance) - weighted(mean - h, variance)) / (2 * h)
    np.testing.assert_allclose(g_mean, fd_mean, rtol=1e-6, atol=1e-6)
    hv = 1e-7 * variance
    fd_var = (weighted(mean, variance + hv) - weighted(mean, variance - hv)) / (2 * hv)
    live = variance > 1e-6  # below, the gradient through the floored sd is zero, as autodiff's
    np.testing.assert_allclose(g_var[live], fd_var[live], rtol=1e-6, atol=1e-6)
    assert np.isfinite(g_var).all() and np.isfinite(g_mean).all()


def test_deterministic_limit_is_the_activation():
    means = keras.ops.convert_to_tensor([-40.0, -2.0, -1e-3, 1e-3, 2.0, 40.0])
    for variance in (0.0, 1e-12):
        var = keras.ops.full_like(means, variance)
        mean_h, var_h = moments.activation_moments(means, var, "relu")
        np.testing.assert_allclose(to_numpy(mean_h), np.maximum(to_numpy(means), 0), atol=1e-6)
        assert (to_numpy(var_h) >= 0).all() and (to_numpy(var_h) <= 1e-11).all()


# ------------------------------------------------------------------ two units


@pytest.mark.parametrize(
    "activation, rhos, bound, asymptote_error",
    [
        ("relu", RHO_CORE, 0.0037, 0.07),
        ("relu", RHO_WIDE, 0.0095, 0.085),
        ("heaviside", RHO_CORE, 0.016, 0.17),
        ("heaviside", RHO_WIDE, 0.060, 0.22),
        # Leaky ReLU = 0.2 x + 0.8 relu(x): only the ReLU-ReLU term is approximated.
        ("leaky_relu", RHO_WIDE, 0.64 * 0.0095, None),
    ],
)
def test_paper_cross_moments_within_stated_error(activation, rhos, bound, asymptote_error):
    """Corrected Table 1 (math.md section 3) within the bounds stated there, on its grid."""
    mj, ml, rho = _grid(rhos)
    oracle = _oracle(activation, mj, ml, 1.0, 1.0, rho)
    got = _cross(activation, "paper", mj, ml, 1.0, 1.0, rho)
    assert np.abs(got - oracle).max() <= bound * 1.02 + 1e-6
    if asymptote_error is None:
        return
    # The grid is discriminative: the asymptote alone (no correction) misses by far more.
    cdf = stats.norm.cdf
    asymptote = rho * cdf(mj) * cdf(ml) if activation == "relu" else np.zeros_like(rho)
    assert np.abs(asymptote - oracle).max() >= asymptote_error


@pytest.mark.parametrize("activation", ["relu", "heaviside", "leaky_relu"])
@pytest.mark.parametrize("variances", [(1.0, 1.0), (0.3, 2.5)])
def test_exact_cross_moments_match_quadrature(activation, variances):
    vj, vl = variances
    mj, ml, rho = _grid(RHO_WIDE, vj, vl)
    oracle = _oracle(activation, mj, ml, vj, vl, rho)
    got = _cross(activation, "exact", mj, ml, vj, vl, rho)
    np.testing.assert_allclose(got, oracle, atol=1e-8)


@pytest.mark.parametrize("activation", ["relu", "heaviside"])
def test_paper_cross_moments_scale_with_variances(activation):
    """With unequal variances the error is the unit-variance error times the scale."""
    vj, vl = 0.3, 2.5
    mj, ml, rho = _grid(RHO_CORE, vj, vl)
    oracle = _oracle(activation, mj, ml, vj, vl, rho)
    got = _cross(activation, "paper", mj, ml, vj, vl, rho)
    scale = np.sqrt(vj * vl) if activation == "relu" else 1.0
    bound = 0.0037 if activation == "relu" else 0.016
    assert np.abs(got - oracle).max() <= bound * scale * 1.02


@pytest.mark.parametrize("method", ["paper", "exact"])
@pytest.mark.parametrize("activation", ["relu", "heaviside"])
def test_cross_moments_float32_close_to_float64(activation, method):
    mj, ml, rho = _grid(RHO_WIDE)
    f64 = _cross(activation, method, mj, ml, 1.0, 1.0, rho, "float64")
    f32 = _cross(activation, method, mj, ml, 1.0, 1.0, rho, "float32")
    np.testing.assert_allclose(f32, f64, atol=2e-5)


def _random_covariance(rng, batch, k):
    a = rng.normal(size=(batch, k, k))
    cov = a @ np.swapaxes(a, -1, -2) / k + 1e-3 * np.eye(k)
    return cov


@pytest.mark.parametrize("activation", ["relu", "heaviside", "linear"])
def test_activation_covariance_assembles_cross_and_diagonal_terms(activation):
    rng = np.random.default_rng(0)
    mean = rng.normal(size=(3, 5))
    cov = _random_covariance(rng, 3, 5)
    mean_h, cov_h = moments.activation_covariance(keras.ops.convert_to_tensor(mean), keras.ops.convert_to_tensor(cov), activation, "exact")
    mean_h, cov_h = to_numpy(mean_h), to_numpy(cov_h)
    for b, j, l in [(0, 0, 1), (1, 2, 4), (2, 3, 3), (2, 4, 1)]:
        vj, vl = cov[b, j, j], cov[b, l, l]
        if activation == "linear":
            want_cov = cov[b, j, l]
        elif j == l:
            want_cov = quad_one_unit(activation, mean[b, j], vj)[1]
        else:
            want_cov = quad_cross(activation, mean[b, j], mean[b, l], vj, vl, cov[b, j, l] / np.sqrt(vj * vl))
        np.testing.assert_allclose(cov_h[b, j, l], want_cov, atol=1e-8)
        want_mean = mean[b, j] if activation == "linear" else quad_one_unit(activation, mean[b, j], vj)[0]
        np.testing.assert_allclose(mean_h[b, j], want_mean, atol=1e-8)
    np.testing.assert_allclose(cov_h, np.swapaxes(cov_h, -1, -2), atol=1e-12)


def _relu_paper_cases(rng):
    """`(label, mean, covariance)`: random, large means, independent units (rho = 0), a unit of
    zero variance, rank one (rho = +-1), means clipped at MU_MAX."""
    zero_unit = _random_covariance(rng, 2, 5)
    zero_unit[:, 0, :] = zero_unit[:, :, 0] = 0.0
    direction = rng.normal(size=(2, 1, 5))
    return [
        ("random", rng.normal(size=(3, 6)), _random_covariance(rng, 3, 6)),
        ("large means", 3 * rng.normal(size=(3, 6)), 0.1 * _random_covariance(rng, 3, 6)),
        ("independent", rng.normal(size=(3, 6)), np.stack([np.diag(rng.uniform(0.1, 2, 6)) for _ in range(3)])),
        ("zero variance", rng.normal(size=(2, 5)), zero_unit),
        ("rank one", rng.normal(size=(2, 5)), np.swapaxes(direction, -1, -2) @ direction + 1e-9 * np.eye(5)),
        ("clipped mu", 80 * rng.normal(size=(2, 5)), 1e-3 * _random_covariance(rng, 2, 5)),
    ]


def test_relu_paper_covariance_gradient_matches_autodiff_and_finite_differences(floatx):
    """ReLU's one-pass paper covariance (the layers' default) and its hand-written gradient: the
    values are the pairwise functions', the gradient autodiff's of the pairwise functions (to
    round-off, at every edge, finite), and, in float64, central finite differences'."""
    assert moments.get_activation("relu").paper_covariance_matrix is moments._relu_paper_covariance_matrix
    one_pass = lambda m, c: moments.activation_covariance(m, c, "relu", "paper")  # noqa: E731
    pairwise = lambda m, c: moments._pairwise_activation_covariance(m, c, "relu", "paper")  # noqa: E731
    rng = np.random.default_rng(7)
    for label, mean, cov in _relu_paper_cases(rng):
        mean, cov = mean.astype(floatx), cov.astype(floatx)
        w_mean, w_cov = rng.normal(size=mean.shape).astype(floatx), rng.normal(size=cov.shape).astype(floatx)

        def objective(function):
            def total(m, c):
                mean_h, cov_h = function(m, c)
                return keras.ops.sum(mean_h * w_mean) + keras.ops.sum(cov_h * w_cov)
            return total

        value, (g_mean, g_cov) = gradients(objective(one_pass), [mean, cov])
        want, (want_mean, want_cov) = gradients(objective(pairwise), [mean, cov])
        tol = 1e-6 if floatx == "float32" else 1e-12
        np.testing.assert_allclose(value, want, rtol=tol, err_msg=label)
        assert np.isfinite(g_mean).all() and np.isfinite(g_cov).all(), label
        # rank one: 1/rho_bar of correlations clipped at 1 - 1e-6 (float32; 1 - 1e-10 in float64)
        # magnifies round-off, by about 1e3 (1e5)
        scale = (1e3 if floatx == "float32" else 1e5) if label == "rank one" else 1.0
        np.testing.assert_allclose(g_mean, want_mean, atol=scale * tol * (1 + np.abs(want_mean).max()), err_msg=label)
        np.testing.assert_allclose(g_cov, want_cov, atol=scale * tol * (1 + np.abs(want_cov).max()), err_msg=label)
        if floatx == "float64" and label in ("random", "large means", "independent"):
            def weighted(m, c):
                mean_h, cov_h = moments.activation_covariance(keras.ops.convert_to_tensor(m), keras.ops.convert_to_tensor(c),
                                                              "relu", "paper")
                return float(np.sum(to_numpy(mean_h) * w_mean) + np.sum(to_numpy(cov_h) * w_cov))

            h = 1e-6
            for _ in range(3):  # random directions; the covariance's kept symmetric, as layers give it
                d_mean = rng.normal(size=mean.shape)
                d_cov = rng.normal(size=cov.shape)
                d_cov = d_cov + np.swapaxes(d_cov, -1, -2)
                fd = (weighted(mean + h * d_mean, cov + h * d_cov) - weighted(mean - h * d_mean, cov - h * d_cov)) / (2 * h)
                np.testing.assert_allclose(np.sum(g_mean * d_mean) + np.sum(g_cov * d_cov), fd, rtol=1e-6, err_msg=label)


@pytest.mark.parametrize("activation", ["relu", "heaviside"])
def test_exact_covariance_is_positive_semidefinite(activation):
    rng = np.random.default_rng(1)
    mean = 2 * rng.normal(size=(20, 8))
    cov = _random_covariance(rng, 20, 8) * rng.uniform(0.1, 5, size=(20, 1, 1))
    _, cov_h = moments.activation_covariance(keras.ops.convert_to_tensor(mean), keras.ops.convert_to_tensor(cov), activation, "exact")
    eig = np.linalg.eigvalsh(to_numpy(cov_h))
    assert eig.min() >= -1e-10 * eig.max()


# ------------------------------------------------------------------ edges: values and gradients

EDGE_MEANS = [-40.0, -1.0, 0.0, 1.0, 40.0]
EDGE_VARS = [0.0, 1e-12, 1.0]
EDGE_RHOS = [0.0, 1 - 1e-6, -(1 - 1e-6), 0.3]


def _edge_grid():
    rows = list(itertools.product(EDGE_MEANS, EDGE_MEANS, EDGE_VARS, EDGE_VARS, EDGE_RHOS))
    return [np.array(c) for c in zip(*rows)]


@pytest.mark.parametrize("method", ["paper", "exact"])
@pytest.mark.parametrize("activation", ["relu", "heaviside", "leaky_relu", "linear"])
def test_cross_covariance_finite_values_and_gradients_at_edges(activation, method, floatx):
    mj, ml, vj, vl, rho = _edge_grid()
    cov = rho * np.sqrt(vj * vl)
    arrays = [a.astype(floatx) for a in (mj, ml, vj, vl, cov)]

    def total(*tensors):
        mean_j, var_j = moments.activation_moments(tensors[0], tensors[2], activation)
        return keras.ops.sum(moments.cross_covariance(*tensors, activation, method)) + keras.ops.sum(mean_j) + keras.ops.sum(var_j)

    value, grads = gradients(total, arrays)
    assert np.isfinite(value)
    for g in grads:
        assert np.isfinite(g).all()
    out = to_numpy(moments.cross_covariance(*[keras.ops.convert_to_tensor(a) for a in arrays], activation, method))
    assert np.isfinite(out).all()
    # Deterministic units have zero covariance (a Heaviside unit at mean exactly 0 is a fair
    # coin whatever its variance, so it is left out); for ReLU with both means +40 and unit
    # variances the units are (almost surely) linear, so the covariance is S_jl itself.
    deterministic = (vj == 0) | (vl == 0) | (vj == 1e-12) | (vl == 1e-12)
    if activation == "heaviside":
        deterministic &= (mj != 0) & (ml != 0)
    assert np.abs(out[deterministic]).max() <= 1e-5
    if activation == "relu":
        linear_regime = (mj == 40) & (ml == 40) & (vj == 1) & (vl == 1)
        np.testing.assert_allclose(out[linear_regime], cov[linear_regime], atol=1e-5)


def test_zero_correlation_means_zero_covariance_for_every_method():
    rng = np.random.default_rng(2)
    mj, ml = rng.normal(size=(2, 50)) * 2
    vj, vl = rng.uniform(0.1, 3, size=(2, 50))
    for activation in ("relu", "heaviside"):
        for method in ("paper", "exact"):
            got = _cross(activation, method, mj, ml, vj, vl, np.zeros(50))
            np.testing.assert_allclose(got, 0.0, atol=1e-12)


# ------------------------------------------------------------------ linear map: Monte Carlo


def _mc_linear(rng, n, mean_h, cov_h, kernel_mean, kernel_var, bias_mean, bias_var):
    h = rng.multivariate_normal(mean_h, cov_h, size=n) if cov_h is not None else np.broadcast_to(mean_h, (n, mean_h.size))
    w = kernel_mean + np.sqrt(kernel_var) * rng.normal(size=(n,) + kernel_mean.shape)
    b = bias_mean + np.sqrt(bias_var) * rng.normal(size=(n, bias_mean.size))
    return np.einsum("ni,niu->nu", h, w) + b


def _assert_moments_match_mc(samples, mean, cov, z=5.0):
    n = samples.shape[0]
    centred = samples - samples.mean(0)
    se_mean = samples.std(0) / np.sqrt(n)
    assert (np.abs(samples.mean(0) - mean) <= z * se_mean).all()
    products = centred[:, :, None] * centred[:, None, :]
    se_cov = products.std(0) / np.sqrt(n)
    assert (np.abs(products.mean(0) - cov) <= z * se_cov + 1e-12).all()


@pytest.mark.parametrize("structure", ["deterministic", "diagonal", "full"])
@pytest.mark.parametrize("full_output", [True, False])
def test_linear_moments_match_monte_carlo(structure, full_output):
    rng = np.random.default_rng(3)
    k_in, units, n = 4, 3, 200_000
    kernel_mean = rng.normal(size=(k_in, units))
    kernel_var = rng.uniform(0.05, 0.5, size=(k_in, units))
    bias_mean, bias_var = rng.normal(size=units), rng.uniform(0.05, 0.5, size=units)
    mean_h = rng.normal(size=k_in)
    cov_h = {"deterministic": None, "diagonal": np.diag(rng.uniform(0.1, 2, k_in)), "full": _random_covariance(rng, 1, k_in)[0]}[structure]
    kwargs = {}
    if structure == "diagonal":
        kwargs["variance"] = np.diag(cov_h)[None]
    elif structure == "full":
        kwargs["covariance"] = cov_h[None]
    mean_a, second_a, diagonal = moments.linear_moments(mean_h[None], kernel_mean, kernel_var, bias_mean, bias_var, full_output=full_output, **kwargs)
    samples = _mc_linear(rng, n, mean_h, cov_h, kernel_mean, kernel_var, bias_mean, bias_var)
    second_a = to_numpy(second_a)[0]
    assert diagonal == (structure == "deterministic" or not full_output)
    cov = np.diag(second_a) if diagonal else second_a
    if diagonal and structure != "deterministic":  # off-diagonal terms were dropped on purpose
        mc_cov = np.cov(samples.T)
        cov = cov + (mc_cov - np.diag(np.diag(mc_cov)))
    _assert_moments_match_mc(samples, to_numpy(mean_a)[0], cov)


def test_normal_cdf_pair_matches_scipy_in_both_tails(floatx):
    """`(Phi(x), Phi(-x))` from one `erfc`: each relatively accurate where it is tiny (the tail
    is never taken as 1 minus a number near 1), the two summing to 1. The tolerance is float32
    `erfc`'s own relative error out to tails of 1e-33 (x = 12; 1e-5 there)."""
    x = np.r_[np.linspace(-37.0, 37.0, 741), -1e-9, 0.0, 1e-9] if floatx == "float64" else np.linspace(-12.0, 12.0, 241)
    lower, upper = (to_numpy(t) for t in moments.normal_cdf_pair(keras.ops.convert_to_tensor(x, floatx)))
    rtol = 1e-13 if floatx == "float64" else 2e-5
    np.testing.assert_allclose(lower, stats.norm.cdf(x), rtol=rtol, atol=0.0)
    np.testing.assert_allclose(upper, stats.norm.sf(x), rtol=rtol, atol=0.0)
    np.testing.assert_allclose(lower + upper, 1.0, rtol=0.0, atol=4 * np.finfo(floatx).eps)


# ------------------------------------------------------------------ Owen's T


def test_owens_t_matches_scipy(floatx):
    h = np.r_[np.linspace(-10, 10, 81), 1e-9, -40.0, 40.0]
    a = np.r_[np.linspace(-30, 30, 121), 1e8, -1e8, 1e-9, 0.0, 1.0, -1.0]
    hh, aa = np.meshgrid(h, a)
    got = to_numpy(moments.owens_t(keras.ops.convert_to_tensor(hh, floatx), keras.ops.convert_to_tensor(aa, floatx)))
    tol = 1e-15 if floatx == "float64" else 2e-7
    np.testing.assert_allclose(got, special.owens_t(hh, aa), atol=tol)


def test_owens_t_gradients_match_closed_form():
    hv = np.linspace(-4, 4, 17)[:, None] + np.zeros((1, 9))
    av = np.zeros((17, 1)) + np.array([-5, -1.5, -1, -0.3, 0, 0.3, 1, 1.5, 5.0])
    _, (dh, da) = gradients(lambda h, a: keras.ops.sum(moments.owens_t(h, a)), [hv, av])
    # dT/da = exp(-h^2 (1 + a^2) / 2) / (2 pi (1 + a^2)); dT/dh = -phi(h) erf(a h / sqrt 2) / 2.
    np.testing.assert_allclose(da, np.exp(-0.5 * hv**2 * (1 + av**2)) / (2 * np.pi * (1 + av**2)), atol=1e-12)
    np.testing.assert_allclose(dh, -stats.norm.pdf(hv) * special.erf(av * hv / np.sqrt(2)) / 2, atol=1e-12)


# ------------------------------------------------------------------ validation


def test_bounded_activations_are_the_bounded_functions():
    """`Activation.bounded` (what `convert`'s warning about depthwise stacks reads) agrees with
    the function itself: bounded entries stay within 6 on inputs out to +-1e6, the others
    (the identity included) grow past 1e3."""
    x = keras.ops.convert_to_tensor(np.array([-1e6, -1e3, 0.0, 1e3, 1e6], "float32"))
    for name in moments.ACTIVATIONS:
        entry = moments.get_activation(name)
        largest = np.abs(to_numpy(entry.apply(x))).max()
        assert entry.bounded == (largest <= 6.0), (name, largest)
        assert entry.bounded or largest > 1e3, name


def test_unknown_activation_and_method_are_refused():
    with pytest.raises(ValueError, match="activation"):
        moments.canonical_activation("softplus")
    with pytest.raises(ValueError, match="covariance_approximation"):
        moments.canonical_method("fast")
    assert moments.canonical_activation(None) == "linear"
    assert moments.canonical_activation(keras.activations.relu) == "relu"
    with pytest.raises(ValueError, match="DenseDVI propagates a full covariance.*DenseDiagDVI"):
        moments.canonical_covariance_activation("relu6", "DenseDVI")
    with pytest.raises(ValueError, match="no closed-form covariance"):
        moments.cross_covariance(*[keras.ops.ones((2,))] * 5, "relu6")


def test_float32_erfc_and_arcsin_match_scipy_and_numpy():
    """The float32 forms that TFLite's builtin operations can run (`moments.erfc`: Numerical
    Recipes' `erfcc` fit; `arcsin` through `arctan2`) against float64 references: `erfc`
    within 2e-6 relative error below 3 and 2e-5 out to 9 (the backend's own float32 `erfc` is
    no better: 1e-6 and 1.2e-5), within 5e-7 absolute for negative arguments; `arcsin` within
    float32 round-off on [-1, 1]. float64 keeps the exact functions."""
    x = np.linspace(-9.0, 9.0, 36001)
    exact = special.erfc(x)
    got = to_numpy(moments.erfc(keras.ops.convert_to_tensor(x, "float32"))).astype("float64")
    relative = np.abs(got - exact) / exact
    assert relative[(x >= 0) & (x < 3)].max() < 2e-6
    assert relative[x >= 0].max() < 2e-5
    assert np.abs(got - exact)[x < 0].max() < 5e-7  # two float32 steps at 2
    assert to_numpy(moments.erfc(keras.ops.convert_to_tensor(x, "float64"))).dtype == np.float64
    np.testing.assert_allclose(to_numpy(moments.erfc(keras.ops.convert_to_tensor(x, "float64"))), exact, rtol=1e-13)
    r = np.linspace(-1.0, 1.0, 20001).astype("float32")  # (the reference at the same rounded points)
    np.testing.assert_allclose(to_numpy(moments._arcsin(keras.ops.convert_to_tensor(r))), np.arcsin(r.astype("float64")),
                               atol=3e-7)
