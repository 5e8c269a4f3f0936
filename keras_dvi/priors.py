"""Priors over the weights of keras-dvi layers, as KL regularisers.

Attach one prior to every layer of a network with `regularizer=`: it says how many training
examples there are (`num_train`) and how the KL enters the objective (`kl_weight`,
`kl_warmup_steps`; see `keras_dvi.objective`). Each layer adds `w_t * KL(q || p) / num_train`
to the model's losses, separately for its kernel and its bias (one weight set each), so that
what `model.fit` minimises after the warm-up is `-ELBO / N` (with `kl_weight = 1`) when the
likelihood loss is averaged per example. The closed-form priors' default `kl_weight="auto"`
keeps that ELBO for regression and weighs a classifier's KL `min(1, N / P)` for its `P`
weights (`auto_kl_weight`); `keras_dvi.objective.describe(model)` states which.

`EmpiricalBayesRegularizer` is the paper's hierarchical prior (Wu et al., ICLR 2019, eqs.
10-13): each weight set `lambda` has prior `N(0, s_lambda)` with `s_lambda ~ InvGamma(alpha,
beta)`, and `s_lambda` is set to its optimum given the posterior,
`s* = (sum_i (v_i + mu_i^2) + 2 beta) / (Omega + 2 alpha + 2)`, recomputed at every step with
gradients flowing through it. As in the original code, the hyperprior's log density is not
added to the objective. `GaussianPriorRegularizer` is a fixed `N(0, variance)` prior (the
paper's "DVI-fixed" ablation). `ScalePriorRegularizer` is the `ScalePrior` of Ober & Aitchison
(ICML 2021): a Gamma prior on each weight set's precision scale, with its KL counted.
"""

import math

import keras
import numpy as np
from keras import ops

from keras_dvi import validation


def gaussian_kl(mean, variance, prior_variance):
    """`sum_i KL(N(mean_i, variance_i) || N(0, prior_variance))` (Wu et al. 2019, eq. 12)."""
    prior_variance = ops.cast(prior_variance, mean.dtype)
    ratio = (variance + ops.square(mean)) / prior_variance
    return 0.5 * ops.sum(ops.log(prior_variance) - ops.log(variance) - 1.0 + ratio)


def log_gamma(x):
    """`log Gamma(x)` for `x > 0` in `keras.ops` (differentiable; `keras.ops` has no `lgamma`):
    the recursion `lgamma(x) = lgamma(x + 6) - log(x (x + 1) ... (x + 5))` and Stirling's series
    at `z = x + 6 >= 6`, whose first omitted term is below 1e-10 there."""
    x = ops.convert_to_tensor(x)
    shift = sum(ops.log(x + float(k)) for k in range(6))  # log x (x + 1) ... (x + 5), no overflow
    z = x + 6.0
    inv, inv2 = 1.0 / z, 1.0 / ops.square(z)
    series = inv * (1.0 / 12.0 - inv2 * (1.0 / 360.0 - inv2 * (1.0 / 1260.0 - inv2 / 1680.0)))
    return (z - 0.5) * ops.log(z) - z + 0.5 * math.log(2.0 * math.pi) + series - shift


def gamma_log_density(x, shape, rate):
    """`log Gamma(x; shape, rate)` (shape and rate parameterisation), elementwise."""
    return shape * ops.log(rate) + (shape - 1.0) * ops.log(x) - rate * x - log_gamma(shape)


#: Default KL warm-up: planned from the run (see `KLSettings` and `auto_kl_warmup_steps`).
DEFAULT_KL_WARMUP_STEPS = "auto"
#: `"auto"`: the share of the training steps `fit` plans over which the KL weight rises ...
AUTO_KL_WARMUP_FRACTION = 0.75
#: ... and its longest length, also its length when the run's length is unknown.
AUTO_KL_WARMUP_MAX_STEPS = 3000


