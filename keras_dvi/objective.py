"""The training objective's bookkeeping: KL weight and warm-up, and the `nll` / `kl` logs.

What `fit` minimises for a keras-dvi network is

    loss = nll + w_t * sum_layers KL_layer / N,

with `nll` the batch mean of the negative expected log-likelihood (the keras-dvi loss), `N`
the number of training examples given to the prior, and `w_t` the KL weight of training step
`t`: a linear warm-up from 0 to `kl_weight` over the prior's `kl_warmup_steps`, then
`kl_weight` (1 is the ELBO; below 1 tempers the posterior, a departure from the ELBO;
`"auto"`: `min(1, N / P)` for the `P` weights of a classifier, `resolved_kl_weight`). Outside
training (`evaluate`, `val_loss`, `model(x)`) the weight is always `kl_weight`, so that
`val_loss` is the same objective at every epoch and `EarlyStopping` / `ModelCheckpoint` on
their default monitor are not fooled by the warm-up.

Where the state lives (every backend, every kind of model):

* each keras-dvi layer counts its training calls in a non-trainable variable `kl_step`
  (updated like a batch-normalisation statistic, saved with the model, so training resumes
  the schedule where it stopped);
* the first keras-dvi layer of a network (the one whose input is deterministic data) owns the
  network's `ELBOTracker` metric, so `model.metrics` lists it once;
* within one step of `fit` or `evaluate`, the layers hand their KL values to the keras-dvi
  loss, which updates the tracker (under JAX only updates made inside the loss computation
  reach the metrics). The hand-off is a `StepRecord` that the network's first layer opens on
  the model being stepped (`stepping_model`: the `self` of Keras' `train_step` / `test_step`,
  found on the Python call stack, since the step's Python code runs while it is traced) and
  the loss closes. No module holds state, and no private Keras attribute is read. A custom
  training loop that calls the model and the loss itself logs nothing through the tracker
  (its `model.losses` hold the weighted KL terms); `model(x)` and `predict` open no record.

The hand-off also makes three misuses loud, when a training step runs or is traced: a step
that no keras-dvi loss closes before the metrics are read (the model was compiled with a loss
such as `"mse"`, which reads packed moments as predictions; `keras_dvi.layers.boundary` refuses
Keras' own losses and metrics earlier, this catches custom ones), a second keras-dvi layer
taking data inputs in the same training pass (a plain layer such as `Flatten` turned
keras-dvi moments into features), and a packed input that no keras-dvi layer of the pass
produced (a plain layer such as `Dropout` between keras-dvi layers of a subclassed model).
"""

import math
import weakref
import warnings

import keras
from keras import ops

from keras_dvi import network

#: The attribute of a model holding the `StepRecord` of its current step.
RECORD = "keras_dvi_step"

# What Keras offers no public channel for (the model being stepped, the running `fit`'s plan,
# the training flag inside a `train_step` that does not pass one) is read off the Python call
# stack in one module, `keras_dvi.keras_frames`, whose test fails when a Keras release changes
# what it reads.
from keras_dvi.keras_frames import (  # noqa: E402, F401 - part of this module's interface
    calling_models,
    fit_holds_data_in_one_batch,
    planned_training_steps,
    resolve_training,
    stepping_model,
)


def prior_weight_count(layer):
    """`P`: the number of weights under closed-form keras-dvi priors (kernels and biases) in
    `layer`, a model or a single layer, its sub-layers included (the `P` of
    `kl_weight="auto"`, `keras_dvi.priors.auto_kl_weight`). Counts built layers only."""
    from keras_dvi import priors

    return sum(int(math.prod(v.shape))
               for current in [layer, *network.layers_of(layer)]
               if isinstance(getattr(current, "regularizer", None), priors.PriorRegularizer) and current.built
               for v in (current.kernel_mean, current.bias_mean) if v is not None)


def trains_classifier(model):
    """Whether `model` is compiled with a keras-dvi classification loss (`SoftmaxDeltaELL`,
    `SampledSoftmaxELL`): `True`, `False`, or `None` when it is not compiled (or is a layer)."""
    loss = getattr(model, "loss", None) if isinstance(model, keras.Model) else None
    if loss is None:
        return None
    return any(getattr(item, "categorical", False) for item in keras.tree.flatten(loss))


