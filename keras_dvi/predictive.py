"""Predictions: what a trained keras-dvi model predicts, and how good it is.

* `predict(model, x)`: predictive summaries as NumPy arrays (mean, standard deviation,
  epistemic and aleatoric parts, intervals; or class probabilities, labels and entropy), for
  every kind of keras-dvi model.
* `predict_samples(model, x, num_samples)`: output samples `(n, num_samples, units)` of any
  keras-dvi model (for moment networks the Monte Carlo reference over the weights,
  `weight_samples`, which runs the layers inside a `keras_dvi.sampling.sampling_scope`);
  `set_sampling_seed` restarts the draws of Monte Carlo layers.
* The predictive distributions behind them, as functions of a model's output: regression
  (Wu et al. 2019, eq. 9: `y ~ N(E[m], S_mm + exp(E[l] + S_ll / 2))`, the variance split into
  an epistemic part `S_mm` and an aleatoric part `exp(E[l] + S_ll / 2)`), class probabilities
  (`softmax` of the mean logits, a pairwise probit approximation of `E[softmax(a)]`, Monte
  Carlo, or the delta method of eq. 23), their scores (log predictive density, RMSE, interval
  coverage, expected calibration error), and the same for sampled outputs (`sampled_*`).

The functions take the packed output of a keras-dvi model (a tensor or the array that
`model.predict` returns) and return backend tensors (`keras.ops.convert_to_numpy` for NumPy);
`predict` and `predict_samples` return NumPy arrays.
"""

import math
import statistics

import keras
import numpy as np
from keras import ops

from keras_dvi import losses, network, packing, sampling, validation
from keras_dvi.maths import moments

_LOG_2PI = math.log(2.0 * math.pi)


def _split_regression(y_pred):
    mean, second = packing.unpack(y_pred)
    units = mean.shape[-1]
    if units % 2:
        raise ValueError(
            f"Argument `y_pred` must have 2 D units (D means, D log-variances); received {units}."
        )
    dims = units // 2
    variance = ops.diagonal(second, axis1=-2, axis2=-1) if len(second.shape) == 3 else second
    return mean[:, :dims], mean[:, dims:], variance[:, :dims], variance[:, dims:]


def regression_moments(y_pred):
    """Predictive mean and variance of a heteroscedastic regression output (eq. 9).

    Args:
        y_pred: packed output with `2 D` units (see `HeteroscedasticELL`).

    Returns:
        Dict of `(batch, D)` tensors: `mean`, `variance` (= `epistemic + aleatoric`),
        `epistemic` (`S_mm`) and `aleatoric` (`exp(E[l] + S_ll / 2)`); for a feature map (a
        dense prediction, `2 D` channels) `(batch, *spatial, D)`, at every position.
    """
    if packing.is_map(y_pred.shape):  # a dense prediction: every position's, `(batch, *spatial, D)`
        rows, restore = packing.positions_as_rows(y_pred)
        return {name: restore(value) for name, value in regression_moments(rows).items()}
    m, log_var, s_mm, s_ll = _split_regression(y_pred)
    aleatoric = moments.safe_exp(log_var + 0.5 * s_ll)
    return {"mean": m, "variance": s_mm + aleatoric, "epistemic": s_mm, "aleatoric": aleatoric}


def _targets(y, like):
    """Targets as `(batch, D)` like the predictive mean, shape-checked as the losses do."""
    y = ops.cast(ops.convert_to_tensor(y), like.dtype)
    return validation.regression_targets(y, like.shape[-1], "keras_dvi.predictive")


def gaussian_log_density(y, mean, variance):
    """Elementwise `log N(y; mean, variance)`: the one Gaussian log density every predictive
    score here (and `TAGIModel`'s) is built from."""
    return -0.5 * (_LOG_2PI + ops.log(variance) + ops.square(y - mean) / variance)


