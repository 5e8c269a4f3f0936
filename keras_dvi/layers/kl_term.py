"""`KLTerm`: a layer's part of the training objective, `w_t * KL / N`, held by composition.

Every keras-dvi layer with weights under a prior holds one (`layer.kl_term`; `None` in layers
without weights). It keeps the layer's part of the objective's state (`keras_dvi.objective`):
the counter of training calls `kl_step` and the planned warm-up length `kl_warmup_length`
(non-trainable variables of the layer, saved with it) that drive the KL warm-up, and, in the
first keras-dvi layer of a network (the one that reads data), the network's `ELBOTracker`
metric. A layer's `call` uses it in two lines:

    layer.kl_term.start(training, data)   # first layer: opens the step's nll / kl record
    layer.kl_term.add(kl, training)        # adds w_t * KL / N to the model's losses

A layer called more than once in a forward pass (a shared layer: a Siamese network's tower)
counts its KL once, and takes one step of its warm-up: its weights are drawn once. A network
with several first layers (a model with several inputs, each read by a keras-dvi layer, or
heads of separate outputs reading the same data) keeps one tracker: elected where their
branches meet (`elect_one_tracker`), or where they read the same tensor; the others join its
step records (`KLTerm.join`).
"""

import keras
from keras import ops

from keras_dvi import elbo_tracker, objective, priors, validation
from keras_dvi.packing import DATA_READER, producer_of

#: Names of the schedule's variables (saved with the model, in this order after the layer's
#: own): the training steps taken, and the length of an `"auto"` warm-up (0: not planned yet).
KL_STEP, KL_WARMUP_LENGTH = "kl_step", "kl_warmup_length"


class KLTerm:
    """The term `w_t * KL / N` that `layer` adds to its model's losses.

    `w_t` is the prior's `kl_weight` (`"auto"` resolved by `keras_dvi.objective.resolved_kl_weight`)
    times the warm-up factor `keras_dvi.objective.kl_ramp` of the layer's training step count.

    Args:
        layer: the keras-dvi layer that holds it; its `regularizer` is the prior.
    """

    def __init__(self, layer):
        self.layer = layer
        self.tracker = None  # the network's ELBOTracker, in its first keras-dvi layer only
        self.joined = None  # another first layer's tracker, whose records this one joins (`join`)
        self.unplaced = False  # built on its own (`build_unplaced`): its place waits for a call
        self.checked_num_train = False
        self.warned_no_prior = False

    # ---------------------------------------------------------------- state

    def build(self, is_head):
        """Creates the layer's `kl_step` and `kl_warmup_length` (after its own variables) and
        gives it the network's tracker if `is_head` (its inputs are data)."""
        layer = self.layer
        layer.kl_step, layer.kl_warmup_length = (
            layer.add_weight(name=name, shape=(), initializer="zeros", trainable=False, autocast=False)
            for name in (KL_STEP, KL_WARMUP_LENGTH)
        )
        self.set_head(is_head and not self.unplaced)

    def set_head(self, is_head):
        """Gives the layer the network's tracker if it is the network's first keras-dvi layer
        (its input is data), and takes it away if not."""
        self.joined = None
        if is_head and self.tracker is None:
            self.tracker = elbo_tracker.ELBOTracker()
            self.tracker.head = elbo_tracker.HeadRef(self.layer)  # (a weak reference)
        elif not is_head:
            self.tracker = None

    @property
    def reporting_to(self):
        """The tracker the layer's steps report to, as a first layer: its own, or the one it
        joined; `None` if it is not a first layer."""
        return self.tracker or self.joined

    def join(self, tracker):
        """Makes the layer, a first layer of its network beside another, report its steps to
        that layer's `tracker` (`elect_one_tracker`): it opens or joins the step's record with
        it and lists no tracker of its own."""
        self.tracker, self.joined = None, tracker

    # ---------------------------------------------------------------- the weight w_t

    def schedule(self):
        """`(kl_weight, kl_warmup_steps)` of the layer's prior; `(1, 0)` without one."""
        prior = self.layer.regularizer
        return (1.0, 0) if prior is None else (prior.kl_weight, prior.kl_warmup_steps)

    def warmup(self):
        """The prior's warm-up length in training steps: an integer, or for an `"auto"` warm-up
        the planned length (a tensor; taken as 1 before the first training step plans it)."""
        warmup = self.schedule()[1]
        if warmup == "auto":
            return ops.maximum(ops.convert_to_tensor(self.layer.kl_warmup_length), 1.0)
        return warmup

    def weight_after_warmup(self):
        """The prior's `kl_weight`, with `"auto"` resolved for the network the layer runs in
        (`keras_dvi.objective.resolved_kl_weight`: `min(1, N / P)` for a classifier, else 1;
        outside a compiled model's call, 1)."""
        kl_weight = self.schedule()[0]
        if kl_weight != priors.AUTO_KL_WEIGHT:
            return kl_weight
        return objective.resolved_kl_weight(self.layer.regularizer, objective.network_of(self.layer))

    def weight(self, training=False):
        """The weight `w_t` of the layer's KL at its next call: `kl_weight` outside training;
        while training, times the warm-up factor of the current `kl_step`."""
        kl_weight = self.weight_after_warmup()
        warmup = self.warmup()
        if not training or (isinstance(warmup, int) and not warmup):
            return kl_weight
        return kl_weight * objective.kl_ramp(ops.convert_to_tensor(self.layer.kl_step), warmup)

    def warmup_done(self):
        """Whether the KL warm-up is over: the next training step's KL weight is `kl_weight`
        (`False` before an `"auto"` warm-up is planned at the first training step). Read
        eagerly, e.g. by `keras_dvi.AfterKLWarmup` at the end of an epoch."""
        layer = self.layer
        if self.schedule()[1] == "auto" and float(ops.convert_to_numpy(layer.kl_warmup_length)) <= 0:
            return False
        ramp = objective.kl_ramp(ops.convert_to_tensor(layer.kl_step), self.warmup())
        return bool(float(ops.convert_to_numpy(ramp)) >= 1.0)

    def plan_warmup(self):
        """At a training step, fixes the length of an `"auto"` warm-up once (while
        `kl_warmup_length` is 0): three quarters of the steps the running `fit` plans, at most
        3,000 (`keras_dvi.priors.auto_kl_warmup_steps`); read when the step is traced."""
        if self.schedule()[1] != "auto":
            return
        model = objective.stepping_model()
        planned = priors.auto_kl_warmup_steps(None if model is None else objective.planned_training_steps(model))
        length = ops.convert_to_tensor(self.layer.kl_warmup_length)
        self.layer.kl_warmup_length.assign(ops.where(length > 0, length, ops.cast(planned, length.dtype)))

    # ---------------------------------------------------------------- a call

    def start(self, training=False, inputs=None):
        """Opens the step's hand-off if the layer is the network's first keras-dvi layer, whose
        data `inputs` (2-D) also check `num_train` against the batch when training."""
        tracker = self.reporting_to
        if tracker is None:
            return
        layer = self.layer
        num_train = None if layer.regularizer is None else layer.regularizer.num_train
        rows = None if inputs is None else inputs.shape[0]
        if rows is not None:  # the data rows: without the inducing rows of `InducingInputs`
            rows -= getattr(layer, "inducing_rows", 0)
        if training and rows is not None and num_train is not None and not self.checked_num_train:
            self.checked_num_train = True
            # as many rows as `num_train` is legitimate only if fit takes the data set as one batch
            one_batch = int(rows) == num_train and objective.fit_holds_data_in_one_batch(objective.stepping_model())
            validation.num_train_against_batch(num_train, int(rows), f"{type(layer).__name__} {layer.name!r}",
                                               one_batch)
        objective.start_step(tracker, training, layer.name, inputs)

    def add(self, kl, training=False):
        """Adds `w_t * kl` to the model's losses and hands `kl` (the layer's unweighted `KL / N`,
        or `None` without a prior) to the step's loss; advances `kl_step` while training."""
        layer = self.layer
        earlier = None if kl is None else objective.reported_loss(layer, kl)
        if earlier is not None or (kl is not None and layer.losses):  # called again in the pass: counted
            if earlier is not None and not layer.losses:
                # Keras' JAX trainer runs the model's `call` (`stateless_call`), not the model: each
                # layer call then enters on its own and clears the layer's losses, the first call's too
                layer.add_loss(earlier)
            return
        if training:
            self.plan_warmup()
        if kl is not None:
            weighted = ops.cast(self.weight(training), kl.dtype) * kl
            layer.add_loss(weighted)
            objective.add_kl(kl, layer, weighted)
        if training:
            layer.kl_step.assign_add(ops.cast(1.0, layer.kl_step.dtype))