def resolved_kl_weight(prior, model):
    """The KL weight `prior` gives the network `model` after the warm-up: its `kl_weight`, or
    for `"auto"` the rule `min(1, N / P)` when `model` trains a classifier
    (`trains_classifier`) and 1 (the ELBO) otherwise."""
    from keras_dvi import priors

    if prior.kl_weight != priors.AUTO_KL_WEIGHT:
        return prior.kl_weight
    if not trains_classifier(model):
        return 1.0
    return priors.auto_kl_weight(prior.num_train, prior_weight_count(model))


def network_of(layer):
    """The model a layer runs in: the model of the running `fit` / `evaluate` step, else the
    outermost model whose `call` is running, else the layer itself."""
    model = stepping_model()
    if model is None:
        models = calling_models()
        model = models[0] if models else None
    return layer if model is None else model


def describe(model):
    """What `fit` minimises for `model` after the KL warm-up, in one sentence per prior: the
    KL weight (with `kl_weight="auto"` resolved to `min(1, N / P)`), `N`, whether that is the
    ELBO or a tempered posterior, and the warm-up.

    Examples:
        >>> print(keras_dvi.objective.describe(model))  # doctest: +SKIP
        After the KL warm-up (three quarters of the steps fit plans, at most 3000), fit minimises
        nll + 0.0571 * KL / 1005: a tempered posterior (EmpiricalBayesRegularizer, kl_weight='auto'
        for a classifier: min(1, N / P) with N = 1005 training examples and P = 17610 weights under
        keras-dvi priors).
    """
    from keras_dvi import priors

    found = {}
    for current in [model, *network.layers_of(model)]:
        prior = getattr(current, "regularizer", None)
        if isinstance(prior, priors.KLSettings):
            # (one entry per distinct prior: a loaded model gives each layer its own copy)
            found.setdefault((type(prior).__name__, repr(sorted(prior.get_config().items()))), prior)
    if not found:
        return "fit minimises nll: no keras-dvi layer has a prior, so there is no KL term."
    count, classifier = prior_weight_count(model), trains_classifier(model)
    sentences = []
    for prior in found.values():
        weight = resolved_kl_weight(prior, model)
        if prior.kl_weight != priors.AUTO_KL_WEIGHT:
            rule = f", kl_weight={prior.kl_weight:g}"
        elif classifier:
            rule = (f", kl_weight='auto' for a classifier: min(1, N / P) with N = {prior.num_train} training "
                    f"examples and P = {count} weights under keras-dvi priors")
        elif classifier is None:
            rule = (f", kl_weight='auto' before compile: 1 unless the model is compiled with a keras-dvi "
                    f"classification loss, then min(1, N / P) = "
                    f"{priors.auto_kl_weight(prior.num_train, count):.3g} for P = {count} weights")
        else:
            rule = ", kl_weight='auto' for a model that is not a classifier: 1"
        kind = "the ELBO" if weight == 1.0 else "a tempered posterior"
        warmup = prior.kl_warmup_steps
        warmup = ("three quarters of the steps fit plans, at most 3000" if warmup == "auto"
                  else f"{warmup} steps" if warmup else "none")
        num_train = prior.num_train if prior.num_train is not None else "N"
        sentences.append(f"After the KL warm-up ({warmup}), fit minimises nll + {weight:.3g} * KL / "
                         f"{num_train}: {kind} ({type(prior).__name__}{rule}).")
    if len(sentences) > 1:
        sentences = [f"Layers under prior {i + 1}: {text}" for i, text in enumerate(sentences)]
    return " ".join(sentences)


class StepRecord:
    """The hand-off of one step of a network: its tracker, whether it trains, its first layer's
    name, the computation it is traced in, the KL values of its layers and the tensors they
    produced. Open from the first layer's call to the keras-dvi loss (or the metrics' read)."""

    def __init__(self, tracker, training, head, trace):
        self.tracker, self.training, self.head, self.trace = tracker, bool(training), head, trace
        self.kl, self.produced = [], []
        self.open = True

    def close(self):
        """Closes the record and returns its KL values; it keeps no tensor or graph after."""
        self.open, self.trace = False, None
        kl, self.kl, self.produced = self.kl, [], []
        return kl


def _open_record():
    """The open `StepRecord` of the model being stepped, or `None`."""
    model = stepping_model()
    record = None if model is None else getattr(model, RECORD, None)
    return record if record is not None and record.open else None