def log_predictive_density(y_pred, y, y_scale=1.0):
    """Log density of targets under the Gaussian predictive (eq. 9), summed over dimensions.

    Args:
        y_pred: packed regression output.
        y: targets `(batch,)` or `(batch, D)`, in the same (normalised) units as the model.
        y_scale: standard deviation used to normalise the targets; the density is returned
            in the original units (`- D log(y_scale)`), as the UCI protocol reports it.

    Returns:
        `(batch,)` log densities.
    """
    predictive = regression_moments(y_pred)
    y = _targets(y, predictive["mean"])
    log_density = gaussian_log_density(y, predictive["mean"], predictive["variance"])
    return ops.sum(log_density, axis=-1) - y.shape[-1] * math.log(y_scale)


def rmse(y_pred, y, y_scale=1.0):
    """Root mean squared error of the predictive mean, in original units (times `y_scale`)."""
    mean = regression_moments(y_pred)["mean"]
    y = _targets(y, mean)
    return ops.sqrt(ops.mean(ops.square(y - mean))) * y_scale


def central_quantile(level):
    """`z` such that `N(0, 1)` puts probability `level` in `[-z, z]`."""
    if not 0.0 < level < 1.0:
        raise ValueError(f"Argument `level` must be in (0, 1); received level={level!r}.")
    return statistics.NormalDist().inv_cdf(0.5 + 0.5 * level)  # (in Python's float64, on every backend)


def prediction_interval(y_pred, level=0.95):
    """Central predictive interval `(lower, upper)`, each `(batch, D)`, of probability `level`."""
    predictive = regression_moments(y_pred)
    half = central_quantile(level) * ops.sqrt(predictive["variance"])
    return predictive["mean"] - half, predictive["mean"] + half


def interval_coverage(y_pred, y, level=0.95):
    """Fraction of targets inside the central `level` predictive interval."""
    lower, upper = prediction_interval(y_pred, level)
    y = _targets(y, lower)
    inside = ops.logical_and(y >= lower, y <= upper)
    return ops.mean(ops.cast(inside, "float32"))


#: Methods of `class_probabilities` (the first is the default).
CLASS_PROBABILITY_METHODS = ("mean", "probit", "mc", "delta")


def _floor_and_normalise(probs):
    """Probabilities floored at 1e-30 (1e-7 in float16), so that no class gets exactly 0 and
    `log` stays finite, then renormalised."""
    tiny = 1e-30 if keras.backend.standardize_dtype(probs.dtype) != "float16" else 1e-7
    probs = ops.maximum(probs, tiny)
    return probs / ops.sum(probs, axis=-1, keepdims=True)


