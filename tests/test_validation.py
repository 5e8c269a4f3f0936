"""Bad input values get clear errors naming the argument (eager, and graph with validate=True)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_dvi import DenseDiagDVI, DenseDVI, HeteroscedasticELL, SkipDVI, SoftmaxDeltaELL, predict_samples
from keras_dvi.packing import pack


def _pair(k=3, batch=2):
    rng = np.random.default_rng(0)
    g = rng.normal(size=(batch, k, k))
    return rng.normal(size=(batch, k)).astype("float32"), (g @ np.swapaxes(g, 1, 2)).astype("float32")


@pytest.mark.parametrize("layer_cls", [DenseDVI, DenseDiagDVI])
def test_non_finite_inputs_are_refused(layer_cls):
    x = np.zeros((2, 3), "float32")
    x[1, 2] = np.nan
    with pytest.raises(ValueError, match=r"`inputs` contains 1 NaN or infinite"):
        layer_cls(2)(x)
    mean, cov = _pair()
    cov[0, 1, 1] = np.inf
    with pytest.raises(ValueError, match="`inputs` contains"):
        layer_cls(2)((mean, cov))


def test_negative_variances_are_refused():
    mean, cov = _pair()
    var = np.diagonal(cov, axis1=1, axis2=2).copy()
    var[0, 0] = -1e-3
    with pytest.raises(ValueError, match="negative variances"):
        DenseDVI(2)((mean, var))
    cov[1, 2, 2] = -0.5
    with pytest.raises(ValueError, match="negative variances"):
        SkipDVI()(pack(mean, cov))


def test_asymmetric_covariance_is_refused():
    mean, cov = _pair()
    cov[0, 0, 1] += 0.1
    with pytest.raises(ValueError, match="symmetric"):
        DenseDVI(2)((mean, cov))
    cov[0, 0, 1] -= 0.1
    cov[0, 0, 1] += 1e-7 * np.abs(cov).max()  # rounding-level asymmetry is fine
    DenseDVI(2)((mean, cov))


def test_non_square_covariance_is_refused():
    mean, cov = _pair()
    with pytest.raises(ValueError, match="covariance"):
        DenseDVI(2)((mean, cov[:, :, :2]))


def test_losses_refuse_non_finite_targets_and_outputs():
    y_pred = pack(np.zeros((3, 2), "float32"), np.ones((3, 2), "float32"))
    with pytest.raises(ValueError, match="y_true"):
        HeteroscedasticELL()(np.array([0.0, np.nan, 1.0]), y_pred)
    bad_pred = pack(np.array([[0.0, np.inf]] * 3, "float32"), np.ones((3, 2), "float32"))
    with pytest.raises(ValueError, match="y_pred"):
        SoftmaxDeltaELL()(np.array([0, 1, 1]), bad_pred)
    with pytest.raises(ValueError, match="`x`"):
        predict_samples(keras.Sequential([keras.Input((2,)), DenseDVI(1)]), np.array([[np.nan, 0.0]], "float32"), 3)


@pytest.mark.parametrize("task", ["regression", "classification"])
def test_fit_refuses_a_moment_loss_on_weight_samples_and_a_sampled_loss_on_moments(task):
    """A Monte Carlo model outputs weight samples `(batch, samples, units)`, a DVI model packed
    moments `(batch, 2 or units + 1, units)`: with 2 samples (or `units + 1`) the shapes cannot
    tell them apart, and the wrong loss trained on NaN or on the wrong numbers. `fit` refuses
    either pairing, naming the loss to use, and the moment metrics on samples."""
    import keras_dvi as kd

    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 3)).astype("float32")
    y = rng.normal(size=16).astype("float32") if task == "regression" else rng.integers(0, 2, 16)
    moment_loss, sampled_loss = (("HeteroscedasticELL", "SampledHeteroscedasticELL") if task == "regression"
                                 else ("SoftmaxDeltaELL", "SampledSoftmaxELL"))
    prior = kd.EmpiricalBayesRegularizer(num_train=16)
    for layers, loss, fix in [
        ([kd.DenseMCVI(4, "relu", num_samples=2, regularizer=prior), kd.DenseMCVI(2, regularizer=prior)],
         moment_loss, sampled_loss),
        ([kd.DenseDVI(4, "relu", regularizer=prior), kd.DenseDVI(2, regularizer=prior)], sampled_loss, moment_loss),
    ]:
        model = keras.Sequential([keras.Input((3,)), *layers])
        model.compile("adam", loss=getattr(kd, loss)())
        with pytest.raises(ValueError, match=rf"{loss} reads .* keras_dvi\.{fix}\(\)"):
            model.fit(x, y, epochs=1, batch_size=8, verbose=0)
    metric = kd.metrics.PredictiveMSE() if task == "regression" else kd.metrics.MeanLogitAccuracy()
    model = keras.Sequential([keras.Input((3,)), kd.DenseMCVI(2, num_samples=2, regularizer=prior)])
    model.compile("adam", loss=getattr(kd, sampled_loss)(), metrics=[metric])
    with pytest.raises(ValueError, match=rf"{type(metric).__name__} reads .* keras_dvi\.predict"):
        model.fit(x, y, epochs=1, batch_size=8, verbose=0)


@pytest.mark.tensorflow_only  # graph-mode checks are TensorFlow assertions
def test_graph_mode_checks_are_opt_in():
    layer = DenseDVI(2, validate=True)
    layer.build((None, 3))
    strict = tf.function(lambda x: layer(x))
    with pytest.raises(tf.errors.InvalidArgumentError, match="inputs"):
        strict(tf.constant([[0.0, np.nan, 1.0]]))
    loose_layer = DenseDVI(2)
    loose_layer.build((None, 3))
    loose = tf.function(lambda x: loose_layer(x))
    assert np.isnan(loose(tf.constant([[0.0, np.nan, 1.0]])).numpy()).any()  # no check: NaN flows


@pytest.mark.tensorflow_only  # graph-mode checks are TensorFlow assertions
def test_validate_flag_in_fit():
    x = np.random.default_rng(0).normal(size=(8, 2)).astype("float32")
    y = np.zeros(8, "float32")
    y[3] = np.nan
    model = keras.Sequential([keras.Input((2,)), DenseDVI(2)])
    model.compile("adam", loss=HeteroscedasticELL(validate=True))
    with pytest.raises(tf.errors.InvalidArgumentError, match="y_true"):
        model.fit(x, y, verbose=0)
    assert HeteroscedasticELL.from_config(HeteroscedasticELL(validate=True).get_config()).validate
    assert DenseDVI.from_config(DenseDVI(2, validate=True).get_config()).validate


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_mixed_precision_computes_moments_in_float32_and_trains(policy):
    from keras_dvi import EmpiricalBayesRegularizer, HomoscedasticNoise, unpack

    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(policy)
    try:
        rng = np.random.default_rng(0)
        x = rng.normal(size=(64, 2)).astype("float32")
        y = (x[:, 0] - x[:, 1]).astype("float32")
        prior = EmpiricalBayesRegularizer(64)
        model = keras.Sequential(
            [keras.Input((2,)), DenseDVI(16, "relu", regularizer=prior), DenseDiagDVI(16, "relu", regularizer=prior),
             SkipDVI(regularizer=prior), DenseDVI(1, regularizer=prior), HomoscedasticNoise()]
        )
        assert model.layers[0].moment_dtype == "float32"
        out = model(x)
        assert keras.backend.standardize_dtype(out.dtype) == "float32"
        model.compile(keras.optimizers.Adam(1e-2), loss=HeteroscedasticELL())
        history = model.fit(x, y, epochs=5, batch_size=16, verbose=0).history
        # The KL weight rises over the run (auto warm-up): the fit term shows the learning.
        assert np.isfinite(history["loss"]).all() and history["nll"][-1] < history["nll"][0]
        # Same numbers as a float32 model with the same weights.
        keras.config.set_dtype_policy("float32")
        clone = keras.Sequential.from_config(model.get_config())
        clone.set_weights(model.get_weights())
        np.testing.assert_allclose(unpack(clone(x))[0], unpack(model(x))[0], rtol=1e-5, atol=1e-5)
    finally:
        keras.config.set_dtype_policy(previous)


def _traced_step_asserts(validate):
    """The `Assert` ops in a traced TensorFlow training step (forward, loss, gradients) of a
    small Bayesian CNN whose layers and loss have `validate`."""
    from keras_dvi import Conv2DDVI, EmpiricalBayesRegularizer, FlattenDVI, MaxPooling2DDVI

    prior = EmpiricalBayesRegularizer(num_train=64)
    model = keras.Sequential([
        keras.Input((6, 6, 1)),
        Conv2DDVI(3, 3, padding="same", regularizer=prior, validate=validate),
        MaxPooling2DDVI(2, activation="relu"),
        Conv2DDVI(4, 3, padding="same", regularizer=prior, validate=validate),
        FlattenDVI(),
        DenseDiagDVI(5, activation="relu", regularizer=prior, validate=validate),
        DenseDVI(3, regularizer=prior, validate=validate),
    ])
    loss = SoftmaxDeltaELL(validate=validate)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            value = loss(y, model(x, training=True)) + sum(model.losses)
        return value, tape.gradient(value, model.trainable_variables)

    spec = (tf.TensorSpec((None, 6, 6, 1)), tf.TensorSpec((None,), tf.int32))
    graph = step.get_concrete_function(*spec).graph
    return sum(op.type == "Assert" for op in graph.get_operations())


@pytest.mark.tensorflow_only  # counts TensorFlow graph ops
def test_a_compiled_training_step_holds_no_assertion():
    """Value checks run eagerly or under `validate=True`: a traced step (unknown batch size,
    as `fit` traces it) of the default network holds no `Assert` op; `validate=True` adds them."""
    assert _traced_step_asserts(validate=False) == 0
    assert _traced_step_asserts(validate=True) > 0
