"""`Conv1DMCVI`, `Conv2DMCVI`: the Monte Carlo baselines of the Bayesian convolutions."""

import keras

from keras_dvi.layers.base import BayesianLayer, SampledWeights, apply_activation
from keras_dvi.layers.conv_dvi import ConvArguments, build_kernel, check_channels, from_conv, sample_conv


class ConvMCVI(BayesianLayer):
    """Base class of `Conv1DMCVI` / `Conv2DMCVI` (see `Conv2DMCVI`): subclasses set `rank`."""

    rank = None
    outputs_moments = False  # weight samples

    def __init__(self, filters, kernel_size, strides=1, padding="valid", data_format=None, dilation_rate=1,
                 activation=None, num_samples=10, seed=None, **kwargs):
        super().__init__(activation=activation, **kwargs)
        self.sampler = SampledWeights(self, num_samples, seed)
        ConvArguments(self.rank, filters, kernel_size, strides, padding, data_format, dilation_rate).attach(self)

    from_conv = classmethod(from_conv)

    @property
    def data_rank(self):
        return self.rank + 2

    def takes_packed(self, shape):
        return False  # weight samples: plain layers may act on them per sample

    def _reads_data(self, input_shape):
        return len(input_shape) == self.data_rank if isinstance(input_shape, tuple) else None

    def build(self, input_shape):
        if len(input_shape) not in (self.rank + 2, self.rank + 3):
            raise ValueError(
                f"{type(self).__name__} expects data (batch, *spatial, channels) or samples (batch, "
                f"samples, *spatial, channels) from another MCVI layer (channels first: channels before "
                f"the spatial axes); received shape {input_shape}."
            )
        input_shape = self.conv.last_shape(input_shape)
        build_kernel(self, input_shape[-1], is_head=len(input_shape) == self.rank + 2)

    def compute_output_shape(self, input_shape):
        last = self.conv.last_shape(input_shape)
        spatial = last[1:-1] if len(last) == self.rank + 2 else last[2:-1]
        shape = ((last[0], self.sampler.output_samples(last)) + self.conv.output_spatial(spatial, self.name)
                 + (self.filters,))
        return self.conv.restore_shape(shape)

    def call(self, inputs, training=None):
        return self.sampler.call(inputs, training)

    def _sampled_forward(self, h, context):
        h = self.conv.last(h)  # (samples, batch, ...): the channel axis as in samples of the output
        check_channels(self, h.shape[-1])
        return self.conv.restore(apply_activation(sample_conv(self, h, context), self.activation))

    def get_config(self):
        config = super().get_config()
        config.update(self.conv.config())
        config.update(self.sampler.config())
        return config


_DOC = """{rank}D convolution with a factorised Gaussian posterior, trained by sampling (MCVI).

    The Monte Carlo baseline of `Conv{rank}DDVI`: the same posterior, initialisation, priors
    and arguments, but every call draws `num_samples` kernels (each shared by every position
    and example of the batch, as the network's weights are) and convolves with each, one
    grouped convolution for all samples. Outputs carry a sample axis, as `DenseMCVI`'s, so the
    sampled losses (`SampledSoftmaxELL`, `SampledHeteroscedasticELL`) apply after a `DenseMCVI`
    head. Between sampled layers, act on each sample with Keras' own layers:
    `keras.layers.TimeDistributed(keras.layers.MaxPooling{rank}D())`,
    `keras.layers.TimeDistributed(keras.layers.Flatten())`.

    Args:
        filters: positive integer, the number of output channels.
        kernel_size: positive integer or tuple of {rank} positive integers.
        strides: positive integer or tuple (default 1).
        padding: `"valid"` (default) or `"same"`.
        data_format: `"channels_last"` or `"channels_first"`; `None` (default) is
            `keras.config.image_data_format()`.
        dilation_rate: positive integer or tuple (default 1).
        activation: `None` (linear), `"relu"`, `"heaviside"`, `"leaky_relu"`, `"relu6"`,
            `"hard_silu"`, `"hard_sigmoid"`, `"silu"`, `"gelu"`, `"sigmoid"` or `"tanh"`.
        num_samples: kernel draws per call (first layer; later layers follow its sample axis).
        seed: integer seed of the draws (`None`: from Keras' global seed).
        **kwargs: the other arguments of `Conv{rank}DDVI` (`use_bias`, initializers,
            `kernel_variance_init`, `bias_variance_init`, `regularizer`, `validate`, ...).

    Input shape:
        Data `(batch, {dims}, channels)` (first layer), or samples
        `(batch, samples, {dims}, channels)` from another sampled layer (channels first:
        the channels before `{dims}`).

    Output shape:
        `(batch, samples, {new_dims}, filters)` (channels first: `(batch, samples, filters,
        {new_dims})`).

    Examples:
        >>> prior = keras_dvi.EmpiricalBayesRegularizer(num_train=len(x_train))
        >>> model = keras.Sequential([
        ...     keras.Input({input_example}),
        ...     keras_dvi.Conv{rank}DMCVI(32, 3, activation="relu", num_samples=10, regularizer=prior),
        ...     keras.layers.TimeDistributed(keras.layers.MaxPooling{rank}D()),
        ...     keras.layers.TimeDistributed(keras.layers.Flatten()),
        ...     keras_dvi.DenseMCVI(10, regularizer=prior),
        ... ])
        >>> model.compile(keras.optimizers.Adam(1e-3), loss=keras_dvi.SampledSoftmaxELL())
    """


@keras.saving.register_keras_serializable(package="keras_dvi")
class Conv1DMCVI(ConvMCVI):
    __doc__ = _DOC.format(rank=1, dims="steps", new_dims="new_steps", input_example="(128, 3)")
    rank = 1


@keras.saving.register_keras_serializable(package="keras_dvi")
class Conv2DMCVI(ConvMCVI):
    __doc__ = _DOC.format(rank=2, dims="rows, cols", new_dims="new_rows, new_cols", input_example="(28, 28, 1)")
    rank = 2
