"""`KerasDVILayer`: the base of every keras-dvi layer, which guards the model boundary.

keras-dvi layers pass each other packed moments `(batch, 2 or K + 1, K)` (feature maps:
`(batch, 3, *spatial, channels)`) or weight samples `(batch, samples, K)`: tensors that only
keras-dvi layers and keras-dvi losses can read. A plain Keras layer placed between them or
after the last one (`Dropout`, `BatchNormalization`, `Dense`, `Activation`, ...) would treat
the mean and (co)variance rows as numbers and silently break the model.

When a functional or `Sequential` model is built, Keras asks each layer for its output's
spec; a keras-dvi layer then stamps its symbolic output with itself (`producer_of` reads the
stamp; no private Keras attribute is read). Two checks read the stamps:

* `check_structure(model)`: a plain layer of the model whose input is a keras-dvi layer's
  packed moments is refused with a `ValueError` naming both layers. It runs when the model is
  called (eagerly, in `predict`, in a step of `fit` / `evaluate`; once per model) and in
  `keras_dvi.predict`, before Keras wraps the call of the layer that runs it, so the message
  leads. Plain layers before the first keras-dvi layer (whose output is data) are welcome, and
  so are plain layers acting on weight samples (`keras.layers.TimeDistributed(...)` after
  `Conv2DMCVI`).
* at build time, a keras-dvi layer warns when a packed symbolic input
  (`KerasDVILayer.takes_packed`) reaches it that no keras-dvi layer produced (a subclassed
  or nested model's own plumbing): a warning, because the output of a nested keras-dvi model
  (a `Model` used as a layer), which Keras rebuilds without the stamp, looks the same.

Plain layers that mix rows (`Dense`, `BatchNormalization`) in models without stamps
(subclassed ones) are refused at run time by the negative variances they produce
(`keras_dvi.validation.check_moments`).
"""

import functools
import types
import warnings

import keras

from keras_dvi import network, objective
from keras_dvi.layers.kl_term import reads_data_changed

#: The attribute of a symbolic tensor naming the keras-dvi layer that produced it.
PRODUCER = "keras_dvi_producer"


def producer_of(tensor):
    """The keras-dvi layer that produced the symbolic tensor `tensor`, or `None`."""
    return getattr(tensor, PRODUCER, None)


#: The attribute of a symbolic tensor counting the inducing rows that `InducingInputs` put
#: before its batch (so that the first layer checks `num_train` against the data rows only).
INDUCING_ROWS = "keras_dvi_inducing_rows"


def inducing_rows_of(tensor):
    """The number of inducing rows before the batch of the symbolic tensor `tensor` (0 if none)."""
    return getattr(tensor, INDUCING_ROWS, 0)


