"""Every check of keras-dvi, in one place: clear errors for bad arguments, shapes, labels,
NaN/inf, negative variances and asymmetric covariances, and for models that misuse keras-dvi
layers (a plain Keras layer reading packed moments, Keras' own losses and metrics on keras-dvi
outputs: `check_structure`, `check_compiled_model`). Every module checks through here; the
warnings about a training step's hand-off (`keras_dvi.objective`) are the one exception, since
they read its record.

Shapes are always checked (they are static). Values are checked whenever they are concrete
(eager calls: `model(x)`, `layer(x)`, `loss(y, y_pred)`), at the cost of one pass over the
inputs. Inside compiled functions (`fit`, `predict`, `evaluate`) values are not concrete, and
a compiled step holds no check unless a layer or loss is created with `validate=True`: then
TensorFlow assertions name the bad argument (a pass over the inputs per step and, on a GPU, a
round trip to the host), and under JAX, which has no assertions, the loss becomes NaN. Without
`validate`, the only value work in a compiled step is the losses' NaN guard on the model's
output variances (`check_packed_variances`): one reduction over the small output, so that a
plain layer after the last keras-dvi layer gives a NaN loss rather than a silently wrong one.
Misplaced plain layers are also refused before any step runs, from the model's structure
(the stamps `keras_dvi.layers.boundary` puts on symbolic tensors).
"""

import functools
import types
import warnings
import weakref

import keras
import numpy as np
from keras import ops

from keras_dvi import network, objective
from keras_dvi.maths import moments
from keras_dvi.packing import producer_of


def _concrete(x):
    """NumPy value of `x` if it is concrete (eager), else `None`."""
    if x is None or isinstance(x, keras.KerasTensor):
        return None
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        if not tf.executing_eagerly() and tf.is_tensor(x):
            return None
    try:
        return np.asarray(ops.convert_to_numpy(x))
    except Exception:  # a symbolic tensor of another backend (a tracer)
        return None


def _fail(message):
    raise ValueError(message)


def check_finite(x, name, validate=False):
    """Raises `ValueError` naming `name` if `x` holds NaN or infinite values."""
    value = _concrete(x)
    if value is not None:
        if not np.isfinite(value).all():
            bad = int(np.size(value) - np.isfinite(value).sum())
            _fail(f"Argument `{name}` contains {bad} NaN or infinite value(s); expected finite numbers.")
        return x
    if validate and keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        return tf.debugging.check_numerics(x, f"Argument `{name}` contains NaN or infinite values")
    return x


def check_moments(mean, second, kind, name="inputs", validate=False, where=None):
    """Validates the values of layer inputs `(mean, second)` of structure `kind`.

    `second` is `None`, variances `(batch, K)` or covariances `(batch, K, K)`. Concrete values:
    variances (and covariance diagonals) must be >= 0 and finite, covariances symmetric
    (relative tolerance 1e-5). Inside compiled steps nothing is checked unless `validate`:
    then finiteness and the variances (`check_packed_variances`, named by `where`, the layer).
    """
    mean = check_finite(mean, name, validate)
    if second is None:
        return mean, second
    second = check_finite(second, name, validate)
    full = kind == "full"
    value = _concrete(second)
    if value is not None:
        variances = np.diagonal(value, axis1=-2, axis2=-1) if full else value
        if (variances < 0).any():
            _fail(
                f"Argument `{name}` has negative variances (min {variances.min():.3g}); "
                "expected variances >= 0. If it is a keras-dvi layer's output, a plain Keras "
                "layer (Dense, BatchNormalization, Dropout, Flatten, ...) sits between keras-dvi "
                "layers or after the last one and mixed its mean and covariance rows as numbers."
            )
        if full:
            scale = max(float(np.abs(value).max()), 1e-30)
            asym = float(np.abs(value - np.swapaxes(value, -1, -2)).max())
            if asym > 1e-5 * scale:
                _fail(
                    f"Argument `{name}`: covariance matrices must be symmetric; largest "
                    f"|C - C^T| is {asym:.3g} (relative {asym / scale:.3g})."
                )
        return mean, second
    if not validate or isinstance(second, keras.KerasTensor):
        return mean, second
    variances = moments.diagonal(second) if full else second
    return check_packed_variances(mean, variances, where or f"Argument `{name}`", validate), second