def auto_kl_warmup_steps(planned_steps):
    """The length of an `"auto"` KL warm-up for a run of `planned_steps` training steps (`None`:
    unknown): `AUTO_KL_WARMUP_FRACTION` of the run (three quarters, rounded up), at least 1 step
    and at most `AUTO_KL_WARMUP_MAX_STEPS` (3,000), so that every run ends on the full
    objective, with at least a quarter of it trained there; the maximum when the length is
    unknown. (The fraction was chosen on validation rows; BENCHMARKS.md has the ablation.)"""
    if planned_steps is None:
        return AUTO_KL_WARMUP_MAX_STEPS
    return max(1, min(AUTO_KL_WARMUP_MAX_STEPS, math.ceil(AUTO_KL_WARMUP_FRACTION * planned_steps)))


#: `kl_weight="auto"`: the KL weight `min(1, N / P)` (see `auto_kl_weight`).
AUTO_KL_WEIGHT = "auto"
#: The default `kl_weight` of the closed-form priors (`PriorRegularizer`): the rule, `"auto"`.
DEFAULT_KL_WEIGHT = AUTO_KL_WEIGHT


def auto_kl_weight(num_train, num_weights):
    """The rule of `kl_weight="auto"` for a classifier: `min(1, N / P)` for `N` training
    examples and a network of `P` weights under keras-dvi priors (kernels and biases).

    While the network has at least as many training examples as weights it is the ELBO
    (weight 1). With more weights than examples the full ELBO's KL, which grows with `P`,
    outweighs a categorical likelihood, which can gain at most `log C` nats per example, and a
    mean-field classifier is pulled back to its prior (BENCHMARKS.md); the rule weighs the KL
    as if there were one training example per weight: a tempered posterior, stated. A
    regression likelihood has no such bound, and `"auto"` keeps the ELBO there
    (`keras_dvi.objective.resolved_kl_weight`)."""
    return min(1.0, float(num_train) / max(1, int(num_weights)))


def _kl_weight(value, allow_auto):
    if isinstance(value, str) and value == AUTO_KL_WEIGHT and allow_auto:
        return value
    if isinstance(value, str):
        raise ValueError(
            "Argument `kl_weight` must be a positive number"
            + (" or 'auto' (a classifier: min(1, num_train / number of weights); else 1)" if allow_auto else
               " (the 'auto' rule applies to the closed-form priors of DVI and MCVI layers only)")
            + f"; received kl_weight={value!r}."
        )
    return validation.positive_number("kl_weight", value)


def _kl_warmup_steps(value):
    if isinstance(value, str) and value == "auto":
        return value
    return validation.non_negative_integer(
        "kl_warmup_steps", value,
        " or 'auto' (training steps over which the KL weight rises from 0; 0: no warm-up; 'auto': "
        "three quarters of the steps `fit` plans, at most 3000)",
    )


