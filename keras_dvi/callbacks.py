"""Keras callbacks for keras-dvi training."""

import keras

from keras_dvi.layers.reporting import ELBOReportingLayer


def elbo_trackers(model):
    """The distinct `ELBOTracker`s of a model's keras-dvi layers."""
    trackers = {}
    for layer in model._flatten_layers(include_self=False):
        if isinstance(layer, ELBOReportingLayer) and layer.elbo_tracker is not None:
            trackers[id(layer.elbo_tracker)] = layer.elbo_tracker
    return list(trackers.values())


class KLWarmup(keras.callbacks.Callback):
    """KL weight schedule: 0 for `delay_steps` updates, then a linear ramp to 1.

    The original DVI code kept the KL term off for the first updates and then ramped it in.
    The weight multiplies every layer's `KL / N` in the loss (the `kl` log entry shows the
    unweighted value).

    Steps are optimizer updates counted from the first `fit` the callback takes part in (it
    reads `optimizer.iterations`), so the schedule is the same whatever `steps_per_execution`
    is; with `steps_per_execution = k` the weight is updated every `k` steps and held within
    each group. Reusing the callback in a later `fit` continues the schedule.

    Args:
        delay_steps: optimizer steps with the KL switched off.
        warmup_steps: steps of the linear ramp from 0 to 1 after the delay (0: jump to 1).

    Example:

    >>> model.fit(x, y, epochs=100, callbacks=[KLWarmup(delay_steps=500, warmup_steps=1000)])
    """

    def __init__(self, delay_steps=0, warmup_steps=0):
        super().__init__()
        for name, value in (("delay_steps", delay_steps), ("warmup_steps", warmup_steps)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"Argument `{name}` must be a non-negative integer; received {value!r}.")
        self.delay_steps = delay_steps
        self.warmup_steps = warmup_steps
        self._first_iteration = None

    def weight(self, step):
        """The KL weight used at optimizer step `step` (0-based)."""
        if step < self.delay_steps:
            return 0.0
        if self.warmup_steps == 0:
            return 1.0
        return min(1.0, (step - self.delay_steps + 1) / self.warmup_steps)

    def on_train_begin(self, logs=None):
        if keras.backend.backend() == "jax":
            raise ValueError(
                "KLWarmup needs the TensorFlow (or torch) backend: under JAX the KL weight "
                "cannot be changed inside a compiled training step (keras-dvi keeps it at 1)."
            )
        if self._first_iteration is None:
            self._first_iteration = self._iterations()
        self._trackers = elbo_trackers(self.model)  # once per fit, not per batch

    def _iterations(self):
        return int(keras.ops.convert_to_numpy(self.model.optimizer.iterations))

    def on_train_batch_begin(self, batch, logs=None):
        # Keras calls this once per `steps_per_execution` group of steps: count real updates.
        weight = self.weight(self._iterations() - self._first_iteration)
        for tracker in self._trackers:
            tracker.kl_weight.assign(weight)

    def on_train_end(self, logs=None):
        for tracker in self._trackers:
            tracker.kl_weight.assign(1.0)
