"""Closed-form moment propagation: the pure mathematics behind every keras-dvi layer.

Everything here is a stateless function of tensors written with `keras.ops`, vectorised over
any leading batch axes. The layers in `keras_dvi.layers` only hold variables and call these
functions; tests check each function against an independent oracle (closed form, quadrature
or Monte Carlo).

Notation (Wu et al., ICLR 2019, Section 3; the documentation's mathematics page): a pre-activation
vector `a` is Gaussian with mean `m` and covariance `S`; `h = f(a)` is the activation.
`mu_j = m_j / sqrt(S_jj)`, `rho = S_jl / sqrt(S_jj S_ll)`, `rho_bar = sqrt(1 - rho^2)`.

Numerical design (tested at the edges):

* Moments are written in unnormalised form (`m`, `sqrt(S)`, `S_jl`), so `mu` only appears
  inside saturating functions (`phi`, `Phi`, `exp(-...)`). Clipping `mu` to +-`MU_MAX` is
  then exact to machine precision and the deterministic limit `S -> 0` is reached with finite
  values and gradients.
* Variances are floored at `VARIANCE_FLOOR` before their square root; correlations are clipped
  strictly inside (-1, 1) before `arcsin` and `sqrt(1 - rho^2)`.
* The 0/0 forms of the paper's correction at `rho -> 0` are evaluated by series, so a
  correlation of exactly zero (every layer after a deterministic input) has finite
  gradients.
* Covariances of activations are computed as sums of terms that vanish with the covariance
  (no `E[h_j h_l] - E[h_j] E[h_l]` cancellation), which matters in float32 for large means.
"""

import dataclasses
import math
import types
from collections.abc import Callable

import keras
import numpy as np
from keras import ops

# --------------------------------------------------------------------------------------------
# Constants and small helpers
# --------------------------------------------------------------------------------------------

#: Negative slope of `"leaky_relu"` (the default of `keras.activations.leaky_relu`).
LEAKY_SLOPE = 0.2
#: Methods for the cross moments of two units through a nonlinearity.
COVARIANCE_APPROXIMATIONS = ("paper", "exact")

#: Standardised means are clipped to +-MU_MAX: phi(60) underflows to 0 and Phi(60) == 1 in
#: float64, so clipping is exact.
MU_MAX = 60.0
#: Variances below this are treated as this (std 1e-6). The gradient of a correlation involves
#: std_j^3 std_l; with a smaller floor that product can be a float32 denormal, which XLA flushes
#: to zero (NaN gradients under jit_compile=True).
VARIANCE_FLOOR = 1e-12
_SQRT_2PI = math.sqrt(2.0 * math.pi)
_TWO_PI = 2.0 * math.pi
_SQRT_HALF = math.sqrt(0.5)


def _single_precision(dtype):
    return keras.backend.standardize_dtype(dtype) in ("float16", "bfloat16", "float32")


def _rho_eps(dtype):
    """How far correlations are kept from +-1 (and h, k from 0 in Owen's T)."""
    return 1e-6 if _single_precision(dtype) else 1e-10


def canonical_activation(activation):
    """Returns the canonical name of a supported activation, or raises `ValueError`.

    Args:
        activation: `None`, `"linear"`, `"relu"`, `"heaviside"`, `"leaky_relu"` (negative
            slope `LEAKY_SLOPE` = 0.2), `"relu6"` (`min(max(x, 0), 6)`), `"hard_silu"` (alias
            `"hard_swish"`, `x relu6(x + 3) / 6`), `"hard_sigmoid"` (`relu6(x + 3) / 6`), or the smooth
            `"silu"` (alias `"swish"`), `"gelu"` (exact, `x Phi(x)`), `"sigmoid"` and `"tanh"`
            (case-insensitive). Keras' activation functions of these names are accepted too.

    Returns:
        One of `ACTIVATIONS`.
    """
    if activation is None:
        return "linear"
    if callable(activation):
        activation = getattr(activation, "__name__", repr(activation))
    if isinstance(activation, str):
        name = _ALIASES.get(activation.lower(), activation.lower())
        if name in ACTIVATIONS:
            return name
    raise ValueError(
        f"Argument `activation` must be one of None, {', '.join(repr(a) for a in ACTIVATIONS)}: "
        f"only these have Gaussian moment rules in keras-dvi. Received: activation={activation!r}"
    )


def canonical_covariance_activation(activation, layer):
    """`canonical_activation` for a layer that propagates a full covariance (`DenseDVI`,
    `SkipDVI`): the activation must have a pairwise covariance (`COVARIANCE_ACTIVATIONS`)."""
    name = canonical_activation(activation)
    if _ACTIVATIONS[name].covariance is None:
        raise ValueError(
            f"Argument `activation` of {layer} must be one of {', '.join(map(repr, COVARIANCE_ACTIVATIONS))}: "
            f"{layer} propagates a full covariance, and {name!r} has no closed-form covariance between two "
            f"units here. Use the diagonal layer (DenseDiagDVI, SkipDiagDVI) for it. Received: activation={name!r}"
        )
    return name


def canonical_method(method):
    """Validates a `covariance_approximation` name (`"paper"` or `"exact"`)."""
    if isinstance(method, str) and method.lower() in COVARIANCE_APPROXIMATIONS:
        return method.lower()
    raise ValueError(
        "Argument `covariance_approximation` must be one of "
        f"{', '.join(repr(m) for m in COVARIANCE_APPROXIMATIONS)}. "
        f"Received: covariance_approximation={method!r}"
    )


def normal_pdf(x):
    """Standard normal density `phi(x)`."""
    return ops.exp(-0.5 * ops.square(x)) / _SQRT_2PI


#: Coefficients of the Chebyshev fit of `log(erfc(z) / t) + z^2`, `t = 1 / (1 + z / 2)`, in
#: powers of `t` (Press et al., Numerical Recipes, `erfcc`: fractional error below 1.2e-7).
_ERFC_FIT = (-1.26551223, 1.00002368, 0.37409196, 0.09678418, -0.18628806, 0.27886807, -1.13520398,
             1.48851587, -0.82215223, 0.17087277)


def _portable(x):
    """Whether `x` (float32 or float16) takes the portable forms of `erfc` and `arcsin` below:
    built from operations every runtime has, TFLite's builtin operations included, so that a
    keras-dvi model converts to TFLite. float64 keeps the backend's exact functions."""
    return keras.backend.standardize_dtype(x.dtype) != "float64"


def erfc(x):
    """The complementary error function. In float64 the backend's `ops.erfc`; in float32 and
    float16 the Chebyshev fit of Press et al. (Numerical Recipes, `erfcc`) from `exp`, products
    and sums, as accurate as TensorFlow's own float32 `erfc` (relative error within 2e-6 below
    3, tested) and converting to TFLite's builtin operations, which have no `erfc`."""
    if not _portable(x):
        return ops.erfc(x)
    upper = _erfc_fit(ops.abs(x))
    return ops.where(x >= 0, upper, 2.0 - upper)


def _erfc_of_nonnegative(z):
    """`erfc(z)` for `z >= 0` (`erfc`'s rule, without the reflection for negative arguments)."""
    return _erfc_fit(z) if _portable(z) else ops.erfc(z)


def _erfc_fit(z):
    """Numerical Recipes' `erfcc` fit of `erfc(z)`, `z >= 0`."""
    t = 1.0 / (1.0 + 0.5 * z)
    series = _ERFC_FIT[-1]
    for coefficient in _ERFC_FIT[-2::-1]:  # Horner's rule, 9 steps (not a loop over data)
        series = coefficient + t * series
    return t * ops.exp(series - ops.square(z))


def normal_cdf(x):
    """Standard normal distribution function `Phi(x)`, accurate in both tails."""
    return 0.5 * erfc(-x * _SQRT_HALF)


def normal_cdf_pair(x):
    """`(Phi(x), Phi(-x))`, both accurate in their tails, from one `erfc`: the smaller of the
    two is `Phi(-|x|)` and the other its complement (which is then at least 1/2)."""
    tail = 0.5 * _erfc_of_nonnegative(ops.abs(x) * _SQRT_HALF)
    rest = 1.0 - tail
    positive = x > 0
    return ops.where(positive, rest, tail), ops.where(positive, tail, rest)


def safe_exp(x, limit=60.0):
    """`exp(x)` for `x <= limit`, continued linearly (with matching slope) above it.

    Keeps losses and gradients finite for extreme log-variances (`exp(88)` overflows float32)
    while leaving every realistic value exact.
    """
    limit_value = math.exp(limit)
    clipped = ops.minimum(x, limit)
    return ops.exp(clipped) + limit_value * ops.maximum(x - limit, 0.0)


def _arcsin(x, cosine=None):
    """`arcsin` in the dtype of `x`. In float32 and float16, `arctan2(x, sqrt((1 - x)(1 + x)))`
    (the same function and derivative; TFLite's builtin operations have `atan2`, not `asin`);
    `cosine`, if given, is that square root already computed. Keras 3.15's JAX backend computes
    `ops.arcsin` of a float64 tensor in float32 (its result-type rule promotes to `floatx`),
    which loses the float64 accuracy near `|x| = 1` and made gradients infinite there; call JAX
    directly."""
    if _portable(x):
        return ops.arctan2(x, ops.sqrt((1.0 - x) * (1.0 + x)) if cosine is None else cosine)
    if keras.backend.backend() == "jax":
        import jax.numpy as jnp

        return jnp.arcsin(x)
    return ops.arcsin(x)


