"""Global inducing point layers (Ober & Aitchison 2021) against independent oracles.

Oracles: NumPy linear algebra for the weight posterior (eq. 11) and Bayesian linear
regression (eqs. 8-9), Monte Carlo over the layer's own weight draws (tolerances from the
Monte Carlo standard error), SciPy densities for log Q and log P, and the closed-form
Gaussian KL.
"""

import math

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import ops
from scipy import stats

import keras_dvi as kd
from tests.conftest import gradients, model_gradients, reloaded, to_numpy
from keras_dvi import inducing, predictive

rng_global = np.random.default_rng(0)


def _problem(seed, m=7, p=4, units=3, per_unit=False):
    rng = np.random.default_rng(seed)
    phi = rng.standard_normal((m, p))
    phi[:, -1] = 1.0
    precision = np.exp(rng.uniform(-1, 1, (m, units) if per_unit else (m,)))
    pseudo = rng.standard_normal((m, units))
    return phi, precision, pseudo


def _numpy_posterior(phi, precision, pseudo, prior_precision):
    """Sigma_w and M_w per output unit, by dense inverses (eq. 11)."""
    p = phi.shape[1]
    units = pseudo.shape[1]
    covs, means = [], []
    for u in range(units):
        lam = precision if precision.ndim == 1 else precision[:, u]
        cov = np.linalg.inv(prior_precision * np.eye(p) + phi.T @ (lam[:, None] * phi))
        covs.append(cov)
        means.append(cov @ phi.T @ (lam * pseudo[:, u]))
    return np.stack(covs), np.stack(means, axis=1)  # (U, P, P), (P, U)


def _posterior(phi, precision, pseudo, prior_precision, samples=1):
    phi_t = ops.convert_to_tensor(np.broadcast_to(phi, (samples,) + phi.shape))
    return inducing.weight_posterior(
        phi_t, ops.convert_to_tensor(precision), ops.convert_to_tensor(pseudo), prior_precision
    )


