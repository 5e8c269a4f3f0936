"""Layers on keras-dvi feature maps without weights: pooling, global pooling, flatten and the
residual addition (`keras_dvi.conv_moments` holds their maths)."""

import math
import warnings

import keras
from keras import ops

from keras_dvi import conv_moments, moments, packing, sampling, validation
from keras_dvi.layers.base import apply_activation
from keras_dvi.layers.boundary import KerasDVILayer, producer_of
from keras_dvi.layers.conv_dvi import PADDINGS, _integers, output_size


class MapLayer(KerasDVILayer):
    """Base class: a layer without weights that reads packed keras-dvi feature maps
    `(batch, 3, *spatial, channels)` (with `rank` spatial axes; any rank if `rank` is `None`),
    and in `keras_dvi.predict_samples` the sampled maps `(samples, batch, *spatial, channels)`."""

    rank = None

    def __init__(self, **kwargs):
        kwargs.setdefault("autocast", False)  # moments in float32 even under mixed precision
        super().__init__(**kwargs)

    def takes_packed(self, shape):
        return len(shape) >= 4 if self.rank is None else len(shape) == self.rank + 3

    @property
    def moment_dtype(self):
        """float32 under a mixed precision policy, else the compute dtype (as `BayesianLayer`)."""
        dtype = keras.backend.standardize_dtype(self.compute_dtype)
        return "float32" if dtype in ("float16", "bfloat16") else dtype

    def _map_rank(self, shape):
        rank = self.rank if self.rank is not None else len(shape) - 3
        if isinstance(shape, (list, tuple)) and shape and isinstance(shape[0], (list, tuple)):
            rank = self.rank if self.rank is not None else len(shape[0]) - 2
        return rank

    def _structure(self, input_shape):
        kind, spatial, channels = packing.structure_of_map(input_shape, self._map_rank(input_shape))
        if kind == packing.DETERMINISTIC:
            raise ValueError(
                f"{type(self).__name__} {self.name!r} takes the packed output of a keras-dvi conv or "
                f"pooling layer (batch, 3, *spatial, channels); received data of shape "
                f"{tuple(input_shape)}. On data, use the plain Keras layer (e.g. keras.layers.MaxPooling2D)."
            )
        return spatial, channels

    def _split(self, inputs):
        """`(mean, variance, shared)` of packed inputs, in the moment dtype, checked."""
        shape = (tuple(inputs[0].shape), tuple(inputs[1].shape)) if isinstance(inputs, (list, tuple)) else tuple(inputs.shape)
        self._structure(shape)
        mean, variance, shared, kind = packing.split_map(inputs, self._map_rank(shape))
        dtype = self.moment_dtype
        mean, variance, shared = (ops.cast(t, dtype) for t in (mean, variance, shared))
        mean, variance = validation.check_moments(mean, variance, kind, "inputs",
                                                  where=f"{type(self).__name__} {self.name!r}")
        return mean, variance, shared

    def call(self, inputs):
        context = sampling.current_context()
        if context is not None:
            return self._sample(inputs)
        return self._propagate(*self._split(inputs))

    def _propagate(self, mean, variance, shared):
        raise NotImplementedError

    def _sample(self, samples):
        raise NotImplementedError


def _per_sample(function, samples):
    """Applies a batched map function to `(samples, batch, ...)` tensors, samples folded into
    the batch."""
    shape = ops.shape(samples)
    out = function(ops.reshape(samples, (-1,) + tuple(shape[2:])))
    return ops.reshape(out, (shape[0], shape[1]) + tuple(ops.shape(out)[1:]))


