"""`DenseDVI`: a fully connected Bayesian layer propagating full covariance matrices."""

import keras

from keras_dvi import packing
from keras_dvi.layers.base import DenseBase
from keras_dvi.maths import moments


@keras.saving.register_keras_serializable(package="keras_dvi")
class DenseDVI(DenseBase):
    """Dense layer with a factorised Gaussian posterior, propagating mean and full covariance.

    Computes the Gaussian approximation to `activation(h W + b)` by deterministic variational
    inference (Wu et al., ICLR 2019): the linear map is exact (eqs. 3-4), the activation
    moments are exact on the diagonal (Table 1) and, off the diagonal, use either the paper's
    asymptote plus correction (eqs. 6-7, with Table 1 as corrected in the documentation's
    mathematics page) or
    the exact bivariate normal closed form.

    Args:
        units: positive integer, output width.
        activation: `None` (linear), `"relu"`, `"heaviside"` or `"leaky_relu"` (the activations
            with a pairwise covariance).
        covariance_approximation: `"paper"` (default, fast) or `"exact"` (bivariate normal
            closed form through Owen's T; no approximation beyond the Gaussian assumption,
            and the covariance stays positive semi-definite).
        use_bias: whether to use a Bayesian bias.
        kernel_mean_initializer: initializer of the kernel posterior means.
        bias_mean_initializer: initializer of the bias posterior means.
        kernel_variance_init: initial kernel posterior variance (`None`: `0.03 / fan_in`).
        bias_variance_init: initial bias posterior variance (`None`: a tenth of the kernel's).
        regularizer: a prior (`EmpiricalBayesRegularizer`, `GaussianPriorRegularizer`) whose
            `KL / N` for the kernel and the bias is added to the model's losses, or `None`.
        **kwargs: base layer arguments (`name`, `dtype`, ...).

    Input shape:
        A deterministic tensor `(batch, in)`, the packed output of another keras-dvi layer
        (`(batch, in + 1, in)` or `(batch, 2, in)`), or a pair
        `(mean (batch, in), covariance (batch, in, in) or variance (batch, in))`.

    Output shape:
        Packed `(batch, units + 1, units)`: row 0 the mean, rows 1.. the covariance, whatever
        the input (after a deterministic input the covariance is diagonal: the units are
        independent). Use `keras_dvi.unpack(outputs)` to get `(mean, covariance)`.

    Examples:
        >>> model = keras.Sequential([
        ...     keras.Input((3,)),
        ...     DenseDVI(32, activation="relu"),
        ...     DenseDVI(32, activation="relu"),
        ...     DenseDVI(2),
        ... ])
        >>> mean, cov = keras_dvi.unpack(model(x), covariance="full")  # (B, 2), (B, 2, 2)
    """

    def __init__(self, units, activation=None, covariance_approximation="paper", **kwargs):
        super().__init__(units, activation=moments.canonical_covariance_activation(activation, "DenseDVI"), **kwargs)
        self.covariance_approximation = moments.canonical_method(covariance_approximation)

    def compute_output_shape(self, input_shape):
        packing.structure_of_shape(input_shape)  # checks it
        return packing.packed_shape(input_shape, self.units, full=True)

    def _moments(self, mean, second, kind):
        mean_a, second_a, diagonal = self._affine_moments(mean, second, kind, full_output=True)
        if diagonal:  # deterministic inputs: independent units, a diagonal covariance
            mean_h, var_h = moments.activation_moments(mean_a, second_a, self.activation)
            return mean_h, moments.diag_embed(var_h)
        return moments.activation_covariance(
            mean_a, second_a, self.activation, self.covariance_approximation
        )

    def get_config(self):
        config = super().get_config()
        config["covariance_approximation"] = self.covariance_approximation
        return config
