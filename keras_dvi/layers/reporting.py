"""`ELBOReportingLayer`: the base of every keras-dvi layer that adds a KL term to the model.

It holds the layer's part of the objective's state (`keras_dvi.objective`): the counter of
training calls `kl_step` that drives the KL warm-up, and, in the first keras-dvi layer of a
network, the network's `ELBOTracker` metric.
"""

import keras
from keras import ops

from keras_dvi import objective, validation
from keras_dvi.layers import boundary
from keras_dvi.layers.boundary import KerasDVILayer

#: Name of the step counter variable (saved with the model).
KL_STEP = "kl_step"


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
        self._warmup_override = None  # (warmup_steps, delay_steps) from `set_kl_warmup`

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

    def set_kl_warmup(self, warmup_steps, delay_steps=0):
        """Overrides the layer's warm-up: the KL is off for `delay_steps` training steps, then
        ramps in over `warmup_steps` (what the deprecated `KLWarmup` callback sets; not saved).
        Takes effect in the next traced training function."""
        self._warmup_override = (
            validation.non_negative_integer("warmup_steps", warmup_steps),
            validation.non_negative_integer("delay_steps", delay_steps),
        )

    def _build_kl_step(self, is_head):
        self.kl_step = self.add_weight(
            name=KL_STEP, shape=(), initializer="zeros", trainable=False, autocast=False
        )
        if is_head and self._tracker_ref.tracker is None:
            self._tracker_ref.tracker = objective.ELBOTracker()

    def _num_train(self):
        """The `N` this layer divides its KL by, or `None`."""
        return None if self.regularizer is None else self.regularizer.num_train

    def _start_network(self, training=False, inputs=None):
        """Opens the step's hand-off if this is the network's first keras-dvi layer, whose data
        `inputs` (2-D) also check `num_train` against the batch when training; in a step of
        `fit` / `evaluate`, checks the model's compiled losses and metrics first."""
        if self._tracker_ref.tracker is None:
            return
        num_train = self._num_train()
        rows = None if inputs is None else inputs.shape[0]
        if training and rows is not None and num_train is not None and not getattr(self, "_checked_num_train", False):
            self._checked_num_train = True
            validation.num_train_against_batch(num_train, int(rows), f"{type(self).__name__} {self.name!r}")
        boundary.check_compiled_model(self)
        objective.start_step(self._tracker_ref.tracker, training, self.name, inputs)

    def kl_weight_value(self, training=False):
        """The weight `w_t` of this layer's KL at its next call: `kl_weight` outside training;
        while training, times the warm-up factor of the current `kl_step`."""
        kl_weight, warmup = self._kl_schedule()
        warmup, delay = self._warmup_override or (warmup, 0)
        if not training or not (warmup or delay):
            return kl_weight
        return kl_weight * objective.kl_ramp(ops.convert_to_tensor(self.kl_step), warmup, delay)

    def _report_kl_value(self, kl, training=False):
        """Adds `w_t * kl` to the model's losses and hands `kl` (the layer's unweighted `KL / N`,
        or `None` without a prior) to the step's loss; advances `kl_step` while training."""
        if kl is not None:
            self.add_loss(ops.cast(self.kl_weight_value(training), kl.dtype) * kl)
            objective.add_kl(kl)
        if training:
            self.kl_step.assign_add(ops.cast(1.0, self.kl_step.dtype))

    def load_own_variables(self, store):
        """Loads files saved before `kl_step` existed (keras-dvi 0.1.0.dev0): their variables are
        the same but for the counter, which then starts at 0."""
        variables = self.weights  # the order Keras saves them in (no sub-layers here)
        if len(store.keys()) == len(variables) - 1:
            others = [v for v in variables if v is not self.kl_step]
            for i, variable in enumerate(others):
                variable.assign(store[f"{i}"])
            return
        super().load_own_variables(store)
