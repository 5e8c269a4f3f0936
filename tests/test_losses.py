"""The expected log-likelihood losses against Monte Carlo, quadrature and closed forms, at
their numerical edges, and the regression heads they read (`HomoscedasticNoise`,
`TargetScaling`)."""

import keras
import numpy as np
import pytest
from scipy import stats

import keras_dvi
from keras_dvi import (
    DenseDVI,
    EmpiricalBayesRegularizer,
    HeteroscedasticELL,
    HomoscedasticNoise,
    SoftmaxDeltaELL,
    predictive,
    unpack,
)
from keras_dvi.packing import pack
from tests.conftest import gradients, mc_gaussian, random_gaussian, reloaded, to_numpy


def test_heteroscedastic_ell_matches_monte_carlo():
    """Eq. 8 is exact for Gaussian (m, l): compare with 400,000 draws per example."""
    rng = np.random.default_rng(0)
    dims = 2
    mean, cov = random_gaussian(rng, 3, 2 * dims, scale=0.3)
    y = rng.normal(size=(3, dims))
    got = to_numpy(HeteroscedasticELL()(y, pack(mean, cov)))
    loss_per_example = to_numpy(HeteroscedasticELL(reduction=None)(y, pack(mean, cov)))
    draws = mc_gaussian(rng, mean, cov, 400_000)
    m, log_var = draws[..., :dims], draws[..., dims:]
    nll = -stats.norm.logpdf(y[:, None, :], m, np.exp(0.5 * log_var)).sum(-1)
    se = nll.std(1) / np.sqrt(nll.shape[1])
    assert (np.abs(loss_per_example - nll.mean(1)) <= 5 * se).all()
    np.testing.assert_allclose(got, loss_per_example.mean(), rtol=1e-6)


def test_heteroscedastic_ell_with_diagonal_output_assumes_no_m_l_covariance():
    rng = np.random.default_rng(1)
    mean = rng.normal(size=(4, 2))
    var = rng.uniform(0.1, 0.5, size=(4, 2))
    y = rng.normal(size=(4,))
    diag = to_numpy(HeteroscedasticELL(reduction=None)(y, pack(mean, var)))
    full = to_numpy(HeteroscedasticELL(reduction=None)(y, pack(mean, np.stack([np.diag(v) for v in var]))))
    np.testing.assert_allclose(diag, full, rtol=1e-6)


def test_homoscedastic_ell_is_exact_for_one_hidden_layer():
    """math.md section 5: one hidden layer, deterministic inputs, fixed noise: exact."""
    x = np.random.default_rng(2).normal(size=(5, 3)).astype("float32")
    y = np.random.default_rng(3).normal(size=(5, 1)).astype("float32")
    log_noise = np.log(0.3)
    model = keras.Sequential(
        [keras.Input((3,)), DenseDVI(20, "relu"), DenseDVI(1), HomoscedasticNoise(log_noise, trainable=False)]
    )
    got = to_numpy(HeteroscedasticELL(reduction=None)(y, model(x)))
    body = keras.Sequential(model.layers[:-1])
    samples = keras_dvi.predict_samples(body, x, 50_000, seed=0)[..., 0].T.astype("float64")  # (S, batch)
    nll = -stats.norm.logpdf(y[:, 0], samples, np.sqrt(0.3))
    se = nll.std(0) / np.sqrt(nll.shape[0])
    assert (np.abs(got - nll.mean(0)) <= 5 * se).all()


@pytest.mark.parametrize(
    "y_shape, units, match",
    [((4, 2), 2, "y_true"), ((4,), 4, "y_true"), ((4, 1), 3, "even")],
)
def test_heteroscedastic_ell_shape_errors(y_shape, units, match):
    y_pred = pack(np.zeros((4, units), "float32"), np.ones((4, units), "float32"))
    with pytest.raises(ValueError, match=match):
        HeteroscedasticELL()(np.zeros(y_shape, "float32"), y_pred)