def build_unplaced(layer, input_shape):
    """Builds `layer` on its own, before it is placed in a network (`from_dense`, `from_conv`):
    whether it is the network's first keras-dvi layer, and so holds the network's tracker, is
    decided where it is placed (`reads_data_changed`), in a functional model or at its first
    call (a subclassed model's)."""
    layer.kl_term.unplaced = True
    layer.build(input_shape)


def reads_data_changed(layer, inputs):
    """Called when `layer` (with a `kl_term`) is placed in a network: a layer built on its own
    (`build_unplaced`) or reused learns its place then, the first keras-dvi layer reading data."""
    if layer.kl_term is None or not layer.built or not hasattr(layer, "kl_step"):
        return
    shapes = keras.tree.map_structure(lambda t: tuple(t.shape), inputs)
    reads = layer._reads_data(shapes)
    if reads is not None:
        layer.kl_term.unplaced = False
        layer.kl_term.set_head(reads)
        if reads:  # first layers reading the same data (heads of separate outputs) share one tracker
            for tensor in keras.tree.flatten(inputs):
                if not keras.utils.is_keras_tensor(tensor):
                    continue
                other = getattr(tensor, DATA_READER, None)
                if other is None or other is layer:
                    setattr(tensor, DATA_READER, layer)
                elif other.kl_term.reporting_to is not None:
                    layer.kl_term.join(other.kl_term.reporting_to)


def elect_one_tracker(tensors):
    """Called where keras-dvi branches meet (a layer reading several keras-dvi `tensors`, in a
    symbolic build): the first keras-dvi layers of the branches (those holding a tracker,
    found through the producers of the tensors) keep one tracker between them, the first
    branch's, so the network logs one `nll` and `kl` and opens one record per step."""
    heads, seen = [], set()

    def walk(tensor):
        layer = producer_of(tensor)
        if layer is None or id(layer) in seen:
            return
        seen.add(id(layer))
        if getattr(layer, "elbo_tracker", None) is not None:
            heads.append(layer)
            return
        try:
            inputs = keras.tree.flatten(layer.input)
        except (AttributeError, ValueError):  # (a layer called more than once: several inputs)
            return
        for t in inputs:
            walk(t)

    for tensor in tensors:
        walk(tensor)
    for head in heads[1:]:
        head.kl_term.join(heads[0].elbo_tracker)
