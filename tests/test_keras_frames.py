"""`keras_dvi.keras_frames` reads the Python call stack for what Keras offers no public channel
for (its docstring says why). These tests pin each fact it reads on the installed Keras, so a
release that renames a method or a local variable fails here instead of silently changing the
KL warm-up, the training flag or the `nll` / `kl` logs."""

import inspect

import keras
import numpy as np

from keras_dvi import keras_frames


class _Log:
    """A plain list holder (a list attribute of a layer would be tracked by Keras)."""

    def __init__(self):
        self.entries = []

    def clear(self):
        self.entries.clear()

    def __iter__(self):
        return iter(self.entries)

    def __bool__(self):
        return bool(self.entries)


class Probe(keras.layers.Layer):
    """Records what `keras_frames` finds while the layer's call runs (traced or eager)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seen = _Log()

    def call(self, inputs, training=None):
        model = keras_frames.stepping_model()
        self.seen.entries.append({
            "model": model,
            "calling": keras_frames.calling_models(),
            "training": keras_frames.resolve_training(training),
            "planned": None if model is None else keras_frames.planned_training_steps(model),
            "one_batch": None if model is None else keras_frames.fit_holds_data_in_one_batch(model),
        })
        return inputs


def _model():
    probe = Probe()
    model = keras.Sequential([keras.Input((2,)), probe, keras.layers.Dense(1)])
    model.compile("sgd", loss="mse")
    return model, probe


def _data(rows=40):
    rng = np.random.default_rng(0)
    return rng.normal(size=(rows, 2)).astype("float32"), rng.normal(size=(rows, 1)).astype("float32")


def test_the_keras_api_it_reads_exists():
    names = inspect.signature(keras.Model.fit).parameters
    assert {"epochs", "initial_epoch", "steps_per_epoch"} <= set(names)
    for method in ("train_step", "test_step", "fit", "evaluate", "train_on_batch", "test_on_batch", "call"):
        assert callable(getattr(keras.Model, method))


def test_fit_names_its_model_plan_and_training_flag():
    model, probe = _model()
    x, y = _data()
    model.fit(x, y, batch_size=10, epochs=3, verbose=0)
    # (under JAX, fit's symbolic build also runs the model, with training=False, before the step)
    steps = [seen for seen in probe.seen if seen["model"] is model and seen["training"]]
    assert steps, "the training step of the model being stepped was not found inside fit"
    assert {seen["planned"] for seen in steps} == {12}  # 3 epochs of 4 steps
    assert not any(seen["one_batch"] for seen in steps)


def test_fit_plan_counts_from_initial_epoch_and_knows_one_batch_epochs():
    model, probe = _model()
    x, y = _data()
    model.fit(x, y, batch_size=40, epochs=5, initial_epoch=2, verbose=0)
    steps = [seen for seen in probe.seen if seen["model"] is model and seen["training"]]
    assert steps and {seen["planned"] for seen in steps} == {3}  # (5 - 2) epochs of 1 step
    assert all(seen["one_batch"] for seen in steps)


def test_a_train_step_that_passes_no_training_flag_still_trains():
    probe = Probe()

    class NoFlag(keras.Model):
        def __init__(self):
            super().__init__()
            self.probe, self.dense = probe, keras.layers.Dense(1)

        def call(self, inputs):  # no `training` argument: Keras hands the layers None
            return self.dense(self.probe(inputs))

    model = NoFlag()
    model.compile("sgd", loss="mse")
    x, y = _data()
    model.fit(x, y, batch_size=20, epochs=1, verbose=0)
    steps = [seen for seen in probe.seen if seen["model"] is model and seen["training"]]
    assert steps and {seen["planned"] for seen in steps} == {2}  # the traced train step


def test_evaluate_and_predict():
    model, probe = _model()
    x, y = _data()
    model.evaluate(x, y, verbose=0)
    evaluated = [seen for seen in probe.seen if seen["model"] is model]
    assert evaluated and not any(seen["training"] for seen in evaluated)
    assert all(seen["planned"] is None for seen in evaluated)  # not inside fit
    probe.seen.clear()
    model.predict(x, verbose=0)
    model(x)
    assert probe.seen and all(seen["model"] is None for seen in probe.seen)
    assert all(model in seen["calling"] for seen in probe.seen)
