"""`DenseMCVI`: the Monte Carlo baseline (MCVI) with the DVI layers' posterior and priors."""

import keras
from keras import ops

from keras_dvi.layers.base import DenseBase, SampledWeights, apply_activation


@keras.saving.register_keras_serializable(package="keras_dvi")
class DenseMCVI(DenseBase):
    """Dense layer with a factorised Gaussian posterior, trained by sampling (MCVI).

    The baseline of Wu et al. (ICLR 2019, Section 5): the same posterior parameterisation,
    initialisation and priors as `DenseDVI` (the KL to the prior is the same closed form),
    but the expected log-likelihood is estimated from `num_samples` weight draws per step
    (reparameterisation gradients) instead of propagated moments. With
    `local_reparameterization=True` the pre-activations are drawn directly from their
    Gaussian given the inputs (Kingma et al. 2015): the same distribution per example, lower
    gradient variance, but draws are independent across the examples of a batch.

    Outputs carry a sample axis, like `GlobalInducingDense`, so the same losses apply:
    `SampledHeteroscedasticELL` with a `2 D`-unit head (means, then log noise variances) or with
    `SampledHomoscedasticNoise`, and `SampledSoftmaxELL` for classification.

    Args:
        units: positive integer, output width.
        activation: `None` (linear), `"relu"`, `"heaviside"`, `"leaky_relu"`, `"relu6"`,
            `"hard_silu"`, `"hard_sigmoid"`, `"silu"`, `"gelu"`, `"sigmoid"` or `"tanh"`.
        num_samples: weight draws per call (first layer; later layers follow its sample axis).
        local_reparameterization: draw pre-activations instead of weights (see above).
        seed: integer seed of the draws (`None`: from Keras' global seed).
        **kwargs: the other arguments of `DenseDVI` (`use_bias`, initializers,
            `kernel_variance_init`, `bias_variance_init`, `regularizer`, `validate`, ...).

    Input shape:
        `(batch, in)` data (first layer), or `(batch, samples, in)` from another `DenseMCVI`.

    Output shape:
        `(batch, samples, units)`.

    Examples:
        >>> prior = EmpiricalBayesRegularizer(num_train=len(x))
        >>> model = keras.Sequential([
        ...     keras.Input((8,)),
        ...     DenseMCVI(50, "relu", num_samples=10, regularizer=prior),
        ...     DenseMCVI(2, regularizer=prior),
        ... ])
        >>> model.compile(keras.optimizers.Adam(1e-3), loss=SampledHeteroscedasticELL())
    """

    outputs_moments = False  # weight samples
    data_rank = 2

    def __init__(self, units, activation=None, num_samples=10, local_reparameterization=False, seed=None, **kwargs):
        super().__init__(units, activation=activation, **kwargs)
        self.sampler = SampledWeights(self, num_samples, seed)
        self.local_reparameterization = bool(local_reparameterization)

    def takes_packed(self, shape):
        return False  # weight samples: plain layers may act on them per sample

    def _reads_data(self, input_shape):
        return len(input_shape) == self.data_rank if isinstance(input_shape, tuple) else None

    def call(self, inputs, training=None):
        return self.sampler.call(inputs, training)

    def build(self, input_shape):
        if len(input_shape) not in (2, 3):
            raise ValueError(
                "DenseMCVI expects data (batch, features) or samples (batch, samples, features) "
                f"from another DenseMCVI layer; received shape {input_shape}."
            )
        self._build_posterior(int(input_shape[-1]), self.units, is_head=len(input_shape) == 2)

    def compute_output_shape(self, input_shape):
        return (input_shape[0], self.sampler.output_samples(input_shape), self.units)

    def _sampled_forward(self, h, context):
        self._check_features(int(h.shape[-1]))
        out = self._local_affine(h) if self.local_reparameterization else self._sample_affine(h, context)
        return apply_activation(out, self.activation)

    def _local_affine(self, h):
        """Pre-activations drawn from `N(h M + m_b, h^2 V + v_b)` per example and sample."""
        kernel_mean, kernel_var, bias_mean, bias_var = self._posterior()
        mean = ops.matmul(h, kernel_mean)
        var = ops.matmul(ops.square(h), kernel_var)
        if bias_mean is not None:
            mean, var = mean + bias_mean, var + bias_var
        noise = keras.random.normal(ops.shape(mean), dtype=mean.dtype, seed=self.seed_generator)
        return mean + ops.sqrt(var) * noise

    def get_config(self):
        config = super().get_config()
        config.update(self.sampler.config())
        config["local_reparameterization"] = self.local_reparameterization
        return config
