"""Keras callbacks for keras-dvi training."""


import keras

from keras_dvi import deprecation, network, objective, validation
from keras_dvi.layers.reporting import ELBOReportingLayer


class KLWarmup(keras.callbacks.Callback):
    """Deprecated: the KL warm-up is now part of the prior, on by default.

    Use `EmpiricalBayesRegularizer(num_train, kl_warmup_steps=...)` (or
    `GaussianPriorRegularizer`) instead; the schedule then works on every backend and in
    `evaluate` without a callback. This callback still works: at the start of `fit` it sets the
    warm-up of every prior in the model to `warmup_steps` after `delay_steps` steps with the KL
    off, counted from the first `fit` it takes part in, on every keras-dvi layer (global
    inducing ones too; `layer.set_kl_warmup`).

    Args:
        delay_steps: optimizer steps with the KL switched off.
        warmup_steps: steps of the linear ramp from 0 to the prior's `kl_weight` after the delay.
    """

    def __init__(self, delay_steps=0, warmup_steps=0):
        super().__init__()
        delay_steps = validation.non_negative_integer("delay_steps", delay_steps)
        warmup_steps = validation.non_negative_integer("warmup_steps", warmup_steps)
        deprecation.warn(
            "KLWarmup",
            "the KL warm-up is part of the prior and on by default; pass `kl_warmup_steps=` to "
            "EmpiricalBayesRegularizer / GaussianPriorRegularizer instead of the callback.",
        )
        self.delay_steps = delay_steps
        self.warmup_steps = warmup_steps
        self._started = False

    def weight(self, step):
        """The KL warm-up factor at optimizer step `step` (0-based)."""
        ramp = objective.kl_ramp(float(step), self.warmup_steps, self.delay_steps)
        return float(keras.ops.convert_to_numpy(keras.ops.convert_to_tensor(ramp)))

    def on_train_begin(self, logs=None):
        for layer in network.layers_of(self.model):
            if isinstance(layer, ELBOReportingLayer) and layer.built:
                layer.set_kl_warmup(self.warmup_steps, self.delay_steps)
                if not self._started:
                    layer.kl_step.assign(0.0)
        self._started = True
        self.model.make_train_function(force=True)  # trace the new schedule