@pytest.mark.parametrize("per_unit", [False, True])
def test_posterior_moments_match_dense_inverse(per_unit):
    phi, precision, pseudo = _problem(1, per_unit=per_unit)
    chol, mean = _posterior(phi, precision, pseudo, 3.0)
    covs, means = _numpy_posterior(phi, precision, pseudo, 3.0)
    np.testing.assert_allclose(ops.convert_to_numpy(mean)[0], means, rtol=1e-10, atol=1e-12)
    chol = ops.convert_to_numpy(chol)[0]
    chol = chol if chol.ndim == 3 else np.broadcast_to(chol, covs.shape)
    for u in range(pseudo.shape[1]):
        np.testing.assert_allclose(np.linalg.inv(chol[u] @ chol[u].T), covs[u], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("per_unit", [False, True])
def test_sampled_weights_match_posterior_mean_and_covariance(per_unit):
    phi, precision, pseudo = _problem(2, per_unit=per_unit)
    covs, means = _numpy_posterior(phi, precision, pseudo, 2.0)
    n = 20000
    chol, mean = _posterior(phi, precision, pseudo, 2.0, samples=n)
    noise = keras.random.normal(tuple(mean.shape), dtype="float64", seed=3)
    draws = ops.convert_to_numpy(inducing.sample_weights(chol, mean, noise))  # (n, P, U)
    for u in range(pseudo.shape[1]):
        w = draws[:, :, u]
        sd = np.sqrt(np.diag(covs[u]))
        assert np.all(np.abs(w.mean(axis=0) - means[:, u]) < 5 * sd / math.sqrt(n))
        empirical = np.cov(w, rowvar=False)
        se = np.sqrt((np.outer(sd**2, sd**2) + covs[u] ** 2) / n)
        assert np.all(np.abs(empirical - covs[u]) < 5 * se)
    if not per_unit:  # units share Sigma_w but draw independently
        corr = np.corrcoef(draws[:, 0, 0], draws[:, 0, 1])[0, 1]
        assert abs(corr) < 5 / math.sqrt(n)


@pytest.mark.parametrize("per_unit", [False, True])
def test_one_step_draws_equal_mean_plus_inverse_transposed_factor_times_noise(per_unit):
    """`posterior_sample` (two triangular solves, no `M_w`) against dense NumPy:
    `W_u = M_w,u + L_u^{-T} eps_u` with `L_u` the Cholesky factor of `Sigma_u^{-1}`."""
    phi, precision, pseudo = _problem(3, per_unit=per_unit)
    covs, means = _numpy_posterior(phi, precision, pseudo, 1.5)
    phi_t = ops.convert_to_tensor(np.broadcast_to(phi, (4,) + phi.shape))
    noise = np.random.default_rng(8).standard_normal((4, phi.shape[1], pseudo.shape[1]))
    chol, w = inducing.posterior_sample(
        phi_t, ops.convert_to_tensor(precision), ops.convert_to_tensor(pseudo), 1.5, ops.convert_to_tensor(noise)
    )
    w, chol = ops.convert_to_numpy(w), ops.convert_to_numpy(chol)
    assert w.shape == noise.shape
    for u in range(pseudo.shape[1]):
        factor = np.linalg.cholesky(np.linalg.inv(covs[u]))
        np.testing.assert_allclose(chol[:, u] if per_unit else chol, np.broadcast_to(factor, (4,) + factor.shape), rtol=1e-9, atol=1e-11)
        expected = means[:, u][None] + np.linalg.solve(factor.T, noise[:, :, u].T).T
        np.testing.assert_allclose(w[:, :, u], expected, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("per_unit", [False, True])
def test_log_densities_match_scipy(per_unit):
    phi, precision, pseudo = _problem(4, per_unit=per_unit)
    covs, means = _numpy_posterior(phi, precision, pseudo, 2.5)
    chol, mean = _posterior(phi, precision, pseudo, 2.5, samples=3)
    noise = keras.random.normal(tuple(mean.shape), dtype="float64", seed=5)
    w = inducing.sample_weights(chol, mean, noise)
    log_q = ops.convert_to_numpy(inducing.log_posterior_density(chol, noise))
    log_p = ops.convert_to_numpy(inducing.log_prior_density(w, 2.5))
    w = ops.convert_to_numpy(w)
    for s in range(3):
        expected_q = sum(
            stats.multivariate_normal(means[:, u], covs[u]).logpdf(w[s, :, u]) for u in range(pseudo.shape[1])
        )
        expected_p = stats.norm(0.0, 1.0 / math.sqrt(2.5)).logpdf(w[s]).sum()
        assert log_q[s] == pytest.approx(expected_q, rel=1e-9)
        assert log_p[s] == pytest.approx(expected_p, rel=1e-9)


@pytest.mark.parametrize("per_unit", [False, True])
def test_monte_carlo_kl_averages_to_closed_form(per_unit):
    phi, precision, pseudo = _problem(6, per_unit=per_unit)
    covs, means = _numpy_posterior(phi, precision, pseudo, 4.0)
    k = covs.shape[1]
    p = 4.0
    closed = sum(
        0.5 * (p * np.trace(covs[u]) + p * means[:, u] @ means[:, u] - k - k * math.log(p) - np.linalg.slogdet(covs[u])[1])
        for u in range(covs.shape[0])
    )
    n = 20000
    chol, mean = _posterior(phi, precision, pseudo, p, samples=n)
    noise = keras.random.normal(tuple(mean.shape), dtype="float64", seed=7)
    w = inducing.sample_weights(chol, mean, noise)
    kl = ops.convert_to_numpy(inducing.log_posterior_density(chol, noise) - inducing.log_prior_density(w, p))
    assert abs(kl.mean() - closed) < 5 * kl.std() / math.sqrt(n)
    formula = ops.convert_to_numpy(inducing.gaussian_kl_full(chol[:1], mean[:1], p))[0]
    assert formula == pytest.approx(closed, rel=1e-9)


def _build(num_inducing, num_train, hidden=(8,), units=1, per_unit=False, samples=1, dtype=None, seed=0, **kw):
    precision = "per_unit" if per_unit else "shared"
    layers = [keras.Input((kw.pop("features", 1),))]
    for i, width in enumerate(hidden):
        extra = dict(num_inducing=num_inducing, regularizer=kd.NealPrior(num_train), num_samples=samples) if i == 0 else {}
        layers.append(kd.GlobalInducingDense(width, "relu", precision=precision, seed=seed + i, dtype=dtype, **extra))
    layers.append(kd.GlobalInducingDense(units, output_layer=True, precision=precision, seed=seed + 99, dtype=dtype))
    return keras.Sequential(layers + kw.pop("head", []))


def test_top_layer_is_bayesian_linear_regression_on_propagated_features(floatx):
    """U0 = X and V = Y: the output layer's posterior is eq. 8-9 on the features of X."""
    rng = np.random.default_rng(8)
    x = rng.standard_normal((12, 2))
    y = np.sin(x[:, :1]) + 0.1 * rng.standard_normal((12, 1))
    noise_var = 0.05
    model = _build(12, 12, hidden=(6,), features=2, dtype="float64")
    hidden, top = model.layers[0], model.layers[1]
    hidden.inducing_inputs.assign(x)
    top.pseudo_outputs.assign(y)
    top.scaled_log_precision.assign(np.full((12,), -math.log(noise_var) / top.log_precision_scale))
    chain = ops.convert_to_numpy(hidden(x))  # (M + B, 1, 6): inducing rows, then data rows
    np.testing.assert_allclose(chain[:12], chain[12:], rtol=0, atol=1e-12)  # same weights for both
    features = np.concatenate([chain[12:, 0], np.ones((12, 1))], axis=1)
    prior = top.prior_precision
    assert prior == 6.0  # NealPrior: 1 / fan_in
    sigma = np.linalg.inv(prior * np.eye(7) + features.T @ features / noise_var)
    mean = sigma @ features.T @ y / noise_var
    chol, got_mean = top.weight_posterior(ops.convert_to_tensor(chain[:12].transpose(1, 0, 2)))
    np.testing.assert_allclose(ops.convert_to_numpy(got_mean)[0], mean, rtol=1e-9)
    chol = ops.convert_to_numpy(chol)[0]
    np.testing.assert_allclose(np.linalg.inv(chol @ chol.T), sigma, rtol=1e-8, atol=1e-14)
    # The layer's own forward pass: outputs at the data are N(phi m, phi Sigma phi^T).
    n = 20000
    tiled = np.broadcast_to(chain, (24, n, 6))
    out = ops.convert_to_numpy(top(tiled))[:, :, 0]  # (B, n)
    sd = np.sqrt(np.einsum("bi,ij,bj->b", features, sigma, features))
    assert np.all(np.abs(out.mean(axis=1) - features @ mean[:, 0]) < 5 * sd / math.sqrt(n))
    assert np.all(np.abs(out.std(axis=1) / sd - 1.0) < 5 / math.sqrt(2 * n))


def _cubic_toy():
    """Ober & Aitchison's toy: 40 points, x ~ U([-4,-2] u [2,4]), y = x^3 + N(0, 3^2)."""
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.uniform(-4, -2, 20), rng.uniform(2, 4, 20)])[:, None]
    y = x**3 + 3.0 * rng.standard_normal(x.shape)
    return x, y


