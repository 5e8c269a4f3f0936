"""`GlobalInducingDense`: a dense layer with a global inducing point posterior."""

import keras
from keras import ops

from keras_dvi.layers.global_inducing_base import GlobalInducingLayer
from keras_dvi.maths import inducing


@keras.saving.register_keras_serializable(package="keras_dvi")
class GlobalInducingDense(GlobalInducingLayer):
    """Fully connected layer with a global inducing point posterior (Ober & Aitchison 2021).

    The weights `W` (bias as one more input row) have the posterior of Bayesian linear
    regression from the features `phi(U)` of `M` inducing points to learned pseudo-outputs `V`
    with learned precisions `lambda` (eq. 11):

    `Sigma_w = (p I + phi(U)^T diag(lambda) phi(U))^-1`, `M_w = Sigma_w phi(U)^T diag(lambda) V`,

    where `p` is the prior precision (`NealPrior`: `p = fan_in`), set by the layer's
    `regularizer`. Every call draws `W ~ N(M_w,
    Sigma_w)` (one Cholesky factorisation per sample, output units as right-hand sides), and
    propagates the inducing points and the data with the same draw (Algorithm 1), so the
    posterior of each layer depends on the weights drawn below it. The layer adds the Monte
    Carlo KL term `(log Q(W) - log P(W)) / num_train`, averaged over samples, to the model's
    losses (times the prior's KL weight and warm-up, as in every keras-dvi layer) and reports
    it as `kl` during `fit`.

    A network is a stack of these layers:

    * the first one receives the data `(batch, features)` and owns the inducing inputs `U0`
      (`num_inducing` rows, a Keras variable), and draws `num_samples` weight samples per call;
    * the layers in between receive and return the inducing points and the data together,
      as one tensor `(M + batch, samples, units)` (inducing rows first);
    * the last one has `output_layer=True` and returns the data part only, `(batch, samples,
      units)`, which `model.predict` concatenates along the batch.

    Deterministic Keras layers may come before the first layer (the inducing inputs then live
    in their feature space), not between or after.

    Args:
        units: positive integer, output width.
        activation: any Keras activation (applied to the sampled pre-activations).
        num_inducing: number of inducing points `M` (first layer; later layers inherit it).
            The paper takes as many as a batch has rows; on UCI data under `StandardPrior`
            that, more than the step count, is what a whole-network model needed
            (BENCHMARKS.md, Appendix P).
        output_layer: `True` for the last layer of the stack.
        precision: `"shared"` (one `lambda` per inducing point, one Cholesky factor per sample)
            or `"per_unit"` (one per inducing point and output unit, as in the paper's UCI
            runs; one factor per sample and unit: several times the step, and the better fit
            on the UCI sets measured, BENCHMARKS.md "Appendix P").
        num_samples: weight samples per call (first layer; later layers follow it). The
            output has a sample axis either way.
        initial_log_precision: starting `log lambda`; `None` means -4, or 0 for the output
            layer (paper, Appendix O).
        log_precision_scale: Appendix H scaling of the stored log precisions (default 3).
        inducing_initializer: initializer of `U0` (default `N(0, 1)`); see
            `keras_dvi.initialize_from_data` for the paper's data-based start.
        pseudo_output_initializer: initializer of `V` (default `N(0, 1)`).
        seed: integer seed of the layer's weight draws (`None`: from Keras' global seed).
        validate: data inputs are checked for NaN/inf in eager calls; `True` also checks them
            inside compiled functions.
        regularizer: the weight prior with the objective's settings, as on every keras-dvi
            layer: `keras_dvi.NealPrior(num_train=N)` (`N(0, 1 / fan_in)`),
            `keras_dvi.StandardPrior(num_train=N)` (`N(0, 1)`) or
            `keras_dvi.ScalePrior(num_train=N)` (`N(0, 1 / (s fan_in))`, a learned Gamma
            posterior over `s` in each layer: weights `scale_log_alpha`, `scale_log_beta`),
            each with `kl_weight` and `kl_warmup_steps`. `fan_in` counts the inputs without
            the bias column; the bias has the same prior. Required on the first layer; a
            later layer without one takes the prior of the layer feeding it (and a prior
            without `num_train` takes its `N`).
        **kwargs: base layer arguments.

    Input shape:
        First layer: `(batch, features)`. Others: `(M + batch, samples, features)`.

    Output shape:
        `(batch, samples, units)` for the output layer, `(M + batch, samples, units)` otherwise.

    Examples:
        >>> model = keras.Sequential([
        ...     keras.Input((1,)),
        ...     GlobalInducingDense(50, "relu", num_inducing=100,
        ...                         regularizer=keras_dvi.NealPrior(num_train=len(x))),
        ...     GlobalInducingDense(50, "relu"),  # takes num_inducing and the prior from above
        ...     GlobalInducingDense(1, output_layer=True),
        ...     SampledHomoscedasticNoise(),
        ... ])
        >>> model.compile(keras.optimizers.Adam(1e-2), loss=SampledHeteroscedasticELL())
        >>> initialize_from_data(model, x, y)
        >>> model.fit(x, y, epochs=100)
    """

    data_rank = 2

    def _build_shapes(self, data_shape):
        self.fan_in = int(data_shape[-1])
        self.weight_rows = self.fan_in + 1
        self.pseudo_output_shape = (self.units,)

    def regression_rows(self, inducing_features, precision, pseudo_outputs):
        return inducing.append_ones(inducing_features), precision, pseudo_outputs

    def apply_weights(self, h, weights):
        return ops.einsum("snp,spu->snu", inducing.append_ones(h), weights)

    def _output_tail(self, data_shape):
        return (self.units,)
