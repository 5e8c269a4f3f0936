"""`AddDVI`: the residual addition of two keras-dvi feature maps."""

import keras

from keras_dvi import packing, sampling
from keras_dvi.layers.base import apply_activation
from keras_dvi.layers.feature_map import MapLayer, to_channels_last
from keras_dvi.maths import conv_moments, moments


@keras.saving.register_keras_serializable(package="keras_dvi")
class AddDVI(MapLayer):
    """Adds two keras-dvi feature maps of the same shape, for residual blocks
    (`keras.layers.Add` for moments), then applies an optional activation.

    **Assumption: the two branches are independent.** Means and variances add; each channel's
    two shared factors become one (the projection of every unit on its channel's sum). In a
    residual block `x + F(x)` the branches are correlated, since `F(x)` is computed from `x`:
    with mostly positive correlation the sum's variance is under-stated. For dense residual
    blocks, `SkipDVI` accounts for that correlation exactly (Stein's lemma); a conv residual
    block has no such closed form here.

    Args:
        activation: `None` (default), `"relu"`, `"heaviside"`, `"leaky_relu"`, `"relu6"`,
            `"hard_silu"`, `"hard_sigmoid"`, `"silu"`, `"gelu"`, `"sigmoid"` or `"tanh"`, applied to
            the sum (as in `relu(x + F(x))`).
        data_format: `"channels_last"` or `"channels_first"` (where the channel axis is: the
            shared components are per channel); `None` (default) is
            `keras.config.image_data_format()`.

    Input shape:
        A list of two packed feature maps `(batch, 3, *spatial, channels)` of the same shape
        (channels first: `(batch, 3, channels, *spatial)`).

    Output shape:
        Packed, as the inputs.

    Examples:
        >>> x = keras_dvi.Conv2DDVI(16, 3, padding="same", activation="relu", regularizer=prior)(inputs)
        >>> branch = keras_dvi.Conv2DDVI(16, 3, padding="same", activation="relu", regularizer=prior)(x)
        >>> branch = keras_dvi.Conv2DDVI(16, 3, padding="same", regularizer=prior)(branch)
        >>> x = keras_dvi.AddDVI(activation="relu")([x, branch])
    """

    def __init__(self, activation=None, data_format=None, **kwargs):
        super().__init__(data_format=data_format, **kwargs)
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
            self._structure(self._last(shape))
        return first, second

    def build(self, input_shape):
        self._shapes(input_shape)

    def compute_output_shape(self, input_shape):
        first, _ = self._shapes(input_shape)
        return first

    def call(self, inputs):
        if sampling.current_context(self) is not None:  # (samples, batch, *spatial, channels) each
            return apply_activation(inputs[0] + inputs[1], self.activation)
        self._shapes([tuple(t.shape) for t in inputs])
        rank = len(inputs[0].shape) - 3
        first, second = (self._split(to_channels_last(t, rank, self.data_format)) for t in inputs)
        summed = conv_moments.add_moments(first, second)
        return self._from_last(packing.pack_map(*conv_moments.activation_moments(*summed, self.activation)))

    def get_config(self):
        config = super().get_config()
        config["activation"] = None if self.activation == "linear" else self.activation
        return config
