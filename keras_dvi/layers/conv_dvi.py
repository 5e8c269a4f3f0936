"""`Conv1DDVI`, `Conv2DDVI`: Bayesian convolutions propagating per-position moments, and the
configuration they share with the sampling baselines `Conv1DMCVI`, `Conv2DMCVI`."""

import math

import keras
from keras import ops

from keras_dvi import conv_moments, packing, validation
from keras_dvi.layers.base import BayesianLayer, apply_activation
from keras_dvi.layers.feature_map import (
    PADDINGS,
    from_channels_last,
    integers,
    output_size,
    padding as _padding,
    shape_from_channels_last,
    shape_to_channels_last,
    standardize_data_format,
    to_channels_last,
)

class ConvBase(BayesianLayer):
    """Base class of the Bayesian convolutions: a factorised Gaussian posterior over a
    `(*kernel_size, in, filters)` kernel and a bias, Keras' `Conv1D` / `Conv2D` arguments,
    and the convolution with sampled kernels (one kernel per sample, shared by every
    position). Subclasses set `rank`; the maths runs channels last (`_last` / `_restore`
    transpose channels-first tensors around it).

    Args:
        filters: positive integer, the number of output channels.
        kernel_size: positive integer or tuple of `rank` positive integers.
        strides: positive integer or tuple (default 1).
        padding: `"valid"` (default) or `"same"`.
        data_format: `"channels_last"` or `"channels_first"`; `None` (default) is
            `keras.config.image_data_format()`.
        dilation_rate: positive integer or tuple (default 1); with strides above 1 it must be 1,
            as in Keras.
        activation: as in `BayesianLayer`.
        **kwargs: other arguments of `BayesianLayer` (initializers, `kernel_variance_init`,
            `bias_variance_init` (`None`: `0.03 / fan_in`, `fan_in = prod(kernel_size) * in`),
            `regularizer`, `validate`, `name`, `dtype`, ...).
    """

    rank = None

    def __init__(self, filters, kernel_size, strides=1, padding="valid", data_format=None, dilation_rate=1,
                 activation=None, **kwargs):
        super().__init__(activation=activation, **kwargs)
        self.filters = validation.positive_integer("filters", filters, " (output channels)")
        self.kernel_size = integers("kernel_size", kernel_size, self.rank)
        self.strides = integers("strides", strides, self.rank)
        self.dilation_rate = integers("dilation_rate", dilation_rate, self.rank)
        self.padding = _padding(padding)
        self.data_format = standardize_data_format(data_format)
        if max(self.strides) > 1 and max(self.dilation_rate) > 1:
            raise ValueError(
                "Arguments `strides` and `dilation_rate` cannot both be above 1 (as in Keras' "
                f"convolutions); received strides={strides!r}, dilation_rate={dilation_rate!r}."
            )

    def _output_spatial(self, spatial):
        out = tuple(output_size(n, k, s, self.padding, d)
                    for n, k, s, d in zip(spatial, self.kernel_size, self.strides, self.dilation_rate))
        if any(n is not None and n < 1 for n in out):
            raise ValueError(
                f"Layer {self.name!r}: inputs of spatial shape {tuple(spatial)} are smaller than its "
                f"kernel {self.kernel_size} (dilation {self.dilation_rate}) with padding='valid'."
            )
        return out

    def _build_kernel(self, channels, is_head):
        if channels is None:
            raise ValueError(f"The channel dimension of the inputs to {type(self).__name__} must be defined.")
        self._build_posterior(math.prod(self.kernel_size) * channels, self.filters, is_head,
                              kernel_shape=self.kernel_size + (channels, self.filters))
        self._channels = channels

    def _check_channels(self, channels):
        if channels is not None and self.built and channels != self._channels:
            raise ValueError(
                f"Layer {self.name!r} expects inputs with {self._channels} channels; received {channels}."
            )

    def _conv_arguments(self):
        return {"strides": self.strides, "padding": self.padding, "dilation_rate": self.dilation_rate}

    def _last_shape(self, shape):
        """An input shape (or a pair of shapes) of this layer's data format, channels last."""
        return shape_to_channels_last(shape, self.rank, self.data_format)

    def _last(self, inputs):
        """Inputs (a tensor or a pair) of this layer's data format, channels last."""
        return to_channels_last(inputs, self.rank, self.data_format)

    def _restore_shape(self, shape):
        """A channels-last output shape in this layer's data format."""
        return shape_from_channels_last(shape, self.rank, self.data_format)

    def _restore(self, outputs):
        """A channels-last output tensor in this layer's data format."""
        return from_channels_last(outputs, self.rank, self.data_format)

    def _sample_conv(self, h, context):
        """`conv(h, W) + b` with `W`, `b` drawn from the posterior, one draw per sample: `h`
        `(samples, batch, *spatial, in)` -> `(samples, batch, *out_spatial, filters)`."""
        kernel_mean, kernel_var, bias_mean, bias_var = self._posterior()
        dtype = self.moment_dtype
        noise = keras.random.normal((context.num_samples,) + tuple(kernel_mean.shape), dtype=dtype,
                                    seed=context.seed_generator)
        bias = None
        if bias_mean is not None:
            bias = bias_mean + ops.sqrt(bias_var) * keras.random.normal(
                (context.num_samples, self.filters), dtype=dtype, seed=context.seed_generator)
        return conv_moments.sampled_conv(ops.cast(h, dtype), kernel_mean + ops.sqrt(kernel_var) * noise, bias,
                                         **self._conv_arguments())

    @classmethod
    def from_conv(cls, conv, kernel_variance=None, bias_variance=None, **kwargs):
        """A layer whose posterior means are the weights of a built `keras.layers.Conv1D` /
        `Conv2D` (of this layer's rank) with a linear or ReLU activation.

        Args:
            conv: the built Keras convolution.
            kernel_variance: initial posterior variance of the kernel (`None`: the default).
            bias_variance: initial posterior variance of the bias (`None`: the default).
            **kwargs: other constructor arguments of this class (`regularizer`, ...;
                `activation=` overrides the convolution's).

        Returns:
            A built layer of this class with the same filters, kernel size, strides, padding,
            data format, dilation, activation and bias.
        """
        expected = {1: keras.layers.Conv1D, 2: keras.layers.Conv2D}[cls.rank]
        if not isinstance(conv, expected) or not conv.built or getattr(conv, "groups", 1) != 1:
            raise ValueError(f"Argument `conv` must be a built keras.layers.{expected.__name__} layer (groups=1).")
        if conv.padding not in PADDINGS:
            raise ValueError("Argument `conv` must use padding 'valid' or 'same' (not 'causal').")
        activation = kwargs.pop("activation", getattr(conv.activation, "__name__", None))
        kwargs.setdefault("use_bias", conv.use_bias)
        layer = cls(
            conv.filters, conv.kernel_size, strides=conv.strides, padding=conv.padding,
            data_format=conv.data_format, dilation_rate=conv.dilation_rate, activation=None if activation == "linear" else activation,
            kernel_variance_init=kernel_variance, bias_variance_init=bias_variance, **kwargs,
        )
        channels = int(conv.kernel.shape[-2])
        layer.build(layer._restore_shape((None,) + (None,) * cls.rank + (channels,)))
        layer.set_posterior(conv.kernel, layer.kernel_variance, conv.bias if conv.use_bias else None)
        return layer

    def get_config(self):
        config = super().get_config()
        config.update({"filters": self.filters, "kernel_size": self.kernel_size, "strides": self.strides,
                       "padding": self.padding, "data_format": self.data_format,
                       "dilation_rate": self.dilation_rate})
        return config


