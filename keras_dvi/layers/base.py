"""Shared machinery of the factorised-Gaussian keras-dvi layers.

`BayesianLayer` owns the variational posterior `q(W) q(b)` (independent Gaussians, stored as
means and log standard deviations), its initialisation and introspection, the sampling
forward pass used by `keras_dvi.predict_samples`, and configuration; its part of the training
objective is a composed `keras_dvi.layers.kl_term.KLTerm` (`layer.kl_term`). Subclasses
implement `_moments(mean, second, kind)` with the pure functions of `keras_dvi.moments`.
`DenseBase` is the dense family's base; `SampledWeights` gives the Monte Carlo layers their
weight draws by composition.
"""

import inspect
import warnings

import keras
import numpy as np
from keras import ops

from keras_dvi import objective, packing, priors, sampling, validation
from keras_dvi.layers.boundary import KerasDVILayer
from keras_dvi.layers.kl_term import KLTerm, build_unplaced
from keras_dvi.maths import moments

#: Default posterior variance of each kernel weight at initialisation, times fan-in.
DEFAULT_KERNEL_VARIANCE_SCALE = 0.03


def variance_of(log_std):
    """The variances `exp(2 log_std)` of weights stored, as every `BayesianLayer` stores its
    posterior, by their log standard deviations (a variable or tensor); `None` for `None` (a
    layer without bias)."""
    return None if log_std is None else ops.exp(2.0 * ops.convert_to_tensor(log_std))


def log_std_of(variance):
    """The inverse of `variance_of` on a positive number or NumPy array: `0.5 log(variance)`."""
    return 0.5 * np.log(variance)


def _show_base_arguments(cls):
    """Gives `cls.__init__` (if it passes `**kwargs` on to `BayesianLayer`) a signature that also
    lists `BayesianLayer`'s arguments with their defaults, keyword-only: what `help()`, IDEs and
    the API reference show. Calls are unchanged (the arguments still travel in `**kwargs`)."""
    init = cls.__dict__.get("__init__")
    if init is None:
        return
    signature = inspect.signature(init)
    own = list(signature.parameters.values())
    if not own or own[-1].kind != inspect.Parameter.VAR_KEYWORD:
        return
    names = {p.name for p in own}
    base = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY)
            for p in inspect.signature(BayesianLayer.__init__).parameters.values()
            if p.name not in names and p.kind == inspect.Parameter.POSITIONAL_OR_KEYWORD]
    init.__signature__ = signature.replace(parameters=own[:-1] + base + own[-1:])


