"""Training with the library's defaults: the KL weight and warm-up, the `nll` / `kl` logs for
every kind of model, and no collapse to the prior. Runs on TensorFlow and (test_backends) JAX."""

import warnings

import keras
import numpy as np
import pytest

import keras_dvi as kd
from keras_dvi import elbo_tracker
from tests.conftest import reloaded, to_numpy
from tests.test_priors import _numpy_eb_kl, _numpy_nll


def _data(n=64, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 2)).astype("float32"), rng.normal(size=(n,)).astype("float32")


def _layers(prior):
    return [kd.DenseDiagDVI(8, "relu", regularizer=prior), kd.DenseDVI(8, "relu", regularizer=prior),
            kd.DenseDVI(2, regularizer=prior)]


class SubclassedNetwork(keras.Model):
    def __init__(self, prior):
        super().__init__()
        self.first, self.second, self.head = _layers(prior)

    def call(self, inputs, training=None):
        return self.head(self.second(self.first(inputs, training=training), training=training), training=training)


class PlainSubclassedNetwork(SubclassedNetwork):
    """Written the way Keras' guides write simple models: no `training` argument."""

    def call(self, inputs):
        return self.head(self.second(self.first(inputs)))


class ForgetfulSubclassedNetwork(SubclassedNetwork):
    """Takes `training` but does not pass it on to its layers."""

    def call(self, inputs, training=None):
        return self.head(self.second(self.first(inputs)))


SUBCLASSED = {"subclassed": SubclassedNetwork, "subclassed_plain": PlainSubclassedNetwork,
              "subclassed_forgetful": ForgetfulSubclassedNetwork}


def _model(kind, prior):
    if kind == "sequential":
        return keras.Sequential([keras.Input((2,))] + _layers(prior))
    if kind == "functional":
        inputs = keras.Input((2,))
        outputs = inputs
        for layer in _layers(prior):
            outputs = layer(outputs)
        return keras.Model(inputs, outputs)
    model = SUBCLASSED[kind](prior)
    model(np.zeros((1, 2), "float32"))
    return model


def _frozen_fit(model, x, y, epochs, batch_size=None, **fit_args):
    """`fit` with SGD at learning rate 0: the weights, so the nll and KL, stay as they are."""
    model.compile(keras.optimizers.SGD(0.0), loss=kd.HeteroscedasticELL())
    return model.fit(x, y, batch_size=batch_size or len(x), epochs=epochs, shuffle=False, verbose=0, **fit_args).history


def _parts(model, x, y, num_train):
    nll = _numpy_nll(model.predict(x, verbose=0), y).mean()
    kl = sum(_numpy_eb_kl(layer) for layer in model.layers if isinstance(layer, kd.layers.BayesianLayer))
    return nll, kl / num_train


def test_kl_warmup_ramps_by_training_step_and_evaluation_uses_the_full_weight():
    x, y = _data()
    model = _model("sequential", kd.EmpiricalBayesRegularizer(64, kl_warmup_steps=4))
    history = _frozen_fit(model, x, y, epochs=6, validation_data=(x, y))
    nll, kl = _parts(model, x, y, 64)
    ramp = np.array([0.25, 0.5, 0.75, 1.0, 1.0, 1.0])
    np.testing.assert_allclose(history["loss"], nll + ramp * kl, rtol=1e-5)
    np.testing.assert_allclose(history["nll"], nll, rtol=1e-5)
    np.testing.assert_allclose(history["kl"], kl, rtol=1e-5)  # logged without the weight
    # `val_loss` (the default monitor of EarlyStopping and ModelCheckpoint) is the full
    # objective at every epoch, not fooled by the warm-up.
    np.testing.assert_allclose(history["val_loss"], nll + kl, rtol=1e-5)
    np.testing.assert_allclose(model.evaluate(x, y, verbose=0, return_dict=True)["loss"], nll + kl, rtol=1e-5)
    assert [float(to_numpy(layer.kl_step)) for layer in model.layers] == [6.0] * 3


def test_kl_weight_tempers_the_kl_term():
    x, y = _data(seed=1)
    model = _model("sequential", kd.EmpiricalBayesRegularizer(64, kl_weight=0.25, kl_warmup_steps=0))
    history = _frozen_fit(model, x, y, epochs=2)
    nll, kl = _parts(model, x, y, 64)
    np.testing.assert_allclose(history["loss"], nll + 0.25 * kl, rtol=1e-5)
    np.testing.assert_allclose(history["kl"], kl, rtol=1e-5)
    np.testing.assert_allclose(model.evaluate(x, y, verbose=0, return_dict=True)["loss"], nll + 0.25 * kl, rtol=1e-5)


@pytest.mark.keras_lazy_optimizer
@pytest.mark.parametrize("kind", ["sequential", "subclassed"])
def test_a_first_fit_that_builds_the_optimizer_in_its_trace_trains_the_same(kind):
    """The tests build a compiled model's optimizer before `fit` on TensorFlow (conftest:
    Keras otherwise builds it in the first trace of the step, and TensorFlow traces that step
    again). A user's `fit`, which does not, gives the same logs and weights."""
    x, y = _data(seed=5)
    runs = []
    for prebuild in (False, True):
        keras.utils.set_random_seed(7)
        model = _model(kind, kd.EmpiricalBayesRegularizer(64, kl_warmup_steps=3))
        model.compile(keras.optimizers.Adam(1e-2), loss=kd.HeteroscedasticELL())
        assert not model.optimizer.built  # (this test runs without conftest's wrapper)
        if prebuild:
            model.optimizer.build(model.trainable_variables)
        history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0).history
        runs.append((history, [to_numpy(v) for v in model.weights]))
    (lazy, lazy_weights), (built, built_weights) = runs
    assert sorted(lazy) == sorted(built) == ["kl", "loss", "nll"]
    for key in lazy:
        np.testing.assert_allclose(lazy[key], built[key], rtol=1e-6)
    for a, b in zip(lazy_weights, built_weights):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert float(to_numpy(model.optimizer.iterations)) == 8.0


KINDS = ("sequential", "functional", "subclassed", "subclassed_plain", "subclassed_forgetful")


