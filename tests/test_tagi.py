"""TAGI: the closed-form updates against the exact Bayesian posterior of linear-Gaussian
models, against a direct NumPy evaluation of the paper's equations (written unit by unit,
independently of `keras_dvi.tagi`), the classification tree against Appendix C, the 1D toy of
the paper's Figure 5, and `TAGIModel` inside Keras' `fit` / `evaluate` / `predict` / save.
Runs on TensorFlow here and on JAX through `test_backends.py`."""


import keras
import numpy as np
import pytest
from keras import ops
from scipy import stats

import keras_dvi as kd
from keras_dvi import tagi
from keras_dvi.maths import tagi as tagi_maths
from tests.conftest import reloaded


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
    (new_mw, new_sw, new_mb, new_sb), = tagi.update(params, caches, ["linear"], dm, ds)
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
    got = tagi.update([tuple(_tensor(p) for p in layer) for layer in params], caches, activations, dm, ds)
    for (gm, gs, gbm, gbs), (em, es, ebm, ebs) in zip(got, expected):
        np.testing.assert_allclose(_np(gm), em, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(_np(gs), es, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(_np(gbm), ebm, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(_np(gbs), ebs, rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------- conv networks, position by position


def _numpy_conv(a, w, padding):
    """`z[b, p, f] = sum_{o, c} a[b, p + o - pad, c] w[o, c, f]` by explicit patches (2D maps;
    1D as height 1). Returns `z` and the patches `(batch, positions, taps * in)` with the
    positions' coordinates in the padded input."""
    kh, kw, c_in, _ = w.shape
    if padding == "same":
        a = np.pad(a, [(0, 0), ((kh - 1) // 2, kh - 1 - (kh - 1) // 2), ((kw - 1) // 2, kw - 1 - (kw - 1) // 2), (0, 0)])
    batch, h, wd, _ = a.shape
    oh, ow = h - kh + 1, wd - kw + 1
    patches = np.zeros((batch, oh * ow, kh * kw * c_in))
    for b in range(batch):
        for i in range(oh):
            for j in range(ow):
                patches[b, i * ow + j] = a[b, i:i + kh, j:j + kw, :].reshape(-1)
    return patches, (oh, ow)


def _numpy_tagi_conv_step(x, y, layers, params, noise, forward):
    """One batch of TAGI through conv, pooling, flatten and dense layers, each conv output
    position written as a dense unit on its patch (eqs. 10-16 per position; the kernel's
    update sums every position's term): the oracle of `test_conv_update_matches_the_papers_equations`."""
    phi, Phi = stats.norm.pdf, stats.norm.cdf
    batch = len(x)
    ma, sa = x, np.zeros_like(x)
    records, weights = [], iter(params)
    for layer in layers:
        kind = layer[0]
        if kind == "pool":
            kh, kw = (layer[1],) * 2 if isinstance(layer[1], int) else layer[1]
            _, h, wd, c = ma.shape
            oh, ow = h // kh, wd // kw
            pool = lambda t: t[:, :oh * kh, :ow * kw].reshape(batch, oh, kh, ow, kw, c).mean((2, 4))  # noqa: E731
            records.append(("pool", (kh, kw), ma.shape))
            ma, sa = pool(ma), pool(sa) / (kh * kw)
            continue
        if kind == "gap":
            n = ma.shape[1] * ma.shape[2]
            records.append(("gap", ma.shape))
            ma, sa = ma.mean((1, 2)), sa.mean((1, 2)) / n
            continue
        if kind == "flatten":
            records.append(("flatten", ma.shape))
            ma, sa = ma.reshape(batch, -1), sa.reshape(batch, -1)
            continue
        mw, sw, mb, sb = next(weights)
        act = layer[1]
        if kind == "conv":
            padding = layer[2]
            pm, out = _numpy_conv(ma, mw, padding)
            ps, _ = _numpy_conv(sa, mw, padding)
            wm, wv = mw.reshape(-1, mw.shape[-1]), sw.reshape(-1, sw.shape[-1])
            mz = (pm @ wm + mb).reshape(batch, *out, -1)
            sz = (ps @ (wv + wm**2) + pm**2 @ wv + sb).reshape(batch, *out, -1)
        else:
            pm = ma
            mz = ma @ mw + mb
            sz = sa @ (sw + mw**2) + ma**2 @ sw + sb
        if act == "linear":
            a_m, a_s, J = mz, sz, np.ones_like(mz)
        elif forward == "linearized":
            J = (mz > 0).astype(float)
            a_m, a_s = np.maximum(mz, 0), J**2 * sz
        else:
            sd = np.sqrt(sz)
            mu = mz / sd
            a_m = sd * phi(mu) + mz * Phi(mu)
            a_s = (mz**2 + sz) * Phi(mu) + mz * sd * phi(mu) - a_m**2
            J = Phi(mu)
        records.append((kind, layer, ma.shape, pm, J))
        ma, sa = a_m, a_s
    dm, ds = (y - ma) / (sa + noise**2), -1.0 / (sa + noise**2)
    new, index = [None] * len(params), len(params)
    for record in reversed(records):
        kind = record[0]
        if kind == "pool":  # each input gets its window's delta / k (variances / k^2)
            _, (kh, kw), shape = record
            n = kh * kw
            dm_in, ds_in = np.zeros(shape), np.zeros(shape)
            for i in range(dm.shape[1]):
                for j in range(dm.shape[2]):
                    dm_in[:, i * kh:(i + 1) * kh, j * kw:(j + 1) * kw] = dm[:, i:i + 1, j:j + 1] / n
                    ds_in[:, i * kh:(i + 1) * kh, j * kw:(j + 1) * kw] = ds[:, i:i + 1, j:j + 1] / n**2
            dm, ds = dm_in, ds_in
            continue
        if kind == "gap":
            shape = record[1]
            n = shape[1] * shape[2]
            dm = np.broadcast_to(dm[:, None, None, :] / n, shape)
            ds = np.broadcast_to(ds[:, None, None, :] / n**2, shape)
            continue
        if kind == "flatten":
            dm, ds = dm.reshape(record[1]), ds.reshape(record[1])
            continue
        _, layer, in_shape, patches, J = record
        index -= 1
        mw, sw, mb, sb = params[index]
        dm, ds = dm * J, ds * J**2
        if kind == "dense":
            gm, gs = patches.T @ dm, (patches**2).T @ ds
            axes = 0
        else:
            f = mw.shape[-1]
            flat_dm, flat_ds = dm.reshape(batch, -1, f), ds.reshape(batch, -1, f)
            gm = sum(patches[b].T @ flat_dm[b] for b in range(batch)).reshape(mw.shape)
            gs = sum((patches[b] ** 2).T @ flat_ds[b] for b in range(batch)).reshape(mw.shape)
            axes = (0, 1, 2)
        new_sw = np.maximum(sw + sw**2 * gs, tagi.MAX_SHRINK * sw)
        new_sb = np.maximum(sb + sb**2 * ds.sum(axes), tagi.MAX_SHRINK * sb)
        new[index] = (mw + sw * gm, new_sw, mb + sb * dm.sum(axes), new_sb)
        if not index:
            break
        if kind == "dense":
            dm, ds = dm @ mw.T, ds @ (mw**2).T
        else:  # each input unit collects the deltas of every position whose patch holds it
            kh, kw = mw.shape[:2]
            pad = ((kh - 1) // 2, (kw - 1) // 2) if layer[2] == "same" else (0, 0)
            padded = (in_shape[0], in_shape[1] + (kh - 1 if layer[2] == "same" else 0),
                      in_shape[2] + (kw - 1 if layer[2] == "same" else 0), in_shape[3])
            dm_in, ds_in = np.zeros(padded), np.zeros(padded)
            for i in range(dm.shape[1]):
                for j in range(dm.shape[2]):
                    for di in range(kh):
                        for dj in range(kw):
                            dm_in[:, i + di, j + dj] += dm[:, i, j] @ mw[di, dj].T
                            ds_in[:, i + di, j + dj] += ds[:, i, j] @ (mw[di, dj] ** 2).T
            dm = dm_in[:, pad[0]:pad[0] + in_shape[1], pad[1]:pad[1] + in_shape[2]]
            ds = ds_in[:, pad[0]:pad[0] + in_shape[1], pad[1]:pad[1] + in_shape[2]]
    return new


CONV_NETWORKS = {
    # (input shape, layers): "same" with odd and even kernels, a pool that drops a row, both heads
    "conv_pool_flatten": ((7, 7, 2), [("conv", "relu", "same", 3, 3), ("pool", 2), ("conv", "relu", "valid", 2, 2),
                                      ("flatten",), ("dense", "relu", 5), ("dense", "linear", 2)]),
    "conv_even_same_gap": ((6, 5, 1), [("conv", "relu", "same", 2, 4), ("conv", "linear", "valid", 3, 3), ("gap",),
                                       ("dense", "linear", 2)]),
    "conv1d": ((1, 9, 2), [("conv", "relu", "same", (1, 3), 3), ("pool", (1, 2)), ("flatten",),
                           ("dense", "linear", 2)]),
}


@pytest.mark.parametrize("forward", ["linearized", "moments"])
@pytest.mark.parametrize("name", sorted(CONV_NETWORKS))
def test_conv_update_matches_the_papers_equations(name, forward):
    """Conv, average pooling, global average pooling and flatten: every parameter after one
    batch equals the position-by-position NumPy evaluation of eqs. 10-16."""
    shape, layers = CONV_NETWORKS[name]
    rng = np.random.default_rng(5)
    batch, noise, one_d = 4, 1.0, name == "conv1d"
    x = rng.normal(size=(batch,) + shape)
    params, steps, channels = [], [], shape[-1]
    probe = x
    for layer in layers:
        if layer[0] in ("conv", "dense"):
            if layer[0] == "conv":
                kernel = (layer[3],) * 2 if isinstance(layer[3], int) else layer[3]
                wshape = kernel + (channels, layer[4])
                channels = layer[4]
            else:
                fan_in = int(np.prod(probe.shape[1:]))
                wshape = (fan_in, layer[2])
            params.append((rng.normal(0, 0.5, wshape), rng.uniform(0.05, 0.2, wshape),
                           rng.normal(0, 0.2, wshape[-1]), rng.uniform(0.005, 0.02, wshape[-1])))
        # the shape flowing through (for the dense fan-in), from the oracle's own conv and pooling
        if layer[0] == "conv":
            patches, out = _numpy_conv(probe, params[-1][0], layer[2])
            probe = np.zeros((batch,) + out + (channels,))
        elif layer[0] == "pool":
            k = (layer[1],) * 2 if isinstance(layer[1], int) else layer[1]
            probe = np.zeros((batch, probe.shape[1] // k[0], probe.shape[2] // k[1], probe.shape[3]))
        elif layer[0] == "gap":
            probe = np.zeros((batch, probe.shape[3]))
        elif layer[0] == "flatten":
            probe = probe.reshape(batch, -1)
        elif layer[0] == "dense":
            probe = np.zeros((batch, layer[2]))
    y = rng.normal(size=(batch, layers[-1][2]))

    def squeeze(t):  # 1D: the oracle's height-1 maps and kernels as Conv1D's
        return t[:, 0] if one_d else t

    for layer in layers:
        if layer[0] == "conv":
            kernel = (layer[3],) * 2 if isinstance(layer[3], int) else layer[3]
            steps.append(tagi_maths.ConvStep(layer[1], kernel[1:] if one_d else kernel, layer[2]))
        elif layer[0] == "pool":
            k = (layer[1],) * 2 if isinstance(layer[1], int) else layer[1]
            steps.append(tagi_maths.AveragePoolStep(k[1:] if one_d else k))
        elif layer[0] == "gap":
            steps.append(tagi_maths.GlobalAveragePoolStep())
        elif layer[0] == "flatten":
            steps.append(tagi_maths.FlattenStep())
        else:
            steps.append(tagi_maths.DenseStep(layer[1]))
    tensors = []
    for (mw, sw, mb, sb), conv in zip(params, [l for l in layers if l[0] in ("conv", "dense")]):
        k = (lambda w: w[0]) if (one_d and conv[0] == "conv") else (lambda w: w)
        tensors.append((_tensor(k(mw)), _tensor(k(sw)), _tensor(mb), _tensor(sb)))
    caches, (mz, sz, _) = tagi.forward(_tensor(squeeze(x)), tensors, steps, forward)
    dm, ds = tagi.observation_deltas(mz, sz, _tensor(y), noise**2)
    got = tagi.update(tensors, caches, steps, dm, ds)
    expected = _numpy_tagi_conv_step(x, y, layers, params, noise, forward)
    for (gm, gs, gbm, gbs), (em, es, ebm, ebs), conv in zip(got, expected,
                                                            [l for l in layers if l[0] in ("conv", "dense")]):
        k = (lambda w: w[0]) if (one_d and conv[0] == "conv") else (lambda w: w)
        np.testing.assert_allclose(_np(gm), k(em), rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(_np(gs), k(es), rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(_np(gbm), ebm, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(_np(gbs), ebs, rtol=1e-10, atol=1e-12)
    assert any(not np.allclose(_np(g[0]), p[0]) for g, p in zip(got, params))  # the batch moved the means


def test_max_step_caps_each_mean_move_at_prior_standard_deviations():
    """`max_step`: the uncapped update where it moves a mean by less than `max_step` prior
    standard deviations, exactly that bound (with the update's sign) where it moves more;
    the variances are the uncapped ones."""
    rng = np.random.default_rng(6)
    x, dm, ds = rng.normal(size=(20, 3)), rng.normal(size=(20, 2)), -rng.uniform(0.1, 1.0, (20, 2))
    mw, sw = rng.normal(size=(3, 2)), rng.uniform(0.01, 0.5, (3, 2))
    mb, sb = rng.normal(size=2), rng.uniform(0.01, 0.5, 2)
    args = [_tensor(a) for a in (x, dm, ds, mw, sw, mb, sb)]
    free = [_np(t) for t in tagi.parameter_update(*args)]
    capped = [_np(t) for t in tagi.parameter_update(*args, max_step=0.5)]
    for (m0, v0), m_free, m_cap in [((mw, sw), free[0], capped[0]), ((mb, sb), free[2], capped[2])]:
        move = m_free - m0
        bound = 0.5 * np.sqrt(v0)
        np.testing.assert_allclose(m_cap - m0, np.sign(move) * np.minimum(np.abs(move), bound), rtol=1e-12, atol=1e-14)
    move, bound = free[0] - mw, 0.5 * np.sqrt(sw)
    assert np.any(np.abs(move) > bound) and np.any(np.abs(move) < bound)  # both cases occur (kernel)
    np.testing.assert_allclose(capped[1], free[1], rtol=1e-12)
    np.testing.assert_allclose(capped[3], free[3], rtol=1e-12)


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
    # the logged nll is the Gaussian predictive's (scipy as the oracle)
    want = -stats.norm.logpdf(y, out["mean"], np.sqrt(out["variance"])).sum(axis=-1).mean()
    np.testing.assert_allclose(logs["nll"], want, rtol=1e-4)
    assert np.all(out["lower"] < out["mean"]) and np.all(out["mean"] < out["upper"])
    loaded = reloaded(model, tmp_path, "tagi")
    assert isinstance(loaded, kd.TAGIModel) and loaded.forward == "moments"
    np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0), rtol=1e-6, atol=1e-7)
    loaded.fit(x, y, batch_size=8, epochs=1, verbose=0)  # compiled on load, trains on


def test_fit_takes_tf_data_and_callbacks():
    """`fit` on a `tf.data` pipeline with Keras callbacks: early stopping stops, restores the
    best posterior (the validation `nll` it monitors is TAGI's), and `steps_per_execution` runs."""
    import tensorflow as tf

    rng = np.random.default_rng(4)
    x = rng.normal(size=(160, 3)).astype("float32")
    y = (x @ np.array([[1.0], [-0.5], [0.2]]) + 0.1 * rng.normal(size=(160, 1))).astype("float32")
    network = keras.Sequential([keras.Input((3,)), kd.DenseDiagDVI(16, "relu"), kd.DenseDiagDVI(1)])
    model = kd.TAGIModel(network, observation_noise=0.1, seed=0)
    model.compile(steps_per_execution=4)
    data = tf.data.Dataset.from_tensor_slices((x[:120], y[:120])).shuffle(120, seed=0).batch(8)
    stop = keras.callbacks.EarlyStopping(monitor="val_nll", mode="min", patience=3, restore_best_weights=True)
    history = model.fit(data, validation_data=(x[120:], y[120:]), epochs=50, verbose=0, callbacks=[stop])
    val = history.history["val_nll"]
    assert len(val) < 50 and min(val) < val[0] - 0.2  # learned, then stopped
    np.testing.assert_allclose(model.evaluate(x[120:], y[120:], verbose=0, return_dict=True)["nll"], min(val),
                               rtol=1e-4, atol=1e-5)


def _digits_classifier():
    """The digits (pixels / 16) and a compiled 64-100-tree TAGI classifier: `(x, y, model)`."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    network = keras.Sequential([keras.Input((64,)), kd.DenseDiagDVI(100, "relu"), kd.DenseDiagDVI(tagi.tree(10)[0])])
    model = kd.TAGIModel(network, observation_noise=0.3, classes=10, seed=0)
    model.compile()
    return (x / 16.0).astype("float32"), y, model


def test_classification_trains_on_digits():
    x, y, model = _digits_classifier()
    history = model.fit(x[:1400], y[:1400], batch_size=10, epochs=2, verbose=0)
    assert history.history["accuracy"][-1] > 0.9
    out = kd.predict(model, x[1400:])
    np.testing.assert_allclose(out["probabilities"].sum(1), 1.0, rtol=1e-5)
    assert np.mean(out["label"] == y[1400:]) > 0.8
    assert np.isfinite(out["entropy"]).all()


def test_classification_logs_the_marginal_likelihood_of_the_tree_observations():
    """`observation_nll` is minus the log Gaussian density of each label's path observations
    (scipy, node by node, with the output variances plus sigma_V^2), and early stopping on its
    validation value (the paper's criterion) stops and restores the best posterior."""
    x, y, model = _digits_classifier()
    stop = keras.callbacks.EarlyStopping(monitor="val_observation_nll", mode="min", patience=1,
                                         restore_best_weights=True)
    history = model.fit(x[:300], y[:300], batch_size=10, epochs=40, verbose=0, callbacks=[stop],
                        validation_data=(x[1000:1400], y[1000:1400])).history
    assert set(history) == {f"{p}{m}" for p in ("", "val_") for m in ("nll", "accuracy", "observation_nll")}
    val = history["val_observation_nll"]
    assert len(val) < 40 and min(val) < val[0]  # learned, then stopped
    logs = model.evaluate(x[1000:1400], y[1000:1400], verbose=0, return_dict=True)
    np.testing.assert_allclose(logs["observation_nll"], min(val), rtol=1e-4, atol=1e-5)  # the best restored
    out = np.asarray(model.predict(x[1400:], verbose=0), "float64")
    signs = np.asarray(tagi.tree(10)[1], "float64")[y[1400:]]  # +-1 on each label's path, 0 off it
    density = stats.norm.logpdf(signs, out[:, 0], np.sqrt(out[:, 1] + 0.3**2))
    want = -np.mean(np.sum(np.where(signs != 0, density, 0.0), axis=1))
    got = model.evaluate(x[1400:], y[1400:], verbose=0, return_dict=True)["observation_nll"]
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_conv_network_trains_on_digits_and_round_trips(tmp_path):
    """A TAGI CNN (conv, average pooling, flatten, dense, the tree head) learns the digits as
    8x8 images, and its `.keras` file predicts the same numbers."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).reshape(-1, 8, 8, 1).astype("float32")
    units, _ = tagi.tree(10)
    network = keras.Sequential([keras.Input((8, 8, 1)), kd.Conv2DDVI(16, 3, padding="same", activation="relu"),
                                kd.AveragePooling2DDVI(2), kd.FlattenDVI(), kd.DenseDiagDVI(64, "relu"),
                                kd.DenseDiagDVI(units)])
    model = kd.TAGIModel(network, observation_noise=0.3, classes=10, seed=0)
    model.compile()
    model.fit(x[:1400], y[:1400], batch_size=10, epochs=3, verbose=0)
    out = kd.predict(model, x[1400:])
    assert np.mean(out["label"] == y[1400:]) > 0.8  # (chance: 0.1; without the cap it stays there)
    loaded = reloaded(model, tmp_path, "tagi_cnn")
    assert loaded.max_step == "auto" and loaded._max_step == 1.0  # conv networks cap their updates
    np.testing.assert_allclose(loaded.predict(x[1400:], verbose=0), model.predict(x[1400:], verbose=0),
                               rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("initialize", [True, "xavier", "he", 0.25])
def test_initialisation_draws_means_from_the_stated_prior(initialize):
    """Weight variances by the named rule (fans as Keras counts them, conv taps included), bias
    variances 0.01, and means drawn from that prior (sample variance within 4 standard errors)."""
    network = keras.Sequential([keras.Input((10, 10, 3)), kd.Conv2DDVI(40, 3, activation="relu"),
                                kd.FlattenDVI(), kd.DenseDiagDVI(200, "relu"), kd.DenseDiagDVI(1)])
    kd.TAGIModel(network, seed=0, initialize=initialize)
    weighted = [layer for layer in network.layers if layer.weights]
    for layer, (fan_in, fan_out) in zip(weighted, [(27, 360), (2560, 200), (200, 1)], strict=True):
        if initialize in (True, "xavier"):
            want = 2.0 / (fan_in + fan_out)
        else:
            want = (1.0 if initialize == "he" else initialize) / fan_in
        variance = _np(layer.kernel_variance)
        np.testing.assert_allclose(variance, want, rtol=1e-5)
        np.testing.assert_allclose(_np(layer.bias_variance), 0.01, rtol=1e-5)
        means = _np(layer.kernel_mean).ravel()
        assert abs(means.var() / want - 1.0) < 4.0 * np.sqrt(2.0 / means.size)
        assert abs(means.mean()) < 4.0 * np.sqrt(want / means.size)


def test_initialize_false_keeps_the_posteriors():
    network = keras.Sequential([keras.Input((3,)), kd.DenseDiagDVI(4, "relu"), kd.DenseDiagDVI(1)])
    before = [_np(v) for v in network.weights]
    kd.TAGIModel(network, initialize=False)
    for old, new in zip(before, network.weights):
        np.testing.assert_array_equal(old, _np(new))


def test_misuse_is_refused():
    dense = keras.Sequential([keras.Input((3,)), kd.DenseDVI(1)])
    with pytest.raises(ValueError, match="DenseDiagDVI"):
        kd.TAGIModel(dense)
    relu_out = keras.Sequential([keras.Input((3,)), kd.DenseDiagDVI(2, "relu")])
    with pytest.raises(ValueError, match="must be a linear"):
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
    image = keras.Input((6, 6, 1))
    conv_max = keras.Sequential([image, kd.Conv2DDVI(2, 3), kd.MaxPooling2DDVI(2, activation="relu"),
                                 kd.FlattenDVI(), kd.DenseDiagDVI(1)])
    with pytest.raises(ValueError, match="AveragePooling2DDVI"):
        kd.TAGIModel(conv_max)
    strided = keras.Sequential([image, kd.Conv2DDVI(2, 3, strides=2), kd.FlattenDVI(), kd.DenseDiagDVI(1)])
    with pytest.raises(ValueError, match="strides"):
        kd.TAGIModel(strided)
    overlapping = keras.Sequential([image, kd.Conv2DDVI(2, 3), kd.AveragePooling2DDVI(2, strides=1),
                                    kd.FlattenDVI(), kd.DenseDiagDVI(1)])
    with pytest.raises(ValueError, match="pool_size"):
        kd.TAGIModel(overlapping)
    conv_last = keras.Sequential([image, kd.Conv2DDVI(1, 6)])
    with pytest.raises(ValueError, match="linear DenseDiagDVI"):
        kd.TAGIModel(conv_last)
    for bad in (0.0, float("inf"), True, "1"):
        with pytest.raises(ValueError, match="max_step"):
            kd.TAGIModel(ok, max_step=bad)
    for bad in (0.0, -1.0, float("nan"), "glorot", None):
        with pytest.raises(ValueError, match="initialize"):
            kd.TAGIModel(ok, initialize=bad)
    model = kd.TAGIModel(ok)
    with pytest.raises(ValueError, match="optimizer"):
        model.compile(optimizer="adam")
    with pytest.raises(ValueError, match="loss"):
        model.compile(loss="mse")


def test_sample_and_class_weights_are_refused_not_ignored():
    """A TAGI update has no loss to weigh: weights given to `fit` / `evaluate` were dropped
    silently."""
    network = keras.Sequential([keras.Input((3,)), kd.DenseDiagDVI(4, "relu"), kd.DenseDiagDVI(1)])
    model = kd.TAGIModel(network)
    model.compile()
    x = np.random.default_rng(0).normal(size=(16, 3)).astype("float32")
    y = x[:, :1]
    with pytest.raises(ValueError, match=r"sample weights .*repeat its\s+examples"):
        model.fit(x, y, sample_weight=np.ones(16, "float32"), epochs=1, verbose=0)
    with pytest.raises(ValueError, match=r"sample weights"):
        model.evaluate(x, y, sample_weight=np.ones(16, "float32"), verbose=0)
    classifier = kd.TAGIModel(keras.Sequential([keras.Input((3,)), kd.DenseDiagDVI(4, "relu"), kd.DenseDiagDVI(3)]),
                              classes=3)
    classifier.compile()
    for weights in ({}, {"sample_weight": None}):  # (an explicit None beside it too)
        with pytest.raises(ValueError, match=r"class_weight"):
            classifier.fit(x, np.arange(16) % 3, class_weight={0: 1.0, 1: 2.0, 2: 1.0}, epochs=1, verbose=0, **weights)
    import tensorflow as tf

    weighted = tf.data.Dataset.from_tensor_slices((x, y, np.ones(16, "float32"))).batch(8)
    with pytest.raises(ValueError, match=r"\(x, y, weights\) data"):
        model.fit(weighted, epochs=1, verbose=0)
    # (a fit that raised inside its JAX step leaves the variables with Keras, unset: a new model)
    model = kd.TAGIModel(keras.Sequential([keras.Input((3,)), kd.DenseDiagDVI(4, "relu"), kd.DenseDiagDVI(1)]))
    model.compile()
    model.fit(x, y, epochs=1, verbose=0)  # unweighted data trains


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