def _safe_std(variance):
    return ops.sqrt(ops.maximum(variance, VARIANCE_FLOOR))


def _standardise(mean, std):
    return ops.clip(mean / std, -MU_MAX, MU_MAX)


def _cdf_difference(a, b):
    """`Phi(a) - Phi(b)` computed from whichever tails are small (no cancellation)."""
    upper = a + b > 0
    return ops.where(upper, normal_cdf(-b) - normal_cdf(-a), normal_cdf(a) - normal_cdf(b))


def _coefficient_correlation(rho):
    """`rho` moved away from 0 by at most 1e-3 (float32) / 1e-6 (float64), for the paper's
    correction coefficients only, whose `rho -> 0` limits are 0/0 forms.

    The correction is multiplied by `rho^2`, so using this `rho` in its coefficients changes
    the covariance by less than 1e-9 while keeping values and gradients finite at `rho = 0`
    (every layer after a deterministic input); its prefactor uses the true `rho`.
    """
    tau = ops.cast(1e-3 if _single_precision(rho.dtype) else 1e-6, rho.dtype)
    return ops.where(ops.abs(rho) < tau, tau, rho)


def clip_correlation(rho):
    """Clips correlations strictly inside (-1, 1) (by 1e-6 in float32, 1e-10 in float64)."""
    eps = _rho_eps(rho.dtype)
    return ops.clip(rho, -1.0 + eps, 1.0 - eps)


# --------------------------------------------------------------------------------------------
# One unit through the activation (Table 1, diagonal): exact
# --------------------------------------------------------------------------------------------


def activation_moments(mean, variance, activation):
    """Mean and variance of `f(a)` for independent Gaussian units `a ~ N(mean, variance)`.

    Implements the exact one-unit moments of Wu et al. (2019), Table 1 / eq. (5) diagonal
    terms, for ReLU `E[h] = sqrt(S) SR(mu)` and Heaviside `E[h] = Phi(mu)`. The variance is
    returned directly (not as `E[h^2] - E[h]^2`), computed without cancellation, and is
    never negative.

    Args:
        mean: tensor of pre-activation means, any shape.
        variance: tensor of pre-activation variances (>= 0), same shape.
        activation: name accepted by `canonical_activation`.

    Returns:
        Tuple `(mean_h, variance_h)` with the shape of `mean`.
    """
    return get_activation(activation).moments(mean, variance)


def expected_derivative(mean, variance, activation):
    """`E[f'(a)]` for `a ~ N(mean, variance)`: the Stein's-lemma factor of skip connections.

    ReLU: `Phi(mu)`; Heaviside: `phi(mu) / sqrt(S)` (Appendix C.1; the paper's
    Appendix C.1 prints `1 / S`, which is dimensionally wrong); linear: 1; leaky ReLU:
    `a + (1 - a) Phi(mu)`.
    """
    return get_activation(activation).derivative(mean, variance)


def _relu_unit_statistics(mean, variance):
    """`(std, mu, phi(mu), Phi(mu), Phi(-mu), E[h], Var[h] / S)` of independent ReLU units: what
    their moments, slope and gradients share."""
    std = _safe_std(variance)
    mu = _standardise(mean, std)
    pdf = normal_pdf(mu)
    cdf, upper = normal_cdf_pair(mu)  # Phi(mu), Q = Phi(-mu)
    mean_h = std * pdf + mean * cdf
    # Var/S = Phi + mu^2 Phi Q + mu phi (Q - Phi) - phi^2: each term is accurate in both tails
    # (the leading 1 or the leading tail term dominates).
    ratio = ops.maximum(cdf + mu * (mu * cdf * upper + pdf * (upper - cdf)) - ops.square(pdf), 0.0)
    return std, mu, pdf, cdf, upper, mean_h, ratio


def _relu_unit_gradient(g_mean, g_var, g_slope, variance, statistics):
    """The gradient in `(mean, variance)` of `(E[h], Var[h], Phi(mu))` of ReLU units, against the
    upstream gradients `g_*` (`g_slope` `None`: the slope is not an output; see
    `_relu_moments_and_slope`); `statistics` is `_relu_unit_statistics`'."""
    std, mu, pdf, cdf, upper, mean_h, ratio = statistics
    pdf_over_std = pdf / std
    d_mean = g_mean * cdf + g_var * (2.0 * mean_h * upper)
    d_live_variance = g_mean * (0.5 * pdf_over_std) + g_var * (cdf - mean_h * pdf_over_std)
    if g_slope is not None:
        d_mean = d_mean + g_slope * pdf_over_std
        d_live_variance = d_live_variance - g_slope * (0.5 * mu / std) * pdf_over_std
    d_variance = ops.where(
        variance > VARIANCE_FLOOR, d_live_variance, g_var * ratio * ops.cast(variance >= 0.0, variance.dtype)
    )
    return d_mean, d_variance


@ops.custom_gradient
def _relu_moments_and_slope(mean, variance):
    """`(E[h], Var[h], E[f'(a)] = Phi(mu))` of `h = relu(a)`, with the closed-form gradient
    (a third of the operations of differentiating the forward pass): `dE/dm = Phi`,
    `dE/dS = phi / (2 sqrt(S))`; `dVar/dm = 2 E[h] Phi(-mu)`, `dVar/dS = Phi - E[h] phi / sqrt(S)`
    (Price's theorem: `dE[h^2]/dS = Phi`); `dPhi/dm = phi / sqrt(S)`, `dPhi/dS = -mu phi / (2 S)`.
    Where `S` is floored the gradient through `sqrt(S)` is zero, as for the forward pass's own
    derivative. Checked against finite differences in `tests/test_moments.py`."""
    statistics = _relu_unit_statistics(mean, variance)
    _, _, _, cdf, _, mean_h, ratio = statistics

    def grad(*upstream):
        if len(upstream) == 1:  # JAX passes the outputs' cotangents as one tuple
            upstream = upstream[0]
        g_mean, g_var, g_slope = (ops.zeros_like(mean) if g is None else g for g in upstream)
        return _relu_unit_gradient(g_mean, g_var, g_slope, variance, statistics)

    return (mean_h, ops.maximum(variance, 0.0) * ratio, cdf), grad


def _relu_moments(mean, variance):
    mean_h, var_h, _ = _relu_moments_and_slope(mean, variance)
    return mean_h, var_h


def activation_moments_and_slope(mean, variance, activation):
    """`(E[f(a)], Var[f(a)], E[f'(a)])` for independent Gaussian units: `activation_moments`
    and `expected_derivative` in one pass (ReLU's share its normal densities and gradient)."""
    entry = get_activation(activation)
    if entry.moments_and_slope is not None:
        return entry.moments_and_slope(mean, variance)
    mean_h, var_h = entry.moments(mean, variance)
    return mean_h, var_h, entry.derivative(mean, variance)


def _relu_derivative(mean, variance):
    return normal_cdf(_standardise(mean, _safe_std(variance)))


def _heaviside_moments(mean, variance):
    # Bernoulli(Phi(mu)).
    cdf, upper = normal_cdf_pair(_standardise(mean, _safe_std(variance)))
    return cdf, cdf * upper


def _heaviside_derivative(mean, variance):
    std = _safe_std(variance)
    return normal_pdf(_standardise(mean, std)) / std


def _leaky_relu_moments(mean, variance):
    # f = a x + (1 - a) relu(x): Var f = a^2 S + (1-a)^2 Var relu + 2 a (1-a) S Phi(mu),
    # using Cov(x, relu(x)) = S Phi(mu) (Stein's lemma).
    a = LEAKY_SLOPE
    mean_r, var_r = _relu_moments(mean, variance)
    slope = _relu_derivative(mean, variance)
    variance = ops.maximum(variance, 0.0)
    mean_h = a * mean + (1.0 - a) * mean_r
    return mean_h, a * a * variance + (1.0 - a) ** 2 * var_r + 2.0 * a * (1.0 - a) * variance * slope


#: The upper bound of `relu6` (Keras' `ReLU(max_value=6)`, MobileNets).
RELU6_BOUND = 6.0