class PoolingDVI(MapLayer):
    """Base class of the local pooling layers (Keras' pooling arguments, channels last)."""

    def __init__(self, pool_size=2, strides=None, padding="valid", **kwargs):
        super().__init__(**kwargs)
        self.pool_size = _integers("pool_size", pool_size, self.rank)
        self.strides = self.pool_size if strides is None else _integers("strides", strides, self.rank)
        if not isinstance(padding, str) or padding.lower() not in PADDINGS:
            raise ValueError(f"Argument `padding` must be 'valid' or 'same'; received padding={padding!r}.")
        self.padding = padding.lower()

    def compute_output_shape(self, input_shape):
        spatial, channels = self._structure(input_shape)
        out = tuple(output_size(n, k, s, self.padding) for n, k, s in zip(spatial, self.pool_size, self.strides))
        if any(n is not None and n < 1 for n in out):
            raise ValueError(f"Layer {self.name!r}: inputs of spatial shape {tuple(spatial)} are smaller than "
                             f"its pool size {self.pool_size} with padding='valid'.")
        return packing.map_shape(input_shape, out, channels)

    def _arguments(self):
        return {"pool_size": self.pool_size, "strides": self.strides, "padding": self.padding}

    def get_config(self):
        config = super().get_config()
        config.update(self._arguments())
        return config


class MaxPoolingDVI(PoolingDVI):
    def __init__(self, pool_size=2, strides=None, padding="valid", activation=None, **kwargs):
        super().__init__(pool_size, strides, padding, **kwargs)
        self.activation = moments.canonical_activation(activation)

    def compute_output_spec(self, *args, **kwargs):
        inputs = args[0] if args else kwargs.get("inputs")
        producer = producer_of(inputs) if keras.utils.is_keras_tensor(inputs) else None
        if getattr(producer, "activation", "linear") != "linear" and not getattr(producer, "warned_pooling", False):
            producer.warned_pooling = True
            warnings.warn(
                f"{type(self).__name__} {self.name!r} follows {type(producer).__name__} {producer.name!r}, "
                f"which applies activation={producer.activation!r}: the max is then taken of non-Gaussian "
                "activations, and its moments are less accurate (means off by up to 0.4 predictive "
                "sd, BENCHMARKS.md). Move the activation to the pooling layer, the same function "
                "(the max commutes with monotone activations): "
                f"`{type(producer).__name__}(..., activation=None)`, "
                f"`{type(self).__name__}(..., activation={producer.activation!r})`.",
                UserWarning,
                stacklevel=2,
            )
        return super().compute_output_spec(*args, **kwargs)

    def _propagate(self, mean, variance, shared):
        if any(n is None for n in mean.shape[1:-1]):
            raise ValueError(f"{type(self).__name__} needs inputs of known spatial shape; received {tuple(mean.shape)}.")
        pooled = conv_moments.max_pool_moments(mean, variance, shared, **self._arguments())
        return packing.pack_map(*conv_moments.activation_moments(*pooled, self.activation))

    def _sample(self, samples):
        return apply_activation(_per_sample(lambda x: ops.max_pool(x, **self._arguments()), samples), self.activation)

    def get_config(self):
        config = super().get_config()
        config["activation"] = None if self.activation == "linear" else self.activation
        return config


class AveragePoolingDVI(PoolingDVI):
    def _propagate(self, mean, variance, shared):
        return packing.pack_map(*conv_moments.average_pool_moments(mean, variance, shared, **self._arguments()))

    def _sample(self, samples):
        return _per_sample(lambda x: ops.average_pool(x, **self._arguments()), samples)


_POOL_DOC = """{kind} pooling on keras-dvi feature maps ({rank}D), arguments as `keras.layers.{keras_name}`.

    {how}

    Args:
        pool_size: positive integer or tuple of {rank} (default 2).
        strides: positive integer or tuple, or `None` (default: `pool_size`).
        padding: `"valid"` (default) or `"same"`.{extra_args}

    Input shape:
        A packed feature map `(batch, 3, {dims}, channels)` from a keras-dvi conv or pooling
        layer.

    Output shape:
        Packed `(batch, 3, {new_dims}, channels)`.
    """
_MAX_HOW = """The moments of the maximum of Gaussians by Clark's (1961) recursion: the maximum of two
    Gaussians is taken as Gaussian with its exact mean and variance (correlations from the
    units' shared components), then compared with the next element of the window. Taking the
    element with the largest mean and its variance instead (as some libraries do) ignores the
    others' chance of being largest and under-states both mean and variance.

    **Put the activation here, not on the conv layer before it.** The max commutes with the
    monotone activations (`relu(max(a)) = max(relu(a))`), so
    `Conv{rank}DDVI(32, 3)` + `MaxPooling{rank}DDVI(2, activation="relu")` is the same function as
    `Conv{rank}DDVI(32, 3, activation="relu")` + `MaxPooling{rank}DDVI(2)`, but the max is
    taken of the Gaussian pre-activations, where Clark's recursion is accurate (variances
    0.94 of Monte Carlo in 2x2 windows), instead of rectified ones (a point mass at 0), where
    its means are off by up to 0.4 sd (BENCHMARKS.md, "Convolutional networks"). Building
    the second form warns."""
