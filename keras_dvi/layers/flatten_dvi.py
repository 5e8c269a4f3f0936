"""`FlattenDVI`: a keras-dvi feature map in the dense keras-dvi form."""

import math

import keras
from keras import ops

from keras_dvi import packing
from keras_dvi.layers.feature_map import MapLayer
from keras_dvi.maths import conv_moments


@keras.saving.register_keras_serializable(package="keras_dvi")
class FlattenDVI(MapLayer):
    """Flattens a keras-dvi feature map of any rank into the dense keras-dvi form, in the order
    of `keras.layers.Flatten`.

    Keeps every unit's mean and variance. The shared components (the part of the variance the
    positions of a channel share) are dropped: the dense layer after it treats its inputs as
    independent, as every diagonal keras-dvi layer does (`keras_dvi.conv_moments`).

    Args:
        data_format: `"channels_last"` or `"channels_first"`; `None` (default) is
            `keras.config.image_data_format()`. As `keras.layers.Flatten`, a channels-first
            map is flattened in channels-last order, so a network keeps its dense weights
            when it switches format.

    Input shape:
        A packed feature map `(batch, 3, *spatial, channels)` (channels first:
        `(batch, 3, channels, *spatial)`).

    Output shape:
        Packed `(batch, 2, prod(spatial) * channels)`: means and variances, ready for
        `DenseDiagDVI` / `DenseDVI`.

    Examples:
        >>> model = keras.Sequential([
        ...     keras.Input((8, 8, 1)),
        ...     keras_dvi.Conv2DDVI(8, 3, activation="relu"),
        ...     keras_dvi.FlattenDVI(),
        ...     keras_dvi.DenseDVI(10),
        ... ])
    """

    maps_out = False

    def _output_shape(self, input_shape):
        spatial, channels = self._structure(input_shape)
        sizes = tuple(spatial) + (channels,)
        features = None if any(n is None for n in sizes) else math.prod(sizes)
        return packing.packed_shape(input_shape, features, full=False)

    def _propagate(self, mean, variance, shared):
        return packing.pack(*conv_moments.flatten_moments(mean, variance))

    def _sample(self, samples):
        shape = ops.shape(samples)
        return ops.reshape(samples, (shape[0], shape[1], -1))
