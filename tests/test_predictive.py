"""Predictions: the predictive distributions of `keras_dvi.predictive` against Monte Carlo and
closed forms, their scores, the Keras metrics for packed outputs, and `keras_dvi.predict`."""

import keras
import numpy as np
import pytest
from scipy import stats

import keras_dvi
from keras_dvi import (
    DenseDVI,
    EmpiricalBayesRegularizer,
    HeteroscedasticELL,
    SoftmaxDeltaELL,
    predictive,
)
from keras_dvi.packing import pack
from tests.conftest import mc_gaussian, random_gaussian, reloaded, to_numpy


def test_regression_predictive_decomposition_against_monte_carlo():
    rng = np.random.default_rng(13)
    mean, cov = random_gaussian(rng, 3, 2, scale=0.2)
    y_pred = pack(mean, cov)
    moments = {k: to_numpy(v)[:, 0] for k, v in predictive.regression_moments(y_pred).items()}
    np.testing.assert_allclose(moments["variance"], moments["epistemic"] + moments["aleatoric"], rtol=1e-6)
    draws = mc_gaussian(rng, mean, cov, 400_000)
    y = draws[..., 0] + np.exp(0.5 * draws[..., 1]) * rng.normal(size=draws.shape[:2])
    np.testing.assert_allclose(moments["mean"], y.mean(1), atol=5 * (y.std(1) / np.sqrt(y.shape[1])).max())
    np.testing.assert_allclose(moments["variance"], y.var(1), rtol=0.02)
    np.testing.assert_allclose(moments["epistemic"], cov[:, 0, 0], rtol=1e-6)
    targets = rng.normal(size=3)
    lpd = to_numpy(predictive.log_predictive_density(y_pred, targets, y_scale=2.0))
    want = stats.norm.logpdf(targets, moments["mean"], np.sqrt(moments["variance"])) - np.log(2.0)
    np.testing.assert_allclose(lpd, want, rtol=1e-5)
    lower, upper = predictive.prediction_interval(y_pred, 0.9)
    np.testing.assert_allclose(to_numpy(upper)[:, 0] - moments["mean"], 1.6448536 * np.sqrt(moments["variance"]), rtol=1e-5)
    np.testing.assert_allclose(float(to_numpy(predictive.rmse(y_pred, moments["mean"] + 1.0, y_scale=3.0))), 3.0, rtol=1e-5)


def test_class_probabilities_are_valid_even_for_large_covariance():
    rng = np.random.default_rng(14)
    mean, cov = random_gaussian(rng, 50, 4, scale=25.0)
    for method in ("delta", "mc", "mean"):
        probs = to_numpy(predictive.class_probabilities(pack(mean, cov), method=method, seed=0))
        assert (probs >= 0).all()
        np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-5)
    # Small covariance: eq. 23 agrees with Monte Carlo.
    mean, cov = random_gaussian(rng, 5, 3, scale=0.02)
    delta = to_numpy(predictive.class_probabilities(pack(mean, cov), method="delta"))
    mc = to_numpy(predictive.class_probabilities(pack(mean, cov), method="mc", num_samples=100_000, seed=1))
    np.testing.assert_allclose(delta, mc, atol=2e-3)


def test_expected_calibration_error_by_hand():
    probs = np.array([[0.9, 0.1], [0.8, 0.2], [0.3, 0.7], [0.45, 0.55]])
    labels = np.array([0, 1, 1, 0])
    # Bins of width 0.5 (num_bins=2): confidences 0.9, 0.8, 0.7 -> bin 1; 0.55 -> bin 1 too.
    conf = probs.max(1)
    correct = (probs.argmax(1) == labels).astype(float)
    want = abs(np.sum(correct - conf)) / 4
    np.testing.assert_allclose(float(to_numpy(predictive.expected_calibration_error(probs, labels, num_bins=2))), want, rtol=1e-6)
    coverage = float(to_numpy(predictive.interval_coverage(pack(np.zeros((4, 2)), np.ones((4, 2)) * 1e-12), np.array([0.0, 0.5, 1.5, -3.0]), 0.5)))
    # Unit aleatoric variance (log-variance 0): the 50% interval is +-0.674.
    assert coverage == 0.5