def _train_toy(steps, seed=1):
    x, y = _cubic_toy()
    xm, xs, ym, ys = x.mean(), x.std(), y.mean(), y.std()
    xn, yn = ((x - xm) / xs).astype("float32"), ((y - ym) / ys).astype("float32")
    keras.utils.set_random_seed(seed)
    model = _build(
        100, 40, hidden=(50, 50), samples=10, seed=seed,
        head=[kd.SampledHomoscedasticNoise(float(np.log(9.0 / ys**2)), trainable=False)],
    )
    model.compile(keras.optimizers.Adam(1e-2), loss=kd.SampledHeteroscedasticELL())
    kd.initialize_from_data(model, xn, yn, seed=0)
    data = tf.data.Dataset.from_tensor_slices((xn, yn)).batch(40).repeat()
    history = model.fit(data, steps_per_epoch=steps, epochs=1, verbose=0)
    return model, history, (xm, xs), xn, yn


@pytest.fixture(scope="module")
def trained_toy():
    return _train_toy(400)


@pytest.mark.heavy
def test_toy_in_between_uncertainty(trained_toy):
    model, history, (xm, xs), _, _ = trained_toy
    grid = np.array([-3.5, -3.0, -2.5, -1.0, -0.5, 0.0, 0.5, 1.0, 2.5, 3.0, 3.5])[:, None]
    samples = kd.predict_samples(model, ((grid - xm) / xs).astype("float32"), 400)
    assert samples.shape == (11, 400, 2)
    sd = np.sqrt(ops.convert_to_numpy(predictive.sampled_regression_moments(samples)["epistemic"]))[:, 0]
    at_data = sd[np.abs(grid[:, 0]) >= 2].mean()
    in_gap = sd[np.abs(grid[:, 0]) <= 1].mean()
    # Measured 2.5 after 400 steps (3.7 after 1000 epochs); a factorised posterior gives ~1.
    assert in_gap / at_data > 1.8