def _relu6_moments_and_slope(mean, variance):
    """`(E[h], Var[h], E[f'(a)])` of `h = min(max(a, 0), 6)`, `a ~ N(m, S)`: with
    `alpha = -m / sqrt(S)`, `beta = (6 - m) / sqrt(S)` and `Z = Phi(beta) - Phi(alpha)` (the
    probability of the linear part, which is also `E[f'(a)]`), the truncated-normal moments of
    the three pieces. Taken about `c = clip(m, 0, 6)`, the point the mass concentrates at as
    `S -> 0`, so that the variance has no cancellation there:
    `E[h - c] = -c Phi(alpha) + (m - c) Z + sqrt(S) (phi(alpha) - phi(beta)) + (6 - c) Phi(-beta)`,
    `E[(h - c)^2] = c^2 Phi(alpha) + (m - c)^2 Z + 2 (m - c) sqrt(S) (phi(alpha) - phi(beta))
    + S (Z + alpha phi(alpha) - beta phi(beta)) + (6 - c)^2 Phi(-beta)`."""
    std = _safe_std(variance)
    top = RELU6_BOUND
    alpha, beta = _standardise(-mean, std), _standardise(top - mean, std)
    pdf_a, pdf_b = normal_pdf(alpha), normal_pdf(beta)
    below, above = normal_cdf(alpha), normal_cdf(-beta)
    inside = _cdf_difference(beta, alpha)
    centre = ops.clip(mean, 0.0, top)
    offset = mean - centre
    tails = std * (pdf_a - pdf_b)
    first = -centre * below + offset * inside + tails + (top - centre) * above
    second = (ops.square(centre) * below + ops.square(offset) * inside + 2.0 * offset * tails
              + ops.maximum(variance, 0.0) * (inside + alpha * pdf_a - beta * pdf_b)
              + ops.square(top - centre) * above)
    return centre + first, ops.maximum(second - ops.square(first), 0.0), inside


def _relu6_moments(mean, variance):
    mean_h, var_h, _ = _relu6_moments_and_slope(mean, variance)
    return mean_h, var_h


def _relu6_derivative(mean, variance):
    std = _safe_std(variance)  # P(0 < a < 6), without the moments
    return _cdf_difference(_standardise(RELU6_BOUND - mean, std), _standardise(-mean, std))


#: Where hard SiLU `x relu6(x + 3) / 6` changes piece (`keras.activations.hard_silu`,
#: MobileNetV3): 0 below `-HARD_SILU_KNOT`, `x (x + 3) / 6` between, `x` above.
HARD_SILU_KNOT = 3.0


def _hard_silu_moments_and_slope(mean, variance):
    """`(E[h], Var[h], E[f'(a)])` of hard SiLU `h = a relu6(a + 3) / 6`, `a ~ N(m, S)`, in closed
    form: with `a = m + s z`, each piece is a polynomial in `z` (the middle one
    `f(m) + d + f'(m) s z + s^2 z^2 / 6`, `d` its value at `m` less `f(m)`), so the moments are
    the truncated standard-normal moments `M_k = int z^k phi` over `(alpha, beta)`,
    `alpha = (-3 - m) / s`, `beta = (3 - m) / s` (`M_k = (k - 1) M_{k-2} + alpha^{k-1} phi(alpha)
    - beta^{k-1} phi(beta)`) and over the tails. Taken about `f(m)`, so that the variance has
    no cancellation as `S -> 0`. `E[f'] = ((2m + 3) / 6) M_0 + (s / 3) M_1 + Phi(-beta)`."""
    std = _safe_std(variance)
    knot = HARD_SILU_KNOT
    alpha, beta = _standardise(-knot - mean, std), _standardise(knot - mean, std)
    pdf_a, pdf_b = normal_pdf(alpha), normal_pdf(beta)
    below, above = normal_cdf(alpha), normal_cdf(-beta)
    m0 = _cdf_difference(beta, alpha)
    m1 = pdf_a - pdf_b
    m2 = m0 + alpha * pdf_a - beta * pdf_b
    m3 = 2.0 * m1 + ops.square(alpha) * pdf_a - ops.square(beta) * pdf_b
    m4 = 3.0 * m2 + alpha * ops.square(alpha) * pdf_a - beta * ops.square(beta) * pdf_b
    at_mean = ops.hard_silu(mean)
    d_low, d_mid, d_high = -at_mean, mean * (mean + knot) / 6.0 - at_mean, mean - at_mean
    b1, q = (2.0 * mean + knot) / 6.0 * std, ops.square(std) / 6.0  # the middle piece: d + b1 z + q z^2
    tail1 = pdf_b  # int_beta^inf z phi
    first = d_low * below + d_mid * m0 + b1 * m1 + q * m2 + d_high * above + std * tail1
    second = (ops.square(d_low) * below
              + ops.square(d_mid) * m0 + 2.0 * d_mid * b1 * m1 + (ops.square(b1) + 2.0 * d_mid * q) * m2
              + 2.0 * b1 * q * m3 + ops.square(q) * m4
              + ops.square(d_high) * above + 2.0 * d_high * std * tail1
              + ops.square(std) * (above + beta * pdf_b))
    slope = (2.0 * mean + knot) / 6.0 * m0 + std / 3.0 * m1 + above
    return at_mean + first, ops.maximum(second - ops.square(first), 0.0), slope


def _hard_sigmoid_moments_and_slope(mean, variance):
    """`(E[h], Var[h], E[f'(a)])` of the hard sigmoid `h = relu6(a + 3) / 6`
    (`keras.activations.hard_sigmoid`, MobileNetV3's gates): ReLU6's closed form at mean
    `m + 3`, scaled by 1/6 (the variance by 1/36)."""
    mean_h, var_h, slope = _relu6_moments_and_slope(mean + HARD_SILU_KNOT, variance)
    return mean_h / 6.0, var_h / 36.0, slope / 6.0


# --------------------------------------------------------------------------------------------
# Smooth activations (SiLU / swish, GELU, sigmoid, tanh): closed forms and quadrature
# --------------------------------------------------------------------------------------------

#: Gauss-Hermite nodes of the smooth activations' moments (probabilists' form, weights summing
#: to 1): `E[u(a)] ~ sum_i w_i u(m + sqrt(S) x_i)`.
SMOOTH_NODES = 20
_GH_NODES, _GH_WEIGHTS = np.polynomial.hermite_e.hermegauss(SMOOTH_NODES)
_GH_WEIGHTS = _GH_WEIGHTS / _GH_WEIGHTS.sum()
#: Below this pre-activation variance a smooth activation is smooth at the scale of the spread,
#: and its moments are quadrature of `f` itself, taken about `f(m)` (no cancellation as
#: `S -> 0`, exact at `S = 0`); at and above it, the closed form of a companion function plus
#: quadrature of the small, smooth difference (`_smooth_moments`).
SMOOTH_SWITCH = 0.25
#: The probit slope of the companions: `sigmoid(x) ~ Phi(LAMBDA x)` (equal slopes at 0).
PROBIT_SLOPE = math.sqrt(math.pi / 8.0)


def _gelu_closed(mean, variance):
    """`(E[f], Var[f], E[f'])` of `f(a) = a Phi(a)` (exact GELU), `a ~ N(m, S)`, in closed form.

    With `h = m / sqrt(1 + S)`, `c = E[phi(a)] = phi(h) / sqrt(1 + S)`: `E[f] = m Phi(h) + S c`
    and `E[f'] = Phi(h) + c m / (1 + S)` (Stein's lemma). `E[f^2] = E[a^2 G(a)]`, `G = Phi^2`,
    by Stein's lemma twice from `E[G] = Phi2(h, h; S / (1 + S))` (Owen's T),
    `E[Phi phi] = c Phi(k)`, `E[phi^2] = exp(-m^2 / (1 + 2S)) / (2 pi sqrt(1 + 2S))` and
    `E[a Phi phi] = c (m' Phi(k) + S' phi(k) sqrt((1 + S) / (1 + 2S)))`, where
    `k = m / sqrt((1 + S)(1 + 2S))`, `m' = m / (1 + S)`, `S' = S / (1 + S)`. The variance is
    `E[f^2] - E[f]^2`: accurate where `S` is not small against `E[f^2]` (`_smooth_moments`
    uses it from `SMOOTH_SWITCH` on)."""
    variance = ops.maximum(variance, 0.0)
    one_s, one_2s = 1.0 + variance, 1.0 + 2.0 * variance
    root_s = ops.sqrt(one_s)
    h = mean / root_s
    cdf_h, pdf_h = normal_cdf(h), normal_pdf(h)
    c = pdf_h / root_s
    k = mean / ops.sqrt(one_s * one_2s)
    cdf_k, pdf_k = normal_cdf(k), normal_pdf(k)
    rho = clip_correlation(variance / one_s)
    e_g = ops.square(cdf_h) + bivariate_normal_cdf_excess(h, h, rho)
    e_g1 = 2.0 * c * cdf_k  # E[G'], G' = 2 Phi phi
    e_pp = ops.exp(-ops.square(mean) / one_2s) / (_TWO_PI * ops.sqrt(one_2s))
    e_aPp = c * (mean / one_s * cdf_k + variance / one_s * pdf_k * ops.sqrt(one_s / one_2s))
    e_g2 = 2.0 * e_pp - 2.0 * e_aPp  # E[G''], G'' = 2 phi^2 - 2 a Phi phi
    e_a_g1 = mean * e_g1 + variance * e_g2
    e_a_g = mean * e_g + variance * e_g1
    e_a2_g = mean * e_a_g + variance * (e_g + e_a_g1)
    mean_f = mean * cdf_h + variance * c
    return mean_f, ops.maximum(e_a2_g - ops.square(mean_f), 0.0), cdf_h + c * mean / one_s


def _scaled_gelu_closed(mean, variance):
    """`_gelu_closed` of `g(x) = x Phi(lambda x) = gelu(lambda x) / lambda`, SiLU's companion."""
    lam = PROBIT_SLOPE
    mean_g, var_g, slope = _gelu_closed(lam * mean, lam * lam * variance)
    return mean_g / lam, var_g / (lam * lam), slope