def class_probabilities(y_pred, method="mean", num_samples=256, seed=None):
    """Class probabilities from Gaussian logits `a ~ N(m, S)`.

    The default, `softmax(m)` of the posterior mean logits (which DVI computes by integrating
    over the weights layer by layer), is the predictive both softmax losses train: their
    `exp(E[log p(y | a)])`, normalised over `y`, is exactly `softmax(m)`, and it is the best
    calibrated in distribution. Under shift and out of distribution the logit variance
    matters, and `"probit"` is the better choice there.

    Args:
        y_pred: packed output with one logit per class.
        method: `"mean"` (default): `softmax(m)`; `"probit"`: `E[softmax(a)]` by the pairwise
            probit approximation of Lu, Ie & Sha
            (2020), `p_i ~ 1 / sum_j exp(-(m_i - m_j) / sqrt(1 + pi/8 Var(a_i - a_j)))`
            (MacKay's 1992 probit approximation applied to every pair of logits, with their
            covariance), renormalised: deterministic, equal to `softmax(m)` at `S = 0`, and
            less confident than it where the logits are uncertain; `"mc"`: the
            mean softmax of `num_samples` logit draws (the reference, stochastic); `"delta"`:
            Wu et al. (2019) eq. 23, `p (1 + p^T S p - S p + diag(S)/2 - p . diag(S) / 2)`,
            a second-order expansion that fails for large logit variances (it can put 0 on
            the true class; clipped here).
        num_samples: Monte Carlo draws for `"mc"`.
        seed: seed for `"mc"`.

    Returns:
        `(batch, C)` probabilities: rows sum to one, every entry positive (at least about
        1e-30; 1e-7 in float16) and finite for any finite input. For a feature map with `C`
        channels (a dense prediction: segmentation), `(batch, *spatial, C)`, at every position.
    """
    if method not in CLASS_PROBABILITY_METHODS:
        raise ValueError(
            f"Argument `method` must be one of {', '.join(repr(m) for m in CLASS_PROBABILITY_METHODS)}; "
            f"received method={method!r}."
        )
    if packing.is_map(y_pred.shape):  # one row of logits per position
        rows, restore = packing.positions_as_rows(y_pred)
        return restore(class_probabilities(rows, method, num_samples, seed))
    mean, second = packing.unpack(y_pred)
    full = len(second.shape) == 3
    variance = ops.diagonal(second, axis1=-2, axis2=-1) if full else second
    if method == "mean":
        return _floor_and_normalise(ops.softmax(mean, axis=-1))
    if method == "probit":
        # Var(a_j - a_i) = S_ii + S_jj - 2 S_ij, (batch, C, C); log p_i by a logsumexp over j.
        cross = second if full else moments.diag_embed(variance)
        difference_var = variance[:, :, None] + variance[:, None, :] - 2.0 * cross
        scale = ops.sqrt(1.0 + (math.pi / 8.0) * ops.maximum(difference_var, 0.0))
        log_p = -ops.logsumexp((mean[:, None, :] - mean[:, :, None]) / scale, axis=-1)
        return _floor_and_normalise(ops.softmax(log_p, axis=-1))
    if method == "delta":
        p = ops.softmax(mean, axis=-1)
        s_p = ops.einsum("bij,bj->bi", second, p) if full else variance * p
        p_s_p = ops.sum(p * s_p, axis=-1, keepdims=True)
        p_var = ops.sum(p * variance, axis=-1, keepdims=True)
        probs = ops.maximum(p * (1.0 + p_s_p - s_p + 0.5 * variance - 0.5 * p_var), 0.0)
        return _floor_and_normalise(probs)
    classes = mean.shape[-1]
    noise = keras.random.normal((num_samples,) + tuple(mean.shape), dtype=mean.dtype, seed=seed)
    if full:
        jitter = 1e-6 * ops.eye(classes, dtype=mean.dtype)
        chol = ops.cholesky(second + jitter)
        logits = mean + ops.einsum("bij,sbj->sbi", chol, noise)
    else:
        logits = mean + ops.sqrt(variance) * noise
    return _floor_and_normalise(ops.mean(ops.softmax(logits, axis=-1), axis=0))


def expected_calibration_error(probabilities, labels, num_bins=15):
    """Expected calibration error of the top-class confidence (equal-width bins).

    Args:
        probabilities: `(batch, C)` class probabilities.
        labels: integer labels `(batch,)`.
        num_bins: number of confidence bins.

    Returns:
        Scalar: `sum_b (n_b / n) |accuracy_b - confidence_b|`.
    """
    probabilities = ops.convert_to_tensor(probabilities)
    labels = ops.cast(ops.reshape(ops.convert_to_tensor(labels), (-1,)), "int32")
    confidence = ops.max(probabilities, axis=-1)
    correct = ops.cast(ops.argmax(probabilities, axis=-1) == labels, confidence.dtype)
    bins = ops.minimum(ops.cast(confidence * num_bins, "int32"), num_bins - 1)
    one_hot = ops.one_hot(bins, num_bins, dtype=confidence.dtype)  # (batch, bins)
    gap = ops.abs(ops.sum(one_hot * (correct - confidence)[:, None], axis=0))
    return ops.sum(gap) / ops.cast(ops.shape(confidence)[0], confidence.dtype)


# ---------------------------------------------------------------- sampled outputs


def _sample_axis(samples, name="samples"):
    samples = ops.convert_to_tensor(samples)
    if len(samples.shape) != 3:
        raise ValueError(
            f"Argument `{name}` must be output samples of shape (batch, samples, units) (a "
            f"GlobalInducingDense model's output); received shape {tuple(samples.shape)}."
        )
    return samples