def test_keras_metrics_for_packed_outputs(tmp_path):
    from keras_dvi import metrics

    rng = np.random.default_rng(15)
    x = rng.normal(size=(64, 2)).astype("float32")
    y = (x[:, 0] + 0.3 * rng.normal(size=64)).astype("float32")
    prior = EmpiricalBayesRegularizer(64)
    model = keras.Sequential([keras.Input((2,)), DenseDVI(8, "relu", regularizer=prior), DenseDVI(2, regularizer=prior)])
    model.compile(
        keras.optimizers.Adam(1e-2),
        loss=HeteroscedasticELL(),
        metrics=[metrics.PredictiveMSE(), metrics.PredictiveLogLikelihood()],
    )
    history = model.fit(x, y, epochs=2, batch_size=64, verbose=0, validation_data=(x, y)).history
    assert {"predictive_mse", "predictive_log_likelihood", "val_predictive_mse", "val_nll", "val_kl"} <= set(history)
    results = model.evaluate(x, y, batch_size=64, verbose=0, return_dict=True)
    y_pred = model.predict(x, verbose=0)
    np.testing.assert_allclose(results["predictive_mse"], float(to_numpy(predictive.rmse(y_pred, y))) ** 2, rtol=1e-5)
    np.testing.assert_allclose(results["predictive_log_likelihood"], to_numpy(predictive.log_predictive_density(y_pred, y)).mean(), rtol=1e-5)
    reloaded(model, tmp_path, "m")
    # Classification accuracy from the mean logits, integer and one-hot labels.
    logits = np.array([[2.0, 0.0, 0.0], [0.0, 0.0, 1.0], [0.0, 3.0, 0.0]], "float32")
    y_pred = pack(logits, np.ones((3, 3), "float32"))
    acc = metrics.MeanLogitAccuracy()
    acc.update_state(np.array([0, 2, 0]), y_pred)
    assert abs(float(acc.result()) - 2 / 3) < 1e-6
    acc.reset_state()
    acc.update_state(np.eye(3)[[0, 2, 1]], y_pred)
    assert float(acc.result()) == 1.0


def test_predictive_refuses_targets_of_the_wrong_shape():
    y_pred = pack(np.zeros((4, 2), "float32"), np.ones((4, 2), "float32"))
    with pytest.raises(ValueError, match="y_true"):
        predictive.log_predictive_density(y_pred, np.zeros((2, 2), "float32"))  # 4 values, 4 rows
    with pytest.raises(ValueError, match="y_true"):
        predictive.rmse(y_pred, np.zeros((4, 3), "float32"))