def _probit_closed(mean, variance):
    """`(E[g], Var[g], E[g'])` of `g(x) = Phi(lambda x)`, the sigmoid's companion: with
    `h = lambda m / sqrt(1 + lambda^2 S)`, `E[g] = Phi(h)`,
    `Var[g] = Phi2(h, h; rho) - Phi(h)^2`, `rho = lambda^2 S / (1 + lambda^2 S)`,
    `E[g'] = lambda phi(h) / sqrt(1 + lambda^2 S)`."""
    lam2_s = PROBIT_SLOPE ** 2 * ops.maximum(variance, 0.0)
    root = ops.sqrt(1.0 + lam2_s)
    h = PROBIT_SLOPE * mean / root
    rho = clip_correlation(lam2_s / (1.0 + lam2_s))
    return (normal_cdf(h), ops.maximum(bivariate_normal_cdf_excess(h, h, rho), 0.0),
            PROBIT_SLOPE * normal_pdf(h) / root)


def _smooth_moments(function, derivative, companion, mean, variance):
    """`(E[f(a)], Var[f(a)], E[f'(a)])` of a smooth activation `f`, `a ~ N(m, S)`.

    Below `SMOOTH_SWITCH`: `SMOOTH_NODES`-point Gauss-Hermite quadrature of `f` about `f(m)`
    (`d_i = f(a_i) - f(m)`, `Var = sum w d^2 - (sum w d)^2`), exact at `S = 0`. From it on,
    where `f` bends within the spread: `f = g + r` with `companion = (g, closed)` a function
    whose moments have a closed form (a probit `Phi(lambda x)` or `x Phi(lambda x)`) and `r`
    small and smooth, so `E[f] = E[g] + E[r]`, `Var[f] = Var[g] + Var[r] + 2 Cov(g, r)`,
    `E[f'] = E[g'] + E[(a - m) r(a)] / S` (Stein's lemma: `r` is smoother than `r'`), the terms
    in `r` by the same quadrature (a control variate). The
    error against the exact integrals is tested in `tests/test_moments.py`."""
    g, closed = companion
    dtype = mean.dtype
    # (on the units flattened: the nodes' axis on a feature map would make 5-D tensors, which
    # TFLite's builtin operations did not take from JAX's export)
    shape = ops.shape(mean)
    mean, variance = ops.reshape(mean, (-1,)), ops.reshape(variance, (-1,))
    nodes = ops.convert_to_tensor(_GH_NODES, dtype=dtype)
    weights = ops.convert_to_tensor(_GH_WEIGHTS, dtype=dtype)
    variance = ops.maximum(variance, 0.0)
    std = _safe_std(variance)
    points = ops.expand_dims(mean, -1) + ops.expand_dims(std, -1) * nodes

    def expect(values):
        return ops.sum(values * weights, axis=-1)

    at_mean = function(mean)
    values = function(points)
    slopes = derivative(points)
    shifts = values - ops.expand_dims(at_mean, -1)
    shift = expect(shifts)
    near = (at_mean + shift, ops.maximum(expect(ops.square(shifts)) - ops.square(shift), 0.0), expect(slopes))
    companion_values = g(points)
    residual = values - companion_values
    residual_mean = expect(residual)
    residual_dev = residual - ops.expand_dims(residual_mean, -1)
    companion_dev = companion_values - ops.expand_dims(expect(companion_values), -1)
    mean_g, var_g, slope_g = closed(mean, variance)
    wide = (mean_g + residual_mean,
            ops.maximum(var_g + expect(residual_dev * (residual_dev + 2.0 * companion_dev)), 0.0),
            slope_g + expect(residual * nodes) / std)
    switch = variance >= SMOOTH_SWITCH
    return tuple(ops.reshape(ops.where(switch, w, n), shape) for w, n in zip(wide, near))


def _silu_derivative_at(x):
    s = ops.sigmoid(x)
    return s * (1.0 + x * (1.0 - s))


_SILU_COMPANION = (lambda x: x * normal_cdf(PROBIT_SLOPE * x), _scaled_gelu_closed)
_SIGMOID_COMPANION = (lambda x: normal_cdf(PROBIT_SLOPE * x), _probit_closed)


def _tanh_closed(mean, variance):
    """`(E[g], Var[g], E[g'])` of `g(x) = 2 Phi(2 lambda x) - 1`, tanh's companion (as
    `tanh(x) = 2 sigmoid(2x) - 1`): `_probit_closed` at `(2m, 4S)`, rescaled."""
    mean_g, var_g, slope_g = _probit_closed(2.0 * mean, 4.0 * variance)
    return 2.0 * mean_g - 1.0, 4.0 * var_g, 4.0 * slope_g


_TANH_COMPANION = (lambda x: 2.0 * normal_cdf(2.0 * PROBIT_SLOPE * x) - 1.0, _tanh_closed)


def _silu_moments_and_slope(mean, variance):
    """SiLU / swish `x sigmoid(x)` (EfficientNet): `_smooth_moments` with companion
    `x Phi(lambda x)`, `lambda = sqrt(pi / 8)`."""
    return _smooth_moments(lambda x: x * ops.sigmoid(x), _silu_derivative_at, _SILU_COMPANION, mean, variance)


def _sigmoid_moments_and_slope(mean, variance):
    """The logistic sigmoid (squeeze-and-excitation gates): `_smooth_moments` with companion
    `Phi(lambda x)`, `lambda = sqrt(pi / 8)`."""
    return _smooth_moments(ops.sigmoid, lambda x: ops.sigmoid(x) * (1.0 - ops.sigmoid(x)), _SIGMOID_COMPANION,
                           mean, variance)


def _tanh(x):
    """`tanh(x)`; in float64 from `expm1` and `exp`, to float64 precision on every backend
    (XLA's float64 `tanh` on a CPU is accurate to about 1e-7 only)."""
    if _portable(x):
        return ops.tanh(x)
    twice = -2.0 * ops.abs(x)
    return ops.sign(x) * -ops.expm1(twice) / (1.0 + ops.exp(twice))


def _tanh_moments_and_slope(mean, variance):
    """The hyperbolic tangent (recurrent and older dense networks): `_smooth_moments` with
    companion `2 Phi(2 lambda x) - 1`, `lambda = sqrt(pi / 8)`."""
    return _smooth_moments(_tanh, lambda x: 1.0 - ops.square(_tanh(x)), _TANH_COMPANION, mean, variance)


def _gelu_moments_and_slope(mean, variance):
    """Exact GELU `x Phi(x)` (`keras.activations.gelu(approximate=False)`): the closed form
    (`_gelu_closed`) from `SMOOTH_SWITCH` on, quadrature about `f(m)` below it (where the
    closed form's `E[f^2] - E[f]^2` would cancel); the companion is GELU itself, so the
    residual is zero."""
    gelu = lambda x: x * normal_cdf(x)  # noqa: E731
    return _smooth_moments(gelu, lambda x: normal_cdf(x) + x * normal_pdf(x), (gelu, _gelu_closed), mean, variance)


def _first_two(function):
    def moments_only(mean, variance):
        mean_h, var_h, _ = function(mean, variance)
        return mean_h, var_h

    return moments_only


def _third(function):
    return lambda mean, variance: function(mean, variance)[2]


# --------------------------------------------------------------------------------------------
# Two units through the activation (eqs. 6-7, Table 1 corrected)
# --------------------------------------------------------------------------------------------


def _paper_relu_covariance(mean_j, mean_l, std_j, std_l, cov_jl, rho, mu_j, mu_l):
    return _paper_relu_terms(cov_jl, rho, mu_j, mu_l, normal_cdf(mu_j), normal_cdf(mu_l))[0]


def _paper_relu_terms(cov_jl, rho, mu_j, mu_l, cdf_j, cdf_l):
    """The paper's ReLU covariance `S_jl Phi_j Phi_l + T` (corrected Table 1), and in a namespace
    the terms of it that its hand-written gradient reuses (`_relu_paper_covariance_matrix`).

    `T = std_j std_l (rho g / 2 pi) exp(-c1 (mu_j^2 + mu_l^2) + c2 mu_j mu_l)` with `g = rho G`,
    `G = arcsin(rho)/rho - 1/(1 + rho_bar)`, `c1 = 1/(2 G (1 + rho_bar))` and
    `c2 = (arcsin(rho) - rho)/(g rho) = (arcsin(rho)/rho - 1)/(rho G)` (note the minus sign in
    `g` and the factor `rho` in the prefactor). The coefficients take `rho_c`
    (`_coefficient_correlation`), the prefactor the true `rho`."""
    rho_c = _coefficient_correlation(rho)
    # rho_bar of rho_c (not rho) serves the arcsin too; they differ only where |rho| < 1e-3
    # (float32), by less than 5e-7, in a term multiplied by rho^2.
    rho_bar = ops.sqrt((1.0 - rho_c) * (1.0 + rho_c))
    one_plus_rho_bar = 1.0 + rho_bar
    asinc = _arcsin(rho_c, rho_bar) / rho_c
    g_over_rho = asinc - 1.0 / one_plus_rho_bar
    c1 = 0.5 / (g_over_rho * one_plus_rho_bar)
    c2 = (asinc - 1.0) / (rho_c * g_over_rho)
    mu_outer = mu_j * mu_l
    square_sum = ops.square(mu_j) + ops.square(mu_l)
    exp_e = ops.exp(c2 * mu_outer - c1 * square_sum)
    scaled = (g_over_rho / _TWO_PI) * exp_e  # (G / 2 pi) e^E
    cdf_outer = cdf_j * cdf_l
    # std_j std_l rho^2 == S_jl rho (rho clipped only where that makes no difference).
    correction = (cov_jl * rho) * scaled
    terms = types.SimpleNamespace(rho_c=rho_c, rho_bar=rho_bar, one_plus_rho_bar=one_plus_rho_bar, asinc=asinc,
                                  g_over_rho=g_over_rho, c1=c1, c2=c2, mu_outer=mu_outer, square_sum=square_sum,
                                  exp_e=exp_e, scaled=scaled, cdf_outer=cdf_outer, correction=correction)
    return cov_jl * cdf_outer + correction, terms