class BayesianLayer(KerasDVILayer):
    """Base class: a factorised Gaussian posterior over a kernel and a bias.

    Args:
        activation: `None`/`"linear"`, `"relu"`, `"heaviside"`, `"leaky_relu"` (negative
            slope 0.2), or `"relu6"`, `"hard_silu"`, `"hard_sigmoid"`, `"silu"` (`"swish"`), `"gelu"`, `"sigmoid"`, `"tanh"` (these seven not
            in `DenseDVI` / `SkipDVI`, which propagate a full covariance).
        use_bias: whether the layer has a (Bayesian) bias.
        kernel_mean_initializer: Keras initializer of the kernel posterior means.
        bias_mean_initializer: Keras initializer of the bias posterior means.
        kernel_variance_init: initial posterior variance of every kernel weight; `None` means
            `0.03 / fan_in`.
        bias_variance_init: initial posterior variance of every bias; `None` means a tenth of
            the kernel's.
        regularizer: a prior from `keras_dvi.priors` (`EmpiricalBayesRegularizer`,
            `GaussianPriorRegularizer`) or `None`. The layer adds `kl_weight * KL / N` for its
            kernel and, separately, its bias to the model's losses at every call.
        validate: input values (NaN/inf, negative variances, asymmetric covariances) are
            always checked in eager calls; `True` also checks them inside compiled
            functions (`fit`, `predict`) with TensorFlow assertions (a pass over the inputs
            per step).
        **kwargs: base `keras.layers.Layer` arguments (`name`, `dtype`, `trainable`).
    """

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        _show_base_arguments(cls)

    def __init__(
        self,
        activation=None,
        use_bias=True,
        kernel_mean_initializer="he_normal",
        bias_mean_initializer="zeros",
        kernel_variance_init=None,
        bias_variance_init=None,
        regularizer=None,
        validate=False,
        **kwargs,
    ):
        # Moments are computed in float32 (or float64) even under mixed precision, so the
        # packed inputs must not be cast down to float16 on the way in.
        kwargs.setdefault("autocast", False)
        super().__init__(**kwargs)
        self.validate = bool(validate)
        self.regularizer = priors.get(regularizer)
        self.kl_term = KLTerm(self)
        self.activation = moments.canonical_activation(activation)
        self.use_bias = bool(use_bias)
        self.kernel_mean_initializer = keras.initializers.get(kernel_mean_initializer)
        self.bias_mean_initializer = keras.initializers.get(bias_mean_initializer)
        for arg, value in (
            ("kernel_variance_init", kernel_variance_init),
            ("bias_variance_init", bias_variance_init),
        ):
            if value is not None and not (isinstance(value, (int, float)) and value > 0):
                raise ValueError(
                    f"Argument `{arg}` must be a positive number or None; received {value!r}."
                )
        self.kernel_variance_init = kernel_variance_init
        self.bias_variance_init = bias_variance_init

    # ---------------------------------------------------------------- variables

    def _initial_variances(self, fan_in):
        kernel = self.kernel_variance_init
        if kernel is None:
            kernel = DEFAULT_KERNEL_VARIANCE_SCALE / max(fan_in, 1)
        bias = self.bias_variance_init
        if bias is None:
            bias = kernel / 10.0
        return float(kernel), float(bias)

    def _build_posterior(self, fan_in, units, is_head, kernel_shape=None):
        """Creates the posterior variables and the objective's state (`kl_step`; the network's
        tracker when `is_head`, i.e. the input is deterministic data). The kernel has shape
        `kernel_shape` (default `(fan_in, units)`; a conv kernel `(*kernel_size, in, units)`)."""
        kernel_var, bias_var = self._initial_variances(fan_in)
        kernel_shape = (fan_in, units) if kernel_shape is None else tuple(kernel_shape)
        self._kernel_mean, self._kernel_log_std = self._gaussian_weights(
            "kernel", kernel_shape, self.kernel_mean_initializer, kernel_var)
        self._bias_mean, self._bias_log_std = (
            self._gaussian_weights("bias", (units,), self.bias_mean_initializer, bias_var) if self.use_bias
            else (None, None))
        self._fan_in = fan_in
        self.kl_term.build(is_head)

    def _gaussian_weights(self, name, shape, mean_initializer, variance):
        """The variables `{name}_mean` and `{name}_log_std` of one factorised Gaussian weight set
        of `shape`, its variances initialised to `variance` (read in float32 under mixed
        precision: `moment_dtype`)."""
        mean = self.add_weight(name=f"{name}_mean", shape=shape, initializer=mean_initializer, autocast=False)
        log_std = self.add_weight(name=f"{name}_log_std", shape=shape, autocast=False,
                                  initializer=keras.initializers.Constant(float(log_std_of(variance))))
        return mean, log_std

    def weight_sets(self):
        """The layer's factorised Gaussian weight sets under its prior, each
        `(mean, log_std, fan_in)` (the variables and the fan-in its prior variance is scaled
        by): the kernel, then the bias. `kl_divergence` sums over them and `kl_weight="auto"`
        counts their means; a layer with several sets (attention) lists them all."""
        sets = [(self._kernel_mean, self._kernel_log_std, self._fan_in)]
        if self._bias_mean is not None:
            sets.append((self._bias_mean, self._bias_log_std, self._fan_in))
        return sets

    @property
    def kernel_mean(self):
        """Posterior means of the kernel, `(in, units)` (conv layers: `(*kernel_size, in, filters)`)."""
        return ops.convert_to_tensor(self._kernel_mean)

    @property
    def kernel_variance(self):
        """Posterior variances of the kernel, shaped as `kernel_mean`, always >= 0."""
        return variance_of(self._kernel_log_std)

    @property
    def bias_mean(self):
        """Posterior means of the bias, `(units,)`, or `None` without a bias."""
        return None if self._bias_mean is None else ops.convert_to_tensor(self._bias_mean)

    @property
    def bias_variance(self):
        """Posterior variances of the bias, `(units,)`, or `None` without a bias."""
        return variance_of(self._bias_log_std)

    def _posterior(self):
        """Posterior moments cast to the moment dtype."""
        dtype = self.moment_dtype
        cast = lambda t: None if t is None else ops.cast(t, dtype)  # noqa: E731
        return (
            cast(self.kernel_mean),
            cast(self.kernel_variance),
            cast(self.bias_mean),
            cast(self.bias_variance),
        )

    def set_posterior(self, kernel_mean, kernel_variance, bias_mean=None, bias_variance=None):
        """Sets the posterior moments (the layer must be built).

        Args:
            kernel_mean: array of the kernel's shape (`(in, units)`; conv layers
                `(*kernel_size, in, filters)`).
            kernel_variance: positive array broadcastable to the kernel's shape.
            bias_mean: array broadcastable to `(units,)`, or `None` to leave it unchanged.
            bias_variance: positive array broadcastable to `(units,)`, or `None` to leave it.
        """
        if not self.built:
            raise ValueError(
                f"Layer {self.name!r} must be built (called on data, or `build(input_shape)`) "
                "before `set_posterior`."
            )
        pairs = [
            ("kernel_mean", kernel_mean, self._kernel_mean, False),
            ("kernel_variance", kernel_variance, self._kernel_log_std, True),
            ("bias_mean", bias_mean, self._bias_mean, False),
            ("bias_variance", bias_variance, self._bias_log_std, True),
        ]
        for arg, value, variable, is_variance in pairs:
            self._assign(arg, value, variable, is_variance)

    def _assign(self, arg, value, variable, is_variance):
        """Sets `variable` (a mean, or a log standard deviation if `is_variance`) from argument
        `arg`'s `value` (broadcast, checked); nothing if `value` is `None`."""
        if value is None:
            return
        if variable is None:
            raise ValueError(f"Argument `{arg}` given, but layer {self.name!r} has no bias.")
        # (in NumPy's float64: JAX without x64 would truncate a float64 tensor, with a warning)
        value = np.asarray(ops.convert_to_numpy(value), dtype="float64")
        try:
            value = np.broadcast_to(value, tuple(variable.shape))
        except ValueError as error:
            raise ValueError(
                f"Argument `{arg}` must broadcast to shape {tuple(variable.shape)}; "
                f"received shape {value.shape}."
            ) from error
        if is_variance:
            if not (value > 0).all() or not (value < float("inf")).all():
                raise ValueError(f"Argument `{arg}` must be positive and finite.")
            value = log_std_of(value)
        variable.assign(ops.cast(value, variable.dtype))

    # ---------------------------------------------------------------- calling

    def _check_features(self, features, name="inputs"):
        if features is not None and self.built and features != self._fan_in:
            raise ValueError(
                f"Layer {self.name!r} expects inputs with {self._fan_in} features; argument "
                f"`{name}` has {features}."
            )

    def kl_divergence(self):
        """`KL(q || p)` of this layer's weights (kernel and bias sets) in nats, or 0 without a
        regularizer. Its share of `-ELBO / N` (and of the logged `kl`) is this divided by the
        prior's `num_train`."""
        kl = ops.zeros((), dtype=self.variable_dtype)
        if self.regularizer is None:
            return kl
        for mean, log_std, fan_in in self.weight_sets():
            kl = kl + self.regularizer.kl(ops.convert_to_tensor(mean), variance_of(log_std), fan_in)
        return kl

    def _report_kl(self, training=False, data=None):
        """Adds the KL; `data`: the layer's inputs if they are data (2-D), else `None`."""
        self.kl_term.start(training, data)
        if training and self.regularizer is None and not self.kl_term.warned_no_prior:
            self.kl_term.warned_no_prior = True
            warnings.warn(
                f"{type(self).__name__} {self.name!r} is trained without a prior "
                "(`regularizer=None`): no KL term pulls its posterior, so its variances shrink "
                "towards 0 and it is fitted by maximum likelihood, and the logged `kl` "
                "leaves it out. Pass one prior to every keras-dvi layer of the network, e.g. "
                "`regularizer=keras_dvi.EmpiricalBayesRegularizer(num_train=len(x_train))`.",
                UserWarning,
                stacklevel=2,
            )
        kl = None if self.regularizer is None else self.kl_divergence() / float(self.regularizer.num_train)
        self.kl_term.add(kl, training)

    def call(self, inputs, training=None):
        context = sampling.current_context(self)
        if context is not None:
            return self._sample(inputs, context)
        return self._propagate(inputs, objective.resolve_training(training))

    def _propagate(self, inputs, training):
        """The moment-propagating forward pass of the dense forms (conv layers override it)."""
        mean, second, kind = packing.split(inputs)
        mean = ops.cast(mean, self.moment_dtype)
        second = None if second is None else ops.cast(second, self.moment_dtype)
        self._check_features(int(mean.shape[-1]) if mean.shape[-1] is not None else None)
        mean, second = validation.check_moments(
            mean, second, kind, "inputs", self.validate, where=f"{type(self).__name__} {self.name!r}"
        )
        self._report_kl(training, mean if kind == packing.DETERMINISTIC else None)
        mean, second = self._moments(mean, second, kind)
        return packing.pack(mean, second)

    def _moments(self, mean, second, kind):
        raise NotImplementedError

    def _reads_data(self, input_shape):
        """Whether inputs of `input_shape` are data (dense forms; conv layers override it)."""
        try:
            return packing.structure_of_shape(input_shape)[0] == packing.DETERMINISTIC
        except ValueError:
            return None

    # ---------------------------------------------------------------- Monte Carlo

    def _sample_inputs(self, inputs, context):
        if isinstance(inputs, (list, tuple)) or len(inputs.shape) not in (2, 3):
            raise ValueError(
                "While sampling, keras-dvi layers take deterministic (batch, features) inputs "
                "or (samples, batch, features) samples from another keras-dvi layer."
            )
        if len(inputs.shape) == 2:
            inputs = ops.broadcast_to(
                inputs[None], (context.num_samples,) + tuple(ops.shape(inputs))
            )
        self._check_features(int(inputs.shape[-1]))
        return inputs

    def _sample_affine(self, h, context):
        """`h W + b` with `W`, `b` drawn from the posterior, one draw per sample."""
        kernel_mean, kernel_var, bias_mean, bias_var = self._posterior()
        dtype = self.moment_dtype
        h = ops.cast(h, dtype)
        shape = (context.num_samples,) + tuple(kernel_mean.shape)
        noise = keras.random.normal(shape, dtype=dtype, seed=context.seed_generator)
        kernel = kernel_mean + ops.sqrt(kernel_var) * noise
        out = ops.einsum("sbi,siu->sbu", h, kernel)
        if bias_mean is not None:
            noise = keras.random.normal(
                (context.num_samples, 1, bias_mean.shape[0]), dtype=dtype, seed=context.seed_generator
            )
            out = out + bias_mean + ops.sqrt(bias_var) * noise
        return out

    def _sample(self, inputs, context):
        raise NotImplementedError

    # ---------------------------------------------------------------- config

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "activation": None if self.activation == "linear" else self.activation,
                "use_bias": self.use_bias,
                "kernel_mean_initializer": keras.initializers.serialize(self.kernel_mean_initializer),
                "bias_mean_initializer": keras.initializers.serialize(self.bias_mean_initializer),
                "kernel_variance_init": self.kernel_variance_init,
                "bias_variance_init": self.bias_variance_init,
                "regularizer": None
                if self.regularizer is None
                else keras.saving.serialize_keras_object(self.regularizer),
                "validate": self.validate,
            }
        )
        return config


