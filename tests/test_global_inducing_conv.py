"""`GlobalInducingConv2D` (Ober & Aitchison 2021, Sec. 3): its posterior is Bayesian linear
regression of the kernel on the inducing feature maps' patches, extracted here by explicit
loops in NumPy; its draws match that posterior by Monte Carlo (means, variances, the KL);
the inducing images and the data share each draw; networks with pooling and a residual add
train, save, load and predict the same numbers."""

import math

import keras
import numpy as np
import pytest
from keras import ops

import keras_dvi as kd
from tests.conftest import reloaded
from tests.test_global_inducing import _numpy_posterior


def _numpy_patches(x, kernel, strides, padding):
    """`(n, out_h * out_w, kh * kw * c)` patches by loops over positions (Keras' "same": the
    extra padding after), rows in (kh, kw, c) order."""
    n, h, w, c = x.shape
    outs, pads = [], []
    for size, k, s in zip((h, w), kernel, strides):
        out = -(-size // s) if padding == "same" else (size - k) // s + 1
        total = max((out - 1) * s + k - size, 0) if padding == "same" else 0
        outs.append(out)
        pads.append((total // 2, total - total // 2))
    xp = np.pad(x, [(0, 0), pads[0], pads[1], (0, 0)])
    rows = np.empty((n, outs[0] * outs[1], kernel[0] * kernel[1] * c))
    for i in range(outs[0]):
        for j in range(outs[1]):
            window = xp[:, i * strides[0]:i * strides[0] + kernel[0], j * strides[1]:j * strides[1] + kernel[1]]
            rows[:, i * outs[1] + j] = window.reshape(n, -1)
    return rows, tuple(outs)


def _layer(shape, filters, per_unit=False, seed=0, **kwargs):
    keras.config.set_floatx("float64")
    layer = kd.GlobalInducingConv2D(filters, num_inducing=3, regularizer=kd.NealPrior(50), seed=seed,
                                    precision="per_unit" if per_unit else "shared", dtype="float64", **kwargs)
    layer.build((None,) + shape)
    rng = np.random.default_rng(seed)
    layer.pseudo_outputs.assign(rng.standard_normal(layer.pseudo_outputs.shape))
    layer.scaled_log_precision.assign(rng.uniform(-0.5, 0.5, layer.scaled_log_precision.shape))
    layer.inducing_inputs.assign(rng.standard_normal(layer.inducing_inputs.shape))
    return layer


def _explicit_posterior(layer, features):
    """Sigma_w and M_w of the layer by dense inverses on explicit patches of `features`
    `(M, h, w, c)`: one regression row per (inducing image, position)."""
    rows, outs = _numpy_patches(features, layer.kernel_size, layer.strides, layer.padding)
    positions = outs[0] * outs[1]
    phi = rows.reshape(-1, rows.shape[-1])
    if layer.use_bias:
        phi = np.concatenate([phi, np.ones((len(phi), 1))], axis=1)
    precision = np.exp(ops.convert_to_numpy(layer.log_precision))
    precision = np.repeat(precision, positions, axis=0)
    pseudo = ops.convert_to_numpy(layer.pseudo_outputs).reshape(-1, layer.filters)
    return _numpy_posterior(phi, precision, pseudo, float(layer.fan_in))


@pytest.mark.parametrize("per_unit, kwargs", [
    (False, dict(kernel_size=3)),
    (True, dict(kernel_size=3)),
    (False, dict(kernel_size=(3, 2), strides=2, padding="valid", use_bias=False)),
    (False, dict(kernel_size=2, strides=(2, 1), padding="same")),
])
def test_posterior_is_regression_on_explicit_patches(per_unit, kwargs):
    layer = _layer((5, 6, 2), 3, per_unit=per_unit, **kwargs)
    features = np.random.default_rng(1).standard_normal((2, 3, 5, 6, 2))  # 2 samples of M = 3 maps
    chol, mean = layer.weight_posterior(ops.convert_to_tensor(features))
    chol, mean = ops.convert_to_numpy(chol), ops.convert_to_numpy(mean)
    for s in range(2):
        covs, means = _explicit_posterior(layer, features[s])
        np.testing.assert_allclose(mean[s], means, rtol=1e-9, atol=1e-11)
        factors = chol[s] if per_unit else [chol[s]] * layer.filters
        for u in range(layer.filters):
            np.testing.assert_allclose(np.linalg.inv(factors[u] @ factors[u].T), covs[u], rtol=1e-8, atol=1e-10)


def test_inducing_images_and_data_share_each_draw():
    """With a linear activation the outputs are `patches @ W` for one draw `W` per sample: `W`
    recovered by least squares from the data's outputs reproduces the inducing images'."""
    layer = _layer((6, 6, 2), 3, kernel_size=3, num_samples=2)
    x = np.random.default_rng(2).standard_normal((4, 6, 6, 2))
    out = ops.convert_to_numpy(layer(x))  # (M + batch, samples, 6, 6, 3)
    assert out.shape == (7, 2, 6, 6, 3)
    u0 = ops.convert_to_numpy(layer.inducing_inputs)
    data_rows = _numpy_patches(x, (3, 3), (1, 1), "same")[0].reshape(-1, 18)
    inducing_rows = _numpy_patches(u0, (3, 3), (1, 1), "same")[0].reshape(-1, 18)
    ones = lambda r: np.concatenate([r, np.ones((len(r), 1))], axis=1)  # noqa: E731
    for s in range(2):
        w, *_ = np.linalg.lstsq(ones(data_rows), out[3:, s].reshape(-1, 3), rcond=None)
        np.testing.assert_allclose(ones(data_rows) @ w, out[3:, s].reshape(-1, 3), atol=1e-9)
        np.testing.assert_allclose(ones(inducing_rows) @ w, out[:3, s].reshape(-1, 3), atol=1e-9)
    assert not np.allclose(out[:, 0], out[:, 1])  # a new draw per sample


def test_draws_and_kl_match_the_posterior_by_monte_carlo():
    """1,000 draws: the data outputs' mean and variance at every position against the
    explicit posterior's `phi^T M_w` and `phi^T Sigma_w phi`, the reported KL against the
    closed-form Gaussian KL (5 standard errors; the KL's spread from NumPy draws of the same
    posterior)."""
    samples = 1000
    layer = _layer((4, 4, 2), 2, kernel_size=3, num_samples=samples)
    x = np.random.default_rng(3).standard_normal((2, 4, 4, 2))
    out = ops.convert_to_numpy(layer(x))[3:].reshape(2, samples, 16, 2)
    covs, means = _explicit_posterior(layer, ops.convert_to_numpy(layer.inducing_inputs))
    rows = _numpy_patches(x, (3, 3), (1, 1), "same")[0]
    rows = np.concatenate([rows, np.ones(rows.shape[:-1] + (1,))], axis=-1)  # (2, 16, 19)
    expected_mean = rows @ means
    expected_var = np.einsum("npi,ij,npj->np", rows, covs[0], rows)[..., None]
    se = np.sqrt(expected_var / samples)
    assert np.all(np.abs(out.mean(axis=1) - expected_mean) < 5 * se)
    np.testing.assert_allclose(out.var(axis=1), np.broadcast_to(expected_var, out.var(axis=1).shape),
                               rtol=5 * np.sqrt(2.0 / samples))
    # the KL: closed form, and the spread of log q - log p over draws of the same posterior
    p = float(layer.fan_in)
    size, units = means.shape
    chol = np.linalg.cholesky(covs[0])
    rng = np.random.default_rng(4)
    eps = rng.standard_normal((20000, size, units))
    w = means + np.einsum("ij,sju->siu", chol, eps)
    log_q = -0.5 * (eps ** 2).sum(axis=(1, 2)) - units * np.log(np.diag(chol)).sum() - 0.5 * size * units * np.log(2 * np.pi)
    log_p = -0.5 * p * (w ** 2).sum(axis=(1, 2)) + 0.5 * size * units * (np.log(p) - np.log(2 * np.pi))
    closed = 0.5 * units * (p * np.trace(covs[0]) - size - size * np.log(p) - np.linalg.slogdet(covs[0])[1]) \
        + 0.5 * p * (means ** 2).sum()
    assert abs((log_q - log_p).mean() - closed) < 5 * (log_q - log_p).std() / np.sqrt(20000)  # the oracle agrees
    reported = float(ops.convert_to_numpy(layer.losses[-1])) * 50.0
    assert abs(reported - closed) < 5 * (log_q - log_p).std() / np.sqrt(samples)


def _network(num_train, prior=None, residual=False):
    prior = prior or kd.NealPrior(num_train)
    inputs = keras.Input((8, 8, 1))
    h = kd.GlobalInducingConv2D(4, 3, "relu", num_inducing=10, num_samples=2, regularizer=prior, seed=1)(inputs)
    h = keras.layers.TimeDistributed(keras.layers.MaxPooling2D())(h)
    h2 = kd.GlobalInducingConv2D(4, 3, "relu", num_inducing=10, regularizer=prior, seed=2)(h)
    if residual:
        h2 = keras.layers.Add()([h, h2])
    h = keras.layers.TimeDistributed(keras.layers.Flatten())(h2)
    out = kd.GlobalInducingDense(2, num_inducing=10, regularizer=prior, output_layer=True, seed=3)(h)
    return keras.Model(inputs, out)


@pytest.mark.filterwarnings("ignore:The classifier")  # 12 steps: the mechanics are under test, not the fit
@pytest.mark.parametrize("prior, residual", [(None, True), ("scale", False)])
def test_network_trains_saves_loads_and_predicts_samples(prior, residual, tmp_path):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((48, 8, 8, 1)).astype("float32")
    labels = (x[:, :4].mean(axis=(1, 2, 3)) > x[:, 4:].mean(axis=(1, 2, 3))).astype("int32")
    keras.utils.set_random_seed(0)
    model = _network(48, kd.ScalePrior(48) if prior == "scale" else None, residual)
    model.compile(keras.optimizers.Adam(1e-2), loss=kd.SampledSoftmaxELL())
    kd.initialize_from_data(model, x, labels, seed=0)
    first = model.layers[1]
    assert first.inducing_inputs.shape == (10, 8, 8, 1)
    np.testing.assert_array_equal(np.isin(ops.convert_to_numpy(first.inducing_inputs)[:, 0, 0, 0], x[:, 0, 0, 0]), True)
    history = model.fit(x, labels, epochs=4, batch_size=16, verbose=0).history
    assert np.isfinite(history["loss"]).all() and history["kl"][-1] > 0
    assert model.predict(x[:5], verbose=0).shape == (5, 2, 2)
    samples = kd.predict_samples(model, x[:5], 6)
    assert samples.shape == (5, 6, 2)
    loaded = reloaded(model, tmp_path, "gic")
    assert isinstance(loaded.layers[1], kd.GlobalInducingConv2D) and loaded.layers[1].kernel_size == (3, 3)
    for a, b in zip(model.weights, loaded.weights):
        np.testing.assert_array_equal(ops.convert_to_numpy(a), ops.convert_to_numpy(b))
    for m in (model, loaded):
        kd.set_sampling_seed(m, 9)
    np.testing.assert_array_equal(model.predict(x, verbose=0), loaded.predict(x, verbose=0))


def test_bad_arguments_and_wiring():
    prior = kd.NealPrior(10)
    with pytest.raises(ValueError, match="kernel_size"):
        kd.GlobalInducingConv2D(4, 0, num_inducing=3, regularizer=prior)
    with pytest.raises(ValueError, match="padding"):
        kd.GlobalInducingConv2D(4, 3, padding="causal")
    with pytest.raises(ValueError, match="channels_last"):
        kd.GlobalInducingConv2D(4, 3, data_format="channels_first")
    with pytest.raises(ValueError, match="rank 4"):
        kd.GlobalInducingConv2D(4, 3, num_inducing=3, regularizer=prior)(keras.Input((8, 8)))
    with pytest.raises(ValueError, match="smaller than the kernel"):
        kd.GlobalInducingConv2D(4, 5, padding="valid", num_inducing=3, regularizer=prior)(keras.Input((3, 3, 1)))
    h = kd.GlobalInducingConv2D(4, 3, num_inducing=3, regularizer=prior)(keras.Input((6, 6, 1)))
    h = keras.layers.TimeDistributed(keras.layers.MaxPooling2D())(h)
    with pytest.raises(ValueError, match="num_inducing"):
        kd.GlobalInducingConv2D(4, 3)(h)
    out = kd.GlobalInducingConv2D(4, 3, num_inducing=3, regularizer=prior)(h)
    assert tuple(out.shape) == (None, 1, 3, 3, 4)


def test_a_collapsed_global_inducing_classifier_gets_its_own_fixes():
    """Random labels, 12 full-batch steps: the network stays at its prior, and the warning
    names the remedies of a global inducing network, not the closed-form priors' KL rule."""
    import warnings

    rng = np.random.default_rng(6)
    x = rng.standard_normal((48, 8, 8, 1)).astype("float32")
    labels = rng.integers(0, 2, 48)
    model = _network(48)
    model.compile(keras.optimizers.Adam(1e-3), loss=kd.SampledSoftmaxELL())
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        model.fit(x, labels, epochs=12, batch_size=48, verbose=0)
    collapsed = [str(w.message) for w in record if "collapsed to its prior" in str(w.message)]
    assert len(collapsed) == 1 and "global inducing network" in collapsed[0]
    assert "kl_weight='auto'" not in collapsed[0]


# ---------------------------------------------------------------- SpatialIWPrior


def _spatial_draws(dims=3, channels=2, samples=5, log_nu=math.log(10.0), seed=0):
    prior = kd.SpatialIWPrior(10)
    tril = ops.convert_to_tensor(np.tril(np.random.default_rng(seed).standard_normal((dims, dims))))
    log_nu = ops.convert_to_tensor(np.float64(log_nu))
    psi, nu = (ops.convert_to_numpy(v) for v in prior.posterior(tril, log_nu))
    matrix, log_ratio = prior.sample_precision(tril, log_nu, channels,
                                               True, samples, "float64", keras.random.SeedGenerator(seed))
    matrix = ops.convert_to_numpy(matrix)
    spatial = matrix[:, :-1:channels, :-1:channels][:, :dims, :dims] / channels  # L from the Kronecker product
    return psi, float(nu), matrix, spatial, ops.convert_to_numpy(log_ratio)


def test_spatial_iw_density_and_log_ratio_match_scipy():
    """`inverse_wishart_log_density` against scipy's `invwishart.logpdf` (real-valued degrees of
    freedom), and every draw's `log p(L) - log q(L)` against scipy at the drawn `L`; the prior
    precision matrix is `L (x) c I` over (position, channel) rows with the bias at `fan_in`."""
    from scipy import stats

    from keras_dvi import priors

    rng = np.random.default_rng(1)
    a = rng.standard_normal((3, 3))
    psi, x, nu = a @ a.T + np.eye(3), stats.wishart(df=6, scale=np.eye(3)).rvs(random_state=2), 5.7
    got = priors.inverse_wishart_log_density(
        ops.convert_to_tensor(np.linalg.slogdet(x)[1]), ops.convert_to_tensor(np.trace(psi @ np.linalg.inv(x))),
        ops.convert_to_tensor(np.linalg.slogdet(psi)[1]), nu, 3)
    np.testing.assert_allclose(float(ops.convert_to_numpy(got)), stats.invwishart(df=nu, scale=psi).logpdf(x), rtol=1e-9)
    psi, nu, matrix, spatial, log_ratio = _spatial_draws()
    for s in range(len(spatial)):
        expected = stats.invwishart(df=4.0, scale=4.0 * np.eye(3)).logpdf(spatial[s]) - \
            stats.invwishart(df=nu, scale=psi).logpdf(spatial[s])
        np.testing.assert_allclose(log_ratio[s], expected, rtol=1e-8)
        np.testing.assert_allclose(matrix[s, :-1, :-1], np.kron(spatial[s], 2.0 * np.eye(2)), rtol=1e-12)
    assert matrix[0, -1, -1] == 6.0 and not matrix[0, -1, :-1].any()


def test_spatial_iw_draws_follow_the_posterior():
    """40,000 reparameterised Bartlett draws of `L ~ IW(Psi, nu)`: a diagonal element against
    its inverse-gamma marginal `IG((nu - p + 1) / 2, Psi_ii / 2)` (Kolmogorov-Smirnov), and
    `E[L^{-1}] = nu Psi^{-1}` (5 standard errors)."""
    from scipy import stats

    psi, nu, _, spatial, _ = _spatial_draws(samples=40_000, seed=3)
    marginal = stats.invgamma((nu - 3 + 1) / 2, scale=psi[1, 1] / 2)
    assert stats.kstest(spatial[:, 1, 1], marginal.cdf).pvalue > 1e-3
    inverse = np.linalg.inv(spatial)
    se = inverse.std(axis=0) / np.sqrt(len(inverse))
    assert np.all(np.abs(inverse.mean(axis=0) - nu * np.linalg.inv(psi)) < 5 * se)


def test_matrix_prior_posterior_and_density_match_dense_algebra():
    """Under a prior precision matrix per sample, `A = Lambda_p + Phi^T diag(lambda) Phi` and
    `log N(w_u | 0, Lambda_p^{-1})` against NumPy and scipy."""
    from scipy import stats

    from keras_dvi import inducing

    _, _, matrix, _, _ = _spatial_draws(samples=2, seed=4)
    rng = np.random.default_rng(5)
    phi = np.concatenate([rng.standard_normal((2, 8, 6)), np.ones((2, 8, 1))], axis=-1)
    precision, pseudo = np.exp(rng.uniform(-1, 1, 8)), rng.standard_normal((8, 2))
    chol, mean = inducing.weight_posterior(*(ops.convert_to_tensor(v) for v in (phi, precision, pseudo, matrix)))
    chol, mean = ops.convert_to_numpy(chol), ops.convert_to_numpy(mean)
    weights = rng.standard_normal((2, 7, 2))
    density = ops.convert_to_numpy(inducing.log_prior_density(ops.convert_to_tensor(weights), ops.convert_to_tensor(matrix)))
    for s in range(2):
        a = matrix[s] + phi[s].T @ (precision[:, None] * phi[s])
        np.testing.assert_allclose(chol[s] @ chol[s].T, a, rtol=1e-10)
        np.testing.assert_allclose(mean[s], np.linalg.solve(a, phi[s].T @ (precision[:, None] * pseudo)), rtol=1e-9)
        cov = np.linalg.inv(matrix[s])
        expected = sum(stats.multivariate_normal(np.zeros(7), cov).logpdf(weights[s, :, u]) for u in range(2))
        np.testing.assert_allclose(density[s], expected, rtol=1e-9)


@pytest.mark.filterwarnings("ignore:The classifier")  # 6 steps: the mechanics are under test, not the fit
def test_spatial_iw_network_trains_saves_and_loads(tmp_path):
    rng = np.random.default_rng(7)
    x = rng.standard_normal((32, 8, 8, 1)).astype("float32")
    labels = (x[:, :4].mean(axis=(1, 2, 3)) > 0).astype("int32")
    keras.utils.set_random_seed(0)
    model = _network(32, kd.SpatialIWPrior(32))
    model.compile(keras.optimizers.Adam(1e-2), loss=kd.SampledSoftmaxELL())
    conv = model.layers[1]
    assert conv.spatial_tril.shape == (9, 9) and model.layers[-1].spatial_tril.shape == (1, 1)
    start = ops.convert_to_numpy(conv.spatial_tril).copy()
    history = model.fit(x, labels, epochs=3, batch_size=16, verbose=0).history
    assert np.isfinite(history["loss"]).all() and np.isfinite(history["kl"]).all()
    assert not np.array_equal(ops.convert_to_numpy(conv.spatial_tril), start)  # q(L) is learned
    loaded = reloaded(model, tmp_path, "iw")
    assert isinstance(loaded.layers[1].regularizer, kd.SpatialIWPrior)
    for m in (model, loaded):
        kd.set_sampling_seed(m, 3)
    np.testing.assert_array_equal(model.predict(x, verbose=0), loaded.predict(x, verbose=0))
    assert isinstance(kd.priors.get_weight_prior("spatial_iw"), kd.SpatialIWPrior)