@ops.custom_gradient
def _relu_paper_covariance_matrix(mean, covariance):
    """`activation_covariance(mean, covariance, "relu", "paper")` in one pass, with its
    closed-form gradient.

    The forward pass is `activation_moments` on the diagonal and `_paper_relu_terms` off
    it, with each unit's `sqrt(S)`, `mu`, `phi` and `Phi` computed once (not once per row and
    column). The gradient differentiates the corrected Table 1 by hand: with
    `T = S_jl rho (G / 2 pi) e^E` the correction and `E = c2 mu_j mu_l - c1 (mu_j^2 + mu_l^2)`,
    `dC/dmu_j = S_jl phi_j Phi_l + T (c2 mu_l - 2 c1 mu_j)`,
    `dC/drho = S_jl e^E (G + rho (G' + G E')) / 2 pi` (`'` the derivative in the coefficients'
    correlation), `dC/dS_jl = Phi_j Phi_l + rho (G / 2 pi) e^E` at fixed `rho`, then the chain
    rule through `mu_j = m_j / sqrt(S_jj)` and `rho = S_jl / sqrt(S_jj S_ll)`; the diagonal's
    is `_relu_moments_and_slope`'s. Clipped and floored quantities pass no gradient, as autodiff
    of the forward pass gives. Half the graph operations of autodiff through the pairwise
    functions (`_pairwise_activation_covariance`), and a quarter to a half less time
    (`benchmarks/experiments/relu_covariance_gradient.py`); checked against that autodiff and
    against finite differences in `tests/test_moments.py`."""
    dtype = mean.dtype
    on_diagonal = _diagonal_mask(ops.shape(mean)[-1])
    variance = diagonal(covariance)
    statistics = _relu_unit_statistics(mean, variance)
    std, mu, pdf, cdf, _, mean_h, ratio = statistics
    var_h = ops.maximum(variance, 0.0) * ratio

    def row(x):  # unit j of the pair (j, l)
        return ops.expand_dims(x, -1)

    def col(x):  # unit l
        return ops.expand_dims(x, -2)

    std_outer = row(std) * col(std)
    rho_raw = covariance / std_outer
    rho = clip_correlation(rho_raw)
    off, t = _paper_relu_terms(covariance, rho, row(mu), col(mu), row(cdf), col(cdf))
    cov_h = ops.where(on_diagonal, row(var_h), off)

    def grad(*upstream):
        if len(upstream) == 1:  # JAX passes the outputs' cotangents as one tuple
            upstream = upstream[0]
        g_mean_h, g_cov_h = (ops.zeros_like(x) if g is None else g for g, x in zip(upstream, (mean_h, cov_h)))
        g_off = ops.where(on_diagonal, ops.zeros_like(g_cov_h), g_cov_h)
        # The diagonal (E[h], Var[h]): `_relu_moments_and_slope`'s gradient.
        d_mean, d_variance = _relu_unit_gradient(g_mean_h, diagonal(g_cov_h), None, variance, statistics)
        # Off the diagonal: the partial derivatives of C_jl in mu_j, mu_l, rho and S_jl, summed
        # against the upstream gradient (the mu's as products with vectors, not K x K passes):
        # sum_l g_jl dC_jl/dmu_j = phi_j (g S Phi)_j + (g T c2 mu)_j - 2 mu_j (g T c1 1)_j.
        g_s = g_off * covariance
        g_t = g_off * t.correction
        g_t_c1 = g_t * t.c1
        g_t_c2 = g_t * t.c2

        def by_rows(matrix, vector):  # sum_l matrix_jl vector_l
            return ops.squeeze(ops.matmul(matrix, ops.expand_dims(vector, -1)), -1)

        def by_columns(matrix, vector):  # sum_j vector_j matrix_jl
            return ops.squeeze(ops.matmul(ops.expand_dims(vector, -2), matrix), -2)

        g_mu = (pdf * (by_rows(g_s, cdf) + by_columns(g_s, cdf)) + by_rows(g_t_c2, mu) + by_columns(g_t_c2, mu)
                - 2.0 * mu * (ops.sum(g_t_c1, axis=-1) + ops.sum(g_t_c1, axis=-2)))
        # The coefficients' derivatives in rho_c: asinc' = (1/rho_bar - asinc)/rho_c, then G', c1', c2'.
        rho_c, rho_bar, one_plus_rho_bar = t.rho_c, t.rho_bar, t.one_plus_rho_bar
        d_asinc = (1.0 / rho_bar - t.asinc) / rho_c
        d_g = d_asinc - rho_c / (rho_bar * ops.square(one_plus_rho_bar))
        d_g_over_g = d_g / t.g_over_rho
        d_c1 = -t.c1 * (d_g_over_g - rho_c / (rho_bar * one_plus_rho_bar))
        d_c2 = d_asinc / (rho_c * t.g_over_rho) - t.c2 * (1.0 / rho_c + d_g_over_g)
        d_exponent = d_c2 * t.mu_outer - d_c1 * t.square_sum
        through_coefficients = ops.cast(ops.equal(rho_c, rho), dtype)  # 0 where rho_c was moved off 0
        by_rho = covariance * (t.scaled + through_coefficients * (rho * t.exp_e / _TWO_PI)
                               * (d_g + t.g_over_rho * d_exponent))
        # The chain rule: rho = clip(S_jl / (s_j s_l)), mu = clip(m / s), s = sqrt(max(S_jj, floor)).
        g_rho = g_off * by_rho * ops.cast(ops.abs(rho_raw) <= 1.0 - _rho_eps(dtype), dtype)
        d_covariance = g_off * (t.cdf_outer + rho * t.scaled) + g_rho / std_outer
        g_mu = g_mu * ops.cast(ops.abs(mu) < MU_MAX, dtype)  # mu = clip(m / s): none where clipped
        g_rho_rho = g_rho * rho
        g_std = -(g_mu * mu + ops.sum(g_rho_rho, axis=-1) + ops.sum(g_rho_rho, axis=-2)) / std
        d_mean = d_mean + g_mu / std
        d_variance = d_variance + ops.where(variance > VARIANCE_FLOOR, g_std * (0.5 / std), ops.zeros_like(g_std))
        return d_mean, d_covariance + diag_embed(d_variance)

    return (mean_h, cov_h), grad


def _paper_heaviside_covariance(rho, mu_j, mu_l):
    # Cov = (arcsin(rho) / 2 pi) exp(-(r / (2 rho_bar)) (mu_j^2 + mu_l^2)
    #                                 + (r rho / (rho_bar (1 + rho_bar))) mu_j mu_l),
    # r = rho / arcsin(rho) (even in rho, -> 1 as rho -> 0).
    rho_bar = ops.sqrt((1.0 - rho) * (1.0 + rho))  # (also the float32 arcsin's, below)
    rho_c = _coefficient_correlation(rho)
    r = rho_c / _arcsin(rho_c)
    exponent = (r / rho_bar) * (
        (rho / (1.0 + rho_bar)) * mu_j * mu_l - 0.5 * (ops.square(mu_j) + ops.square(mu_l))
    )
    return _arcsin(rho, rho_bar) / _TWO_PI * ops.exp(exponent)


# Gauss-Legendre rule on [0, 1] for Owen's T; 16 nodes give 1e-16 absolute error (tested
# against scipy.special.owens_t), since the integrand is analytic and, after the |a| > 1
# reflection, the interval has unit length.
_GL_NODES, _GL_WEIGHTS = (
    [float(v) for v in arr]
    for arr in (
        (np.polynomial.legendre.leggauss(16)[0] + 1.0) / 2.0,
        np.polynomial.legendre.leggauss(16)[1] / 2.0,
    )
)


def _owens_t_unit(h, a):
    """Owen's T for 0 <= a <= 1 by Gauss-Legendre quadrature of its defining integral."""
    nodes = ops.convert_to_tensor(_GL_NODES, dtype=h.dtype)
    weights = ops.convert_to_tensor(_GL_WEIGHTS, dtype=h.dtype)
    u = 1.0 + ops.square(ops.expand_dims(a, -1) * nodes)
    integrand = ops.exp(-0.5 * ops.expand_dims(ops.square(h), -1) * u) / u
    return a / _TWO_PI * ops.sum(weights * integrand, axis=-1)


