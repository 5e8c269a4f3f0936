"""`SampledHomoscedasticNoise`: a learned noise log-variance for sampled regression outputs."""

import keras
from keras import ops

from keras_dvi.layers.homoscedastic_noise import LearnedLogVariance


@keras.saving.register_keras_serializable(package="keras_dvi")
class SampledHomoscedasticNoise(LearnedLogVariance):
    """Appends a learned (or fixed) log noise variance per target to output samples.

    The sampled counterpart of `HomoscedasticNoise`, for `GlobalInducingDense` networks: the
    likelihood is `y ~ N(f, exp(l))` with one `l` per target dimension, learned by maximising
    the ELBO (the paper's homoscedastic Gaussian likelihood, Ober & Aitchison 2021).

    Args:
        initial_log_variance: starting value of each target's log noise variance.
        log_variance_scale: Appendix H scaling: the variable holds `l / scale` (the paper's
            UCI runs start at -3 with a scale of 10).
        trainable: `True` to learn the noise, `False` to keep it fixed.
        **kwargs: base layer arguments.

    Input shape:
        `(batch, samples, D)`: samples of the function values.

    Output shape:
        `(batch, samples, 2 D)`: the `D` function values, then the `D` log noise variances
        (the layout `SampledHeteroscedasticELL` reads).

    Examples:
        >>> model = keras.Sequential([..., GlobalInducingDense(1, output_layer=True),
        ...                           SampledHomoscedasticNoise(-3.0, log_variance_scale=10.0)])
    """

    outputs_moments = False  # weight samples

    def build(self, input_shape):
        if len(input_shape) != 3 or input_shape[-1] is None:
            raise ValueError(
                "SampledHomoscedasticNoise expects samples of shape (batch, samples, D) from a "
                f"GlobalInducingDense output layer; received shape {input_shape}."
            )
        self._add_log_variance(input_shape[-1])

    def compute_output_shape(self, input_shape):
        return tuple(input_shape[:-1]) + (2 * input_shape[-1],)

    def call(self, inputs):
        log_var = ops.cast(self.log_variance, inputs.dtype) + ops.zeros_like(inputs)
        return ops.concatenate([inputs, log_var], axis=-1)