def check_same_batch(y_true, y_pred, message, validate=False):
    """Raises `ValueError(message)` if `y_pred` has a different batch size than `y_true`
    (checked statically, which covers every eager call and every JAX step, or, inside a
    compiled TensorFlow step with an unknown batch size, by an assertion with `validate`)."""
    true_rows, pred_rows = y_true.shape[0], y_pred.shape[0]
    if true_rows is not None and pred_rows is not None:
        if true_rows != pred_rows:
            _fail(message + f" (targets: {true_rows} rows, output: {pred_rows} rows)")
        return y_pred
    if validate and keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        with tf.control_dependencies(
            [tf.debugging.assert_equal(tf.shape(y_true)[0], tf.shape(y_pred)[0], message=message)]
        ):
            return tf.identity(y_pred)
    return y_pred


# ---------------------------------------------------------------- arguments


def positive_number(name, value):
    """`value` as a float; `ValueError` naming `name` unless it is a positive number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"Argument `{name}` must be a positive number; received {name}={value!r}.")
    return float(value)


def positive_integer(name, value, meaning=""):
    """`value` unless it is not a positive integer (`ValueError` naming `name`)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(f"Argument `{name}` must be a positive integer{meaning}; received {value!r}.")
    return int(value)


def non_negative_integer(name, value, meaning=""):
    """`value` unless it is not a non-negative integer (`ValueError` naming `name`)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"Argument `{name}` must be a non-negative integer{meaning}; received {value!r}.")
    return int(value)


def num_train(value):
    """The number of training examples: a positive integer."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(
            "Argument `num_train` must be the number of training examples, a positive "
            f"integer (the KL is divided by it, never by the batch size); received {value!r}."
        )
    return int(value)


def num_train_against_batch(num_train, rows, where, one_batch=False):
    """Checks `num_train` against the rows of a training batch (of layer `where`): fewer
    training examples than rows in one batch is impossible (an error); as many is the batch
    size passed by mistake (a warning), unless `one_batch`: `fit` takes the data as one batch
    an epoch, the whole data set (`keras_dvi.objective.fit_holds_data_in_one_batch`)."""
    fix = ("`num_train` must be the number of training examples in the whole data set (e.g. "
           "`len(x_train)`), not the batch size: the KL is divided by it, so a batch-sized value "
           "overweights the KL by the number of batches per epoch")
    if num_train < rows:
        raise ValueError(f"{where} trains on a batch of {rows} rows but `num_train` is {num_train}: {fix}.")
    if num_train > rows or one_batch:
        return
    warnings.warn(
        f"{where} trains on a batch of {rows} rows and `num_train` is also {rows}. If the "
        f"data set has more rows than one batch, {fix[0].lower() + fix[1:]}. (If each batch "
        "holds the whole data set, ignore this.)",
        UserWarning,
        stacklevel=3,
    )


# ---------------------------------------------------------------- targets and labels


def regression_targets(y_true, dims, name):
    """`y_true` as `(batch, dims)`; accepts `(batch,)` when `dims == 1`. `name` prefixes the
    error message (the loss or function that received the targets)."""
    shape = tuple(y_true.shape)
    if len(shape) == 1 and dims == 1:
        return y_true[:, None]
    if len(shape) == 2 and shape[1] == dims:
        return y_true
    raise ValueError(
        f"{name}: targets `y_true` must have shape (batch, {dims})"
        + (" or (batch,)" if dims == 1 else "")
        + f" to match a model output with {dims} target dimension(s); received shape {shape}."
    )