class KerasDVILayer(keras.layers.Layer):
    """A Keras layer that reads and writes keras-dvi tensors (see the module docstring).

    `outputs_moments`: whether its outputs are packed moments (`False` for layers whose outputs
    are weight samples, on which plain layers may act per sample). `kl_term`: the layer's
    `keras_dvi.layers.kl_term.KLTerm` if it has weights under a prior (set by the layer), else
    `None`; the first keras-dvi layer of a network lists the network's `ELBOTracker` in its
    `metrics`."""

    outputs_moments = True
    kl_term = None

    @property
    def elbo_tracker(self):
        """The network's `ELBOTracker` if this is its first keras-dvi layer, else `None`."""
        return None if self.kl_term is None else self.kl_term.tracker

    @property
    def metrics(self):
        tracker = self.elbo_tracker
        return super().metrics + ([tracker] if tracker is not None else [])

    def _reads_data(self, input_shape):
        """Whether inputs of `input_shape` are data (this is then the network's first keras-dvi
        layer), or `None` if the layer cannot tell."""
        return None

    def load_own_variables(self, store):
        if self.kl_term is None or not self.kl_term.load(store):
            super().load_own_variables(store)

    def takes_packed(self, shape):
        """Whether an input of `shape` is a keras-dvi tensor (packed moments or weight samples)
        rather than data: 3-D for the dense layers; conv and pooling layers say for their
        feature maps; `False` for layers whose inputs are weight samples (`DenseMCVI`,
        `Conv*MCVI`: samples are ordinary numbers, and plain layers may act on them per
        sample, e.g. `keras.layers.TimeDistributed(keras.layers.MaxPooling2D())`)."""
        return len(shape) == 3

    def __call__(self, *args, **kwargs):
        inputs = args[0] if args else kwargs.get("inputs")
        if not any(keras.utils.is_keras_tensor(t) for t in keras.tree.flatten(inputs)):  # not a symbolic build
            if not getattr(self, "_in_symbolic_graph", False):  # (its stamps are checked at build)
                objective.check_inputs(self, inputs)
            if getattr(self, "elbo_tracker", None) is not None or not self.built:  # the network's first layer
                check_running_models(self)  # (here, not in `call`: Keras would name this layer's call)
        outputs = super().__call__(*args, **kwargs)
        objective.record_outputs(outputs)
        return outputs

    def compute_output_spec(self, *args, **kwargs):
        inputs = args[0] if args else kwargs.get("inputs")
        reads_data_changed(self, inputs)
        self._in_symbolic_graph = True
        tensors = [t for t in keras.tree.flatten(inputs) if keras.utils.is_keras_tensor(t)]
        self.inducing_rows = max([inducing_rows_of(t) for t in tensors] + [0])
        packed = bool(tensors) and all(self.takes_packed(t.shape) for t in tensors)  # not a (mean, covariance) pair
        unstamped = [t for t in tensors if producer_of(t) is None] if packed else []
        if unstamped:
            inputs = unstamped[0]
            warnings.warn(
                f"Layer {type(self).__name__} {self.name!r} receives a {len(inputs.shape)}-D input of shape "
                f"{tuple(inputs.shape)} that no keras-dvi layer produced. Between keras-dvi "
                "layers the tensors hold packed means and (co)variances (or weight samples), "
                "which plain Keras layers (Dropout, BatchNormalization, Dense, Activation, "
                "Reshape, ...) treat as numbers, silently breaking the model. Remove the plain "
                "layer: keras-dvi layers take each other's outputs directly, apply their own "
                "activation (`activation=`) and model weight noise themselves (no Dropout "
                "needed); plain layers are welcome before the first keras-dvi layer. (If the "
                "input is the output of a nested keras-dvi model, this warning does not apply.)",
                UserWarning,
                stacklevel=2,
            )
        outputs = super().compute_output_spec(*args, **kwargs)
        for output in keras.tree.flatten(outputs):
            setattr(output, PRODUCER, self)
        return outputs


# ------------------------------------------------------------- plain layers reading moments


def plain_readers(model):
    """`[(plain layer, keras-dvi layer)]`: the plain Keras layers of `model` (a functional or
    `Sequential` model; nested models included) whose input is the packed moments of a
    keras-dvi layer, each with that layer. Read from the stamps of the symbolic graph (a
    subclassed model has none: `[]`)."""
    found = []
    for layer in network.layers_of(model):
        if isinstance(layer, (KerasDVILayer, keras.Model, keras.layers.Identity)):  # (an identity changes nothing)
            continue
        try:
            inputs = layer.input
        except (AttributeError, ValueError):  # never called on a symbolic tensor
            continue
        producers = [producer_of(t) for t in keras.tree.flatten(inputs)]
        producers = [p for p in producers if p is not None and p.outputs_moments]
        if producers:
            found.append((layer, producers[0]))
    return found


def check_structure(model):
    """Refuses a plain Keras layer that reads keras-dvi moments in `model` (`plain_readers`),
    with a `ValueError` naming it, the layer it reads and the fix."""
    readers = plain_readers(model)
    if not readers:
        return
    plain, producer = readers[0]
    raise ValueError(
        f"Layer {type(plain).__name__} {plain.name!r} of model {model.name!r} reads the output of "
        f"{type(producer).__name__} {producer.name!r}, which is keras-dvi's packed means and "
        "(co)variances, not activations: a plain Keras layer treats those rows as numbers and the "
        "model's predictions and loss would be silently wrong. Remove it, or use the keras-dvi layer "
        "for the job: keras-dvi layers take each other's outputs directly, apply their own "
        "activation (`activation=`) and model weight noise themselves (no Dropout needed); "
        "`keras_dvi.FlattenDVI` / `AddDVI` / `MaxPooling2DDVI` replace Flatten / Add / MaxPooling2D "
        "after keras-dvi conv layers; a keras-dvi layer ends the model (read its output with "
        "`keras_dvi.predict` or `keras_dvi.unpack`). Plain layers are welcome before the first "
        "keras-dvi layer."
    )


