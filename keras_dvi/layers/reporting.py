"""`ELBOReportingLayer`: the base of every keras-dvi layer that adds a KL term to the model.

The layers of one network share one `keras_dvi.tracking.ELBOTracker` (a layer reuses the
tracker of the keras-dvi layer that feeds it, found through the Keras history of its input),
so `fit` logs `nll` and `kl` once per network.
"""

import keras
from keras import ops

from keras_dvi import tracking


class _TrackerRef:
    """A plain holder, invisible to Keras' attribute tracking."""

    def __init__(self):
        self.tracker = None
        self.head = False


class ELBOReportingLayer(keras.layers.Layer):
    """A Keras layer that reports its `KL / N` to the network's shared `ELBOTracker`."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        # Held outside Keras' state tracking (the tracker may belong to another layer, and is
        # attached after `build` when a saved model is loaded); see the `metrics` property.
        self._tracker_ref = _TrackerRef()

    def __call__(self, inputs, *args, **kwargs):
        if self._tracker_ref.tracker is None:
            self._attach_tracker(inputs)
        return super().__call__(inputs, *args, **kwargs)

    @staticmethod
    def upstream_layer(inputs):
        """The layer that produced `inputs` (a symbolic tensor), or `None`."""
        first = inputs[0] if isinstance(inputs, (list, tuple)) and inputs else inputs
        history = getattr(first, "_keras_history", None)
        return getattr(history, "operation", None) if history is not None else None

    def _attach_tracker(self, inputs):
        """Shares the `ELBOTracker` of the keras-dvi layer feeding this one, or starts one.

        Not under JAX: its trainer runs layers statelessly and would drop (or fail on) the
        tracker's variable updates inside `call`; there the KL still enters the loss, but the
        `nll` / `kl` log entries and `KLWarmup` are not available."""
        if keras.backend.backend() == "jax":
            return
        tracker = getattr(self.upstream_layer(inputs), "elbo_tracker", None)
        self._tracker_ref.head = tracker is None
        self._tracker_ref.tracker = tracking.ELBOTracker() if tracker is None else tracker

    @property
    def elbo_tracker(self):
        """The `ELBOTracker` metric this layer reports its KL to (`None` before a call)."""
        return self._tracker_ref.tracker

    @property
    def metrics(self):
        tracker = self._tracker_ref.tracker
        return super().metrics + ([tracker] if tracker is not None else [])

    def _report_kl_value(self, kl):
        """Adds `kl_weight * kl` to the model's losses and `kl` to the tracker (`kl`: the
        layer's `KL / N`, or `None` for a layer without a prior)."""
        tracker, head = self._tracker_ref.tracker, self._tracker_ref.head
        if kl is not None:
            weight = 1.0 if tracker is None else ops.cast(tracker.kl_weight, kl.dtype)
            self.add_loss(weight * kl)
            if tracker is not None:
                tracker.add_kl(kl, new_step=head)
        elif tracker is not None and head:
            tracker.add_kl(0.0, new_step=True)
        if tracker is not None and head:
            tracking._activate(tracker)
