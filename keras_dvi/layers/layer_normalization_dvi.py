"""`LayerNormalizationDVI` and `RMSNormalizationDVI`: layer and RMS normalisation of keras-dvi
feature maps and vectors."""

import keras
from keras import ops

from keras_dvi.layers.base import apply_activation
from keras_dvi.layers.batch_normalization_dvi import affine_map, affine_vector, check_epsilon, from_plain
from keras_dvi.layers.feature_map import MapLayer
from keras_dvi.maths import moments


@keras.saving.register_keras_serializable(package="keras_dvi")
class LayerNormalizationDVI(MapLayer):
    """Layer normalisation of a keras-dvi feature map's channels (or a vector's units):
    `y = gamma (x - x_bar) / sqrt(s^2 + epsilon) + beta`, with `x_bar` and `s^2` the mean and
    variance of the channels at each position, as `keras.layers.LayerNormalization` on the
    channel axis (ConvNeXt, Transformer feed-forward blocks, normalised MLPs), then an optional
    activation.

    The moments (`keras_dvi.maths.moments.layer_norm_moments`): the centring is exact; the
    normaliser, a statistic of the layer's own random input, is taken at its expectation and
    the map linearised about the means (the delta method). With the posterior variances at
    zero it is the plain layer's function; against Monte Carlo over Gaussian inputs, from nearly
    deterministic to pure noise, the variances are 0.87-1.05 of Monte Carlo's and the means
    within 0.05 standard deviations with 32 channels or more (0.79-1.11 and 0.14 with 8; with
    fewer the normaliser itself is too random for a Gaussian rule). Where a position's
    channels have nearly equal means (a network whose biases are all zero, on a blank
    background) the layer normalises the weight noise itself, amplified up to
    `1 / sqrt(epsilon)` as by the plain layer's Jacobian: right unit by unit, but the
    convolutions after it then approximate the shared components poorly (a small ConvNeXt on
    digits with zero biases: output variances 0.51-0.77 of Monte Carlo's; with biases as after
    training, 0.81-1.03). `gamma` and `beta` train as point estimates (no prior, no KL), as in
    `BatchNormalizationDVI`.

    Args:
        epsilon: added to the variance (default 1e-3, Keras' default).
        center: whether the layer has `beta` (default `True`).
        scale: whether the layer has `gamma` (default `True`).
        activation: `None` (default) or an activation of `keras_dvi.ActivationDVI`, applied
            after the normalisation (with a full covariance input: `"relu"`, `"heaviside"`,
            `"leaky_relu"` or `None`).
        data_format: `"channels_last"` or `"channels_first"` (where a feature map's channels
            are, the axis normalised); `None` (default) is `keras.config.image_data_format()`.

    Input shape:
        A packed feature map `(batch, 3, *spatial, channels)` (channels first:
        `(batch, 3, channels, *spatial)`; one or two spatial axes: sequences or images), or a
        dense keras-dvi output `(batch, 2, K)` / `(batch, K + 1, K)`.

    Output shape:
        Packed, as the input.

    Examples:
        >>> h = keras_dvi.DepthwiseConv2DDVI(7, padding="same", regularizer=prior)(h)
        >>> h = keras_dvi.LayerNormalizationDVI(epsilon=1e-6)(h)
        >>> h = keras_dvi.Conv2DDVI(64, 1, activation="gelu", regularizer=prior)(h)
    """

    def __init__(self, epsilon=1e-3, center=True, scale=True, activation=None, data_format=None, **kwargs):
        super().__init__(data_format=data_format, **kwargs)
        self.epsilon, self.center, self.scale = check_epsilon(epsilon), bool(center), bool(scale)
        self.activation = moments.canonical_activation(activation)

    _reads_vectors = True
    #: Whether the layer centres its input (`False`: RMS normalisation, `RMSNormalizationDVI`).
    _centres = True

    def build(self, input_shape):
        channels = self._channels(input_shape)
        add = lambda name, init: self.add_weight(  # noqa: E731
            name=name, shape=(channels,), initializer=init, trainable=True, autocast=False)
        self.gamma = add("gamma", "ones") if self.scale else None
        self.beta = add("beta", "zeros") if self.center else None

    def _output_shape(self, input_shape):
        self._structure(input_shape)
        return tuple(input_shape)

    def affine(self, like):
        """`(gamma, beta)` in the dtype of `like` (a tensor whose last axis holds the channels; 1 and
        0 where the layer has none): the per-channel map after the normalisation."""
        get = lambda v, value: (ops.full(like.shape[-1:], value, like.dtype) if v is None  # noqa: E731
                                else ops.cast(ops.convert_to_tensor(v), like.dtype))
        return get(self.gamma, 1.0), get(self.beta, 0.0)

    def _propagate_vector(self, mean, second):
        normalised = moments.layer_norm_moments(mean, second, self.epsilon, center=self._centres)
        return affine_vector(*normalised, *self.affine(mean), self.activation)

    def _propagate(self, mean, variance, shared):
        normalised = moments.layer_norm_moments(mean, variance, self.epsilon, shared=shared, center=self._centres)
        return affine_map(*normalised, *self.affine(mean), self.activation)

    def _sample(self, samples):
        scale, shift = self.affine(samples)
        normalised = ops.layer_normalization(samples, axis=-1, epsilon=self.epsilon)  # (Keras' own function)
        return apply_activation(normalised * scale + shift, self.activation)

    @classmethod
    def from_layer_normalization(cls, layer, activation=None, data_format=None, **kwargs):
        """The keras-dvi counterpart of a built `keras.layers.LayerNormalization` on the channel
        axis of a feature map (or a vector's units), with its weights (what `keras_dvi.convert`
        uses)."""
        return from_plain(cls, layer, epsilon=layer.epsilon, center=layer.center, scale=layer.scale,
                          activation=activation, data_format=data_format, name=kwargs.pop("name", layer.name), **kwargs)

    def get_config(self):
        config = super().get_config()
        config.update(epsilon=self.epsilon, center=self.center, scale=self.scale,
                      activation=None if self.activation == "linear" else self.activation)
        return config


