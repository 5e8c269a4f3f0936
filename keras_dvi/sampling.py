"""Monte Carlo reference: run a keras-dvi model with weights drawn from the posterior.

`weight_samples` (public as `keras_dvi.predict_samples` for moment networks) is the
independent oracle that the deterministic moments are tested against, and a tool for users
to see how good the Gaussian approximation is on their own model. While it runs, every
keras-dvi layer switches from moment propagation to ordinary forward passes with sampled
weights (internally a sample axis in front of the batch axis; the result is returned as
`(batch, samples, units)`, the one sample-axis convention of keras-dvi).
"""

import math

import keras
import numpy as np
from keras import ops

from keras_dvi import network, validation


class SamplingContext:
    """What layers need to sample: the number of weight draws and a seed generator."""

    def __init__(self, num_samples, seed_generator):
        self.num_samples = int(num_samples)
        self.seed_generator = seed_generator


#: The attribute of a keras-dvi layer that holds the `SamplingContext` of the `weight_samples`
#: call running it (`None`, or absent, during ordinary moment propagation).
CONTEXT = "sampling_context"


class sampling_scope:  # noqa: N801 - a context manager, named as Keras' scopes are
    """Within `with sampling_scope(model, context):` every layer of `model` (nested models
    included, and `model` itself if it is a layer) samples under `context` instead of
    propagating moments: an explicit scope held by the layers while it is open, so no module
    holds state and no layer looks up who called it.

    Args:
        model: a keras-dvi layer or a `keras.Model`.
        context: the `SamplingContext`.
    """

    def __init__(self, model, context):
        self.layers = [model, *network.layers_of(model)]
        self.context = context

    def __enter__(self):
        for layer in self.layers:
            setattr(layer, CONTEXT, self.context)
        return self.context

    def __exit__(self, *exc_info):
        for layer in self.layers:
            setattr(layer, CONTEXT, None)
        return False


def current_context(layer):
    """The `SamplingContext` of the `weight_samples` call running `layer`, or `None` during
    ordinary moment propagation (`sampling_scope`)."""
    return getattr(layer, CONTEXT, None)


def _sampled_call(model, x, context):
    """Calls `model` on `x` with every layer sampling under `context`."""
    with sampling_scope(model, context):
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
            `(batch, *spatial, channels)`).
        num_samples: number of weight draws (positive integer).
        seed: integer seed for reproducibility, or `None`.
        chunk_size: weight draws per forward pass; default keeps each sampled kernel under
            about 25 million numbers.

    Returns:
        NumPy array of shape `(batch, num_samples, units)` (a feature map's:
        `(batch, num_samples, *spatial, channels)`): the output pre-activations or
        activations of the last layer, as the deterministic layers describe them.

    Examples:
        >>> samples = keras_dvi.predict_samples(model, x, num_samples=20000, seed=0)
        >>> mc_mean, mc_var = samples.mean(1), samples.var(1)
    """
    if int(num_samples) != num_samples or num_samples < 1:
        raise ValueError(
            f"Argument `num_samples` must be a positive integer; received {num_samples!r}."
        )
    x = ops.convert_to_tensor(x)
    if len(x.shape) < 2:
        raise ValueError(
            "Argument `x` must be deterministic inputs of shape (batch, features) (conv networks: "
            f"(batch, *spatial, channels)); received shape {tuple(x.shape)}. Sample Gaussian inputs "
            "yourself and pass them as rows."
        )
    validation.check_finite(x, "x")
    if chunk_size is None:
        per_sample = _largest_kernel(model)
        if len(x.shape) > 2:  # feature maps: the activations dominate
            per_sample = max(per_sample, math.prod(x.shape) * _MAP_GROWTH)
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
        out = ops.convert_to_numpy(_sampled_call(model, x, SamplingContext(size, generator)))
        if out.ndim < 3 or out.shape[0] != size:
            raise ValueError(
                "Monte Carlo over the weights needs a model built from keras-dvi layers: its output had "
                f"shape {out.shape}, expected (samples, batch, units)."
            )
        chunks.append(out)
        remaining -= size
    return np.swapaxes(np.concatenate(chunks, axis=0), 0, 1)


def sampling_layer(model):
    """The layer that sets the sample axis of a sampled model (the first with a `num_samples`
    setting: `GlobalInducingDense`, `DenseMCVI`, `Conv1DMCVI`, `Conv2DMCVI`), or `None` for a
    moment-propagating model."""
    for layer in network.layers_of(model):
        if hasattr(layer, "num_samples") and hasattr(layer, "seed_generator"):
            return layer
    return None


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
