"""The training objective: losses, priors, -ELBO/N through model.fit, logs, saving."""

import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf
from scipy import optimize, stats

import keras_dvi
from keras_dvi import (
    DenseDiagDVI,
    DenseDVI,
    EmpiricalBayesRegularizer,
    GaussianPriorRegularizer,
    HeteroscedasticELL,
    HomoscedasticNoise,
    SoftmaxDeltaELL,
    predictive,
    unpack,
)
from keras_dvi.packing import pack
from tests.conftest import gradients, to_numpy


def _random_gaussian(rng, batch, k, scale=1.0):
    g = rng.normal(size=(batch, k, k))
    cov = scale * (g @ np.swapaxes(g, 1, 2) / k + 0.05 * np.eye(k))
    return rng.normal(size=(batch, k)), cov


def _mc_gaussian(rng, mean, cov, n):
    chol = np.linalg.cholesky(cov)
    return mean[:, None, :] + np.einsum("bij,bnj->bni", chol, rng.normal(size=(mean.shape[0], n, mean.shape[1])))


# ------------------------------------------------------------------ HeteroscedasticELL


def test_heteroscedastic_ell_matches_monte_carlo():
    """Eq. 8 is exact for Gaussian (m, l): compare with 400,000 draws per example."""
    rng = np.random.default_rng(0)
    dims = 2
    mean, cov = _random_gaussian(rng, 3, 2 * dims, scale=0.3)
    y = rng.normal(size=(3, dims))
    got = to_numpy(HeteroscedasticELL()(y, pack(mean, cov)))
    loss_per_example = to_numpy(HeteroscedasticELL(reduction=None)(y, pack(mean, cov)))
    draws = _mc_gaussian(rng, mean, cov, 400_000)
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


# ------------------------------------------------------------------ SoftmaxDeltaELL


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
    mean, cov = _random_gaussian(rng, 4, 3, scale=0.05)
    if structure == "diagonal":
        cov = np.stack([np.diag(np.diag(c)) for c in cov])
        second = np.stack([np.diag(c) for c in cov])
    else:
        second = cov
    labels = rng.integers(0, 3, size=4)
    got = to_numpy(SoftmaxDeltaELL(reduction=None)(labels, pack(mean, second)))
    draws = _mc_gaussian(rng, mean, cov, 400_000)
    log_p = draws - np.log(np.exp(draws).sum(-1, keepdims=True))
    nll = -log_p[np.arange(4), :, labels]
    se = nll.std(1) / np.sqrt(nll.shape[1])
    # Delta-method error is O(S^2) (about 1e-4 here) on top of Monte Carlo error.
    assert (np.abs(got - nll.mean(1)) <= 5 * se + 2e-4).all()
    # The correction matters: ignoring the covariance is measurably worse.
    plain = to_numpy(keras.losses.sparse_categorical_crossentropy(labels, mean, from_logits=True))
    assert np.abs(plain - nll.mean(1)).max() > 5 * np.abs(got - nll.mean(1)).max()


def test_softmax_delta_drops_the_variance_penalty_of_confident_logits():
    """The documented weakness of `method="delta"` (README, notebook 03): when softmax(m) is
    near one-hot, `p . diag(S) - p^T S p` vanishes whatever S is, so large logit variances go
    unpenalised, while the Jankowiak form penalises them. Oracle: Monte Carlo over the logits."""
    rng = np.random.default_rng(6)
    mean = np.array([[10.0, 0.0, 0.0]], "float32")
    variance = np.full((1, 3), 25.0, "float32")
    labels = np.array([0])
    draws = _mc_gaussian(rng, mean, np.diag(variance[0])[None], 200_000)[0]
    nll = np.log(np.exp(draws).sum(-1)) - draws[:, 0]
    mc, se = nll.mean(), nll.std() / np.sqrt(len(nll))  # about 0.51 +- 0.004
    plain = to_numpy(keras.losses.sparse_categorical_crossentropy(labels, mean, from_logits=True))[0]
    delta = to_numpy(SoftmaxDeltaELL(reduction=None)(labels, pack(mean, variance)))[0]
    jankowiak = to_numpy(SoftmaxDeltaELL("jankowiak", reduction=None)(labels, pack(mean, variance)))[0]
    assert abs(delta - plain) < 0.01  # the variance adds almost nothing (0.002 nats) ...
    assert mc - plain > 50 * se  # ... where Monte Carlo's penalty is 0.51 nats
    assert jankowiak > mc  # the Jankowiak form penalises at least as much here (about 2.6)