def check_running_models(layer):
    """Called by a network's first keras-dvi layer outside a symbolic build: checks the models
    running it (the one stepped by `fit` / `evaluate`, else those whose `call` is on the Python
    call stack: an eager `model(x)`, `predict`), once per model and size. In a step of `fit` /
    `evaluate` it also refuses Keras' own losses and metrics (`check_compiled_model`)."""
    stepping = objective.stepping_model()
    models = [stepping] if stepping is not None else objective.calling_models()
    checked = getattr(layer, "_checked_structure", ())
    for model in models:
        key = (id(model), len(model.layers))
        if key not in checked:
            check_structure(model)
            checked = checked + (key,)
            layer._checked_structure = checked
    if stepping is not None:
        check_compiled_model(layer, stepping)


# ------------------------------------------------------------- the model's compiled loss and metrics

_FIX = (
    "Keras losses and metrics read the packed output (mean and (co)variance rows, or weight "
    "samples) as if it were a prediction. Use keras-dvi's: the loss `keras_dvi.HeteroscedasticELL()` "
    "(regression) or `keras_dvi.SoftmaxDeltaELL()` (classification) (`SampledHeteroscedasticELL` / "
    "`SampledSoftmaxELL` for sampled layers), and the metrics `keras_dvi.metrics.PredictiveMSE()`, "
    "`PredictiveLogLikelihood()` or `MeanLogitAccuracy()`. (A custom function that reads the "
    "moments with `keras_dvi.unpack` is welcome.)"
)


def is_keras_builtin(entry, kind):
    """Whether `entry`, a loss (`kind="loss"`) or metric (`"metric"`) as given to `compile` or
    serialised (`keras.saving.serialize_keras_object`), is one of Keras' own: a name such as
    `"mse"` or `"accuracy"`, a Keras function, or a Keras class not wrapping a user function."""
    if entry is None:
        return False
    getter = keras.losses.get if kind == "loss" else keras.metrics.get
    if isinstance(entry, str):
        if entry in ("accuracy", "acc", "crossentropy", "ce"):  # names only `compile` resolves
            return True
        try:
            found = getter(entry)
        except (ValueError, TypeError):
            return False
        module = getattr(found, "__module__", "") if callable(found) else type(found).__module__
        return module.startswith("keras.")
    if isinstance(entry, (types.FunctionType, functools.partial)):  # a Keras function, or a user's
        function = entry.func if isinstance(entry, functools.partial) else entry
        return str(getattr(function, "__module__", "")).startswith("keras.")
    if not isinstance(entry, dict):
        try:
            entry = keras.saving.serialize_keras_object(entry)
        except Exception:  # noqa: BLE001 - an object Keras cannot serialise is not Keras' own
            return False
        return isinstance(entry, dict) and is_keras_builtin(entry, kind)
    if entry.get("class_name") == "function":  # functions are serialised by name only
        return is_keras_builtin(entry.get("config"), kind)
    if not str(entry.get("module", "")).startswith("keras."):
        return False
    config = entry.get("config")
    wrapped = config.get("fn") if isinstance(config, dict) else None
    return wrapped is None or is_keras_builtin(wrapped, kind)


def _entries(value):
    """The losses or metrics in one `compile` argument's value, as a flat list (a serialised
    object, a dict with a `class_name`, is one entry)."""
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [entry for item in value for entry in _entries(item)]
    if isinstance(value, dict) and "class_name" not in value:
        return [entry for item in value.values() for entry in _entries(item)]
    return [value]