def owens_t(h, a):
    """Owen's T function `T(h, a) = (1/2pi) int_0^a exp(-h^2 (1+x^2)/2) / (1+x^2) dx`.

    Backend-agnostic (`keras.ops`) and differentiable. For `|a| <= 1` a 16-point
    Gauss-Legendre rule; for `|a| > 1` Owen's (1956) reflection
    `T(h, a) = [Phi(h) Phi(-ah) + Phi(ah) Phi(-h)] / 2 - T(ah, 1/a)` (`h >= 0`); `T` is even
    in `h` and odd in `a`. Absolute error about 1e-16 in float64 (tested against
    `scipy.special.owens_t`), which is why `tfp.math.owens_t` (errors up to 6e-7 seen) is
    not used.
    """
    h = ops.abs(h)
    sign = ops.where(a < 0, -ops.ones_like(a), ops.ones_like(a))
    a = sign * a  # |a| with derivative 1 (not 0) at a = 0
    big = a > 1.0
    a_safe = ops.where(big, a, ops.ones_like(a))
    small_a = ops.where(big, 1.0 / a_safe, a)
    ah = a_safe * h
    # One quadrature serves both branches: T(h, a) directly, or T(ah, 1/a) for the reflection.
    unit = _owens_t_unit(ops.where(big, ah, h), small_a)
    reflected = 0.5 * (normal_cdf(h) * normal_cdf(-ah) + normal_cdf(ah) * normal_cdf(-h)) - unit
    return sign * ops.where(big, reflected, unit)


def bivariate_normal_cdf_excess(h, k, rho):
    """`Phi2(h, k; rho) - Phi(h) Phi(k)`, the covariance of two Heaviside units.

    Uses Owen's T (`owens_t`):
    `Phi2(h, k; rho) = Phi(h)/2 + Phi(k)/2 - T(h, a_h) - T(k, a_k) - beta`,
    evaluated on the side (`(h, k)` or `(-h, -k)`, which give the same excess) where the
    probabilities are small, so there is no cancellation. `h = 0` or `k = 0` is shifted by a
    negligible amount away from zero (`Phi2` is continuous there).

    Args:
        h: standardised means of the first variable, a tensor.
        k: standardised means of the second variable, broadcastable with `h`.
        rho: correlation, strictly inside (-1, 1) (see `clip_correlation`).

    Returns:
        The excess, shape of the broadcast inputs.
    """
    flip = h + k > 0
    h = ops.where(flip, -h, h)
    k = ops.where(flip, -k, k)
    eps = _rho_eps(h.dtype) * 1e-3
    h = h + eps * ops.where(h >= 0, ops.ones_like(h), -ops.ones_like(h))
    k = k + eps * ops.where(k >= 0, ops.ones_like(k), -ops.ones_like(k))
    rho_bar = ops.sqrt(1.0 - ops.square(rho))
    a_h = ops.clip((k - rho * h) / (h * rho_bar), -1e8, 1e8)
    a_k = ops.clip((h - rho * k) / (k * rho_bar), -1e8, 1e8)
    beta = ops.where(h * k > 0, ops.zeros_like(h), 0.5 * ops.ones_like(h))
    cdf_h = normal_cdf(h)
    cdf_k = normal_cdf(k)
    phi2 = 0.5 * cdf_h + 0.5 * cdf_k - owens_t(h, a_h) - owens_t(k, a_k) - beta
    return phi2 - cdf_h * cdf_k


def _exact_relu_covariance(mean_j, mean_l, std_j, std_l, cov_jl, rho, mu_j, mu_l):
    # Closed form of E[relu(a_j) relu(a_l)] minus E[h_j] E[h_l], regrouped
    # so that every bracket vanishes with the covariance:
    # Cov = m_j m_l D + S_jl Phi2 + m_j s_l phi_l (Phi(alpha_jl) - Phi_j)
    #       + m_l s_j phi_j (Phi(alpha_lj) - Phi_l) + s_j s_l (rho_bar e^{-q/2} - e^{-(mu_j^2+mu_l^2)/2}) / 2pi
    rho_bar = ops.sqrt(1.0 - ops.square(rho))
    excess = bivariate_normal_cdf_excess(mu_j, mu_l, rho)
    phi2 = excess + normal_cdf(mu_j) * normal_cdf(mu_l)
    alpha_jl = (mu_j - rho * mu_l) / rho_bar
    alpha_lj = (mu_l - rho * mu_j) / rho_bar
    q = (ops.square(mu_j) - 2.0 * rho * mu_j * mu_l + ops.square(mu_l)) / ops.square(rho_bar)
    last = rho_bar * ops.exp(-0.5 * q) - ops.exp(-0.5 * (ops.square(mu_j) + ops.square(mu_l)))
    return (
        mean_j * mean_l * excess
        + cov_jl * phi2
        + mean_j * std_l * normal_pdf(mu_l) * _cdf_difference(alpha_jl, mu_j)
        + mean_l * std_j * normal_pdf(mu_j) * _cdf_difference(alpha_lj, mu_l)
        + std_j * std_l * last / _TWO_PI
    )


def cross_covariance(mean_j, mean_l, var_j, var_l, cov_jl, activation, method="paper"):
    """`Cov(f(a_j), f(a_l))` for two jointly Gaussian units, elementwise with broadcasting.

    `method="paper"`: the asymptote plus Gaussian-shaped correction of Wu et al. (2019),
    eqs. (6)-(7), with the **corrected** Table 1 (the documentation's mathematics page; largest
    error in the normalised cross moment 0.0095 for ReLU, 0.060 for Heaviside). `method="exact"`: the
    bivariate normal closed form through Owen's T (no approximation).

    Args:
        mean_j: means of the first pre-activation.
        mean_l: means of the second pre-activation.
        var_j: variances of the first (>= 0).
        var_l: variances of the second (>= 0).
        cov_jl: their covariance.
        activation: one of `COVARIANCE_ACTIVATIONS` (`"linear"`, `"relu"`, `"heaviside"`,
            `"leaky_relu"`) or `None`.
        method: `"paper"` or `"exact"`.

    Returns:
        The covariance of the two activations, shape of the broadcast inputs. Correlations
        are clipped strictly inside (-1, 1) first.
    """
    entry = get_activation(activation)
    if entry.covariance is None:
        raise ValueError(f"Activation {entry.name!r} has no closed-form covariance between two units here; layers "
                         f"that propagate a full covariance take {', '.join(map(repr, COVARIANCE_ACTIVATIONS))} "
                         "(use the diagonal layers, DenseDiagDVI and the conv layers, for it).")
    return entry.covariance(mean_j, mean_l, var_j, var_l, cov_jl, canonical_method(method))


def _standardised_pair(mean_j, mean_l, var_j, var_l, cov_jl):
    std_j, std_l = _safe_std(var_j), _safe_std(var_l)
    rho = clip_correlation(cov_jl / (std_j * std_l))
    return std_j, std_l, rho, _standardise(mean_j, std_j), _standardise(mean_l, std_l)


def _linear_covariance(mean_j, mean_l, var_j, var_l, cov_jl, method):
    return cov_jl + ops.zeros_like(mean_j) + ops.zeros_like(mean_l)


def _relu_covariance(mean_j, mean_l, var_j, var_l, cov_jl, method):
    std_j, std_l, rho, mu_j, mu_l = _standardised_pair(mean_j, mean_l, var_j, var_l, cov_jl)
    fn = _paper_relu_covariance if method == "paper" else _exact_relu_covariance
    return fn(mean_j, mean_l, std_j, std_l, cov_jl, rho, mu_j, mu_l)


def _heaviside_covariance(mean_j, mean_l, var_j, var_l, cov_jl, method):
    _, _, rho, mu_j, mu_l = _standardised_pair(mean_j, mean_l, var_j, var_l, cov_jl)
    if method == "paper":
        return _paper_heaviside_covariance(rho, mu_j, mu_l)
    return bivariate_normal_cdf_excess(mu_j, mu_l, rho)


def _leaky_relu_covariance(mean_j, mean_l, var_j, var_l, cov_jl, method):
    # f = a x + (1 - a) relu(x); Cov(x_j, relu(x_l)) = S_jl Phi(mu_l) (Stein's lemma), so
    # only the ReLU-ReLU term needs the paper's approximation (or the exact form).
    a = LEAKY_SLOPE
    relu = _relu_covariance(mean_j, mean_l, var_j, var_l, cov_jl, method)
    slopes = _relu_derivative(mean_j, var_j) + _relu_derivative(mean_l, var_l)
    return a * a * cov_jl + a * (1.0 - a) * cov_jl * slopes + (1.0 - a) ** 2 * relu