def test_softmax_shape_errors():
    with pytest.raises(ValueError, match="at least 2"):
        SoftmaxDeltaELL()(np.zeros((3,)), pack(np.zeros((3, 1), "float32"), np.ones((3, 1), "float32")))
    with pytest.raises(ValueError, match="labels"):
        SoftmaxDeltaELL()(np.zeros((3, 5)), pack(np.zeros((3, 4), "float32"), np.ones((3, 4), "float32")))
    with pytest.raises(ValueError, match="method"):
        SoftmaxDeltaELL(method="mc")


# ------------------------------------------------------------------ priors


def _inverse_gamma_map(mean, var, alpha, beta):
    """Independent oracle: minimise KL(q || N(0, s)) - log InvGamma(s; alpha, beta) over s."""

    def objective(log_s):
        s = np.exp(log_s)
        kl = 0.5 * np.sum(np.log(s / var) - 1 + (var + mean**2) / s)
        return kl - stats.invgamma.logpdf(s, alpha, scale=beta)

    return np.exp(optimize.minimize_scalar(objective, bounds=(-20, 20), method="bounded", options={"xatol": 1e-12}).x)


@pytest.mark.parametrize("alpha, beta, per_fan_in", [(1.0, 10.0, False), (4.4798, (1 + 4.4798) * 5, True)])
def test_empirical_bayes_prior_variance_is_the_hyperprior_map(alpha, beta, per_fan_in):
    rng = np.random.default_rng(6)
    mean = rng.normal(size=(7, 5)) * 0.3
    var = rng.uniform(0.01, 0.2, size=(7, 5))
    reg = EmpiricalBayesRegularizer(100, alpha, beta, beta_per_fan_in=per_fan_in)
    got = float(to_numpy(reg.optimal_prior_variance(keras.ops.convert_to_tensor(mean), keras.ops.convert_to_tensor(var), 7)))
    want = _inverse_gamma_map(mean, var, alpha, beta / 7 if per_fan_in else beta)
    np.testing.assert_allclose(got, want, rtol=1e-6)


def _mc_kl(rng, mean, var, prior_var, n=200_000):
    w = mean[..., None] + np.sqrt(var)[..., None] * rng.normal(size=mean.shape + (n,))
    log_q = stats.norm.logpdf(w, mean[..., None], np.sqrt(var)[..., None])
    log_p = stats.norm.logpdf(w, 0.0, np.sqrt(prior_var))
    terms = (log_q - log_p).sum(axis=tuple(range(mean.ndim)))
    return terms.mean(), terms.std() / np.sqrt(n)


def test_prior_kl_matches_monte_carlo():
    rng = np.random.default_rng(7)
    mean = rng.normal(size=(4, 3)) * 0.5
    var = rng.uniform(0.05, 0.5, size=(4, 3))
    t = lambda a: keras.ops.convert_to_tensor(a)  # noqa: E731
    eb = EmpiricalBayesRegularizer(num_train=50)
    s_star = float(to_numpy(eb.optimal_prior_variance(t(mean), t(var), 4)))
    for reg, prior_var in ((eb, s_star), (GaussianPriorRegularizer(50, 0.7), 0.7)):
        kl = float(to_numpy(reg.kl(t(mean), t(var), 4)))
        mc, se = _mc_kl(rng, mean, var, prior_var)
        assert abs(kl - mc) <= 5 * se
        np.testing.assert_allclose(float(to_numpy(reg(t(mean), t(var), 4))), kl / 50, rtol=1e-6)


