"""The training objective's bookkeeping: KL weight and warm-up, and the `nll` / `kl` logs.

What `fit` minimises for a keras-dvi network is

    loss = nll + w_t * sum_layers KL_layer / N,

with `nll` the batch mean of the negative expected log-likelihood (the keras-dvi loss, weighted
by `sample_weight` / `class_weight` as Keras weighs it), `N`
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
  network's `ELBOTracker` metric (`keras_dvi.elbo_tracker`), so `model.metrics` lists it once;
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

    return sum(int(math.prod(mean.shape))
               for current in [layer, *network.layers_of(layer)]
               if isinstance(getattr(current, "regularizer", None), priors.PriorRegularizer) and current.built
               for mean, _, _ in current.weight_sets())


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
    produced. Open from the first layer's call to the metrics' read at the end of the step;
    `scored` once a keras-dvi loss has reported the step (the losses of further outputs add
    their `nll` to it)."""

    def __init__(self, tracker, training, head, trace):
        self.tracker, self.training, self.head, self.trace = tracker, bool(training), head, trace
        self.kl, self.produced = [], []
        self.losses = {}  # id(layer): the weighted KL the layer added to the losses in this step
        self.open, self.scored = True, False

    def score(self):
        """Marks the record scored and returns its KL values (kept no longer)."""
        self.scored = True
        kl, self.kl = self.kl, []
        return kl

    def close(self):
        """Closes the record; it keeps no tensor or graph after."""
        self.open, self.trace = False, None
        self.kl, self.produced, self.losses = [], [], {}


def _open_record():
    """The open `StepRecord` of the model being stepped, or `None`."""
    model = stepping_model()
    record = None if model is None else getattr(model, RECORD, None)
    return record if record is not None and record.open else None


def stepped_sampler():
    """In `fit` / `evaluate`, the layer from which the stepped model's outputs are weight samples
    (`keras_dvi.network.sampling_layer`), `None` if they are packed moments; `False` outside a
    step (a loss or metric called directly)."""
    model = stepping_model()
    return False if model is None else network.sampling_layer(model)


def refuse_samples(reader, fix):
    """In `fit` / `evaluate`, a `ValueError` when `reader` (a loss or metric that reads packed
    moments) is given a sampled model's weight samples, whose shape `(batch, samples, units)`
    reads as packed moments when there are 2 samples (or `units + 1`); `fix` says what to use."""
    sampler = stepped_sampler()
    if sampler:
        raise ValueError(
            f"{reader} reads the means and variances that DVI layers output, but this model's outputs are "
            f"weight samples of shape (batch, samples, units), drawn from {type(sampler).__name__} "
            f"{sampler.name!r} on. {fix}"
        )


def kl_ramp(step, warmup_steps):
    """Warm-up factor of the KL at training step `step` (0-based): `min(1, (step + 1) /
    warmup_steps)`, 1 without a warm-up (`warmup_steps` 0). Works on Python numbers and tensors
    (`warmup_steps` too: a tensor is taken to be positive)."""
    if isinstance(warmup_steps, (int, float)) and not warmup_steps:
        return 1.0
    step = ops.cast(step, "float32")
    return ops.clip((step + 1.0) / ops.cast(warmup_steps, "float32"), 0.0, 1.0)


def start_step(tracker, training=False, head=None, inputs=None):
    """Called by the first keras-dvi layer of a forward pass (named `head`, reading the data
    `inputs`): opens the step's `StepRecord` on the model being stepped (nothing outside `fit`
    / `evaluate`). Warns when a training step of another network's first layer is still open
    in the same computation: two keras-dvi layers took data inputs in one training pass."""
    model = stepping_model()
    if model is None:
        return
    previous = getattr(model, RECORD, None)
    trace = None if inputs is None else trace_of(inputs)
    if (previous is not None and previous.open and not previous.scored and previous.tracker is tracker
            and previous.trace is trace and previous.training == training):
        return  # the same first layer again in the same pass (a shared layer): one record
    if (training and previous is not None and previous.open and previous.tracker is not tracker
            and previous.training and not previous.scored and previous.trace is trace
            and not getattr(tracker, "warned_second_head", False)):
        tracker.warned_second_head = True
        warnings.warn(
            f"keras-dvi layers {previous.head!r} and {head!r} both take data (2-D) inputs in one "
            "training pass. If a plain Keras layer such as Flatten or Dense turns the first "
            "one's packed moments into plain features for the second, remove it: keras-dvi "
            "layers take each other's outputs directly. (Two keras-dvi branches on the data are "
            "legitimate: in a functional model they share one record; in a subclassed model, whose graph "
            f"keras-dvi cannot read, the logged `kl` leaves out the branch of {previous.head!r}.)",
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
        if shape is None or not layer.takes_packed(shape) or trace_of(tensor) is not record.trace:
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


def add_kl(kl, layer=None, loss=None):
    """Called by every keras-dvi layer with a prior: its `KL / N` for the current step (and
    the weighted term `loss` it added to the model's losses, `reported_loss`)."""
    record = _open_record()
    if record is not None:
        record.kl.append(ops.stop_gradient(kl))
        if layer is not None:
            record.losses[id(layer)] = loss


def reported_loss(layer, kl):
    """The weighted KL `layer` added to the losses earlier in the open step of `fit` /
    `evaluate`, in the computation of its `kl` now (it is called again: a shared layer), else
    `None`."""
    record = _open_record()
    earlier = None if record is None else record.losses.get(id(layer))
    return earlier if earlier is not None and trace_of(earlier) is trace_of(kl) else None


def trace_of(tensor):
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


def report_nll(nll, probabilities=None, unweighted=None):
    """Called by the keras-dvi losses with the step's `nll` (the loss as Keras weighs and
    reduces it; a classifier adds its predicted class probabilities `(batch, C)` and its
    unweighted mean `nll` per example `unweighted`, for the collapse check): closes the
    hand-off. KL values
    left by a forward pass of another computation (a `predict` that no loss followed) are
    dropped, not mixed in."""
    record = _open_record()
    if record is None:
        return
    trace = trace_of(nll)
    if record.scored:  # the loss of a further output of the same step (a model with several outputs)
        if trace is record.trace:
            record.tracker.update_state(ops.stop_gradient(nll), 0.0, steps=0.0)
        return
    kl = record.score()
    if any(trace_of(value) is not trace for value in kl):
        record.close()
        return
    total = ops.cast(0.0, "float32")
    for value in kl:
        total = total + ops.cast(value, "float32")
    record.tracker.update_state(ops.stop_gradient(nll), total, probabilities,
                                unweighted=None if unweighted is None else ops.stop_gradient(unweighted))