class DenseBase(BayesianLayer):
    """A `BayesianLayer` with a `(in, units)` kernel: the common part of the dense layers.

    Args:
        units: positive integer, output width.
        activation: as in `BayesianLayer`.
        **kwargs: other arguments of `BayesianLayer`.
    """

    def __init__(self, units, activation=None, **kwargs):
        super().__init__(activation=activation, **kwargs)
        if isinstance(units, bool) or not isinstance(units, int) or units <= 0:
            raise ValueError(
                f"Argument `units` must be a positive integer; received units={units!r}."
            )
        self.units = units

    def build(self, input_shape):
        kind, features = packing.structure_of_shape(input_shape)
        if features is None:
            raise ValueError(
                f"The last dimension of the inputs to {type(self).__name__} must be defined."
            )
        self._build_posterior(features, self.units, is_head=kind == packing.DETERMINISTIC)

    def _affine_moments(self, mean, second, kind, full_output):
        """Moments of `h W + b` for inputs of any structure (`moments.linear_moments`)."""
        kernel_mean, kernel_var, bias_mean, bias_var = self._posterior()
        return moments.linear_moments(
            mean,
            kernel_mean,
            kernel_var,
            bias_mean,
            bias_var,
            variance=second if kind == packing.DIAGONAL else None,
            covariance=second if kind == packing.FULL else None,
            full_output=full_output,
        )

    def _sample(self, inputs, context):
        h = self._sample_inputs(inputs, context)
        return apply_activation(self._sample_affine(h, context), self.activation)

    @classmethod
    def from_dense(cls, dense, kernel_variance=None, bias_variance=None, **kwargs):
        """A layer whose posterior means are the weights of a built `keras.layers.Dense`.

        Args:
            dense: a built `keras.layers.Dense` with a linear, ReLU or leaky ReLU activation.
            kernel_variance: initial posterior variance of the kernel (`None`: the default).
            bias_variance: initial posterior variance of the bias (`None`: the default).
            **kwargs: other constructor arguments of this class (`activation=` overrides the
                dense layer's).

        Returns:
            A built layer of this class.
        """
        if not isinstance(dense, keras.layers.Dense) or not dense.built:
            raise ValueError("Argument `dense` must be a built keras.layers.Dense layer.")
        activation = kwargs.pop("activation", getattr(dense.activation, "__name__", None))
        kwargs.setdefault("use_bias", dense.use_bias)
        layer = cls(
            dense.units,
            activation=None if activation == "linear" else activation,
            kernel_variance_init=kernel_variance,
            bias_variance_init=bias_variance,
            **kwargs,
        )
        build_unplaced(layer, (None, int(dense.kernel.shape[0])))
        layer.set_posterior(
            dense.kernel, layer.kernel_variance, dense.bias if dense.use_bias else None
        )
        return layer

    def get_config(self):
        config = super().get_config()
        config["units"] = self.units
        return config