def test_softmax_delta_matches_cross_entropy_at_zero_covariance():
    rng = np.random.default_rng(4)
    logits = rng.normal(size=(6, 4)).astype("float32")
    labels = rng.integers(0, 4, size=6)
    y_pred = pack(logits, np.zeros((6, 4, 4), "float32"))
    want = to_numpy(keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True))
    for method in ("delta", "jankowiak"):
        got = to_numpy(SoftmaxDeltaELL(method=method, reduction=None)(labels, y_pred))
        np.testing.assert_allclose(got, want, rtol=1e-5)
    one_hot = np.eye(4)[labels]
    np.testing.assert_allclose(to_numpy(SoftmaxDeltaELL(reduction=None)(one_hot, y_pred)), want, rtol=1e-5)
    np.testing.assert_allclose(to_numpy(SoftmaxDeltaELL(reduction=None)(labels[:, None], y_pred)), want, rtol=1e-5)


@pytest.mark.parametrize("structure", ["full", "diagonal"])
def test_softmax_delta_matches_monte_carlo_for_small_covariance(structure):
    rng = np.random.default_rng(5)
    mean, cov = random_gaussian(rng, 4, 3, scale=0.05)
    if structure == "diagonal":
        cov = np.stack([np.diag(np.diag(c)) for c in cov])
        second = np.stack([np.diag(c) for c in cov])
    else:
        second = cov
    labels = rng.integers(0, 3, size=4)
    got = to_numpy(SoftmaxDeltaELL(method="delta", reduction=None)(labels, pack(mean, second)))
    draws = mc_gaussian(rng, mean, cov, 400_000)
    log_p = draws - np.log(np.exp(draws).sum(-1, keepdims=True))
    nll = -log_p[np.arange(4), :, labels]
    se = nll.std(1) / np.sqrt(nll.shape[1])
    # Delta-method error is O(S^2) (about 1e-4 here) on top of Monte Carlo error.
    assert (np.abs(got - nll.mean(1)) <= 5 * se + 2e-4).all()
    # The correction matters: ignoring the covariance is measurably worse.
    plain = to_numpy(keras.losses.sparse_categorical_crossentropy(labels, mean, from_logits=True))
    assert np.abs(plain - nll.mean(1)).max() > 5 * np.abs(got - nll.mean(1)).max()


def test_softmax_jankowiak_lies_between_monte_carlo_and_jensens_bound():
    """The default `method="jankowiak"` (Jankowiak 2018, eq. 38) against Monte Carlo over the
    logits: for logit variances up to 2 it bounds the expected negative log-likelihood from
    above (by more than the Monte Carlo error), and lies below Jensen's bound
    `-m_y + log sum_j exp(m_j + S_jj / 2)` (as `1 + s / 2 <= exp(s / 2)`)."""
    rng = np.random.default_rng(7)
    mean = (2.0 * rng.normal(size=(6, 4))).astype("float32")
    variance = rng.uniform(0.01, 2.0, size=(6, 4)).astype("float32")
    labels = rng.integers(0, 4, size=6)
    got = to_numpy(SoftmaxDeltaELL(reduction=None)(labels, pack(mean, variance)))
    draws = mean[:, None, :] + np.sqrt(variance)[:, None, :] * rng.normal(size=(6, 200_000, 4))
    nll = np.log(np.exp(draws).sum(-1)) - draws[np.arange(6), :, labels]
    mc, se = nll.mean(1), nll.std(1) / np.sqrt(nll.shape[1])
    jensen = -mean[np.arange(6), labels] + np.log(np.exp(mean + variance / 2).sum(-1))
    assert (got > mc + 5 * se).all()
    assert (got < jensen).all()