def test_prior_argument_errors():
    for kwargs, match in [
        ({"num_train": 0}, "num_train"),
        ({"num_train": 10.5}, "num_train"),
        ({"num_train": 10, "alpha": 0}, "alpha"),
        ({"num_train": 10, "beta": -1}, "beta"),
    ]:
        with pytest.raises(ValueError, match=match):
            EmpiricalBayesRegularizer(**kwargs)
    with pytest.raises(ValueError, match="variance"):
        GaussianPriorRegularizer(10, variance=0)
    with pytest.raises(ValueError, match="regularizer"):
        DenseDVI(3, regularizer=keras.regularizers.L2(0.1))


# ------------------------------------------------------------------ the objective through fit


def _toy_model(prior, method=DenseDVI):
    return keras.Sequential(
        [keras.Input((2,)), method(8, "relu", regularizer=prior), method(8, "relu", regularizer=prior), DenseDVI(2, regularizer=prior)]
    )


def _numpy_nll(y_pred, y):
    mean, cov = unpack(y_pred, covariance="full")
    mean, cov = to_numpy(mean), to_numpy(cov)
    m, l = mean[:, 0], mean[:, 1]
    s_mm, s_ll, s_ml = cov[:, 0, 0], cov[:, 1, 1], cov[:, 0, 1]
    return 0.5 * (np.log(2 * np.pi) + l + (s_mm + (m - s_ml - y) ** 2) * np.exp(-l + s_ll / 2))


def _numpy_eb_kl(layer, alpha=1.0, beta=10.0):
    total = 0.0
    for mean, var in ((layer.kernel_mean, layer.kernel_variance), (layer.bias_mean, layer.bias_variance)):
        mean, var = to_numpy(mean).astype("float64"), to_numpy(var).astype("float64")
        s = (np.sum(var + mean**2) + 2 * beta) / (mean.size + 2 * alpha + 2)
        total += 0.5 * np.sum(np.log(s / var) - 1 + (var + mean**2) / s)
    return total


def test_kl_divergence_of_a_layer_is_the_whole_kl_in_nats():
    """`layer.kl_divergence()` once returned KL / N; it is the KL of the layer's weights (eq. 12
    at the empirical Bayes variance, against NumPy), whatever `num_train` says."""
    model = _toy_model(EmpiricalBayesRegularizer(num_train=640))
    for layer in model.layers[:2]:
        np.testing.assert_allclose(to_numpy(layer.kl_divergence()), _numpy_eb_kl(layer), rtol=1e-4)


def test_fit_minimises_negative_elbo_over_n_and_logs_its_parts():
    rng = np.random.default_rng(8)
    n_train, batch = 640, 32
    x = rng.normal(size=(batch, 2)).astype("float32")
    y = rng.normal(size=(batch,)).astype("float32")
    model = _toy_model(EmpiricalBayesRegularizer(num_train=n_train, kl_warmup_steps=0))
    model.compile(keras.optimizers.SGD(0.0), loss=HeteroscedasticELL())
    history = model.fit(x, y, batch_size=batch, epochs=1, verbose=0).history
    nll = _numpy_nll(model.predict(x, verbose=0), y).mean()
    kl = sum(_numpy_eb_kl(layer) for layer in model.layers) / n_train
    np.testing.assert_allclose(history["loss"][0], nll + kl, rtol=1e-5)
    np.testing.assert_allclose(history["nll"][0], nll, rtol=1e-5)
    np.testing.assert_allclose(history["kl"][0], kl, rtol=1e-5)
    results = model.evaluate(x, y, batch_size=batch, verbose=0, return_dict=True)
    assert set(results) == {"loss", "nll", "kl"}
    np.testing.assert_allclose(results["loss"], nll + kl, rtol=1e-5)


