"""`Conv1DDVI`, `Conv2DDVI` and the transposed `Conv1DTransposeDVI`, `Conv2DTransposeDVI`:
Bayesian convolutions propagating per-position moments, and the convolution arguments
(`ConvArguments`) and helpers they share with the sampling baselines `Conv1DMCVI`,
`Conv2DMCVI`."""

import math

import keras
from keras import ops

from keras_dvi import packing, validation
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
from keras_dvi.layers.kl_term import build_unplaced
from keras_dvi.maths import conv_moments


class ConvArguments:
    """Keras' `Conv1D` / `Conv2D` arguments of a Bayesian convolution and what follows from
    them, shared by composition (`layer.conv`) between `ConvDVI` and the Monte Carlo `ConvMCVI`:
    validation, output sizes, the channels-last view the maths runs in (`last` / `restore`
    transpose channels-first tensors and shapes around it), the convolution with sampled
    kernels, and the config. The layer keeps the arguments as its own attributes too, as Keras'
    convolutions do (`layer.filters`, `layer.kernel_size`, ...).

    Args:
        rank: 1, 2 or 3.
        filters: positive integer, the number of output channels.
        kernel_size: positive integer or tuple of `rank` positive integers.
        strides: positive integer or tuple (default 1).
        padding: `"valid"` (default) or `"same"`.
        data_format: `"channels_last"` or `"channels_first"`; `None` (default) is
            `keras.config.image_data_format()`.
        dilation_rate: positive integer or tuple (default 1); with strides above 1 it must be 1,
            as in Keras.
        transpose: whether the convolution is transposed (`keras.layers.Conv2DTranspose`:
            kernel `(*kernel_size, filters, in)`, output positions `strides` times the input's).
        output_padding: a transposed convolution's `output_padding` (`None`, a non-negative
            integer or tuple, each below the stride), as in Keras.
    """

    def __init__(self, rank, filters, kernel_size, strides=1, padding="valid", data_format=None, dilation_rate=1,
                 transpose=False, output_padding=None):
        self.rank = rank
        self.transpose = bool(transpose)
        self.filters = validation.positive_integer("filters", filters, " (output channels)")
        self.kernel_size = integers("kernel_size", kernel_size, rank)
        self.strides = integers("strides", strides, rank)
        self.dilation_rate = integers("dilation_rate", dilation_rate, rank)
        self.padding = _padding(padding)
        self.data_format = standardize_data_format(data_format)
        if max(self.strides) > 1 and max(self.dilation_rate) > 1:
            raise ValueError(
                "Arguments `strides` and `dilation_rate` cannot both be above 1 (as in Keras' "
                f"convolutions); received strides={strides!r}, dilation_rate={dilation_rate!r}."
            )
        self.output_padding = None
        if output_padding is not None:
            if not self.transpose:
                raise ValueError("Argument `output_padding` applies to transposed convolutions only.")
            values = (output_padding,) * rank if isinstance(output_padding, int) else output_padding
            if (not isinstance(values, (tuple, list)) or len(values) != rank
                    or not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < s
                               for v, s in zip(values, self.strides))):
                raise ValueError(
                    f"Argument `output_padding` must be None or a non-negative integer or tuple of {rank} of them, "
                    f"each below the stride (strides={self.strides}), as in Keras; received "
                    f"output_padding={output_padding!r}.")
            self.output_padding = tuple(values)

    def attach(self, layer):
        """Holds these arguments in `layer.conv` and sets them as its attributes, as Keras'
        convolutions have them (`layer.filters`, `layer.kernel_size`, ...)."""
        layer.conv = self
        for name, value in self.config().items():
            setattr(layer, name, value)

    def config(self):
        config = {"filters": self.filters, "kernel_size": self.kernel_size, "strides": self.strides,
                  "padding": self.padding, "data_format": self.data_format, "dilation_rate": self.dilation_rate}
        if self.transpose:
            config["output_padding"] = self.output_padding
        return config

    def window(self):
        """The arguments of `keras_dvi.conv_moments`' convolutions."""
        window = {"strides": self.strides, "padding": self.padding, "dilation_rate": self.dilation_rate}
        if self.transpose:
            window["output_padding"] = self.output_padding
        return window

    def kernel_shape(self, channels):
        """The kernel's shape for `channels` input channels, in Keras' layout:
        `(*kernel_size, in, filters)`, transposed `(*kernel_size, filters, in)`."""
        pair = (self.filters, channels) if self.transpose else (channels, self.filters)
        return self.kernel_size + pair

    def fan_in(self, channels):
        """The inputs each output unit reads: `prod(kernel_size) * in`; transposed, on average
        `prod(kernel_size) * in / prod(strides)` (the default initial variance and the priors'
        per-fan-in scales use it)."""
        window = math.prod(self.kernel_size) * channels
        return max(1, round(window / math.prod(self.strides))) if self.transpose else window

    def moments(self, *args, depthwise=False, **kwargs):
        """`keras_dvi.conv_moments.conv_moments` (transposed: `conv_transpose_moments`, never
        depthwise) with this convolution's window."""
        if self.transpose:
            return conv_moments.conv_transpose_moments(*args, **kwargs, **self.window())
        return conv_moments.conv_moments(*args, depthwise=depthwise, **kwargs, **self.window())

    def sampled(self, inputs, kernels, bias, depthwise=False):
        """This convolution of samples, one kernel per sample (`conv_moments.sampled_conv`,
        transposed `sampled_conv_transpose`)."""
        if self.transpose:
            return conv_moments.sampled_conv_transpose(inputs, kernels, bias, **self.window())
        return conv_moments.sampled_conv(inputs, kernels, bias, depthwise=depthwise, **self.window())

    def output_spatial(self, spatial, name):
        if self.transpose:
            pads = conv_moments.transpose_pads(self.kernel_size, self.strides, self.padding, self.output_padding,
                                               self.dilation_rate)
            return tuple(None if n is None else (n - 1) * s + 1 + b + a - (k - 1) * d
                         for n, s, (b, a), k, d in zip(spatial, self.strides, pads, self.kernel_size,
                                                       self.dilation_rate))
        out = tuple(output_size(n, k, s, self.padding, d)
                    for n, k, s, d in zip(spatial, self.kernel_size, self.strides, self.dilation_rate))
        if any(n is not None and n < 1 for n in out):
            raise ValueError(
                f"Layer {name!r}: inputs of spatial shape {tuple(spatial)} are smaller than its "
                f"kernel {self.kernel_size} (dilation {self.dilation_rate}) with padding='valid'."
            )
        return out

    def last_shape(self, shape):
        """An input shape (or a pair of shapes) of the layer's data format, channels last."""
        return shape_to_channels_last(shape, self.rank, self.data_format)

    def last(self, inputs):
        """Inputs (a tensor or a pair) of the layer's data format, channels last."""
        return to_channels_last(inputs, self.rank, self.data_format)

    def restore_shape(self, shape):
        """A channels-last output shape in the layer's data format."""
        return shape_from_channels_last(shape, self.rank, self.data_format)

    def restore(self, outputs):
        """A channels-last output tensor in the layer's data format."""
        return from_channels_last(outputs, self.rank, self.data_format)