def kl_ramp(step, warmup_steps):
    """Warm-up factor of the KL at training step `step` (0-based): `min(1, (step + 1) /
    warmup_steps)`, 1 without a warm-up (`warmup_steps` 0). Works on Python numbers and tensors
    (`warmup_steps` too: a tensor is taken to be positive)."""
    if isinstance(warmup_steps, (int, float)) and not warmup_steps:
        return 1.0
    step = ops.cast(step, "float32")
    return ops.clip((step + 1.0) / ops.cast(warmup_steps, "float32"), 0.0, 1.0)


#: A classifier whose predictions carry less than this share of the information of their own
#: average (`prediction_information`), or whose `nll` is no better than a uniform guess, after
#: the KL warm-up, at two checks in a row, has collapsed to the prior.
COLLAPSE_INFORMATION_SHARE = 0.1


def prediction_information(probabilities):
    """`(information, spread)` of a batch of class probabilities `(batch, C)`: the spread is the
    entropy of the batch's average prediction, `H(mean p)`, and the information the predictions
    carry about their inputs is `H(mean p) - mean H(p)` (the mutual information between the
    input and the predicted class over the batch), in nats. A classifier at its prior predicts
    the same distribution for every input: information 0."""
    probabilities = ops.maximum(probabilities, 1e-12)
    average = ops.mean(probabilities, axis=0)
    spread = -ops.sum(average * ops.log(average))
    own = -ops.sum(probabilities * ops.log(probabilities), axis=-1)
    return spread - ops.mean(own), spread


class HeadRef:
    """A weak reference to a network's first keras-dvi layer, held by its tracker (a plain
    object: Keras does not track it as a sub-layer of the metric)."""

    def __init__(self, layer):
        self.layer = weakref.ref(layer)