_AVERAGE_HOW = """The window average of Gaussian units: exact within keras-dvi's representation (the
    shared components add coherently, the independent parts as independent variables)."""


_MAX_ARGS = """
        activation: `None` (default), `"relu"`, `"heaviside"` or `"leaky_relu"`, applied to the
            max (see above)."""


def _doc(kind, rank, how):
    dims, new_dims = ("steps", "new_steps") if rank == 1 else ("rows, cols", "new_rows, new_cols")
    return _POOL_DOC.format(kind=kind, rank=rank, keras_name=f"{kind}Pooling{rank}D", how=how.format(rank=rank),
                            dims=dims, new_dims=new_dims, extra_args=_MAX_ARGS if kind == "Max" else "")


@keras.saving.register_keras_serializable(package="keras_dvi")
class MaxPooling1DDVI(MaxPoolingDVI):
    __doc__ = _doc("Max", 1, _MAX_HOW)
    rank = 1


@keras.saving.register_keras_serializable(package="keras_dvi")
class MaxPooling2DDVI(MaxPoolingDVI):
    __doc__ = _doc("Max", 2, _MAX_HOW)
    rank = 2


@keras.saving.register_keras_serializable(package="keras_dvi")
class AveragePooling1DDVI(AveragePoolingDVI):
    __doc__ = _doc("Average", 1, _AVERAGE_HOW)
    rank = 1


@keras.saving.register_keras_serializable(package="keras_dvi")
class AveragePooling2DDVI(AveragePoolingDVI):
    __doc__ = _doc("Average", 2, _AVERAGE_HOW)
    rank = 2


class GlobalAveragePoolingDVI(MapLayer):
    """Base class of `GlobalAveragePooling1DDVI` / `GlobalAveragePooling2DDVI`."""

    def compute_output_shape(self, input_shape):
        _, channels = self._structure(input_shape)
        return packing.packed_shape(input_shape, channels, full=False)

    def _propagate(self, mean, variance, shared):
        return packing.pack(*conv_moments.global_average_pool_moments(mean, variance, shared))

    def _sample(self, samples):
        return ops.mean(samples, axis=tuple(range(2, len(samples.shape) - 1)))


_GLOBAL_DOC = """The mean over all positions of a keras-dvi feature map ({rank}D), as
    `keras.layers.GlobalAveragePooling{rank}D`, in the dense keras-dvi form.

    Exact within keras-dvi's representation: each channel's shared component adds coherently,
    the independent parts as independent variables; the channels of the result are
    independent. Follow it with `DenseDiagDVI` or `DenseDVI`.

    Input shape:
        A packed feature map `(batch, 3, {dims}, channels)`.

    Output shape:
        Packed `(batch, 2, channels)`: means and variances.
    """


@keras.saving.register_keras_serializable(package="keras_dvi")
class GlobalAveragePooling1DDVI(GlobalAveragePoolingDVI):
    __doc__ = _GLOBAL_DOC.format(rank=1, dims="steps")
    rank = 1


@keras.saving.register_keras_serializable(package="keras_dvi")
class GlobalAveragePooling2DDVI(GlobalAveragePoolingDVI):
    __doc__ = _GLOBAL_DOC.format(rank=2, dims="rows, cols")
    rank = 2


