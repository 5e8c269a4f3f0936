"""The priors against closed forms and Monte Carlo (the empirical Bayes prior variance, the KL),
and the objective `fit` minimises: `nll + KL / N`, logged in its parts."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from scipy import optimize, stats

from keras_dvi import (
    DenseDiagDVI,
    DenseDVI,
    EmpiricalBayesRegularizer,
    GaussianPriorRegularizer,
    HeteroscedasticELL,
    NealPrior,
    ScalePriorRegularizer,
    SoftmaxDeltaELL,
    predictive,
    unpack,
)
from keras_dvi.objective import describe
from tests.conftest import reloaded, to_numpy


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
    neal = GaussianPriorRegularizer(50, per_fan_in=True)  # Ober & Aitchison's NealPrior: N(0, 1 / fan_in)
    for reg, prior_var in ((eb, s_star), (GaussianPriorRegularizer(50, 0.7), 0.7), (neal, 1.0 / 4)):
        kl = float(to_numpy(reg.kl(t(mean), t(var), 4)))
        mc, se = _mc_kl(rng, mean, var, prior_var)
        assert abs(kl - mc) <= 5 * se
        np.testing.assert_allclose(float(to_numpy(reg(t(mean), t(var), 4))), kl / 50, rtol=1e-6)


def _scale_prior_objective(mean, var, fan_in, a, b, shape, rate):
    """Independent oracle for `ScalePriorRegularizer`: `E_q(s)[KL(q(w) || N(0, 1 / (s fan_in)))]
    + KL(Gamma(a, b) || Gamma(shape, rate))` for any `q(s) = Gamma(a, b)`, both by quadrature."""
    from scipy import integrate

    q, p = stats.gamma(a, scale=1 / b), stats.gamma(shape, scale=1 / rate)
    lo, hi = q.ppf(1e-12), q.ppf(1 - 1e-12)

    def kl_given(s):
        prior_var = 1.0 / (s * fan_in)
        return 0.5 * np.sum(np.log(prior_var / var) - 1 + (var + mean**2) / prior_var)

    expected = integrate.quad(lambda s: q.pdf(s) * kl_given(s), lo, hi, epsabs=1e-11, epsrel=1e-11, limit=200)[0]
    kl_s = integrate.quad(lambda s: q.pdf(s) * (q.logpdf(s) - p.logpdf(s)), lo, hi, epsabs=1e-11, epsrel=1e-11,
                          limit=200)[0]
    return expected + kl_s


@pytest.mark.parametrize("shape, rate, fan_in", [(2.0, 2.0, 5), (3.0, 0.5, 1)])
def test_scale_prior_kl_is_the_minimum_over_gamma_posteriors(shape, rate, fan_in):
    """The closed form is the quadrature objective at its minimum over every `Gamma(a, b)`
    posterior of the scale (found by a numerical search, not the formula), and that minimum
    is where `scale_posterior` puts it."""
    rng = np.random.default_rng(9)
    mean = rng.normal(size=(5, 3)) * 0.4
    var = rng.uniform(0.02, 0.3, size=(5, 3))
    reg = ScalePriorRegularizer(num_train=40, shape=shape, rate=rate)
    t = lambda a: keras.ops.convert_to_tensor(a)  # noqa: E731
    closed = float(to_numpy(reg.kl(t(mean), t(var), fan_in)))
    search = optimize.minimize(lambda z: _scale_prior_objective(mean, var, fan_in, *np.exp(z), shape, rate),
                               x0=np.log([shape, rate]), method="Nelder-Mead",
                               options={"xatol": 1e-6, "fatol": 1e-9, "maxiter": 4000})
    np.testing.assert_allclose(closed, search.fun, rtol=1e-5)
    a, b = reg.scale_posterior(t(mean), t(var), fan_in)
    np.testing.assert_allclose([a, float(to_numpy(b))], np.exp(search.x), rtol=1e-3)
    np.testing.assert_allclose(float(to_numpy(reg(t(mean), t(var), fan_in))), closed / 40, rtol=1e-6)


@pytest.mark.filterwarnings("ignore:The classifier")  # three epochs on 64 rows: at its prior
def test_scale_prior_trains_and_saves(tmp_path):
    """A network under the scale prior trains to finite losses and round-trips through `.keras`."""
    rng = np.random.default_rng(10)
    x = rng.normal(size=(64, 2)).astype("float32")
    y = (x[:, 0] > 0).astype("int32")
    model = _toy_model(ScalePriorRegularizer(num_train=64, rate=1.5), DenseDiagDVI)
    model.compile(keras.optimizers.Adam(1e-2), loss=SoftmaxDeltaELL())
    history = model.fit(x, y, epochs=3, batch_size=32, verbose=0).history
    assert np.all(np.isfinite(history["loss"])) and history["kl"][-1] > 0
    loaded = reloaded(model, tmp_path, "scale")
    assert loaded.layers[0].regularizer.get_config() == model.layers[0].regularizer.get_config()
    np.testing.assert_allclose(to_numpy(loaded(x)), to_numpy(model(x)), rtol=1e-6)


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
    for kwargs in ({"shape": 0}, {"rate": -2}):
        with pytest.raises(ValueError, match=next(iter(kwargs))):
            ScalePriorRegularizer(10, **kwargs)
    with pytest.raises(ValueError, match="regularizer"):
        DenseDVI(3, regularizer=keras.regularizers.L2(0.1))


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


@pytest.mark.filterwarnings("ignore:The classifier")  # one step at a learning rate of 0: at its prior
@pytest.mark.parametrize("task, n_train", [("classifier", 64), ("classifier", 100_000), ("regression", 64)])
def test_auto_kl_weight_is_n_over_p_for_classifiers(task, n_train, tmp_path):
    """`kl_weight="auto"`: the KL enters `fit`'s and `evaluate`'s loss with weight
    `min(1, N / P)` (`P` counted here from the layers' shapes) in a classifier, and 1 in a
    regression network; `describe` states it, before and after `compile`, and the setting
    survives a `.keras` round trip."""
    rng = np.random.default_rng(11)
    x = rng.normal(size=(32, 2)).astype("float32")
    classifier = task == "classifier"
    y = (x[:, 0] > 0).astype("int32") if classifier else rng.normal(size=(32,)).astype("float32")
    prior = EmpiricalBayesRegularizer(num_train=n_train, kl_weight="auto", kl_warmup_steps=0)
    model = _toy_model(prior)
    weights = (2 * 8 + 8) + (8 * 8 + 8) + (8 * 2 + 2)  # kernels and biases of 2-8-8-2
    assert f"min(1, N / P) = {min(1.0, n_train / weights):.3g} for P = {weights}" in describe(model)
    model.compile(keras.optimizers.SGD(0.0), loss=SoftmaxDeltaELL() if classifier else HeteroscedasticELL())
    expected = min(1.0, n_train / weights) if classifier else 1.0
    history = model.fit(x, y, batch_size=32, epochs=1, verbose=0).history
    kl = sum(_numpy_eb_kl(layer) for layer in model.layers) / n_train
    np.testing.assert_allclose(history["kl"][0], kl, rtol=1e-5)
    np.testing.assert_allclose(history["loss"][0], history["nll"][0] + expected * kl, rtol=1e-5)
    results = model.evaluate(x, y, batch_size=32, verbose=0, return_dict=True)
    np.testing.assert_allclose(results["loss"], results["nll"] + expected * kl, rtol=1e-5)
    text = describe(model)
    assert f"nll + {expected:.3g} * KL / {n_train}" in text
    assert ("tempered posterior" in text) == (expected < 1)
    assert (f"P = {weights} weights" in text) == classifier
    loaded = reloaded(model, tmp_path, "auto")
    assert loaded.layers[0].regularizer.kl_weight == "auto"
    assert describe(loaded) == text


def test_defaults_state_the_rule_and_the_elbo_stays_one_argument_away(tmp_path):
    """The closed-form priors default to `kl_weight="auto"` (global inducing priors to 1) and
    `SoftmaxDeltaELL` to Jankowiak's bound; `kl_weight=1` asks for the full ELBO of a classifier,
    and a saved model keeps the weight it was trained with (the config stores it), so a file
    saved with `kl_weight=1.0` reloads on the ELBO."""
    for prior in (EmpiricalBayesRegularizer(10), GaussianPriorRegularizer(10), ScalePriorRegularizer(10)):
        assert prior.kl_weight == "auto"
    assert NealPrior(10).kl_weight == 1.0
    assert SoftmaxDeltaELL().method == "jankowiak"
    texts = {}
    for setting in ({}, {"kl_weight": 1.0}):
        model = _toy_model(EmpiricalBayesRegularizer(num_train=64, kl_warmup_steps=0, **setting))
        model.compile(keras.optimizers.SGD(0.0), loss=SoftmaxDeltaELL())
        texts[bool(setting)] = describe(model)
        loaded = reloaded(model, tmp_path, "model")
        assert loaded.layers[0].regularizer.kl_weight == setting.get("kl_weight", "auto")
        assert describe(loaded) == texts[bool(setting)]
    assert "a tempered posterior" in texts[False] and "kl_weight='auto' for a classifier" in texts[False]
    assert "nll + 1 * KL / 64: the ELBO" in texts[True] and "kl_weight=1" in texts[True]


def test_kl_weight_argument_errors():
    with pytest.raises(ValueError, match="kl_weight.*'auto'"):
        EmpiricalBayesRegularizer(10, kl_weight="full")
    with pytest.raises(ValueError, match="kl_weight.*closed-form priors"):
        NealPrior(10, kl_weight="auto")
    for value in (0, -1.0):
        with pytest.raises(ValueError, match="kl_weight"):
            GaussianPriorRegularizer(10, kl_weight=value)


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