@pytest.mark.keras_lazy_optimizer
def test_every_kind_of_model_logs_the_whole_objective_once():
    x, y = _data(seed=2)
    logs = {}
    for kind in KINDS:
        keras.utils.set_random_seed(5)  # the same initial weights for every kind
        model = _model(kind, kd.EmpiricalBayesRegularizer(64, kl_warmup_steps=2))
        history = _frozen_fit(model, x, y, epochs=3)
        assert [m.name for m in model.metrics].count("elbo") == 1
        nll, kl = _parts(model, x, y, 64)
        np.testing.assert_allclose(history["kl"], kl, rtol=1e-5)  # every layer's KL
        np.testing.assert_allclose(history["loss"], nll + np.array([0.5, 1.0, 1.0]) * kl, rtol=1e-5)
        logs[kind] = history
    for kind in KINDS[1:]:
        for key in ("loss", "nll", "kl"):
            np.testing.assert_allclose(logs[kind][key], logs["sequential"][key], rtol=1e-5)


def test_a_model_with_several_outputs_logs_the_nll_of_every_output():
    """Each output's keras-dvi loss reports its `nll`; the step's logged `nll` is their sum (the
    objective's likelihood part), counted as one step, beside the one `kl`: the logs add up to
    the loss in `fit` and in `evaluate`."""
    x, y = _data(seed=3)
    labels = (x[:, 0] > 0).astype("int32")
    prior = kd.EmpiricalBayesRegularizer(64, kl_weight=1.0, kl_warmup_steps=0)  # (loss = nll + kl)
    inputs = keras.Input((2,))
    hidden = kd.DenseDiagDVI(8, "relu", regularizer=prior)(inputs)
    model = keras.Model(inputs, {"value": kd.DenseDVI(2, regularizer=prior, name="value")(hidden),
                                 "label": kd.DenseDVI(2, regularizer=prior, name="label")(hidden)})
    model.compile(keras.optimizers.SGD(0.0), loss={"value": kd.HeteroscedasticELL(), "label": kd.SoftmaxDeltaELL()})
    targets = {"value": y, "label": labels}
    history = model.fit(x, targets, batch_size=16, epochs=2, shuffle=False, verbose=0).history
    np.testing.assert_allclose(history["nll"], np.add(history["value_loss"], history["label_loss"]), rtol=1e-5)
    np.testing.assert_allclose(np.add(history["nll"], history["kl"]), history["loss"], rtol=1e-5)
    logs = model.evaluate(x, targets, batch_size=16, verbose=0, return_dict=True)
    np.testing.assert_allclose(logs["nll"], logs["value_loss"] + logs["label_loss"], rtol=1e-5)
    np.testing.assert_allclose(logs["nll"] + logs["kl"], logs["loss"], rtol=1e-5)


def test_sample_and_class_weights_weigh_the_logged_nll_as_they_weigh_the_loss():
    """Keras weighs the loss by `sample_weight` / `class_weight`; the logged `nll` is weighted
    the same (it was the unweighted batch mean), so `loss = nll + kl` holds with weights.
    Oracle: the NumPy negative expected log-likelihood per example, weighted."""
    x, y = _data(seed=4)
    weights = np.linspace(0.2, 3.0, len(x)).astype("float32")
    model = _model("sequential", kd.EmpiricalBayesRegularizer(64, kl_weight=1.0, kl_warmup_steps=0))
    history = _frozen_fit(model, x, y, epochs=2, sample_weight=weights)
    per_example = _numpy_nll(model.predict(x, verbose=0), y)
    nll, kl = np.mean(weights * per_example), _parts(model, x, y, 64)[1]
    np.testing.assert_allclose(history["nll"], nll, rtol=1e-5)
    np.testing.assert_allclose(history["loss"], nll + kl, rtol=1e-5)
    logs = model.evaluate(x, y, sample_weight=weights, batch_size=64, verbose=0, return_dict=True)
    np.testing.assert_allclose([logs["nll"], logs["loss"]], [nll, nll + kl], rtol=1e-5)
    labels = (x[:, 0] > 0).astype("int32")
    prior = kd.EmpiricalBayesRegularizer(64, kl_weight=1.0, kl_warmup_steps=0)
    classifier = keras.Sequential([keras.Input((2,)), kd.DenseDVI(8, "relu", regularizer=prior),
                                   kd.DenseDVI(2, regularizer=prior)])
    classifier.compile(keras.optimizers.SGD(0.0), loss=kd.SoftmaxDeltaELL())
    history = classifier.fit(x, labels, batch_size=64, epochs=1, verbose=0, class_weight={0: 1.0, 1: 4.0}).history
    plain = to_numpy(kd.SoftmaxDeltaELL(reduction=None)(labels, classifier.predict(x, verbose=0)))
    np.testing.assert_allclose(history["nll"], np.mean(np.where(labels == 1, 4.0, 1.0) * plain), rtol=1e-5)
    np.testing.assert_allclose(history["loss"], np.add(history["nll"], history["kl"]), rtol=1e-5)
    # the collapse check compares the unweighted nll per example with a uniform guess
    tracker = next(m for m in classifier.metrics if isinstance(m, kd.elbo_tracker.ELBOTracker))
    totals = to_numpy(tracker.totals)
    index = tracker.INDEX
    np.testing.assert_allclose(totals[index["classified_nll"]] / totals[index["classified_steps"]], plain.mean(),
                               rtol=1e-5)


def test_every_way_of_writing_a_model_trains_the_same():
    """Keras hands `training=None` to the layers of a subclassed model whose `call` has no
    `training` argument or does not pass it on; its training steps still advance the KL
    warm-up, so it logs the same `nll` / `kl` and reaches the same weights as a `Sequential`
    from the same start, with the default ("auto") warm-up."""
    x, y = _data(seed=6)
    runs = {}
    for kind in KINDS:
        keras.utils.set_random_seed(7)
        model = _model(kind, kd.EmpiricalBayesRegularizer(64))
        model.compile(keras.optimizers.Adam(1e-2), loss=kd.HeteroscedasticELL())
        history = model.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0).history
        assert [m.name for m in model.metrics].count("elbo") == 1, kind  # the objective is logged once
        layers = [layer for layer in model.layers if isinstance(layer, kd.layers.BayesianLayer)]
        assert [float(to_numpy(layer.kl_step)) for layer in layers] == [12.0] * 3, kind
        assert [float(to_numpy(layer.kl_warmup_length)) for layer in layers] == [9.0] * 3, kind
        runs[kind] = history, [to_numpy(w) for w in model.trainable_weights]
    loss, weights = runs["sequential"]
    assert loss["loss"][1] > loss["nll"][1]  # the KL weight came in
    for kind in KINDS[1:]:
        for key in ("loss", "nll", "kl"):
            np.testing.assert_allclose(runs[kind][0][key], loss[key], rtol=1e-5, err_msg=f"{kind} {key}")
        for got, want in zip(runs[kind][1], weights):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6, err_msg=kind)