def activation_covariance(mean, covariance, activation, method="paper"):
    """Mean and full covariance of `h = f(a)` for `a ~ N(mean, covariance)`.

    The diagonal is the exact variance of `activation_moments`; off-diagonal entries come
    from `cross_covariance` (Wu et al. 2019, eqs. 5-7, corrected Table 1, or `"exact"`). ReLU
    with `"paper"` (the layers' default) runs in one pass with a hand-written gradient.

    Args:
        mean: `(..., K)` pre-activation means.
        covariance: `(..., K, K)` symmetric positive semi-definite covariances.
        activation: `"linear"`, `"relu"` or `"heaviside"` (or `None`).
        method: `"paper"` or `"exact"`.

    Returns:
        `(mean_h (..., K), covariance_h (..., K, K))`.
    """
    entry = get_activation(activation)
    if entry.identity:
        return mean, covariance
    method = canonical_method(method)
    if method == "paper" and entry.paper_covariance_matrix is not None:
        return entry.paper_covariance_matrix(mean, covariance)
    return _pairwise_activation_covariance(mean, covariance, activation, method)


def _pairwise_activation_covariance(mean, covariance, activation, method):
    """`activation_covariance` assembled from `activation_moments` on the diagonal and
    `cross_covariance` for every pair off it (differentiated by autodiff)."""
    variance = diagonal(covariance)
    mean_h, var_h = activation_moments(mean, variance, activation)
    off = cross_covariance(
        ops.expand_dims(mean, -1),
        ops.expand_dims(mean, -2),
        ops.expand_dims(variance, -1),
        ops.expand_dims(variance, -2),
        covariance,
        activation,
        method,
    )
    # Replace the diagonal by the exact variances (one select, no pass to read the diagonal out).
    # The result is symmetric whenever `covariance` is: every formula is evaluated identically
    # for (j, l) and (l, j).
    return mean_h, ops.where(_diagonal_mask(ops.shape(mean)[-1]), ops.expand_dims(var_h, -1), off)


# --------------------------------------------------------------------------------------------
# Linear map with factorised Gaussian weights (eqs. 3-4)
# --------------------------------------------------------------------------------------------


def linear_moments(
    mean,
    kernel_mean,
    kernel_variance,
    bias_mean=None,
    bias_variance=None,
    variance=None,
    covariance=None,
    full_output=True,
):
    """Moments of `a = h W + b` with independent factorised Gaussian `W`, `b` and `h`.

    Wu et al. (2019), eqs. (3)-(4):
    `E[a] = E[h] M + b_m`, `Cov(a) = diag(E[h*h] V + b_v) + M^T Cov(h) M`.

    Give at most one of `variance` (diagonal `Cov(h)`) and `covariance` (full `Cov(h)`);
    with neither, `h` is deterministic and `Cov(a)` is diagonal.

    Args:
        mean: `(batch, in)` mean of `h` (or the deterministic input).
        kernel_mean: `(in, units)` posterior means `M`.
        kernel_variance: `(in, units)` posterior variances `V` (>= 0).
        bias_mean: `(units,)` or `None` (no bias).
        bias_variance: `(units,)` or `None`.
        variance: `(batch, in)` variances of `h`, or `None`.
        covariance: `(batch, in, in)` covariances of `h`, or `None`.
        full_output: `True` for the `(batch, units, units)` covariance; `False` for the
            `(batch, units)` variances only (the paper's dDVI, exact diagonal).

    Returns:
        `(mean_a, second_a, is_diagonal)`: `second_a` is the `(batch, units, units)`
        covariance when `is_diagonal` is `False`, else the `(batch, units)` variances. The
        output is diagonal when `full_output=False` or when `h` is deterministic (units are
        then independent, exactly).
    """
    mean_a = ops.matmul(mean, kernel_mean)
    second = ops.square(mean)
    if variance is not None:
        second = second + variance
    elif covariance is not None:
        second = second + diagonal(covariance)
    var_a = ops.matmul(second, kernel_variance)
    if bias_mean is not None:
        mean_a = mean_a + bias_mean
    if bias_variance is not None:
        var_a = var_a + bias_variance
    if variance is None and covariance is None:
        return mean_a, var_a, True
    if not full_output:
        if variance is not None:
            var_a = var_a + ops.matmul(variance, ops.square(kernel_mean))
        else:
            projected = ops.matmul(covariance, kernel_mean)  # (batch, in, units)
            var_a = var_a + ops.sum(projected * kernel_mean, axis=-2)
        return mean_a, var_a, True
    if variance is not None:
        # M^T diag(v) M = (M * v)^T M: O(batch in units^2), no (in, in) matrices.
        scaled = ops.expand_dims(variance, -1) * kernel_mean  # (batch, in, units)
        cov_a = ops.matmul(ops.transpose(kernel_mean), scaled)  # M^T (v M): (batch, units, units)
    else:
        projected = ops.matmul(covariance, kernel_mean)  # (batch, in, units)
        cov_a = ops.matmul(ops.transpose(kernel_mean), projected)  # M^T S M
    cov_a = cov_a + diag_embed(var_a)
    return mean_a, cov_a, False



# --------------------------------------------------------------------------------------------
# Sums and concatenations of Gaussian vectors (`keras.layers.Add`, `Concatenate`)
# --------------------------------------------------------------------------------------------


def _as_covariance(mean, second):
    """`second` (`None`: deterministic, `(..., K)` variances or `(..., K, K)` covariances) as a
    covariance matrix."""
    if second is None:
        return diag_embed(ops.zeros_like(mean))
    return second if len(second.shape) == len(mean.shape) + 1 else diag_embed(second)


def _is_full(mean, second):
    return second is not None and len(second.shape) == len(mean.shape) + 1


def add_moments(first, second):
    """Moments of the sum of two independent Gaussian vectors: means and (co)variances add,
    exact for independent inputs (a residual sum `x + f(x)` is not: its branches correlate).

    Args:
        first, second: `(mean (..., K), second)` each, `second` `None` (deterministic),
            `(..., K)` variances or `(..., K, K)` covariances.

    Returns:
        `(mean, second)`: covariances if either input has them, else variances (`None` if
        both inputs are deterministic).
    """
    (mean_1, second_1), (mean_2, second_2) = first, second
    if _is_full(mean_1, second_1) or _is_full(mean_2, second_2):
        return mean_1 + mean_2, _as_covariance(mean_1, second_1) + _as_covariance(mean_2, second_2)
    seconds = [s for s in (second_1, second_2) if s is not None]
    return mean_1 + mean_2, (None if not seconds else seconds[0] if len(seconds) == 1 else seconds[0] + seconds[1])


def concatenate_moments(parts):
    """Moments of independent Gaussian vectors joined along their last axis: exact (the
    covariance is block diagonal).

    Args:
        parts: a list of `(mean (..., K_i), second)`, `second` as in `add_moments`.

    Returns:
        `(mean (..., sum K_i), second)`: the block-diagonal covariances if any input has
        covariances, else the variances (deterministic parts: zero; `None` if all are).
    """
    mean = ops.concatenate([m for m, _ in parts], axis=-1)
    if all(s is None for _, s in parts):
        return mean, None
    if not any(_is_full(m, s) for m, s in parts):
        return mean, ops.concatenate([ops.zeros_like(m) if s is None else s for m, s in parts], axis=-1)
    sizes = [int(m.shape[-1]) for m, _ in parts]
    leading = [[0, 0]] * (len(mean.shape) - 1)
    rows = [ops.pad(_as_covariance(m, s), leading + [[0, 0], [sum(sizes[:i]), sum(sizes[i + 1:])]])
            for i, (m, s) in enumerate(parts)]  # each part's rows, zero outside its block
    return mean, ops.concatenate(rows, axis=-2)


