"""What the layers on feature maps share: Keras' spatial arguments, the two data formats, and
`MapLayer`, the base of the layers without weights (pooling, flatten, residual addition).

The moment maths (`keras_dvi.conv_moments`) works on channels-last tensors. A layer with
`data_format="channels_first"` reads and writes channels-first tensors, as Keras' own layers
do, and transposes them to channels last around the maths (Keras itself transposes
channels-first convolutions on CPUs): data `(batch, channels, *spatial)`, packed maps
`(batch, 3, channels, *spatial)`, weight samples `(batch, samples, channels, *spatial)`.
"""

import keras
from keras import ops

from keras_dvi import packing, sampling, validation
from keras_dvi.layers import vectors
from keras_dvi.layers.boundary import KerasDVILayer

PADDINGS = ("valid", "same")
DATA_FORMATS = ("channels_last", "channels_first")


def integers(name, value, rank):
    """`value` as a tuple of `rank` positive integers (one integer is repeated)."""
    values = (value,) * rank if isinstance(value, int) and not isinstance(value, bool) else value
    if (not isinstance(values, (tuple, list)) or len(values) != rank
            or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values)):
        raise ValueError(
            f"Argument `{name}` must be a positive integer or a tuple of {rank} positive integers; "
            f"received {name}={value!r}."
        )
    return tuple(values)


def padding(value):
    """`"valid"` or `"same"` (any case), or a `ValueError` naming the argument."""
    if not isinstance(value, str) or value.lower() not in PADDINGS:
        raise ValueError(f"Argument `padding` must be 'valid' or 'same'; received padding={value!r}.")
    return value.lower()


def standardize_data_format(value):
    """`"channels_last"` or `"channels_first"`; `None` is `keras.config.image_data_format()`."""
    if value is None:
        value = keras.config.image_data_format()
    if not isinstance(value, str) or value.lower() not in DATA_FORMATS:
        raise ValueError(
            "Argument `data_format` must be 'channels_last', 'channels_first' or None (the value of "
            f"keras.config.image_data_format()); received data_format={value!r}."
        )
    return value.lower()