class ELBOTracker(keras.metrics.Metric):
    """The metric of a keras-dvi network: running means over steps of `nll` and `kl`.

    `nll` is the batch mean of the negative expected log-likelihood reported by the loss, `kl`
    the sum over layers of `KL / N` (without the warm-up or `kl_weight`), per step. Keras resets
    it at every epoch and `evaluate`, and shows it in the progress bar, the `History` and
    `evaluate`'s results.

    For classifiers it also keeps the running means of `prediction_information` and of
    `log C`, and checks them whenever Keras reads the result outside a compiled function (at
    the end of every epoch of `fit`, and of `evaluate`): a classifier trained past its KL
    warm-up whose predictions carry almost no information about its inputs, or whose `nll` is
    no better than a uniform guess, at two such checks in a row, has collapsed to its prior,
    and a warning says so, with the cause and the fixes.
    """

    def __init__(self, name="elbo", dtype="float32"):
        super().__init__(name=name, dtype=dtype)
        self.nll_total = self.add_variable(shape=(), initializer="zeros", name="nll_total")
        self.kl_total = self.add_variable(shape=(), initializer="zeros", name="kl_total")
        self.steps = self.add_variable(shape=(), initializer="zeros", name="steps")
        self.information_total = self.add_variable(shape=(), initializer="zeros", name="information_total")
        self.spread_total = self.add_variable(shape=(), initializer="zeros", name="spread_total")
        self.log_classes_total = self.add_variable(shape=(), initializer="zeros", name="log_classes_total")
        self.classified_steps = self.add_variable(shape=(), initializer="zeros", name="classified_steps")
        self.collapse_checks = 0  # consecutive checks that found a collapse (Python: read eagerly)

    def update_state(self, nll, kl, classification=None):
        """`classification`: `(information, spread, log C)` of the batch's predictions, or `None`."""
        self.nll_total.assign_add(ops.cast(nll, self.dtype))
        self.kl_total.assign_add(ops.cast(kl, self.dtype))
        self.steps.assign_add(ops.cast(1.0, self.dtype))
        if classification is not None:
            for variable, value in zip((self.information_total, self.spread_total, self.log_classes_total),
                                       classification):
                variable.assign_add(ops.cast(value, self.dtype))
            self.classified_steps.assign_add(ops.cast(1.0, self.dtype))

    def result(self):
        """`{"nll": ..., "kl": ...}`. Keras reads it at the end of every training or test step,
        after the loss: a step of this network still open then was scored by no keras-dvi loss
        (a warning if it was a training step), and is closed. Read outside a compiled function,
        it also checks a classifier for a collapse to its prior."""
        record = getattr(self, "open_record", None)
        if record is not None:
            self.open_record = None
            if record.open:
                record.close()
                if record.training and not getattr(self, "warned_loss", False):
                    self._warn_no_loss(record.head)
        steps = ops.maximum(self.steps, 1.0)
        nll = self.nll_total / steps
        if _executing_eagerly(self.steps):
            self._check_collapse(nll)
        return {"nll": nll, "kl": self.kl_total / steps}

    def _check_collapse(self, nll):
        steps = float(ops.convert_to_numpy(self.classified_steps))
        head = getattr(self, "head", None)
        layer = None if head is None else head.layer()
        if steps < 1 or layer is None or getattr(self, "warned_collapse", False):
            return
        if layer.regularizer is None or not layer.kl_term.warmup_done():
            self.collapse_checks = 0
            return
        information, spread, log_classes = (float(ops.convert_to_numpy(v)) / steps for v in
                                            (self.information_total, self.spread_total, self.log_classes_total))
        nll = float(ops.convert_to_numpy(nll))
        uninformed = information < COLLAPSE_INFORMATION_SHARE * max(spread, 1e-6)
        if not (uninformed or nll >= log_classes - 0.01):
            self.collapse_checks = 0
            return
        self.collapse_checks += 1
        if self.collapse_checks < 2:
            return
        self.warned_collapse = True
        from keras_dvi import priors

        if not getattr(layer.regularizer, "accepts_auto_kl_weight", True):  # a global inducing prior
            fixes = ("Fixes: a global inducing network leaves its prior as its precisions grow, "
                     "so train longer (the paper's learning rate 1e-2 with the Appendix H "
                     "`log_precision_scale`), start from data (`keras_dvi.initialize_from_data`), "
                     "or state a tempered `kl_weight` below 1; ")
        elif getattr(layer.regularizer, "kl_weight", None) == priors.AUTO_KL_WEIGHT:
            fixes = ("Fixes: a Bayesian last layer over plain Keras layers, fewer weights, or more "
                     "data (the KL weight is already the rule of kl_weight='auto'); ")
        else:
            fixes = ("Fixes: a tempered posterior by a stated rule, the priors' default "
                     "`kl_weight='auto'` (KL weight min(1, N / P) for N examples and P weights, "
                     "with `SoftmaxDeltaELL()`, Jankowiak's bound), a Bayesian last layer over "
                     "plain Keras layers, or more data; ")
        warnings.warn(
            f"The classifier whose first keras-dvi layer is {layer.name!r} has collapsed to its "
            f"prior: after the KL warm-up its predictions carry {information:.3f} nats of "
            f"information about its inputs (against {spread:.3f} for the spread of its average "
            f"prediction) and its nll is {nll:.3f} (a uniform guess: {log_classes:.3f}). It "
            f"predicts about the same class probabilities for every input. Cause: the KL term "
            f"(weight {layer.kl_term.weight_after_warmup():.3g} after the warm-up) outweighs what the data "
            "can pay for, which happens with many weights per training example (small data sets, "
            "wide networks, short runs): the posterior is pulled back to the prior. "
            + fixes + "`kl_warmup_steps=0` makes this worse (the documentation's classification "
            "guide).",
            UserWarning,
            stacklevel=2,
        )

    def _warn_no_loss(self, head):
        self.warned_loss = True
        warnings.warn(
                f"The network whose first keras-dvi layer is {head!r} trained a step that no "
                "keras-dvi loss scored: its loss reads the packed output (mean and (co)variance "
                "rows, or weight samples) as if it were a prediction, and its `nll` is not "
                "logged. Compile with a keras-dvi loss: "
                "`keras_dvi.HeteroscedasticELL()` (regression) or `keras_dvi.SoftmaxDeltaELL()` "
                "(classification); `SampledHeteroscedasticELL` / `SampledSoftmaxELL` for sampled layers. "
                "(A custom loss that reads the moments with `keras_dvi.unpack` is legitimate.)",
                UserWarning,
                stacklevel=3,
            )

    def reset_state(self):
        for variable in (self.nll_total, self.kl_total, self.steps, self.information_total, self.spread_total,
                         self.log_classes_total, self.classified_steps):
            variable.assign(ops.zeros((), dtype=variable.dtype))


