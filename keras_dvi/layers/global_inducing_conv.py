"""`GlobalInducingConv2D`: a convolution with a global inducing point posterior."""

import math

import keras
from keras import ops

from keras_dvi.layers import feature_map
from keras_dvi.layers.global_inducing_base import GlobalInducingLayer
from keras_dvi.maths import conv_moments, inducing


@keras.saving.register_keras_serializable(package="keras_dvi")
class GlobalInducingConv2D(GlobalInducingLayer):
    """2D convolution with a global inducing point posterior (Ober & Aitchison 2021, Sec. 3).

    The inducing points are images `U0` `(M, rows, cols, channels)`, propagated through the
    network beside the data. Each layer's kernel `W` (`(k_h k_w c_in + 1, filters)` with the
    bias row) has the posterior of Bayesian linear regression from every patch of the inducing
    feature maps to the pseudo-outputs `V` `(M, out_rows, out_cols, filters)` at the patch's
    output position, with one learned precision per inducing image (or per image and filter,
    `precision="per_unit"`), shared by its positions (eq. 11 with the patches as rows):

    `Sigma_w = (p I + sum_{m, x} lambda_m phi_mx phi_mx^T)^-1`,
    `M_w = Sigma_w sum_{m, x} lambda_m phi_mx v_mx^T`,

    with `p = k_h k_w c_in` under `NealPrior` (`s k_h k_w c_in`, `s` learned, under
    `ScalePrior`). Each call draws `num_samples` kernels, one Cholesky factorisation of the
    `(k_h k_w c_in + 1)`-square `A` each, and convolves the inducing images and the data with
    the same draw (one grouped convolution for all samples); the layer adds the Monte Carlo KL
    `(log Q(W) - log P(W)) / num_train` to the model's losses, as `GlobalInducingDense`.

    Between these layers act on each sample with Keras' own layers
    (`keras.layers.TimeDistributed(keras.layers.MaxPooling2D())`, `keras.layers.ReLU()`,
    `keras.layers.Add()` for a residual); those layers hide the producer, so a global inducing
    layer after one takes `num_inducing` and `regularizer` explicitly. End the network with
    `keras.layers.TimeDistributed(keras.layers.Flatten())` (or `GlobalAveragePooling2D`) and a
    `GlobalInducingDense(..., output_layer=True)`.

    Args:
        filters: positive integer, the number of output channels.
        kernel_size: positive integer or tuple of 2.
        strides: positive integer or tuple of 2 (default 1).
        padding: `"same"` (default, as in the paper) or `"valid"`; zero padding.
        use_bias: whether the kernel has a bias row (default `True`).
        **kwargs: the arguments of `GlobalInducingDense` (`activation`, `num_inducing`,
            `output_layer`, `precision`, `num_samples`, `initial_log_precision`,
            `log_precision_scale`, `inducing_initializer` (of the inducing images),
            `pseudo_output_initializer`, `seed`, `validate`, `regularizer`) and base layer
            arguments. Channels last only.

    Input shape:
        First layer: data `(batch, rows, cols, channels)`. Others: `(M + batch, samples, rows,
        cols, channels)`.

    Output shape:
        `(M + batch, samples, new_rows, new_cols, filters)`; `(batch, samples, ...)` with
        `output_layer=True`.

    Examples:
        >>> prior = keras_dvi.NealPrior(num_train=len(x_train))
        >>> model = keras.Sequential([
        ...     keras.Input((28, 28, 1)),
        ...     keras_dvi.GlobalInducingConv2D(32, 3, "relu", num_inducing=100, regularizer=prior),
        ...     keras.layers.TimeDistributed(keras.layers.MaxPooling2D()),
        ...     keras_dvi.GlobalInducingConv2D(32, 3, "relu", num_inducing=100, regularizer=prior),
        ...     keras.layers.TimeDistributed(keras.layers.GlobalAveragePooling2D()),
        ...     keras_dvi.GlobalInducingDense(10, num_inducing=100, regularizer=prior, output_layer=True),
        ... ])
        >>> model.compile(keras.optimizers.Adam(1e-3), loss=keras_dvi.SampledSoftmaxELL())
        >>> keras_dvi.initialize_from_data(model, x_train, y_train)
    """

    data_rank = 4

    def __init__(self, filters, kernel_size, activation=None, strides=1, padding="same", use_bias=True,
                 **kwargs):
        self.kernel_size = feature_map.integers("kernel_size", kernel_size, 2)
        self.strides = feature_map.integers("strides", strides, 2)
        self.padding = feature_map.padding(padding)
        self.use_bias = bool(use_bias)
        if kwargs.get("data_format", "channels_last") != "channels_last":
            raise ValueError("GlobalInducingConv2D supports `data_format='channels_last'` only; "
                             "transpose channels-first images with `keras.layers.Permute((2, 3, 1))`.")
        kwargs.pop("data_format", None)
        super().__init__(filters, activation=activation, **kwargs)

    @property
    def spatial_size(self):
        return math.prod(self.kernel_size)

    @property
    def filters(self):
        return self.units

    def _output_tail(self, data_shape):
        out = []
        for size, k, s in zip(data_shape[:2], self.kernel_size, self.strides):
            if self.padding == "same":
                out.append(-(-size // s))
            else:
                out.append((size - k) // s + 1)
        return tuple(out) + (self.units,)

    def _build_shapes(self, data_shape):
        if len(data_shape) != 3:
            raise ValueError(f"GlobalInducingConv2D expects images `(rows, cols, channels)`; received {data_shape}.")
        tail = self._output_tail(data_shape)
        if min(tail[:2]) <= 0:
            raise ValueError(f"Images of shape {data_shape} are smaller than the kernel {self.kernel_size} "
                             "with `padding='valid'`.")
        self.fan_in = math.prod(self.kernel_size) * int(data_shape[-1])
        self.weight_rows = self.fan_in + int(self.use_bias)
        self.pseudo_output_shape = tail

    def _patch_rows(self, features):
        """`(S, M, rows, cols, c)` -> `(S, M * positions, fan_in [+ 1])`."""
        shape = ops.shape(features)
        flat = ops.reshape(features, (-1,) + tuple(features.shape[2:]))
        rows = conv_moments.patches(flat, self.kernel_size, self.strides, self.padding)
        rows = ops.reshape(rows, (shape[0], -1, self.fan_in))
        return inducing.append_ones(rows) if self.use_bias else rows

    def regression_rows(self, inducing_features, precision, pseudo_outputs):
        positions = math.prod(self.pseudo_output_shape[:2])
        lam = ops.repeat(precision, positions, axis=0)  # (M * positions,) or (M * positions, filters)
        return self._patch_rows(inducing_features), lam, ops.reshape(pseudo_outputs, (-1, self.units))

    def apply_weights(self, h, weights):
        samples = weights.shape[0]
        kernels = ops.reshape(weights[:, :self.fan_in], (samples,) + self.kernel_size + (-1, self.units))
        bias = weights[:, self.fan_in] if self.use_bias else None
        return conv_moments.sampled_conv(h, kernels, bias, strides=self.strides, padding=self.padding)

    def get_config(self):
        config = super().get_config()
        config["filters"] = config.pop("units")
        config.update({"kernel_size": self.kernel_size, "strides": self.strides, "padding": self.padding,
                       "use_bias": self.use_bias})
        return config
