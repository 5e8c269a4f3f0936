"""`GlobalInducingDenseDVI`: a global inducing output layer over a DVI body, in closed form."""

import keras
from keras import ops

from keras_dvi import objective, packing, sampling
from keras_dvi.layers.global_inducing_dense import GlobalInducingDense
from keras_dvi.maths import inducing


@keras.saving.register_keras_serializable(package="keras_dvi")
class GlobalInducingDenseDVI(GlobalInducingDense):
    """Linear output layer with a global inducing point posterior over a DVI body, in closed form.

    The top of a DVI-to-global network: `keras_dvi.InducingInputs` puts `M` learned inducing
    inputs before every batch, the DVI layers (`DenseDVI`, `DenseDiagDVI`, the convolutions)
    propagate the moments of the inducing rows and the data rows alike, and this layer

    * fits its weights' posterior to the inducing rows' mean features `phi(U)` by Bayesian
      linear regression on learned pseudo-outputs `V` with precisions `lambda` (Ober &
      Aitchison 2021, eq. 11): `W ~ N(M_w, Sigma_w)`, `Sigma_w = (p I + phi^T diag(lambda)
      phi)^-1`, `M_w = Sigma_w phi^T diag(lambda) V`, a full covariance over each output
      unit's weights;
    * returns the data rows' output moments in closed form (no sampling): for an input
      `x ~ N(m, C)` independent of `W`, `E f = M_w^T [m, 1]` and
      `Cov f = M_w^T C M_w + diag(m~^T Sigma_w m~ + tr(Sigma_w C))`
      (`keras_dvi.inducing.linear_output_moments`), packed as `DenseDVI`'s output, so
      `HeteroscedasticELL` / `SoftmaxDeltaELL` and `keras_dvi.predict` apply;
    * adds the closed-form KL `KL(N(M_w, Sigma_w) || N(0, I / p)) / num_train` to the losses.

    Unlike `GlobalInducingDense` over a sampled body, the posterior depends on the body's mean
    features, not on a weight draw: a full-covariance Gaussian last layer parameterised by
    inducing points, over a factorised body, in one deterministic pass.

    Args:
        units: positive integer, output width.
        num_inducing: the `M` of the `InducingInputs` layer below (required).
        regularizer: `keras_dvi.NealPrior(num_train=N)` or `keras_dvi.StandardPrior(...)`,
            with `kl_weight` and `kl_warmup_steps` (the KL is in closed form; `ScalePrior`
            and `SpatialIWPrior` need weight draws and are refused).
        precision: `"shared"` (default) or `"per_unit"`, as in `GlobalInducingDense`.
        initial_log_precision: starting `log lambda` (default 0, the output layer's start).
        log_precision_scale, pseudo_output_initializer, validate: as in `GlobalInducingDense`.
        **kwargs: base layer arguments.

    Input shape:
        Packed moments `(M + batch, K + 1, K)` or `(M + batch, 2, K)` from a DVI layer (or
        deterministic `(M + batch, K)`), the inducing rows first.

    Output shape:
        Packed `(batch, units + 1, units)`: the data rows' mean and covariance.

    Examples:
        >>> prior = keras_dvi.EmpiricalBayesRegularizer(num_train=len(x_train))
        >>> model = keras.Sequential([
        ...     keras.Input((8,)),
        ...     keras_dvi.InducingInputs(100),
        ...     keras_dvi.DenseDiagDVI(50, "relu", regularizer=prior),
        ...     keras_dvi.DenseDiagDVI(50, "relu", regularizer=prior),
        ...     keras_dvi.GlobalInducingDenseDVI(1, num_inducing=100,
        ...                                      regularizer=keras_dvi.NealPrior(len(x_train))),
        ...     keras_dvi.HomoscedasticNoise(),
        ... ])
        >>> model.compile(keras.optimizers.Adam(1e-2), loss=keras_dvi.HeteroscedasticELL())
        >>> keras_dvi.initialize_from_data(model, x_train, y_train)
    """

    outputs_moments = True

    def __init__(self, units, num_inducing=None, regularizer=None, precision="shared",
                 initial_log_precision=0.0, **kwargs):
        for name in ("activation", "output_layer", "num_samples"):
            value = kwargs.pop(name, None)
            if name == "activation" and value is not None:
                raise ValueError("GlobalInducingDenseDVI is a linear output layer: argument `activation` "
                                 f"must be None; received {value!r}.")
        super().__init__(units, num_inducing=num_inducing, output_layer=True, precision=precision,
                         initial_log_precision=initial_log_precision, regularizer=regularizer, **kwargs)
        if getattr(self.regularizer, "learns_scale", False) or getattr(self.regularizer, "learns_spatial_precision", False):
            raise ValueError(
                "GlobalInducingDenseDVI computes its KL in closed form: argument `regularizer` must be "
                "a keras_dvi.NealPrior or StandardPrior (ScalePrior and SpatialIWPrior need weight draws: use "
                "GlobalInducingDense over sampled layers)."
            )

    def takes_packed(self, shape):
        return len(shape) == 3

    def _reads_data(self, input_shape):
        try:
            return packing.structure_of_shape(input_shape)[0] == packing.DETERMINISTIC
        except ValueError:
            return None

    def build(self, input_shape):
        kind, features = packing.structure_of_shape(tuple(input_shape))
        if self.num_inducing is None:
            raise ValueError(
                f"Layer {self.name!r}: argument `num_inducing` (the `M` of the `InducingInputs` "
                "layer below) is required."
            )
        if self.num_train is None:
            raise ValueError(
                f"Layer {self.name!r} needs a prior with the number of training examples: "
                "`regularizer=keras_dvi.NealPrior(num_train=len(x_train))`."
            )
        self._is_first = False  # the inducing inputs live in `InducingInputs`
        self._build_shapes((features,))
        self._build_variables((features,))
        self.kl_term.set_head(kind == packing.DETERMINISTIC)

    def call(self, inputs, training=None):
        if sampling.current_context(self) is not None:
            raise ValueError("GlobalInducingDenseDVI has no Monte Carlo form (`keras_dvi.predict_samples`); "
                             "its outputs are exact given its inputs' moments.")
        training = objective.resolve_training(training)
        mean, second, kind = packing.split(inputs)
        self.kl_term.start(training, mean if kind == packing.DETERMINISTIC else None)
        dtype = self.moment_dtype
        mean = ops.cast(mean, dtype)
        second = None if second is None else ops.cast(second, dtype)
        m = self.num_inducing
        chol, weight_mean = self.weight_posterior(mean[None, :m])
        kl = inducing.gaussian_kl_full(chol, weight_mean, self.prior_precision)[0]
        self.kl_term.add(kl / float(self.num_train), training)
        out_mean, out_cov = inducing.linear_output_moments(
            chol[0], weight_mean[0], mean[m:], None if second is None else second[m:])
        return packing.pack(out_mean, out_cov)

    def compute_output_shape(self, input_shape):
        batch = input_shape[0]
        batch = None if batch is None else batch - self.num_inducing
        return (batch, self.units + 1, self.units)

    def get_config(self):
        config = super().get_config()
        for name in ("activation", "output_layer", "num_samples"):
            config.pop(name, None)
        return config
