"""`ActivationDVI`: an activation applied to a keras-dvi feature map or vector on its own
(`keras.layers.Activation` for moments)."""

import keras

from keras_dvi import packing
from keras_dvi.layers import vectors
from keras_dvi.layers.base import apply_activation
from keras_dvi.layers.feature_map import MapLayer
from keras_dvi.maths import conv_moments, moments


@keras.saving.register_keras_serializable(package="keras_dvi")
class ActivationDVI(MapLayer):
    """Applies an activation to a keras-dvi feature map of any rank, as `keras.layers.Activation`
    on the moments: each unit's mean and variance through the activation's Gaussian moments, each
    channel's shared component scaled by the unit's expected slope (the map's moment rule,
    `keras_dvi.conv_moments.activation_moments`; Wu et al., 2019, eq. 5-6). On a dense keras-dvi
    output (a vector) the units' moments, and with a full covariance the pairs' covariances
    (eqs. 5-7), as the dense layers apply their activation.

    Where one layer feeds it alone, a keras-dvi layer takes the activation itself
    (`activation=`); this layer serves a feature map that several layers read and only some of
    them through the activation, as after the residual additions of Xception.

    Args:
        activation: `"relu"`, `"relu6"`, `"hard_silu"`, `"hard_sigmoid"`, `"leaky_relu"`, `"heaviside"`, `"silu"` (`"swish"`),
            `"gelu"`, `"sigmoid"`, `"tanh"` or `None` (linear).
        data_format: `"channels_last"` or `"channels_first"`; `None` (default) is
            `keras.config.image_data_format()`.

    Input shape:
        A packed feature map `(batch, 3, *spatial, channels)` (channels first:
        `(batch, 3, channels, *spatial)`), or a dense keras-dvi output `(batch, 2, K)` /
        `(batch, K + 1, K)` (with a full covariance, an activation with a pairwise covariance:
        `"relu"`, `"heaviside"`, `"leaky_relu"` or `None`).

    Output shape:
        Packed, as the input.

    Examples:
        >>> x = keras_dvi.AddDVI()([x, residual])  # read by the next block's two branches
        >>> branch = keras_dvi.ActivationDVI("relu")(x)
    """

    def __init__(self, activation, data_format=None, **kwargs):
        super().__init__(data_format=data_format, **kwargs)
        self.activation = moments.canonical_activation(activation)

    def _output_shape(self, input_shape):
        self._structure(input_shape)
        return tuple(input_shape)

    _reads_vectors = True

    def _propagate_vector(self, mean, second):
        return vectors.activated(mean, second, self.activation)

    def _propagate(self, mean, variance, shared):
        return packing.pack_map(*conv_moments.activation_moments(mean, variance, shared, self.activation))

    def _sample(self, samples):
        return apply_activation(samples, self.activation)

    def get_config(self):
        config = super().get_config()
        config["activation"] = None if self.activation == "linear" else self.activation
        return config
