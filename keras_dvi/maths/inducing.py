"""Pure maths of global inducing point posteriors (Ober & Aitchison, ICML 2021).

Functions of `keras.ops` tensors, shared by `keras_dvi.GlobalInducingDense` and the tests
Shapes: `S` samples, `M` inducing points, `P` input
features (bias column included), `U` output units.

For one layer with features `Phi` of the inducing points (`M x P`), pseudo-outputs `V`
(`M x U`), precisions `lambda` (`M`, or `M x U` per output unit) and prior `w ~ N(0, 1 / p)`
per weight (eq. 11):

    A = p I + Phi^T diag(lambda) Phi,   Sigma_w = A^{-1},   M_w = A^{-1} Phi^T diag(lambda) V.

A sample is `W = M_w + L^{-T} eps` with `A = L L^T` and `eps ~ N(0, I)`, so that
`(W - M_w)^T A (W - M_w) = eps^T eps` and `log N(W | M_w, Sigma_w)` needs no second solve.
"""

import math

import keras
import numpy as np
from keras import ops

_LOG_2PI = math.log(2.0 * math.pi)


def append_ones(features):
    """`[features, 1]`: the bias as one more input column (`(..., P - 1)` -> `(..., P)`)."""
    ones = ops.ones_like(features[..., :1])
    return ops.concatenate([features, ones], axis=-1)


#: The jitter added to `A`, in units of its trace times the machine epsilon (`precision_matrix`).
JITTER_EPS_TRACE = 4.0


def precision_matrix(phi, precision, prior_precision):
    """`A = p I + Phi^T diag(lambda) Phi`, plus `4 eps tr(A) I` (`eps` the dtype's machine
    epsilon).

    The jitter is the round-off of the Gram matrix itself: in float32 the product
    `Phi^T diag(lambda) Phi` is only known to about `eps` times its largest eigenvalue
    (`<= tr(A)`), so where large precisions meet a small (learned) prior precision `p` and
    directions the inducing features do not span, `A` can come out indefinite and its Cholesky
    factor NaN. The jitter lifts those directions above the round-off; the data-determined ones
    (eigenvalues near `tr(A)`) move by a relative `4 eps`. Every quantity of the posterior (its
    draws, density and KL) uses the same jittered `A`, so the ELBO stays a bound.

    Args:
        phi: `(S, M, P)` features of the inducing points.
        precision: `(M,)` shared precisions, or `(M, U)` one column per output unit.
        prior_precision: scalar `p` (the inverse prior variance of every weight), `(S,)`,
            one per sample (a `ScalePrior`'s draws), or `(S, P, P)`, a prior precision matrix
            per sample (a `SpatialIWPrior`'s draws): `A = Lambda_p + Phi^T diag(lambda) Phi`.

    Returns:
        `(S, P, P)` for shared precisions, `(S, U, P, P)` per unit.
    """
    size = phi.shape[-1]
    p = ops.cast(prior_precision, phi.dtype)
    per_unit = len(precision.shape) != 1
    if len(p.shape) == 3:  # a prior precision matrix per sample (SpatialIWPrior)
        eye = p[:, None] if per_unit else p
    else:
        if len(p.shape) == 1:  # one prior precision per sample: (S,) -> (S, 1, 1) or (S, 1, 1, 1)
            p = ops.reshape(p, (-1, 1, 1, 1) if per_unit else (-1, 1, 1))
        eye = ops.eye(size, dtype=phi.dtype) * p
    if not per_unit:
        weighted = phi * precision[:, None]  # (S, M, P)
        return _add_jitter(eye + ops.matmul(_transpose(weighted), phi))
    # (S, U, M, P): batched products are twice as fast as a three-operand einsum on CPU.
    weighted = phi[:, None] * ops.transpose(precision)[None, :, :, None]
    return _add_jitter(eye + ops.matmul(_transpose(weighted), phi[:, None]))


def _add_jitter(matrix):
    """`A + 4 eps tr(A) I` for a batch of square matrices (see `precision_matrix`)."""
    eps = float(np.finfo(keras.backend.standardize_dtype(matrix.dtype)).eps)
    trace = ops.sum(ops.diagonal(matrix, axis1=-2, axis2=-1), axis=-1)
    eye = ops.eye(matrix.shape[-1], dtype=matrix.dtype)
    return matrix + (JITTER_EPS_TRACE * eps) * trace[..., None, None] * eye


def _factor_and_half_mean(phi, precision, pseudo_outputs, prior_precision):
    """`L` (`A = L L^T`) and `L^{-1} Phi^T diag(lambda) V`, so that `M_w = L^{-T}` of it.

    The second is `(S, P, U)` for shared precisions and `(S, U, P, 1)` per unit (one system
    per output unit)."""
    chol = ops.cholesky(precision_matrix(phi, precision, prior_precision))
    if len(precision.shape) == 1:
        rhs = ops.einsum("smi,m,mu->siu", phi, precision, pseudo_outputs)
    else:
        rhs = ops.einsum("smi,mu->sui", phi, precision * pseudo_outputs)[..., None]
    return chol, ops.solve_triangular(chol, rhs, lower=True)