class KLSettings:
    """How a prior's KL enters the objective: `num_train`, `kl_weight`, `kl_warmup_steps`.

    The base of every keras-dvi prior (the closed-form `PriorRegularizer`s of DVI and MCVI
    layers, the `WeightPrior`s of `GlobalInducingDense`), so each layer takes its prior, and
    with it these settings, in one argument: `regularizer=`.

    Args:
        num_train: number of training examples `N`; the KL is divided by it.
        kl_weight: weight of the KL term after the warm-up. 1 is the ELBO; a value below 1
            tempers the posterior (a "cold" posterior, closer to maximum likelihood): a
            departure from Bayesian inference, stated by `keras_dvi.objective.describe`.
            `"auto"` (the default of the closed-form priors, `PriorRegularizer`; global
            inducing priors default to 1 and refuse it): for a network compiled with a
            classification loss (`SoftmaxDeltaELL`, `SampledSoftmaxELL`) the rule
            `min(1, N / P)` of `auto_kl_weight`, with `P` the number of weights under
            keras-dvi priors in the network; otherwise (regression, or a model that is not
            compiled) 1, the ELBO. Pass `kl_weight=1` for the ELBO of a classifier.
        kl_warmup_steps: training steps (optimizer updates) over which the KL weight rises
            linearly from 0 to `kl_weight`, or `"auto"` (the default): three quarters of the
            training steps that the first `fit` of the network plans (`epochs *
            steps_per_epoch`), at most 3,000 steps, so that every run ends on the objective
            `kl_weight` asks for, at least its last quarter trained there (3,000 steps when
            `fit` cannot know its length, or training runs outside `fit`).
            The length is fixed at the first training step and saved with the model (the
            layers' `kl_warmup_length`), so a later `fit` or a reloaded model continues the
            same schedule. 0 turns the warm-up off. Without a warm-up, a network with many
            weights per training example is pulled to the prior by the KL's gradient before
            the data term can act, and stays there (BENCHMARKS.md). Counted per layer in its
            `kl_step` variable, on every backend; evaluation always uses `kl_weight`.
    """

    #: Whether `kl_weight="auto"` is accepted (the closed-form priors of DVI and MCVI layers).
    accepts_auto_kl_weight = False

    def __init__(self, num_train, kl_weight=1.0, kl_warmup_steps=DEFAULT_KL_WARMUP_STEPS):
        self.num_train = None if num_train is None else validation.num_train(num_train)
        self.kl_weight = _kl_weight(kl_weight, self.accepts_auto_kl_weight)
        self.kl_warmup_steps = _kl_warmup_steps(kl_warmup_steps)

    def get_config(self):
        return {
            "num_train": self.num_train,
            "kl_weight": self.kl_weight,
            "kl_warmup_steps": self.kl_warmup_steps,
        }

    @classmethod
    def from_config(cls, config):
        return cls(**config)


class PriorRegularizer(KLSettings):
    """Base class: a prior whose KL to a factorised Gaussian posterior has a closed form
    (`KLSettings` holds `num_train`, `kl_weight` and `kl_warmup_steps`; `num_train` is
    required; `kl_weight` is `"auto"` by default: 1, the ELBO, for regression, and
    `min(1, N / P)` for a classifier, see `auto_kl_weight`)."""

    accepts_auto_kl_weight = True

    def __init__(self, num_train, kl_weight=DEFAULT_KL_WEIGHT, kl_warmup_steps=DEFAULT_KL_WARMUP_STEPS):
        super().__init__(validation.num_train(num_train), kl_weight, kl_warmup_steps)

    def kl(self, mean, variance, fan_in):
        """KL divergence of one weight set (all entries of `mean` / `variance`)."""
        raise NotImplementedError

    def __call__(self, mean, variance, fan_in):
        """The weight set's contribution to `-ELBO / N`: `KL / num_train`."""
        return self.kl(mean, variance, fan_in) / float(self.num_train)