def class_labels(y_true, classes, dtype, validate=False):
    """Labels as one-hot (or soft) rows `(batch, classes)`.

    Integer labels `(batch,)` / `(batch, 1)` must be whole numbers in `0 .. classes - 1`:
    checked in eager calls and, with `validate`, by a TensorFlow assertion inside compiled
    TensorFlow steps; otherwise an out-of-range or fractional label gives an all-zero row,
    which the losses turn into a NaN loss rather than a silently wrong one
    (`poison_unlabelled`). With two classes a label `(batch,)` / `(batch, 1)` is the
    probability of class 1, as Keras' binary cross-entropy reads it: 0 and 1 are the classes,
    a soft label such as 0.9 (label smoothing) is the row `(0.1, 0.9)`; it must lie in
    `[0, 1]` (outside it the row is NaN).
    """
    shape = tuple(y_true.shape)
    if len(shape) == 2 and shape[1] == classes:
        return ops.cast(y_true, dtype)
    if len(shape) == 1 or (len(shape) == 2 and shape[1] == 1):
        if classes == 2:
            positive = _check_label_range(ops.cast(ops.reshape(y_true, (-1,)), dtype), classes, validate, binary=True)
            return ops.stack([1.0 - positive, positive], axis=-1)
        labels = ops.reshape(y_true, (-1,))
        indices = _check_label_range(ops.cast(labels, "int32"), classes, validate, labels)
        one_hot = ops.one_hot(indices, classes, dtype=dtype)
        if "int" in str(labels.dtype):
            return one_hot
        whole = ops.cast(ops.cast(indices, labels.dtype) == labels, dtype)  # 0 for a fractional label
        return whole[:, None] * one_hot
    raise ValueError(
        f"keras_dvi losses: labels `y_true` must be integers of shape (batch,) or (batch, 1), "
        f"or one-hot of shape (batch, {classes}) to match the {classes} logits; received "
        f"shape {shape}."
    )


def _check_label_range(indices, classes, validate=False, labels=None, binary=False):
    """`indices`: class indices (cast from `labels`), or with `binary` the probability of class
    1. Checked to lie in range (and `labels` to be whole numbers) where the values are concrete,
    and under `validate` by TensorFlow assertions in compiled TensorFlow steps; in a compiled
    step a `binary` probability outside `[0, 1]` becomes NaN."""
    if binary:
        message = (
            "Argument `y_true` of a two-class output holds labels outside [0, 1]: a label of shape "
            "(batch,) or (batch, 1) is the probability of class 1 (0 or 1, or a soft label such as 0.9); "
            "relabel the classes 0 and 1 (e.g. subtract 1 from labels 1 and 2)"
        )
    else:
        message = (
            f"Argument `y_true` has integer class labels outside 0..{classes - 1}, the range of the "
            f"model's {classes} logits: relabel the classes 0..{classes - 1} (e.g. subtract 1 from "
            f"labels 1..{classes}) or give the output layer one unit per class"
        )
    value, raw = _concrete(indices), _concrete(labels)
    if value is not None:
        top = 1 if binary else classes - 1
        if value.size and (value.min() < 0 or value.max() > top):
            _fail(message + f"; received labels from {value.min()} to {value.max()}.")
        if raw is not None and raw.size and not np.array_equal(raw, np.round(raw)):
            _fail(
                f"Argument `y_true` has fractional class labels (e.g. {raw[raw != np.round(raw)][0]}) for "
                f"{classes} classes: integer labels name a class; give soft labels as rows of shape "
                f"(batch, {classes}) that sum to 1."
            )
        return indices
    if binary:
        indices = ops.where((indices >= 0) & (indices <= 1), indices, float("nan"))
    if validate and keras.backend.backend() == "tensorflow" and not isinstance(indices, keras.KerasTensor):
        import tensorflow as tf

        top = tf.constant(1 if binary else classes - 1, indices.dtype)
        with tf.control_dependencies([
            tf.debugging.assert_non_negative(indices, message=message),
            tf.debugging.assert_less_equal(indices, top, message=message),
        ]):
            return tf.identity(indices)
    return indices


def poison_unlabelled(nll, labels):
    """NaN where a label row sums to 0 (an out-of-range integer label under JAX), else `nll`."""
    return ops.where(ops.sum(labels, axis=-1) > 0, nll, ops.full_like(nll, float("nan")))


# ---------------------------------------------------------------- the packed contract

#: How negative a packed variance may be (relative to `1 + mean^2`) before the tensor is taken
#: for something that is not a keras-dvi Gaussian (float round-off stays far inside it).
NEGATIVE_VARIANCE_TOLERANCE = 1e-3


