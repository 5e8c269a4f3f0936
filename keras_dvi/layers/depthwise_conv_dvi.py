"""`DepthwiseConv2DDVI`: a depthwise convolution with a factorised Gaussian posterior."""

import math

import keras

from keras_dvi import packing
from keras_dvi.layers.conv_dvi import ConvDVI
from keras_dvi.layers.kl_term import build_unplaced


@keras.saving.register_keras_serializable(package="keras_dvi")
class DepthwiseConv2DDVI(ConvDVI):
    """2D depthwise convolution with a factorised Gaussian posterior, propagating per-position
    moments (`keras.layers.DepthwiseConv2D` for keras-dvi feature maps: MobileNets,
    EfficientNets).

    Output channel `c * depth_multiplier + j` convolves input channel `c` alone with its own
    random kernel. The moments are those of `Conv2DDVI` (`keras_dvi.conv_moments.conv_moments`
    with `depthwise=True`: a depthwise convolution is a convolution whose kernel is zero, with
    zero variance, between different channels), shared components included, at the cost of
    depthwise convolutions. A weight's fan-in is `prod(kernel_size)` (the default initial
    variance `0.03 / fan_in` and the priors' per-fan-in scales use it).

    Args:
        kernel_size: positive integer or tuple of 2 positive integers.
        strides: positive integer or tuple (default 1).
        padding: `"valid"` (default) or `"same"`.
        depth_multiplier: output channels per input channel (default 1).
        data_format: `"channels_last"` or `"channels_first"`; `None` (default) is
            `keras.config.image_data_format()`.
        dilation_rate: positive integer or tuple (default 1).
        activation: `None` (linear) or one of `keras_dvi.moments.ACTIVATIONS` (`"relu"`,
            `"relu6"`, ...).
        **kwargs: the posterior's arguments as `Conv2DDVI`'s (`use_bias`, `regularizer`,
            `kernel_variance_init`, ...) and base layer arguments.

    Input shape:
        Data `(batch, rows, cols, channels)` or a packed feature map `(batch, 3, rows, cols,
        channels)` (channels first: `(batch, channels, rows, cols)`, `(batch, 3, channels, rows,
        cols)`).

    Output shape:
        Packed `(batch, 3, new_rows, new_cols, channels * depth_multiplier)`.

    Examples:
        >>> x = keras_dvi.Conv2DDVI(16, 1, activation="relu6", regularizer=prior)(inputs)
        >>> x = keras_dvi.DepthwiseConv2DDVI(3, padding="same", activation="relu6", regularizer=prior)(x)
    """

    rank = 2
    depthwise = True

    def __init__(self, kernel_size, strides=1, padding="valid", depth_multiplier=1, data_format=None,
                 dilation_rate=1, activation=None, **kwargs):
        super().__init__(depth_multiplier, kernel_size, strides=strides, padding=padding, data_format=data_format,
                         dilation_rate=dilation_rate, activation=activation, **kwargs)
        self.depth_multiplier = self.conv.filters  # (validated as `ConvArguments`' filters)
        del self.filters  # (a depthwise convolution has no fixed number of filters)

    def build(self, input_shape):
        kind, _, channels = packing.structure_of_map(self.conv.last_shape(input_shape), self.rank)
        if channels is None:
            raise ValueError(f"The channel dimension of the inputs to {type(self).__name__} must be defined.")
        self._build_posterior(math.prod(self.kernel_size), channels * self.depth_multiplier,
                              is_head=kind == packing.DETERMINISTIC,
                              kernel_shape=self.kernel_size + (channels, self.depth_multiplier))
        self._channels = channels

    def compute_output_shape(self, input_shape):
        _, spatial, channels = packing.structure_of_map(self.conv.last_shape(input_shape), self.rank)
        spatial = self.conv.output_spatial(spatial, self.name)
        out = None if channels is None else channels * self.depth_multiplier
        return self.conv.restore_shape(packing.map_shape(input_shape, spatial, out))

    @classmethod
    def from_depthwise_conv(cls, conv, kernel_variance=None, bias_variance=None, **kwargs):
        """A layer whose posterior means are the weights of a built
        `keras.layers.DepthwiseConv2D` (as `Conv2DDVI.from_conv`)."""
        if not isinstance(conv, keras.layers.DepthwiseConv2D) or not conv.built:
            raise ValueError("Argument `conv` must be a built keras.layers.DepthwiseConv2D layer.")
        activation = kwargs.pop("activation", getattr(conv.activation, "__name__", None))
        kwargs.setdefault("use_bias", conv.use_bias)
        layer = cls(conv.kernel_size, strides=conv.strides, padding=conv.padding, depth_multiplier=conv.depth_multiplier,
                    data_format=conv.data_format, dilation_rate=conv.dilation_rate,
                    activation=None if activation == "linear" else activation,
                    kernel_variance_init=kernel_variance, bias_variance_init=bias_variance, **kwargs)
        channels = int(conv.kernel.shape[-2])
        build_unplaced(layer, layer.conv.restore_shape((None, None, None, channels)))
        layer.set_posterior(conv.kernel, layer.kernel_variance, conv.bias if conv.use_bias else None)
        return layer

    def get_config(self):
        config = super().get_config()
        config["depth_multiplier"] = config.pop("filters")
        return config