@keras.saving.register_keras_serializable(package="keras_dvi")
class EmpiricalBayesRegularizer(PriorRegularizer):
    """The empirical Bayes prior of Wu et al. (2019), eqs. 10-13.

    Args:
        num_train: number of training examples `N` (positive integer).
        alpha: shape of the inverse gamma hyperprior (paper: 1).
        beta: scale of the inverse gamma hyperprior (paper: 10, kept after an ablation of 1,
            10 and 100 on validation rows, BENCHMARKS.md). It floors each weight set's prior
            variance at about `2 beta / Omega`.
        beta_per_fan_in: if `True`, the effective scale is `beta / fan_in` for each layer (the
            original code's toy used `alpha = 4.4798`, `beta = (1 + alpha) * 5 / fan_in`, i.e.
            `beta=(1 + 4.4798) * 5, beta_per_fan_in=True`).
        kl_weight: weight of the KL after the warm-up (see `PriorRegularizer`).
        kl_warmup_steps: length of the KL warm-up in training steps (see `PriorRegularizer`).

    Examples:
        >>> prior = EmpiricalBayesRegularizer(num_train=len(x_train))
        >>> model = keras.Sequential([
        ...     keras.Input((1,)),
        ...     DenseDVI(128, "relu", regularizer=prior),
        ...     DenseDVI(2, regularizer=prior),
        ... ])
    """

    def __init__(self, num_train, alpha=1.0, beta=10.0, beta_per_fan_in=False, kl_weight=DEFAULT_KL_WEIGHT,
                 kl_warmup_steps=DEFAULT_KL_WARMUP_STEPS):
        super().__init__(num_train, kl_weight=kl_weight, kl_warmup_steps=kl_warmup_steps)
        self.alpha = validation.positive_number("alpha", alpha)
        self.beta = validation.positive_number("beta", beta)
        self.beta_per_fan_in = bool(beta_per_fan_in)

    def optimal_prior_variance(self, mean, variance, fan_in):
        """`s* = (sum(v + mu^2) + 2 beta) / (Omega + 2 alpha + 2)` (eq. 13)."""
        beta = self.beta / fan_in if self.beta_per_fan_in else self.beta
        count = float(_size(mean))
        second = ops.sum(variance + ops.square(mean))
        return (second + 2.0 * beta) / (count + 2.0 * self.alpha + 2.0)

    def kl(self, mean, variance, fan_in):
        return gaussian_kl(mean, variance, self.optimal_prior_variance(mean, variance, fan_in))

    def get_config(self):
        config = super().get_config()
        config.update(
            {"alpha": self.alpha, "beta": self.beta, "beta_per_fan_in": self.beta_per_fan_in}
        )
        return config


@keras.saving.register_keras_serializable(package="keras_dvi")
class GaussianPriorRegularizer(PriorRegularizer):
    """A fixed `N(0, variance)` prior on every weight (the paper's "DVI-fixed" ablation), or
    with `per_fan_in=True` `N(0, variance / fan_in)`: with `variance=1`, the `NealPrior` of Ober
    & Aitchison (eq. 14) for factorised layers.

    Args:
        num_train: number of training examples `N` (positive integer).
        variance: prior variance (positive).
        per_fan_in: divide `variance` by each layer's fan-in (inputs per output unit; the bias
            has its layer's prior).
        kl_weight: weight of the KL after the warm-up (see `PriorRegularizer`).
        kl_warmup_steps: length of the KL warm-up in training steps (see `PriorRegularizer`).
    """

    def __init__(self, num_train, variance=1.0, per_fan_in=False, kl_weight=DEFAULT_KL_WEIGHT,
                 kl_warmup_steps=DEFAULT_KL_WARMUP_STEPS):
        super().__init__(num_train, kl_weight=kl_weight, kl_warmup_steps=kl_warmup_steps)
        self.variance = validation.positive_number("variance", variance)
        self.per_fan_in = bool(per_fan_in)

    def kl(self, mean, variance, fan_in):
        return gaussian_kl(mean, variance, self.variance / float(fan_in) if self.per_fan_in else self.variance)

    def get_config(self):
        config = super().get_config()
        config.update({"variance": self.variance, "per_fan_in": self.per_fan_in})
        return config


