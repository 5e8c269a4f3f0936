"""`TAGIModel`: trains a keras-dvi network with TAGI's closed-form updates (no optimizer, no
gradients) inside Keras' `fit`; the equations and each layer's linear map are in
`keras_dvi.maths.tagi` (also `keras_dvi.tagi.maths`), which step each layer is in
`keras_dvi.tagi.steps`."""

import math

import keras
import numpy as np
from keras import ops

from keras_dvi import packing, predictive
from keras_dvi.layers.base import variance_of
from keras_dvi.layers.conv_dvi import ConvDVI
from keras_dvi.layers.dense_diag_dvi import DenseDiagDVI
from keras_dvi.layers.pooling_dvi import AveragePoolingDVI, MaxPoolingDVI
from keras_dvi.maths import tagi
from keras_dvi.maths.tagi import ACTIVATIONS, ConvStep
from keras_dvi.network import layers_of
from keras_dvi.tagi.steps import MAP_LAYERS, WEIGHT_LAYERS, step_of

REGRESSION, CLASSIFICATION = "regression", "classification"


def _refuse_weights(weights):
    """A `ValueError` when `fit` / `evaluate` give a TAGI model sample weights (`sample_weight`,
    `class_weight`, or a third element of the data): its update conditions on every
    observation in closed form, with no loss to weigh, and would ignore them."""
    if weights is not None:
        raise ValueError(
            "TAGIModel received sample weights (`sample_weight` or `class_weight` of fit / evaluate, or "
            "(x, y, weights) data): its update conditions on every observation in closed form, with no "
            "loss to weigh, and would ignore them. Remove them; to give a class more weight, repeat its "
            "examples."
        )


def _unweighted_batch(data):
    """`(x, y)` of a batch of `fit` / `evaluate`, its sample weights refused."""
    x, y, weights = keras.utils.unpack_x_y_sample_weight(data)
    _refuse_weights(weights)
    return x, y