def _per_output(value, names):
    """A `compile` argument (`loss`, `metrics`, ...) as one list of entries per output name:
    keyed by output name, one item per output, or one value for every output."""
    if isinstance(value, dict) and "class_name" not in value:
        return {name: _entries(value.get(name)) for name in names}
    if isinstance(value, (list, tuple)) and len(names) > 1 and len(value) == len(names):
        return {name: _entries(item) for name, item in zip(names, value)}
    return {name: _entries(value) for name in names}


def _compiled_metrics(model):
    """`{"metrics": ..., "weighted_metrics": ...}` as given to `compile` (serialised), or
    `None` where the config cannot be read (inside the symbolic build of a JAX step, whose
    optimizer state is not readable yet)."""
    try:
        if keras.backend.backend() == "tensorflow":
            import tensorflow as tf

            with tf.init_scope():  # the optimizer's config reads its learning rate eagerly
                config = model.get_compile_config()
        else:
            config = model.get_compile_config()
    except Exception:  # noqa: BLE001 - any failure to serialise: fall back to the built metrics
        return None
    return {argument: config.get(argument) for argument in ("metrics", "weighted_metrics")}


def _built_metrics(model):
    """The metrics `compile` gave the model, as Keras built them (`[]` before the first step;
    which output each reads is not public)."""
    return [metric for found in model.metrics if getattr(found, "name", None) == "compile_metrics"
            for metric in found.metrics]


def _label(entry):
    if isinstance(entry, dict):  # serialised
        return entry.get("config") if entry.get("class_name") == "function" else entry.get("class_name")
    return entry if isinstance(entry, str) else getattr(entry, "name", None) or getattr(entry, "__name__", repr(entry))


def check_compiled_model(layer, model):
    """Refuses Keras' own losses and metrics on the keras-dvi outputs of `model`, the model being
    trained or evaluated (`keras_dvi.objective.stepping_model`), naming them and the keras-dvi
    replacement: a `ValueError` for a functional or `Sequential` model, whose outputs' producers
    are known, and a warning for a subclassed one (its outputs cannot be traced to their
    layers). Checked once per compiled step function; `layer` is the network's first keras-dvi
    layer."""
    key = (id(model), id(model.train_function), id(model.test_function))
    if getattr(layer, "_checked_compile", None) == key:
        return
    try:
        outputs = keras.tree.flatten(model.outputs)
    except (AttributeError, ValueError):  # a subclassed model
        outputs = None
    if outputs is None:
        names, ours, known = ["output"], {"output": layer}, False
    else:
        names = list(getattr(model, "output_names", None) or [f"output_{i}" for i in range(len(outputs))])
        ours = {name: producer_of(tensor) for name, tensor in zip(names, outputs) if producer_of(tensor) is not None}
        known = True
    refused = []
    arguments = [("loss", model.loss, "loss")]
    metrics = _compiled_metrics(model)
    if metrics is not None:
        arguments += [(argument, value, "metric") for argument, value in metrics.items()]
    elif len(ours) == len(names):  # every output is keras-dvi's: any built Keras metric reads one
        arguments.append(("metrics", _built_metrics(model), "metric"))
    for argument, value, kind in arguments:
        for name, entries in _per_output(value, names).items():
            builtins = [_label(entry) for entry in entries if name in ours and is_keras_builtin(entry, kind)]
            if builtins:
                refused.append((f"{argument}={builtins[0]!r}" if kind == "loss" else f"{argument}={builtins}", ours[name]))
                break
    if not refused or not known:  # an error is raised again at the next step; a warning is not
        layer._checked_compile = key
    for argument, producer in refused[:1]:
        message = (
            f"`model.compile({argument})` gives Keras' own loss or metric to the keras-dvi output "
            + (f"of layer {type(producer).__name__} {producer.name!r}" if known else
               f"of model {model.name!r} (whose first keras-dvi layer is {producer.name!r})")
            + f". {_FIX}"
        )
        if known:
            raise ValueError(message)
        warnings.warn(message + " (This subclassed model's outputs cannot be traced to their layers: if "
                      "its output is not a keras-dvi output, ignore this warning.)", UserWarning, stacklevel=2)
