"""Pooling layers on keras-dvi feature maps: max, average, global average and global max
pooling (`keras_dvi.conv_moments` holds their maths)."""

import warnings

import keras
from keras import ops

from keras_dvi import packing
from keras_dvi.layers.base import apply_activation
from keras_dvi.layers.feature_map import MapLayer, integers, output_size, per_sample
from keras_dvi.layers.feature_map import padding as _padding
from keras_dvi.maths import conv_moments, moments
from keras_dvi.packing import producer_of


def _pooling_arguments(layer, pool_size, strides, padding):
    """Sets Keras' pooling arguments on a local pooling layer of rank `layer.rank`."""
    layer.pool_size = integers("pool_size", pool_size, layer.rank)
    layer.strides = layer.pool_size if strides is None else integers("strides", strides, layer.rank)
    layer.padding = _padding(padding)


def _pooled_shape(layer, input_shape):
    """The channels-last packed output shape of a local pooling layer."""
    spatial, channels = layer._structure(input_shape)
    out = tuple(output_size(n, k, s, layer.padding) for n, k, s in zip(spatial, layer.pool_size, layer.strides))
    if any(n is not None and n < 1 for n in out):
        raise ValueError(f"Layer {layer.name!r}: inputs of spatial shape {tuple(spatial)} are smaller than "
                         f"its pool size {layer.pool_size} with padding='valid'.")
    return packing.map_shape(input_shape, out, channels)


def _window(layer):
    return {"pool_size": layer.pool_size, "strides": layer.strides, "padding": layer.padding}


def _warn_activation_before_max(layer, args, kwargs):
    """Warns (once per producer) when a max pooling `layer` is built on a layer that applies an
    activation itself: the max is then taken of non-Gaussian activations."""
    inputs = args[0] if args else kwargs.get("inputs")
    producer = producer_of(inputs) if keras.utils.is_keras_tensor(inputs) else None
    if getattr(producer, "activation", "linear") != "linear" and not getattr(producer, "warned_pooling", False):
        producer.warned_pooling = True
        warnings.warn(
            f"{type(layer).__name__} {layer.name!r} follows {type(producer).__name__} {producer.name!r}, "
            f"which applies activation={producer.activation!r}: the max is then taken of non-Gaussian "
            "activations, and its moments are less accurate (means off by up to 0.4 predictive "
            "sd, BENCHMARKS.md). Move the activation to the pooling layer, the same function "
            "(the max commutes with monotone activations): "
            f"`{type(producer).__name__}(..., activation=None)`, "
            f"`{type(layer).__name__}(..., activation={producer.activation!r})`.",
            UserWarning,
            stacklevel=3,
        )


def _activation_config(layer):
    return {"activation": None if layer.activation == "linear" else layer.activation}


def _global_output_shape(layer, input_shape):
    """The global poolings' dense output shape, `(batch, 2, channels)`."""
    _, channels = layer._structure(input_shape)
    return packing.packed_shape(input_shape, channels, full=False)


def _positions(samples):
    """The axes of the positions of weight samples `(batch, samples, *spatial, channels)`."""
    return tuple(range(2, len(samples.shape) - 1))


class MaxPoolingDVI(MapLayer):
    """Base class of `MaxPooling1DDVI` / `MaxPooling2DDVI` (see `MaxPooling2DDVI`)."""

    def __init__(self, pool_size=2, strides=None, padding="valid", data_format=None, activation=None, **kwargs):
        super().__init__(data_format=data_format, **kwargs)
        _pooling_arguments(self, pool_size, strides, padding)
        self.activation = moments.canonical_activation(activation)

    def _output_shape(self, input_shape):
        return _pooled_shape(self, input_shape)

    def compute_output_spec(self, *args, **kwargs):
        _warn_activation_before_max(self, args, kwargs)
        return super().compute_output_spec(*args, **kwargs)

    def _propagate(self, mean, variance, shared):
        if any(n is None for n in mean.shape[1:-1]):
            raise ValueError(f"{type(self).__name__} needs inputs of known spatial shape; received {tuple(mean.shape)}.")
        pooled = conv_moments.max_pool_moments(mean, variance, shared, **_window(self))
        return packing.pack_map(*conv_moments.activation_moments(*pooled, self.activation))

    def _sample(self, samples):
        pool = lambda x: ops.max_pool(x, **_window(self), data_format="channels_last")  # noqa: E731
        return apply_activation(per_sample(pool, samples), self.activation)

    def get_config(self):
        config = super().get_config()
        config.update(_window(self), **_activation_config(self))
        return config


