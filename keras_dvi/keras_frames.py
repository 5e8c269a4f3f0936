"""The one place where keras-dvi reads the Python call stack, and why.

A keras-dvi network's objective needs three facts that Keras gives a layer no public channel
for (Keras 3.15: no scope names the model being stepped, and `fit`'s plan reaches only its
callbacks):

* **the model being stepped** (`stepping_model`): the `self` of the nearest `train_step` /
  `test_step` (or `fit`, `evaluate`, `train_on_batch`, `test_on_batch`, whose symbolic build
  runs a forward pass before the first step) on the stack. The network's first layer opens the
  step's `nll` / `kl` record on it (`keras_dvi.objective`), and the KL weight rule
  `kl_weight="auto"` asks it whether it trains a classifier. This works on every kind of model
  (Sequential, functional, subclassed, a custom `train_step`) and backend, while the step is
  traced;
* **the running `fit`'s plan** (`planned_training_steps`, `fit_holds_data_in_one_batch`): the
  `epochs`, `initial_epoch` and `steps_per_epoch` arguments of `fit` (its frame's locals) with
  the steps per epoch from the `History` callback's public `params`; under
  `tf.distribute.MirroredStrategy` each replica's step is traced in a thread of its own, so
  every thread's stack is searched. The `"auto"` KL warm-up is three quarters of that plan;
* **the training flag** where Keras hands a layer `training=None` inside a training step (a
  subclassed model whose `call` does not pass it on, a custom `train_step` calling `self(x)`):
  whether a `train_step` is on the stack (`resolve_training`).

The frames are read only while a step is traced (once per compiled function), at a network's
first layer, never inside the compiled step. `tests/test_keras_frames.py` pins each fact on the
installed Keras: if a release renames a method or a local variable that these functions read,
it fails (the functions themselves fall back to "not found", which would silently change the
warm-up and the logs).
"""

import inspect
import sys

import keras

#: Methods of `keras.Model` whose `self` is the model being stepped, nearest on the call stack
#: first: the step methods (also under JAX and custom `train_step`s), then the public loops
#: (whose symbolic build runs a forward pass and the loss before the first step).
_STEPPING_METHODS = ("train_step", "test_step", "fit", "evaluate", "train_on_batch", "test_on_batch")


def _stepping_frame(names=_STEPPING_METHODS, model=None, frame=None):
    """`(model, method name, frame locals)` of the nearest frame on the Python call stack that
    runs one of the `keras.Model` methods `names` (of `model`, if given), or `None`. `frame`:
    the innermost frame to search from (default: the caller's)."""
    frame = frame or inspect.currentframe()
    try:
        while frame is not None:
            if frame.f_code.co_name in names:
                found = frame.f_locals.get("self")
                if isinstance(found, keras.Model) and (model is None or found is model):
                    return found, frame.f_code.co_name, frame.f_locals
            frame = frame.f_back
        return None
    finally:
        del frame


def stepping_model():
    """The `keras.Model` whose `fit`, `evaluate` or train or test step is running (or being
    traced) in this thread, or `None`: a forward pass outside them (`model(x)`, `predict`, a
    custom training loop). Found on the Python call stack (the `self` of the nearest of those
    methods); no Keras attribute is read."""
    found = _stepping_frame()
    return None if found is None else found[0]


def calling_models():
    """The `keras.Model`s whose `call` is running in this thread (an eager `model(x)`,
    `predict`), outermost first, found on the Python call stack as `stepping_model` finds its
    model (Keras offers no scope for a model's call)."""
    models, frame = [], inspect.currentframe()
    try:
        while frame is not None:
            if frame.f_code.co_name == "call":
                found = frame.f_locals.get("self")
                if isinstance(found, keras.Model) and all(found is not m for m in models):
                    models.append(found)
            frame = frame.f_back
        return models[::-1]
    finally:
        del frame


def resolve_training(training):
    """The training flag a keras-dvi layer acts on: `training` when Keras or the user set it,
    else whether the layer runs inside Keras' `train_step` (of `fit`, `train_on_batch` or a
    custom `train_step`). Keras hands `training=None` to the layers of a subclassed model whose
    `call` does not pass it on (or has no `training` argument); a training step is a training
    step all the same, so the KL warm-up advances and the step is logged as for any other
    model. An explicit `training=False` is respected."""
    if training is not None:
        return bool(training)
    found = _stepping_frame()
    return found is not None and found[1] == "train_step"


def _fit_plan(model):
    """`(fit's arguments, its History params)` of the running `model.fit`, or `None` outside
    it. Read from `fit`'s own arguments and the `History` callback's `params` (public Keras
    API; `fit` hands its `History` to the model when it builds its callbacks); works while the
    training step is traced."""
    found = _stepping_frame(("fit",), model)
    if found is None:
        # `tf.distribute.MirroredStrategy` traces each replica's step in a thread of its own,
        # while `fit` runs in the caller's: look at every thread's stack (`sys._current_frames`
        # is public Python API).
        for frame in sys._current_frames().values():  # noqa: SLF001
            found = _stepping_frame(("fit",), model, frame)
            if found is not None:
                break
    history = getattr(model, "history", None)
    params = getattr(history, "params", None) or {}
    # (`model.history` is set by the History callback of this model's `fit`; its `model`
    # property is not read: on JAX it syncs the training state, which must not happen while
    # the step is traced.)
    if found is None:
        return None
    arguments = found[2]
    if params.get("epochs") != arguments.get("epochs"):  # another fit's History
        return None
    return arguments, params


def planned_training_steps(model):
    """The number of training steps the running `model.fit` plans: `(epochs - initial_epoch) *
    steps per epoch`, or `None` outside `fit` or when the number of steps per epoch is unknown
    (a dataset or generator of unknown length without `steps_per_epoch`)."""
    plan = _fit_plan(model)
    if plan is None:
        return None
    arguments, params = plan
    epochs, steps = arguments.get("epochs"), params.get("steps")
    if not isinstance(epochs, int) or not isinstance(steps, int):
        return None
    initial = arguments.get("initial_epoch") or 0
    return max(0, epochs - int(initial)) * steps


def fit_holds_data_in_one_batch(model):
    """Whether the running `model.fit` takes its whole data set as one batch an epoch: one step
    an epoch that `fit` counted from the data (not a `steps_per_epoch` argument). `False` outside
    `fit`, with several steps an epoch, or when unknown."""
    plan = _fit_plan(model)
    return plan is not None and plan[1].get("steps") == 1 and plan[0].get("steps_per_epoch") is None