def apply_activation(x, activation):
    """Deterministic activation (used in sampling mode)."""
    return moments.get_activation(activation).apply(x)


class SampledWeights:
    """The weight draws of a Monte Carlo baseline layer (`DenseMCVI`, `Conv1DMCVI`,
    `Conv2DMCVI`), held by composition as `layer.sampler`: every call draws `layer.num_samples`
    weight sets from the posterior (first layer; later layers follow its sample axis), shared
    by every example of the batch, and the layer returns samples `(batch, samples, ...)`. The
    layer implements `_sampled_forward(h, context)` on sample-major inputs `(samples, batch,
    ...)` and sets `data_rank`, the rank of its data inputs (`(batch, ...)`).

    Args:
        layer: the layer; its `num_samples`, `seed` and `seed_generator` are set here (public
            attributes, as `keras_dvi.predict_samples` and `set_sampling_seed` read them).
        num_samples: weight draws per call (first layer).
        seed: integer seed of the draws (`None`: from Keras' global seed).
    """

    def __init__(self, layer, num_samples=10, seed=None):
        self.layer = layer
        layer.num_samples = validation.positive_integer("num_samples", num_samples)
        layer.seed = seed
        layer.seed_generator = keras.random.SeedGenerator(seed)

    def output_samples(self, input_shape):
        """The sample axis of the layer's output for inputs of `input_shape`."""
        layer = self.layer
        return layer.num_samples if len(input_shape) == layer.data_rank else input_shape[1]

    def call(self, inputs, training=None):
        """The layer's forward pass: data `(batch, ...)` or samples `(batch, samples, ...)` in,
        samples `(batch, samples, ...)` out."""
        layer = self.layer
        training = objective.resolve_training(training)
        inputs = ops.cast(inputs, layer.moment_dtype)
        data = None
        if len(inputs.shape) == layer.data_rank:
            data = inputs = validation.check_finite(inputs, "inputs", layer.validate)
            h = ops.broadcast_to(inputs[None], (layer.num_samples,) + tuple(ops.shape(inputs)))
        else:
            h = ops.moveaxis(inputs, 1, 0)  # (samples, batch, ...)
        layer._report_kl(training, data)
        out = layer._sampled_forward(h, sampling.SamplingContext(h.shape[0], layer.seed_generator))
        return ops.moveaxis(out, 0, 1)

    def config(self):
        return {"num_samples": self.layer.num_samples, "seed": self.layer.seed}
