"""The token layers of a Vision Transformer on keras-dvi moments, all exact: `ReshapeDVI` (a
map's patches as a sequence of tokens), `ClassTokenDVI` (a learned class token before them),
`PositionEmbeddingDVI` (a learned position embedding) and, after the encoder, `SelectTokenDVI`
(one token, the class token, as the vector the head reads)."""

import math

import keras
import numpy as np
from keras import ops

from keras_dvi import packing
from keras_dvi.layers.feature_map import MapLayer


class _TokenLayer(MapLayer):
    """Base of the token layers: they read channels-last maps and sequences only (as
    `keras.layers.Reshape` reads maps, and as a Transformer's tokens are), so they take no
    `data_format` argument and save none."""

    def __init__(self, **kwargs):
        if kwargs.pop("data_format", "channels_last") != "channels_last":
            raise ValueError(f"{type(self).__name__} takes channels-last maps and sequences, as keras.layers.Reshape "
                             "reads them; argument `data_format` must be 'channels_last'.")
        super().__init__(data_format="channels_last", **kwargs)

    def get_config(self):
        config = super().get_config()
        config.pop("data_format")
        return config


def _index(value):
    """`SelectTokenDVI`'s `index`: an integer (negative counts from the end)."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError("Argument `index` must be an integer, the position of the token to take (0: the class "
                         f"token; negative counts from the end, as in `x[:, index]`); received index={value!r}.")
    return value


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
class ReshapeDVI(_TokenLayer):
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
        super().__init__(**kwargs)
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
        config["target_shape"] = self.target_shape
        return config


@keras.saving.register_keras_serializable(package="keras_dvi")
class PositionEmbeddingDVI(_TokenLayer):
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
        super().__init__(**kwargs)
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
        config["embeddings_initializer"] = keras.initializers.serialize(self.embeddings_initializer)
        return config


@keras.saving.register_keras_serializable(package="keras_dvi")
class ClassTokenDVI(_TokenLayer):
    """Puts a learned class token before the tokens of a keras-dvi sequence,
    `(batch, 3, tokens, channels)` to `(batch, 3, tokens + 1, channels)`: the Vision
    Transformer's (and BERT's) `[CLS]` token, `concatenate([broadcast(token), x], axis=1)`,
    whose encoder output the head reads (`SelectTokenDVI(0)`).

    Exact: the token is a point estimate (no prior, no KL, as the position embedding of
    `PositionEmbeddingDVI`), so it enters with its value as the mean, no variance and no shared
    component; the other tokens keep their moments. The encoder's attention then gives it
    its variance.

    Args:
        token_initializer: the initializer of the token, `(channels,)` (default: zeros, as in
            the Vision Transformer).

    Input shape:
        A packed sequence `(batch, 3, tokens, channels)` (channels last).

    Output shape:
        A packed sequence `(batch, 3, tokens + 1, channels)`, the class token first.

    Examples:
        >>> h = keras_dvi.ReshapeDVI((-1, 64))(patches)   # (batch, 3, tokens, 64)
        >>> h = keras_dvi.ClassTokenDVI()(h)              # (batch, 3, tokens + 1, 64)
        >>> h = keras_dvi.PositionEmbeddingDVI()(h)
    """

    rank = 1

    def __init__(self, token_initializer="zeros", **kwargs):
        super().__init__(**kwargs)
        self.token_initializer = keras.initializers.get(token_initializer)

    def build(self, input_shape):
        _, channels = self._structure(tuple(input_shape))
        if channels is None:
            raise ValueError(f"Layer {self.name!r} needs a known number of channels (its token has one value per "
                             f"channel); received inputs of shape {tuple(input_shape)}.")
        self.token = self.add_weight(name="token", shape=(channels,), initializer=self.token_initializer,
                                     trainable=True, autocast=False)

    def _output_shape(self, input_shape):
        (tokens,), channels = self._structure(input_shape)
        return packing.map_shape(input_shape, (None if tokens is None else tokens + 1,), channels)

    def _propagate(self, mean, variance, shared):
        token = ops.broadcast_to(ops.cast(self.token, mean.dtype), (ops.shape(mean)[0], 1, mean.shape[-1]))
        zeros = ops.zeros_like(token)
        return packing.pack_map(*(ops.concatenate([first, t], axis=1)
                                  for first, t in ((token, mean), (zeros, variance), (zeros, shared))))

    def _sample(self, samples):
        shape = ops.shape(samples)
        token = ops.broadcast_to(ops.cast(self.token, samples.dtype), (shape[0], shape[1], 1, samples.shape[-1]))
        return ops.concatenate([token, samples], axis=2)

    @classmethod
    def from_token(cls, token, **kwargs):
        """A built layer with the class token `token` (`(channels,)`, e.g. a plain model's: what
        `keras_dvi.convert` uses)."""
        token = np.asarray(keras.ops.convert_to_numpy(token)).reshape(-1)
        layer = cls(**kwargs)
        layer.build((None, 3, None, token.shape[0]))
        layer.token.assign(token)
        return layer

    def get_config(self):
        config = super().get_config()
        config["token_initializer"] = keras.initializers.serialize(self.token_initializer)
        return config


@keras.saving.register_keras_serializable(package="keras_dvi")
class SelectTokenDVI(_TokenLayer):
    """Takes one token of a keras-dvi sequence as a vector, `x[:, index]`: the class token
    that a Vision Transformer's (or BERT's) head reads after the encoder.

    Exact: the token's units keep their means and variances; its shared components (what
    the positions of a channel share) are dropped, as by `FlattenDVI`, since the vector has
    one position.

    Args:
        index: the position of the token (default 0, the class token of `ClassTokenDVI`);
            negative counts from the end, as in Python.

    Input shape:
        A packed sequence `(batch, 3, tokens, channels)` (channels last).

    Output shape:
        Packed `(batch, 2, channels)`: means and variances, ready for `DenseDiagDVI` /
        `DenseDVI`.

    Examples:
        >>> h = keras_dvi.LayerNormalizationDVI()(encoded)   # (batch, 3, tokens + 1, 64)
        >>> h = keras_dvi.SelectTokenDVI(0)(h)               # (batch, 2, 64)
        >>> logits = keras_dvi.DenseDVI(10, regularizer=prior)(h)
    """

    rank = 1
    maps_out = False

    def __init__(self, index=0, **kwargs):
        super().__init__(**kwargs)
        self.index = _index(index)

    def _output_shape(self, input_shape):
        (tokens,), channels = self._structure(input_shape)
        if tokens is not None and not -tokens <= self.index < tokens:
            raise ValueError(f"Layer {self.name!r} takes token `index`={self.index} of a sequence of {tokens} tokens; "
                             f"`index` must be in [{-tokens}, {tokens - 1}].")
        return packing.packed_shape(input_shape, channels, full=False)

    def _propagate(self, mean, variance, shared):
        return packing.pack(mean[:, self.index], variance[:, self.index])

    def _sample(self, samples):
        return samples[:, :, self.index]

    def get_config(self):
        config = super().get_config()
        config["index"] = self.index
        return config