@pytest.mark.heavy
def test_training_is_finite_and_reports_kl(trained_toy):
    model, history, _, xn, yn = trained_toy
    for key in ("loss", "nll", "kl"):
        assert np.isfinite(history.history[key]).all()
    assert history.history["kl"][-1] > 0
    assert history.history["loss"][-1] == pytest.approx(history.history["nll"][-1] + history.history["kl"][-1], rel=1e-4)
    for v in model.weights:
        assert np.isfinite(ops.convert_to_numpy(v)).all(), v.path
    _, grads = model_gradients(model, xn, lambda out: kd.SampledHeteroscedasticELL()(yn, out), training=True)
    assert all(g is not None and np.isfinite(g).all() for g in grads)


@pytest.mark.heavy
def test_save_load_keeps_inducing_state_and_predictions(trained_toy, tmp_path):
    model, _, _, xn, _ = trained_toy
    loaded = reloaded(model, tmp_path, "gi")
    for a, b in zip(model.weights, loaded.weights):
        np.testing.assert_array_equal(ops.convert_to_numpy(a), ops.convert_to_numpy(b))
    first = loaded.layers[0]
    assert first.num_inducing == 100 and loaded.layers[1].num_inducing == 100
    for m in (model, loaded):
        kd.set_sampling_seed(m, 123)
    np.testing.assert_array_equal(model.predict(xn, verbose=0), loaded.predict(xn, verbose=0))
    kd.set_sampling_seed(model, 123)
    kd.set_sampling_seed(loaded, 124)  # a different seed draws different weights
    assert not np.array_equal(model.predict(xn, verbose=0), loaded.predict(xn, verbose=0))


def test_per_unit_precision_and_classification_train():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((64, 2)).astype("float32")
    labels = (x[:, 0] * x[:, 1] > 0).astype("int32")
    keras.utils.set_random_seed(0)
    model = _build(16, 64, hidden=(16,), units=2, per_unit=True, samples=4, features=2)
    model.compile(keras.optimizers.Adam(1e-2), loss=kd.SampledSoftmaxELL())
    kd.initialize_from_data(model, x, labels, seed=0)
    assert model.layers[-1].scaled_log_precision.shape == (16, 2)
    history = model.fit(x, labels, epochs=60, batch_size=64, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    assert history.history["loss"][-1] < history.history["loss"][0]
    probs = ops.convert_to_numpy(predictive.sampled_class_probabilities(kd.predict_samples(model, x, 32)))
    np.testing.assert_allclose(probs.sum(axis=1), 1.0, rtol=1e-5)
    assert (probs.argmax(axis=1) == labels).mean() > 0.7


def test_functional_model_float64_and_samples_axis(floatx):
    inputs = keras.Input((3,), dtype="float64")
    h = keras.layers.Dense(4, dtype="float64")(inputs)  # deterministic features first
    h = kd.GlobalInducingDense(5, "tanh", num_inducing=6, regularizer=kd.NealPrior(10), num_samples=3, dtype="float64")(h)
    out = kd.GlobalInducingDense(2, output_layer=True, dtype="float64")(h)
    model = keras.Model(inputs, out)
    x = np.random.default_rng(0).standard_normal((10, 3))
    y = model.predict(x, verbose=0)
    assert y.shape == (10, 3, 2) and y.dtype == np.float64
    kd.initialize_from_data(model, x, x[:, :2], seed=1)
    features = keras.Model(inputs, model.layers[1].output).predict(x, verbose=0)
    assert np.isin(ops.convert_to_numpy(model.layers[2].inducing_inputs)[:, 0], features[:, 0]).all()
    assert kd.predict_samples(model, x, 7).shape == (10, 7, 2)
    assert model.predict(x, verbose=0).shape == (10, 3, 2)  # the model's own setting is back


def test_fresh_randomness_and_seeded_reproducibility():
    x = np.linspace(-1, 1, 5)[:, None].astype("float32")
    a = _build(4, 5, seed=11)
    b = _build(4, 5, seed=11)
    b.set_weights(a.get_weights())
    first, second = a.predict(x, verbose=0), a.predict(x, verbose=0)
    assert not np.allclose(first, second)  # new weights every call
    np.testing.assert_array_equal(first, b.predict(x, verbose=0))  # same seed, same draws


@pytest.mark.tensorflow_only  # jit_compile on the TensorFlow backend
def test_xla_trains_and_matches_the_graph_predictive():
    """XLA draws other random numbers than TF kernels, so compare distributions."""
    x = np.random.default_rng(1).standard_normal((20, 2)).astype("float32")
    y = x[:, :1] ** 2
    keras.utils.set_random_seed(4)
    model = _build(8, 20, hidden=(8,), features=2, samples=2, head=[kd.SampledHomoscedasticNoise()])
    model.compile(keras.optimizers.Adam(1e-2), loss=kd.SampledHeteroscedasticELL(), jit_compile=True)
    history = model.fit(x, y, epochs=20, batch_size=10, verbose=0).history
    assert np.isfinite(history["loss"]).all() and history["loss"][-1] < history["loss"][0]
    xla = kd.predict_samples(model, x[:4], 4000)[..., 0]
    model.compile(keras.optimizers.Adam(1e-2), loss=kd.SampledHeteroscedasticELL(), jit_compile=False)
    graph = kd.predict_samples(model, x[:4], 4000)[..., 0]
    se = np.sqrt((xla.var(axis=1) + graph.var(axis=1)) / 4000)
    assert np.all(np.abs(xla.mean(axis=1) - graph.mean(axis=1)) < 5 * se)
    assert np.all(np.abs(xla.std(axis=1) / graph.std(axis=1) - 1) < 5 * math.sqrt(2 / 4000))


def test_config_round_trip():
    layer = kd.GlobalInducingDense(
        7, "relu", num_inducing=5, regularizer=kd.StandardPrior(30, kl_weight=0.5, kl_warmup_steps=10),
        precision="per_unit", num_samples=2, initial_log_precision=-2.0, log_precision_scale=2.0, seed=3,
        validate=True,
    )
    config = layer.get_config()
    clone = kd.GlobalInducingDense.from_config(config)
    assert clone.get_config() == config
    assert isinstance(clone.regularizer, kd.StandardPrior) and clone.num_train == 30
    assert (clone.regularizer.kl_weight, clone.regularizer.kl_warmup_steps) == (0.5, 10)
    noise = kd.SampledHomoscedasticNoise(-3.0, log_variance_scale=10.0)
    assert kd.SampledHomoscedasticNoise.from_config(noise.get_config()).get_config() == noise.get_config()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(units=0), "units"),
        (dict(units=3, precision="full"), "precision"),
        (dict(units=3, regularizer="laplace"), "regularizer"),
        (dict(units=3, regularizer=kd.EmpiricalBayesRegularizer(4)), "NealPrior"),
        (dict(units=3, num_inducing=0), "num_inducing"),
        (dict(units=3, num_samples=0), "num_samples"),
        (dict(units=3, log_precision_scale=0), "log_precision_scale"),
    ],
)
def test_bad_constructor_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        kd.GlobalInducingDense(**kwargs)


