"""`ConcatenateDVI`: keras-dvi feature maps joined along their channels."""

import keras
from keras import ops

from keras_dvi import packing, sampling
from keras_dvi.layers.feature_map import MapLayer, from_channels_last, shape_from_channels_last, to_channels_last
from keras_dvi.maths import conv_moments


@keras.saving.register_keras_serializable(package="keras_dvi")
class ConcatenateDVI(MapLayer):
    """Joins keras-dvi feature maps of the same spatial shape along their channels
    (`keras.layers.Concatenate` on the channel axis, for Inception and DenseNet blocks).

    Exact within keras-dvi's representation: every channel keeps its mean, variance and shared
    component (`keras_dvi.conv_moments.concatenate_moments`). Like every keras-dvi feature map,
    the result takes different channels to be independent, also where two inputs share an
    ancestor (a DenseNet block concatenates a map with features computed from it).

    Args:
        data_format: `"channels_last"` or `"channels_first"` (where the channel axis is);
            `None` (default) is `keras.config.image_data_format()`.

    Input shape:
        A list of two or more packed feature maps `(batch, 3, *spatial, channels_i)` of the same
        spatial shape (channels first: `(batch, 3, channels_i, *spatial)`).

    Output shape:
        Packed `(batch, 3, *spatial, sum_i channels_i)`.

    Examples:
        >>> a = keras_dvi.Conv2DDVI(8, 1, activation="relu", regularizer=prior)(x)
        >>> b = keras_dvi.Conv2DDVI(8, 3, padding="same", activation="relu", regularizer=prior)(x)
        >>> x = keras_dvi.ConcatenateDVI()([a, b])
    """

    def takes_packed(self, shape):
        return len(shape) >= 4

    def _shapes(self, input_shape):
        if (not isinstance(input_shape, (list, tuple)) or len(input_shape) < 2
                or not all(isinstance(s, (list, tuple)) for s in input_shape)):
            raise ValueError(f"{type(self).__name__} takes a list of two or more packed feature maps; "
                             f"received {input_shape}.")
        shapes = [self._last(tuple(s)) for s in input_shape]
        spatial = [self._structure(s)[0] for s in shapes]
        if any(len(s) != len(spatial[0]) or any(a is not None and b is not None and a != b
                                                for a, b in zip(s, spatial[0])) for s in spatial):
            raise ValueError(f"{type(self).__name__} joins feature maps of the same spatial shape; received "
                             f"{[tuple(s) for s in input_shape]}.")
        return shapes

    def build(self, input_shape):
        self._shapes(input_shape)

    def compute_output_shape(self, input_shape):
        shapes = self._shapes(input_shape)
        channels = [self._structure(s)[1] for s in shapes]
        total = None if any(c is None for c in channels) else sum(channels)
        out = packing.map_shape(shapes[0], self._structure(shapes[0])[0], total)
        return shape_from_channels_last(out, len(out) - 3, self.data_format)

    def call(self, inputs):
        rank = len(inputs[0].shape) - 3
        sampled = sampling.current_context(self) is not None  # (samples, batch, *spatial, channels) each
        if not sampled:
            self._shapes([tuple(t.shape) for t in inputs])
        inputs = [to_channels_last(t, rank, self.data_format) for t in inputs]
        if sampled:
            return from_channels_last(ops.concatenate(inputs, axis=-1), rank, self.data_format)
        joined = conv_moments.concatenate_moments([self._split(t) for t in inputs])
        return self._from_last(packing.pack_map(*joined))