@keras.saving.register_keras_serializable(package="keras_dvi")
class ScalePriorRegularizer(PriorRegularizer):
    """The `ScalePrior` of Ober & Aitchison (2021, eqs. 16-18) for closed-form layers: a learned
    prior scale per weight set whose own prior is counted in the KL.

    Each weight set `lambda` (a layer's kernel, its bias) with `Omega` weights has prior
    `w_i ~ N(0, 1 / (s fan_in))` given a precision scale `s ~ Gamma(shape, rate)` (paper:
    `Gamma(2, 2)`), and a variational posterior `q(s) = Gamma(shape + alpha, rate + beta)`.
    Here `q(s)` is always at its optimum given the weights' posterior (the prior is
    conjugate): `alpha = Omega / 2`, `beta = fan_in sum_i (v_i + mu_i^2) / 2`. The KL counted
    is then `E_q(s)[KL(q(w) || p(w | s))] + KL(q(s) || p(s))`, in closed form:

    `KL = sum_i (-log(fan_in v_i) - 1) / 2 + a log b - shape log rate - lgamma(a) + lgamma(shape)`

    with `a = shape + Omega / 2`, `b = rate + beta`. Unlike `EmpiricalBayesRegularizer`,
    whose hyperprior's density is left out, every term of this objective is a bound on the
    evidence; like it, the scale shrinks with the weights when the data do not hold them.

    Args:
        num_train: number of training examples `N` (positive integer).
        shape: shape of the Gamma prior on the precision scale `s` (paper: 2).
        rate: rate of the Gamma prior on `s` (paper: 2); `s` has prior mean `shape / rate`.
        kl_weight: weight of the KL after the warm-up (see `PriorRegularizer`).
        kl_warmup_steps: length of the KL warm-up in training steps (see `PriorRegularizer`).

    Examples:
        >>> prior = ScalePriorRegularizer(num_train=len(x_train))
        >>> layer = DenseDiagDVI(100, "relu", regularizer=prior)
    """

    def __init__(self, num_train, shape=2.0, rate=2.0, kl_weight=DEFAULT_KL_WEIGHT, kl_warmup_steps=DEFAULT_KL_WARMUP_STEPS):
        super().__init__(num_train, kl_weight=kl_weight, kl_warmup_steps=kl_warmup_steps)
        self.shape = validation.positive_number("shape", shape)
        self.rate = validation.positive_number("rate", rate)

    def scale_posterior(self, mean, variance, fan_in):
        """`(a, b)`: shape and rate of the optimal `q(s)`, `Gamma(shape + Omega / 2, rate +
        fan_in sum(v + mu^2) / 2)`."""
        count = float(_size(mean))
        second = ops.sum(variance + ops.square(mean))
        return self.shape + 0.5 * count, self.rate + 0.5 * float(fan_in) * second

    def kl(self, mean, variance, fan_in):
        a, b = self.scale_posterior(mean, variance, fan_in)
        weights = 0.5 * ops.sum(-ops.log(float(fan_in) * variance) - 1.0)
        return (weights + a * ops.log(b) - self.shape * math.log(self.rate)
                - math.lgamma(a) + math.lgamma(self.shape))

    def get_config(self):
        config = super().get_config()
        config.update({"shape": self.shape, "rate": self.rate})
        return config


class WeightPrior(KLSettings):
    """Base class of the Gaussian weight priors of `GlobalInducingDense` (Ober & Aitchison,
    2021, eqs. 14-15): every weight (bias included) is `N(0, 1 / prior_precision(fan_in))`.

    Args:
        num_train: number of training examples `N`; the layer's Monte Carlo KL is divided by
            it. Required on the first `GlobalInducingDense` layer; a later layer given a prior
            without it takes the `N` of the layer feeding it.
        kl_weight: weight of the KL after the warm-up (see `KLSettings`).
        kl_warmup_steps: length of the KL warm-up in training steps; 0 (the default here:
            global inducing networks were benchmarked without one, BENCHMARKS.md) turns it off.
    """

    def __init__(self, num_train=None, kl_weight=1.0, kl_warmup_steps=0):
        super().__init__(num_train, kl_weight, kl_warmup_steps)

    def prior_precision(self, fan_in):
        """The inverse prior variance of every weight of a layer with `fan_in` inputs."""
        raise NotImplementedError

    def with_num_train(self, num_train):
        """A copy of this prior with `num_train` set (the prior itself is left as it is)."""
        return type(self).from_config({**self.get_config(), "num_train": num_train})