def output_size(size, kernel, stride, padding, dilation=1):
    """The length of one spatial axis after a convolution or pooling (`None` if unknown)."""
    if size is None:
        return None
    if padding == "same":
        return -(-size // stride)
    return (size - (kernel - 1) * dilation - 1) // stride + 1


def _leading(rank, ndim):
    """Axes before the channel axis of a channels-first tensor of `ndim` axes on maps with
    `rank` spatial axes: 1 for data `(batch, channels, ...)`, 2 for packed maps and samples."""
    return 1 if ndim == rank + 2 else 2


def _moved(items, leading, to_last):
    items = tuple(items)
    if to_last:
        return items[:leading] + items[leading + 1:] + (items[leading],)
    return items[:leading] + (items[-1],) + items[leading:-1]


def shape_to_channels_last(shape, rank, data_format):
    """A channels-first shape (or a pair of them) as the channels-last shape of the same tensor."""
    if data_format == "channels_last":
        return shape
    if isinstance(shape, (list, tuple)) and shape and isinstance(shape[0], (list, tuple)):
        return [shape_to_channels_last(s, rank, data_format) for s in shape]
    if len(shape) not in (rank + 2, rank + 3):
        return tuple(shape)  # the wrong rank: the shape checks name it
    return _moved(shape, _leading(rank, len(shape)), to_last=True)


def shape_from_channels_last(shape, rank, data_format):
    """The inverse of `shape_to_channels_last` for one feature-map shape."""
    if data_format == "channels_last":
        return tuple(shape)
    return _moved(shape, _leading(rank, len(shape)), to_last=False)


def to_channels_last(x, rank, data_format):
    """`x` (data, a packed map or samples, or a pair) transposed from `data_format` to channels last."""
    if data_format == "channels_last":
        return x
    if isinstance(x, (list, tuple)):
        return [to_channels_last(t, rank, data_format) for t in x]
    ndim = len(x.shape)
    axes = _moved(range(ndim), _leading(rank, ndim), to_last=True)
    return ops.transpose(x, axes)


def from_channels_last(x, rank, data_format):
    """The inverse of `to_channels_last` for one tensor."""
    if data_format == "channels_last":
        return x
    ndim = len(x.shape)
    axes = _moved(range(ndim), _leading(rank, ndim), to_last=False)
    return ops.transpose(x, axes)


def per_sample(function, samples):
    """Applies a batched map function to `(samples, batch, ...)` tensors, samples folded into
    the batch."""
    shape = ops.shape(samples)
    out = function(ops.reshape(samples, (-1,) + tuple(shape[2:])))
    return ops.reshape(out, (shape[0], shape[1]) + tuple(ops.shape(out)[1:]))


class MapLayer(KerasDVILayer):
    """Base class: a layer without weights that reads packed keras-dvi feature maps
    `(batch, 3, *spatial, channels)` (channels first: `(batch, 3, channels, *spatial)`) with
    `rank` spatial axes (any rank if `rank` is `None`), and in `keras_dvi.predict_samples`
    the sampled maps `(samples, batch, *spatial, channels)`.

    Subclasses implement `_propagate(mean, variance, shared)` and `_sample(samples)` on
    channels-last tensors, and `_output_shape(shape)` on a channels-last shape; this class
    transposes channels-first inputs and outputs around them. `maps_out` says whether the output
    is a feature map (`False` for flatten and global pooling, whose outputs are dense forms).

    Args:
        data_format: `"channels_last"` (`(batch, *spatial, channels)`) or `"channels_first"`
            (`(batch, channels, *spatial)`); `None` (default) is
            `keras.config.image_data_format()`.
        **kwargs: base layer arguments (`name`, `dtype`, ...).
    """

    rank = None
    maps_out = True
    # Whether the layer also reads vectors, the dense keras-dvi outputs `(batch, 2, K)` and
    # `(batch, K + 1, K)`, unit by unit (`_propagate_vector`): the per-unit layers.
    _reads_vectors = False

    def __init__(self, data_format=None, **kwargs):
        kwargs.setdefault("autocast", False)  # moments in float32 even under mixed precision
        super().__init__(**kwargs)
        self.data_format = standardize_data_format(data_format)

    def takes_packed(self, shape):
        if self._reads_vectors and len(shape) == 3:
            return True
        return len(shape) >= 4 if self.rank is None else len(shape) == self.rank + 3

    def _on_vector(self, shape):
        """Whether an input of `shape` is a vector this layer reads (`_reads_vectors`), checked:
        moments, not data."""
        if not self._reads_vectors or isinstance(shape[0], (list, tuple)) or len(shape) > 3:
            return False
        try:
            [(kind, _)] = vectors.structures(self, [shape])
        except ValueError as error:
            if len(shape) == 2:  # (data alone: the error says so)
                raise
            raise ValueError(
                f"{type(self).__name__} {self.name!r} takes a packed keras-dvi feature map (batch, 3, *spatial, "
                "channels) or a dense keras-dvi output (batch, 2 or K + 1, K); received shape "
                f"{tuple(shape)}, which is neither (data? On data, use the plain Keras layer, "
                f"keras.layers.{type(self).__name__[:-3]}).") from error
        vectors.check_activation(self, getattr(self, "activation", "linear"), kind == packing.FULL)
        return True

    def _propagate_vector(self, mean, second):
        raise NotImplementedError

    def _channels(self, input_shape):
        """The number of channels of a packed map (or, `_reads_vectors`, units of a vector) of
        `input_shape`, checked: what a per-channel layer's weights need."""
        _, channels = (packing.structure_of_shape(input_shape) if self._on_vector(tuple(input_shape))
                       else self._structure(self._last(input_shape)))
        if channels is None:
            raise ValueError(f"{type(self).__name__} {self.name!r} needs a known number of channels; "
                             f"received inputs of shape {tuple(input_shape)}.")
        return channels

    def _map_rank(self, shape):
        if self.rank is not None:
            return self.rank
        if isinstance(shape, (list, tuple)) and shape and isinstance(shape[0], (list, tuple)):
            return len(shape[0]) - 2
        return len(shape) - 3

    def _last(self, shape):
        """`shape` (of the inputs) as channels last."""
        return shape_to_channels_last(shape, self._map_rank(shape), self.data_format)

    def _structure(self, input_shape):
        """`(spatial, channels)` of a packed input given by its channels-last shape."""
        kind, spatial, channels = packing.structure_of_map(input_shape, self._map_rank(input_shape))
        if kind == packing.DETERMINISTIC:
            raise ValueError(
                f"{type(self).__name__} {self.name!r} takes the packed output of a keras-dvi conv or "
                f"pooling layer (batch, 3, *spatial, channels); received data of shape "
                f"{tuple(input_shape)}. On data, use the plain Keras layer (e.g. keras.layers.MaxPooling2D)."
            )
        return spatial, channels

    def compute_output_shape(self, input_shape):
        if self._on_vector(input_shape):
            return tuple(input_shape)
        rank = self._map_rank(input_shape)
        out = self._output_shape(self._last(input_shape))
        return shape_from_channels_last(out, rank, self.data_format) if self.maps_out else out

    def _output_shape(self, input_shape):
        raise NotImplementedError

    def _split(self, inputs):
        """`(mean, variance, shared)` of channels-last packed inputs, in the moment dtype, checked."""
        shape = ((tuple(inputs[0].shape), tuple(inputs[1].shape)) if isinstance(inputs, (list, tuple))
                 else tuple(inputs.shape))
        self._structure(shape)
        mean, variance, shared, kind = packing.split_map(inputs, self._map_rank(shape))
        dtype = self.moment_dtype
        mean, variance, shared = (ops.cast(t, dtype) for t in (mean, variance, shared))
        mean, variance = validation.check_moments(mean, variance, kind, "inputs",
                                                  where=f"{type(self).__name__} {self.name!r}")
        return mean, variance, shared

    def _from_last(self, outputs):
        if not self.maps_out:
            return outputs
        return from_channels_last(outputs, len(outputs.shape) - 3, self.data_format)

    def call(self, inputs):
        single = not isinstance(inputs, (list, tuple))
        if single and self._reads_vectors and sampling.current_context(self) is not None and len(inputs.shape) == 3:
            return self._sample(inputs)  # a vector's samples (samples, batch, K)
        if single and self._on_vector(tuple(inputs.shape)):
            return self._propagate_vector(*vectors.split(self, [inputs])[0])
        rank = self._map_rank(tuple(inputs[0].shape) if isinstance(inputs, (list, tuple)) else tuple(inputs.shape))
        inputs = to_channels_last(inputs, rank, self.data_format)
        if sampling.current_context(self) is not None:  # (samples, batch, *spatial, channels)
            out = self._sample(inputs)
            return out if not self.maps_out else from_channels_last(out, rank, self.data_format)
        return self._from_last(self._propagate(*self._split(inputs)))

    def _propagate(self, mean, variance, shared):
        raise NotImplementedError

    def _sample(self, samples):
        raise NotImplementedError

    def get_config(self):
        config = super().get_config()
        config["data_format"] = self.data_format
        return config