def test_softmax_delta_drops_the_variance_penalty_of_confident_logits():
    """The documented weakness of `method="delta"` (README, notebook 03): when softmax(m) is
    near one-hot, `p . diag(S) - p^T S p` vanishes whatever S is, so large logit variances go
    unpenalised, while the Jankowiak form penalises them. Oracle: Monte Carlo over the logits."""
    rng = np.random.default_rng(6)
    mean = np.array([[10.0, 0.0, 0.0]], "float32")
    variance = np.full((1, 3), 25.0, "float32")
    labels = np.array([0])
    draws = mc_gaussian(rng, mean, np.diag(variance[0])[None], 200_000)[0]
    nll = np.log(np.exp(draws).sum(-1)) - draws[:, 0]
    mc, se = nll.mean(), nll.std() / np.sqrt(len(nll))  # about 0.51 +- 0.004
    plain = to_numpy(keras.losses.sparse_categorical_crossentropy(labels, mean, from_logits=True))[0]
    delta = to_numpy(SoftmaxDeltaELL(method="delta", reduction=None)(labels, pack(mean, variance)))[0]
    jankowiak = to_numpy(SoftmaxDeltaELL("jankowiak", reduction=None)(labels, pack(mean, variance)))[0]
    assert abs(delta - plain) < 0.01  # the variance adds almost nothing (0.002 nats) ...
    assert mc - plain > 50 * se  # ... where Monte Carlo's penalty is 0.51 nats
    assert jankowiak > mc  # the Jankowiak form penalises at least as much here (about 2.6)