def test_weight_prior_arguments():
    with pytest.raises(ValueError, match="num_train"):
        kd.NealPrior(num_train=-1)
    with pytest.raises(ValueError, match="kl_weight"):
        kd.StandardPrior(4, kl_weight=0)
    with pytest.raises(ValueError, match="kl_warmup_steps"):
        kd.NealPrior(4, kl_warmup_steps=-1)
    assert kd.NealPrior(4).with_num_train(9).num_train == 9


def test_wiring_errors():
    with pytest.raises(ValueError, match="num_inducing"):
        keras.Sequential([keras.Input((2,)), kd.GlobalInducingDense(3, regularizer=kd.NealPrior(4))])
    with pytest.raises(ValueError, match=r"regularizer=keras_dvi\.NealPrior\(num_train=len\(x_train\)\)"):
        keras.Sequential([keras.Input((2,)), kd.GlobalInducingDense(3, num_inducing=4)])
    with pytest.raises(ValueError, match="output_layer"):
        keras.Sequential([
            keras.Input((2,)),
            kd.GlobalInducingDense(3, num_inducing=4, regularizer=kd.NealPrior(4), output_layer=True),
            kd.GlobalInducingDense(3),
        ])
    with pytest.raises(ValueError, match="num_train"):
        keras.Sequential([
            keras.Input((2,)), kd.GlobalInducingDense(3, num_inducing=4, regularizer=kd.NealPrior(4)),
            kd.GlobalInducingDense(3, regularizer=kd.NealPrior(5)),
        ])
    layer = kd.GlobalInducingDense(3, num_inducing=4, regularizer=kd.NealPrior(4), output_layer=True)
    with pytest.raises(ValueError, match="inputs"):
        layer(np.array([[np.nan, 1.0]], dtype="float32"))