@pytest.mark.tensorflow_only  # tf.data
def test_tf_data_callbacks_and_diagonal_bodies():
    rng = np.random.default_rng(10)
    x = rng.normal(size=(128, 2)).astype("float32")
    y = (x[:, 0] + 0.1 * rng.normal(size=128)).astype("float32")
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(32)
    model = _toy_model(GaussianPriorRegularizer(num_train=128), method=DenseDiagDVI)
    model.compile(keras.optimizers.Adam(1e-2), loss=HeteroscedasticELL())
    stopper = keras.callbacks.EarlyStopping(monitor="loss", patience=100)
    history = model.fit(dataset, epochs=5, verbose=0, callbacks=[stopper]).history
    # (the KL weight rises over the run, auto warm-up: the fit term shows the learning)
    assert len(history["loss"]) == 5 and history["nll"][-1] < history["nll"][0]
    assert set(model.evaluate(dataset, verbose=0, return_dict=True)) == {"loss", "nll", "kl"}


def test_classifier_trains_with_softmax_delta_ell():
    rng = np.random.default_rng(11)
    x = rng.normal(size=(300, 2)).astype("float32")
    labels = (x[:, 0] + x[:, 1] > 0).astype("int32") + (x[:, 0] > 1).astype("int32")
    model = keras.Sequential(
        [keras.Input((2,)), DenseDVI(16, "relu", regularizer=EmpiricalBayesRegularizer(300)), DenseDVI(3, regularizer=EmpiricalBayesRegularizer(300))]
    )
    model.compile(keras.optimizers.Adam(1e-2), loss=SoftmaxDeltaELL())
    model.fit(x, labels, epochs=30, batch_size=50, verbose=0)
    probs = to_numpy(predictive.class_probabilities(model.predict(x, verbose=0)))
    assert (probs.argmax(-1) == labels).mean() > 0.85


def test_compiled_model_saves_and_loads_in_a_fresh_process(tmp_path):
    rng = np.random.default_rng(12)
    x = rng.normal(size=(64, 2)).astype("float32")
    y = rng.normal(size=(64,)).astype("float32")
    model = keras.Sequential(
        [
            keras.Input((2,)),
            DenseDVI(8, "relu", regularizer=EmpiricalBayesRegularizer(64, alpha=2.0, beta=3.0)),
            DenseDVI(1, regularizer=GaussianPriorRegularizer(64, 0.5)),
            HomoscedasticNoise(-1.0),
        ]
    )
    model.compile(keras.optimizers.Adam(1e-2), loss=HeteroscedasticELL())
    model.fit(x, y, epochs=2, verbose=0)
    path = tmp_path / "model.keras"
    model.save(path)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    before = model.predict(x, verbose=0)
    loss_before = model.evaluate(x, y, verbose=0, return_dict=True)
    loaded = keras.saving.load_model(path, safe_mode=True)
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), before)
    assert isinstance(loaded.layers[0].regularizer, EmpiricalBayesRegularizer)
    assert loaded.layers[0].regularizer.alpha == 2.0
    script = (
        "import keras, numpy as np, sys\n"
        "import keras_dvi  # registers the classes\n"
        f"m = keras.saving.load_model(r'{path}', safe_mode=True)\n"
        f"x = np.load(r'{tmp_path / 'x.npy'}'); y = np.load(r'{tmp_path / 'y.npy'}')\n"
        f"np.save(r'{tmp_path / 'out.npy'}', m.predict(x, verbose=0))\n"
        "r = m.evaluate(x, y, verbose=0, return_dict=True)\n"
        "print(r['loss'], r['nll'], r['kl'])\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=300)
    np.testing.assert_array_equal(np.load(tmp_path / "out.npy"), before)
    loss, nll, kl = (float(v) for v in out.stdout.split()[-3:])
    np.testing.assert_allclose([loss, nll, kl], [loss_before["loss"], loss_before["nll"], loss_before["kl"]], rtol=1e-5)


# ------------------------------------------------------------------ predictions


def test_regression_predictive_decomposition_against_monte_carlo():
    rng = np.random.default_rng(13)
    mean, cov = _random_gaussian(rng, 3, 2, scale=0.2)
    y_pred = pack(mean, cov)
    moments = {k: to_numpy(v)[:, 0] for k, v in predictive.regression_moments(y_pred).items()}
    np.testing.assert_allclose(moments["variance"], moments["epistemic"] + moments["aleatoric"], rtol=1e-6)
    draws = _mc_gaussian(rng, mean, cov, 400_000)
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
    mean, cov = _random_gaussian(rng, 50, 4, scale=25.0)
    for method in ("delta", "mc", "mean"):
        probs = to_numpy(predictive.class_probabilities(pack(mean, cov), method=method, seed=0))
        assert (probs >= 0).all()
        np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-5)
    # Small covariance: eq. 23 agrees with Monte Carlo.
    mean, cov = _random_gaussian(rng, 5, 3, scale=0.02)
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


