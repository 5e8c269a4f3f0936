"""`ConcatenateDVI`: keras-dvi feature maps joined along their channels, or vectors joined."""

import keras
from keras import ops

from keras_dvi import packing, sampling
from keras_dvi.layers import vectors
from keras_dvi.layers.feature_map import MapLayer, from_channels_last, shape_from_channels_last, to_channels_last
from keras_dvi.maths import conv_moments, moments


@keras.saving.register_keras_serializable(package="keras_dvi")
class ConcatenateDVI(MapLayer):
    """Joins keras-dvi feature maps of the same spatial shape along their channels
    (`keras.layers.Concatenate` on the channel axis, for Inception and DenseNet blocks), or
    vectors: dense keras-dvi outputs, and data (a second input of the network, as in wide and
    deep or multi-input models).

    Exact within keras-dvi's representation: every channel keeps its mean, variance and shared
    component (`keras_dvi.conv_moments.concatenate_moments`); vectors keep their means and
    (co)variances, data with variance zero, in a block-diagonal covariance
    (`keras_dvi.moments.concatenate_moments`). Like every keras-dvi feature map, the result
    takes different inputs to be independent, also where two share an ancestor (a DenseNet
    block concatenates a map with features computed from it).

    Args:
        data_format: `"channels_last"` or `"channels_first"` (where the channel axis is);
            `None` (default) is `keras.config.image_data_format()`.

    Input shape:
        A list of two or more packed feature maps `(batch, 3, *spatial, channels_i)` of the same
        spatial shape (channels first: `(batch, 3, channels_i, *spatial)`); or of two or more
        vectors: dense keras-dvi outputs `(batch, 2, K_i)` or `(batch, K_i + 1, K_i)`, and data
        `(batch, K_i)`, one at least not data.

    Output shape:
        Packed `(batch, 3, *spatial, sum_i channels_i)`; for vectors `(batch, 2, sum_i K_i)`
        (`(batch, sum_i K_i + 1, sum_i K_i)` if an input has a full covariance).

    Examples:
        >>> a = keras_dvi.Conv2DDVI(8, 1, activation="relu", regularizer=prior)(x)
        >>> b = keras_dvi.Conv2DDVI(8, 3, padding="same", activation="relu", regularizer=prior)(x)
        >>> x = keras_dvi.ConcatenateDVI()([a, b])
        >>> h = keras_dvi.ConcatenateDVI()([keras_dvi.DenseDiagDVI(16, activation="relu")(deep), wide])
    """

    def takes_packed(self, shape):
        return len(shape) >= 3

    def _shapes(self, input_shape):
        if (not isinstance(input_shape, (list, tuple)) or len(input_shape) < 2
                or not all(isinstance(s, (list, tuple)) for s in input_shape)):
            raise ValueError(f"{type(self).__name__} takes a list of two or more packed feature maps or vectors; "
                             f"received {input_shape}.")
        if vectors.on_vectors(self, input_shape):
            return None
        shapes = [self._last(tuple(s)) for s in input_shape]
        spatial = [self._structure(s)[0] for s in shapes]
        if any(len(s) != len(spatial[0]) or any(a is not None and b is not None and a != b
                                                for a, b in zip(s, spatial[0])) for s in spatial):
            raise ValueError(f"{type(self).__name__} joins feature maps of the same spatial shape; received "
                             f"{[tuple(s) for s in input_shape]}.")
        return shapes

    def build(self, input_shape):
        self.compute_output_shape(input_shape)

    def compute_output_shape(self, input_shape):
        shapes = self._shapes(input_shape)
        if shapes is None:  # vectors
            kinds = vectors.structures(self, input_shape)
            features = [features for _, features in kinds]
            total = None if None in features else sum(features)
            return packing.packed_shape(input_shape, total, full=any(kind == packing.FULL for kind, _ in kinds))
        channels = [self._structure(s)[1] for s in shapes]
        total = None if any(c is None for c in channels) else sum(channels)
        out = packing.map_shape(shapes[0], self._structure(shapes[0])[0], total)
        return shape_from_channels_last(out, len(out) - 3, self.data_format)

    def call(self, inputs):
        context = sampling.current_context(self)
        if vectors.on_vectors(self, [t.shape for t in inputs]):
            if context is not None:  # (samples, batch, K_i) each, data (batch, K_i)
                return ops.concatenate(vectors.samples(inputs, context.num_samples), axis=-1)
            self.compute_output_shape([tuple(t.shape) for t in inputs])  # (checks them)
            return packing.pack(*moments.concatenate_moments(vectors.split(self, inputs)))
        rank = len(inputs[0].shape) - 3
        sampled = context is not None  # (samples, batch, *spatial, channels) each
        if not sampled:
            self._shapes([tuple(t.shape) for t in inputs])
        inputs = [to_channels_last(t, rank, self.data_format) for t in inputs]
        if sampled:
            return from_channels_last(ops.concatenate(inputs, axis=-1), rank, self.data_format)
        joined = conv_moments.concatenate_moments([self._split(t) for t in inputs])
        return self._from_last(packing.pack_map(*joined))
