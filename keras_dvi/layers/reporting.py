"""`ELBOReportingLayer`: the base of every keras-dvi layer that adds a KL term to the model.

It holds the layer's part of the objective's state (`keras_dvi.objective`): the counter of
training calls `kl_step` and the planned warm-up length `kl_warmup_length` that drive the KL
warm-up, and, in the first keras-dvi layer of a network, the network's `ELBOTracker` metric.
"""

import keras
from keras import ops

from keras_dvi import objective, priors, validation
from keras_dvi.layers.boundary import KerasDVILayer

#: Names of the schedule's variables (saved with the model, in this order after the layer's
#: own): the training steps taken, and the length of an `"auto"` warm-up (0: not planned yet).
KL_STEP, KL_WARMUP_LENGTH = "kl_step", "kl_warmup_length"


class _TrackerRef:
    """A plain holder, invisible to Keras' attribute tracking: the tracker is exposed through
    `metrics` (not saved with the weights, and creatable after the layer's state is locked)."""

    def __init__(self):
        self.tracker = None


class ELBOReportingLayer(KerasDVILayer):
    """A Keras layer that adds `w_t * KL / N` to the model's losses (see `keras_dvi.objective`).

    Subclasses call `_build_kl_step(is_head)` in `build` (`is_head`: the input is deterministic
    data, so this is the first keras-dvi layer of the network), `_start_network()` at the start
    of `call`, and `_report_kl_value(kl, training)` with their `KL / N`.
    """

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.regularizer = None  # the layer's prior (`keras_dvi.priors.KLSettings`), set by subclasses
        self._tracker_ref = _TrackerRef()

    @property
    def elbo_tracker(self):
        """The network's `ELBOTracker` if this is its first keras-dvi layer, else `None`."""
        return self._tracker_ref.tracker

    @property
    def metrics(self):
        tracker = self._tracker_ref.tracker
        return super().metrics + ([tracker] if tracker is not None else [])

    def _kl_schedule(self):
        """`(kl_weight, kl_warmup_steps)` of this layer's prior; `(1, 0)` without one."""
        prior = self.regularizer
        return (1.0, 0) if prior is None else (prior.kl_weight, prior.kl_warmup_steps)

    def _build_kl_step(self, is_head):
        self.kl_step, self.kl_warmup_length = (
            self.add_weight(name=name, shape=(), initializer="zeros", trainable=False, autocast=False)
            for name in (KL_STEP, KL_WARMUP_LENGTH)
        )
        self._set_head(is_head)

    def _set_head(self, is_head):
        """Gives the layer the network's tracker if it is the network's first keras-dvi layer
        (its input is data), and takes it away if not."""
        if is_head and self._tracker_ref.tracker is None:
            tracker = objective.ELBOTracker()
            tracker.head = objective.HeadRef(self)  # (a weak reference: not tracked by Keras)
            self._tracker_ref.tracker = tracker
        elif not is_head:
            self._tracker_ref.tracker = None

    def _reads_data(self, input_shape):
        """Whether inputs of `input_shape` are data (this is then the network's first keras-dvi
        layer), or `None` if the layer cannot tell."""
        return None

    def compute_output_spec(self, *args, **kwargs):
        # A layer built on its own (`from_dense`, `from_conv`) learns its place in the network
        # when the network is built: the first keras-dvi layer reads data.
        inputs = args[0] if args else kwargs.get("inputs")
        shapes = keras.tree.map_structure(lambda t: tuple(t.shape), inputs)
        reads = self._reads_data(shapes) if self.built and hasattr(self, "kl_step") else None
        if reads is not None:
            self._set_head(reads)
        return super().compute_output_spec(*args, **kwargs)

    def _training(self, training):
        """The training flag this call acts on (`keras_dvi.objective.resolve_training`)."""
        return objective.resolve_training(training)

    def _num_train(self):
        """The `N` this layer divides its KL by, or `None`."""
        return None if self.regularizer is None else self.regularizer.num_train

    def _start_network(self, training=False, inputs=None):
        """Opens the step's hand-off if this is the network's first keras-dvi layer, whose data
        `inputs` (2-D) also check `num_train` against the batch when training."""
        if self._tracker_ref.tracker is None:
            return
        num_train = self._num_train()
        rows = None if inputs is None else inputs.shape[0]
        if rows is not None:  # the data rows: without the inducing rows of `InducingInputs`
            rows -= getattr(self, "inducing_rows", 0)
        if training and rows is not None and num_train is not None and not getattr(self, "_checked_num_train", False):
            self._checked_num_train = True
            # as many rows as `num_train` is legitimate only if fit takes the data set as one batch
            one_batch = int(rows) == num_train and objective.fit_holds_data_in_one_batch(objective.stepping_model())
            validation.num_train_against_batch(num_train, int(rows), f"{type(self).__name__} {self.name!r}",
                                               one_batch)
        objective.start_step(self._tracker_ref.tracker, training, self.name, inputs)

    def _warmup(self):
        """The prior's warm-up length in training steps: an integer, or for an `"auto"` warm-up
        the planned length (a tensor; taken as 1 before the first training step plans it)."""
        warmup = self._kl_schedule()[1]
        if warmup == "auto":
            return ops.maximum(ops.convert_to_tensor(self.kl_warmup_length), 1.0)
        return warmup

    def kl_weight_after_warmup(self):
        """The prior's `kl_weight`, with `"auto"` resolved for the network this layer runs in
        (`keras_dvi.objective.resolved_kl_weight`: `min(1, N / P)` for a classifier, else 1;
        outside a compiled model's call, 1)."""
        kl_weight = self._kl_schedule()[0]
        if kl_weight != priors.AUTO_KL_WEIGHT:
            return kl_weight
        return objective.resolved_kl_weight(self.regularizer, objective.network_of(self))

    def kl_weight_value(self, training=False):
        """The weight `w_t` of this layer's KL at its next call: `kl_weight` outside training;
        while training, times the warm-up factor of the current `kl_step`."""
        kl_weight = self.kl_weight_after_warmup()
        warmup = self._warmup()
        if not training or (isinstance(warmup, int) and not warmup):
            return kl_weight
        return kl_weight * objective.kl_ramp(ops.convert_to_tensor(self.kl_step), warmup)

    def kl_warmup_done(self):
        """Whether the KL warm-up is over: the next training step's KL weight is `kl_weight`
        (`False` before an `"auto"` warm-up is planned at the first training step). Read
        eagerly, e.g. by `keras_dvi.AfterKLWarmup` at the end of an epoch."""
        if self._kl_schedule()[1] == "auto" and float(ops.convert_to_numpy(self.kl_warmup_length)) <= 0:
            return False
        ramp = objective.kl_ramp(ops.convert_to_tensor(self.kl_step), self._warmup())
        return bool(float(ops.convert_to_numpy(ramp)) >= 1.0)

    def _plan_kl_warmup(self):
        """At a training step, fixes the length of an `"auto"` warm-up once (while
        `kl_warmup_length` is 0): three quarters of the steps the running `fit` plans, at most 3,000
        (`keras_dvi.priors.auto_kl_warmup_steps`); read when the step is traced."""
        if self._kl_schedule()[1] != "auto":
            return
        model = objective.stepping_model()
        planned = priors.auto_kl_warmup_steps(None if model is None else objective.planned_training_steps(model))
        length = ops.convert_to_tensor(self.kl_warmup_length)
        self.kl_warmup_length.assign(ops.where(length > 0, length, ops.cast(planned, length.dtype)))

    def _report_kl_value(self, kl, training=False):
        """Adds `w_t * kl` to the model's losses and hands `kl` (the layer's unweighted `KL / N`,
        or `None` without a prior) to the step's loss; advances `kl_step` while training."""
        if training:
            self._plan_kl_warmup()
        if kl is not None:
            self.add_loss(ops.cast(self.kl_weight_value(training), kl.dtype) * kl)
            objective.add_kl(kl)
        if training:
            self.kl_step.assign_add(ops.cast(1.0, self.kl_step.dtype))

    def load_own_variables(self, store):
        """Loads files saved before the schedule's variables existed: without `kl_step` (the
        first keras-dvi 0.1.0.dev0 files; it then starts at 0) or without `kl_warmup_length`
        (files saved before the `"auto"` warm-up; it is then planned at the next training
        step). Their other variables are the same, in the same order."""
        variables = self.weights  # the order Keras saves them in (no sub-layers here)
        missing = len(variables) - len(store.keys())
        if missing in (1, 2):
            kept = variables[:-2] + ([self.kl_step] if missing == 1 else [])
            for i, variable in enumerate(kept):
                variable.assign(store[f"{i}"])
            return
        super().load_own_variables(store)