class AveragePoolingDVI(MapLayer):
    """Base class of `AveragePooling1DDVI` / `AveragePooling2DDVI` (see `AveragePooling2DDVI`)."""

    def __init__(self, pool_size=2, strides=None, padding="valid", data_format=None, **kwargs):
        super().__init__(data_format=data_format, **kwargs)
        _pooling_arguments(self, pool_size, strides, padding)

    def _output_shape(self, input_shape):
        return _pooled_shape(self, input_shape)

    def _propagate(self, mean, variance, shared):
        return packing.pack_map(*conv_moments.average_pool_moments(mean, variance, shared, **_window(self)))

    def _sample(self, samples):
        return per_sample(lambda x: ops.average_pool(x, **_window(self), data_format="channels_last"), samples)

    def get_config(self):
        config = super().get_config()
        config.update(_window(self))
        return config


_POOL_DOC = """{kind} pooling on keras-dvi feature maps ({rank}D), arguments as `keras.layers.{keras_name}`.

    {how}

    Args:
        pool_size: positive integer or tuple of {rank} (default 2).
        strides: positive integer or tuple, or `None` (default: `pool_size`).
        padding: `"valid"` (default) or `"same"`.
        data_format: `"channels_last"` or `"channels_first"`; `None` (default) is
            `keras.config.image_data_format()`.{extra_args}

    Input shape:
        A packed feature map `(batch, 3, {dims}, channels)` from a keras-dvi conv or pooling
        layer (channels first: `(batch, 3, channels, {dims})`).

    Output shape:
        Packed `(batch, 3, {new_dims}, channels)` (channels first: `(batch, 3, channels,
        {new_dims})`).
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
    taken of the Gaussian pre-activations, where Clark's recursion is accurate, instead of
    rectified ones (a point mass at 0), where its means can be off by a large fraction of a
    predictive standard deviation. Building the second form warns."""
_AVERAGE_HOW = """The window average of Gaussian units: exact within keras-dvi's representation (the
    shared components add coherently, the independent parts as independent variables)."""


_MAX_ARGS = """
        activation: `None` (default), `"relu"`, `"heaviside"`, `"leaky_relu"`, `"relu6"`, `"hard_silu"`, `"hard_sigmoid"`,
            `"silu"`, `"gelu"`, `"sigmoid"` or `"tanh"`, applied to the max (see above)."""


#: The names of a map's spatial axes, by rank (docstrings).
DIMS = {1: "steps", 2: "rows, cols", 3: "depth, rows, cols"}


def _doc(kind, rank, how):
    dims = DIMS[rank]
    new_dims = ", ".join("new_" + d for d in dims.split(", "))
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
class MaxPooling3DDVI(MaxPoolingDVI):
    __doc__ = _doc("Max", 3, _MAX_HOW)
    rank = 3


@keras.saving.register_keras_serializable(package="keras_dvi")
class AveragePooling1DDVI(AveragePoolingDVI):
    __doc__ = _doc("Average", 1, _AVERAGE_HOW)
    rank = 1


@keras.saving.register_keras_serializable(package="keras_dvi")
class AveragePooling2DDVI(AveragePoolingDVI):
    __doc__ = _doc("Average", 2, _AVERAGE_HOW)
    rank = 2


@keras.saving.register_keras_serializable(package="keras_dvi")
class AveragePooling3DDVI(AveragePoolingDVI):
    __doc__ = _doc("Average", 3, _AVERAGE_HOW)
    rank = 3


class GlobalAveragePoolingDVI(MapLayer):
    """Base class of `GlobalAveragePooling1DDVI` / `GlobalAveragePooling2DDVI`."""

    maps_out = False
    _output_shape = _global_output_shape

    def _propagate(self, mean, variance, shared):
        return packing.pack(*conv_moments.global_average_pool_moments(mean, variance, shared))

    def _sample(self, samples):
        return ops.mean(samples, axis=_positions(samples))