@keras.saving.register_keras_serializable(package="keras_dvi")
class TAGIModel(keras.Model):
    """Trains a network of `DenseDiagDVI` (and conv) layers by tractable approximate Gaussian inference.

    TAGI (Goulet, Nguyen and Amiri, JMLR 2021) learns without gradients: every batch is
    propagated through the current posterior (eq. 10), the observed outputs are conditioned on
    the targets (eq. 14), and the deltas go back down layer by layer in closed form (RTS
    smoother, eqs. 15-16), updating each weight's posterior mean and variance once per batch
    (`keras_dvi.tagi`). `fit`, `evaluate`, `predict`, callbacks, `tf.data` and `.keras` files
    work as for any Keras model; `compile()` takes no optimizer or loss.

    The network is wrapped, not changed: the same layers can be trained by DVI (gradients on
    the ELBO) instead. Its leading layers without weights (`Flatten`, `Reshape`, ...) are
    applied to the data as they are; then come `DenseDiagDVI` layers (activation `"relu"`,
    `"leaky_relu"` or `None`), the last one linear. Convolutional networks: `Conv1DDVI` /
    `Conv2DDVI` (strides 1, no dilation, `"valid"` or `"same"`, the activation on the conv
    layer), `AveragePooling1DDVI` / `2DDVI` (non-overlapping windows),
    `GlobalAveragePooling1DDVI` / `2DDVI` and `FlattenDVI`, then the dense layers. Each conv
    output position is a dense unit on its patch with the shared kernel (per-position
    diagonal moments, the authors' conv rule); max pooling is refused (no closed-form update
    here).

    Regression: the last layer has one unit per target and the targets are observed with
    homoscedastic noise of standard deviation `observation_noise` (the paper's `sigma_V`).
    Classification (`classes=K`): the last layer has one unit per node of Appendix C's binary
    tree (`keras_dvi.tagi.tree(K)[0]`: 11 for 10 classes); targets are integer labels.

    Args:
        network: a built Keras model (`Sequential` or functional, a chain of layers) as above.
        observation_noise: `sigma_V` (> 0): the observation noise's standard deviation.
        classes: `None` (regression) or the number of classes (>= 2).
        forward: `"linearized"` (default, the paper: activations linearised at the mean) or
            `"moments"` (keras-dvi's exact Gaussian moments of the activations, with the slope
            `E[f'(z)]` from Stein's lemma).
        initialize: the prior the layers' posteriors start from: bias variances 0.01 and
            means drawn from the prior (`seed`), with weight variances by `True` / `"xavier"`
            (default, the paper's): Xavier's rule `2 / (fan_in + fan_out)`; `"he"`:
            `1 / fan_in` (the authors' MNIST code and cuTAGI); a positive number `c`:
            `c / fan_in` (the authors' UCI code uses 0.25). `False` keeps the layers' current
            posteriors (a `.keras` file loads that way).
        seed: integer seed of the initial means.
        max_step: `"auto"` (default), `None` or a positive number: a weight's mean moves by at
            most `max_step` prior standard deviations per batch (`keras_dvi.maths.tagi.parameter_update`;
            the authors' cuTAGI caps its updates the same way). `"auto"`: no cap for dense
            networks (the paper's updates), 1 for networks with conv layers, whose shared
            kernels sum one term per position and example from one prior and otherwise
            overshoot (the ablation is in BENCHMARKS.md). Pass 1 for small data sets, narrow
            dense networks or a small `observation_noise`, where uncapped updates can collapse
            a network to chance.
        **kwargs: base `keras.Model` arguments (`name`).

    Outputs:
        `model(x)` / `model.predict(x)`: the packed output moments `(batch, 2, units)` of TAGI's
        forward pass (means, variances; without the observation noise).
        `keras_dvi.predict(model, x)` gives the predictive distribution: regression `mean`,
        `std`, `variance`, `epistemic`, `aleatoric` (`observation_noise^2`), `lower`, `upper`;
        classification `probabilities` (eq. 24, `alpha = 1/3`), `label`, `entropy`.

    Logs: `nll`, the mean negative log predictive density of the batch's targets under the
    posterior before the batch's update; for classification also `accuracy` and
    `observation_nll`, the negative log marginal likelihood of the tree observations (the
    Gaussian density of the `+-1` targets on each label's path, with the output variances
    plus `observation_noise^2`; for regression `nll` is that already). The paper stops
    training where the validation set's marginal likelihood is highest (section 3.4):
    `keras.callbacks.EarlyStopping(monitor="val_observation_nll", mode="min",
    restore_best_weights=True)`.

    Examples:
        >>> network = keras.Sequential([
        ...     keras.Input((13,)),
        ...     keras_dvi.DenseDiagDVI(50, activation="relu"),
        ...     keras_dvi.DenseDiagDVI(1),
        ... ])
        >>> model = keras_dvi.TAGIModel(network, observation_noise=0.3)
        >>> model.compile()
        >>> model.fit(x_train, y_train, batch_size=10, epochs=40)
    """

    def __init__(self, network, observation_noise=1.0, classes=None, forward="linearized", initialize=True,
                 seed=None, max_step="auto", **kwargs):
        super().__init__(**kwargs)
        if isinstance(network, dict):
            network = keras.saving.deserialize_keras_object(network)
        if not isinstance(network, keras.Model):
            raise ValueError(
                f"Argument `network` must be a built Keras model (Sequential or functional) of "
                f"keras_dvi.DenseDiagDVI layers; received {type(network).__name__}."
            )
        self.network = network
        noise = float(observation_noise)
        if not (noise > 0.0 and math.isfinite(noise)):
            raise ValueError(f"Argument `observation_noise` must be positive and finite; received {observation_noise!r}.")
        self.observation_noise = noise
        self.forward = tagi.canonical_forward(forward)
        self.classes = classes
        self.task = REGRESSION if classes is None else CLASSIFICATION
        self._preprocessing, body = _split_chain(network)
        self._steps = [step_of(layer) for layer in body]
        self._tagi_layers = [layer for layer in body if isinstance(layer, WEIGHT_LAYERS)]
        units = self._tagi_layers[-1].units
        if self.task == CLASSIFICATION:
            tree_units, paths = tagi.tree(classes)
            if units != tree_units:
                raise ValueError(
                    f"With classes={classes}, the last DenseDiagDVI layer must have {tree_units} units "
                    f"(one per node of the classification tree, keras_dvi.tagi.tree({classes})); it has {units}."
                )
            self._paths = paths
        if not (max_step is None or max_step == "auto" or _is_positive_number(max_step)):
            raise ValueError(f"Argument `max_step` must be 'auto', None or positive and finite; received {max_step!r}.")
        self.max_step = max_step
        has_conv = any(isinstance(step, ConvStep) for step in self._steps)
        self._max_step = (1.0 if has_conv else None) if max_step == "auto" else max_step
        self.seed = seed
        scale = _weight_variance_scale(initialize)
        if scale is not None:
            self._initialize(seed, scale)
        self.nll_tracker = keras.metrics.Mean(name="nll")
        classification = self.task == CLASSIFICATION
        self.accuracy_tracker = keras.metrics.Mean(name="accuracy") if classification else None
        self.observation_nll_tracker = keras.metrics.Mean(name="observation_nll") if classification else None

    # ---------------------------------------------------------------- set-up

    def _initialize(self, seed, scale):
        """The paper's prior; `scale`: `"xavier"` or `c` for weight variances `c / fan_in`."""
        rng = np.random.default_rng(seed)
        for layer in self._tagi_layers:
            shape = tuple(int(n) for n in layer.kernel_mean.shape)  # conv: (*kernel_size, in, filters)
            taps = math.prod(shape[:-2])  # fans as Keras counts them
            if scale == "xavier":
                var_w = 2.0 / (taps * (shape[-2] + shape[-1]))
            else:
                var_w = scale / (taps * shape[-2])
            mean_w = rng.normal(0.0, math.sqrt(var_w), shape)
            bias = {}
            if layer.use_bias:
                bias = {"bias_mean": rng.normal(0.0, 0.1, (shape[-1],)), "bias_variance": 0.01}
            layer.set_posterior(mean_w, var_w, **bias)

    @property
    def metrics(self):
        return [m for m in (self.nll_tracker, self.accuracy_tracker, self.observation_nll_tracker) if m is not None]

    def compile(self, optimizer=None, **kwargs):
        """Like `keras.Model.compile`, without an optimizer or a loss (TAGI uses neither; a
        zero-rate SGD holds Keras' step counter). `metrics`, `loss` and `optimizer` are
        refused."""
        for name in ("loss", "metrics"):
            if kwargs.get(name) is not None:
                raise ValueError(f"TAGIModel.compile takes no `{name}`: TAGI's updates are closed form; "
                                 "its logs are `nll` (and `accuracy` for classification).")
        if optimizer is not None:
            raise ValueError("TAGIModel.compile takes no `optimizer`: TAGI updates the posteriors in closed form.")
        super().compile(optimizer=keras.optimizers.SGD(learning_rate=0.0), **kwargs)

    def fit(self, x=None, y=None, *args, **kwargs):
        """`keras.Model.fit`; sample weights (`sample_weight`, `class_weight`) are refused."""
        for name in ("sample_weight", "class_weight"):
            _refuse_weights(kwargs.get(name))
        return super().fit(x, y, *args, **kwargs)

    def evaluate(self, x=None, y=None, *args, **kwargs):
        """`keras.Model.evaluate`; `sample_weight` is refused."""
        _refuse_weights(kwargs.get("sample_weight"))
        return super().evaluate(x, y, *args, **kwargs)

    def get_compile_config(self):
        return {"jit_compile": self.jit_compile} if getattr(self, "compiled", False) else None

    def compile_from_config(self, config):
        self.compile(**(config or {}))

    def _variable_indices(self):
        """Per TAGI layer, the positions of its variables in `self.trainable_variables` (the
        order of the JAX training state)."""
        variables = self.trainable_variables

        def index(variable):
            if variable is None:
                return None
            return next(i for i, v in enumerate(variables) if v is variable)

        return [tuple(index(v) for v in (layer._kernel_mean, layer._kernel_log_std, layer._bias_mean,
                                          layer._bias_log_std)) for layer in self._tagi_layers]

    # ---------------------------------------------------------------- the maths on values

    def _params(self, values, indices):
        dtype = self._tagi_layers[0].moment_dtype
        params = []
        for idx in indices:
            get = lambda i: None if i is None else ops.cast(values[i], dtype)  # noqa: E731
            km, kls, bm, bls = (get(i) for i in idx)
            params.append((km, variance_of(kls), bm, variance_of(bls)))
        return params

    def _inputs(self, x):
        for layer in self._preprocessing:
            x = layer(x)
        return ops.cast(x, self._tagi_layers[0].moment_dtype)

    def _forward(self, params, x):
        return tagi.forward(self._inputs(x), params, self._steps, self.forward)

    def _observations(self, y, mz):
        """`(targets, observed)` as the output units see them: regression targets shaped like
        `mz` (every unit observed: `None`); classification `+-1` on each label's tree path and
        the 0/1 mask of the path's nodes."""
        if self.task == CLASSIFICATION:
            targets, observed = tagi.tree_targets(ops.reshape(y, (-1,)), self._paths)
            return ops.cast(targets, mz.dtype), ops.cast(observed, mz.dtype)
        return ops.reshape(ops.cast(y, mz.dtype), ops.shape(mz)), None

    def _scores(self, mz, sz, y, observations=None):
        """Per-example scores of the targets, in the order of `self.metrics`: the negative log
        predictive density; for classification also the correctness and the negative log
        marginal likelihood of the tree observations (`None` where not logged).
        `observations`: `self._observations(y, mz)` where already computed."""
        targets, observed = self._observations(y, mz) if observations is None else observations
        density = predictive.gaussian_log_density(targets, mz, sz + self.observation_noise**2)
        if self.task == CLASSIFICATION:
            probs = tagi.class_probabilities(mz, sz, self._paths)
            labels = ops.cast(ops.reshape(y, (-1,)), "int32")
            true = ops.take_along_axis(probs, labels[:, None], axis=1)[:, 0]
            nll = -ops.log(ops.maximum(true, 1e-30))
            correct = ops.cast(ops.argmax(probs, axis=-1) == labels, mz.dtype)
            return nll, correct, -ops.sum(observed * density, axis=-1)
        return -ops.sum(density, axis=-1), None, None

    def _step(self, values, x, y):
        """TAGI's update of one batch on the values of `self.trainable_variables`: returns the
        new values and the batch's scores under the prior."""
        indices = self._variable_indices()
        params = self._params(values, indices)
        caches, (mz, sz, slope) = self._forward(params, x)
        observations = self._observations(y, mz)
        scores = self._scores(mz, sz, y, observations)
        dm, ds = tagi.observation_deltas(mz, sz, observations[0], self.observation_noise**2, observations[1])
        new_params = tagi.update(params, caches, self._steps, dm, ds, max_step=self._max_step)
        new_values = list(values)
        for idx, (km, kv, bm, bv) in zip(indices, new_params):
            for i, value in zip(idx, (km, 0.5 * ops.log(kv), bm, None if bv is None else 0.5 * ops.log(bv))):
                if i is not None:
                    new_values[i] = ops.cast(value, values[i].dtype)
        return new_values, scores

    # ---------------------------------------------------------------- Keras hooks

    def call(self, inputs, training=None):
        params = [(layer.kernel_mean, layer.kernel_variance, layer.bias_mean, layer.bias_variance)
                  for layer in self._tagi_layers]
        dtype = self._tagi_layers[0].moment_dtype
        params = [tuple(None if t is None else ops.cast(t, dtype) for t in p) for p in params]
        _, (mz, sz, _) = self._forward(params, inputs)
        return packing.pack(mz, sz)

    def train_step(self, *args):
        if len(args) == 2:  # JAX: a stateless step on (state, data)
            state, data = args
            trainable, non_trainable, optimizer_vars, metric_vars = state
            x, y = _unweighted_batch(data)
            new_trainable, scores = self._step(list(trainable), x, y)
            logs, metric_vars = self._stateless_metrics(metric_vars, scores)
            return logs, (new_trainable, non_trainable, optimizer_vars, metric_vars)
        x, y = _unweighted_batch(args[0])
        variables = self.trainable_variables
        new_values, scores = self._step([v.value for v in variables], x, y)
        for variable, old, new in zip(variables, [v.value for v in variables], new_values):
            if new is not old:
                variable.assign(new)
        return self._update_metrics(scores)

    def test_step(self, *args):
        if len(args) == 2:
            state, data = args
            trainable, non_trainable, metric_vars = state
            x, y = _unweighted_batch(data)
            params = self._params(list(trainable), self._variable_indices())
            _, (mz, sz, _) = self._forward(params, x)
            logs, metric_vars = self._stateless_metrics(metric_vars, self._scores(mz, sz, y))
            return logs, (trainable, non_trainable, metric_vars)
        x, y = _unweighted_batch(args[0])
        mz, sz = packing.split(self(x))[:2]
        return self._update_metrics(self._scores(mz, sz, y))

    def _update_metrics(self, scores):
        for metric, value in zip(self.metrics, [v for v in scores if v is not None]):
            metric.update_state(value)
        return {m.name: m.result() for m in self.metrics}

    def _stateless_metrics(self, metric_vars, scores):
        values = [v for v in scores if v is not None]
        logs, new_vars, start = {}, [], 0
        for metric, value in zip(self.metrics, values):
            count = len(metric.variables)
            current = metric.stateless_update_state(metric_vars[start:start + count], value)
            logs[metric.name] = metric.stateless_result(current)
            new_vars.extend(current)
            start += count
        return logs, new_vars

    # ---------------------------------------------------------------- predictions

    def predictive_distribution(self, outputs, level=0.95):
        """The predictive distribution of packed outputs `model.predict(x)`, as NumPy arrays
        (see the class docstring). `keras_dvi.predict` calls it: a model that defines
        `predictive_distribution(outputs, level)` states its own predictive distribution."""
        mz, sz = (np.asarray(ops.convert_to_numpy(t), dtype="float64") for t in packing.split(ops.convert_to_tensor(outputs))[:2])
        if self.task == CLASSIFICATION:
            probs = np.asarray(ops.convert_to_numpy(tagi.class_probabilities(ops.convert_to_tensor(mz),
                                                                              ops.convert_to_tensor(sz), self._paths)))
            entropy = -np.sum(probs * np.log(np.maximum(probs, 1e-300)), axis=-1)
            return {"probabilities": probs, "label": probs.argmax(-1), "entropy": entropy}
        aleatoric = np.full_like(sz, self.observation_noise**2)
        variance = sz + aleatoric
        std = np.sqrt(variance)
        half = predictive.central_quantile(level) * std
        return {"mean": mz, "variance": variance, "std": std, "epistemic": sz, "aleatoric": aleatoric,
                "lower": mz - half, "upper": mz + half}

    def get_config(self):
        return {"name": self.name, "network": keras.saving.serialize_keras_object(self.network),
                "observation_noise": self.observation_noise, "classes": self.classes, "forward": self.forward,
                "initialize": False, "seed": self.seed, "max_step": self.max_step}

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        config["network"] = keras.saving.deserialize_keras_object(config["network"], custom_objects=custom_objects)
        return cls(**config)