def test_two_class_labels_are_the_probability_of_class_one():
    """A converted binary classifier's labels `(batch,)` are read as Keras' binary cross-entropy
    reads them: the probability of class 1, so label smoothing's 0.9 is the row (0.1, 0.9) (it
    was cast to class 0). Oracle: Keras' binary cross-entropy of the logit z at tiny variances
    of the logits (0, z); and the same loss as the soft rows."""
    rng = np.random.default_rng(11)
    z = rng.normal(scale=2.0, size=6).astype("float32")
    mean = np.stack([np.zeros_like(z), z], axis=-1)
    tiny = pack(mean, np.full((6, 2), 1e-9, "float32"))
    labels = np.array([0.9, 0.1, 1.0, 0.0, 0.5, 0.95], "float32")
    want = to_numpy(keras.losses.binary_crossentropy(labels[:, None], z[:, None], from_logits=True))
    for method in ("jankowiak", "delta"):
        loss = SoftmaxDeltaELL(method=method, reduction=None)
        np.testing.assert_allclose(to_numpy(loss(labels, tiny)), want, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(to_numpy(loss(labels[:, None], tiny)), want, rtol=1e-5, atol=1e-6)
    wide = pack(mean, np.full((6, 2), 0.7, "float32"))
    rows = np.stack([1 - labels, labels], axis=-1)
    np.testing.assert_allclose(to_numpy(SoftmaxDeltaELL(reduction=None)(labels, wide)),
                               to_numpy(SoftmaxDeltaELL(reduction=None)(rows, wide)), rtol=1e-6)
    with pytest.raises(ValueError, match=r"two-class output holds labels outside \[0, 1\].*from 0\.0 to 2\.0"):
        SoftmaxDeltaELL()(np.array([0.0, 1.0, 2.0, 0.0, 1.0, 1.0]), wide)


def test_label_smoothing_is_keras_label_smoothing():
    """`label_smoothing` smooths the labels as Keras' cross-entropies do: at tiny logit
    variances the loss is Keras' `CategoricalCrossentropy(label_smoothing=...)` of the logits,
    and for two classes `BinaryCrossentropy(label_smoothing=...)` of the logit z of the logits
    (0, z); `SampledSoftmaxELL` on samples that all equal the logits likewise."""
    rng = np.random.default_rng(12)
    logits = rng.normal(scale=2.0, size=(6, 4)).astype("float32")
    labels = rng.integers(0, 4, size=6)
    tiny = pack(logits, np.full((6, 4), 1e-9, "float32"))
    want = to_numpy(keras.losses.CategoricalCrossentropy(from_logits=True, label_smoothing=0.2, reduction=None)(
        np.eye(4)[labels], logits))
    for method in ("jankowiak", "delta"):
        got = SoftmaxDeltaELL(method=method, label_smoothing=0.2, reduction=None)(labels, tiny)
        np.testing.assert_allclose(to_numpy(got), want, rtol=1e-5)
    samples = np.repeat(logits[:, None, :], 3, axis=1)
    np.testing.assert_allclose(to_numpy(_sampled_softmax(samples, labels, 0.2)), want, rtol=1e-5)
    z = logits[:, 0]
    binary = pack(np.stack([np.zeros_like(z), z], axis=-1), np.full((6, 2), 1e-9, "float32"))
    soft = np.array([0.0, 1.0, 1.0, 0.9, 0.0, 0.3], "float32")
    want = to_numpy(keras.losses.BinaryCrossentropy(from_logits=True, label_smoothing=0.1, reduction=None)(
        soft[:, None], z[:, None]))
    np.testing.assert_allclose(to_numpy(SoftmaxDeltaELL(label_smoothing=0.1, reduction=None)(soft, binary)), want,
                               rtol=1e-5, atol=1e-6)
    loss = SoftmaxDeltaELL(label_smoothing=0.1)
    assert SoftmaxDeltaELL.from_config(loss.get_config()).label_smoothing == 0.1
    for bad in (-0.1, 1.5, "0.1", True, float("nan")):
        with pytest.raises(ValueError, match="label_smoothing"):
            SoftmaxDeltaELL(label_smoothing=bad)
    # an out-of-range label still poisons its row (smoothing does not give it mass)
    out = to_numpy(_compiled(lambda y: SoftmaxDeltaELL(label_smoothing=0.1, reduction=None)(y, tiny))(
        np.array([0, 1, 2, 3, 4, 0], "int32")))
    assert np.isnan(out[4]) and np.isfinite(np.delete(out, 4)).all()


def _sampled_softmax(samples, labels, label_smoothing):
    """`SampledSoftmaxELL` per example, called as in a step of a model with sampling layers."""
    loss = keras_dvi.SampledSoftmaxELL(label_smoothing=label_smoothing, reduction=None)
    return loss.call(keras.ops.convert_to_tensor(labels), keras.ops.convert_to_tensor(samples))


def test_fractional_class_labels_are_refused():
    """With three or more classes a label of shape `(batch,)` names a class: 1.5 was cast to
    class 1. Eagerly an error names the label; in a compiled step its loss is NaN."""
    three = pack(np.zeros((3, 3), "float32"), np.ones((3, 3), "float32"))
    with pytest.raises(ValueError, match=r"fractional class labels \(e\.g\. 1\.5\).*\(batch, 3\)"):
        SoftmaxDeltaELL()(np.array([0.0, 1.5, 2.0]), three)
    compiled = to_numpy(_compiled(lambda y: SoftmaxDeltaELL(reduction=None)(y, three))(np.array([0.0, 1.5, 2.0], "float32")))
    assert np.isfinite(compiled[[0, 2]]).all() and np.isnan(compiled[1])
    two = pack(np.zeros((3, 2), "float32"), np.ones((3, 2), "float32"))
    compiled = to_numpy(_compiled(lambda y: SoftmaxDeltaELL(reduction=None)(y, two))(np.array([0.0, 2.0, -1.0], "float32")))
    assert np.isfinite(compiled[0]) and np.isnan(compiled[1:]).all()


def _compiled(function):
    """`function` traced as a compiled step traces it (no concrete values to check eagerly)."""
    if keras.backend.backend() == "jax":
        import jax

        return jax.jit(function)
    import tensorflow as tf

    return tf.function(function)


def test_softmax_shape_errors():
    with pytest.raises(ValueError, match="at least 2"):
        SoftmaxDeltaELL()(np.zeros((3,)), pack(np.zeros((3, 1), "float32"), np.ones((3, 1), "float32")))
    with pytest.raises(ValueError, match="labels"):
        SoftmaxDeltaELL()(np.zeros((3, 5)), pack(np.zeros((3, 4), "float32"), np.ones((3, 4), "float32")))
    with pytest.raises(ValueError, match="method"):
        SoftmaxDeltaELL(method="mc")


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_losses_finite_at_extreme_values(dtype):
    """Large log-variances and their variances, near-zero variances, large means."""
    mean = np.array([[1e4, -80.0], [0.0, 80.0], [-1e4, 0.0], [3.0, -30.0]])
    var = np.array([[1e-12, 300.0], [0.0, 0.0], [1e6, 1e-12], [1.0, 400.0]])
    y = np.array([0.0, 1.0, -5.0, 3.0])

    def total(mean_v, var_v):
        het = HeteroscedasticELL(dtype=dtype)(y, keras.ops.stack([mean_v, var_v], axis=1))
        soft = SoftmaxDeltaELL(dtype=dtype)(np.array([0, 1, 1, 0]), keras.ops.stack([mean_v * 10, var_v], axis=1))
        return het + soft

    value, grads = gradients(total, [mean.astype(dtype), var.astype(dtype)])
    assert np.isfinite(value)
    assert all(np.isfinite(g).all() for g in grads)
    moments = predictive.regression_moments(pack(mean, var))
    assert all(np.isfinite(to_numpy(v)).all() for v in moments.values())
    # Values in the ordinary range are untouched by the overflow guard.
    np.testing.assert_allclose(to_numpy(keras_dvi.moments.safe_exp(keras.ops.convert_to_tensor([-3.0, 0.0, 59.0]))), np.exp([-3.0, 0.0, 59.0]), rtol=1e-6)


def test_homoscedastic_noise_layer_shapes_and_config():
    layer = HomoscedasticNoise(initial_log_variance=-2.0)
    full = layer(pack(np.zeros((3, 2), "float32"), np.stack([np.eye(2, dtype="float32")] * 3)))
    assert tuple(full.shape) == (3, 5, 4)
    mean, cov = unpack(full)
    np.testing.assert_allclose(to_numpy(mean)[:, 2:], -2.0)
    np.testing.assert_allclose(to_numpy(cov)[:, 2:, :], 0.0)
    diag = HomoscedasticNoise()(np.zeros((3, 2), "float32"))
    assert tuple(diag.shape) == (3, 2, 4)
    clone = HomoscedasticNoise.from_config(layer.get_config())
    assert clone.initial_log_variance == -2.0


def test_homoscedastic_noise_scale_multiplies_the_log_variance_gradient():
    """With `log_variance_scale = s` the variable holds `l / s`: the output still starts at
    `initial_log_variance`, and the gradient with respect to the variable is `s dL/dl`, with
    `dL/dl = mean(1 - (y - m)^2 exp(-l)) / 2` for the Gaussian negative log-likelihood."""
    from tests.conftest import model_gradients

    rng = np.random.default_rng(3)
    m, y = rng.normal(size=(6, 1)).astype("float32"), rng.normal(size=(6, 1)).astype("float32")
    for scale in (1.0, 10.0):
        model = keras.Sequential([keras.Input((1,)), HomoscedasticNoise(-1.5, log_variance_scale=scale)])
        loss = HeteroscedasticELL()
        out, grads = model_gradients(model, m, lambda out: loss(y, out))
        np.testing.assert_allclose(to_numpy(unpack(out)[0])[:, 1], -1.5, rtol=1e-6)
        np.testing.assert_allclose(to_numpy(model.layers[0].scaled_log_variance), [-1.5 / scale], rtol=1e-6)
        expected = np.mean(1.0 - (y - m) ** 2 * np.exp(1.5)) / 2.0
        np.testing.assert_allclose(grads[0], [scale * expected], rtol=1e-5)
    layer = HomoscedasticNoise(-3.0, log_variance_scale=10.0)
    assert HomoscedasticNoise.from_config(layer.get_config()).get_config() == layer.get_config()
    with pytest.raises(ValueError, match="log_variance_scale"):
        HomoscedasticNoise(log_variance_scale=0.0)


@pytest.mark.parametrize("structure", ["full", "diagonal"])
def test_target_scaling_is_the_change_of_variables(structure):
    """`y = mean + std z`: the loss and the predictive density in y differ from those in z by
    `log std` per dimension, exactly (an identity of densities, not of the code)."""
    rng = np.random.default_rng(21)
    mean, cov = random_gaussian(rng, 5, 4, scale=0.3)
    if structure == "diagonal":
        cov = np.eye(4) * cov
    out = pack(mean, cov)
    shift, std = np.array([100.0, -3.0]), np.array([20.0, 0.5])
    scaled = keras_dvi.TargetScaling(shift, std)(out)
    z = rng.normal(size=(5, 2))
    y = shift + std * z
    per_example = lambda loss, t, o: to_numpy(HeteroscedasticELL(reduction=None)(t, o))  # noqa: E731
    np.testing.assert_allclose(per_example(HeteroscedasticELL, y, scaled),
                               per_example(HeteroscedasticELL, z, out) + np.log(std).sum(), rtol=1e-5)
    np.testing.assert_allclose(to_numpy(predictive.log_predictive_density(scaled, y)),
                               to_numpy(predictive.log_predictive_density(out, z)) - np.log(std).sum(), rtol=1e-5)
    moments_y = {k: to_numpy(v) for k, v in predictive.regression_moments(scaled).items()}
    moments_z = {k: to_numpy(v) for k, v in predictive.regression_moments(out).items()}
    np.testing.assert_allclose(moments_y["mean"], shift + std * moments_z["mean"], rtol=1e-5)
    np.testing.assert_allclose(moments_y["variance"], std**2 * moments_z["variance"], rtol=1e-5)


def test_target_scaling_trains_on_targets_in_their_own_units(tmp_path):
    """scikit-learn's diabetes targets (25..346): without `TargetScaling` the network's RMSE
    was 155 (the mean predicts 70); with it, as good as on standardised targets."""
    from sklearn.datasets import load_diabetes

    x, y = load_diabetes(return_X_y=True)
    x = ((x - x.mean(0)) / x.std(0)).astype("float32")
    y = y.astype("float32")
    order = np.random.default_rng(0).permutation(len(x))
    train, test = order[:350], order[350:]
    prior = EmpiricalBayesRegularizer(350)
    model = keras.Sequential([keras.Input((10,)), DenseDVI(50, "relu", regularizer=prior),
                              DenseDVI(2, regularizer=prior), keras_dvi.TargetScaling.from_targets(y[train])])
    model.compile(keras.optimizers.Adam(1e-2), loss=HeteroscedasticELL())
    model.fit(x[train], y[train], epochs=60, batch_size=32, verbose=0)
    rmse = float(to_numpy(predictive.rmse(model.predict(x[test], verbose=0), y[test])))
    baseline = float(np.sqrt(np.mean((y[train].mean() - y[test]) ** 2)))
    assert rmse < 0.85 * baseline, (rmse, baseline)
    loaded = reloaded(model, tmp_path, "m")
    np.testing.assert_allclose(loaded.predict(x[test], verbose=0), model.predict(x[test], verbose=0), rtol=1e-6)
    with pytest.raises(ValueError, match="std"):
        keras_dvi.TargetScaling(0.0, 0.0)
    with pytest.raises(ValueError, match="2 D units"):
        keras_dvi.TargetScaling()(np.zeros((2, 2, 3), "float32"))