def sampled_regression_moments(samples):
    """Predictive mean and variance from sampled regression outputs.

    Args:
        samples: `(batch, S, 2 D)`: function values `f_s`, then log noise variances `l_s`
            (the output of `SampledHomoscedasticNoise`), e.g. from `predict_samples`.

    Returns:
        Dict of `(batch, D)` tensors: `mean` (of `f`), `variance` (= `epistemic +
        aleatoric`), `epistemic` (variance of `f` over samples) and `aleatoric` (mean of
        `exp(l)`).
    """
    samples = _sample_axis(samples)
    units = samples.shape[-1]
    if units % 2:
        raise ValueError(
            f"Argument `samples` must have 2 D units (D values, D log-variances); received {units}."
        )
    dims = units // 2
    f, log_var = samples[..., :dims], samples[..., dims:]
    mean = ops.mean(f, axis=1)
    epistemic = ops.mean(ops.square(f - mean[:, None, :]), axis=1)
    aleatoric = ops.mean(moments.safe_exp(log_var), axis=1)
    return {"mean": mean, "variance": epistemic + aleatoric, "epistemic": epistemic, "aleatoric": aleatoric}


def sampled_log_predictive_density(samples, y, y_scale=1.0):
    """`log (1/S) sum_s N(y | f_s, exp(l_s))`: the Monte Carlo predictive log density, summed
    over target dimensions, in original units (`- D log(y_scale)`).

    Args:
        samples: `(batch, S, 2 D)` sampled regression outputs.
        y: targets `(batch,)` or `(batch, D)`.
        y_scale: standard deviation used to normalise the targets.

    Returns:
        `(batch,)` log densities.
    """
    samples = _sample_axis(samples)
    dims = samples.shape[-1] // 2
    f, log_var = samples[..., :dims], samples[..., dims:]
    y = ops.cast(validation.regression_targets(ops.convert_to_tensor(y), dims, "keras_dvi.predictive"), f.dtype)
    log_n = -0.5 * (_LOG_2PI + log_var + ops.square(y[:, None, :] - f) * moments.safe_exp(-log_var))
    log_n = ops.sum(log_n, axis=-1)
    count = samples.shape[1]
    return ops.logsumexp(log_n, axis=1) - math.log(count) - dims * math.log(y_scale)


def sampled_class_probabilities(samples):
    """Class probabilities `(1/S) sum_s softmax(a_s)` from sampled logits `(batch, S, C)`."""
    samples = _sample_axis(samples)
    return ops.mean(ops.softmax(samples, axis=-1), axis=1)


# ---------------------------------------------------------------- models


def _sampled_call(model, x, context):
    """Calls `model` on `x` with every layer sampling under `context`."""
    with sampling.sampling_scope(model, context):
        return model(x, training=False)


def _largest_kernel(model):
    sizes = [
        math.prod(v.shape)
        for v in getattr(model, "weights", [])
        if len(v.shape) >= 2
    ]
    return max(sizes, default=1)


#: Channels assumed per input value when sizing chunks for image inputs (feature maps grow
#: with the channels of the conv layers).
_MAP_GROWTH = 64


def _inputs_of(model, x):
    """`x` as tensors: one, or a structure of them for a model with several inputs."""
    if len(getattr(model, "inputs", None) or ()) > 1 and isinstance(x, (list, tuple, dict)):
        return keras.tree.map_structure(ops.convert_to_tensor, x)
    return ops.convert_to_tensor(x)