def layer_norm_moments(mean, second, epsilon, shared=None, center=True):
    """Moments of layer normalisation over the last axis of Gaussian units,
    `y = (x - x_bar) / sqrt(s^2 + epsilon)` with `x_bar`, `s^2` the mean and the (biased)
    variance of the `C` units of `x` (`keras.layers.LayerNormalization(axis=-1)` before its
    per-unit scale and shift, which are exact: `conv_moments.channel_affine_moments`).

    The centring `x - x_bar` is linear: exact. The normaliser `s^2` is a statistic of the
    random units themselves. It is taken at its expectation `S = mean(m~^2) + tr(Cov(x~)) / C`
    (`m~` the centred means) and the map is linearised about the means (the delta method):
    `J = r (I - a a^T / C)`, `r = (S + epsilon)^(-1/2)`, `a = r m~`. So the output mean is
    `a` and the covariance `J Cov(x~) J^T`. Exact when the variances
    vanish (the plain layer's function); with many units the statistic concentrates and the
    rule is accurate: against Monte Carlo through Keras' layer, for inputs from nearly
    deterministic to pure noise, variances 0.87-1.05 of Monte Carlo's and means within 0.05
    standard deviations with 32 units or more; 0.79-1.11 and 0.14 with 8
    (`tests/test_layer_normalization.py`).

    Args:
        mean: `(..., C)`.
        second: `(..., C)` variances of independent units, or `(..., C, C)` covariances.
        epsilon: added to the normaliser, as in Keras.
        shared: `(..., C)` shared components of a feature map's units
            (`keras_dvi.maths.conv_moments`; each channel's factor is independent of the
            others'), or `None`. The output's component on channel `c`'s factor is
            `r s (1 - (1 + a^2) / C)`, the linearised map's.
        center: `False` for RMS normalisation, `y = x / sqrt(mean(x^2) + epsilon)`
            (`keras.layers.RMSNormalization` before its scale): no centring, the statistic
            `S = mean(m^2) + tr(Cov(x)) / C`, `J = r (I - a a^T / C)` with `a = r m`, and the
            shared factor `r s (1 - a^2 / C)`.

    Returns:
        `(mean, second)`, or `(mean, variance, shared)` when `shared` is given.
    """
    units = int(mean.shape[-1])
    centred = mean - ops.mean(mean, axis=-1, keepdims=True) if center else mean
    full = len(second.shape) == len(mean.shape) + 1
    if full and center:  # P Cov P, P = I - 1 1^T / C
        rows = ops.mean(second, axis=-1)
        second = (second - ops.expand_dims(rows, -1) - ops.expand_dims(rows, -2)
                  + ops.mean(rows, axis=-1)[..., None, None])
        spread = diagonal(second)
    elif full:
        spread = diagonal(second)
    else:
        spread = centred_spread(second, units, _unit_sum) if center else second
    statistic = ops.mean(ops.square(centred) + spread, axis=-1, keepdims=True)
    rate = ops.rsqrt(statistic + epsilon)
    a = centred * rate
    if full:  # r^2 (Cov~ - (a u^T + u a^T) / C + a a^T (a . u) / C^2), u = Cov~ a
        u = ops.squeeze(ops.matmul(second, ops.expand_dims(a, -1)), -1)
        quadratic = ops.sum(a * u, axis=-1)[..., None, None]
        outer = lambda x, y: ops.expand_dims(x, -1) * ops.expand_dims(y, -2)  # noqa: E731
        out = ops.expand_dims(ops.square(rate), -1) * (
            second - (outer(a, u) + outer(u, a)) / units + outer(a, a) * quadratic / units**2)
    else:
        out = normalised_diagonal(second, spread, a, rate, units, _unit_sum, center)
    if shared is None:
        return a, out
    return a, out, shared * rate * (1.0 - ((1.0 if center else 0.0) + ops.square(a)) / units)


def _unit_sum(t):
    """The sum over the last axis, kept."""
    return ops.sum(t, axis=-1, keepdims=True)


def centred_spread(variance, units, total):
    """The variances of independent units after their mean over `units` of them is subtracted,
    `v (1 - 2 / n) + sum(v) / n^2` (`total`: the sum over the normalised units, kept): the
    diagonal of `P diag(v) P`, `P = I - 1 1^T / n`."""
    return variance * (1.0 - 2.0 / units) + total(variance) / units**2


def normalised_diagonal(variance, spread, a, rate, units, total, center=True):
    """The delta method's variances of a normalisation of `units` independent units with
    variances `variance` (after centring: `spread`, `centred_spread`): the diagonal of
    `J Cov~ J^T`, `J = r (I - a a^T / n)`, `Cov~ = P diag(v) P` (`P = I` without centring),
    `r^2 (v~ - 2 a u / n + a^2 (a . u) / n^2)` with `u = Cov~ a = P (v a)`. `total`: the sum over
    the normalised units, kept (`layer_norm_moments`: a position's channels;
    `conv_moments.group_norm_moments`: a group's channels and positions)."""
    va = variance * a
    u = va - total(va) / units if center else va
    return ops.square(rate) * (spread - 2.0 * a * u / units + ops.square(a) * total(va * a) / units**2)


def diag_embed(variance):
    """`(..., K)` variances to `(..., K, K)` diagonal covariance matrices."""
    units = ops.shape(variance)[-1]
    return ops.expand_dims(variance, -1) * ops.eye(units, dtype=variance.dtype)


def diagonal(matrix):
    """The diagonal `(..., K)` of `(..., K, K)` matrices: the sum of each row with its
    off-diagonal entries masked out, exact (TFLite's builtin operations have no op taking a
    diagonal, and `where` keeps an infinite off-diagonal entry out of the sum)."""
    return ops.sum(ops.where(_diagonal_mask(ops.shape(matrix)[-1]), matrix, ops.zeros_like(matrix)), axis=-1)


def _diagonal_mask(units):
    """`(units, units)` booleans, true on the diagonal."""
    return ops.cast(ops.eye(units), "bool")


# --------------------------------------------------------------------------------------------
# The activations: one entry each
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Activation:
    """Everything keras-dvi computes for one activation `f`; adding an activation is adding
    one entry to `_ACTIVATIONS`.

    Attributes:
        name: the name layers accept and save (`activation="relu"`).
        apply: `f(x)`, elementwise (weight sampling, skip connections).
        moments: `(mean, variance) -> (E[f(a)], Var[f(a)])` for independent Gaussian units
            (default: the first two of `moments_and_slope`).
        derivative: `(mean, variance) -> E[f'(a)]` (Stein's lemma; default: the third of
            `moments_and_slope`).
        covariance: `(mean_j, mean_l, var_j, var_l, cov_jl, method) -> Cov(f(a_j), f(a_l))`
            for `method` `"paper"` or `"exact"`, or `None` where keras-dvi has no closed form
            (the activation then serves the layers with diagonal moments only).
        identity: whether `f` is the identity (moments pass through unchanged).
        moments_and_slope: `(mean, variance) -> (E[f(a)], Var[f(a)], E[f'(a)])` in one pass
            (shared densities, pieces or quadrature), or `None`: `activation_moments_and_slope`
            then combines `moments` and `derivative`.
        bounded: whether `f` is bounded (Heaviside, ReLU6, the sigmoids). After depthwise
            convolutions block after block an unbounded nonlinear `f` makes the moments fall
            far short of Monte Carlo's (EfficientNets; `keras_dvi.convert` warns).
        paper_covariance_matrix: `(mean, covariance) -> (mean_h, covariance_h)`,
            `activation_covariance` with `"paper"` for whole matrices in one pass (a
            hand-written gradient), or `None`: it is then assembled pair by pair.
    """

    name: str
    apply: Callable
    moments: Callable | None = None
    derivative: Callable | None = None
    covariance: Callable | None = None
    identity: bool = False
    moments_and_slope: Callable | None = None
    bounded: bool = False
    paper_covariance_matrix: Callable | None = None

    def __post_init__(self):
        if self.moments_and_slope is not None:  # frozen: fill the parts through object.__setattr__
            if self.moments is None:
                object.__setattr__(self, "moments", _first_two(self.moments_and_slope))
            if self.derivative is None:
                object.__setattr__(self, "derivative", _third(self.moments_and_slope))
        if self.moments is None or self.derivative is None:
            raise ValueError(f"Activation {self.name!r} needs `moments` and `derivative`, or `moments_and_slope`.")


_ACTIVATIONS = {
    a.name: a
    for a in (
        Activation("linear", lambda x: x, lambda m, v: (m, v), lambda m, v: ops.ones_like(m),
                   _linear_covariance, identity=True),
        Activation("relu", ops.relu, _relu_moments, _relu_derivative, _relu_covariance,
                   moments_and_slope=_relu_moments_and_slope, paper_covariance_matrix=_relu_paper_covariance_matrix),
        Activation("heaviside", lambda x: ops.cast(x > 0, x.dtype), _heaviside_moments,
                   _heaviside_derivative, _heaviside_covariance, bounded=True),
        Activation("leaky_relu", lambda x: ops.leaky_relu(x, negative_slope=LEAKY_SLOPE),
                   _leaky_relu_moments,
                   lambda m, v: LEAKY_SLOPE + (1.0 - LEAKY_SLOPE) * _relu_derivative(m, v),
                   _leaky_relu_covariance),
        Activation("relu6", ops.relu6, _relu6_moments, _relu6_derivative, moments_and_slope=_relu6_moments_and_slope,
                   bounded=True),
        Activation("hard_silu", ops.hard_silu, moments_and_slope=_hard_silu_moments_and_slope),
        Activation("hard_sigmoid", ops.hard_sigmoid, moments_and_slope=_hard_sigmoid_moments_and_slope, bounded=True),
        Activation("silu", ops.silu, moments_and_slope=_silu_moments_and_slope),
        Activation("gelu", lambda x: ops.gelu(x, approximate=False), moments_and_slope=_gelu_moments_and_slope),
        Activation("sigmoid", ops.sigmoid, moments_and_slope=_sigmoid_moments_and_slope, bounded=True),
        Activation("tanh", ops.tanh, moments_and_slope=_tanh_moments_and_slope, bounded=True),
    )
}
#: Activations whose pairwise covariance has a closed form here (`DenseDVI`'s full covariance).
COVARIANCE_ACTIVATIONS = tuple(name for name, a in _ACTIVATIONS.items() if a.covariance is not None)
#: Other names of the activations (Keras' `"swish"` is SiLU, `"hard_swish"` hard SiLU).
_ALIASES = {"swish": "silu", "hard_swish": "hard_silu"}
#: Activations with Gaussian moment rules. `None` and `"linear"` mean the identity.
ACTIVATIONS = tuple(_ACTIVATIONS)


def get_activation(activation):
    """The `Activation` entry of `activation` (any form `canonical_activation` accepts)."""
    return _ACTIVATIONS[canonical_activation(activation)]
