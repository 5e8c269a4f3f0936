"""`DenseDiagDVI`: the paper's dDVI, propagating means and variances only."""

import keras

from keras_dvi import packing
from keras_dvi.layers.base import DenseBase
from keras_dvi.maths import moments


@keras.saving.register_keras_serializable(package="keras_dvi")
class DenseDiagDVI(DenseBase):
    """Dense layer with a factorised Gaussian posterior, propagating means and variances.

    The diagonal variant of deterministic variational inference (dDVI in Wu et al., ICLR 2019,
    Section 3): output units are treated as independent. The output variances are exact for
    the given input moments (eq. 4, diagonal only): after a full-covariance layer the exact
    diagonal of `M^T Cov(h) M` is used; correlations between this layer's outputs are
    dropped. Costs a few dense matrix products.

    Args:
        units: positive integer, output width.
        activation: `None` (linear) or one of the activations of `BayesianLayer` (`"relu"`,
            `"silu"`, `"gelu"`, `"tanh"`, ...).
        use_bias: whether to use a Bayesian bias.
        kernel_mean_initializer: initializer of the kernel posterior means.
        bias_mean_initializer: initializer of the bias posterior means.
        kernel_variance_init: initial kernel posterior variance (`None`: `0.03 / fan_in`).
        bias_variance_init: initial bias posterior variance (`None`: a tenth of the kernel's).
        regularizer: a prior (`EmpiricalBayesRegularizer`, `GaussianPriorRegularizer`) whose
            `KL / N` for the kernel and the bias is added to the model's losses, or `None`.
        **kwargs: base layer arguments (`name`, `dtype`, ...).

    Input shape:
        A deterministic tensor `(batch, in)`, the packed output of another keras-dvi layer,
        or a pair `(mean (batch, in), covariance (batch, in, in) or variance (batch, in))`.

    Output shape:
        Packed `(batch, 2, units)`: row 0 the means, row 1 the variances.
        `keras_dvi.unpack(outputs)` returns `(mean, variance)`.

    Examples:
        >>> model = keras.Sequential([
        ...     keras.Input((3,)),
        ...     DenseDiagDVI(64, activation="relu"),
        ...     DenseDiagDVI(64, activation="relu"),
        ...     DenseDVI(2),  # a full-covariance head on a diagonal body
        ... ])
    """

    def compute_output_shape(self, input_shape):
        return packing.packed_shape(input_shape, self.units, full=False)

    def _moments(self, mean, second, kind):
        mean_a, var_a, _ = self._affine_moments(mean, second, kind, full_output=False)
        return moments.activation_moments(mean_a, var_a, self.activation)