# ------------------------------------------------------------------ layers of the objective


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


# ------------------------------------------------------------------ numerical edges


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
    model.save(tmp_path / "m.keras")
    keras.saving.load_model(tmp_path / "m.keras")
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


# ------------------------------------------------------------------ targets in their own units


@pytest.mark.parametrize("structure", ["full", "diagonal"])
def test_target_scaling_is_the_change_of_variables(structure):
    """`y = mean + std z`: the loss and the predictive density in y differ from those in z by
    `log std` per dimension, exactly (an identity of densities, not of the code)."""
    rng = np.random.default_rng(21)
    mean, cov = _random_gaussian(rng, 5, 4, scale=0.3)
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
    model.save(tmp_path / "m.keras")
    loaded = keras.saving.load_model(tmp_path / "m.keras")
    np.testing.assert_allclose(loaded.predict(x[test], verbose=0), model.predict(x[test], verbose=0), rtol=1e-6)
    with pytest.raises(ValueError, match="std"):
        keras_dvi.TargetScaling(0.0, 0.0)
    with pytest.raises(ValueError, match="2 D units"):
        keras_dvi.TargetScaling()(np.zeros((2, 2, 3), "float32"))


# ------------------------------------------------------------------ class probabilities


@pytest.mark.parametrize("scale, kl_bound", [(0.3, 0.002), (3.0, 0.03), (30.0, 0.08)])
def test_probit_class_probabilities_follow_monte_carlo(scale, kl_bound):
    """`"probit"` against 20,000 logit draws per example (correlated logits, variances
    up to about 4 scale): its KL from Monte Carlo is at most half that of softmax(m), the
    probabilities that ignore the variance, and within a bound measured at each scale (the
    approximation gives 0.0007, 0.012 and 0.043 here; softmax(m) 0.0025, 0.080, 0.50)."""
    rng = np.random.default_rng(22)
    mean, cov = _random_gaussian(rng, 100, 4, scale=scale)
    mean = 2.0 * mean
    probit = to_numpy(predictive.class_probabilities(pack(mean, cov), method="probit")).astype("float64")
    mean_only = to_numpy(predictive.class_probabilities(pack(mean, cov), method="mean")).astype("float64")
    draws = _mc_gaussian(rng, mean, cov, 20_000)
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
    labels = (x[:, 0] > 0).astype("int32")
    classifier = keras.Sequential([keras.Input((2,)), DenseDVI(8, "relu", regularizer=prior), DenseDVI(2, regularizer=prior)])
    classifier.compile(keras.optimizers.Adam(1e-2), loss=SoftmaxDeltaELL())
    out = keras_dvi.predict(classifier, x)
    np.testing.assert_allclose(out["probabilities"].sum(-1), 1.0, rtol=1e-5)
    np.testing.assert_array_equal(out["label"], out["probabilities"].argmax(-1))
    np.testing.assert_allclose(out["entropy"], stats.entropy(out["probabilities"].T), rtol=1e-4)
    with pytest.raises(ValueError, match="task"):
        keras_dvi.predict(keras.Sequential([keras.Input((2,)), DenseDVI(2)]), x)