def weight_samples(model, x, num_samples, seed=None, chunk_size=None):
    """Output samples of `model` under weights drawn from the variational posterior.

    Every keras-dvi layer draws its kernel and bias from its factorised Gaussian posterior,
    independently per sample, the same weights for every row of `x` (so each sample is one
    function), and applies the activation deterministically. Samples are drawn in chunks to
    bound memory.

    Args:
        model: a keras-dvi layer or a `keras.Model` whose layers are keras-dvi layers
            (deterministic preprocessing layers before the first keras-dvi layer are fine).
        x: deterministic inputs, array or tensor of shape `(batch, features)` (a conv network's:
            `(batch, *spatial, channels)`); a list or dict of them for a model with several
            inputs.
        num_samples: number of weight draws (positive integer).
        seed: integer seed for reproducibility, or `None`.
        chunk_size: weight draws per forward pass; default keeps each sampled kernel under
            about 25 million numbers.

    Returns:
        NumPy array of shape `(batch, num_samples, units)` (a feature map's:
        `(batch, num_samples, *spatial, channels)`): the output pre-activations or
        activations of the last layer, as the deterministic layers describe them. A model with
        several outputs gives them in the same structure (list, tuple or dict), every output
        under the same weight draws.

    Examples:
        >>> samples = keras_dvi.predict_samples(model, x, num_samples=20000, seed=0)
        >>> mc_mean, mc_var = samples.mean(1), samples.var(1)
    """
    if int(num_samples) != num_samples or num_samples < 1:
        raise ValueError(
            f"Argument `num_samples` must be a positive integer; received {num_samples!r}."
        )
    x = _inputs_of(model, x)
    for tensor in keras.tree.flatten(x):
        if len(tensor.shape) < 2:
            raise ValueError(
                "Argument `x` must be deterministic inputs of shape (batch, features) (conv networks: "
                f"(batch, *spatial, channels)); received shape {tuple(tensor.shape)}. Sample Gaussian inputs "
                "yourself and pass them as rows."
            )
        validation.check_finite(tensor, "x")
    if chunk_size is None:
        per_sample = _largest_kernel(model)
        for tensor in keras.tree.flatten(x):
            if len(tensor.shape) > 2:  # feature maps: the activations dominate
                per_sample = max(per_sample, math.prod(tensor.shape) * _MAP_GROWTH)
        chunk_size = max(1, int(2.5e7 // per_sample))
    elif int(chunk_size) != chunk_size or chunk_size < 1:
        raise ValueError(
            f"Argument `chunk_size` must be a positive integer or None; received {chunk_size!r}."
        )
    generator = keras.random.SeedGenerator(seed)
    chunks = []
    remaining = int(num_samples)
    while remaining > 0:
        size = min(int(chunk_size), remaining)
        structure = _sampled_call(model, x, sampling.SamplingContext(size, generator))
        outputs = [ops.convert_to_numpy(out) for out in keras.tree.flatten(structure)]
        for out in outputs:
            if out.ndim < 3 or out.shape[0] != size:
                raise ValueError(
                    "Monte Carlo over the weights needs a model built from keras-dvi layers: its output had "
                    f"shape {out.shape}, expected (samples, batch, units)."
                )
        chunks.append(outputs)
        remaining -= size
    samples = [np.swapaxes(np.concatenate(parts, axis=0), 0, 1) for parts in zip(*chunks)]
    return keras.tree.pack_sequence_as(structure, samples)


def set_sampling_seed(model, seed):
    """Restarts the weight draws of every sampling layer of `model` (`GlobalInducingDense`,
    `DenseMCVI`, `Conv1DMCVI`, `Conv2DMCVI`) from `seed`.

    Seed generator states are not part of a saved `.keras` file; after `set_sampling_seed`
    with the same seed, a model and its saved-and-loaded copy draw the same weights, so
    `model.predict` returns the same numbers.

    Args:
        model: a Keras model with sampling layers.
        seed: integer seed.

    Examples:
        >>> keras_dvi.set_sampling_seed(model, 0)
        >>> first = model.predict(x_test)
        >>> keras_dvi.set_sampling_seed(model, 0)
        >>> np.testing.assert_array_equal(first, model.predict(x_test))
    """
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"Argument `seed` must be an integer; received {seed!r}.")
    layers = [layer for layer in network.layers_of(model) if hasattr(layer, "seed_generator")]
    for i, layer in enumerate(layers):
        state = layer.seed_generator.state
        layer.seed_generator.state.assign(np.array([seed + 7919 * i, 0], dtype=state.dtype))


def predict_samples(model, x, num_samples, batch_size=None, verbose=0, seed=None):
    """Output samples of any keras-dvi model, as a NumPy array `(n, num_samples, units)`.

    * A sampled model (`GlobalInducingDense`, `DenseMCVI`, `Conv2DMCVI` layers):
      `model.predict(x)` with the sample count of its first such layer set to `num_samples` for
      this call (the model's own setting is restored afterwards). `seed` first restarts its
      layers' draws (`keras_dvi.set_sampling_seed`).
    * A moment-propagating model (`DenseDVI`, `DenseDiagDVI`, `SkipDVI`, `Conv2DDVI`, ...):
      the Monte Carlo reference, every keras-dvi layer running ordinary forward passes with
      weights drawn from its posterior (the same weights for every row of `x`, so each sample
      is one function); `seed` seeds the draws.

    The result is ready for `sampled_regression_moments`, `sampled_log_predictive_density` or
    `sampled_class_probabilities`.

    Args:
        model: a keras-dvi model.
        x: inputs `(n, features)` (conv networks: `(n, *spatial, channels)`); a list or dict
            of them for a model with several inputs.
        num_samples: weight samples (positive integer).
        batch_size: rows per forward pass (default: `model.predict`'s for sampled models, all
            rows at once for moment models).
        verbose: `model.predict` verbosity (sampled models).
        seed: integer seed for reproducible draws, or `None` (moment models in batches still
            draw one set of weights for all batches).

    Returns:
        A NumPy array `(n, num_samples, units)` (a feature map's: `(n, num_samples, *spatial,
        channels)`); for a moment-propagating model with several outputs, one such array per
        output in the model's output structure, all under the same weight draws.

    Examples:
        >>> samples = keras_dvi.predict_samples(model, x_test, num_samples=1000, seed=0)
        >>> mc_mean, mc_var = samples.mean(axis=1), samples.var(axis=1)
    """
    num_samples = validation.positive_integer("num_samples", num_samples)
    first = network.sampling_layer(model)
    if first is None:
        if batch_size is None:
            return weight_samples(model, x, num_samples, seed=seed)
        batch_size = validation.positive_integer("batch_size", batch_size)
        if seed is None:  # one seed for every batch: each sample is one function on all rows
            seed = int(np.random.default_rng().integers(2**31 - 1))
        x = keras.tree.map_structure(np.asarray, _inputs_of(model, x))
        rows = len(keras.tree.flatten(x)[0])
        batches = [weight_samples(model, keras.tree.map_structure(lambda t: t[i : i + batch_size], x), num_samples,
                                  seed=seed)
                   for i in range(0, rows, batch_size)]
        return keras.tree.map_structure(lambda *parts: np.concatenate(parts, axis=0), *batches)
    if seed is not None:
        set_sampling_seed(model, seed)
    previous = first.num_samples
    first.num_samples = num_samples
    model.predict_function = None  # retrace with the new sample count
    try:
        return model.predict(x, batch_size=batch_size, verbose=verbose)
    finally:
        first.num_samples = previous
        model.predict_function = None


REGRESSION, CLASSIFICATION = "regression", "classification"
_TASK_OF_LOSS = {
    losses.HeteroscedasticELL: REGRESSION,
    losses.SampledHeteroscedasticELL: REGRESSION,
    losses.SoftmaxDeltaELL: CLASSIFICATION,
    losses.SampledSoftmaxELL: CLASSIFICATION,
}


def _task_of_loss(loss):
    for cls, name in _TASK_OF_LOSS.items():
        if isinstance(loss, cls):
            return name
    raise ValueError(
        "keras_dvi.predict could not tell the task from the model's loss "
        f"({type(loss).__name__ if loss is not None else 'not compiled'}): pass "
        "`task='regression'` or `task='classification'`."
    )


def _tasks(model, task):
    """The task of the model's output: one name, or for a model compiled with one loss per
    output, a dict (named outputs) or list of names."""
    if task is not None:
        if task not in (REGRESSION, CLASSIFICATION):
            raise ValueError(f"Argument `task` must be 'regression' or 'classification'; received {task!r}.")
        return task
    loss = getattr(model, "loss", None)
    if hasattr(loss, "items"):  # (Keras wraps a dict of losses)
        return {name: _task_of_loss(value) for name, value in loss.items()}
    if keras.tree.is_nested(loss):
        return [_task_of_loss(value) for value in loss]
    return _task_of_loss(loss)


def predict(model, x, task=None, level=0.95, num_samples=100, batch_size=None, probability_method="mean"):
    """Predictions of a keras-dvi model, as a dict of NumPy arrays.

    Regression (a `HeteroscedasticELL` / `SampledHeteroscedasticELL` model, in the targets' own
    units when it ends in `TargetScaling`; a regression `TAGIModel`), each `(n, D)`:

    * `mean`, `std` and `variance` of the predictive distribution (Wu et al. 2019, eq. 9),
    * `epistemic` and `aleatoric`: the two parts of `variance` (weight uncertainty; noise),
    * `lower`, `upper`: the central interval of probability `level` (Gaussian predictive;
      for sampled models, a Gaussian with the mixture's mean and variance).

    Classification (`SoftmaxDeltaELL` / `SampledSoftmaxELL`; a `TAGIModel` with `classes`):

    * `probabilities` `(n, C)` (`class_probabilities` with `probability_method`; sampled
      models: the mean softmax of the samples), `label` `(n,)` the most probable class,
      `entropy` `(n,)` the predictive entropy in nats (high: uncertain or out of
      distribution).

    Args:
        model: a trained keras-dvi model.
        x: inputs (anything `model.predict` takes).
        task: `"regression"` or `"classification"`; `None` reads it from the compiled loss.
        level: probability of the interval (regression).
        num_samples: weight samples per input for models with a sample axis (`DenseMCVI`,
            `GlobalInducingDense`).
        batch_size: as in `model.predict`.
        probability_method: method of `class_probabilities` for DVI classifiers: `"mean"`
            (default, calibrated in distribution) or `"probit"` (for inputs that may be
            shifted or out of distribution).

    A dense prediction (segmentation, per-pixel regression: the output a feature map) gets
    every position's summary: probabilities `(n, *spatial, C)`, label and entropy `(n,
    *spatial)`; regression entries `(n, *spatial, D)`.

    A model with several outputs, compiled with a keras-dvi loss per output (a dict or list of
    losses), gets a summary per output, in the structure of `model.predict`'s outputs (a dict
    for named outputs); `task` then applies to every output.

    Returns:
        A dict of NumPy arrays, as above (per output for a model with several).

    Examples:
        >>> out = keras_dvi.predict(model, x_test)
        >>> out["mean"], out["std"], out["lower"], out["upper"]
    """
    validation.check_structure(model)
    own = getattr(model, "predictive_distribution", None)
    if callable(own):  # a model that states its own (`TAGIModel`: fixed noise, the binary tree)
        return own(model.predict(x, batch_size=batch_size, verbose=0), level=level)
    tasks = _tasks(model, task)
    quantile = central_quantile(level) if REGRESSION in keras.tree.flatten(tasks) else None  # checks `level`
    sampled = network.sampling_layer(model) is not None
    if sampled:
        y_pred = predict_samples(model, x, num_samples, batch_size=batch_size)
    else:
        y_pred = model.predict(x, batch_size=batch_size, verbose=0)

    def summary(y_pred, task):
        if task == CLASSIFICATION:
            if sampled:
                probs = np.asarray(sampled_class_probabilities(y_pred))
            else:
                probs = np.asarray(class_probabilities(y_pred, method=probability_method))
            entropy = -np.sum(probs * np.log(probs), axis=-1)
            return {"probabilities": probs, "label": probs.argmax(-1), "entropy": entropy}
        parts = sampled_regression_moments(y_pred) if sampled else regression_moments(y_pred)
        out = {name: np.asarray(value) for name, value in parts.items()}
        out["std"] = np.sqrt(out["variance"])
        half = quantile * out["std"]
        out["lower"], out["upper"] = out["mean"] - half, out["mean"] + half
        return out

    if isinstance(tasks, str):  # one task for every output
        tasks = keras.tree.map_structure(lambda _: tasks, y_pred)
    elif isinstance(tasks, dict) and not isinstance(y_pred, dict):  # (losses named by output, outputs listed)
        tasks = [tasks[name] for name in model.output_names]
    return keras.tree.map_structure(summary, y_pred, tasks)