def start_step(tracker, training=False, head=None, inputs=None):
    """Called by the first keras-dvi layer of a forward pass (named `head`, reading the data
    `inputs`): opens the step's `StepRecord` on the model being stepped (nothing outside `fit`
    / `evaluate`). Warns when a training step of another network's first layer is still open
    in the same computation: two keras-dvi layers took data inputs in one training pass."""
    model = stepping_model()
    if model is None:
        return
    previous = getattr(model, RECORD, None)
    trace = None if inputs is None else _trace_of(inputs)
    if (training and previous is not None and previous.open and previous.tracker is not tracker
            and previous.training and previous.trace is trace and not getattr(tracker, "warned_second_head", False)):
        tracker.warned_second_head = True
        warnings.warn(
            f"keras-dvi layers {previous.head!r} and {head!r} both take data (2-D) inputs in one "
            "training pass. If a plain Keras layer such as Flatten or Dense turns the first "
            "one's packed moments into plain features for the second, remove it: keras-dvi "
            "layers take each other's outputs directly. (A network with two keras-dvi branches "
            f"on the data is legitimate, but its logged `kl` leaves out the branch of {previous.head!r}.)",
            UserWarning,
            stacklevel=2,
        )
    record = StepRecord(tracker, training, head, trace)
    setattr(model, RECORD, record)
    tracker.open_record = record


def record_outputs(outputs):
    """Called by every keras-dvi layer with its outputs: the tensors a later keras-dvi layer of
    the same pass may read (see `check_inputs`)."""
    record = _open_record()
    if record is not None:
        record.produced.extend(keras.tree.flatten(outputs))


def check_inputs(layer, inputs):
    """Warns (once per layer) when a packed input (`layer.takes_packed`) reaches `layer` in a
    training pass that no keras-dvi layer of the pass produced: a plain layer (`Dropout`,
    `BatchNormalization`, ...) between keras-dvi layers of a subclassed model, where no
    symbolic build stamps tensors (`keras_dvi.layers.boundary`). Tensors are compared by
    identity within the pass's trace."""
    if getattr(layer, "warned_inputs", False):
        return
    record = _open_record()
    if record is None or not record.training:
        return
    for tensor in keras.tree.flatten(inputs):
        shape = getattr(tensor, "shape", None)
        if shape is None or not layer.takes_packed(shape) or _trace_of(tensor) is not record.trace:
            continue
        if not any(tensor is produced for produced in record.produced):
            layer.warned_inputs = True
            warnings.warn(
                f"Layer {type(layer).__name__} {layer.name!r} receives a {len(shape)}-D input of shape "
                f"{tuple(shape)} that no keras-dvi layer of this training pass produced: a plain "
                "Keras operation (Dropout, BatchNormalization, Dense, an activation, ...) changed "
                "the packed means and (co)variances (or weight samples) between keras-dvi layers, "
                "treating them as numbers. Pass keras-dvi layers each other's outputs directly: "
                "they apply their own activation (`activation=`) and model weight noise "
                "themselves (no Dropout needed).",
                UserWarning,
                stacklevel=3,
            )
            return


def add_kl(kl):
    """Called by every keras-dvi layer with a prior: its `KL / N` for the current step."""
    record = _open_record()
    if record is not None:
        record.kl.append(ops.stop_gradient(kl))


def _trace_of(tensor):
    """What identifies the computation a tensor belongs to: `None` for a concrete value, the
    graph of a symbolic TensorFlow tensor, `"traced"` for a JAX tracer."""
    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        return tensor.graph if tf.is_symbolic_tensor(tensor) else None
    if backend == "jax":
        import jax

        return "traced" if isinstance(tensor, jax.core.Tracer) else None
    return None


def _executing_eagerly(variable):
    """Whether this code runs eagerly (with concrete values), not traced into a compiled
    function: TensorFlow's executing mode, or a JAX variable's value that is no tracer."""
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        return tf.executing_eagerly()
    return _trace_of(ops.convert_to_tensor(variable)) is None


def report_nll(nll, probabilities=None):
    """Called by the keras-dvi losses with the batch mean `nll` (and a classifier's predicted
    class probabilities `(batch, C)`, for the collapse check): closes the hand-off. KL values
    left by a forward pass of another computation (a `predict` that no loss followed) are
    dropped, not mixed in."""
    record = _open_record()
    if record is None:
        return
    tracker, kl = record.tracker, record.close()
    trace = _trace_of(nll)
    if any(_trace_of(value) is not trace for value in kl):
        return
    total = ops.cast(0.0, "float32")
    for value in kl:
        total = total + ops.cast(value, "float32")
    classification = None
    if probabilities is not None:
        probabilities = ops.stop_gradient(ops.cast(probabilities, "float32"))
        information, spread = prediction_information(probabilities)
        classification = (information, spread, math.log(int(probabilities.shape[-1])))
    tracker.update_state(ops.stop_gradient(nll), total, classification)
