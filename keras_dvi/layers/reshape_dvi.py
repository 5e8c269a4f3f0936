"""`ReshapeDVI` and `PositionEmbeddingDVI`: what a Vision Transformer does to a feature map
between its patch projection and its first attention, on keras-dvi moments. Both are exact."""

import math

import keras
from keras import ops

from keras_dvi import packing
from keras_dvi.layers.feature_map import MapLayer


def _target_shape(value):
    """Keras' `target_shape` as a tuple of positive integers with at most one `-1`."""
    values = tuple(value) if isinstance(value, (tuple, list)) else None
    if (not values or not all(isinstance(v, int) and not isinstance(v, bool) and (v > 0 or v == -1) for v in values)
            or values.count(-1) > 1 or len(values) < 2):
        raise ValueError(
            "Argument `target_shape` must be a tuple of at least two positive integers (one of them may be -1), "
            "positions first and the channels last, e.g. (rows * cols, channels); received "
            f"target_shape={value!r}.")
    return values


@keras.saving.register_keras_serializable(package="keras_dvi")
class ReshapeDVI(MapLayer):
    """Rearranges the positions of a keras-dvi feature map, keeping its channels, as
    `keras.layers.Reshape(target_shape)` whose last entry is the number of channels: an
    image's grid of patch embeddings `(batch, rows, cols, channels)` becomes a Vision
    Transformer's sequence of tokens `(batch, rows * cols, channels)`, or a sequence becomes a
    grid.

    Exact: every unit keeps its mean, its variance and its channel's shared component (the
    part of the variance all positions of a channel share, `keras_dvi.conv_moments`), which
    reshaping the positions does not change. Maps are channels last, as Keras' `Reshape`
    reads them.

    Args:
        target_shape: the output's shape without the batch axis, as in `keras.layers.Reshape`:
            the new positions, then the number of channels (unchanged). One entry may be
            `-1`, inferred from the input.

    Input shape:
        A packed feature map `(batch, 3, *spatial, channels)`.

    Output shape:
        A packed feature map `(batch, 3, *target_shape)`.

    Examples:
        >>> h = keras_dvi.Conv2DDVI(64, 4, strides=4, regularizer=prior)(images)  # patches
        >>> h = keras_dvi.ReshapeDVI((-1, 64))(h)                                 # tokens
        >>> h = keras_dvi.PositionEmbeddingDVI()(h)
    """

    def __init__(self, target_shape, **kwargs):
        if kwargs.pop("data_format", "channels_last") != "channels_last":
            raise ValueError(f"{type(self).__name__} reshapes channels-last maps, as keras.layers.Reshape reads "
                             "them; argument `data_format` must be 'channels_last'.")
        super().__init__(data_format="channels_last", **kwargs)
        self.target_shape = _target_shape(target_shape)

    def _resolved(self, spatial, channels):
        """The target shape with its `-1` filled in (left as `None` where the input's positions
        are unknown), checked against the input's positions and channels."""
        target, units = list(self.target_shape), None
        if all(n is not None for n in spatial) and channels is not None:
            units = math.prod(spatial) * channels
        known = math.prod(n for n in target if n != -1)
        if -1 in target:
            target[target.index(-1)] = None if units is None or units % known else units // known
        if (units is not None and (None in target or math.prod(target) != units)) or (
                channels is not None and target[-1] is not None and target[-1] != channels):
            raise ValueError(
                f"Layer {self.name!r} reshapes a map's positions and keeps its channels: `target_shape` "
                f"{self.target_shape} must end in the {channels} channels and hold the input's "
                f"{tuple(spatial)} positions; received a map of spatial shape {tuple(spatial)} with {channels} "
                "channels.")
        return tuple(target)

    def _output_shape(self, input_shape):
        spatial, channels = self._structure(input_shape)
        target = self._resolved(spatial, channels)
        return packing.map_shape(input_shape, target[:-1], target[-1])

    def _propagate(self, mean, variance, shared):
        spatial, channels = tuple(mean.shape[1:-1]), mean.shape[-1]
        shape = (ops.shape(mean)[0], *[-1 if n is None else n for n in self._resolved(spatial, channels)])
        return packing.pack_map(*(ops.reshape(t, shape) for t in (mean, variance, shared)))

    def _sample(self, samples):
        leading = ops.shape(samples)[:2]
        return ops.reshape(samples, (*leading, *self.target_shape))

    def get_config(self):
        config = super().get_config()
        config.pop("data_format")
        config["target_shape"] = self.target_shape
        return config


@keras.saving.register_keras_serializable(package="keras_dvi")
class PositionEmbeddingDVI(MapLayer):
    """Adds a learned embedding to every position of a keras-dvi sequence or feature map,
    `y = x + E` with `E` of shape `(*spatial, channels)`: a Vision Transformer's position
    embedding added to its patch tokens.

    Exact: the means move by `E`; variances and shared components are unchanged. `E` trains as
    a point estimate (no prior, no KL), as the scales and shifts of
    `keras_dvi.LayerNormalizationDVI`.

    Args:
        embeddings_initializer: the initializer of `E` (default: normal with standard
            deviation 0.02, as in the Vision Transformer).

    Input shape:
        A packed feature map or sequence `(batch, 3, *spatial, channels)` of known spatial
        shape (channels last).

    Output shape:
        As the input.

    Examples:
        >>> h = keras_dvi.ReshapeDVI((-1, 64))(patches)   # (batch, 3, tokens, 64)
        >>> h = keras_dvi.PositionEmbeddingDVI()(h)
        >>> h = keras_dvi.MultiHeadAttentionDVI(4, 16, regularizer=prior)(h, h)
    """

    def __init__(self, embeddings_initializer=None, **kwargs):
        if kwargs.pop("data_format", "channels_last") != "channels_last":
            raise ValueError(f"{type(self).__name__} takes channels-last maps; argument `data_format` must be "
                             "'channels_last'.")
        super().__init__(data_format="channels_last", **kwargs)
        self.embeddings_initializer = keras.initializers.get(
            keras.initializers.RandomNormal(stddev=0.02) if embeddings_initializer is None else embeddings_initializer)

    def build(self, input_shape):
        spatial, channels = self._structure(tuple(input_shape))
        shape = (*spatial, channels)
        if any(n is None for n in shape):
            raise ValueError(f"Layer {self.name!r} needs a known number of positions and channels (one embedding "
                             f"per position); received inputs of shape {tuple(input_shape)}.")
        self.embeddings = self.add_weight(name="embeddings", shape=shape, initializer=self.embeddings_initializer,
                                          trainable=True, autocast=False)

    def _output_shape(self, input_shape):
        self._structure(input_shape)
        return tuple(input_shape)

    def _propagate(self, mean, variance, shared):
        return packing.pack_map(mean + ops.cast(self.embeddings, mean.dtype), variance, shared)

    def _sample(self, samples):
        return samples + ops.cast(self.embeddings, samples.dtype)

    @classmethod
    def from_embeddings(cls, embeddings, **kwargs):
        """A built layer adding `embeddings` (`(*spatial, channels)`, e.g. a plain model's
        position embedding: what `keras_dvi.convert` uses)."""
        embeddings = keras.ops.convert_to_numpy(embeddings)
        layer = cls(**kwargs)
        layer.build((None, 3, *embeddings.shape))
        layer.embeddings.assign(embeddings)
        return layer

    def get_config(self):
        config = super().get_config()
        config.pop("data_format")
        config["embeddings_initializer"] = keras.initializers.serialize(self.embeddings_initializer)
        return config
