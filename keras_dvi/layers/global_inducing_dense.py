"""`GlobalInducingDense`: a dense layer with a global inducing point posterior."""

import keras
import numpy as np
from keras import ops

from keras_dvi import inducing, priors, validation
from keras_dvi.layers import boundary
from keras_dvi.layers.reporting import ELBOReportingLayer

#: Appendix H of Ober & Aitchison: the log precisions are stored divided by this factor (and
#: multiplied back in the forward pass), so Adam moves them this much faster.
DEFAULT_LOG_PRECISION_SCALE = 3.0


def _positive_int(name, value, allow_none=False):
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(f"Argument `{name}` must be a positive integer; received {name}={value!r}.")
    return int(value)


@keras.saving.register_keras_serializable(package="keras_dvi")
class GlobalInducingDense(ELBOReportingLayer):
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
        output_layer: `True` for the last layer of the stack.
        precision: `"shared"` (one `lambda` per inducing point, one Cholesky factor per sample)
            or `"per_unit"` (one per inducing point and output unit, as in the paper's UCI
            runs; one factor per sample and unit).
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

    Example:

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

    outputs_moments = False  # weight samples

    def __init__(
        self,
        units,
        activation=None,
        num_inducing=None,
        output_layer=False,
        precision="shared",
        num_samples=1,
        initial_log_precision=None,
        log_precision_scale=DEFAULT_LOG_PRECISION_SCALE,
        inducing_initializer=None,
        pseudo_output_initializer=None,
        seed=None,
        validate=False,
        regularizer=None,
        **kwargs,
    ):
        kwargs.setdefault("autocast", False)  # float32 linear algebra under mixed precision
        super().__init__(**kwargs)
        self.units = _positive_int("units", units)
        self.activation = keras.activations.get(activation)
        self.num_inducing = _positive_int("num_inducing", num_inducing, allow_none=True)
        self.regularizer = None if regularizer is None else priors.get_weight_prior(regularizer)
        self.output_layer = bool(output_layer)
        if precision not in ("shared", "per_unit"):
            raise ValueError(
                f"Argument `precision` must be 'shared' or 'per_unit'; received {precision!r}."
            )
        self.precision = precision
        self.num_samples = _positive_int("num_samples", num_samples)
        if initial_log_precision is None:
            initial_log_precision = 0.0 if self.output_layer else -4.0
        self.initial_log_precision = float(initial_log_precision)
        self.log_precision_scale = validation.positive_number("log_precision_scale", log_precision_scale)
        self.inducing_initializer = keras.initializers.get(
            inducing_initializer or keras.initializers.RandomNormal(stddev=1.0)
        )
        self.pseudo_output_initializer = keras.initializers.get(
            pseudo_output_initializer or keras.initializers.RandomNormal(stddev=1.0)
        )
        self.seed = seed
        self.seed_generator = keras.random.SeedGenerator(seed)
        self.validate = bool(validate)
        self.inducing_inputs = None
        self._is_first = None

    # ---------------------------------------------------------------- wiring

    def __call__(self, inputs, *args, **kwargs):
        if not self.built and hasattr(inputs, "shape") and len(inputs.shape) == 3:
            self._inherit(self.upstream_layer(inputs))
        return super().__call__(inputs, *args, **kwargs)

    @staticmethod
    def upstream_layer(inputs):
        """The keras-dvi layer that produced `inputs` (a symbolic tensor of a functional or
        `Sequential` model), or `None`."""
        return boundary.producer_of(inputs)

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        if "prior" in config or "num_train" in config:  # a file saved by 0.1.0.dev0, before `regularizer`
            prior = priors.get_weight_prior(config.pop("prior", None) or "neal")
            num_train = config.pop("num_train", None)
            config["regularizer"] = prior if num_train is None else prior.with_num_train(num_train)
        return super().from_config(config)

    @property
    def num_train(self):
        """`N` of the layer's prior (`None` until known)."""
        return None if self.regularizer is None else self.regularizer.num_train

    def _inherit(self, upstream):
        """A later layer takes `num_inducing` and its prior (or the prior's `num_train`) from the
        layer feeding it."""
        if not isinstance(upstream, GlobalInducingDense):
            if self.num_inducing is None:
                raise ValueError(
                    f"Layer {self.name!r} received a 3-D input that does not come from a "
                    "GlobalInducingDense layer; pass `num_inducing` explicitly, or feed it "
                    "2-D data to make it the first layer."
                )
            return
        if upstream.output_layer:
            raise ValueError(
                f"Layer {self.name!r} follows {upstream.name!r}, which has `output_layer=True` "
                "and returns no inducing points: only the last GlobalInducingDense layer may "
                "be an output layer."
            )
        if self.num_inducing is None:
            self.num_inducing = upstream.num_inducing
        elif upstream.num_inducing is not None and self.num_inducing != upstream.num_inducing:
            raise ValueError(
                f"Argument `num_inducing` of layer {self.name!r} is {self.num_inducing}, but the "
                f"layer feeding it, {upstream.name!r}, has {upstream.num_inducing}; leave it out "
                "to inherit it."
            )
        if self.regularizer is None:
            self.regularizer = upstream.regularizer
        elif self.num_train is None and upstream.num_train is not None:
            self.regularizer = self.regularizer.with_num_train(upstream.num_train)
        elif upstream.num_train is not None and self.num_train != upstream.num_train:
            raise ValueError(
                f"Argument `num_train` of the prior of layer {self.name!r} is {self.num_train}, "
                f"but the layer feeding it, {upstream.name!r}, has {upstream.num_train}; the "
                "number of training examples is the same for every layer."
            )

    def build(self, input_shape):
        if len(input_shape) not in (2, 3):
            raise ValueError(
                f"GlobalInducingDense expects data `(batch, features)` (first layer) or the "
                f"output of another GlobalInducingDense layer; received shape {input_shape}."
            )
        features = input_shape[-1]
        if features is None:
            raise ValueError("The last dimension of the inputs to GlobalInducingDense must be defined.")
        self._is_first = len(input_shape) == 2
        if self.num_inducing is None:
            raise ValueError(
                f"Layer {self.name!r} is the first GlobalInducingDense layer: argument "
                "`num_inducing` (the number of inducing points, e.g. 100) is required."
            )
        if self.num_train is None:
            raise ValueError(
                f"Layer {self.name!r} is the first GlobalInducingDense layer: it needs a prior "
                "with the number of training examples (the KL is divided by it): "
                "`regularizer=keras_dvi.NealPrior(num_train=len(x_train))`."
            )
        self.fan_in = int(features)
        if self._is_first:
            self.inducing_inputs = self.add_weight(
                name="inducing_inputs",
                shape=(self.num_inducing, self.fan_in),
                initializer=self.inducing_initializer,
                autocast=False,
            )
        self.pseudo_outputs = self.add_weight(
            name="pseudo_outputs",
            shape=(self.num_inducing, self.units),
            initializer=self.pseudo_output_initializer,
            autocast=False,
        )
        shape = (self.num_inducing,) if self.precision == "shared" else (self.num_inducing, self.units)
        self.scaled_log_precision = self.add_weight(
            name="scaled_log_precision",
            shape=shape,
            initializer=keras.initializers.Constant(self.initial_log_precision / self.log_precision_scale),
            autocast=False,
        )
        if getattr(self.regularizer, "learns_scale", False):  # ScalePrior: this layer's q(s)
            self.scale_log_alpha, self.scale_log_beta = (
                self.add_weight(name=name, shape=(), initializer=keras.initializers.Constant(6.0), autocast=False)
                for name in ("scale_log_alpha", "scale_log_beta"))
        self._build_kl_step(is_head=self._is_first)

    # ---------------------------------------------------------------- maths

    @property
    def moment_dtype(self):
        """float32 under mixed precision (Cholesky factorisations need it), else the compute
        dtype."""
        dtype = keras.backend.standardize_dtype(self.compute_dtype)
        return "float32" if dtype in ("float16", "bfloat16") else dtype

    @property
    def log_precision(self):
        """`log lambda`, `(M,)` or `(M, units)`."""
        return self.log_precision_scale * ops.convert_to_tensor(self.scaled_log_precision)

    @property
    def prior_precision(self):
        return self.regularizer.prior_precision(self.fan_in)

    def _posterior_arguments(self, inducing_features):
        """`(phi, lambda, V)` in the moment dtype, `phi` with its bias column."""
        dtype = self.moment_dtype
        phi = inducing.append_ones(ops.cast(inducing_features, dtype))
        precision = ops.exp(ops.cast(self.log_precision, dtype))
        return phi, precision, ops.cast(self.pseudo_outputs, dtype)

    def weight_posterior(self, inducing_features):
        """`(chol, mean)` of the weight posterior given the inducing features `phi(U)`,
        `(samples, M, fan_in)` (bias column added here); see `keras_dvi.inducing`."""
        return inducing.weight_posterior(
            *self._posterior_arguments(inducing_features), self.prior_precision
        )

    def sample_posterior(self, inducing_features, noise, prior_precision=None):
        """`(chol, weights)`: the factor of `A` and the weight draws `M_w + L^{-T} noise`,
        `noise` `(samples, fan_in + 1, units)` (`keras_dvi.inducing.posterior_sample`), under
        `prior_precision` (default: the prior's, `prior_precision`)."""
        return inducing.posterior_sample(
            *self._posterior_arguments(inducing_features),
            self.prior_precision if prior_precision is None else prior_precision, noise
        )

    def sample_prior_precision(self, samples, dtype):
        """`(p, log_ratio)`: the prior precision of the weights for each of `samples` draws and
        the prior's own `log p - log q` per draw: for a `ScalePrior`, `p = s fan_in` with `s`
        drawn from this layer's `q(s)`; else the prior's constant and 0."""
        if not getattr(self.regularizer, "learns_scale", False):
            return self.prior_precision, 0.0
        scale, log_ratio = self.regularizer.sample_scale(
            self.scale_log_alpha, self.scale_log_beta, samples, dtype, self.seed_generator)
        return scale * float(self.fan_in), log_ratio

    def call(self, inputs, training=None):
        training = self._training(training)
        self._start_network(training, inputs if self._is_first else None)
        dtype = self.moment_dtype
        inputs = ops.cast(inputs, dtype)
        m = self.num_inducing
        if self._is_first:
            inputs = validation.check_finite(inputs, "inputs", self.validate)
            rows = ops.concatenate([ops.cast(self.inducing_inputs, dtype), inputs], axis=0)
            samples = self.num_samples
            h = ops.broadcast_to(rows[None], (samples,) + tuple(ops.shape(rows)))
        else:
            h = ops.transpose(inputs, (1, 0, 2))  # (samples, M + batch, features)
            samples = inputs.shape[1]
        noise = keras.random.normal(
            (samples, self.fan_in + 1, self.units), dtype=dtype, seed=self.seed_generator
        )
        prior_precision, scale_log_ratio = self.sample_prior_precision(samples, dtype)
        chol, weights = self.sample_posterior(h[:, :m], noise, prior_precision)
        log_ratio = inducing.log_posterior_density(chol, noise) - inducing.log_prior_density(
            weights, prior_precision
        ) - scale_log_ratio
        self._report_kl_value(ops.mean(log_ratio) / float(self.num_train), training)
        out = self.activation(ops.einsum("snp,spu->snu", inducing.append_ones(h), weights))
        if self.output_layer:
            out = out[:, m:]
        return ops.transpose(out, (1, 0, 2))

    def compute_output_shape(self, input_shape):
        samples = self.num_samples if len(input_shape) == 2 else input_shape[1]
        batch = input_shape[0]
        if len(input_shape) == 2 and not self.output_layer:
            batch = None if batch is None else batch + self.num_inducing
        if len(input_shape) == 3 and self.output_layer:
            batch = None if batch is None else batch - self.num_inducing
        return (batch, samples, self.units)

    # ---------------------------------------------------------------- config

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "units": self.units,
                "activation": keras.activations.serialize(self.activation),
                "num_inducing": self.num_inducing,
                "output_layer": self.output_layer,
                "regularizer": None if self.regularizer is None
                else keras.saving.serialize_keras_object(self.regularizer),
                "precision": self.precision,
                "num_samples": self.num_samples,
                "initial_log_precision": self.initial_log_precision,
                "log_precision_scale": self.log_precision_scale,
                "inducing_initializer": keras.initializers.serialize(self.inducing_initializer),
                "pseudo_output_initializer": keras.initializers.serialize(
                    self.pseudo_output_initializer
                ),
                "seed": self.seed,
                "validate": self.validate,
            }
        )
        return config