def test_loss_errors_name_the_problem():
    x = np.zeros((5, 1), dtype="float32")
    not_output = keras.Sequential([keras.Input((1,)), kd.GlobalInducingDense(2, num_inducing=3, regularizer=kd.NealPrior(5))])
    with pytest.raises(ValueError, match="output_layer=True"):
        kd.SampledHeteroscedasticELL()(x, not_output(x))
    with pytest.raises(ValueError, match="even number"):
        kd.SampledHeteroscedasticELL()(x, np.zeros((5, 2, 3), "float32"))
    with pytest.raises(ValueError, match=r"\(batch, samples, units\)"):
        kd.SampledSoftmaxELL()(x, np.zeros((5, 3), "float32"))
    with pytest.raises(ValueError, match="y_true"):
        kd.SampledHeteroscedasticELL()(np.full((5, 1), np.nan, "float32"), np.zeros((5, 2, 2), "float32"))


def test_sampled_losses_and_predictive_match_hand_computation():
    rng = np.random.default_rng(9)
    f = rng.standard_normal((4, 5, 1))
    log_var = rng.uniform(-2, 1, (4, 5, 1))
    y = rng.standard_normal((4, 1))
    out = np.concatenate([f, log_var], axis=-1)
    dens = stats.norm(f, np.sqrt(np.exp(log_var))).logpdf(y[:, None, :])[..., 0]  # (4, 5)
    nll = ops.convert_to_numpy(kd.SampledHeteroscedasticELL(reduction=None)(y, out))
    np.testing.assert_allclose(nll, -dens.mean(axis=1), rtol=1e-6)
    lpd = ops.convert_to_numpy(predictive.sampled_log_predictive_density(out, y, y_scale=2.0))
    np.testing.assert_allclose(lpd, np.log(np.exp(dens).mean(axis=1)) - math.log(2.0), rtol=1e-6)
    mom = predictive.sampled_regression_moments(out)
    np.testing.assert_allclose(ops.convert_to_numpy(mom["variance"])[:, 0], f[..., 0].var(axis=1) + np.exp(log_var[..., 0]).mean(axis=1), rtol=1e-6)
    logits = rng.standard_normal((4, 5, 3))
    labels = np.array([0, 2, 1, 1])
    soft = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    nll = ops.convert_to_numpy(kd.SampledSoftmaxELL(reduction=None)(labels, logits))
    np.testing.assert_allclose(nll, -np.log(soft[np.arange(4), :, labels]).mean(axis=1), rtol=1e-6)


def test_large_precisions_and_far_inputs_stay_finite():
    """Cholesky of A = p I + Phi^T Lambda Phi with lambda up to e^12 and inputs of 1e3."""
    model = _build(6, 10, hidden=(8,), features=2)
    for layer in model.layers:
        layer.scaled_log_precision.assign(np.full(layer.scaled_log_precision.shape, 12.0 / layer.log_precision_scale))
    model.layers[0].inducing_inputs.assign(np.random.default_rng(0).standard_normal((6, 2)) * 30)
    x = np.array([[1e3, -1e3], [0.0, 0.0], [1e-3, 1e-3]], dtype="float32")
    out, grads = model_gradients(model, x)
    assert np.isfinite(out).all()
    assert all(np.isfinite(g).all() for g in grads)


def test_float32_round_off_of_the_gram_matrix_does_not_break_the_factor():
    """A small prior precision (a learned `ScalePrior` scale), precisions up to e^7.75 and
    inducing features spanning 21 of 51 directions: the float32 Gram matrix is indefinite by
    its round-off and, without `precision_matrix`'s jitter, every one of these draws fails
    (checked). With it the factor and draws are finite, the gradients too, and the posterior
    mean's fit at the inducing points matches a float64 dense solve (no jitter)."""
    m, p, prior = 100, 51, 0.01
    for seed in range(5):
        rng = np.random.default_rng(seed)
        phi = np.ones((m, p))
        phi[:, :50] = rng.standard_normal((m, 20)) @ rng.standard_normal((20, 50))
        lam = np.exp(rng.uniform(0.0, 7.75, m))
        v = rng.standard_normal((m, 2))
        arrays = [a.astype("float32") for a in (phi[None], lam, v)]
        noise = ops.convert_to_tensor(rng.standard_normal((1, p, 2)).astype("float32"))

        def objective(*tensors):
            chol, weights = inducing.posterior_sample(*tensors, prior, noise)
            return ops.sum(inducing.log_posterior_density(chol, noise)) + ops.sum(weights)

        tensors = [ops.convert_to_tensor(a) for a in arrays]
        draw = inducing.posterior_sample(*tensors, prior, noise)
        assert all(np.isfinite(to_numpy(t)).all() for t in draw)
        value, grads = gradients(objective, arrays)
        assert np.isfinite(value) and all(np.isfinite(g).all() for g in grads)
        _, mean = inducing.weight_posterior(*tensors, prior)
        a = prior * np.eye(p) + phi.T @ (lam[:, None] * phi)
        exact = phi @ np.linalg.solve(a, phi.T @ (lam[:, None] * v))
        np.testing.assert_allclose(phi @ ops.convert_to_numpy(mean)[0], exact, atol=1e-2)