class ConvDVI(ConvBase):
    """Base class of `Conv1DDVI` / `Conv2DDVI` (see `Conv2DDVI`)."""

    def takes_packed(self, shape):
        return len(shape) == self.rank + 3

    def build(self, input_shape):
        kind, _, channels = packing.structure_of_map(self._last_shape(input_shape), self.rank)
        self._build_kernel(channels, is_head=kind == packing.DETERMINISTIC)

    def _reads_data(self, input_shape):
        try:
            return packing.structure_of_map(self._last_shape(input_shape), self.rank)[0] == packing.DETERMINISTIC
        except ValueError:
            return None

    def compute_output_shape(self, input_shape):
        _, spatial, _ = packing.structure_of_map(self._last_shape(input_shape), self.rank)
        return self._restore_shape(packing.map_shape(input_shape, self._output_spatial(spatial), self.filters))

    def _propagate(self, inputs, training):
        mean, variance, shared, kind = packing.split_map(self._last(inputs), self.rank)
        dtype = self.moment_dtype
        cast = lambda t: None if t is None else ops.cast(t, dtype)  # noqa: E731
        mean, variance, shared = cast(mean), cast(variance), cast(shared)
        self._check_channels(mean.shape[-1])
        mean, variance = validation.check_moments(mean, variance, kind, "inputs", self.validate,
                                                  where=f"{type(self).__name__} {self.name!r}")
        self._report_kl(training, mean if kind == packing.DETERMINISTIC else None)
        kernel_mean, kernel_var, bias_mean, bias_var = self._posterior()
        moments_a = conv_moments.conv_moments(mean, kernel_mean, kernel_var, bias_mean, bias_var, variance, shared,
                                              **self._conv_arguments())
        return self._restore(packing.pack_map(*conv_moments.activation_moments(*moments_a, self.activation)))

    def _sample(self, inputs, context):
        if isinstance(inputs, (list, tuple)) or len(inputs.shape) not in (self.rank + 2, self.rank + 3):
            raise ValueError(
                "While sampling, keras-dvi conv layers take deterministic (batch, *spatial, channels) "
                "inputs or (samples, batch, *spatial, channels) samples from another keras-dvi layer."
            )
        inputs = self._last(inputs)
        if len(inputs.shape) == self.rank + 2:
            inputs = ops.broadcast_to(inputs[None], (context.num_samples,) + tuple(ops.shape(inputs)))
        self._check_channels(int(inputs.shape[-1]))
        return self._restore(apply_activation(self._sample_conv(inputs, context), self.activation))