def build_kernel(layer, channels, is_head):
    """Builds `layer`'s posterior over its kernel for `channels` input channels
    (`ConvArguments.kernel_shape`)."""
    if channels is None:
        raise ValueError(f"The channel dimension of the inputs to {type(layer).__name__} must be defined.")
    layer._build_posterior(layer.conv.fan_in(channels), layer.filters, is_head,
                           kernel_shape=layer.conv.kernel_shape(channels))
    layer._channels = channels


def check_channels(layer, channels):
    if channels is not None and layer.built and channels != layer._channels:
        raise ValueError(
            f"Layer {layer.name!r} expects inputs with {layer._channels} channels; received {channels}."
        )


def sample_conv(layer, h, context):
    """`conv(h, W) + b` with `W`, `b` drawn from `layer`'s posterior, one draw per sample: `h`
    `(samples, batch, *spatial, in)` -> `(samples, batch, *out_spatial, filters)`."""
    kernel_mean, kernel_var, bias_mean, bias_var = layer._posterior()
    dtype = layer.moment_dtype
    noise = keras.random.normal((context.num_samples,) + tuple(kernel_mean.shape), dtype=dtype,
                                seed=context.seed_generator)
    bias = None
    if bias_mean is not None:
        bias = bias_mean + ops.sqrt(bias_var) * keras.random.normal(
            (context.num_samples, bias_mean.shape[-1]), dtype=dtype, seed=context.seed_generator)
    return layer.conv.sampled(ops.cast(h, dtype), kernel_mean + ops.sqrt(kernel_var) * noise, bias,
                              depthwise=getattr(layer, "depthwise", False))