def test_an_explicit_training_false_is_respected():
    class Frozen(SubclassedNetwork):
        def call(self, inputs, training=None):
            return self.head(self.second(self.first(inputs, training=False), training=False), training=False)

    x, y = _data(seed=8)
    model = Frozen(kd.EmpiricalBayesRegularizer(64))
    model(x[:1])
    _frozen_fit(model, x, y, epochs=2)
    assert float(to_numpy(model.first.kl_step)) == 0.0  # the user's choice, not a training step


@pytest.mark.parametrize("epochs, batch", [(10, 64), (10, 6)])  # 10 and 110 training steps
def test_the_auto_warm_up_ends_on_the_objective_kl_weight_asks_for(epochs, batch):
    """The default warm-up is three quarters of the steps `fit` plans (at most 3,000), so the
    last quarter of every run trains `nll + kl_weight * kl`, whatever its length and batch size."""
    x, y = _data(seed=9)
    model = _model("sequential", kd.EmpiricalBayesRegularizer(64, kl_weight=0.5))
    model.compile(keras.optimizers.SGD(0.0), loss=kd.HeteroscedasticELL(), steps_per_execution=5)
    history = model.fit(x, y, batch_size=batch, epochs=epochs, shuffle=False, verbose=0).history
    steps = epochs * -(-len(x) // batch)
    layer = model.layers[0]
    assert float(to_numpy(layer.kl_warmup_length)) == -(-3 * steps // 4)
    assert float(to_numpy(layer.kl_term.weight(training=True))) == pytest.approx(0.5)
    assert layer.kl_term.warmup_done()
    nll, kl = _parts(model, x, y, 64)
    np.testing.assert_allclose(history["loss"][-1], nll + 0.5 * kl, rtol=1e-5)  # the last epoch


def test_the_auto_warm_up_length_for_runs_of_any_length():
    from keras_dvi.priors import auto_kl_warmup_steps

    for steps in (1, 2, 100, 1_000, 10_000, 100_000):
        length = auto_kl_warmup_steps(steps)
        assert 1 <= length <= steps and length <= 3000  # the last step trains the full weight
    assert [auto_kl_warmup_steps(s) for s in (100, 1_000, 10_000, 100_000)] == [75, 750, 3000, 3000]
    assert auto_kl_warmup_steps(None) == 3000  # a run of unknown length


@pytest.mark.keras_lazy_optimizer
def test_the_auto_warm_up_is_planned_once_and_without_a_known_length_is_3000_steps(tmp_path):
    x, y = _data(seed=10)

    def batches():  # a generator: `fit` cannot know its length
        for i in range(0, 64, 16):
            yield x[i:i + 16], y[i:i + 16]

    model = _model("sequential", kd.EmpiricalBayesRegularizer(64))
    model.compile(keras.optimizers.SGD(0.0), loss=kd.HeteroscedasticELL())
    model.fit(batches(), epochs=1, verbose=0)
    assert float(to_numpy(model.layers[0].kl_warmup_length)) == 3000

    class StopAfter(keras.callbacks.Callback):  # an interrupted run: stopped inside its warm-up
        def on_train_batch_end(self, batch, logs=None):
            self.model.stop_training = batch >= 2

    model = _model("sequential", kd.EmpiricalBayesRegularizer(64))
    model.compile(keras.optimizers.SGD(0.0), loss=kd.HeteroscedasticELL())
    model.fit(x, y, batch_size=4, epochs=5, verbose=0, callbacks=[StopAfter()])  # plans 80 steps
    assert float(to_numpy(model.layers[0].kl_step)) == 3 and not model.layers[0].kl_term.warmup_done()
    loaded = reloaded(model, tmp_path, "m")
    loaded.fit(x, y, batch_size=64, epochs=1, verbose=0)  # a later run keeps the plan
    assert [float(to_numpy(layer.kl_warmup_length)) for layer in loaded.layers] == [60.0] * 3
    assert float(to_numpy(loaded.layers[0].kl_term.weight(training=True))) == pytest.approx(5 / 60)


def test_after_kl_warmup_holds_a_stopping_rule_back_until_the_warm_up_is_over():
    """With frozen weights the training loss rises while the KL weight comes in (the first 15
    epochs of a 20-epoch run), then stays level: a bare EarlyStopping stops at the first rise;
    wrapped, it counts its patience from the end of the warm-up."""
    x, y = _data(seed=11)
    stopped = {}
    for wrap in (False, True):
        model = _model("sequential", kd.EmpiricalBayesRegularizer(64))
        rule = keras.callbacks.EarlyStopping(monitor="loss", patience=2)
        history = _frozen_fit(model, x, y, epochs=20, batch_size=8,
                              callbacks=[kd.AfterKLWarmup(rule) if wrap else rule])
        stopped[wrap] = len(history["loss"])
        if wrap:
            assert np.all(np.diff(history["loss"][:15]) > 0)  # the warm-up: 120 of the 160 steps
    assert stopped == {False: 3, True: 17}  # wrapped: sees epochs 15-17, no gain after the first
    with pytest.raises(ValueError, match="keras.callbacks.Callback"):
        kd.AfterKLWarmup("early_stopping")


def test_the_schedule_resumes_after_saving(tmp_path):
    x, y = _data(seed=3)
    model = _model("sequential", kd.EmpiricalBayesRegularizer(64, kl_warmup_steps=10, kl_weight=0.5))
    _frozen_fit(model, x, y, epochs=3)
    loaded = reloaded(model, tmp_path, "m")
    assert [float(to_numpy(layer.kl_step)) for layer in loaded.layers] == [3.0] * 3
    assert loaded.layers[0].regularizer.kl_weight == 0.5
    assert loaded.layers[0].regularizer.kl_warmup_steps == 10
    assert float(to_numpy(loaded.layers[1].kl_term.weight(training=True))) == pytest.approx(0.5 * 4 / 10)


def test_prior_schedule_arguments_are_checked():
    with pytest.raises(ValueError, match="kl_weight"):
        kd.EmpiricalBayesRegularizer(10, kl_weight=0.0)
    with pytest.raises(ValueError, match="kl_warmup_steps"):
        kd.GaussianPriorRegularizer(10, kl_warmup_steps=-5)
    with pytest.raises(ValueError, match="kl_warmup_steps"):
        kd.EmpiricalBayesRegularizer(10, kl_warmup_steps=2.5)
    with pytest.raises(ValueError, match="'auto'"):
        kd.EmpiricalBayesRegularizer(10, kl_warmup_steps="half")
    assert kd.EmpiricalBayesRegularizer(10).kl_warmup_steps == "auto"


def _digits():
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    rng = np.random.default_rng(0)
    rows = rng.permutation(len(x))
    x, y = (x[rows] / 16.0).astype("float32"), y[rows].astype("int32")
    return (x[:500], y[:500]), (x[1000:], y[1000:])


def _digits_classifier(num_train, method="jankowiak", **prior_args):
    prior = kd.EmpiricalBayesRegularizer(num_train, **prior_args)
    model = keras.Sequential([
        keras.Input((64,)),
        kd.DenseDiagDVI(100, "relu", regularizer=prior),
        kd.DenseDiagDVI(100, "relu", regularizer=prior),
        kd.DenseDVI(10, regularizer=prior),
    ])
    model.compile(keras.optimizers.Adam(3e-3), loss=kd.SoftmaxDeltaELL(method=method))
    return model


@pytest.mark.heavy
@pytest.mark.parametrize("settings, collapses, epochs", [
    ({}, False, 165),
    ({"kl_weight": 1.0, "kl_warmup_steps": 0, "method": "delta"}, True, 50),
])
def test_a_classifier_with_the_defaults_does_not_collapse_to_the_prior(settings, collapses, epochs):
    """The README's few lines on 500 digits, 3,300 steps (past the default 3,000-step warm-up, so
    the objective the prior states is trained at the end: the defaults' KL weight min(1, N / P)
    = 500 / 17,710). The full ELBO without the KL warm-up (the second case) collapses: the KL's
    gradient wins at the start and the network predicts chance (checked after 1,000 steps)."""
    (x, y), (x_test, y_test) = _digits()
    model = _digits_classifier(len(x), **settings)
    model.fit(x, y, epochs=epochs, batch_size=25, verbose=0)
    probs = to_numpy(kd.predictive.class_probabilities(model.predict(x_test, verbose=0)))
    accuracy = (probs.argmax(-1) == y_test).mean()
    if collapses:
        assert accuracy < 0.3
    else:
        assert accuracy > 0.85


@pytest.mark.keras_lazy_optimizer
def test_training_without_a_prior_warns_once_per_layer():
    x, y = _data(seed=6)
    model = keras.Sequential([keras.Input((2,)), kd.DenseDVI(4, "relu"),
                              kd.DenseDVI(2, regularizer=kd.EmpiricalBayesRegularizer(64))])
    model.compile(keras.optimizers.Adam(1e-2), loss=kd.HeteroscedasticELL())
    with pytest.warns(UserWarning, match="trained without a prior") as record:
        model.fit(x, y, epochs=2, batch_size=32, verbose=0)
    assert len([w for w in record if "without a prior" in str(w.message)]) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # predicting is a legitimate use: no warning
        model.predict(x, verbose=0)


def test_class_labels_out_of_range_are_refused():
    """Labels 1..3 for 3 logits once trained silently (loss 8.49)."""
    x, _ = _data(seed=7)
    labels = (np.arange(64) % 3 + 1).astype("int32")
    prior = kd.EmpiricalBayesRegularizer(64)
    model = keras.Sequential([keras.Input((2,)), kd.DenseDVI(4, "relu", regularizer=prior), kd.DenseDVI(3, regularizer=prior)])
    model.compile(keras.optimizers.Adam(1e-2), loss=kd.SoftmaxDeltaELL())
    with pytest.raises(ValueError, match=r"outside 0\.\.2"):
        kd.SoftmaxDeltaELL()(labels, model(x))
    # no assertion inside a compiled step: the loss is NaN, not silently wrong
    assert np.isnan(model.fit(x, labels, epochs=1, verbose=0).history["loss"][0])
    if keras.backend.backend() == "tensorflow":  # validate=True: an assertion names the labels
        model.compile(keras.optimizers.Adam(1e-2), loss=kd.SoftmaxDeltaELL(validate=True))
        with pytest.raises(Exception, match=r"outside 0\.\.2"):
            model.fit(x, labels, epochs=1, verbose=0)
    model = keras.Sequential([keras.Input((2,)), kd.DenseDVI(4, "relu", regularizer=prior), kd.DenseDVI(3, regularizer=prior)])
    model.compile(keras.optimizers.Adam(1e-2), loss=kd.SoftmaxDeltaELL())
    assert np.isfinite(model.fit(x, labels - 1, epochs=1, verbose=0).history["loss"][0])


@pytest.mark.parametrize("where", ["dense_between", "batch_norm_between", "dropout_between", "dense_head",
                                   "dense_after_flatten"])
def test_plain_keras_layers_after_a_keras_dvi_layer_are_refused(where):
    """A plain layer treats the packed mean and covariance rows as numbers (between keras-dvi
    layers it once trained silently: variances -0.07, -0.12 in the issue that found this; after
    the last one, `model(x)` and `keras_dvi.predict` returned its garbage). Building the model
    warns between keras-dvi layers; calling it in any way (eagerly, `predict`,
    `keras_dvi.predict`, `fit`, on every backend) is refused with an error that names the plain
    layer and the keras-dvi layer it reads, before Keras names any keras-dvi layer's call."""
    x, y = _data(seed=8)
    prior = kd.EmpiricalBayesRegularizer(64)
    if where == "dense_after_flatten":
        x = np.random.default_rng(8).normal(size=(64, 6, 6, 1)).astype("float32")
        plain = keras.layers.Dense(2)
        layers = [keras.Input((6, 6, 1)), kd.Conv2DDVI(3, 3, regularizer=prior), kd.FlattenDVI(), plain]
    elif where == "dense_head":
        plain = keras.layers.Dense(2)
        layers = [keras.Input((2,)), kd.DenseDiagDVI(8, "relu", regularizer=prior), kd.DenseDVI(1, regularizer=prior),
                  plain]
    else:
        plain = {"dense_between": keras.layers.Dense(8), "batch_norm_between": keras.layers.BatchNormalization(),
                 "dropout_between": keras.layers.Dropout(0.1)}[where]
        layers = [keras.Input((2,)), kd.DenseDiagDVI(8, "relu", regularizer=prior), plain,
                  kd.DenseDVI(2, regularizer=prior)]
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        model = keras.Sequential(layers)
    built = [str(w.message) for w in record if "that no keras-dvi layer produced" in str(w.message)]
    assert len(built) == (1 if where.endswith("between") else 0)
    if built:
        assert f"{type(plain).__name__}" in built[0] and "Remove the plain layer" in built[0]
    producer = layers[-2] if not where.endswith("between") else layers[1]
    message = (rf"Layer {type(plain).__name__} '{plain.name}' of model '{model.name}' reads the output of "
               rf"{type(producer).__name__} '{producer.name}'")
    for call in (lambda: model(x), lambda: model(x, training=True), lambda: model.predict(x, verbose=0)):
        with pytest.raises(ValueError, match=message) as error:
            call()
        assert "Conv2DDVI.call" not in str(error.value) and "DenseDiagDVI.call" not in str(error.value)
    model.compile(keras.optimizers.Adam(1e-2), loss=kd.HeteroscedasticELL())
    with pytest.raises(ValueError, match=message):
        kd.predict(model, x)
    with pytest.raises(ValueError, match=message):
        model.fit(x, y, epochs=1, verbose=0)


def test_a_subclassed_model_with_a_plain_head_is_refused_at_run_time():
    """Without a symbolic graph the plain layer cannot be named; the negative "variances" a
    row-mixing layer produces are refused where the loss reads them (eager: an error; inside
    `fit`, which holds no assertion, the loss is NaN, not a silently wrong model; with
    `validate=True`, TensorFlow's `fit` raises the same error)."""
    x, y = _data(seed=8)
    prior = kd.EmpiricalBayesRegularizer(64)

    class PlainHead(keras.Model):
        def __init__(self):
            super().__init__()
            self.body = kd.DenseDVI(1, regularizer=prior)
            self.head = keras.layers.Dense(2, bias_initializer="ones")  # "variances" of -1 - ...

        def call(self, inputs, training=None):
            return -self.head(self.body(inputs, training=training))

    model = PlainHead()
    model.compile(keras.optimizers.Adam(1e-2), loss=kd.HeteroscedasticELL())
    with pytest.raises(ValueError, match="sits between keras-dvi layers"):
        kd.HeteroscedasticELL()(y, model(x))
    assert np.isnan(model.fit(x, y, epochs=1, verbose=0).history["loss"][0])
    if keras.backend.backend() == "tensorflow":
        model = PlainHead()  # (the NaN loss made the weights NaN)
        model.compile(keras.optimizers.Adam(1e-2), loss=kd.HeteroscedasticELL(validate=True))
        with pytest.raises(Exception, match="sits between keras-dvi layers or after the last one"):
            model.fit(x, y, epochs=1, verbose=0)


def test_a_nested_keras_dvi_model_keeps_working():
    """A keras-dvi model used as a layer: its output loses the stamp (Keras rebuilds it), so
    building warns, but the network computes what the flat network computes and round-trips."""
    prior = kd.EmpiricalBayesRegularizer(64)
    body = keras.Sequential([keras.Input((2,)), kd.DenseDiagDVI(8, "relu", regularizer=prior)])
    with pytest.warns(UserWarning, match="nested keras-dvi model"):
        model = keras.Sequential([keras.Input((2,)), body, kd.DenseDVI(2, regularizer=prior)])
    flat = keras.Sequential([keras.Input((2,)), body.layers[0], model.layers[-1]])
    x, _ = _data(seed=10)
    np.testing.assert_allclose(keras.ops.convert_to_numpy(model(x)), keras.ops.convert_to_numpy(flat(x)), rtol=1e-6)


def test_global_inducing_layers_take_the_kl_schedule_from_their_prior():
    """`GlobalInducingDense`'s prior carries the KL weight and warm-up as every keras-dvi prior
    does (and later layers inherit it)."""
    x, y = _data(seed=14)
    prior = kd.NealPrior(num_train=64, kl_weight=0.5, kl_warmup_steps=4)
    model = keras.Sequential([keras.Input((2,)),
                              kd.GlobalInducingDense(4, "relu", num_inducing=5, regularizer=prior, num_samples=2),
                              kd.GlobalInducingDense(1, output_layer=True), kd.SampledHomoscedasticNoise()])
    assert model.layers[1].regularizer is prior
    model.compile(keras.optimizers.SGD(0.0), loss=kd.SampledHeteroscedasticELL())
    history = model.fit(x, y, batch_size=64, epochs=5, shuffle=False, verbose=0).history
    weight = 0.5 * np.minimum(np.arange(1, 6) / 4.0, 1.0)
    np.testing.assert_allclose(history["loss"], np.array(history["nll"]) + weight * np.array(history["kl"]), rtol=1e-5)
    logs = model.evaluate(x, y, batch_size=64, verbose=0, return_dict=True)  # evaluation: the full weight
    np.testing.assert_allclose(logs["loss"], logs["nll"] + 0.5 * logs["kl"], rtol=1e-5)


def _fit_messages(model, x, y, **fit_args):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        model.fit(x, y, verbose=0, **fit_args)
    return [str(w.message) for w in record]


def _misuse_free(messages):
    return not [m for m in messages if "keras-dvi" in m or "num_train" in m]


def _custom_mse(y_true, y_pred):  # a custom loss that does not read the moments with `unpack`
    return keras.ops.mean(keras.ops.square(keras.ops.reshape(y_true, (-1, 1, 1)) - y_pred), axis=(1, 2))


@pytest.mark.keras_lazy_optimizer
@pytest.mark.parametrize("run_eagerly", [False, True])
def test_a_custom_loss_that_scores_no_keras_dvi_loss_warns_once(run_eagerly):
    """A loss that is not keras-dvi's reads the packed tensor as a prediction (it once logged
    `nll: 0`); a custom one may be legitimate (reading the moments with `unpack`), so it warns."""
    x, y = _data(seed=11)
    prior = kd.EmpiricalBayesRegularizer(640)
    model = keras.Sequential([keras.Input((2,)), kd.DenseDVI(8, "relu", regularizer=prior), kd.DenseDVI(1, regularizer=prior)])
    model.compile(keras.optimizers.Adam(1e-3), loss=_custom_mse, run_eagerly=run_eagerly)
    messages = [m for m in _fit_messages(model, x, y, epochs=2, batch_size=32) if "no keras-dvi loss scored" in m]
    assert len(messages) == 1 and "HeteroscedasticELL" in messages[0]
    right = keras.Sequential([keras.Input((2,))] + _layers(prior))
    right.compile(keras.optimizers.Adam(1e-3), loss=kd.HeteroscedasticELL(), metrics=[kd.metrics.PredictiveMSE()],
                  run_eagerly=run_eagerly)
    assert _misuse_free(_fit_messages(right, x, y, epochs=2, batch_size=32, validation_split=0.25))
    right.predict(x, verbose=0)  # an open inference step is no misuse either
    assert _misuse_free(_fit_messages(right, x, y, epochs=1, batch_size=32))


def test_a_loss_keras_cannot_serialise_is_not_mistaken_for_a_keras_loss():
    """The compile check serialises what it cannot recognise; a lambda without source code
    (defined in a console) made that raise `OSError` inside `fit`. It is a custom loss."""
    x, y = _data(seed=20)
    prior = kd.EmpiricalBayesRegularizer(640)
    model = keras.Sequential([keras.Input((2,))] + _layers(prior))
    loss = eval("lambda y_true, y_pred: keras.ops.mean(keras.ops.square(y_pred), axis=(1, 2))")  # no source
    model.compile(keras.optimizers.Adam(1e-3), loss=loss)
    messages = _fit_messages(model, x, y, epochs=1, batch_size=32)
    assert [m for m in messages if "no keras-dvi loss scored" in m]


def _classifier(prior, classes=3):
    return keras.Sequential([keras.Input((2,)), kd.DenseDiagDVI(8, "relu", regularizer=prior),
                             kd.DenseDVI(classes, regularizer=prior)])


@pytest.mark.parametrize("loss, metrics, classes, run_eagerly", [
    ("mse", None, 1, False),  # once trained on the packed tensor, logging `nll: 0`
    ("mse", None, 3, True),  # once a raw error: Incompatible shapes [64] vs. [64,3,2]
    (keras.losses.MeanSquaredError(), None, 3, False),
    ("softmax_delta", ["mae"], 1, False),  # silently scored the packed rows
    ("softmax_delta", ["accuracy"], 3, False),  # once a raw error
    ("softmax_delta", [keras.metrics.SparseCategoricalAccuracy()], 3, True),
])
def test_keras_losses_and_metrics_on_a_keras_dvi_output_are_refused(loss, metrics, classes, run_eagerly):
    """Keras' own losses and metrics read the packed output as a prediction: refused at the
    first step of `fit` (or `evaluate`), naming the argument and keras-dvi's replacement."""
    x, _ = _data(seed=15)
    labels = np.arange(len(x)) % max(classes, 2) if classes > 1 else np.zeros(len(x), "int64")
    model = _classifier(kd.EmpiricalBayesRegularizer(640), classes)
    loss = kd.SoftmaxDeltaELL() if loss == "softmax_delta" else loss
    model.compile(keras.optimizers.Adam(1e-3), loss=loss, metrics=metrics, run_eagerly=run_eagerly)
    argument = "loss=" if metrics is None else "metrics="
    with pytest.raises(ValueError, match=rf"model.compile\({argument}.*keras-dvi output of layer DenseDVI"):
        model.fit(x, labels, epochs=1, batch_size=32, verbose=0)
    with pytest.raises(ValueError, match=r"keras_dvi.metrics.PredictiveMSE\(\)"):
        model.evaluate(x, labels, verbose=0)


def test_keras_losses_stay_welcome_on_plain_outputs_and_keras_dvi_metrics_on_keras_dvi_outputs():
    """A model with a keras-dvi output and a plain one: each gets its own kind of loss."""
    x, y = _data(seed=16)
    labels = (np.arange(len(x)) % 3).astype("int64")
    inputs = keras.Input((2,), name="x")
    bayes = kd.DenseDVI(3, regularizer=kd.EmpiricalBayesRegularizer(640), name="bayes")(
        kd.DenseDiagDVI(8, "relu", regularizer=kd.EmpiricalBayesRegularizer(640))(inputs))
    plain = keras.layers.Dense(1, name="plain")(keras.layers.Dense(8, "relu")(inputs))
    model = keras.Model(inputs, {"bayes": bayes, "plain": plain})
    model.compile(keras.optimizers.Adam(1e-3), loss={"bayes": kd.SoftmaxDeltaELL(), "plain": "mse"},
                  metrics={"bayes": [kd.metrics.MeanLogitAccuracy()], "plain": ["mae"]})
    assert _misuse_free(_fit_messages(model, x, {"bayes": labels, "plain": y}, epochs=1, batch_size=32))
    model.compile(keras.optimizers.Adam(1e-3), loss={"bayes": "sparse_categorical_crossentropy", "plain": "mse"})
    with pytest.raises(ValueError, match=r"loss='sparse_categorical_crossentropy'.*layer DenseDVI 'bayes'"):
        model.fit(x, {"bayes": labels, "plain": y}, epochs=1, batch_size=32, verbose=0)
    model.compile(keras.optimizers.Adam(1e-3), loss={"bayes": kd.SoftmaxDeltaELL(), "plain": "mse"},
                  metrics={"bayes": ["accuracy"], "plain": ["mae"]})
    with pytest.raises(ValueError, match=r"metrics=\['accuracy'\].*layer DenseDVI 'bayes'"):
        model.fit(x, {"bayes": labels, "plain": y}, epochs=1, batch_size=32, verbose=0)


class SubclassedWith(keras.Model):
    """A subclassed network with an optional plain layer between its keras-dvi layers."""

    def __init__(self, prior, between=None, body=None):
        super().__init__()
        self.body = body or kd.DenseDiagDVI(8, "relu", regularizer=prior)
        self.between = between
        self.head = kd.DenseDVI(2, regularizer=prior)

    def call(self, inputs, training=None):
        hidden = self.body(inputs, training=training)
        if self.between is not None:
            hidden = self.between(hidden, training=training)
        return self.head(hidden, training=training)


def test_plain_layers_between_keras_dvi_layers_of_a_subclassed_model_warn():
    """No symbolic build stamps a subclassed model's tensors: Dropout between its keras-dvi
    layers trained silently. Now the first training pass warns; the plain network, and a
    nested keras-dvi model as its body, do not."""
    x, y = _data(seed=17)
    prior = kd.EmpiricalBayesRegularizer(640)
    model = SubclassedWith(prior, keras.layers.Dropout(0.2))
    model.compile(keras.optimizers.Adam(1e-3), loss=kd.HeteroscedasticELL())
    messages = [m for m in _fit_messages(model, x, y, epochs=2, batch_size=32) if "no keras-dvi layer of this" in m]
    assert len(messages) == 1 and "DenseDVI" in messages[0] and "Dropout" in messages[0]
    body = keras.Sequential([keras.Input((2,)), kd.DenseDiagDVI(8, "relu", regularizer=prior)])
    for right in (SubclassedWith(prior), SubclassedWith(prior, body=body)):
        right.compile(keras.optimizers.Adam(1e-3), loss=kd.HeteroscedasticELL())
        assert _misuse_free(_fit_messages(right, x, y, epochs=2, batch_size=32))


def test_a_keras_loss_on_a_subclassed_keras_dvi_model_warns():
    """A subclassed model's outputs cannot be traced to their layers: a Keras loss warns."""
    x, y = _data(seed=18)
    model = SubclassedWith(kd.EmpiricalBayesRegularizer(640))
    model.compile(keras.optimizers.Adam(1e-3), loss="mse")
    with pytest.warns(UserWarning, match=r"model.compile\(loss='mse'\).*subclassed"):
        try:
            model.fit(x, y, epochs=1, batch_size=32, verbose=0)
        except Exception:  # noqa: BLE001 - Keras' own shape error may follow the warning
            pass


def test_flatten_between_keras_dvi_layers_is_refused_or_warned():
    """`Flatten` turned packed moments into 2-D "data" for the next keras-dvi layer, silently. In
    a `Sequential` model it is refused by name; in a subclassed model (no symbolic graph to read)
    the first training step warns that two keras-dvi layers take data inputs."""
    x, y = _data(seed=12)
    prior = kd.EmpiricalBayesRegularizer(640)
    model = keras.Sequential([keras.Input((2,)), kd.DenseDiagDVI(8, "relu", regularizer=prior),
                              keras.layers.Flatten(), kd.DenseDVI(2, regularizer=prior)])
    model.compile(keras.optimizers.Adam(1e-3), loss=kd.HeteroscedasticELL())
    with pytest.raises(ValueError, match="Layer Flatten 'flatten.*' of model .* reads the output of DenseDiagDVI"):
        model.fit(x, y, epochs=1, batch_size=32, verbose=0)

    class Flattened(keras.Model):
        def __init__(self):
            super().__init__()
            self.body = kd.DenseDiagDVI(8, "relu", regularizer=prior)
            self.flatten = keras.layers.Flatten()
            self.head = kd.DenseDVI(2, regularizer=prior)

        def call(self, inputs, training=None):
            return self.head(self.flatten(self.body(inputs, training=training)), training=training)

    subclassed = Flattened()
    subclassed.compile(keras.optimizers.Adam(1e-3), loss=kd.HeteroscedasticELL())
    messages = [m for m in _fit_messages(subclassed, x, y, epochs=2, batch_size=32) if "both take data" in m]
    assert len(messages) == 1 and "Flatten" in messages[0]


def _objective_parts(model, x, y, layers, num_train):
    """`(logged loss, nll, kl)` of `evaluate` and the layers' KL / N, computed independently."""
    logs = model.evaluate(x, y, verbose=0, return_dict=True)
    kl = sum(float(keras.ops.convert_to_numpy(layer.kl_divergence())) for layer in layers) / num_train
    return logs["loss"], logs["nll"], logs["kl"], kl


def test_a_shared_layer_counts_its_kl_once_and_steps_its_warm_up_once():
    """A layer called on two inputs (a Siamese tower) draws its weights once per pass: its KL
    entered the loss once per call (loss = nll + KL + the tower's KL again), and its warm-up
    advanced twice per step."""
    rng = np.random.default_rng(21)
    x = [rng.normal(size=(64, 4)).astype("float32"), rng.normal(size=(64, 4)).astype("float32")]
    y = rng.normal(size=(64,)).astype("float32")
    prior = kd.EmpiricalBayesRegularizer(64, kl_weight=1.0, kl_warmup_steps=10)
    first, second = keras.Input((4,)), keras.Input((4,))
    tower, head = kd.DenseDiagDVI(6, "relu", regularizer=prior), kd.DenseDVI(2, regularizer=prior)
    model = keras.Model([first, second], head(kd.ConcatenateDVI()([tower(first), tower(second)])))
    model.compile(keras.optimizers.Adam(1e-3), loss=kd.HeteroscedasticELL())
    messages = _fit_messages(model, x, y, epochs=3, batch_size=16)
    assert _misuse_free(messages), messages
    assert float(keras.ops.convert_to_numpy(tower.kl_step)) == 12 == float(keras.ops.convert_to_numpy(head.kl_step))
    loss, nll, logged_kl, kl = _objective_parts(model, x, y, [tower, head], 64)
    np.testing.assert_allclose([loss, logged_kl], [nll + kl, kl], rtol=1e-5)


def test_branches_on_several_inputs_log_one_nll_and_kl():
    """Two keras-dvi layers on two inputs, joined: each was its network's first layer, with a
    tracker of its own; the second one's record replaced the first's, whose KL the logged `kl`
    left out, with warnings that two layers take data and that no loss scored a step."""
    rng = np.random.default_rng(22)
    x = [rng.normal(size=(64, 4)).astype("float32"), rng.normal(size=(64, 3)).astype("float32")]
    y = rng.normal(size=(64,)).astype("float32")
    prior = kd.EmpiricalBayesRegularizer(64, kl_weight=1.0)
    first, second = keras.Input((4,)), keras.Input((3,))
    layers = [kd.DenseDiagDVI(6, "relu", regularizer=prior), kd.DenseDiagDVI(5, "relu", regularizer=prior),
              kd.DenseDVI(2, regularizer=prior)]
    model = keras.Model([first, second], layers[2](kd.ConcatenateDVI()([layers[0](first), layers[1](second)])))
    model.compile(keras.optimizers.Adam(1e-3), loss=kd.HeteroscedasticELL())
    assert [metric.name for metric in model.metrics].count("elbo") == 1
    messages = _fit_messages(model, x, y, epochs=2, batch_size=16)
    assert _misuse_free(messages), messages
    assert sum(layer.elbo_tracker is not None for layer in layers) == 1
    loss, nll, logged_kl, kl = _objective_parts(model, x, y, layers, 64)
    np.testing.assert_allclose([loss, logged_kl], [nll + kl, kl], rtol=1e-5)


def test_heads_of_separate_outputs_on_the_same_data_log_one_nll_and_kl():
    """Two keras-dvi heads reading the same data, one per output, never meeting (a Bayesian last
    layer per head, `convert(..., last_layers=2)`): each held a tracker, with the warnings and
    the logged `kl` of the multi-input case; they now share the first one's."""
    rng = np.random.default_rng(23)
    x = rng.normal(size=(64, 4)).astype("float32")
    y = [rng.normal(size=(64,)).astype("float32"), rng.normal(size=(64,)).astype("float32")]
    prior = kd.EmpiricalBayesRegularizer(64, kl_weight=1.0)
    inputs = keras.Input((4,))
    features = keras.layers.Dense(6, activation="relu")(inputs)  # a plain body
    heads = [kd.DenseDVI(2, regularizer=prior), kd.DenseDVI(2, regularizer=prior)]
    model = keras.Model(inputs, [head(features) for head in heads])
    model.compile(keras.optimizers.Adam(1e-3), loss=[kd.HeteroscedasticELL(), kd.HeteroscedasticELL()])
    assert [metric.name for metric in model.metrics].count("elbo") == 1
    messages = _fit_messages(model, x, y, epochs=2, batch_size=16)
    assert _misuse_free(messages), messages
    loss, nll, logged_kl, kl = _objective_parts(model, x, y, heads, 64)
    np.testing.assert_allclose([loss, logged_kl], [nll + kl, kl], rtol=1e-5)


def test_num_train_is_checked_against_the_batch():
    """`num_train` set to the batch size went undetected (KL 14.4 instead of 2.1)."""
    x, y = _data(seed=13)

    def model(num_train):
        prior = kd.EmpiricalBayesRegularizer(num_train)
        m = keras.Sequential([keras.Input((2,))] + _layers(prior))
        m.compile(keras.optimizers.Adam(1e-3), loss=kd.HeteroscedasticELL())
        return m

    with pytest.raises(Exception, match=r"batch of 32 rows but `num_train` is 16.*whole data set"):
        model(16).fit(x, y, epochs=1, batch_size=32, verbose=0)
    messages = [m for m in _fit_messages(model(32), x, y, epochs=1, batch_size=32) if "num_train" in m]
    assert len(messages) == 1 and "`num_train` is also 32" in messages[0] and "len(x_train)" in messages[0]
    assert _misuse_free(_fit_messages(model(len(x)), x, y, epochs=1, batch_size=32))
    # A full batch is the whole data set: legitimate, no warning (the paper's full-batch
    # global inducing recipe warned on every run).
    assert _misuse_free(_fit_messages(model(len(x)), x, y, epochs=2, batch_size=len(x)))
    # `fit` with `steps_per_epoch=1` (a part of the data an epoch) or `train_on_batch`, cannot tell.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(32).train_on_batch(x[:32], y[:32])
    for messages in (_fit_messages(model(32), x, y, batch_size=32, epochs=1, steps_per_epoch=1),
                     [str(w.message) for w in caught]):
        messages = [m for m in messages if "num_train" in m]
        assert len(messages) == 1 and "If the data set has more rows than one batch" in messages[0]


def test_no_keras_dvi_module_holds_state():
    """The objective's hand-off once lived in a module-level thread-local: now every piece of
    state belongs to a layer, a metric, a loss or the model being stepped. No module of the
    package holds a mutable object (constants are named in capitals)."""
    import importlib
    import pkgutil
    import re
    import threading

    found = []
    for info in pkgutil.walk_packages(kd.__path__, prefix="keras_dvi."):
        if info.name == "keras_dvi.__main__":
            continue
        module = importlib.import_module(info.name)
        for name, value in vars(module).items():
            constant = name.startswith("__") or re.fullmatch(r"_?[A-Z][A-Z0-9_]*", name)
            if isinstance(value, threading.local) or (isinstance(value, (list, dict, set, bytearray)) and not constant):
                found.append(f"{info.name}.{name}")
    assert found == []
    x, y = _data(seed=19)
    model = _model("sequential", kd.EmpiricalBayesRegularizer(64))
    model.compile(keras.optimizers.Adam(1e-3), loss=kd.HeteroscedasticELL())
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    record = getattr(model, kd.objective.RECORD)  # the step's hand-off lives on the model, closed
    assert not record.open and record.kl == [] and record.produced == []


def _wine(seed=0):
    from sklearn.datasets import load_wine

    x, y = load_wine(return_X_y=True)
    order = np.random.default_rng(seed).permutation(len(x))
    x = ((x - x.mean(0)) / x.std(0)).astype("float32")
    return x[order[:124]], y[order[:124]].astype("int32")


def _wine_classifier(prior, method="jankowiak"):
    model = keras.Sequential([keras.Input((13,)), kd.DenseDiagDVI(100, "relu", regularizer=prior),
                              kd.DenseDiagDVI(100, "relu", regularizer=prior), kd.DenseDVI(3, regularizer=prior)])
    model.compile(keras.optimizers.Adam(1e-3), loss=kd.SoftmaxDeltaELL(method=method))
    return model


def test_prediction_information_against_its_definition():
    """`elbo_tracker.prediction_information` is the mutual information between the input and the
    predicted class over a batch: scipy's entropies of the average and of each prediction."""
    from scipy import stats

    rng = np.random.default_rng(3)
    p = rng.dirichlet(np.ones(4) * 0.5, size=32)
    information, spread = (float(to_numpy(v)) for v in elbo_tracker.prediction_information(keras.ops.convert_to_tensor(p)))
    np.testing.assert_allclose(spread, stats.entropy(p.mean(0)), rtol=1e-5)
    np.testing.assert_allclose(information, stats.entropy(p.mean(0)) - np.mean(stats.entropy(p.T)), rtol=1e-4)
    same = np.tile(p[:1], (32, 1))  # the same prediction for every input: no information
    assert abs(float(to_numpy(elbo_tracker.prediction_information(keras.ops.convert_to_tensor(same))[0]))) < 1e-6
    one_hot = np.eye(4)[np.arange(32) % 4]  # confident and spread over the classes: log 4
    np.testing.assert_allclose(float(to_numpy(elbo_tracker.prediction_information(keras.ops.convert_to_tensor(one_hot))[0])),
                               np.log(4), rtol=1e-5)


def test_a_classifier_collapsed_to_its_prior_is_named():
    """scikit-learn's wine (124 training rows, about 12,000 weights) under the full ELBO
    (`kl_weight=1`, the delta method): after the KL warm-up the ELBO holds the predictions near
    the class frequencies for every input. `fit` says so once, naming the network and the
    fixes; the defaults it recommends (`kl_weight="auto"`, Jankowiak's bound), which train, do
    not warn, and neither does a regression network."""
    x, y = _wine()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _wine_classifier(kd.EmpiricalBayesRegularizer(len(x), kl_weight=1.0), method="delta").fit(
            x, y, epochs=100, batch_size=64, verbose=0)
    collapsed = [str(w.message) for w in record if "collapsed to its prior" in str(w.message)]
    assert len(collapsed) == 1, collapsed
    assert "'dense_diag_dvi" in collapsed[0] and "kl_weight='auto'" in collapsed[0] and "Bayesian last layer" in collapsed[0]
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        tempered = _wine_classifier(kd.EmpiricalBayesRegularizer(len(x)))
        tempered.fit(x, y, epochs=100, batch_size=64, verbose=0)
        regression = _model("sequential", kd.EmpiricalBayesRegularizer(64))
        _frozen_fit(regression, *_data(seed=5), epochs=3)
    assert not [w for w in record if "collapsed" in str(w.message)]
    assert (kd.predict(tempered, x)["label"] == y).mean() > 0.9