@keras.saving.register_keras_serializable(package="keras_dvi")
class RMSNormalizationDVI(LayerNormalizationDVI):
    """RMS normalisation of a keras-dvi feature map's channels (or a vector's units):
    `y = scale x / sqrt(mean(x^2) + epsilon)` over the channels at each position, as
    `keras.layers.RMSNormalization` on the channel axis (the normalisation of recent
    Transformers and MLPs), then an optional activation.

    The moments are `LayerNormalizationDVI`'s without the centring
    (`keras_dvi.maths.moments.layer_norm_moments(..., center=False)`): the statistic
    `mean(x^2)` taken at its expectation, the map linearised about the means (the delta
    method). With the posterior variances at zero it is the plain layer's function; against
    Monte Carlo through Keras' layer the variances are within the bands of layer
    normalisation (`tests/test_layer_normalization.py`). `scale` trains as a point estimate (no
    prior, no KL).

    Args:
        epsilon: added to the mean square (default 1e-6, Keras' default).
        activation: `None` (default) or an activation of `keras_dvi.ActivationDVI`, applied
            after the normalisation (with a full covariance input: `"relu"`, `"heaviside"`,
            `"leaky_relu"` or `None`).
        data_format: `"channels_last"` or `"channels_first"` (where a feature map's channels
            are, the axis normalised); `None` (default) is `keras.config.image_data_format()`.

    Input shape:
        A packed feature map `(batch, 3, *spatial, channels)` (channels first:
        `(batch, 3, channels, *spatial)`), or a dense keras-dvi output `(batch, 2, K)` /
        `(batch, K + 1, K)`.

    Output shape:
        Packed, as the input.

    Examples:
        >>> h = keras_dvi.DenseDiagDVI(64, regularizer=prior)(inputs)
        >>> h = keras_dvi.RMSNormalizationDVI(activation="silu")(h)
    """

    _centres = False

    def __init__(self, epsilon=1e-6, activation=None, data_format=None, **kwargs):
        kwargs.pop("center", None), kwargs.pop("scale", None)  # (fixed: a scale, no shift)
        super().__init__(epsilon=epsilon, center=False, scale=True, activation=activation, data_format=data_format,
                         **kwargs)

    def _sample(self, samples):
        scale, _ = self.affine(samples)
        normalised = ops.rms_normalization(samples, axis=-1, epsilon=self.epsilon)  # (Keras' own function)
        return apply_activation(normalised * scale, self.activation)

    @classmethod
    def from_rms_normalization(cls, layer, activation=None, data_format=None, **kwargs):
        """The keras-dvi counterpart of a built `keras.layers.RMSNormalization` on the channel
        axis of a feature map (or a vector's units), with its weights (what `keras_dvi.convert`
        uses)."""
        return from_plain(cls, layer, epsilon=layer.epsilon, activation=activation, data_format=data_format,
                          name=kwargs.pop("name", layer.name), **kwargs)

    def get_config(self):
        config = super().get_config()
        config.pop("center"), config.pop("scale")
        return config
