"""TAGI (issue 24): the closed-form updates against the exact Bayesian posterior of linear-Gaussian
models, against a direct NumPy evaluation of the paper's equations (written unit by unit,
independently of `keras_dvi.tagi`), the classification tree against Appendix C, the 1D toy of
the paper's Figure 5, and `TAGIModel` inside Keras' `fit` / `evaluate` / `predict` / save.
Runs on TensorFlow here and on JAX through `test_backends.py`."""

import math

import keras
import numpy as np
import pytest
from keras import ops
from scipy import stats

import keras_dvi as kd
from keras_dvi import tagi


def _tensor(a, dtype="float64"):
    return ops.convert_to_tensor(np.asarray(a), dtype=dtype)


def _np(t):
    return np.asarray(ops.convert_to_numpy(t), dtype="float64")


# ---------------------------------------------------------------- exactness (linear-Gaussian)


@pytest.mark.parametrize("use_bias", [True, False])
def test_linear_layer_update_is_the_exact_posterior(use_bias):
    """One linear layer, one observation: TAGI's means equal the exact posterior means and its
    variances the exact posterior's marginal variances (Kalman update with a diagonal prior;
    the outputs depend on disjoint weights, so they are independent given the input)."""
    rng = np.random.default_rng(0)
    n_in, n_out, noise = 3, 2, 0.4
    x = rng.normal(size=(1, n_in))
    y = rng.normal(size=(1, n_out))
    mw, sw = rng.normal(size=(n_in, n_out)), rng.uniform(0.1, 1.0, (n_in, n_out))
    mb, sb = rng.normal(size=n_out), rng.uniform(0.1, 1.0, n_out)
    params = [(_tensor(mw), _tensor(sw), _tensor(mb) if use_bias else None, _tensor(sb) if use_bias else None)]
    caches, (mz, sz, slope) = tagi.forward(_tensor(x), params, ["linear"])
    dm, ds = tagi.observation_deltas(mz, sz, _tensor(y), noise**2)
    (new_mw, new_sw, new_mb, new_sb), = tagi.update(params, caches, slope, dm, ds)
    h = np.append(x[0], 1.0) if use_bias else x[0]
    for i in range(n_out):
        mean = np.append(mw[:, i], mb[i]) if use_bias else mw[:, i]
        cov = np.diag(np.append(sw[:, i], sb[i]) if use_bias else sw[:, i])
        gain = cov @ h / (h @ cov @ h + noise**2)
        post_mean = mean + gain * (y[0, i] - h @ mean)
        post_cov = cov - np.outer(gain, h @ cov)
        np.testing.assert_allclose(_np(new_mw)[:, i], post_mean[:n_in], rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(_np(new_sw)[:, i], np.diag(post_cov)[:n_in], rtol=1e-12, atol=1e-14)
        if use_bias:
            np.testing.assert_allclose(_np(new_mb)[i], post_mean[-1], rtol=1e-12)
            np.testing.assert_allclose(_np(new_sb)[i], post_cov[-1, -1], rtol=1e-12)


def test_fit_one_weight_is_the_kalman_filter():
    """`TAGIModel.fit` on y = w x + v, one weight, batches of 1: the posterior after every
    observation is the exact one (a scalar Kalman filter), here after 30 observations."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(30, 1)).astype("float32")
    y = (0.7 * x + 0.5 * rng.normal(size=x.shape)).astype("float32")
    network = keras.Sequential([keras.Input((1,)), kd.DenseDiagDVI(1, use_bias=False)])
    network.layers[0].set_posterior(np.array([[0.2]]), 2.0)
    model = kd.TAGIModel(network, observation_noise=0.5, initialize=False)
    model.compile()
    model.fit(x, y, batch_size=1, epochs=1, shuffle=False, verbose=0)
    precision = 1 / 2.0 + np.sum(x.astype("float64") ** 2) / 0.25
    mean = (0.2 / 2.0 + np.sum(x.astype("float64") * y) / 0.25) / precision
    layer = network.layers[0]
    np.testing.assert_allclose(_np(layer.kernel_mean)[0, 0], mean, rtol=2e-5)
    np.testing.assert_allclose(_np(layer.kernel_variance)[0, 0], 1 / precision, rtol=2e-4)


# ---------------------------------------------------------------- the paper's equations in NumPy


def _numpy_tagi_step(x, y, params, activations, noise, forward):
    """One batch of TAGI written out unit by unit from the paper's equations (10-16, diagonal):
    the oracle of `test_update_matches_the_papers_equations`. Returns the new parameters."""
    batch = len(x)
    phi, Phi = stats.norm.pdf, stats.norm.cdf
    inputs, slopes = [], []  # per layer: the activations it receives; the slope of its own activation
    ma, sa = x, np.zeros_like(x)
    for (mw, sw, mb, sb), act in zip(params, activations):
        n_in, n_out = mw.shape
        mz, sz = np.zeros((batch, n_out)), np.zeros((batch, n_out))
        for b in range(batch):
            for i in range(n_out):
                mz[b, i] = sum(ma[b, k] * mw[k, i] for k in range(n_in)) + mb[i]
                sz[b, i] = sum(sa[b, k] * sw[k, i] + sa[b, k] * mw[k, i] ** 2 + ma[b, k] ** 2 * sw[k, i]
                               for k in range(n_in)) + sb[i]
        if act == "linear":
            a_m, a_s, J = mz, sz, np.ones_like(mz)
        elif forward == "linearized":  # eqs. 11-12
            J = (mz > 0).astype(float)
            a_m, a_s = np.maximum(mz, 0), J**2 * sz
        else:  # Gaussian ReLU moments, J = E[f'(z)] = Phi(mu)
            sd = np.sqrt(sz)
            mu = mz / sd
            a_m = sd * phi(mu) + mz * Phi(mu)
            a_s = (mz**2 + sz) * Phi(mu) + mz * sd * phi(mu) - a_m**2
            J = Phi(mu)
        inputs.append(ma)
        slopes.append(J)
        ma, sa = a_m, a_s
    dm = (y - ma) / (sa + noise**2)  # eq. 14 (linear output)
    ds = -1.0 / (sa + noise**2)
    new = [None] * len(params)
    for j in range(len(params) - 1, -1, -1):  # eqs. 15-16, from the top
        mw, sw, mb, sb = params[j]
        a_in = inputs[j]
        n_in, n_out = mw.shape
        nmw, nsw, nmb, nsb = mw.copy(), sw.copy(), mb.copy(), sb.copy()
        for k in range(n_in):
            for i in range(n_out):
                nmw[k, i] += sum(sw[k, i] * a_in[b, k] * dm[b, i] for b in range(batch))
                nsw[k, i] += sum(sw[k, i] ** 2 * a_in[b, k] ** 2 * ds[b, i] for b in range(batch))
        for i in range(n_out):
            nmb[i] += sum(sb[i] * dm[b, i] for b in range(batch))
            nsb[i] += sum(sb[i] ** 2 * ds[b, i] for b in range(batch))
        new[j] = (nmw, nsw, nmb, nsb)
        if j:
            J = slopes[j - 1]  # Cov(z_k, z+_i) = J_k sz_k mw_ki
            dm_below, ds_below = np.zeros((batch, n_in)), np.zeros((batch, n_in))
            for b in range(batch):
                for k in range(n_in):
                    dm_below[b, k] = J[b, k] * sum(mw[k, i] * dm[b, i] for i in range(n_out))
                    ds_below[b, k] = J[b, k] ** 2 * sum(mw[k, i] ** 2 * ds[b, i] for i in range(n_out))
            dm, ds = dm_below, ds_below
    return new


@pytest.mark.parametrize("forward", ["linearized", "moments"])
def test_update_matches_the_papers_equations(forward):
    rng = np.random.default_rng(2)
    sizes, batch, noise = [4, 5, 3, 2], 6, 1.0  # (no variance reaches the guard `MAX_SHRINK`)
    activations = ["relu", "relu", "linear"]
    params = []
    for n_in, n_out in zip(sizes[:-1], sizes[1:]):
        params.append((rng.normal(0, 0.6, (n_in, n_out)), rng.uniform(0.05, 0.3, (n_in, n_out)),
                       rng.normal(0, 0.3, n_out), rng.uniform(0.005, 0.02, n_out)))
    x, y = rng.normal(size=(batch, sizes[0])), rng.normal(size=(batch, sizes[-1]))
    caches, (mz, sz, slope) = tagi.forward(_tensor(x), [tuple(_tensor(p) for p in layer) for layer in params],
                                           activations, forward)
    expected = _numpy_tagi_step(x, y, params, activations, noise, forward)
    dm, ds = tagi.observation_deltas(mz, sz, _tensor(y), noise**2)
    got = tagi.update([tuple(_tensor(p) for p in layer) for layer in params], caches, slope, dm, ds)
    for (gm, gs, gbm, gbs), (em, es, ebm, ebs) in zip(got, expected):
        np.testing.assert_allclose(_np(gm), em, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(_np(gs), es, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(_np(gbm), ebm, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(_np(gbs), ebs, rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------- classification (Appendix C)


def test_tree_matches_appendix_c():
    units, paths = tagi.tree(10)
    assert units == 11
    # class 9 = 1001: nodes 1, 3, 6, 11 (1-based, as in the authors' code), observing -1 +1 +1 -1
    nodes = np.flatnonzero(paths[9])
    np.testing.assert_array_equal(nodes + 1, [1, 3, 6, 11])
    np.testing.assert_array_equal(paths[9, nodes], [-1, 1, 1, -1])
    np.testing.assert_array_equal(np.abs(paths).sum(1), 4)  # every class observes H = 4 nodes
    assert len({tuple(row) for row in paths}) == 10  # distinct paths
    assert tagi.tree(2)[0] == 1 and tagi.tree(3)[0] == 3 and tagi.tree(16)[0] == 15
    with pytest.raises(ValueError, match="classes"):
        tagi.tree(1)


def test_class_probabilities_are_the_normalised_path_products():
    rng = np.random.default_rng(3)
    units, paths = tagi.tree(10)
    mz, sz = rng.normal(size=(5, units)), rng.uniform(0.01, 2.0, (5, units))
    got = _np(tagi.class_probabilities(_tensor(mz), _tensor(sz), paths))
    p = stats.norm.cdf(mz / np.sqrt(1 / 9 + sz))
    expected = np.ones((5, 10))
    for c in range(10):
        for node in range(units):
            if paths[c, node] > 0:
                expected[:, c] *= p[:, node]
            elif paths[c, node] < 0:
                expected[:, c] *= 1 - p[:, node]
    np.testing.assert_allclose(got, expected / expected.sum(1, keepdims=True), rtol=1e-9)
    # extreme outputs stay finite and normalised
    extreme = _np(tagi.class_probabilities(_tensor(np.full((1, units), 1e4), "float32"),
                                           _tensor(np.zeros((1, units)), "float32"), paths))
    assert np.isfinite(extreme).all() and abs(extreme.sum() - 1) < 1e-5


# ---------------------------------------------------------------- the paper's 1D toy (Figure 5)


def _cubic_toy():
    """y = x^3 + v, v ~ N(0, 9), 20 points in [-4, 4], x and y scaled to [-1, 1] (Section 4.1)."""
    rng = np.random.default_rng(0)
    x = rng.uniform(-4, 4, (20, 1))
    y = x**3 + 3 * rng.normal(size=x.shape)
    return (x / 4).astype("float32"), (y / 64).astype("float32")


def test_cubic_toy_reproduces_figure_5():
    """A 1 x 100 ReLU network, one observation at a time: the prior predictive is weakly
    informative (wide); after training the mean follows x^3 inside the data, the +-3 sd band
    covers the training points, and the band is narrower than the prior's."""
    keras.utils.set_random_seed(0)
    x, y = _cubic_toy()
    network = keras.Sequential([keras.Input((1,)), kd.DenseDiagDVI(100, "relu"), kd.DenseDiagDVI(1)])
    model = kd.TAGIModel(network, observation_noise=3 / 64, seed=0)
    model.compile()
    grid = np.linspace(-1, 1, 41)[:, None].astype("float32")
    prior = kd.predict(model, grid)
    model.fit(x, y, batch_size=1, epochs=30, verbose=0)
    post = kd.predict(model, grid)
    inside = np.abs(grid[:, 0]) <= np.abs(x).max()
    truth = grid[:, 0] ** 3
    # measured (seeds 0-2): RMSE 0.28-0.38 under the prior, 0.05-0.07 after 30 epochs (noise sd 0.047)
    assert np.sqrt(np.mean((prior["mean"][inside, 0] - truth[inside]) ** 2)) > 0.2
    assert np.sqrt(np.mean((post["mean"][inside, 0] - truth[inside]) ** 2)) < 0.1
    assert np.mean(np.abs(post["mean"][inside, 0] - truth[inside]) <= 3 * post["std"][inside, 0]) >= 0.9
    train = kd.predict(model, x)
    assert np.mean(np.abs(train["mean"] - y) <= 3 * train["std"]) >= 0.9
    assert np.median(prior["std"]) > 2 * np.median(post["std"][inside])  # measured 2.7-3.2


# ---------------------------------------------------------------- Keras integration


def test_fit_evaluate_predict_save_and_load(tmp_path):
    rng = np.random.default_rng(4)
    x = rng.normal(size=(64, 3)).astype("float32")
    y = (x @ np.array([[1.0], [-0.5], [0.2]]) + 0.1 * rng.normal(size=(64, 1))).astype("float32")
    network = keras.Sequential([keras.Input((3,)), kd.DenseDiagDVI(16, "relu"), kd.DenseDiagDVI(1)])
    model = kd.TAGIModel(network, observation_noise=0.1, forward="moments", seed=0)
    model.compile()
    history = model.fit(x, y, batch_size=8, epochs=5, verbose=0, validation_data=(x, y))
    assert set(history.history) == {"nll", "val_nll"}
    assert history.history["nll"][-1] < history.history["nll"][0]
    logs = model.evaluate(x, y, verbose=0, return_dict=True)
    assert np.isfinite(logs["nll"])
    out = kd.predict(model, x)
    np.testing.assert_allclose(out["aleatoric"], 0.01, rtol=1e-6)
    np.testing.assert_allclose(out["variance"], out["epistemic"] + out["aleatoric"], rtol=1e-6)
    assert np.all(out["lower"] < out["mean"]) and np.all(out["mean"] < out["upper"])
    path = str(tmp_path / "tagi.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert isinstance(loaded, kd.TAGIModel) and loaded.forward == "moments"
    np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0), rtol=1e-6, atol=1e-7)
    loaded.fit(x, y, batch_size=8, epochs=1, verbose=0)  # compiled on load, trains on


