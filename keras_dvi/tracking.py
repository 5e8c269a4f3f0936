"""Reporting the two parts of the objective, `nll` and `kl`, in Keras logs.

Keras adds the layers' KL terms (`add_loss`) to the compiled loss and logs only the total.
Every keras-dvi layer therefore carries an `ELBOTracker`: a Keras metric that the layers of
one network share (a layer reuses the tracker of the keras-dvi layer that feeds it), so it
appears once in `model.metrics`, is reset by Keras at every epoch and `evaluate`, and shows
in the progress bar, the `History` and `evaluate`'s results as:

* `nll`: the batch mean of the negative expected log-likelihood (updated by the keras-dvi
  losses), and
* `kl`: the sum over layers of `KL / N` (without the warm-up weight), per step.

so that `loss = nll + kl_weight * kl`. The tracker also holds `kl_weight`, the KL warm-up
weight that `keras_dvi.callbacks.KLWarmup` sets.
"""

import keras
from keras import ops

# The tracker of the network whose forward pass was traced last. The losses, traced in the
# same train/test step right after the forward pass, add their value to it.
_ACTIVE = {"tracker": None}


def active_tracker():
    return _ACTIVE["tracker"]


def _activate(tracker):
    _ACTIVE["tracker"] = tracker


class ELBOTracker(keras.metrics.Metric):
    """Shared metric of a keras-dvi network: running means of `nll` and `kl`, and `kl_weight`."""

    def __init__(self, name="elbo", dtype="float32"):
        super().__init__(name=name, dtype=dtype)
        self._accumulators = [
            self.add_variable(shape=(), initializer="zeros", name=n)
            for n in ("nll_total", "nll_count", "kl_total", "kl_count")
        ]
        self.kl_weight = self.add_variable(shape=(), initializer="ones", name="kl_weight")

    def add_nll(self, value):
        nll_total, nll_count, _, _ = self._accumulators
        nll_total.assign_add(ops.cast(value, self.dtype))
        nll_count.assign_add(ops.cast(1.0, self.dtype))

    def add_kl(self, value, new_step):
        _, _, kl_total, kl_count = self._accumulators
        kl_total.assign_add(ops.cast(value, self.dtype))
        if new_step:
            kl_count.assign_add(ops.cast(1.0, self.dtype))

    def update_state(self, *args, **kwargs):  # updated through add_nll / add_kl
        pass

    def result(self):
        nll_total, nll_count, kl_total, kl_count = self._accumulators
        return {
            "nll": nll_total / ops.maximum(nll_count, 1.0),
            "kl": kl_total / ops.maximum(kl_count, 1.0),
        }

    def reset_state(self):
        for variable in self._accumulators:
            variable.assign(ops.zeros(variable.shape, dtype=variable.dtype))