def _is_positive_number(value):
    """A positive, finite number (a bool is not one)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0.0 < float(value) < math.inf


def _weight_variance_scale(initialize):
    """`None` (keep the posteriors), `"xavier"`, or `c` of weight variances `c / fan_in`."""
    if initialize is False:
        return None
    if initialize is True or initialize == "xavier":
        return "xavier"
    if initialize == "he":
        return 1.0
    if _is_positive_number(initialize):
        return float(initialize)
    raise ValueError(
        f"Argument `initialize` must be True or 'xavier' (the paper's prior), 'he' (weight variances "
        f"1 / fan_in), a positive number c (c / fan_in) or False (keep the posteriors); received {initialize!r}."
    )


def _split_chain(network):
    """`(preprocessing layers, TAGI layers)` of a chain network, or a clear error."""
    if not network.built or not network.layers:
        raise ValueError("Argument `network` must be built: start it with keras.Input(shape) (or call it once).")
    layers = [layer for layer in network.layers if not isinstance(layer, keras.layers.InputLayer)]
    first = next((i for i, layer in enumerate(layers) if isinstance(layer, WEIGHT_LAYERS)), None)
    if first is None:
        raise ValueError("TAGIModel trains keras_dvi.DenseDiagDVI, Conv1DDVI and Conv2DDVI layers; the network has none.")
    preprocessing, body = layers[:first], layers[first:]
    for layer in preprocessing:
        if layer.weights or any(True for _ in layers_of(layer)):
            raise ValueError(
                f"TAGIModel: layer {layer.name!r} ({type(layer).__name__}) comes before the first DenseDiagDVI or "
                "ConvDVI layer and has weights; only layers without weights (Flatten, Reshape, Rescaling, ...) may "
                "come first (TAGI learns the keras-dvi layers only)."
            )
    for layer in body:
        if not isinstance(layer, WEIGHT_LAYERS + MAP_LAYERS):
            hint = (" Max pooling has no closed-form TAGI update here: use AveragePooling1DDVI / AveragePooling2DDVI "
                    "(with the activation on the conv layer)." if isinstance(layer, MaxPoolingDVI) else "")
            raise ValueError(
                f"TAGIModel: after the first keras-dvi layer with weights every layer must be one TAGI can update: "
                f"DenseDiagDVI, Conv1DDVI / Conv2DDVI, AveragePooling1DDVI / 2DDVI, GlobalAveragePooling1DDVI / "
                f"2DDVI or FlattenDVI; found {type(layer).__name__} {layer.name!r}.{hint}"
            )
        if isinstance(layer, WEIGHT_LAYERS) and layer.activation not in ACTIVATIONS:
            raise ValueError(
                f"TAGIModel: layer {layer.name!r} has activation={layer.activation!r}; TAGI supports "
                f"{', '.join(ACTIVATIONS)} (Heaviside has no slope to pass its deltas down)."
            )
        if getattr(layer, "data_format", "channels_last") != "channels_last":
            raise ValueError(
                f"TAGIModel: layer {layer.name!r} has data_format={layer.data_format!r}; TAGI's conv and "
                "pooling steps are channels last: build the network with data_format='channels_last' "
                "(or keras.config.set_image_data_format('channels_last'))."
            )
        if isinstance(layer, ConvDVI) and (set(layer.strides) != {1} or set(layer.dilation_rate) != {1}):
            raise ValueError(
                f"TAGIModel: conv layer {layer.name!r} has strides={layer.strides}, dilation_rate="
                f"{layer.dilation_rate}; TAGI's conv update supports strides 1 and dilation 1 (downsample "
                "with AveragePooling2DDVI)."
            )
        if isinstance(layer, AveragePoolingDVI) and (tuple(layer.strides) != tuple(layer.pool_size)
                                                     or layer.padding != "valid"):
            raise ValueError(
                f"TAGIModel: pooling layer {layer.name!r} must have strides equal to pool_size and padding "
                f"'valid' (non-overlapping windows); it has pool_size={layer.pool_size}, strides={layer.strides}, "
                f"padding={layer.padding!r}."
            )
    if not isinstance(body[-1], DenseDiagDVI) or body[-1].activation != "linear":
        raise ValueError(f"TAGIModel: the last layer ({body[-1].name!r}) must be a linear DenseDiagDVI "
                         "(activation=None): its outputs are observed with Gaussian noise.")
    return preprocessing, body
