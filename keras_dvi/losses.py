"""Expected log-likelihood losses for keras-dvi outputs (pass them to `model.compile`).

Each loss reads the packed output of the last keras-dvi layer (see `keras_dvi.packing`),
returns the per-example negative expected log-likelihood, and reports the loss as Keras reduces
it (the batch mean, weighted by `sample_weight` or `class_weight` as the loss is) as `nll` in
the training logs (`keras_dvi.objective`), so that the logged `loss` is `nll + kl`.
"""

import math

import keras
from keras import ops

from keras_dvi import objective, packing, validation
from keras_dvi.maths import moments

_LOG_2PI = math.log(2.0 * math.pi)


def _replicas(reduction):
    """The number of replicas by which Keras divides a mean loss under `tf.distribute` (their
    gradients are summed), 1 elsewhere: the logged `nll` is the loss of the whole batch."""
    if keras.backend.backend() != "tensorflow" or reduction not in ("sum_over_batch_size", "mean",
                                                                     "mean_with_sample_weight"):
        return 1
    import tensorflow as tf

    return tf.distribute.get_strategy().num_replicas_in_sync


def _moments(y_pred, loss, sampled_loss):
    """`packing.unpack(y_pred)` for the moment loss `loss` (a sampled model's weight samples
    refused, `objective.refuse_samples`)."""
    objective.refuse_samples(loss, f"Compile it with keras_dvi.{sampled_loss}(), the Monte Carlo estimate of "
                                   f"the same expected log-likelihood; received y_pred of shape {tuple(y_pred.shape)}.")
    return packing.unpack(y_pred)


def _positions(y_pred):
    """The positions of each example of a dense prediction (a feature-map output), 1 for any
    other output: an example's expected log-likelihood is the sum over its positions, which are
    conditionally independent given the weights, so that the KL's `num_train` counts examples
    (images), as for any other model. The losses return each position's value times this
    number, so that Keras' mean over the batch and the positions is the mean per example and
    per-pixel sample weights weigh as Keras weighs them."""
    if not packing.is_map(y_pred.shape):
        return 1.0
    return ops.cast(ops.prod(ops.shape(y_pred)[2:-1]), "float32")


def _per_position(y_true, y_pred, name, targets):
    """`packing.per_position` for a loss: `(y_true, y_pred, finish)`, `finish(nll)` the loss per
    position times the positions of an example (`_positions`), or `nll` itself for any other
    output."""
    positions = _positions(y_pred)
    y_true, y_pred, restore = packing.per_position(y_true, y_pred, name, targets)
    if restore is None:
        return y_true, y_pred, lambda nll: nll
    return y_true, y_pred, lambda nll: restore(nll) * ops.cast(positions, nll.dtype)


class _ValidatingLoss(keras.losses.Loss):
    """Base of the keras-dvi losses: the `validate` flag and its config entry, and the report of
    the step's `nll` (`__call__`)."""

    #: Whether the likelihood is categorical (a classifier): `kl_weight="auto"` then applies
    #: its rule `min(1, N / P)` (`keras_dvi.priors.auto_kl_weight`); else the ELBO.
    categorical = False

    def __init__(self, validate=False, reduction="sum_over_batch_size", name=None, dtype=None):
        super().__init__(name=name, reduction=reduction, dtype=dtype)
        self.validate = bool(validate)

    def __call__(self, y_true, y_pred, sample_weight=None):
        """Keras' loss (per-example `call`, weighted and reduced by Keras), reported as the step's
        `nll`: the value that enters the loss, weights included. A classifier also reports its
        probabilities and its unweighted mean `nll` per example, for the collapse check (the
        loss's per-example values once more only where weights or a reduction other than the
        batch mean make the two differ)."""
        loss = super().__call__(y_true, y_pred, sample_weight=sample_weight)
        reported = ops.mean(loss) * _replicas(self.reduction)
        probabilities = self.probabilities(y_pred)
        unweighted = None
        if probabilities is not None:
            unweighted = reported
            if sample_weight is not None or self.reduction != "sum_over_batch_size":
                unweighted = ops.mean(self.call(ops.convert_to_tensor(y_true), ops.convert_to_tensor(y_pred)))
            if packing.is_map(y_pred.shape):  # per pixel of a dense prediction, against log C
                unweighted = unweighted / _positions(y_pred)
        objective.report_nll(reported, probabilities, unweighted)
        return loss

    def probabilities(self, y_pred):
        """A classifier's predicted class probabilities `(batch, C)` for the collapse check of
        `ELBOTracker`; `None` for regression."""
        return None

    def get_config(self):
        config = super().get_config()
        config["validate"] = self.validate
        return config