@keras.saving.register_keras_serializable(package="keras_dvi")
class FlattenDVI(MapLayer):
    """Flattens a keras-dvi feature map of any rank into the dense keras-dvi form, in the order
    of `keras.layers.Flatten` (channels last).

    Keeps every unit's mean and variance. The shared components (the part of the variance the
    positions of a channel share) are dropped: the dense layer after it treats its inputs as
    independent, as every diagonal keras-dvi layer does. Measured against Monte Carlo on the
    benchmark's CNN (conv - pool - conv - pool - flatten - dense 128 - dense 10), keeping them
    through the flatten changed the output variances by under 2% (`keras_dvi.conv_moments`).

    Input shape:
        A packed feature map `(batch, 3, *spatial, channels)`.

    Output shape:
        Packed `(batch, 2, prod(spatial) * channels)`: means and variances, ready for
        `DenseDiagDVI` / `DenseDVI`.
    """

    def compute_output_shape(self, input_shape):
        spatial, channels = self._structure(input_shape)
        sizes = tuple(spatial) + (channels,)
        features = None if any(n is None for n in sizes) else math.prod(sizes)
        return packing.packed_shape(input_shape, features, full=False)

    def _propagate(self, mean, variance, shared):
        return packing.pack(*conv_moments.flatten_moments(mean, variance))

    def _sample(self, samples):
        shape = ops.shape(samples)
        return ops.reshape(samples, (shape[0], shape[1], -1))


@keras.saving.register_keras_serializable(package="keras_dvi")
class AddDVI(MapLayer):
    """Adds two keras-dvi feature maps of the same shape, for residual blocks
    (`keras.layers.Add` for moments), then applies an optional activation.

    **Assumption: the two branches are independent.** Means and variances add; each channel's
    two shared factors become one (the projection of every unit on its channel's sum). In a
    residual block `x + F(x)` the branches are correlated, since `F(x)` is computed from `x`:
    with mostly positive correlation the sum's variance is under-stated. For dense residual
    blocks, `SkipDVI` accounts for that correlation exactly (Stein's lemma); a conv residual
    block has no such closed form here. The measured error on a small residual CNN is in
    BENCHMARKS.md ("Convolutional networks").

    Args:
        activation: `None` (default), `"relu"`, `"heaviside"` or `"leaky_relu"`, applied to
            the sum (as in `relu(x + F(x))`).

    Input shape:
        A list of two packed feature maps `(batch, 3, *spatial, channels)` of the same shape.

    Output shape:
        Packed `(batch, 3, *spatial, channels)`.

    Example:

    >>> x = keras_dvi.Conv2DDVI(16, 3, padding="same", activation="relu", regularizer=prior)(inputs)
    >>> branch = keras_dvi.Conv2DDVI(16, 3, padding="same", activation="relu", regularizer=prior)(x)
    >>> branch = keras_dvi.Conv2DDVI(16, 3, padding="same", regularizer=prior)(branch)
    >>> x = keras_dvi.AddDVI(activation="relu")([x, branch])
    """

    def __init__(self, activation=None, **kwargs):
        super().__init__(**kwargs)
        self.activation = moments.canonical_activation(activation)

    def takes_packed(self, shape):
        return len(shape) >= 4

    def _shapes(self, input_shape):
        if not isinstance(input_shape, (list, tuple)) or len(input_shape) != 2 or not all(
                isinstance(s, (list, tuple)) for s in input_shape):
            raise ValueError(f"{type(self).__name__} takes a list of two packed feature maps; received {input_shape}.")
        first, second = (tuple(s) for s in input_shape)
        if len(first) != len(second) or any(a is not None and b is not None and a != b
                                            for a, b in zip(first[1:], second[1:])):
            raise ValueError(f"{type(self).__name__} adds feature maps of the same shape; received {first} and {second}.")
        for shape in (first, second):
            self._structure(shape)
        return first, second

    def build(self, input_shape):
        self._shapes(input_shape)

    def compute_output_shape(self, input_shape):
        first, _ = self._shapes(input_shape)
        spatial, channels = self._structure(first)
        return packing.map_shape(first, spatial, channels)

    def call(self, inputs):
        if sampling.current_context() is not None:  # (samples, batch, *spatial, channels) each
            return apply_activation(inputs[0] + inputs[1], self.activation)
        self._shapes([tuple(t.shape) for t in inputs])
        summed = conv_moments.add_moments(self._split(inputs[0]), self._split(inputs[1]))
        return packing.pack_map(*conv_moments.activation_moments(*summed, self.activation))

    def get_config(self):
        config = super().get_config()
        config["activation"] = None if self.activation == "linear" else self.activation
        return config