def test_precision_matrix_jitter_is_four_epsilon_times_the_trace():
    """Integer features and unit precisions make the Gram matrix exact in float64, and zero
    features make `A = p I` exact in float32, so what `precision_matrix` adds is measured alone
    (resolution: the spacing of floats at `A`'s diagonal, a fifth of the jitter here)."""
    rng = np.random.default_rng(3)
    phi = rng.integers(-3, 4, (2, 6, 4)).astype("float64")
    for dtype, features in (("float64", phi), ("float32", np.zeros_like(phi))):
        a = ops.convert_to_numpy(inducing.precision_matrix(ops.convert_to_tensor(features.astype(dtype)),
                                                           ops.convert_to_tensor(np.ones(6, dtype)), 2.0))
        exact = 2.0 * np.eye(4) + np.einsum("smi,smj->sij", features, features)
        jitter = 4.0 * np.finfo(dtype).eps * np.trace(exact, axis1=1, axis2=2)
        added = a.astype("float64") - exact
        np.testing.assert_array_equal(added * (1 - np.eye(4)), 0.0)
        np.testing.assert_allclose(np.diagonal(added, axis1=1, axis2=2), np.broadcast_to(jitter[:, None], (2, 4)),
                                   rtol=0.25)


# ---------------------------------------------------------------- ScalePrior (eqs. 16-18)


def test_log_gamma_and_gamma_density_match_scipy():
    """`priors.log_gamma` (Stirling's series after a shift; `keras.ops` has no lgamma) against
    scipy's `gammaln`, its gradient against `digamma`, and `gamma_log_density` against
    `scipy.stats.gamma`."""
    from scipy import special

    from keras_dvi.priors import gamma_log_density, log_gamma
    from tests.conftest import gradients

    x = np.array([0.05, 0.5, 1.0, 2.0, 3.7, 11.0, 405.0, 1e5])
    np.testing.assert_allclose(ops.convert_to_numpy(log_gamma(x)), special.gammaln(x), rtol=1e-10, atol=1e-10)
    _, (grad,) = gradients(lambda t: ops.sum(log_gamma(t)), [x])
    np.testing.assert_allclose(grad, special.digamma(x), rtol=1e-8, atol=1e-8)
    s, shape, rate = np.array([0.3, 1.0, 2.5]), np.array([2.0, 7.5, 405.0]), np.array([2.0, 3.0, 400.0])
    np.testing.assert_allclose(ops.convert_to_numpy(gamma_log_density(s, shape, rate)),
                               stats.gamma.logpdf(s, shape, scale=1.0 / rate), rtol=1e-9)


def _gamma_kl(a_q, b_q, a_p, b_p):
    """KL(Gamma(a_q, b_q) || Gamma(a_p, b_p)), shape and rate, in closed form (scipy's digamma)."""
    from scipy import special

    return ((a_q - a_p) * special.digamma(a_q) - special.gammaln(a_q) + special.gammaln(a_p)
            + a_p * (math.log(b_q) - math.log(b_p)) + a_q * (b_p - b_q) / b_q)