def check_packed_variances(mean, variance, where, validate=False):
    """Refuses a packed tensor whose variances are clearly negative, in every mode.

    A plain Keras layer between keras-dvi layers (or after the last one) treats the packed
    `(mean, covariance)` rows as numbers and makes the "variances" negative. Eager values raise
    `ValueError`. In compiled functions the mean becomes NaN (one scalar added: a reduction over
    the variances, no assertion), so the loss is NaN rather than silently wrong; with
    `validate`, a TensorFlow graph also holds an assertion that raises with the same message.
    `where` names the layer or loss. Returns `mean`.
    """
    message = (
        f"{where} received a packed keras-dvi tensor whose variances are negative or NaN. "
        "Negative: it is not the output of a keras-dvi layer: a plain Keras layer (Dense, "
        "BatchNormalization, Dropout, Flatten, ...) sits between keras-dvi layers or after the "
        "last one and mixed the mean and covariance rows as numbers. Put plain Keras layers "
        "before the first keras-dvi layer only, and read predictions with keras_dvi.predict or "
        "keras_dvi.unpack. NaN: the inputs or the weights hold NaN or infinite values (check the "
        "data; `validate=True` on the first layer names them inside fit)"
    )
    bound = -NEGATIVE_VARIANCE_TOLERANCE * (1.0 + ops.square(mean))
    value, bound_value = _concrete(variance), _concrete(bound)
    if value is not None and bound_value is not None:
        if (value < bound_value).any():
            _fail(message + f" (smallest variance {value.min():.3g}).")
        return mean
    if isinstance(variance, keras.KerasTensor):
        return mean
    ok = ops.all(variance >= bound)
    if validate and keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        with tf.control_dependencies([tf.debugging.Assert(ok, [message])]):
            mean = tf.identity(mean)
    # A scalar NaN added to the mean (not a `where` over the whole tensor: one pass forward and
    # none backward, where the select cost two passes each way in every layer of a CNN step).
    return mean + ops.cast(ops.where(ok, 0.0, float("nan")), mean.dtype)


# ---------------------------------------------------------------- the model: plain layers reading moments


def plain_readers(model):
    """`[(plain layer, keras-dvi layer)]`: the plain Keras layers of `model` (a functional or
    `Sequential` model; nested models included) whose input is the packed moments of a
    keras-dvi layer, each with that layer. Read from the stamps of the symbolic graph (a
    subclassed model has none: `[]`)."""
    found = []
    for layer in network.layers_of(model):
        if hasattr(layer, "takes_packed") or isinstance(layer, (keras.Model, keras.layers.Identity)):  # keras-dvi's
            # own layers, nested models and identities (which change nothing) read packed moments legitimately
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
    done = _checks_done(layer)
    for model in models:
        if not any(_is_same(key, (model, len(model.layers))) for key in done.structures):
            check_structure(model)
            done.structures.append(_key(model, len(model.layers)))
    if stepping is not None:
        check_compiled_model(layer, stepping)


class _ChecksDone:
    """What a layer has checked already (a plain object: Keras does not track its contents).
    Models and compiled functions are held by weak reference and compared by identity, never by
    `id()`, which a new object can reuse once the old one is gone."""

    def __init__(self):
        self.structures, self.compiled = [], None


def _checks_done(layer):
    done = layer.__dict__.get("_keras_dvi_checks_done")
    if done is None:
        done = _ChecksDone()
        object.__setattr__(layer, "_keras_dvi_checks_done", done)
    return done


def _key(*objects):
    """`objects` as weak references (plain values, such as a layer count or `None`, kept as
    they are), for `_is_same`."""
    key = []
    for value in objects:
        try:
            key.append(("ref", weakref.ref(value)))
        except TypeError:  # None, numbers
            key.append(("value", value))
    return tuple(key)


def _is_same(key, objects):
    """Whether `key` (`_key`) refers to exactly `objects`: the same objects (identity; an object
    that is gone matches nothing) and equal plain values."""
    if key is None or len(key) != len(objects):
        return False
    for (kind, held), value in zip(key, objects):
        if kind == "ref":
            if held() is None or held() is not value:
                return False
        elif not (type(held) is type(value) and held == value):
            return False
    return True


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
    done = _checks_done(layer)
    current = (model, model.train_function, model.test_function)
    if _is_same(done.compiled, current):
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
        done.compiled = _key(*current)
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