def test_classification_trains_on_digits():
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype("float32")
    units, _ = tagi.tree(10)
    network = keras.Sequential([keras.Input((64,)), kd.DenseDiagDVI(100, "relu"), kd.DenseDiagDVI(units)])
    model = kd.TAGIModel(network, observation_noise=0.3, classes=10, seed=0)
    model.compile()
    history = model.fit(x[:1400], y[:1400], batch_size=10, epochs=2, verbose=0)
    assert history.history["accuracy"][-1] > 0.9
    out = kd.predict(model, x[1400:])
    np.testing.assert_allclose(out["probabilities"].sum(1), 1.0, rtol=1e-5)
    assert np.mean(out["label"] == y[1400:]) > 0.8
    assert np.isfinite(out["entropy"]).all()


def test_misuse_is_refused():
    dense = keras.Sequential([keras.Input((3,)), kd.DenseDVI(1)])
    with pytest.raises(ValueError, match="DenseDiagDVI"):
        kd.TAGIModel(dense)
    relu_out = keras.Sequential([keras.Input((3,)), kd.DenseDiagDVI(2, "relu")])
    with pytest.raises(ValueError, match="must be linear"):
        kd.TAGIModel(relu_out)
    heaviside = keras.Sequential([keras.Input((3,)), kd.DenseDiagDVI(4, "heaviside"), kd.DenseDiagDVI(1)])
    with pytest.raises(ValueError, match="Heaviside"):
        kd.TAGIModel(heaviside)
    weighted_first = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), kd.DenseDiagDVI(1)])
    with pytest.raises(ValueError, match="has weights"):
        kd.TAGIModel(weighted_first)
    ok = keras.Sequential([keras.Input((3,)), kd.DenseDiagDVI(4, "relu"), kd.DenseDiagDVI(3)])
    with pytest.raises(ValueError, match="11 units"):
        kd.TAGIModel(ok, classes=10)
    with pytest.raises(ValueError, match="observation_noise"):
        kd.TAGIModel(ok, observation_noise=0.0)
    with pytest.raises(ValueError, match="forward"):
        kd.TAGIModel(ok, forward="exact")
    model = kd.TAGIModel(ok)
    with pytest.raises(ValueError, match="optimizer"):
        model.compile(optimizer="adam")
    with pytest.raises(ValueError, match="loss"):
        model.compile(loss="mse")


def test_variances_stay_positive_with_large_batches():
    """Summing a big batch's variance reductions from one prior would overshoot (the paper has
    no guard); the update keeps every variance positive and finite."""
    rng = np.random.default_rng(5)
    x = rng.normal(size=(512, 4)).astype("float32") * 3
    y = rng.normal(size=(512, 1)).astype("float32")
    network = keras.Sequential([keras.Input((4,)), kd.DenseDiagDVI(8, "relu"), kd.DenseDiagDVI(1)])
    model = kd.TAGIModel(network, observation_noise=0.01, seed=0)
    model.compile()
    model.fit(x, y, batch_size=512, epochs=3, verbose=0)
    for layer in network.layers:
        variance = _np(layer.kernel_variance)
        assert np.isfinite(variance).all() and (variance > 0).all()
    assert np.isfinite(model.predict(x, verbose=0)).all()