@keras.saving.register_keras_serializable(package="keras_dvi")
class NealPrior(WeightPrior):
    """`w ~ N(0, 1 / fan_in)` (Ober & Aitchison eq. 14, `S = I`): activations keep their
    scale through the layers, as with "He" initialisation. The default prior of
    `GlobalInducingDense`."""

    def prior_precision(self, fan_in):
        return float(fan_in)


@keras.saving.register_keras_serializable(package="keras_dvi")
class StandardPrior(WeightPrior):
    """`w ~ N(0, 1)` (Ober & Aitchison eq. 15, `S = fan_in I`)."""

    def prior_precision(self, fan_in):
        return 1.0


@keras.saving.register_keras_serializable(package="keras_dvi")
class ScalePrior(WeightPrior):
    """The `ScalePrior` of Ober & Aitchison (2021, eqs. 16-18) for `GlobalInducingDense`: each
    layer's weights are `N(0, 1 / (s fan_in))` given a precision scale `s` with prior
    `Gamma(shape, rate)` (paper: `Gamma(2, 2)`) and a learned variational posterior
    `q(s) = Gamma(shape + alpha, rate + beta)`, `alpha, beta >= 0` (each layer its own, stored
    in the layer as `scale_log_alpha` / `scale_log_beta`; both start at `log alpha = log beta = 6`,
    as in the authors' code: `q(s)` concentrated at 1, `NealPrior`). Each weight sample draws
    its own `s` (reparameterised), and the layer's Monte Carlo KL counts
    `log q(s) - log p(s)` beside `log q(W | s) - log p(W | s)`.

    Args:
        num_train: as in `WeightPrior`.
        shape: shape of the Gamma prior on `s` (paper: 2).
        rate: rate of the Gamma prior on `s` (paper: 2).
        kl_weight, kl_warmup_steps: as in `WeightPrior`.
    """

    #: `GlobalInducingDense` creates the variational parameters of `q(s)` for priors that set it.
    learns_scale = True

    def __init__(self, num_train=None, shape=2.0, rate=2.0, kl_weight=1.0, kl_warmup_steps=0):
        super().__init__(num_train, kl_weight, kl_warmup_steps)
        self.shape = validation.positive_number("shape", shape)
        self.rate = validation.positive_number("rate", rate)

    def prior_precision(self, fan_in):
        """At the prior mean of `s`: `shape / rate * fan_in` (used where no sample is drawn)."""
        return self.shape / self.rate * float(fan_in)

    def scale_posterior(self, log_alpha, log_beta):
        """`(a, b)`: shape and rate of `q(s)`."""
        return self.shape + ops.exp(log_alpha), self.rate + ops.exp(log_beta)

    def sample_scale(self, log_alpha, log_beta, samples, dtype, seed):
        """`(s, log p(s) - log q(s))`, `(samples,)` each: reparameterised draws from `q(s)`."""
        a, b = (ops.cast(v, dtype) for v in self.scale_posterior(log_alpha, log_beta))
        s = keras.random.gamma((samples,), alpha=a, dtype=dtype, seed=seed) / b
        log_ratio = (gamma_log_density(s, ops.cast(self.shape, dtype), ops.cast(self.rate, dtype))
                     - gamma_log_density(s, a, b))
        return s, log_ratio

    def get_config(self):
        config = super().get_config()
        config.update({"shape": self.shape, "rate": self.rate})
        return config


def log_multigamma(x, dims):
    """`log Gamma_p(x)`, the multivariate log-gamma function of dimension `p = dims`."""
    terms = [log_gamma(x - 0.5 * j) for j in range(dims)]
    return sum(terms) + 0.25 * dims * (dims - 1) * math.log(math.pi)


