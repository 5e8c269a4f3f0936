"""Model-level helpers for networks of `GlobalInducingDense` layers.

* `initialize_from_data(model, x, y)`: the paper's initialisation (Ober & Aitchison 2021,
  Appendix O): inducing inputs from training inputs, the output layer's pseudo-outputs from
  the matching targets.
* `predict_samples(model, x, num_samples)`: output samples `(n, num_samples, units)` of any
  keras-dvi model (sampled models through `model.predict`, moment models by Monte Carlo over
  their weights).
"""

import keras
import numpy as np

from keras_dvi import network, sampling, validation
from keras_dvi.layers.global_inducing_dense import GlobalInducingDense


def global_inducing_layers(model):
    """The `GlobalInducingDense` layers of `model`, in call order."""
    return [layer for layer in network.layers_of(model) if isinstance(layer, GlobalInducingDense)]


def _first_and_output(model):
    layers = global_inducing_layers(model)
    if not layers:
        raise ValueError("Argument `model` has no GlobalInducingDense layer.")
    first = [layer for layer in layers if layer._is_first]
    output = [layer for layer in layers if layer.output_layer]
    if not first or not layers[0].built:
        raise ValueError("Argument `model` must be built (called on data or given an Input).")
    return first[0], (output[0] if output else None)


def initialize_from_data(model, x, y=None, seed=None):
    """Sets the inducing inputs (and the output layer's pseudo-outputs) from training data.

    The inducing inputs `U0` become `M` training inputs drawn without replacement (the
    features at the first `GlobalInducingDense` layer, when deterministic layers come before
    it); with fewer than `M` examples the remaining rows are `N(0, 1)`. The output layer's
    pseudo-outputs `V` become the targets of the same examples (regression; integer labels
    are one-hot encoded), so that with `U0 = X` and `V = Y` the top layer's posterior is
    Bayesian linear regression on the propagated features (paper eq. 8).

    Args:
        model: a built Keras model with `GlobalInducingDense` layers.
        x: training inputs (array).
        y: training targets `(n,)`/`(n, D)`, or integer labels; `None` leaves `V` as is.
        seed: seed of the row choice.
    """
    first, output = _first_and_output(model)
    x = np.asarray(x)
    rng = np.random.default_rng(seed)
    m = first.num_inducing
    take = min(m, len(x))
    rows = rng.choice(len(x), size=take, replace=False)
    features = x[rows]
    if first.input is not model.inputs[0]:
        features = keras.Model(model.inputs, first.input).predict(features, verbose=0)
    inducing = rng.standard_normal((m, first.fan_in))
    inducing[:take] = np.asarray(features).reshape(take, first.fan_in)
    first.inducing_inputs.assign(inducing.astype(first.inducing_inputs.dtype))
    if y is None or output is None:
        return
    y = np.asarray(y)[rows]
    units = output.units
    if y.ndim == 1 or (y.ndim == 2 and y.shape[1] == 1 and units > 1):
        if units == 1:
            y = y.reshape(-1, 1)
        else:
            y = np.eye(units)[y.reshape(-1).astype(int)]
    if y.shape[1:] != (units,):
        raise ValueError(
            f"Argument `y` must have shape (n, {units}) (or integer labels) to initialise the "
            f"pseudo-outputs of {output.name!r}; received rows of shape {y.shape[1:]}."
        )
    pseudo = keras.ops.convert_to_numpy(output.pseudo_outputs).copy()
    pseudo[:take] = y
    output.pseudo_outputs.assign(pseudo.astype(output.pseudo_outputs.dtype))


def sampling_layer(model):
    """The layer that sets the sample axis of a sampled model (the first with a `num_samples`
    setting: `GlobalInducingDense`, `DenseMCVI`), or `None` for a moment-propagating model."""
    for layer in network.layers_of(model):
        if hasattr(layer, "num_samples") and hasattr(layer, "seed_generator"):
            return layer
    return None


def predict_samples(model, x, num_samples, batch_size=None, verbose=0, seed=None):
    """Output samples of any keras-dvi model, as a NumPy array `(n, num_samples, units)`.

    * A sampled model (`GlobalInducingDense` or `DenseMCVI` layers): `model.predict(x)` with
      the sample count of its first such layer set to `num_samples` for this call (the
      model's own setting is restored afterwards). `seed` first restarts its layers' draws
      (`set_sampling_seed`).
    * A moment-propagating model (`DenseDVI`, `DenseDiagDVI`, `SkipDVI`, ...): the Monte
      Carlo reference, every keras-dvi layer running ordinary forward passes with weights
      drawn from its posterior (`keras_dvi.sampling.weight_samples`; the same weights for
      every row of `x`, so each sample is one function); `seed` seeds the draws.

    The result is ready for `keras_dvi.predictive.sampled_regression_moments`,
    `sampled_log_predictive_density` or `sampled_class_probabilities`.

    Args:
        model: a keras-dvi model.
        x: inputs `(n, features)`.
        num_samples: weight samples (positive integer).
        batch_size: rows per forward pass (default: `model.predict`'s for sampled models, all
            rows at once for moment models).
        verbose: `model.predict` verbosity (sampled models).
        seed: integer seed for reproducible draws, or `None` (moment models in batches still
            draw one set of weights for all batches).
    """
    num_samples = validation.positive_integer("num_samples", num_samples)
    first = sampling_layer(model)
    if first is None:
        if batch_size is None:
            return sampling.weight_samples(model, x, num_samples, seed=seed)
        batch_size = validation.positive_integer("batch_size", batch_size)
        if seed is None:  # one seed for every batch: each sample is one function on all rows
            seed = int(np.random.default_rng().integers(2**31 - 1))
        x = np.asarray(x)
        return np.concatenate([sampling.weight_samples(model, x[i : i + batch_size], num_samples, seed=seed)
                               for i in range(0, len(x), batch_size)], axis=0)
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


def set_sampling_seed(model, seed):
    """Restarts the weight draws of every sampling layer of `model` (`GlobalInducingDense`,
    `DenseMCVI`) from `seed`.

    Seed generator states are not part of a saved `.keras` file; after `set_sampling_seed`
    with the same seed, a model and its saved-and-loaded copy draw the same weights, so
    `model.predict` returns the same numbers.
    """
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"Argument `seed` must be an integer; received {seed!r}.")
    layers = [layer for layer in network.layers_of(model) if hasattr(layer, "seed_generator")]
    for i, layer in enumerate(layers):
        state = layer.seed_generator.state
        layer.seed_generator.state.assign(np.array([seed + 7919 * i, 0], dtype=state.dtype))
