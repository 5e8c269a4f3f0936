"""`BatchNormalizationDVI`: batch normalisation of keras-dvi feature maps and vectors with fixed statistics."""

import keras
from keras import ops

from keras_dvi import packing
from keras_dvi.layers import vectors
from keras_dvi.layers.base import apply_activation
from keras_dvi.layers.feature_map import MapLayer
from keras_dvi.maths import conv_moments, moments


def check_epsilon(epsilon):
    """`epsilon` as a float, or a `ValueError` naming the argument."""
    if not isinstance(epsilon, (int, float)) or isinstance(epsilon, bool) or not epsilon >= 0:
        raise ValueError(f"Argument `epsilon` must be a non-negative number; received epsilon={epsilon!r}.")
    return float(epsilon)


def affine_vector(mean, second, scale, shift, activation):
    """Packed moments of `activation(scale x + shift)`, per unit, for Gaussian vectors `x` with
    variances or covariances `second` (`vectors.unit_affine`, `vectors.activated`)."""
    return vectors.activated(mean * scale + shift, vectors.unit_affine(second, scale), activation)


def affine_map(mean, variance, shared, scale, shift, activation):
    """The packed map `activation(scale x + shift)`, per channel
    (`conv_moments.channel_affine_moments`, then `conv_moments.activation_moments`)."""
    moved = conv_moments.channel_affine_moments(mean, variance, shared, scale, shift)
    return packing.pack_map(*conv_moments.activation_moments(*moved, activation))


def from_plain(cls, layer, **kwargs):
    """The keras-dvi normalisation `cls(**kwargs)` of a built plain one, built for its packed
    input and given its weights."""
    converted = cls(**kwargs)
    shape = tuple(layer.input.shape)  # data (batch, ...): the packed form has its rows after the batch
    converted.build(shape[:1] + (2 if len(shape) == 2 else packing.MAP_ROWS,) + shape[1:])
    converted.set_weights(layer.get_weights())
    return converted


@keras.saving.register_keras_serializable(package="keras_dvi")
class BatchNormalizationDVI(MapLayer):
    """Batch normalisation of a keras-dvi feature map with fixed statistics: the per-channel
    affine map `y = gamma (x - moving_mean) / sqrt(moving_variance + epsilon) + beta` of
    `keras.layers.BatchNormalization` at inference, then an optional activation.

    Exact: means map through the affine map, variances through its square, shared components
    through its scale (`keras_dvi.conv_moments.channel_affine_moments`); the activation's
    moments are DVI's. **In training too the statistics stay fixed** (those of the plain model
    it was converted from): the moments of a batch of Gaussian feature maps define no batch
    statistics a plain network would see, so `moving_mean` and `moving_variance` are not
    trainable and not updated; `gamma` and `beta` train as point estimates (no prior, no KL).
    Where a linear convolution or `Dense` feeds the normalisation alone, `keras_dvi.convert`
    folds it into that layer's weights instead; this layer serves the others (pre-activation
    ResNets, DenseNets, the residual MLPs of tabular data). On a dense keras-dvi output (a
    vector) it normalises each unit: covariances through the scales of both units.

    Args:
        epsilon: added to the variance (default 1e-3, Keras' default).
        center: whether the layer has `beta` (default `True`).
        scale: whether the layer has `gamma` (default `True`).
        activation: `None` (default), `"relu"`, `"heaviside"`, `"leaky_relu"`, `"relu6"`,
            `"hard_silu"`, `"hard_sigmoid"`, `"silu"`, `"gelu"`, `"sigmoid"` or `"tanh"`, applied after
            the normalisation (as in `BatchNormalization` + `ReLU`).
        data_format: `"channels_last"` or `"channels_first"` (where the channel axis is);
            `None` (default) is `keras.config.image_data_format()`.

    Input shape:
        A packed feature map `(batch, 3, *spatial, channels)` (channels first:
        `(batch, 3, channels, *spatial)`), or a dense keras-dvi output `(batch, 2, K)` /
        `(batch, K + 1, K)` (with a full covariance, an activation with a pairwise covariance:
        `"relu"`, `"heaviside"`, `"leaky_relu"` or `None`).

    Output shape:
        Packed, as the input.

    Examples:
        >>> x = keras_dvi.BatchNormalizationDVI(activation="relu")(x)
        >>> x = keras_dvi.Conv2DDVI(16, 3, padding="same", regularizer=prior)(x)
    """

    def __init__(self, epsilon=1e-3, center=True, scale=True, activation=None, data_format=None, **kwargs):
        super().__init__(data_format=data_format, **kwargs)
        self.epsilon, self.center, self.scale = check_epsilon(epsilon), bool(center), bool(scale)
        self.activation = moments.canonical_activation(activation)

    _reads_vectors = True

    def build(self, input_shape):
        channels = self._channels(input_shape)
        add = lambda name, init, trainable: self.add_weight(  # noqa: E731
            name=name, shape=(channels,), initializer=init, trainable=trainable, autocast=False)
        self.gamma = add("gamma", "ones", True) if self.scale else None
        self.beta = add("beta", "zeros", True) if self.center else None
        self.moving_mean = add("moving_mean", "zeros", False)
        self.moving_variance = add("moving_variance", "ones", False)

    def _output_shape(self, input_shape):
        self._structure(input_shape)
        return tuple(input_shape)

    def affine(self, dtype):
        """`(scale, shift)` of the per-channel map, in `dtype`."""
        get = lambda v: ops.cast(ops.convert_to_tensor(v), dtype)  # noqa: E731
        scale = ops.rsqrt(get(self.moving_variance) + self.epsilon)
        if self.gamma is not None:
            scale = scale * get(self.gamma)
        shift = -get(self.moving_mean) * scale
        if self.beta is not None:
            shift = shift + get(self.beta)
        return scale, shift

    def _propagate_vector(self, mean, second):
        return affine_vector(mean, second, *self.affine(mean.dtype), self.activation)

    def _propagate(self, mean, variance, shared):
        return affine_map(mean, variance, shared, *self.affine(mean.dtype), self.activation)

    def _sample(self, samples):
        scale, shift = self.affine(samples.dtype)
        return apply_activation(samples * scale + shift, self.activation)

    @classmethod
    def from_batch_normalization(cls, layer, activation=None, data_format=None, **kwargs):
        """The keras-dvi counterpart of a built `keras.layers.BatchNormalization` on the channel
        axis of a feature map, with its weights and statistics (what `keras_dvi.convert` uses)."""
        return from_plain(cls, layer, epsilon=layer.epsilon, center=layer.center, scale=layer.scale,
                          activation=activation, data_format=data_format, name=kwargs.pop("name", layer.name), **kwargs)

    def get_config(self):
        config = super().get_config()
        config.update(epsilon=self.epsilon, center=self.center, scale=self.scale,
                      activation=None if self.activation == "linear" else self.activation)
        return config