def inverse_wishart_log_density(precision_logdet, trace_psi_inverse, psi_logdet, nu, dims):
    """`log IW(L; Psi, nu)` of a `dims`-square matrix `L` from its parts: `log det L`,
    `tr(Psi L^{-1})` and `log det Psi` (so that a sampler holding `L^{-1}` needs no inverse):

    `nu / 2 log det Psi - nu dims / 2 log 2 - log Gamma_dims(nu / 2) - (nu + dims + 1) / 2 log det L
    - tr(Psi L^{-1}) / 2`."""
    dtype = keras.backend.standardize_dtype(precision_logdet.dtype)
    nu = ops.cast(nu, dtype) if hasattr(nu, "dtype") else ops.convert_to_tensor(nu, dtype=dtype)  # (a float: no float32 detour)
    return (0.5 * nu * psi_logdet - 0.5 * nu * dims * math.log(2.0) - log_multigamma(0.5 * nu, dims)
            - 0.5 * (nu + dims + 1.0) * precision_logdet - 0.5 * trace_psi_inverse)


def _log_det_from_factor(chol):
    return 2.0 * ops.sum(ops.log(ops.diagonal(chol, axis1=-2, axis2=-1)), axis=-1)


@keras.saving.register_keras_serializable(package="keras_dvi")
class SpatialIWPrior(WeightPrior):
    """The `SpatialIWPrior` of Ober & Aitchison (2021, eq. 19) for the global inducing layers:
    spatially correlated kernels.

    A kernel with `c` input channels and `k = k_h k_w` positions has the prior
    `w ~ N(0, (I_c (x) L^{-1}) / c)` over each output channel's weights, `L` a `k`-square
    spatial precision with prior `IW(L; (k + 1) I, k + 1)` and a learned variational posterior
    `q(L) = IW(L; (k + 1) I + Psi, k + 1 + nu)` per layer (`Psi = T T^T`, `T` lower triangular,
    the layer weight `spatial_tril`; `nu = exp(spatial_log_nu)`; both start where `q(L)` is
    concentrated at `L = k I`, `NealPrior`'s precision `fan_in = c k`). The bias has the
    `NealPrior` precision `fan_in`. Each weight sample draws its own `L` (a reparameterised
    Bartlett decomposition), and the layer's Monte Carlo KL counts `log q(L) - log p(L)`.
    For a dense layer `k = 1`: `L` is a learned precision scale with an inverse-gamma prior.

    Args:
        num_train, kl_weight, kl_warmup_steps: as in `WeightPrior`.
    """

    #: The global inducing layers create the variational parameters of `q(L)` for priors that set it.
    learns_spatial_precision = True
    #: `log nu` at the start: `q(L)` concentrated (as `ScalePrior`'s start).
    initial_log_nu = 6.0

    def prior_precision(self, fan_in):
        """`fan_in`: the precision at the start of `q(L)` (used where no sample is drawn)."""
        return float(fan_in)

    @classmethod
    def initial_tril(cls, dims):
        """`T` at the start: `Psi = (dims nu - dims - 1) I`, so `E_q[L] = dims I`."""
        nu = math.exp(cls.initial_log_nu)
        return math.sqrt(dims * nu - dims - 1.0) * np.eye(dims)

    def posterior(self, tril, log_nu):
        """`(Psi_q, nu_q)` of `q(L)`."""
        dims = tril.shape[-1]
        t = ops.tril(tril)
        psi = (dims + 1.0) * ops.eye(dims, dtype=t.dtype) + ops.matmul(t, ops.transpose(t))
        return psi, dims + 1.0 + ops.exp(log_nu)

    def sample_precision(self, tril, log_nu, channels, bias, samples, dtype, seed):
        """`(Lambda, log p(L) - log q(L))`: the prior precision matrix of the layer's weight rows,
        `(samples, P, P)` with rows ordered (position, channel) and the bias last, for
        reparameterised draws `L ~ q(L)`; and the log ratio per draw, `(samples,)`.

        `L^{-1} = X ~ Wishart(Psi_q^{-1}, nu_q)` by Bartlett: `X = C A A^T C^T`, `C` the
        Cholesky factor of `Psi_q^{-1}`, `A` lower triangular with `A_ii^2 ~ Gamma((nu_q - i) / 2,
        1 / 2)` and standard normal entries below the diagonal."""
        tril, log_nu = ops.cast(tril, dtype), ops.cast(log_nu, dtype)
        dims = tril.shape[-1]
        psi, nu = self.posterior(tril, log_nu)
        c = ops.cholesky(ops.inv(psi))
        dof = nu - ops.arange(dims, dtype=dtype)  # (dims,)
        chi2 = 2.0 * keras.random.gamma((samples, dims), alpha=ops.broadcast_to(0.5 * dof, (samples, dims)),
                                        dtype=dtype, seed=seed)
        below = ops.tril(keras.random.normal((samples, dims, dims), dtype=dtype, seed=seed), k=-1)
        a = below + ops.eye(dims, dtype=dtype)[None] * ops.sqrt(chi2)[:, :, None]
        factor = ops.matmul(c[None], a)  # X = factor factor^T
        covariance = ops.matmul(factor, ops.transpose(factor, (0, 2, 1)))  # X = L^{-1}
        precision = ops.inv(covariance)
        logdet_precision = -_log_det_from_factor(factor)
        prior_psi = (dims + 1.0) * ops.eye(dims, dtype=dtype)
        log_p = inverse_wishart_log_density(
            logdet_precision, ops.sum(covariance * prior_psi[None], axis=(-2, -1)),
            dims * math.log(dims + 1.0), float(dims + 1), dims)
        log_q = inverse_wishart_log_density(
            logdet_precision, ops.sum(covariance * psi[None], axis=(-2, -1)),
            -_log_det_from_factor(c), nu, dims)  # log det Psi = -log det Psi^{-1}
        eye_c = ops.eye(channels, dtype=dtype) * float(channels)
        kron = precision[:, :, None, :, None] * eye_c[None, None, :, None, :]  # (S, k, c, k, c)
        size = dims * channels
        matrix = ops.reshape(kron, (samples, size, size))
        if bias:
            matrix = ops.pad(matrix, ((0, 0), (0, 1), (0, 1)))
            corner = ops.pad(ops.ones((1, 1), dtype=dtype) * float(size), ((size, 0), (size, 0)))
            matrix = matrix + corner[None]
        return matrix, log_p - log_q