_GLOBAL_DOC = """The mean over all positions of a keras-dvi feature map ({rank}D), as
    `keras.layers.GlobalAveragePooling{rank}D`, in the dense keras-dvi form.

    Exact within keras-dvi's representation: each channel's shared component adds coherently,
    the independent parts as independent variables; the channels of the result are
    independent. Follow it with `DenseDiagDVI` or `DenseDVI`.

    Args:
        data_format: `"channels_last"` or `"channels_first"`; `None` (default) is
            `keras.config.image_data_format()`.

    Input shape:
        A packed feature map `(batch, 3, {dims}, channels)` (channels first:
        `(batch, 3, channels, {dims})`).

    Output shape:
        Packed `(batch, 2, channels)`: means and variances.
    """


class GlobalMaxPoolingDVI(MapLayer):
    """Base class of `GlobalMaxPooling1DDVI` / `GlobalMaxPooling2DDVI`."""

    maps_out = False
    _output_shape = _global_output_shape

    def __init__(self, data_format=None, activation=None, **kwargs):
        super().__init__(data_format=data_format, **kwargs)
        self.activation = moments.canonical_activation(activation)

    def compute_output_spec(self, *args, **kwargs):
        _warn_activation_before_max(self, args, kwargs)
        return super().compute_output_spec(*args, **kwargs)

    def _propagate(self, mean, variance, shared):
        pooled = conv_moments.global_max_pool_moments(mean, variance, shared)
        return packing.pack(*moments.activation_moments(*pooled, self.activation))

    def _sample(self, samples):
        return apply_activation(ops.max(samples, axis=_positions(samples)), self.activation)

    def get_config(self):
        return {**super().get_config(), **_activation_config(self)}


_GLOBAL_MAX_DOC = """The max over all positions of a keras-dvi feature map ({rank}D), as
    `keras.layers.GlobalMaxPooling{rank}D`, in the dense keras-dvi form.

    Clark's (1961) recursion, as `MaxPooling{rank}DDVI` takes it over a window, here over every
    position in order; the channels of the result are independent. Where the positions overlap
    strongly and independently (means closer than their sds) it under-states the variance
    (medians 0.64-0.75 of Monte Carlo's, measured); where the weight noise shared along the
    positions dominates, as in trained networks, it is within a few percent. Put the activation here, not
    on the conv layer before it (see `MaxPooling{rank}DDVI`). Follow it with `DenseDiagDVI` or
    `DenseDVI`.

    Args:
        data_format: `"channels_last"` or `"channels_first"`; `None` (default) is
            `keras.config.image_data_format()`.
        activation: `None` (default) or an activation of `MaxPooling{rank}DDVI`, applied to
            the max.

    Input shape:
        A packed feature map `(batch, 3, {dims}, channels)` (channels first:
        `(batch, 3, channels, {dims})`); on TensorFlow the positions may be of any number
        (`keras.Input((None, channels))`).

    Output shape:
        Packed `(batch, 2, channels)`: means and variances.
    """


@keras.saving.register_keras_serializable(package="keras_dvi")
class GlobalMaxPooling1DDVI(GlobalMaxPoolingDVI):
    __doc__ = _GLOBAL_MAX_DOC.format(rank=1, dims="steps")
    rank = 1


@keras.saving.register_keras_serializable(package="keras_dvi")
class GlobalMaxPooling2DDVI(GlobalMaxPoolingDVI):
    __doc__ = _GLOBAL_MAX_DOC.format(rank=2, dims="rows, cols")
    rank = 2


@keras.saving.register_keras_serializable(package="keras_dvi")
class GlobalAveragePooling1DDVI(GlobalAveragePoolingDVI):
    __doc__ = _GLOBAL_DOC.format(rank=1, dims="steps")
    rank = 1


@keras.saving.register_keras_serializable(package="keras_dvi")
class GlobalAveragePooling2DDVI(GlobalAveragePoolingDVI):
    __doc__ = _GLOBAL_DOC.format(rank=2, dims="rows, cols")
    rank = 2


@keras.saving.register_keras_serializable(package="keras_dvi")
class GlobalMaxPooling3DDVI(GlobalMaxPoolingDVI):
    __doc__ = _GLOBAL_MAX_DOC.format(rank=3, dims=DIMS[3])
    rank = 3


@keras.saving.register_keras_serializable(package="keras_dvi")
class GlobalAveragePooling3DDVI(GlobalAveragePoolingDVI):
    __doc__ = _GLOBAL_DOC.format(rank=3, dims=DIMS[3])
    rank = 3