def _solve_upper(chol, half):
    """`L^{-T} half`, back in `(S, P, U)` layout."""
    solved = ops.solve_triangular(_transpose(chol), half, lower=False)
    if len(chol.shape) == 3:
        return solved
    return ops.transpose(solved[..., 0], (0, 2, 1))


def weight_posterior(phi, precision, pseudo_outputs, prior_precision):
    """Cholesky factor of `A` and the posterior mean `M_w` (eq. 11).

    Args:
        phi: `(S, M, P)` features of the inducing points (bias column included).
        precision: `(M,)` or `(M, U)` positive precisions `lambda`.
        pseudo_outputs: `(M, U)` pseudo-outputs `V`.
        prior_precision: scalar `p`.

    Returns:
        `(chol, mean)`: `chol` lower triangular `(S, P, P)` (shared) or `(S, U, P, P)` (per
        unit); `mean` `(S, P, U)`.
    """
    chol, half = _factor_and_half_mean(phi, precision, pseudo_outputs, prior_precision)
    return chol, _solve_upper(chol, half)


def sample_weights(chol, mean, noise):
    """`W = M_w + L^{-T} eps`: one weight matrix per sample, `(S, P, U)`.

    Args:
        chol: Cholesky factor of `A` from `weight_posterior`.
        mean: `(S, P, U)` posterior mean.
        noise: `(S, P, U)` standard normal draws `eps`.
    """
    return mean + _solve_upper(chol, _noise_layout(chol, noise))


def posterior_sample(phi, precision, pseudo_outputs, prior_precision, noise):
    """Cholesky factor of `A` and one weight draw per sample, without forming `M_w`.

    `W = M_w + L^{-T} eps = L^{-T} (L^{-1} Phi^T diag(lambda) V + eps)`: two triangular solves
    instead of the three of `weight_posterior` followed by `sample_weights` (eq. 11). Used by
    `GlobalInducingDense`, which needs only `L` and `W` (its KL is the Monte Carlo estimate
    `log_posterior_density - log_prior_density`).

    Args:
        phi: `(S, M, P)` features of the inducing points (bias column included).
        precision: `(M,)` or `(M, U)` positive precisions `lambda`.
        pseudo_outputs: `(M, U)` pseudo-outputs `V`.
        prior_precision: scalar `p`, or `(S,)` one per sample.
        noise: `(S, P, U)` standard normal draws `eps`.

    Returns:
        `(chol, weights)`: `chol` as in `weight_posterior`; `weights` `(S, P, U)`.
    """
    chol, half = _factor_and_half_mean(phi, precision, pseudo_outputs, prior_precision)
    return chol, _solve_upper(chol, half + _noise_layout(chol, noise))


def _noise_layout(chol, noise):
    """`(S, P, U)` draws in the layout of `_factor_and_half_mean`'s second output."""
    if len(chol.shape) == 3:
        return noise
    return ops.transpose(noise, (0, 2, 1))[..., None]


def log_posterior_density(chol, noise):
    """`log N(W | M_w, Sigma_w)` summed over the weights of a layer, per sample `(S,)`.

    Uses `(W - M_w)^T A (W - M_w) = eps^T eps` and `log det Sigma_w = -2 sum log diag L`.
    """
    units = noise.shape[-1]
    size = noise.shape[-2]
    log_diag = ops.log(ops.diagonal(chol, axis1=-2, axis2=-1))
    if len(chol.shape) == 3:
        log_det_half = units * ops.sum(log_diag, axis=-1)
    else:
        log_det_half = ops.sum(log_diag, axis=(-2, -1))
    quad = ops.sum(ops.square(noise), axis=(-2, -1))
    return -0.5 * quad + log_det_half - 0.5 * units * size * _LOG_2PI


def log_prior_density(weights, prior_precision):
    """`log N(W | 0, I / p)` summed over the weights of a layer, per sample `(S,)` (`p` a scalar
    or `(S,)`); for a precision matrix per sample `(S, P, P)`, `log N(w_u | 0, Lambda_p^{-1})`
    summed over the output units `u`."""
    p = ops.cast(prior_precision, weights.dtype)
    count = weights.shape[-2] * weights.shape[-1]
    if len(p.shape) == 3:
        quad = ops.sum(weights * ops.matmul(p, weights), axis=(-2, -1))
        log_det = 2.0 * ops.sum(ops.log(ops.diagonal(ops.cholesky(p), axis1=-2, axis2=-1)), axis=-1)
        return -0.5 * quad + 0.5 * weights.shape[-1] * log_det - 0.5 * count * _LOG_2PI
    quad = ops.sum(ops.square(weights), axis=(-2, -1))
    return -0.5 * p * quad + 0.5 * count * (ops.log(p) - _LOG_2PI)