def get_weight_prior(identifier):
    """A `WeightPrior` from `"neal"`, `"standard"`, an instance or a serialised config."""
    if isinstance(identifier, WeightPrior):
        return identifier
    names = {"neal": NealPrior, "standard": StandardPrior, "scale": ScalePrior, "spatial_iw": SpatialIWPrior}
    if isinstance(identifier, str) and identifier.lower() in names:
        return names[identifier.lower()]()
    if isinstance(identifier, dict):
        obj = keras.saving.deserialize_keras_object(identifier)
        if isinstance(obj, WeightPrior):
            return obj
    raise ValueError(
        "Argument `regularizer` of a global inducing layer must be a keras_dvi.NealPrior, "
        f"StandardPrior, ScalePrior or SpatialIWPrior (e.g. `regularizer=keras_dvi.NealPrior(num_train=len(x_train))`); "
        f"received {identifier!r}."
    )


def _size(tensor):
    size = 1
    for dim in tensor.shape:
        size *= int(dim)
    return size


def get(identifier):
    """A `PriorRegularizer` from an instance, a serialised config, or `None`."""
    if identifier is None or isinstance(identifier, PriorRegularizer):
        return identifier
    if isinstance(identifier, dict):
        obj = keras.saving.deserialize_keras_object(identifier)
        if isinstance(obj, PriorRegularizer):
            return obj
    raise ValueError(
        "Argument `regularizer` must be a keras-dvi prior (EmpiricalBayesRegularizer or "
        f"GaussianPriorRegularizer) or None; received {identifier!r}. Keras weight "
        "regularizers such as L2 do not apply: the layers hold a posterior, not weights."
    )