def from_conv(cls, conv, kernel_variance=None, bias_variance=None, **kwargs):
    """A layer whose posterior means are the weights of a built `keras.layers.Conv1D` /
    `Conv2D` / `Conv3D` (of this layer's rank; a transposed layer: `Conv*DTranspose`)
    with one of the layer's activations.

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
    transpose = getattr(cls, "transpose", False)
    expected = {(1, False): keras.layers.Conv1D, (2, False): keras.layers.Conv2D, (3, False): keras.layers.Conv3D,
                (1, True): keras.layers.Conv1DTranspose, (2, True): keras.layers.Conv2DTranspose,
                (3, True): keras.layers.Conv3DTranspose}[cls.rank, transpose]
    if not isinstance(conv, expected) or not conv.built or getattr(conv, "groups", 1) != 1:
        raise ValueError(f"Argument `conv` must be a built keras.layers.{expected.__name__} layer (groups=1).")
    if transpose:
        kwargs.setdefault("output_padding", conv.output_padding)
    if conv.padding not in PADDINGS:
        raise ValueError("Argument `conv` must use padding 'valid' or 'same' (not 'causal').")
    activation = kwargs.pop("activation", getattr(conv.activation, "__name__", None))
    kwargs.setdefault("use_bias", conv.use_bias)
    layer = cls(
        conv.filters, conv.kernel_size, strides=conv.strides, padding=conv.padding,
        data_format=conv.data_format, dilation_rate=conv.dilation_rate, activation=None if activation == "linear" else activation,
        kernel_variance_init=kernel_variance, bias_variance_init=bias_variance, **kwargs,
    )
    channels = int(conv.kernel.shape[-1 if transpose else -2])
    build_unplaced(layer, layer.conv.restore_shape((None,) + (None,) * cls.rank + (channels,)))
    layer.set_posterior(conv.kernel, layer.kernel_variance, conv.bias if conv.use_bias else None)
    return layer


class ConvDVI(BayesianLayer):
    """Base class of `Conv1DDVI` / `Conv2DDVI` (see `Conv2DDVI`) and `DepthwiseConv2DDVI`:
    subclasses set `rank` (and `depthwise`)."""

    rank = None
    depthwise = False
    transpose = False

    def __init__(self, filters, kernel_size, strides=1, padding="valid", data_format=None, dilation_rate=1,
                 activation=None, **kwargs):
        super().__init__(activation=activation, **kwargs)
        ConvArguments(self.rank, filters, kernel_size, strides, padding, data_format, dilation_rate).attach(self)

    from_conv = classmethod(from_conv)

    def takes_packed(self, shape):
        return len(shape) == self.rank + 3

    @property
    def half_dtype(self):
        """The compute dtype of a mixed precision policy (`"float16"`, `"bfloat16"`), in which
        the layer runs its convolution of the means (under `"bfloat16"` all its convolutions:
        `keras_dvi.conv_moments.conv_moments`' `conv_dtype`); `None` otherwise."""
        dtype = keras.backend.standardize_dtype(self.compute_dtype)
        return None if dtype == self.moment_dtype else dtype

    def build(self, input_shape):
        kind, _, channels = packing.structure_of_map(self.conv.last_shape(input_shape), self.rank)
        build_kernel(self, channels, is_head=kind == packing.DETERMINISTIC)

    def _reads_data(self, input_shape):
        try:
            return packing.structure_of_map(self.conv.last_shape(input_shape), self.rank)[0] == packing.DETERMINISTIC
        except ValueError:
            return None

    def compute_output_shape(self, input_shape):
        _, spatial, _ = packing.structure_of_map(self.conv.last_shape(input_shape), self.rank)
        spatial = self.conv.output_spatial(spatial, self.name)
        return self.conv.restore_shape(packing.map_shape(input_shape, spatial, self.filters))

    def _propagate(self, inputs, training):
        mean, variance, shared, kind = packing.split_map(self.conv.last(inputs), self.rank)
        dtype = self.moment_dtype
        cast = lambda t: None if t is None else ops.cast(t, dtype)  # noqa: E731
        mean, variance, shared = cast(mean), cast(variance), cast(shared)
        check_channels(self, mean.shape[-1])
        mean, variance = validation.check_moments(mean, variance, kind, "inputs", self.validate,
                                                  where=f"{type(self).__name__} {self.name!r}")
        self._report_kl(training, mean if kind == packing.DETERMINISTIC else None)
        kernel_mean, kernel_var, bias_mean, bias_var = self._posterior()
        moments_a = self.conv.moments(mean, kernel_mean, kernel_var, bias_mean, bias_var, variance, shared,
                                      depthwise=self.depthwise, conv_dtype=self.half_dtype)
        return self.conv.restore(packing.pack_map(*conv_moments.activation_moments(*moments_a, self.activation)))

    def _sample(self, inputs, context):
        if isinstance(inputs, (list, tuple)) or len(inputs.shape) not in (self.rank + 2, self.rank + 3):
            raise ValueError(
                "While sampling, keras-dvi conv layers take deterministic (batch, *spatial, channels) "
                "inputs or (samples, batch, *spatial, channels) samples from another keras-dvi layer."
            )
        inputs = self.conv.last(inputs)
        if len(inputs.shape) == self.rank + 2:
            inputs = ops.broadcast_to(inputs[None], (context.num_samples,) + tuple(ops.shape(inputs)))
        check_channels(self, int(inputs.shape[-1]))
        return self.conv.restore(apply_activation(sample_conv(self, inputs, context), self.activation))

    def get_config(self):
        config = super().get_config()
        config.update(self.conv.config())
        return config


_CONV_DOC = """{rank}D convolution with a factorised Gaussian posterior, propagating per-position moments.

    Deterministic variational inference (Wu et al., ICLR 2019) for a convolution: the moments of
    `activation(conv(h, W) + b)` with independent Gaussian weights are computed in closed form
    at every position (eqs. 3-4 per position, the exact one-unit activation moments of Table 1),
    together with each unit's shared component, the part of its variance that every position
    of its channel shares because they share the random kernel (`keras_dvi.conv_moments`:
    without it, pooling and dense layers after the convolution under-state the output
    variance). Covariances between positions beyond that are not tracked{window_note}. The cost is four
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
        activation: `None` (linear), `"relu"`, `"heaviside"`, `"leaky_relu"`, `"relu6"`,
            `"hard_silu"`, `"hard_sigmoid"`, `"silu"`, `"gelu"`, `"sigmoid"` or `"tanh"`.
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

    Examples:
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
    __doc__ = _CONV_DOC.format(rank=1, dims="steps", new_dims="new_steps", input_example="(128, 3)", window_note="")
    rank = 1


@keras.saving.register_keras_serializable(package="keras_dvi")
class Conv2DDVI(ConvDVI):
    __doc__ = _CONV_DOC.format(rank=2, dims="rows, cols", new_dims="new_rows, new_cols",
                               input_example="(28, 28, 1)", window_note="")
    rank = 2


@keras.saving.register_keras_serializable(package="keras_dvi")
class Conv3DDVI(ConvDVI):
    __doc__ = _CONV_DOC.format(
        rank=3, dims="depth, rows, cols", new_dims="new_depth, new_rows, new_cols", input_example="(16, 32, 32, 1)",
        window_note=(": after a keras-dvi layer a\n    3x3x3 window sums 27 neighbours whose correlations it "
                     "does not see, as a 2D network with\n    5x5 kernels does (a small 3D CNN's logits: variances "
                     "0.31-1.13 of Monte Carlo's, medians\n    0.50-1.04 over ten networks; check yours with "
                     "`keras_dvi.predict_samples`)"))
    rank = 3


def _transpose_init(self, filters, kernel_size, strides=1, padding="valid", output_padding=None, data_format=None,
                    dilation_rate=1, activation=None, **kwargs):
    """`Conv1DTransposeDVI` / `Conv2DTransposeDVI`'s constructor: `ConvDVI`'s with
    `output_padding`, the arguments in the order of Keras' `Conv*DTranspose`."""
    BayesianLayer.__init__(self, activation=activation, **kwargs)
    ConvArguments(self.rank, filters, kernel_size, strides, padding, data_format, dilation_rate, transpose=True,
                  output_padding=output_padding).attach(self)


_CONV_TRANSPOSE_DOC = """{rank}D transposed convolution with a factorised Gaussian posterior, propagating
    per-position moments (`keras.layers.Conv{rank}DTranspose` for keras-dvi feature maps: the
    decoders of U-Nets and autoencoders).

    A transposed convolution is a convolution of its input with `strides - 1` zeros between
    neighbouring positions, padded, with the kernel flipped
    (`keras_dvi.conv_moments.conv_transpose_moments`): the moments are those of `Conv{rank}DDVI`
    on that input (Wu et al., ICLR 2019, eqs. 3-4 per position, exact for the given input
    moments; the shared components as for a convolution). Its convolutions run on the input
    with the zeros in, `prod(strides)` times its positions. A weight's fan-in is
    `prod(kernel_size) * input channels / prod(strides)`, the inputs an output unit reads on
    average (the default initial variance `0.03 / fan_in` and the priors' per-fan-in scales
    use it).

    Args:
        filters: positive integer, the number of output channels.
        kernel_size: positive integer or tuple of {rank} positive integers.
        strides: positive integer or tuple (default 1): the upsampling factor.
        padding: `"valid"` (default) or `"same"`, as in Keras: `"same"` gives `strides` times
            the input's positions.
        output_padding: `None` (default) or a non-negative integer or tuple, each below the
            stride: positions added after the output, as in Keras.
        data_format: `"channels_last"` or `"channels_first"`; `None` (default) is
            `keras.config.image_data_format()`.
        dilation_rate: positive integer or tuple (default 1).
        activation: `None` (linear) or one of `Conv{rank}DDVI`'s activations (`"relu"`, ...).
        **kwargs: the posterior's arguments as `Conv{rank}DDVI`'s (`use_bias`, `regularizer`,
            `kernel_variance_init`, ...) and base layer arguments.

    Input shape:
        Data `(batch, {dims}, channels)`, or a packed feature map `(batch, 3, {dims}, channels)`
        from another keras-dvi layer (channels first: `(batch, channels, {dims})`, `(batch, 3,
        channels, {dims})`).

    Output shape:
        Packed `(batch, 3, {new_dims}, filters)`: means, variances and shared components. The
        kernel has Keras' layout, `(*kernel_size, filters, input channels)`.

    Examples:
        >>> x = keras_dvi.Conv{rank}DDVI(16, 3, strides=2, padding="same", activation="relu", regularizer=prior)(inputs)
        >>> x = keras_dvi.Conv{rank}DTransposeDVI(8, 3, strides=2, padding="same", activation="relu",
        ...                                      regularizer=prior)(x)  # back to the input's size
    """


@keras.saving.register_keras_serializable(package="keras_dvi")
class Conv1DTransposeDVI(ConvDVI):
    __doc__ = _CONV_TRANSPOSE_DOC.format(rank=1, dims="steps", new_dims="new_steps")
    rank = 1
    transpose = True
    __init__ = _transpose_init


@keras.saving.register_keras_serializable(package="keras_dvi")
class Conv2DTransposeDVI(ConvDVI):
    __doc__ = _CONV_TRANSPOSE_DOC.format(rank=2, dims="rows, cols", new_dims="new_rows, new_cols")
    rank = 2
    transpose = True
    __init__ = _transpose_init


@keras.saving.register_keras_serializable(package="keras_dvi")
class Conv3DTransposeDVI(ConvDVI):
    __doc__ = _CONV_TRANSPOSE_DOC.format(rank=3, dims="depth, rows, cols", new_dims="new_depth, new_rows, new_cols")
    rank = 3
    transpose = True
    __init__ = _transpose_init