@pytest.mark.parametrize("per_unit", [False, True])
def test_scale_prior_kl_averages_to_closed_form(per_unit):
    """The Monte Carlo KL of a `ScalePrior` layer, `log q(W | s) q(s) - log p(W | s) p(s)` at
    draws `s ~ q(s)` and `W ~ q(W | s)` (the global inducing posterior under the prior precision
    `s fan_in`, one per draw), averages to `E_s[KL(q(W | s) || p(W | s))] + KL(q(s) || p(s))`:
    the first term by the closed form per draw, the second by the Gamma KL's closed form."""
    phi, precision, pseudo = _problem(9, per_unit=per_unit)
    fan_in = phi.shape[1] - 1
    prior = kd.ScalePrior(10, shape=2.0, rate=2.0)
    log_alpha, log_beta = np.float64(math.log(3.0)), np.float64(math.log(1.5))
    n = 20000
    s, log_ratio_s = prior.sample_scale(ops.convert_to_tensor(log_alpha), ops.convert_to_tensor(log_beta), n,
                                        "float64", keras.random.SeedGenerator(4))
    p = s * float(fan_in)
    phi_t = ops.convert_to_tensor(np.broadcast_to(phi, (n,) + phi.shape))
    noise = keras.random.normal((n,) + (phi.shape[1], pseudo.shape[1]), dtype="float64", seed=5)
    chol, w = inducing.posterior_sample(phi_t, ops.convert_to_tensor(precision), ops.convert_to_tensor(pseudo), p,
                                        noise)
    mc = inducing.log_posterior_density(chol, noise) - inducing.log_prior_density(w, p) - log_ratio_s
    _, mean = inducing.weight_posterior(phi_t, ops.convert_to_tensor(precision), ops.convert_to_tensor(pseudo), p)
    closed_w = inducing.gaussian_kl_full(chol, mean, p)  # (n,): per draw of s
    diff = ops.convert_to_numpy(mc - closed_w)
    expected = _gamma_kl(2.0 + 3.0, 2.0 + 1.5, 2.0, 2.0)
    assert abs(diff.mean() - expected) < 5 * diff.std() / math.sqrt(n)
    s = ops.convert_to_numpy(s)  # the draws follow q(s) = Gamma(5, 3.5)
    assert stats.kstest(s, stats.gamma(5.0, scale=1.0 / 3.5).cdf).pvalue > 1e-3
    # One prior precision per sample gives each sample the posterior of its own precision
    # (eq. 11 by dense inverses): the KL above cannot see a q(W | s) built with the wrong one.
    chol3, mean3 = inducing.weight_posterior(phi_t[:3], ops.convert_to_tensor(precision),
                                             ops.convert_to_tensor(pseudo), p[:3])
    for i in range(3):
        covs, means = _numpy_posterior(phi, precision, pseudo, float(s[i]) * fan_in)
        np.testing.assert_allclose(ops.convert_to_numpy(mean3)[i], means, rtol=1e-8, atol=1e-10)
        factor = ops.convert_to_numpy(chol3)[i]
        factor = factor if factor.ndim == 3 else factor[None]
        for u in range(covs.shape[0]):
            a = factor[min(u, len(factor) - 1)]
            np.testing.assert_allclose(np.linalg.inv(a @ a.T), covs[u], rtol=1e-8, atol=1e-10)


def test_scale_prior_trains_saves_and_loads(tmp_path):
    """Each `GlobalInducingDense` layer under a `ScalePrior` learns its own `q(s)` (two weights,
    starting at `log alpha = log beta = 6`), trains with a finite loss, and round-trips `.keras`
    with the same predictions under a sampling seed."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 2)).astype("float32")
    y = np.sin(x[:, :1]).astype("float32")
    model = keras.Sequential([
        keras.Input((2,)),
        kd.GlobalInducingDense(8, "relu", num_inducing=16, regularizer=kd.ScalePrior(64), num_samples=2, seed=1),
        kd.GlobalInducingDense(1, output_layer=True, seed=2),
        kd.SampledHomoscedasticNoise(),
    ])
    model.compile(keras.optimizers.Adam(3e-2), loss=kd.SampledHeteroscedasticELL())
    history = model.fit(x, y, epochs=8, batch_size=32, verbose=0).history
    assert np.isfinite(history["loss"]).all() and history["kl"][-1] > 0
    for layer in model.layers[:2]:
        assert isinstance(layer.regularizer, kd.ScalePrior)
        assert float(ops.convert_to_numpy(layer.scale_log_alpha)) != 6.0  # q(s) is learned
    loaded = reloaded(model, tmp_path, "scale")
    for a, b in zip(model.weights, loaded.weights):
        np.testing.assert_array_equal(ops.convert_to_numpy(a), ops.convert_to_numpy(b))
    for m in (model, loaded):
        kd.set_sampling_seed(m, 7)
    np.testing.assert_array_equal(model.predict(x, verbose=0), loaded.predict(x, verbose=0))
    with pytest.raises(ValueError, match="shape"):
        kd.ScalePrior(10, shape=0.0)
    with pytest.raises(ValueError, match="rate"):
        kd.ScalePrior(10, rate=-1.0)
    assert isinstance(kd.priors.get_weight_prior("scale"), kd.ScalePrior)