class _ClassificationLoss(_ValidatingLoss):
    """Base of the keras-dvi classification losses: the labels (`validation.class_labels`) with
    Keras' label smoothing, `y (1 - label_smoothing) + label_smoothing / C` (as Keras'
    `CategoricalCrossentropy` and, for two classes, `BinaryCrossentropy`)."""

    #: A classification loss: under it a prior's default `kl_weight="auto"` weighs the KL
    #: `min(1, N / P)`.
    categorical = True

    def __init__(self, validate=False, reduction="sum_over_batch_size", name=None, dtype=None, label_smoothing=0.0):
        super().__init__(validate=validate, reduction=reduction, name=name, dtype=dtype)
        if (isinstance(label_smoothing, bool) or not isinstance(label_smoothing, (int, float))
                or not 0.0 <= label_smoothing <= 1.0):
            raise ValueError(f"Argument `label_smoothing` must be a number in [0, 1]; received "
                             f"label_smoothing={label_smoothing!r}.")
        self.label_smoothing = float(label_smoothing)

    def labels(self, y_true, classes, dtype):
        """`y_true` as rows `(batch, classes)`, checked, smoothed (a row of an out-of-range label
        stays all zero, for `validation.poison_unlabelled`)."""
        labels = validation.check_finite(validation.class_labels(y_true, classes, dtype, self.validate), "y_true",
                                         self.validate)
        if not self.label_smoothing:
            return labels
        mass = ops.sum(labels, axis=-1, keepdims=True)
        return labels * (1.0 - self.label_smoothing) + mass * (self.label_smoothing / classes)

    def get_config(self):
        config = super().get_config()
        config["label_smoothing"] = self.label_smoothing
        return config