@pytest.mark.parametrize("scale, kl_bound", [(0.3, 0.002), (3.0, 0.03), (30.0, 0.08)])
def test_probit_class_probabilities_follow_monte_carlo(scale, kl_bound):
    """`"probit"` against 20,000 logit draws per example (correlated logits, variances
    up to about 4 scale): its KL from Monte Carlo is at most half that of softmax(m), the
    probabilities that ignore the variance, and within a bound measured at each scale (the
    approximation gives 0.0007, 0.012 and 0.043 here; softmax(m) 0.0025, 0.080, 0.50)."""
    rng = np.random.default_rng(22)
    mean, cov = random_gaussian(rng, 100, 4, scale=scale)
    mean = 2.0 * mean
    probit = to_numpy(predictive.class_probabilities(pack(mean, cov), method="probit")).astype("float64")
    mean_only = to_numpy(predictive.class_probabilities(pack(mean, cov), method="mean")).astype("float64")
    draws = mc_gaussian(rng, mean, cov, 20_000)
    mc = stats_softmax(draws).mean(1)
    kl = lambda p: np.mean(np.sum(mc * (np.log(mc) - np.log(p)), -1))  # noqa: E731
    assert kl(probit) < kl_bound
    assert kl(probit) < 0.5 * kl(mean_only)
    zero = to_numpy(predictive.class_probabilities(pack(mean, 0.0 * cov), method="probit"))
    np.testing.assert_allclose(zero, stats_softmax(mean), rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(to_numpy(predictive.class_probabilities(pack(mean, cov))), mean_only)  # default


def stats_softmax(z):
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


@pytest.mark.parametrize("method", ["probit", "delta", "mc", "mean"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_class_probabilities_never_zero_or_nan_for_finite_inputs(method, dtype):
    """Huge or tiny logits and variances (the delta method once gave the true class exactly 0,
    and NaN): every method returns positive, finite rows summing to one."""
    mean = np.array([[1e4, -1e4, 0.0], [300.0, 0.0, -300.0], [0.0, 0.0, 0.0], [50.0, 49.0, -80.0]], dtype)
    for variance in (0.0, 1e-30, 1.0, 36.0, 1e8):
        out = pack(mean, np.full_like(mean, variance))
        probs = to_numpy(predictive.class_probabilities(out, method=method, num_samples=64, seed=0))
        assert probs.dtype == np.dtype(dtype)
        assert np.isfinite(probs).all() and (probs > 0).all(), (method, variance, probs)
        np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-5)
        assert np.isfinite(np.log(probs)).all()


def test_predict_returns_numpy_summaries_for_both_tasks():
    rng = np.random.default_rng(23)
    x = rng.normal(size=(40, 2)).astype("float32")
    y = (50.0 + 10.0 * x[:, 0]).astype("float32")
    prior = EmpiricalBayesRegularizer(40)
    regression = keras.Sequential([keras.Input((2,)), DenseDVI(8, "relu", regularizer=prior),
                                   DenseDVI(2, regularizer=prior), keras_dvi.TargetScaling.from_targets(y)])
    regression.compile(keras.optimizers.Adam(1e-2), loss=HeteroscedasticELL())
    out = keras_dvi.predict(regression, x, level=0.9)
    assert all(isinstance(v, np.ndarray) and v.shape == (40, 1) for v in out.values())
    moments = {k: to_numpy(v) for k, v in predictive.regression_moments(regression.predict(x, verbose=0)).items()}
    np.testing.assert_allclose(out["mean"], moments["mean"], rtol=1e-6)  # original units (about 50)
    np.testing.assert_allclose(out["std"] ** 2, moments["epistemic"] + moments["aleatoric"], rtol=1e-5)
    np.testing.assert_allclose(out["upper"] - out["mean"], stats.norm.ppf(0.95) * out["std"], rtol=1e-5)
    classifier = keras.Sequential([keras.Input((2,)), DenseDVI(8, "relu", regularizer=prior), DenseDVI(2, regularizer=prior)])
    classifier.compile(keras.optimizers.Adam(1e-2), loss=SoftmaxDeltaELL())
    out = keras_dvi.predict(classifier, x)
    np.testing.assert_allclose(out["probabilities"].sum(-1), 1.0, rtol=1e-5)
    np.testing.assert_array_equal(out["label"], out["probabilities"].argmax(-1))
    np.testing.assert_allclose(out["entropy"], stats.entropy(out["probabilities"].T), rtol=1e-4)
    with pytest.raises(ValueError, match="task"):
        keras_dvi.predict(keras.Sequential([keras.Input((2,)), DenseDVI(2)]), x)


@pytest.mark.parametrize("structure", ["dict", "list"])
def test_predict_summarises_every_output_of_a_model_with_several(structure):
    """A model with a regression and a classification output, a keras-dvi loss each: one summary
    per output, in the outputs' structure, each what the one-output model of that head gives."""
    rng = np.random.default_rng(5)
    x = rng.normal(size=(30, 3)).astype("float32")
    prior = EmpiricalBayesRegularizer(30)
    inputs = keras.Input((3,))
    hidden = DenseDVI(6, "relu", regularizer=prior)(inputs)
    value, label = DenseDVI(2, regularizer=prior, name="value")(hidden), DenseDVI(3, regularizer=prior, name="label")(hidden)
    if structure == "dict":
        model = keras.Model(inputs, {"value": value, "label": label})
        model.compile("adam", loss={"value": HeteroscedasticELL(), "label": SoftmaxDeltaELL()})
    else:
        model = keras.Model(inputs, [value, label])
        model.compile("adam", loss=[HeteroscedasticELL(), SoftmaxDeltaELL()])
    out = keras_dvi.predict(model, x, level=0.9)
    value_out, label_out = (out["value"], out["label"]) if structure == "dict" else out
    for head, task, summary in ((value, "regression", value_out), (label, "classification", label_out)):
        alone = keras_dvi.predict(keras.Model(inputs, head), x, task=task, level=0.9)
        assert sorted(summary) == sorted(alone)
        for key in alone:
            np.testing.assert_allclose(summary[key], alone[key], rtol=1e-6)


def test_predict_samples_of_a_model_with_several_outputs_draws_the_same_weights_for_all():
    """A moment model with several outputs gives one array per output, in the model's output
    structure, every output under the same weight draws: the head's draws equal those of the
    one-output model of the same layers and seed, batched or not."""
    x = np.random.default_rng(3).normal(size=(7, 3)).astype("float32")
    prior = keras_dvi.EmpiricalBayesRegularizer(64)
    inputs = keras.Input((3,))
    hidden = keras_dvi.DenseDiagDVI(6, "relu", regularizer=prior)(inputs)
    head = keras_dvi.DenseDVI(2, regularizer=prior)(hidden)
    alone = keras_dvi.predict_samples(keras.Model(inputs, head), x, 40, seed=5)
    both = keras_dvi.predict_samples(keras.Model(inputs, [hidden, head]), x, 40, seed=5)
    assert isinstance(both, list) and both[0].shape == (7, 40, 6) and both[1].shape == (7, 40, 2)
    np.testing.assert_array_equal(both[1], alone)
    assert np.all(both[0] >= 0) and both[0].std(axis=1).max() > 0.05  # ReLU units, drawn per sample
    named = keras_dvi.predict_samples(keras.Model(inputs, {"hidden": hidden, "head": head}), x, 40, seed=5,
                                      batch_size=3)
    assert set(named) == {"hidden", "head"}
    np.testing.assert_allclose(named["head"], alone, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(named["hidden"], both[0], rtol=1e-6, atol=1e-6)