def gaussian_kl_full(chol, mean, prior_precision):
    """Closed-form `KL(N(M_w, Sigma_w) || N(0, I / p))` summed over output units, `(S,)`.

    The oracle for the Monte Carlo KL `log Q(W) - log P(W)` (used in tests and diagnostics).
    """
    p = ops.cast(prior_precision, mean.dtype)
    size, units = mean.shape[-2], mean.shape[-1]
    inv_chol = _inverse_factor(chol)
    if len(chol.shape) == 3:
        trace = units * ops.sum(ops.square(inv_chol), axis=(-2, -1))
        log_det_sigma = -2.0 * units * ops.sum(ops.log(ops.diagonal(chol, axis1=-2, axis2=-1)), axis=-1)
    else:
        trace = ops.sum(ops.square(inv_chol), axis=(-3, -2, -1))
        log_det_sigma = -2.0 * ops.sum(ops.log(ops.diagonal(chol, axis1=-2, axis2=-1)), axis=(-2, -1))
    quad = ops.sum(ops.square(mean), axis=(-2, -1))
    count = size * units
    return 0.5 * (p * (trace + quad) - count - count * ops.log(p) - log_det_sigma)


def linear_output_moments(chol, mean, x_mean, x_second):
    """Mean and covariance of `f = W^T [x, 1]` for `W ~ N(M_w, Sigma_w)` (columns independent,
    `Sigma_w = A^{-1}` shared by the output units, or one per unit) and an independent Gaussian
    input `x ~ N(m, C)`:

        E f = M_w^T m~,   Cov f = M_w^T C~ M_w + diag_u(m~^T Sigma_u m~ + tr(Sigma_u C~)),

    with `m~ = [m, 1]` and `C~` `C` with a zero bias row and column (the law of total
    covariance over `x`; `GlobalInducingDenseDVI`).

    Args:
        chol: Cholesky factor of `A`: `(P, P)` (shared) or `(U, P, P)` (per unit).
        mean: `(P, U)` posterior mean `M_w` (bias row last).
        x_mean: `(B, P - 1)` input means.
        x_second: `(B, P - 1, P - 1)` input covariances, `(B, P - 1)` variances, or `None`
            (deterministic inputs).

    Returns:
        `(mean (B, U), covariance (B, U, U))`.
    """
    m = append_ones(x_mean)  # (B, P)
    out_mean = ops.matmul(m, mean)
    inv_chol = _inverse_factor(chol)
    sigma = ops.matmul(_transpose(inv_chol), inv_chol)  # (P, P) or (U, P, P)
    w = mean[:-1]  # the input rows of M_w: C~ has no bias row
    if len(sigma.shape) == 2:
        quad = ops.sum(ops.matmul(m, sigma) * m, axis=-1)[:, None]  # (B, 1): shared by the units
    else:
        quad = ops.transpose(ops.sum(ops.einsum("bi,uij->ubj", m, sigma) * m[None], axis=-1))  # (B, U)
    if x_second is None:
        cov = ops.zeros(ops.shape(out_mean)[:1] + (mean.shape[1], mean.shape[1]), dtype=mean.dtype)
        trace = 0.0
    elif len(x_second.shape) == 2:  # variances
        cov = ops.einsum("iu,bi,iv->buv", w, x_second, w)
        inner = sigma[:-1, :-1] if len(sigma.shape) == 2 else sigma[:, :-1, :-1]
        diag = ops.diagonal(inner, axis1=-2, axis2=-1)  # (P - 1,) or (U, P - 1)
        trace = ops.matmul(x_second, diag[:, None]) if len(diag.shape) == 1 else ops.matmul(x_second, ops.transpose(diag))
    else:
        cov = ops.matmul(ops.matmul(ops.transpose(w)[None], x_second), w[None])
        if len(sigma.shape) == 2:
            trace = ops.sum(x_second * sigma[None, :-1, :-1], axis=(-2, -1))[:, None]
        else:
            trace = ops.einsum("bij,uij->bu", x_second, sigma[:, :-1, :-1])
    noise = quad + trace  # (B, 1) or (B, U)
    units = mean.shape[1]
    return out_mean, cov + ops.eye(units, dtype=mean.dtype)[None] * noise[:, :, None]


def _inverse_factor(chol):
    """`L^{-1}` of lower triangular factors `L` (any leading axes)."""
    eye = ops.eye(chol.shape[-1], dtype=chol.dtype)
    return ops.solve_triangular(chol, ops.broadcast_to(eye, ops.shape(chol)), lower=True)


def _transpose(matrix):
    rank = len(matrix.shape)
    return ops.transpose(matrix, tuple(range(rank - 2)) + (rank - 1, rank - 2))
