"""The training objective's bookkeeping: KL weight and warm-up, and the `nll` / `kl` logs.

What `fit` minimises for a keras-dvi network is

    loss = nll + w_t * sum_layers KL_layer / N,

with `nll` the batch mean of the negative expected log-likelihood (the keras-dvi loss), `N`
the number of training examples given to the prior, and `w_t` the KL weight of training step
`t`: a linear warm-up from 0 to `kl_weight` over the prior's `kl_warmup_steps`, then
`kl_weight` (1 is the ELBO; below 1 tempers the posterior, a departure from the ELBO). Outside
training (`evaluate`, `val_loss`, `model(x)`) the weight is always `kl_weight`, so that
`val_loss` is the same objective at every epoch and `EarlyStopping` / `ModelCheckpoint` on
their default monitor are not fooled by the warm-up.

Where the state lives (every backend, every kind of model):

* each keras-dvi layer counts its training calls in a non-trainable variable `kl_step`
  (updated like a batch-normalisation statistic, saved with the model, so training resumes
  the schedule where it stopped);
* the first keras-dvi layer of a network (the one whose input is deterministic data) owns the
  network's `ELBOTracker` metric, so `model.metrics` lists it once;
* within one training or test step, the layers hand their KL values to the keras-dvi loss,
  which updates the tracker. The hand-off is a thread-local scope like Keras' own (it holds
  tensors of the step being traced and nothing between steps); it is needed because under
  JAX only updates made inside the loss computation reach the metrics.

The hand-off also makes two misuses loud, when a training step runs or is traced: a step that
no keras-dvi loss closes before the metrics are read (the model was compiled with a Keras loss
such as `"mse"`, which reads packed moments as predictions), and a second keras-dvi layer
taking data inputs in the same training pass (a plain layer such as `Flatten` turned
keras-dvi moments into features).
"""

import threading
import warnings

import keras
from keras import ops

_STEP = threading.local()


def kl_ramp(step, warmup_steps, delay_steps=0):
    """Warm-up factor of the KL at training step `step` (0-based): 0 for `delay_steps` steps, then
    `min(1, (step - delay_steps + 1) / warmup_steps)` (1 without a warm-up). Works on Python
    numbers and tensors."""
    if not warmup_steps and not delay_steps:
        return 1.0
    step = ops.cast(step, "float32")
    if not warmup_steps:
        return ops.cast(step >= delay_steps, "float32")
    return ops.clip((step - delay_steps + 1.0) / float(warmup_steps), 0.0, 1.0)


class ELBOTracker(keras.metrics.Metric):
    """The metric of a keras-dvi network: running means over steps of `nll` and `kl`.

    `nll` is the batch mean of the negative expected log-likelihood reported by the loss, `kl`
    the sum over layers of `KL / N` (without the warm-up or `kl_weight`), per step. Keras resets
    it at every epoch and `evaluate`, and shows it in the progress bar, the `History` and
    `evaluate`'s results.
    """

    def __init__(self, name="elbo", dtype="float32"):
        super().__init__(name=name, dtype=dtype)
        self.nll_total = self.add_variable(shape=(), initializer="zeros", name="nll_total")
        self.kl_total = self.add_variable(shape=(), initializer="zeros", name="kl_total")
        self.steps = self.add_variable(shape=(), initializer="zeros", name="steps")

    def update_state(self, nll, kl):
        self.nll_total.assign_add(ops.cast(nll, self.dtype))
        self.kl_total.assign_add(ops.cast(kl, self.dtype))
        self.steps.assign_add(ops.cast(1.0, self.dtype))

    def result(self):
        """`{"nll": ..., "kl": ...}`. Keras reads it at the end of every training or test step,
        after the loss: a step of this network still open then was scored by no keras-dvi loss
        (a warning if it was a training step), and is closed."""
        if getattr(_STEP, "tracker", None) is self:
            _STEP.tracker = None
            if _STEP.training and not getattr(self, "warned_loss", False):
                self._warn_no_loss()
        steps = ops.maximum(self.steps, 1.0)
        return {"nll": self.nll_total / steps, "kl": self.kl_total / steps}

    def _warn_no_loss(self):
        self.warned_loss = True
        warnings.warn(
                f"The network whose first keras-dvi layer is {_STEP.head!r} trained a step that no "
                "keras-dvi loss scored: its loss reads the packed output (mean and (co)variance "
                "rows, or weight samples) as if it were a prediction, e.g. `loss=\"mse\"` on a "
                "DVI output, and its `nll` is not logged. Compile with a keras-dvi loss: "
                "`keras_dvi.HeteroscedasticELL()` (regression) or `keras_dvi.SoftmaxDeltaELL()` "
                "(classification); `SampledHeteroscedasticELL` / `SampledSoftmaxELL` for sampled layers. "
                "(A custom loss that reads the moments with `keras_dvi.unpack` is legitimate.)",
                UserWarning,
                stacklevel=3,
            )

    def reset_state(self):
        for variable in (self.nll_total, self.kl_total, self.steps):
            variable.assign(ops.zeros((), dtype=variable.dtype))


def start_step(tracker, training=False, head=None, inputs=None):
    """Called by the first keras-dvi layer of a forward pass (named `head`, reading the data
    `inputs`): opens the hand-off of the step. Warns when a training step of another network's
    first layer is still open in the same computation: two keras-dvi layers took data inputs
    in one training pass."""
    previous = getattr(_STEP, "tracker", None)
    trace = None if inputs is None else _trace_of(inputs)
    if (training and previous is not None and previous is not tracker and _STEP.training
            and _STEP.trace is trace and not getattr(tracker, "warned_second_head", False)):
        tracker.warned_second_head = True
        warnings.warn(
            f"keras-dvi layers {_STEP.head!r} and {head!r} both take data (2-D) inputs in one "
            "training pass. If a plain Keras layer such as Flatten or Dense turns the first "
            "one's packed moments into plain features for the second, remove it: keras-dvi "
            "layers take each other's outputs directly. (A network with two keras-dvi branches "
            f"on the data is legitimate, but its logged `kl` leaves out the branch of {_STEP.head!r}.)",
            UserWarning,
            stacklevel=2,
        )
    _STEP.tracker, _STEP.training, _STEP.head, _STEP.trace = tracker, bool(training), head, trace
    _STEP.kl = []


def add_kl(kl):
    """Called by every keras-dvi layer with a prior: its `KL / N` for the current step."""
    if getattr(_STEP, "tracker", None) is not None:
        _STEP.kl.append(ops.stop_gradient(kl))


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


def report_nll(nll):
    """Called by the keras-dvi losses with the batch mean `nll`: closes the hand-off. KL values
    left by a forward pass of another computation (a `predict` that no loss followed) are
    dropped, not mixed in."""
    tracker = getattr(_STEP, "tracker", None)
    if tracker is None:
        return
    kl = _STEP.kl
    _STEP.tracker, _STEP.kl = None, []
    trace = _trace_of(nll)
    if any(_trace_of(value) is not trace for value in kl):
        return
    total = ops.cast(0.0, "float32")
    for value in kl:
        total = total + ops.cast(value, "float32")
    tracker.update_state(ops.stop_gradient(nll), total)
