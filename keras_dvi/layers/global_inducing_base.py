"""`GlobalInducingLayer`: what `GlobalInducingDense` and `GlobalInducingConv2D` share.

The inducing points, pseudo-outputs, precisions, the weight prior (and a `ScalePrior`'s
`q(s)`), the per-sample posterior draw and its Monte Carlo KL (Ober & Aitchison 2021,
Algorithm 1), the wiring of a stack of layers and the config. A subclass says how its
inducing features become the rows of the regression (`regression_rows`), how the weights act
on its inputs (`apply_weights`), and its shapes.
"""

import keras
import numpy as np
from keras import ops

from keras_dvi import objective, packing, priors, validation
from keras_dvi.layers.boundary import KerasDVILayer
from keras_dvi.layers.kl_term import KLTerm
from keras_dvi.maths import inducing

#: Appendix H of Ober & Aitchison: the log precisions are stored divided by this factor (and
#: multiplied back in the forward pass), so Adam moves them this much faster.
DEFAULT_LOG_PRECISION_SCALE = 3.0


def positive_int(name, value, allow_none=False):
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(f"Argument `{name}` must be a positive integer; received {name}={value!r}.")
    return int(value)


class GlobalInducingLayer(KerasDVILayer):
    """Base class of the global inducing point layers (see `GlobalInducingDense`).

    Subclasses set `data_rank` (the rank of the data a first layer reads, batch included) and
    implement `_build_shapes`, `regression_rows`, `apply_weights` and `_output_tail`.
    """

    outputs_moments = False  # weight samples
    data_rank = 2

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
        self.units = positive_int("units", units)
        self.activation = keras.activations.get(activation)
        self.num_inducing = positive_int("num_inducing", num_inducing, allow_none=True)
        self.regularizer = None if regularizer is None else priors.get_weight_prior(regularizer)
        self.output_layer = bool(output_layer)
        if precision not in ("shared", "per_unit"):
            raise ValueError(
                f"Argument `precision` must be 'shared' or 'per_unit'; received {precision!r}."
            )
        self.precision = precision
        self.num_samples = positive_int("num_samples", num_samples)
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
        self.kl_term = KLTerm(self)

    # ---------------------------------------------------------------- wiring

    def takes_packed(self, shape):
        """`False`: the inputs of a later layer are weight samples (ordinary numbers, the
        inducing rows first), on which plain layers may act per sample
        (`keras.layers.TimeDistributed(keras.layers.MaxPooling2D())`)."""
        return False

    def __call__(self, inputs, *args, **kwargs):
        if not self.built and hasattr(inputs, "shape") and len(inputs.shape) == self.data_rank + 1:
            self._inherit(self.upstream_layer(inputs))
        return super().__call__(inputs, *args, **kwargs)

    @staticmethod
    def upstream_layer(inputs):
        """The keras-dvi layer that produced `inputs` (a symbolic tensor of a functional or
        `Sequential` model), or `None`."""
        return packing.producer_of(inputs)

    @property
    def num_train(self):
        """`N` of the layer's prior (`None` until known)."""
        return None if self.regularizer is None else self.regularizer.num_train

    def _inherit(self, upstream):
        """A later layer takes `num_inducing` and its prior (or the prior's `num_train`) from the
        global inducing layer feeding it."""
        if not isinstance(upstream, GlobalInducingLayer):
            if getattr(upstream, "local_reparameterization", False):
                raise ValueError(
                    f"Layer {self.name!r} follows {upstream.name!r}, which draws pre-activations "
                    "(`local_reparameterization=True`): each row, inducing points included, then "
                    "sees different weights, and the inducing points no longer describe the data's "
                    "network. Use `local_reparameterization=False` (the default) below a global "
                    "inducing layer."
                )
            if self.num_inducing is None:
                raise ValueError(
                    f"Layer {self.name!r} received samples that do not come straight from a global "
                    "inducing layer (e.g. through `keras.layers.TimeDistributed(...)`, or from a "
                    "sampled `DenseMCVI` / `Conv2DMCVI` body after `keras_dvi.InducingInputs`); pass "
                    "`num_inducing` (and `regularizer`) explicitly, or feed it data to make it "
                    "the first layer."
                )
            return
        if upstream.output_layer:
            raise ValueError(
                f"Layer {self.name!r} follows {upstream.name!r}, which has `output_layer=True` "
                "and returns no inducing points: only the last global inducing layer may be an "
                "output layer."
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

    def _build_shapes(self, data_shape):
        """Sets `fan_in` (the prior's fan-in), `weight_rows` (rows of the weight matrix, bias
        included) and `pseudo_output_shape` from the shape of one example's input."""
        raise NotImplementedError

    def build(self, input_shape):
        name = type(self).__name__
        if len(input_shape) not in (self.data_rank, self.data_rank + 1):
            raise ValueError(
                f"{name} expects data of rank {self.data_rank} (batch included; first layer) or the "
                f"samples `(M + batch, samples, ...)` of another global inducing layer; received "
                f"shape {input_shape}."
            )
        self._is_first = len(input_shape) == self.data_rank
        data_shape = tuple(input_shape[1:] if self._is_first else input_shape[2:])
        if any(n is None for n in data_shape):
            raise ValueError(f"The non-batch dimensions of the inputs to {name} must be defined; "
                             f"received shape {input_shape}.")
        if self.num_inducing is None:
            raise ValueError(
                f"Layer {self.name!r} is the first global inducing layer: argument "
                "`num_inducing` (the number of inducing points, e.g. 100) is required."
            )
        if self.num_train is None:
            raise ValueError(
                f"Layer {self.name!r} needs a prior with the number of training examples (the KL "
                "is divided by it): `regularizer=keras_dvi.NealPrior(num_train=len(x_train))` "
                "(later layers take it from a global inducing layer feeding them)."
            )
        self._build_shapes(data_shape)
        self._build_variables(data_shape)

    def _build_variables(self, data_shape):
        """The layer's variables (the inducing inputs in a first layer) and its KL schedule."""
        if self._is_first:
            self.inducing_inputs = self.add_weight(
                name="inducing_inputs",
                shape=(self.num_inducing,) + data_shape,
                initializer=self.inducing_initializer,
                autocast=False,
            )
        self.pseudo_outputs = self.add_weight(
            name="pseudo_outputs",
            shape=(self.num_inducing,) + tuple(self.pseudo_output_shape),
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
        if getattr(self.regularizer, "learns_spatial_precision", False):  # SpatialIWPrior: this layer's q(L)
            dims = self.spatial_size
            self.spatial_tril = self.add_weight(
                name="spatial_tril", shape=(dims, dims), autocast=False,
                initializer=keras.initializers.Constant(self.regularizer.initial_tril(dims)))
            self.spatial_log_nu = self.add_weight(
                name="spatial_log_nu", shape=(), autocast=False,
                initializer=keras.initializers.Constant(self.regularizer.initial_log_nu))
        self.kl_term.build(is_head=self._is_first)

    # ---------------------------------------------------------------- maths

    @property
    def log_precision(self):
        """`log lambda`, `(M,)` or `(M, units)`."""
        return self.log_precision_scale * ops.convert_to_tensor(self.scaled_log_precision)

    #: Positions of a kernel (`k_h k_w` for a convolution; 1 for a dense layer): the size of a
    #: `SpatialIWPrior`'s spatial precision.
    spatial_size = 1

    @property
    def prior_precision(self):
        return self.regularizer.prior_precision(self.fan_in)

    def regression_rows(self, inducing_features, precision, pseudo_outputs):
        """`(phi, lambda, V)`: the rows of the layer's Bayesian linear regression (eq. 11) from
        the inducing points' inputs `(S, M, ...)`, their precisions `(M,)` / `(M, units)` and
        pseudo-outputs `(M, ...)`: `phi` `(S, R, weight_rows)` with the bias column, `lambda`
        `(R,)` / `(R, units)`, `V` `(R, units)`."""
        raise NotImplementedError

    def apply_weights(self, h, weights):
        """The layer's pre-activations: inputs `h` `(S, rows, ...)` under the weight draws
        `(S, weight_rows, units)`."""
        raise NotImplementedError

    def _posterior_arguments(self, inducing_features):
        dtype = self.moment_dtype
        precision = ops.exp(ops.cast(self.log_precision, dtype))
        return self.regression_rows(ops.cast(inducing_features, dtype), precision,
                                    ops.cast(self.pseudo_outputs, dtype))

    def weight_posterior(self, inducing_features):
        """`(chol, mean)` of the weight posterior given the inputs of the inducing points,
        `(samples, M, ...)`, under the prior's precision (a `ScalePrior`'s mean); see
        `keras_dvi.inducing.weight_posterior`."""
        return inducing.weight_posterior(
            *self._posterior_arguments(inducing_features), self.prior_precision
        )

    def sample_posterior(self, inducing_features, noise, prior_precision=None):
        """`(chol, weights)`: the factor of `A` and the weight draws `M_w + L^{-T} noise`,
        `noise` `(samples, weight_rows, units)` (`keras_dvi.inducing.posterior_sample`), under
        `prior_precision` (default: the prior's, `prior_precision`)."""
        return inducing.posterior_sample(
            *self._posterior_arguments(inducing_features),
            self.prior_precision if prior_precision is None else prior_precision, noise
        )

    def sample_prior_precision(self, samples, dtype):
        """`(p, log_ratio)`: the prior precision of the weights for each of `samples` draws and
        the prior's own `log p - log q` per draw: for a `ScalePrior`, `p = s fan_in` with `s`
        drawn from this layer's `q(s)`; for a `SpatialIWPrior`, a precision matrix per draw
        `(samples, P, P)` from this layer's `q(L)`; else the prior's constant and 0."""
        if getattr(self.regularizer, "learns_spatial_precision", False):
            return self.regularizer.sample_precision(
                self.spatial_tril, self.spatial_log_nu, self.fan_in // self.spatial_size,
                self.weight_rows > self.fan_in, samples, dtype, self.seed_generator)
        if not getattr(self.regularizer, "learns_scale", False):
            return self.prior_precision, 0.0
        scale, log_ratio = self.regularizer.sample_scale(
            self.scale_log_alpha, self.scale_log_beta, samples, dtype, self.seed_generator)
        return scale * float(self.fan_in), log_ratio

    def call(self, inputs, training=None):
        training = objective.resolve_training(training)
        self.kl_term.start(training, inputs if self._is_first else None)
        dtype = self.moment_dtype
        inputs = ops.cast(inputs, dtype)
        m = self.num_inducing
        if self._is_first:
            inputs = validation.check_finite(inputs, "inputs", self.validate)
            rows = ops.concatenate([ops.cast(self.inducing_inputs, dtype), inputs], axis=0)
            samples = self.num_samples
            h = ops.broadcast_to(rows[None], (samples,) + tuple(ops.shape(rows)))
        else:
            rank = len(inputs.shape)
            h = ops.transpose(inputs, (1, 0) + tuple(range(2, rank)))  # (samples, M + batch, ...)
            samples = inputs.shape[1]
        noise = keras.random.normal(
            (samples, self.weight_rows, self.units), dtype=dtype, seed=self.seed_generator
        )
        prior_precision, scale_log_ratio = self.sample_prior_precision(samples, dtype)
        chol, weights = self.sample_posterior(h[:, :m], noise, prior_precision)
        log_ratio = inducing.log_posterior_density(chol, noise) - inducing.log_prior_density(
            weights, prior_precision
        ) - scale_log_ratio
        self.kl_term.add(ops.mean(log_ratio) / float(self.num_train), training)
        out = self.activation(self.apply_weights(h, weights))
        if self.output_layer:
            out = out[:, m:]
        rank = len(out.shape)
        return ops.transpose(out, (1, 0) + tuple(range(2, rank)))

    def _output_tail(self, data_shape):
        """The output's shape after the batch and sample axes, from the input's."""
        raise NotImplementedError

    def compute_output_shape(self, input_shape):
        first = len(input_shape) == self.data_rank
        samples = self.num_samples if first else input_shape[1]
        batch = input_shape[0]
        if first and not self.output_layer:
            batch = None if batch is None else batch + self.num_inducing
        if not first and self.output_layer:
            batch = None if batch is None else batch - self.num_inducing
        tail = self._output_tail(tuple(input_shape[1:] if first else input_shape[2:]))
        return (batch, samples) + tuple(tail)

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