@keras.saving.register_keras_serializable(package="keras_dvi")
class HeteroscedasticELL(_ValidatingLoss):
    """Negative expected Gaussian log-likelihood with a learned, input-dependent noise.

    Wu et al. (ICLR 2019), eq. 8: for each target dimension the network
    outputs a mean `m` and a log noise variance `l`, jointly Gaussian with covariance
    `(S_mm, S_ml, S_ll)`, and

    `-E[log N(y | m, exp(l))] = 1/2 [log 2pi + E[l] + (S_mm + (E[m] - S_ml - y)^2) exp(-E[l] + S_ll / 2)]`,

    exact for a Gaussian `(m, l)`. Summed over target dimensions.

    Output layout: a model for `D` targets ends in a keras-dvi layer with `2 D` units: units
    `0..D-1` are the means, units `D..2D-1` the log-variances (`keras_dvi.HomoscedasticNoise`
    appends a learned or fixed log-variance to a `D`-unit output: the paper's hoDVI). With a
    full-covariance output (`DenseDVI`) the `m`-`l` covariance `S_ml` is used; a diagonal
    output (`DenseDiagDVI`) has none, so `S_ml = 0` is assumed there: use a `DenseDVI` head.

    A dense prediction (the output a channels-last feature map with `2 D` channels: a per-pixel
    regression) is scored at every position against targets `(batch, *spatial, D)` (or `(batch, *spatial)`
    for `D = 1`); an example's loss is the sum over its positions (conditionally independent
    given the weights, so the prior's `num_train` counts images), returned per position as the
    position's value times the number of positions, so that Keras' mean over the batch and the
    positions is the mean per example and per-pixel `sample_weight`s weigh as in Keras.

    Args:
        validate: targets and outputs are checked for NaN/inf in eager calls; `True` also
            checks them inside `fit`/`evaluate` (TensorFlow assertions).
        reduction: Keras loss reduction (default: mean over the batch).
        name: loss name.
        dtype: dtype of the loss computation.

    Examples:
        >>> model.compile(keras.optimizers.Adam(1e-3), loss=HeteroscedasticELL())
    """

    def __init__(self, validate=False, reduction="sum_over_batch_size", name="heteroscedastic_ell", dtype=None):
        super().__init__(validate=validate, reduction=reduction, name=name, dtype=dtype)

    def call(self, y_true, y_pred):
        units = y_pred.shape[-1]
        y_true, y_pred, finish = _per_position(y_true, y_pred, "HeteroscedasticELL", (units or 0) // 2)
        mean, second = _moments(y_pred, "HeteroscedasticELL", "SampledHeteroscedasticELL")
        if units is None or units % 2:
            raise ValueError(
                "HeteroscedasticELL needs a model output with an even number of units, "
                f"2 D (D means, then D log noise variances); received {units} units. For a "
                "homoscedastic model add keras_dvi.HomoscedasticNoise() after the output layer."
            )
        dims = units // 2
        y = ops.cast(validation.regression_targets(y_true, dims, "HeteroscedasticELL"), mean.dtype)
        y = validation.check_finite(y, "y_true", self.validate)
        mean = validation.check_finite(mean, "y_pred", self.validate)
        if len(second.shape) == 3:
            variance = ops.diagonal(second, axis1=-2, axis2=-1)
            cross = ops.diagonal(second[:, :dims, dims:], axis1=-2, axis2=-1)
        else:
            variance, cross = second, ops.zeros_like(mean[:, :dims])
        mean = validation.check_packed_variances(mean, variance, "HeteroscedasticELL", self.validate)
        m, log_var = mean[:, :dims], mean[:, dims:]
        s_mm, s_ll = variance[:, :dims], variance[:, dims:]
        precision = moments.safe_exp(0.5 * s_ll - log_var)
        nll = ops.sum(0.5 * (_LOG_2PI + log_var + (s_mm + ops.square(m - cross - y)) * precision), axis=-1)
        return finish(nll)


@keras.saving.register_keras_serializable(package="keras_dvi")
class SoftmaxDeltaELL(_ClassificationLoss):
    """Negative expected log-likelihood of a softmax (categorical) likelihood over logits.

    (A classification loss: under it, a prior's default `kl_weight="auto"` weighs the KL
    `min(1, N / P)`.)

    Logits `a ~ N(m, S)` (the packed output of the last keras-dvi layer, `C >= 2` units), in
    closed form by one of two approximations. `method="jankowiak"` (the default): the
    closed-form approximate bound of Jankowiak (2018), eq. 38:
    `E[log p(y|a)] >~ m_y - log sum_j exp(m_j) (1 + S_jj / 2)`. `method="delta"` (the loss's
    namesake): the second-order delta method, Wu et al. (ICLR 2019) eq. 21:
    `E[log p(y|a)] ~= m_y - logsumexp(m) - (p . diag(S) - p^T S p) / 2`, `p = softmax(m)`.

    The delta method is a second-order expansion, not a bound. Where `softmax(m)` is near
    one-hot its variance term `p . diag(S) - p^T S p` vanishes whatever `S` is (at
    `m = (10, 0, 0)`, `S = 25 I` it adds 0.002 nats where Monte Carlo gives 0.51), so
    training can learn large logit variances and over-confident networks. The Jankowiak
    form's penalty grows with the variance; with the priors' default KL weight it trains
    classifiers that are robust under shift at every width measured, where the delta method
    failed at two (BENCHMARKS.md, "What makes a classifier learn on small data"). With the
    full ELBO (`kl_weight=1`) on a network with more weights than training examples it
    under-fits; the delta method under-fits less there.

    Labels: integer class indices of shape `(batch,)` or `(batch, 1)`, or one-hot (or soft)
    labels of shape `(batch, C)`. With two classes (a converted binary classifier) a label of
    shape `(batch,)` or `(batch, 1)` is the probability of class 1, as Keras' binary
    cross-entropy reads it: 0 or 1, or a soft label such as 0.9.

    A dense prediction (segmentation: the output a channels-last feature map with `C` channels)
    is scored at every position, with labels `(batch, *spatial)`, `(batch, *spatial, 1)` or one-hot
    `(batch, *spatial, C)` (two classes: a mask of class-1 probabilities); an example's loss is
    the sum over its positions, as in `HeteroscedasticELL`, so that the prior's `num_train`
    counts images and the logged `nll` is per image.

    Args:
        method: `"jankowiak"` (default) or `"delta"`.
        validate: as in `HeteroscedasticELL`.
        reduction: Keras loss reduction (default: mean over the batch).
        name: loss name.
        dtype: dtype of the loss computation.
        label_smoothing: in `[0, 1]`: the labels become `y (1 - label_smoothing) +
            label_smoothing / C`, as in Keras' `CategoricalCrossentropy` (and, for two
            classes, `BinaryCrossentropy`).

    Examples:
        >>> model.compile(keras.optimizers.Adam(1e-3), loss=SoftmaxDeltaELL())  # doctest: +SKIP
    """

    def __init__(self, method="jankowiak", validate=False, reduction="sum_over_batch_size", name="softmax_delta_ell",
                 dtype=None, label_smoothing=0.0):
        super().__init__(validate=validate, reduction=reduction, name=name, dtype=dtype, label_smoothing=label_smoothing)
        if method not in ("delta", "jankowiak"):
            raise ValueError(
                f"Argument `method` must be 'delta' or 'jankowiak'; received method={method!r}."
            )
        self.method = method

    def call(self, y_true, y_pred):
        y_true, y_pred, finish = _per_position(y_true, y_pred, "SoftmaxDeltaELL", y_pred.shape[-1])
        mean, second = _moments(y_pred, "SoftmaxDeltaELL", "SampledSoftmaxELL")
        classes = mean.shape[-1]
        if classes is None or classes < 2:
            raise ValueError(
                "SoftmaxDeltaELL needs a model output with one logit per class (at least 2 "
                f"units); received {classes} unit(s)."
            )
        labels = self.labels(y_true, classes, mean.dtype)
        mean = validation.check_finite(mean, "y_pred", self.validate)
        variance = ops.diagonal(second, axis1=-2, axis2=-1) if len(second.shape) == 3 else second
        mean = validation.check_packed_variances(mean, variance, "SoftmaxDeltaELL", self.validate)
        if self.method == "jankowiak":
            log_norm = ops.logsumexp(mean + ops.log1p(0.5 * variance), axis=-1, keepdims=True)
            ell = mean - log_norm
        else:
            log_p = mean - ops.logsumexp(mean, axis=-1, keepdims=True)
            p = ops.exp(log_p)
            if len(second.shape) == 3:
                quadratic = ops.einsum("bi,bij,bj->b", p, second, p)
            else:
                quadratic = ops.sum(ops.square(p) * variance, axis=-1)
            correction = 0.5 * (ops.sum(p * variance, axis=-1) - quadratic)
            ell = log_p - correction[:, None]
        return finish(validation.poison_unlabelled(-ops.sum(labels * ell, axis=-1), labels))

    def probabilities(self, y_pred):
        mean = packing.unpack(y_pred)[0]  # (a dense prediction's: a row per position)
        return ops.softmax(ops.reshape(mean, (-1, mean.shape[-1])), axis=-1)

    def get_config(self):
        config = super().get_config()
        config["method"] = self.method
        return config


def _samples(y_pred, name, moment_loss, y_true, validate=False):
    """Checks a sampled output `(batch, samples, units)` against its targets' batch size; in
    `fit` / `evaluate`, refuses the moments of a model without sampling layers (a packed
    `(batch, 2, units)` output reads as 2 samples)."""
    if objective.stepped_sampler() is None:
        raise ValueError(
            f"{name} reads weight samples of shape (batch, samples, units), but this model has no "
            "sampling layer (GlobalInducingDense, DenseMCVI, Conv1DMCVI, Conv2DMCVI): its outputs are "
            f"packed means and variances. Compile it with keras_dvi.{moment_loss}(); received y_pred of "
            f"shape {tuple(y_pred.shape)}."
        )
    if len(y_pred.shape) != 3:
        raise ValueError(
            f"{name} expects output samples of shape (batch, samples, units), as returned by a "
            "GlobalInducingDense layer with `output_layer=True`; received shape "
            f"{tuple(y_pred.shape)}. For DVI layers use HeteroscedasticELL / SoftmaxDeltaELL."
        )
    return validation.check_same_batch(
        y_true,
        y_pred,
        f"{name}: the output has more rows than the targets; is the last GlobalInducingDense "
        "layer created with `output_layer=True`? (other layers return the inducing points too)",
        validate,
    )


@keras.saving.register_keras_serializable(package="keras_dvi")
class SampledHeteroscedasticELL(_ValidatingLoss):
    """Monte Carlo negative expected Gaussian log-likelihood over output samples.

    For samples `f_s` of the function and log noise variances `l_s` (`S` samples), the
    per-example loss is `(1/S) sum_s -log N(y | f_s, exp(l_s))`, an unbiased estimate of
    `-E_q[log p(y | f)]` (Ober & Aitchison 2021, eq. 13), summed over target dimensions.

    Output layout: `(batch, samples, 2 D)`: `D` function values, then `D` log noise
    variances (`keras_dvi.SampledHomoscedasticNoise` appends a learned one).

    Args:
        validate: as in `HeteroscedasticELL`.
        reduction: Keras loss reduction (default: mean over the batch).
        name: loss name.
        dtype: dtype of the loss computation.

    Examples:
        >>> model.compile(keras.optimizers.Adam(1e-2), loss=SampledHeteroscedasticELL())

    The sampled counterpart of `HeteroscedasticELL`.
    """

    def __init__(self, validate=False, reduction="sum_over_batch_size", name="sampled_heteroscedastic_ell",
                 dtype=None):
        super().__init__(validate=validate, reduction=reduction, name=name, dtype=dtype)

    def call(self, y_true, y_pred):
        y_pred = _samples(y_pred, "SampledHeteroscedasticELL", "HeteroscedasticELL", y_true, self.validate)
        units = y_pred.shape[-1]
        if units is None or units % 2:
            raise ValueError(
                "SampledHeteroscedasticELL needs output samples with an even number of units, 2 D (D "
                f"function values, then D log noise variances); received {units} units. Add "
                "keras_dvi.SampledHomoscedasticNoise() after the output layer."
            )
        dims = units // 2
        y = ops.cast(validation.regression_targets(y_true, dims, "SampledHeteroscedasticELL"), y_pred.dtype)
        y = validation.check_finite(y, "y_true", self.validate)
        y_pred = validation.check_finite(y_pred, "y_pred", self.validate)
        f, log_var = y_pred[..., :dims], y_pred[..., dims:]
        precision = moments.safe_exp(-log_var)
        nll = 0.5 * (_LOG_2PI + log_var + ops.square(f - y[:, None, :]) * precision)
        return ops.mean(ops.sum(nll, axis=-1), axis=-1)


@keras.saving.register_keras_serializable(package="keras_dvi")
class SampledSoftmaxELL(_ClassificationLoss):
    """Monte Carlo negative expected softmax log-likelihood over sampled logits (a
    classification loss, as `SoftmaxDeltaELL`).

    `(1/S) sum_s -log softmax(a_s)_y` for logit samples `a_s`, `(batch, samples, C)`. Labels as
    in `SoftmaxDeltaELL` (integers or one-hot).

    Args:
        validate: as in `HeteroscedasticELL`.
        reduction: Keras loss reduction (default: mean over the batch).
        name: loss name.
        dtype: dtype of the loss computation.
        label_smoothing: as in `SoftmaxDeltaELL`.

    Examples:
        >>> model = keras.Sequential([keras.Input((64,)),
        ...     GlobalInducingDense(50, "relu", num_inducing=100, regularizer=NealPrior(num_train=len(x))),
        ...     GlobalInducingDense(10, output_layer=True)])
        >>> model.compile(keras.optimizers.Adam(1e-2), loss=SampledSoftmaxELL())
    """

    def __init__(self, validate=False, reduction="sum_over_batch_size", name="sampled_softmax_ell", dtype=None,
                 label_smoothing=0.0):
        super().__init__(validate=validate, reduction=reduction, name=name, dtype=dtype, label_smoothing=label_smoothing)

    def call(self, y_true, y_pred):
        y_pred = _samples(y_pred, "SampledSoftmaxELL", "SoftmaxDeltaELL", y_true, self.validate)
        classes = y_pred.shape[-1]
        if classes is None or classes < 2:
            raise ValueError(
                "SampledSoftmaxELL needs one logit per class (at least 2 units); received "
                f"{classes} unit(s)."
            )
        labels = self.labels(y_true, classes, y_pred.dtype)
        y_pred = validation.check_finite(y_pred, "y_pred", self.validate)
        log_p = y_pred - ops.logsumexp(y_pred, axis=-1, keepdims=True)
        return validation.poison_unlabelled(-ops.mean(ops.sum(labels[:, None, :] * log_p, axis=-1), axis=-1), labels)

    def probabilities(self, y_pred):
        return ops.mean(ops.softmax(y_pred, axis=-1), axis=1)