_CONV_DOC = """{rank}D convolution with a factorised Gaussian posterior, propagating per-position moments.

    Deterministic variational inference (Wu et al., ICLR 2019) for a convolution: the moments of
    `activation(conv(h, W) + b)` with independent Gaussian weights are computed in closed form
    at every position (eqs. 3-4 per position, the exact one-unit activation moments of Table 1),
    together with each unit's shared component, the part of its variance that every position
    of its channel shares because they share the random kernel (`keras_dvi.conv_moments`:
    without it, pooling and dense layers after the convolution under-state the output
    variance). Covariances between positions beyond that are not tracked. The cost is four
    convolutions per call after a keras-dvi layer (three after data) where `keras.layers.
    Conv{rank}D` has one.

    Args:
        filters: positive integer, the number of output channels.
        kernel_size: positive integer or tuple of {rank} positive integers.
        strides: positive integer or tuple (default 1).
        padding: `"valid"` (default) or `"same"` (zero padding, as Keras).
        data_format: `"channels_last"` (`(batch, {dims}, channels)`) or `"channels_first"`
            (`(batch, channels, {dims})`); `None` (default) is
            `keras.config.image_data_format()`. Channels-first tensors are transposed to
            channels last around the moment maths.
        dilation_rate: positive integer or tuple (default 1).
        activation: `None` (linear), `"relu"`, `"heaviside"` or `"leaky_relu"`.
        use_bias: whether to use a Bayesian bias.
        kernel_mean_initializer: initializer of the kernel posterior means (`"he_normal"`).
        bias_mean_initializer: initializer of the bias posterior means.
        kernel_variance_init: initial kernel posterior variance (`None`: `0.03 / fan_in`,
            `fan_in = prod(kernel_size) * input channels`).
        bias_variance_init: initial bias posterior variance (`None`: a tenth of the kernel's).
        regularizer: a prior (`EmpiricalBayesRegularizer`, `GaussianPriorRegularizer`) whose
            `KL / N` for the kernel and the bias is added to the model's losses, or `None`.
        **kwargs: base layer arguments (`name`, `dtype`, ...).

    Input shape:
        Data `(batch, {dims}, channels)`, or a packed feature map `(batch, 3, {dims}, channels)`
        from another keras-dvi layer (a `(batch, 2, ...)` map, or a `(mean, variance)` pair, is
        read with shared components 0). Channels first: `(batch, channels, {dims})` and
        `(batch, 3, channels, {dims})`.

    Output shape:
        Packed `(batch, 3, {new_dims}, filters)` (channels first: `(batch, 3, filters,
        {new_dims})`): means, variances and shared components. `keras_dvi.unpack(outputs)`
        returns `(mean, variance)`.

    Example:

    >>> prior = keras_dvi.EmpiricalBayesRegularizer(num_train=len(x_train))
    >>> model = keras.Sequential([
    ...     keras.Input({input_example}),
    ...     keras_dvi.Conv{rank}DDVI(32, 3, activation="relu", regularizer=prior),
    ...     keras_dvi.MaxPooling{rank}DDVI(2),
    ...     keras_dvi.FlattenDVI(),
    ...     keras_dvi.DenseDVI(10, regularizer=prior),
    ... ])
    """


@keras.saving.register_keras_serializable(package="keras_dvi")
class Conv1DDVI(ConvDVI):
    __doc__ = _CONV_DOC.format(rank=1, dims="steps", new_dims="new_steps", input_example="(128, 3)")
    rank = 1


@keras.saving.register_keras_serializable(package="keras_dvi")
class Conv2DDVI(ConvDVI):
    __doc__ = _CONV_DOC.format(rank=2, dims="rows, cols", new_dims="new_rows, new_cols",
                               input_example="(28, 28, 1)")
    rank = 2
