"""`SkipDVI` and `SkipDiagDVI`: residual blocks `a = a' + f(a') W + b` on Gaussian moments."""

import keras
from keras import ops

from keras_dvi import packing
from keras_dvi.layers.base import BayesianLayer, apply_activation
from keras_dvi.maths import moments


@keras.saving.register_keras_serializable(package="keras_dvi")
class SkipDVI(BayesianLayer):
    """Residual block `a = a' + f(a') W + b` propagating mean and full covariance.

    Wu et al. (ICLR 2019), Appendix C.1: the input `a'` is a Gaussian
    pre-activation, `f(a')` is approximated as in `DenseDVI`, and the output covariance is
    `Cov(a') + Cov(delta) + C + C^T` with the cross-covariance
    `C_ik = sum_j Cov(a'_i, a'_j) E[f'(a'_j)] M_jk` (Stein's lemma), where
    `E[f'] = Phi(mu)` for ReLU and `phi(mu) / sqrt(S)` for Heaviside. The width is preserved.

    Unlike `DenseDVI`, the activation is applied *inside* the residual branch, so the input
    and output are pre-activations: stack it after a linear `DenseDVI` and read out with a
    linear `DenseDVI`.

    Args:
        activation: activation inside the residual branch: `"relu"` (default), `"heaviside"`
            or `None`.
        covariance_approximation: `"paper"` or `"exact"`, as in `DenseDVI`.
        use_bias: whether to use a Bayesian bias.
        kernel_mean_initializer: initializer of the kernel posterior means.
        bias_mean_initializer: initializer of the bias posterior means.
        kernel_variance_init: initial kernel posterior variance (`None`: `0.03 / width`).
        bias_variance_init: initial bias posterior variance (`None`: a tenth of the kernel's).
        regularizer: a prior (`EmpiricalBayesRegularizer`, `GaussianPriorRegularizer`) whose
            `KL / N` for the kernel and the bias is added to the model's losses, or `None`.
        **kwargs: base layer arguments (`name`, `dtype`, ...).

    Input shape:
        Deterministic `(batch, width)`, a packed keras-dvi tensor, or a
        `(mean, covariance)` / `(mean, variance)` pair.

    Output shape:
        Packed `(batch, width + 1, width)` whatever the input (after a deterministic input
        the covariance is diagonal: the outputs are then independent); `SkipDiagDVI`: the
        diagonal form `(batch, 2, width)`.

    Examples:
        >>> model = keras.Sequential([
        ...     keras.Input((1,)),
        ...     DenseDVI(25),                     # linear: Gaussian pre-activations
        ...     SkipDVI("relu"), SkipDVI("relu"),
        ...     DenseDVI(1),
        ... ])
    """

    _diagonal_output = False

    def __init__(self, activation="relu", covariance_approximation="paper", **kwargs):
        if not self._diagonal_output:
            activation = moments.canonical_covariance_activation(activation, type(self).__name__)
        super().__init__(activation=activation, **kwargs)
        self.covariance_approximation = moments.canonical_method(covariance_approximation)

    def build(self, input_shape):
        kind, features = packing.structure_of_shape(input_shape)
        if features is None:
            raise ValueError(
                f"The last dimension of the inputs to {type(self).__name__} must be defined."
            )
        self._build_posterior(features, features, is_head=kind == packing.DETERMINISTIC)

    def compute_output_shape(self, input_shape):
        kind, features = packing.structure_of_shape(input_shape)
        return packing.packed_shape(input_shape, features, full=not self._diagonal_output)

    def _moments(self, mean, second, kind):
        kernel_mean, kernel_var, bias_mean, bias_var = self._posterior()
        full_output = not self._diagonal_output
        if kind == packing.DETERMINISTIC:
            h = apply_activation(mean, self.activation)
            mean_d, var_d, _ = moments.linear_moments(h, kernel_mean, kernel_var, bias_mean, bias_var)
            return mean + mean_d, var_d if self._diagonal_output else moments.diag_embed(var_d)
        if kind == packing.DIAGONAL:
            variance = second
            mean_h, var_h, slope = moments.activation_moments_and_slope(mean, variance, self.activation)
            linear_inputs = {"variance": var_h}
        else:
            mean_h, cov_h = moments.activation_covariance(
                mean, second, self.activation, self.covariance_approximation
            )
            linear_inputs = {"covariance": cov_h}
            variance = moments.diagonal(second)
            slope = moments.expected_derivative(mean, variance, self.activation)
        mean_d, second_d, _ = moments.linear_moments(
            mean_h,
            kernel_mean,
            kernel_var,
            bias_mean,
            bias_var,
            full_output=full_output,
            **linear_inputs,
        )
        # C_ik = sum_j Cov(a'_i, a'_j) E[f'(a'_j)] M_jk.
        weighted = ops.expand_dims(slope, -1) * kernel_mean  # (batch, width, width)
        if kind == packing.DIAGONAL:
            cross = ops.expand_dims(variance, -1) * weighted
        elif full_output:
            cross = ops.matmul(second, weighted)
        else:
            cross_diag = ops.sum(second * ops.swapaxes(weighted, -1, -2), axis=-1)
        if full_output:
            input_cov = moments.diag_embed(variance) if kind == packing.DIAGONAL else second
            return mean + mean_d, input_cov + second_d + cross + ops.swapaxes(cross, -1, -2)
        if kind == packing.DIAGONAL:
            cross_diag = moments.diagonal(cross)
        return mean + mean_d, variance + second_d + 2.0 * cross_diag

    def _sample(self, inputs, context):
        a = self._sample_inputs(inputs, context)
        return a + self._sample_affine(apply_activation(a, self.activation), context)

    def get_config(self):
        config = super().get_config()
        config["covariance_approximation"] = self.covariance_approximation
        return config


@keras.saving.register_keras_serializable(package="keras_dvi")
class SkipDiagDVI(SkipDVI):
    """Residual block `a = a' + f(a') W + b` propagating means and variances only.

    The diagonal counterpart of `SkipDVI` (same arguments): the output variances are exact
    for the given input moments, `Var(a'_k) + Var(delta_k) + 2 C_kk`; correlations between
    outputs are dropped. After a diagonal input it costs a few dense matrix products.

    Input shape:
        As `SkipDVI`.

    Output shape:
        Packed `(batch, 2, width)`: means and variances.

    Examples:
        >>> model = keras.Sequential(
        ...     [keras.Input((1,)), DenseDiagDVI(50), SkipDiagDVI(), SkipDiagDVI(), DenseDiagDVI(1)]
        ... )
    """

    _diagonal_output = True
