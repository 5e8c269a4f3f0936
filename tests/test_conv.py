"""Bayesian convolutional networks: the maths of `keras_dvi.conv_moments` against Monte Carlo,
the layers against Monte Carlo of the network the user built (`predict_samples`: one kernel
drawn per sample, shared by every position), and the Keras conventions of the new layers."""

import itertools
import warnings

import keras
import numpy as np
import pytest
from keras import ops

import keras_dvi as kd
from keras_dvi import conv_moments
from tests.conftest import plain_outputs, reloaded, to_numpy

# --------------------------------------------------------------------------- helpers


def _images(size, rows=6, channels=1, seed=0):
    """scikit-learn's 8x8 digits, zoomed to `size` x `size` (bilinear), scaled to [0, 1]."""
    from scipy import ndimage
    from sklearn.datasets import load_digits

    digits = load_digits().images[:rows] / 16.0
    if size != 8:
        digits = np.stack([ndimage.zoom(d, size / 8, order=1) for d in digits])
    x = np.clip(digits, 0, 1)[..., None]
    if channels > 1:
        rng = np.random.default_rng(seed)
        x = x * rng.uniform(0.5, 1.5, (1, 1, 1, channels))
    return x.astype("float32")


def _set_variances(model, scale):
    """Posterior variances `scale / fan_in` for every kernel (biases a tenth of that)."""
    for layer in model.layers:
        if isinstance(layer, kd.layers.BayesianLayer):
            kernel_mean, _, bias_mean, _ = layer._posterior()  # noqa: SLF001 - shapes only
            fan_in = int(np.prod(kernel_mean.shape[:-1]))
            kernel_var = np.full(kernel_mean.shape, scale / fan_in, "float32")
            bias_var = None if bias_mean is None else np.full(bias_mean.shape, 0.1 * scale / fan_in, "float32")
            layer.set_posterior(to_numpy(kernel_mean), kernel_var, None if bias_mean is None else to_numpy(bias_mean),
                                bias_var)


def _compare(model, x, num_samples=4000, seed=0):
    """`(mean error / predictive sd, variance / Monte Carlo variance, Monte Carlo standard errors
    of both)` for every output of `model` on `x`."""
    mean, variance = (to_numpy(t) for t in kd.unpack(model(x)))
    if variance.ndim == mean.ndim + 1:
        variance = np.diagonal(variance, axis1=-2, axis2=-1)
    samples = kd.predict_samples(model, x, num_samples, seed=seed).astype("float64")
    mc_mean, mc_var = samples.mean(1), samples.var(1)
    # A ReLU unit that no draw switches on has no variance: compared on an absolute scale.
    live = mc_var > 1e-10
    assert np.all(live | (variance < 1e-4)), "a unit with variance where Monte Carlo has none"
    return (mean - mc_mean) / np.sqrt(np.maximum(mc_var, 1e-6)), np.where(live, variance / np.where(live, mc_var, 1), 1)


def _assert_exact(model, x, n, seed=0):
    """Means and variances of `model(x)` equal Monte Carlo's within 5 standard errors of each
    unit (the variance's from the samples' fourth moment: ReLU units are heavy-tailed)."""
    mean, variance = (to_numpy(t) for t in kd.unpack(model(x)))
    samples = kd.predict_samples(model, x, n, seed=seed).astype("float64")
    _assert_moments_match_samples(mean, variance, samples)


def _assert_moments_match_samples(mean, variance, samples):
    """Within 5 (mean) and 6 (variance) standard errors of Monte Carlo, on the units the
    central limit theorem covers: a ReLU unit that fewer than 1% of the draws switch on has a
    far from normal sample mean (it is only checked to be near 0)."""
    n = samples.shape[1]
    centred = samples - samples.mean(1, keepdims=True)
    mc_var = np.mean(centred ** 2, 1)
    mean_se = np.sqrt(mc_var / n)
    var_se = np.sqrt(np.maximum(np.mean(centred ** 4, 1) - mc_var ** 2, 0) / n)
    assert mean.shape == samples.shape[:1] + samples.shape[2:]
    regular = np.mean(samples != 0, axis=1) > 0.01
    assert regular.mean() > 0.5
    err_mean, err_var = np.abs(mean - samples.mean(1)), np.abs(variance - mc_var)
    np.testing.assert_array_less(err_mean[regular], 5 * mean_se[regular] + 2e-5)  # (+ float32 rounding)
    np.testing.assert_array_less(err_var[regular], 6 * var_se[regular] + 2e-5)
    np.testing.assert_array_less(np.abs(mean[~regular]), 1e-2 * np.sqrt(mc_var.max()) + 1e-5)


def _factor_inputs(rng, shape):
    """Moments `(m, v, s)` of a feature map in keras-dvi's representation, with shared
    components of every size up to the whole sd."""
    m = rng.normal(size=shape)
    v = rng.uniform(0.05, 1.0, shape)
    s = np.sqrt(v) * rng.uniform(-1.0, 1.0, shape)
    return m, v, s


def _factor_samples(rng, m, v, s, n):
    """`n` samples `u = m + s z_c + e` (one z per channel and sample), `(n, *shape)`."""
    z = rng.standard_normal((n, m.shape[0]) + (1,) * (m.ndim - 2) + (m.shape[-1],))
    e = rng.standard_normal((n,) + m.shape) * np.sqrt(v - s ** 2)
    return m + s * z + e, z


# --------------------------------------------------------------------------- Clark's max


@pytest.mark.parametrize("m1, v1, m2, v2, rho", [
    (0.0, 1.0, 0.0, 1.0, 0.0),
    (0.5, 2.0, -0.3, 0.5, 0.6),
    (1.0, 0.3, 0.8, 1.5, -0.7),
    (3.0, 0.1, -2.0, 0.1, 0.0),  # one side always wins
    (0.2, 1.0, 0.0, 1.0, 0.99),  # almost the same variable
])
def test_gaussian_max_matches_monte_carlo(m1, v1, m2, v2, rho):
    """Clark's (1961) mean and variance of the max of two jointly Gaussian variables are exact;
    so is `Cov(max(X1, X2), Z) = Cov(X1, Z) w + Cov(X2, Z) (1 - w)` for a third Gaussian `Z`."""
    rng = np.random.default_rng(0)
    n = 400_000
    cov = rho * np.sqrt(v1 * v2)
    z = rng.standard_normal(n)
    c1, c2 = 0.3 * np.sqrt(v1), 0.2 * np.sqrt(v2)  # Cov(X_i, Z)
    joint = np.array([[v1 - c1 ** 2, cov - c1 * c2], [cov - c1 * c2, v2 - c2 ** 2]])
    rest = rng.multivariate_normal([0, 0], joint, n, method="eigh")
    x1, x2 = m1 + c1 * z + rest[:, 0], m2 + c2 * z + rest[:, 1]
    top = np.maximum(x1, x2)
    mean, var, weight = (float(to_numpy(t)) for t in conv_moments.gaussian_max(
        *(np.float64(a) for a in (m1, v1, m2, v2, cov))))
    assert abs(mean - top.mean()) < 5 * top.std() / np.sqrt(n)
    assert abs(var - top.var()) < 5 * top.var() * np.sqrt(2 / n) + 1e-12
    covariance = np.mean((top - top.mean()) * z)
    assert abs(c1 * weight + c2 * (1 - weight) - covariance) < 5 * top.std() / np.sqrt(n)


def test_gaussian_max_is_finite_at_the_edges(floatx):
    """Deterministic inputs (both variances 0), a padded side (mean -1e9) and equal inputs:
    finite values and gradients, and the deterministic limit is the max."""
    m1 = np.array([0.3, -1e9, 2.0, 1.0], floatx)
    v1 = np.array([0.0, 0.0, 1.0, 1.0], floatx)
    m2 = np.array([0.1, 0.5, -1e9, 1.0], floatx)
    v2 = np.array([0.0, 0.7, 0.0, 1.0], floatx)
    cov = np.array([0.0, 0.0, 0.0, 1.0], floatx)  # the last pair: one variable twice
    from tests.conftest import gradients

    value, grads = gradients(lambda *t: ops.sum(ops.stack(conv_moments.gaussian_max(*t)[:2])), [m1, v1, m2, v2, cov])
    mean, var, _ = (to_numpy(t) for t in conv_moments.gaussian_max(m1, v1, m2, v2, cov))
    assert np.isfinite(value) and all(np.isfinite(g).all() for g in grads)
    np.testing.assert_allclose(mean, [0.3, 0.5, 2.0, 1.0], rtol=1e-5, atol=1e-3)
    np.testing.assert_allclose(var, [0.0, 0.7, 1.0, 1.0], rtol=1e-4, atol=1e-3)


def _pair_inputs(rng, n):
    m1, m2 = rng.normal(0, 1, n), rng.normal(0, 1, n)
    v1, v2 = rng.uniform(0.1, 2, n), rng.uniform(0.1, 2, n)
    s1 = 0.9 * rng.uniform(-1, 1, n) * np.sqrt(v1)
    s2 = 0.9 * rng.uniform(-1, 1, n) * np.sqrt(v2)
    m2[:5] = m1[:5] + rng.normal(0, 1e-3, 5)  # near ties
    m2[5:10] = m1[5:10] + 4 * np.sqrt(v1[5:10] + v2[5:10])  # one side (almost) always wins
    return [m1, v1, s1, m2, v2, s2]


def test_max_pair_gradient_matches_finite_differences():
    """The hand-written gradient of Clark's step (`max_pair_moments`) against central finite
    differences of its values in float64, for a random weighting of its three outputs (its
    values share `gaussian_max`'s terms, checked against Monte Carlo above and through
    `max_pool_moments` below)."""
    rng = np.random.default_rng(3)
    n = 40
    args = _pair_inputs(rng, n)
    weights = [rng.normal(size=n) for _ in range(3)]

    def objective(*t):
        return sum(ops.sum(out * w) for out, w in zip(conv_moments.max_pair_moments(*t), weights))

    from tests.conftest import gradients

    _, grads = gradients(objective, args)
    h = 1e-6
    for i, a in enumerate(args):
        # every element moves at once: each output element depends on its own inputs only
        plus = [x + h * (j == i) for j, x in enumerate(args)]
        minus = [x - h * (j == i) for j, x in enumerate(args)]
        outs_plus = [to_numpy(t) for t in conv_moments.max_pair_moments(*plus)]
        outs_minus = [to_numpy(t) for t in conv_moments.max_pair_moments(*minus)]
        finite = sum(w * (op - om) for w, op, om in zip(weights, outs_plus, outs_minus)) / (2 * h)
        np.testing.assert_allclose(grads[i], finite, rtol=1e-6, atol=1e-7, err_msg=f"argument {i}")


def test_shared_component_clip_gradient_matches_finite_differences():
    """`|s| <= sqrt(v)` (its hand-written gradient): the values of `clip`, and the gradient
    against central finite differences on both sides of the bound; none to a floored `v`."""
    rng = np.random.default_rng(5)
    variance = np.concatenate([rng.uniform(0.1, 2.0, 20), [0.0, 0.0]])
    shared = np.concatenate([rng.uniform(-2.0, 2.0, 20), [0.5, -0.5]]) * np.sqrt(np.maximum(variance, 0.3))
    weights = rng.normal(size=variance.size)
    from tests.conftest import gradients

    value = to_numpy(conv_moments.clip_shared(shared, variance))  # noqa: SLF001
    bound = np.sqrt(np.maximum(variance, 1e-12))
    np.testing.assert_allclose(value, np.clip(shared, -bound, bound), rtol=1e-15)
    assert (np.abs(shared) > bound).sum() >= 5 and (np.abs(shared) < bound).sum() >= 5  # both sides tested
    _, (g_shared, g_var) = gradients(lambda s, v: ops.sum(conv_moments.clip_shared(s, v) * weights),  # noqa: SLF001
                                     [shared, variance])
    h = 1e-7
    live = variance > 0
    fd_shared = (np.clip(shared + h, -bound, bound) - np.clip(shared - h, -bound, bound)) / (2 * h) * weights
    fd_var = (np.clip(shared, -np.sqrt(variance + h), np.sqrt(variance + h))
              - np.clip(shared, -np.sqrt(np.maximum(variance - h, 0)), np.sqrt(np.maximum(variance - h, 0)))) / (2 * h) * weights
    np.testing.assert_allclose(g_shared, fd_shared, rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(g_var[live], fd_var[live], rtol=1e-6, atol=1e-8)
    np.testing.assert_array_equal(g_var[~live], 0.0)


@pytest.mark.parametrize("spatial, window, strides, padding, dilation", [
    ((9, 7), (3, 3), (1, 1), "valid", (1, 1)),
    ((9, 7), (3, 2), (2, 2), "same", (1, 1)),
    ((10, 9), (3, 3), (1, 1), "same", (2, 2)),
    ((14,), (4,), (3,), "same", (1,)),
    ((15,), (5,), (2,), "valid", (1,)),
])
def test_window_total_matches_its_definition(spatial, window, strides, padding, dilation):
    """The shared component's window total, `sum_p x[p + o]` over a convolution's output
    positions averaged over the offsets (computed from a coverage map), against the sum written
    out position by position with Keras' padding ("same": the extra pad after)."""
    rng = np.random.default_rng(6)
    x = rng.normal(size=(2,) + spatial + (3,))
    out, before = [], []
    for n, k, st, d in zip(spatial, window, strides, dilation):
        size = -(-n // st) if padding == "same" else (n - (k - 1) * d - 1) // st + 1
        out.append(size)
        before.append(max((size - 1) * st + (k - 1) * d + 1 - n, 0) // 2 if padding == "same" else 0)
    want = np.zeros((2, 3))
    for p in itertools.product(*(range(o) for o in out)):
        for o in itertools.product(*(range(k) for k in window)):
            q = tuple(pi * st + oi * d - b for pi, oi, st, d, b in zip(p, o, strides, dilation, before))
            if all(0 <= qi < n for qi, n in zip(q, spatial)):
                want += x[(slice(None),) + q]
    want /= np.prod(window)
    got = to_numpy(conv_moments._window_total(x, window, strides, padding, dilation))  # noqa: SLF001
    np.testing.assert_allclose(got.reshape(2, 3), want, rtol=1e-12)


def test_max_pair_is_finite_at_the_edges(floatx):
    """`max_pair_moments` at deterministic inputs, a padded side (mean -1e9), one variable
    twice (`theta` floored) and a tie: finite values and gradients, the max in the
    deterministic limit, and an unused output (its upstream gradient zero) is fine."""
    m1 = np.array([0.3, -1e9, 2.0, 1.0, 0.0], floatx)
    v1 = np.array([0.0, 0.0, 1.0, 1.0, 1.0], floatx)
    s1 = np.array([0.0, 0.0, 0.5, 1.0, 0.0], floatx)
    m2 = np.array([0.1, 0.5, -1e9, 1.0, 0.0], floatx)
    v2 = np.array([0.0, 0.7, 0.0, 1.0, 1.0], floatx)
    s2 = np.array([0.0, 0.3, 0.0, 1.0, 0.0], floatx)
    from tests.conftest import gradients

    for use in (slice(0, 3), slice(0, 2)):
        value, grads = gradients(lambda *t: ops.sum(ops.stack(conv_moments.max_pair_moments(*t)[use])),
                                 [m1, v1, s1, m2, v2, s2])
        assert np.isfinite(value) and all(np.isfinite(g).all() for g in grads)
    mean, var, shared = (to_numpy(t) for t in conv_moments.max_pair_moments(m1, v1, s1, m2, v2, s2))
    np.testing.assert_allclose(mean, [0.3, 0.5, 2.0, 1.0, 1 / np.sqrt(np.pi)], rtol=1e-5, atol=1e-3)
    np.testing.assert_allclose(var, [0.0, 0.7, 1.0, 1.0, 1 - 1 / np.pi], rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(shared, [0.0, 0.3, 0.5, 1.0, 0.0], atol=1e-6)


# --------------------------------------------------------------------------- pooling maths


def _pool_numpy(u, pool, stride, padding, kind):
    """Keras' own pooling of NumPy samples `(n, batch, *spatial, channels)`."""
    rank = u.ndim - 3
    fold = u.reshape((-1,) + u.shape[2:])
    op = ops.max_pool if kind == "max" else ops.average_pool
    out = to_numpy(op(fold.astype("float32"), (pool,) * rank, (stride,) * rank, padding))
    return out.reshape(u.shape[:2] + out.shape[1:])


@pytest.mark.parametrize("kind, rank, pool, stride, padding", [
    ("max", 2, 2, 2, "valid"), ("max", 2, 3, 2, "same"), ("max", 1, 3, 1, "valid"),
    ("average", 2, 2, 2, "valid"), ("average", 2, 3, 2, "same"), ("average", 1, 2, 1, "same"),
])
def test_pooling_moments_match_monte_carlo_of_factor_inputs(kind, rank, pool, stride, padding):
    """Pooling of Gaussian feature maps in keras-dvi's representation (`u = m + s z + e`):
    average pooling exactly, max pooling by Clark's recursion (its Gaussian approximation of
    each pairwise max is the only error), means, variances and the shared component
    `Cov(out, z)`."""
    rng = np.random.default_rng(1)
    shape = (3,) + (7,) * rank + (4,)
    m, v, s = _factor_inputs(rng, shape)
    if kind == "max":
        m = 0.5 * m  # overlapping inputs, where the max is least Gaussian
    u, z = _factor_samples(rng, m, v, s, 40_000)
    out = _pool_numpy(u, pool, stride, padding, kind)
    function = conv_moments.max_pool_moments if kind == "max" else conv_moments.average_pool_moments
    mean, var, shared = (to_numpy(t) for t in function(m, v, s, (pool,) * rank, (stride,) * rank, padding))
    assert mean.shape == out.shape[1:]
    sd = out.std(0)
    mean_error = np.abs(mean - out.mean(0)) / sd
    ratio = var / out.var(0)
    shared_mc = np.mean((out - out.mean(0)) * z, axis=0)
    shared_error = np.abs(shared - shared_mc) / sd
    if kind == "average":  # exact: Monte Carlo error only
        assert mean_error.max() < 5 / np.sqrt(40_000) * 1.5
        assert np.abs(ratio - 1).max() < 5 * np.sqrt(2 / 40_000) * 1.5
        assert shared_error.max() < 0.03
    else:
        # Clark's Gaussian max under-states the variance of the max of strongly overlapping
        # inputs (measured medians: 0.94 for 2x2 windows, 0.87 for 3x3, 0.97 for 1D windows of 3).
        assert np.median(mean_error) < 0.03 and mean_error.max() < 0.2
        assert 0.82 < np.median(ratio) < 1.05 and ratio.min() > 0.6 and ratio.max() < 1.3
        assert np.median(shared_error) < 0.04 and shared_error.max() < 0.3


def test_global_average_pooling_is_exact_within_the_representation():
    rng = np.random.default_rng(2)
    m, v, s = _factor_inputs(rng, (3, 5, 6, 4))
    u, _ = _factor_samples(rng, m, v, s, 100_000)
    out = u.mean(axis=(2, 3))
    mean, var = (to_numpy(t) for t in conv_moments.global_average_pool_moments(m, v, s))
    np.testing.assert_allclose(mean, out.mean(0), atol=5 * out.std(0).max() / np.sqrt(100_000))
    np.testing.assert_allclose(var, out.var(0), rtol=5 * np.sqrt(2 / 100_000))


@pytest.mark.parametrize("shape", [(3, 17, 4), (3, 5, 6, 4)], ids=["1d-odd", "2d"])
def test_global_max_pooling_matches_monte_carlo_of_factor_inputs(shape):
    """The max over every position by Clark's recursion in order against Keras' max over
    samples of the map (`u = m + s z + e`): its Gaussian approximation of each pairwise max is
    the only error. On these strongly overlapping positions (means differing by less than their
    sds) it under-states the variance: medians measured 0.67-0.75 of Monte Carlo's, 0.64 on 64
    positions (a balanced tree of pairwise maxima: 0.38-0.66)."""
    rng = np.random.default_rng(3)
    m, v, s = _factor_inputs(rng, shape)
    m = 0.5 * m  # overlapping inputs, where the max is least Gaussian
    u, _ = _factor_samples(rng, m, v, s, 40_000)
    out = to_numpy(ops.max(u.astype("float32"), axis=tuple(range(2, u.ndim - 1)))).astype("float64")
    mean, var = (to_numpy(t) for t in conv_moments.global_max_pool_moments(m, v, s))
    assert mean.shape == var.shape == out.shape[1:]
    mean_error = np.abs(mean - out.mean(0)) / out.std(0)
    ratio = var / out.var(0)
    assert np.median(mean_error) < 0.15 and mean_error.max() < 0.3
    assert 0.6 < np.median(ratio) < 1.05 and ratio.min() > 0.5 and ratio.max() < 1.1


@pytest.mark.parametrize("rank", [1, 2])
def test_global_max_pooling_network_matches_monte_carlo(rank):
    """A convolution, then the global max with the ReLU on it (as `convert` moves it), then a
    dense layer, against Monte Carlo over the weights (`predict_samples`, which pools each draw
    with Keras' max): means and variances of the outputs. Weight noise, shared by the
    positions of a channel, dominates here: medians measured 0.02-0.07 sd and variance ratios
    0.975-1.03 over three seeds per rank."""
    keras.utils.set_random_seed(11 + rank)
    size = (24,) if rank == 1 else (8, 8)
    conv, pool = (kd.Conv1DDVI, kd.GlobalMaxPooling1DDVI) if rank == 1 else (kd.Conv2DDVI, kd.GlobalMaxPooling2DDVI)
    model = keras.Sequential([keras.Input(size + (2,)), conv(6, 3), pool(activation="relu"), kd.DenseDiagDVI(3)])
    _set_variances(model, 0.3)
    x = np.random.default_rng(rank).normal(size=(6,) + size + (2,)).astype("float32")
    mean_error, ratio = _compare(model, x, 4000)
    assert np.median(np.abs(mean_error)) < 0.1 and np.abs(mean_error).max() < 0.2
    assert 0.9 < np.median(ratio) < 1.1


@pytest.mark.skipif(keras.backend.backend() != "tensorflow", reason="JAX traces every shape statically")
def test_global_max_pooling_takes_sequences_of_any_length():
    """Under TensorFlow a text model takes `keras.Input((None,))`: its global max, traced once
    for sequences of unknown length (a loop over the positions), gives on each length the
    moments of the same maps of known length, and trains on batches of different lengths."""
    import tensorflow as tf

    rng = np.random.default_rng(4)
    spec = tf.TensorSpec((None, None, 3), "float64")
    pooled = tf.function(conv_moments.global_max_pool_moments, input_signature=[spec] * 3)
    for steps in (1, 2, 9):
        m, v, s = _factor_inputs(rng, (2, steps, 3))
        for got, want in zip(pooled(m, v, s), conv_moments.global_max_pool_moments(m, v, s)):
            np.testing.assert_allclose(to_numpy(got), to_numpy(want), rtol=1e-12)
    tokens = keras.Input((None,), dtype="int32")
    h = keras.layers.Embedding(20, 4)(tokens)
    prior = kd.EmpiricalBayesRegularizer(32)
    pooled_map = kd.GlobalMaxPooling1DDVI(activation="relu")(kd.Conv1DDVI(3, 2, regularizer=prior)(h))
    model = keras.Model(tokens, kd.DenseDVI(2, regularizer=prior)(pooled_map))
    for steps in (5, 8):
        assert model.predict(rng.integers(0, 20, size=(3, steps)), verbose=0).shape == (3, 3, 2)

    def batches():  # a batch of another length each step: trained through one trace
        for steps in (4, 7, 5, 9):
            x = rng.integers(0, 20, size=(8, steps)).astype("int32")
            yield x, (x[:, 0] > 10).astype("int32")

    data = tf.data.Dataset.from_generator(batches, output_signature=(tf.TensorSpec((None, None), tf.int32),
                                                                     tf.TensorSpec((None,), tf.int32)))
    model.compile(keras.optimizers.Adam(1e-2), loss=kd.SoftmaxDeltaELL())
    weights = [to_numpy(w) for w in model.trainable_weights]
    assert np.isfinite(model.fit(data, epochs=1, verbose=0).history["loss"]).all()
    assert all(np.isfinite(to_numpy(w)).all() and not np.array_equal(to_numpy(w), w0)
               for w, w0 in zip(model.trainable_weights, weights))


def test_global_max_pool_gradient_matches_finite_differences():
    """The gradient of the global max's moments (Clark's recursion as a scan, the pairwise
    step's hand-written gradient) against central finite differences in float64, along random
    directions of the mean, variance and shared component."""
    rng = np.random.default_rng(12)
    m, v, s = _factor_inputs(rng, (2, 7, 3))
    weights = [rng.normal(size=(2, 3)) for _ in range(2)]

    def objective(*t):
        return sum(ops.sum(out * w) for out, w in zip(conv_moments.global_max_pool_moments(*t), weights))

    from tests.conftest import gradients

    _, grads = gradients(objective, [m, v, s])
    h = 1e-6
    for _ in range(3):
        d = [rng.normal(size=m.shape) for _ in range(3)]
        up, down = (to_numpy(objective(*(x + sign * h * dx for x, dx in zip((m, v, s), d)))) for sign in (1, -1))
        np.testing.assert_allclose(sum(np.sum(g * dx) for g, dx in zip(grads, d)), (up - down) / (2 * h), rtol=1e-6)


def test_max_pooling_is_not_the_largest_mean():
    """Two equal inputs: the max has mean `sd / sqrt(pi)` above them, which the "largest mean"
    shortcut of some libraries misses."""
    m = np.zeros((1, 2, 1, 1), "float32")
    v = np.ones_like(m)
    mean, var, _ = (to_numpy(t) for t in conv_moments.max_pool_moments(m, v, 0 * m, (2, 1), (2, 1)))
    np.testing.assert_allclose(mean.ravel(), [1 / np.sqrt(np.pi)], rtol=1e-5)
    np.testing.assert_allclose(var.ravel(), [1 - 1 / np.pi], rtol=1e-5)


@pytest.mark.parametrize("shape, pool, padding, strides", [
    ((2, 6, 4, 3), (2, 2), "valid", None),  # windows tile the map
    ((2, 7, 5, 3), (2, 2), "valid", None),  # a row and a column no window reaches
    ((2, 6, 6, 2), (3, 2), "valid", None),
    ((2, 9, 3), (3,), "valid", None),  # 1D
    ((2, 5, 5, 2), (2, 2), "same", None),  # padded, then tiled
    ((2, 7, 6, 2), (3, 3), "valid", (2, 2)),  # overlapping windows (strided slices)
], ids=["tiled", "cropped", "pool3x2", "1d", "same", "overlapping"])
def test_max_pool_gradient_matches_finite_differences(shape, pool, padding, strides):
    """The gradient of max pooling's moments (under JAX Clark's recursion is a scan over the
    window's offsets, under TensorFlow unrolled) against central finite differences of its
    values in float64, along random directions of all three inputs together and of each alone;
    no gradient to elements no window reaches."""
    rng = np.random.default_rng(11)
    strides = strides or pool
    m, v, s = _factor_inputs(rng, shape)
    weights = [rng.normal(size=t.shape) for t in
               (to_numpy(o) for o in conv_moments.max_pool_moments(m, v, s, pool, strides, padding))]

    def objective(*t):
        return sum(ops.sum(out * w) for out, w in zip(conv_moments.max_pool_moments(*t, pool, strides, padding), weights))

    from tests.conftest import gradients

    _, grads = gradients(objective, [m, v, s])
    h = 1e-6
    directions = [[rng.normal(size=shape) for _ in range(3)] for _ in range(3)]
    directions += [[rng.normal(size=shape) * (j == i) for j in range(3)] for i in range(3)]
    # every perturbed input in one call, along the batch axis (examples are pooled independently)
    moved = [np.concatenate([x + sign * h * d[i] for d in directions for sign in (1, -1)]) for i, x in enumerate((m, v, s))]
    outs = [to_numpy(o).reshape((2 * len(directions),) + w.shape)
            for o, w in zip(conv_moments.max_pool_moments(*moved, pool, strides, padding), weights)]
    values = sum(np.sum(o * w, axis=tuple(range(1, o.ndim))) for o, w in zip(outs, weights))
    for j, d in enumerate(directions):
        along = sum(np.sum(g * dx) for g, dx in zip(grads, d))
        np.testing.assert_allclose(along, (values[2 * j] - values[2 * j + 1]) / (2 * h), rtol=1e-6)
    if shape[1] % pool[0] and padding == "valid" and strides == pool:
        for g in grads:
            assert np.all(g[:, -1] == 0) and np.any(g[:, 0] != 0)


# --------------------------------------------------------------------------- the layers against Monte Carlo


@pytest.mark.parametrize("rank, kwargs", [
    (2, {"padding": "valid"}),
    (2, {"padding": "same", "strides": 2}),
    (2, {"padding": "valid", "dilation_rate": 2}),
    (1, {"padding": "same"}),
])
@pytest.mark.parametrize("activation", [None, "relu"])
def test_first_conv_layer_moments_are_exact(rank, kwargs, activation):
    """The first conv layer's per-position means and variances are exact (Monte Carlo over
    kernels, each shared by every position, agrees within its standard error)."""
    x = _images(8, rows=3, channels=2)
    if rank == 1:
        x = x[:, :, :, 0]  # (rows, 8 steps, 8 channels)
    layer = (kd.Conv2DDVI if rank == 2 else kd.Conv1DDVI)(5, 3, activation=activation, **kwargs)
    model = keras.Sequential([keras.Input(x.shape[1:]), layer])
    _set_variances(model, 0.5)
    _assert_exact(model, x, 20_000)


@pytest.mark.parametrize("activation", [None, "relu"])
def test_first_conv_layer_shared_component_matches_monte_carlo(activation):
    """The shared component of a first-layer unit is its covariance with the factor of its
    channel, the normalised sum of the channel's pre-activations over positions:
    `Cov(u_p, sum a) / sd(sum a)` (exact up to the window-mean approximation of the module
    docstring; through the ReLU by Stein's lemma, exact)."""
    x = _images(8, rows=3, channels=2)
    model = keras.Sequential([keras.Input(x.shape[1:]), kd.Conv2DDVI(4, 3, activation=activation)])
    linear = keras.Sequential([keras.Input(x.shape[1:]), kd.Conv2DDVI(4, 3)])
    _set_variances(model, 0.5)
    linear.set_weights(model.get_weights())
    outputs = to_numpy(model(x))
    var, shared = outputs[:, 1], outputs[:, 2]
    samples = kd.predict_samples(model, x, 20_000, seed=1).astype("float64")
    pre = kd.predict_samples(linear, x, 20_000, seed=1).astype("float64")  # the same kernels
    total = pre.sum(axis=(2, 3), keepdims=True)
    total = total - total.mean(1, keepdims=True)
    centred = samples - samples.mean(1, keepdims=True)
    mc_shared = np.mean(centred * total, axis=1) / np.sqrt(np.mean(total ** 2, axis=1))
    error = np.abs(shared - mc_shared) / np.sqrt(np.maximum(var, 1e-12))
    assert np.median(error) < 0.03 and error.max() < 0.15


def _issue_cnn(size, form="post"):
    """The issue's CNN: conv 3x3 (8), ReLU, max pool 2, conv 3x3 (8), ReLU, global average
    pool, dense 3; `form="pre"` puts the first ReLU on the pooling layer (the same function)."""
    pre = form == "pre"
    return keras.Sequential([
        keras.Input((size, size, 1)),
        kd.Conv2DDVI(8, 3, activation=None if pre else "relu"),
        kd.MaxPooling2DDVI(2, activation="relu" if pre else None),
        kd.Conv2DDVI(8, 3, activation="relu"),
        kd.GlobalAveragePooling2DDVI(),
        kd.DenseDiagDVI(3),
    ])


@pytest.mark.parametrize("size, form", [(8, "post"), (16, "post"), (28, "post"), (28, "pre")])
@pytest.mark.parametrize("scale", [0.03, 0.3])
def test_small_cnn_end_to_end_matches_monte_carlo(size, form, scale):
    """The issue's bound, on inputs up to 28x28 (the digits, zoomed): means within 0.1
    predictive sd and variances within a factor of 2 (medians over outputs and inputs), with
    posterior variances `scale / fan_in` (0.03: the layers' initial value; 0.3: ten times
    that, the issue's sketch). A per-position diagonal measured 0.57 at 28x28 (module
    docstring of `keras_dvi.conv_moments`). The "post" form (ReLU on the conv layer, which
    warns) meets the mean bound on these seeds but not on every initialisation: 0.12-0.14 sd
    on two of eight (BENCHMARKS.md, "Convolutional networks"); the advised "pre" form stayed
    within 0.06 on all eight."""
    keras.utils.set_random_seed(size)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the post-activation form warns
        model = _issue_cnn(size, form)
    _set_variances(model, scale)
    mean_error, ratio = _compare(model, _images(size, rows=6), 4000)
    assert np.median(np.abs(mean_error)) < 0.1
    assert 0.5 < np.median(ratio) < 2.0
    assert 0.8 < np.median(ratio) < 1.25  # what the shared components achieve (BENCHMARKS.md)


def _benchmark_cnn():
    """The MNIST benchmark's architecture (conv 32 - max pool - conv 64 - max pool - dense 128 -
    dense 10), written as the layers' docstrings advise (ReLU on the pooling layers)."""
    return keras.Sequential([
        keras.Input((28, 28, 1)),
        kd.Conv2DDVI(32, 3),
        kd.MaxPooling2DDVI(2, activation="relu"),
        kd.Conv2DDVI(64, 3),
        kd.MaxPooling2DDVI(2, activation="relu"),
        kd.FlattenDVI(),
        kd.DenseDiagDVI(128, "relu"),
        kd.DenseDiagDVI(10),
    ])


@pytest.mark.parametrize("scale", [0.03, 0.3])
def test_benchmark_cnn_matches_monte_carlo(scale):
    """The benchmark's CNN on 28x28 digits, at the layers' initial variances and ten times
    them. (With the ReLU on the conv layers instead, the means were 0.14 sd off at 0.3:
    Clark's max of rectified units; building that form warns.)"""
    keras.utils.set_random_seed(3)
    model = _benchmark_cnn()
    _set_variances(model, scale)
    mean_error, ratio = _compare(model, _images(28, rows=4), 1500, seed=int(scale * 100))
    assert np.median(np.abs(mean_error)) < 0.1
    assert 0.5 < np.median(ratio) < 2.0


def test_max_pooling_after_an_activation_warns():
    with pytest.warns(UserWarning, match=r"activation='relu'.*MaxPooling2DDVI\(\.\.\., activation='relu'\)"):
        keras.Sequential([keras.Input((8, 8, 1)), kd.Conv2DDVI(2, 3, activation="relu"), kd.MaxPooling2DDVI(2)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        keras.Sequential([keras.Input((8, 8, 1)), kd.Conv2DDVI(2, 3), kd.MaxPooling2DDVI(2, activation="relu")])


def _residual_cnn():
    """A residual block (`AddDVI`), average pooling and a dense head on 12x12 inputs."""
    inputs = keras.Input((12, 12, 1))
    x = kd.Conv2DDVI(6, 3, padding="same", activation="relu")(inputs)
    branch = kd.Conv2DDVI(6, 3, padding="same", activation="relu")(x)
    branch = kd.Conv2DDVI(6, 3, padding="same")(branch)
    x = kd.AddDVI(activation="relu")([x, branch])
    x = kd.AveragePooling2DDVI(2)(x)
    return keras.Model(inputs, kd.DenseDiagDVI(2)(kd.FlattenDVI()(x)))


def _signal_cnn():
    """A 1D network: conv, max pool, conv, global average pool, dense."""
    return keras.Sequential([
        keras.Input((32, 2)),
        kd.Conv1DDVI(8, 5),
        kd.MaxPooling1DDVI(2, activation="relu"),
        kd.Conv1DDVI(8, 3, activation="relu", padding="same"),
        kd.GlobalAveragePooling1DDVI(),
        kd.DenseDVI(2),
    ])


def _signals():
    """Five smooth 2-channel signals of 32 steps."""
    x = np.sin(np.linspace(0, 6, 32))[None, :, None] * np.random.default_rng(0).uniform(0.5, 2, (5, 1, 2))
    return x.astype("float32")


def test_residual_block_and_average_pooling_end_to_end():
    """`AddDVI` (branches taken as independent) and average pooling: within the issue's bound
    against Monte Carlo."""
    model = _residual_cnn()
    _set_variances(model, 0.3)
    mean_error, ratio = _compare(model, _images(12, rows=4), 3000)
    assert np.median(np.abs(mean_error)) < 0.1 and 0.5 < np.median(ratio) < 2.0


@pytest.mark.xfail(strict=True, reason=(
    "Known gap: on smooth 1D signals the second conv layer's outputs are "
    "correlated between neighbouring positions through the input units' independent parts "
    "(overlapping windows), which neither the per-position diagonal nor the per-channel shared "
    "component carries: the global average pool's variance is 0.62 of Monte Carlo and the "
    "output means 0.13 sd off (0.03 / fan_in)."))
def test_1d_signal_network_end_to_end():
    signal = _signal_cnn()
    _set_variances(signal, 0.03)
    mean_error, ratio = _compare(signal, _signals(), 3000)
    assert np.median(np.abs(mean_error)) < 0.1 and 0.5 < np.median(ratio) < 2.0


# --------------------------------------------------------------------------- Keras conventions


def _cnn(prior, rank=2, size=10):
    shape = (size, size, 1) if rank == 2 else (size, 2)
    conv, pool = (kd.Conv2DDVI, kd.MaxPooling2DDVI) if rank == 2 else (kd.Conv1DDVI, kd.MaxPooling1DDVI)
    return keras.Sequential([
        keras.Input(shape),
        conv(4, 3, activation="relu", regularizer=prior, padding="same"),
        pool(2),
        conv(6, 3, activation="relu", regularizer=prior),
        kd.FlattenDVI(),
        kd.DenseDVI(3, regularizer=prior),
    ])


def _classification(rows=64, size=10, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.uniform(0, 1, (rows, size, size, 1)).astype("float32")
    labels = (x[:, : size // 2].mean((1, 2, 3)) > x[:, size // 2:].mean((1, 2, 3))).astype("int32")
    x[labels == 1, :2] += 0.5
    return x, labels


def test_every_layer_round_trips_its_config_and_output_shape():
    layers = [
        kd.Conv2DDVI(4, (3, 2), strides=(2, 1), padding="same", activation="relu", kernel_variance_init=1e-3),
        kd.Conv1DDVI(4, 3, dilation_rate=2, use_bias=False),
        kd.Conv2DMCVI(4, 3, num_samples=3, seed=2), kd.Conv1DMCVI(4, 3, num_samples=2),
        kd.MaxPooling2DDVI((2, 3), strides=1, padding="same"), kd.MaxPooling1DDVI(3),
        kd.AveragePooling2DDVI(2), kd.AveragePooling1DDVI(2, padding="same"),
        kd.GlobalAveragePooling2DDVI(), kd.GlobalAveragePooling1DDVI(), kd.FlattenDVI(), kd.AddDVI("relu"),
        kd.GlobalMaxPooling2DDVI(activation="relu"), kd.GlobalMaxPooling1DDVI(data_format="channels_first"),
    ]
    for layer in layers:
        config = layer.get_config()
        clone = type(layer).from_config(config)
        assert clone.get_config() == config, type(layer).__name__
        assert keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(layer)).get_config() == config
    x2 = np.zeros((2, 9, 9, 3), "float32")
    for layer, x in [(layers[0], x2), (kd.Conv2DDVI(5, 3, padding="valid", dilation_rate=2), x2),
                     (layers[1], np.zeros((2, 11, 3), "float32"))]:
        out = layer(x)
        assert tuple(out.shape) == tuple(layer.compute_output_shape(x.shape))
        packed = out
        for follower in ([kd.MaxPooling2DDVI(2, padding="same"), kd.AveragePooling2DDVI(3, 1), kd.FlattenDVI()]
                         if len(x.shape) == 4 else [kd.MaxPooling1DDVI(2), kd.GlobalAveragePooling1DDVI()]) + [
                            kd.GlobalMaxPooling2DDVI() if len(x.shape) == 4 else kd.GlobalMaxPooling1DDVI()]:
            result = follower(packed)
            assert tuple(result.shape) == tuple(follower.compute_output_shape(packed.shape)), type(follower).__name__
    sampled = layers[2](x2)
    assert tuple(sampled.shape) == tuple(layers[2].compute_output_shape(x2.shape)) == (2, 3, 7, 7, 4)


def test_trains_saves_and_loads_in_safe_mode(tmp_path):
    """fit with the nll / kl logs and the KL warm-up; `.keras` round trip (safe mode) that
    predicts the same numbers; `keras_dvi.predict` on a conv classifier."""
    x, labels = _classification()
    prior = kd.EmpiricalBayesRegularizer(len(x))
    model = _cnn(prior)
    model.compile(keras.optimizers.Adam(1e-2), loss=kd.SoftmaxDeltaELL())
    history = model.fit(x, labels, epochs=6, batch_size=16, verbose=0).history
    assert {"loss", "nll", "kl"} <= set(history) and np.isfinite(history["loss"]).all()
    assert history["nll"][-1] < history["nll"][0]
    conv = model.layers[0]
    assert int(to_numpy(conv.kl_step)) == 24 and int(to_numpy(conv.kl_warmup_length)) == 18  # auto: 3/4 of 24
    assert conv.kl_term.warmup_done() and float(to_numpy(conv.kl_term.weight(training=True))) == pytest.approx(1.0)
    loaded = reloaded(model, tmp_path, "cnn")
    np.testing.assert_allclose(to_numpy(loaded(x[:8])), to_numpy(model(x[:8])), rtol=1e-6, atol=1e-6)
    probabilities = kd.predict(loaded, x[:8])["probabilities"]
    assert probabilities.shape == (8, 3) and np.allclose(probabilities.sum(-1), 1, atol=1e-5)
    mean, variance = kd.unpack(model.layers[1](model.layers[0](x[:8])))  # (the shapes above: on JAX, compiled once)
    assert tuple(mean.shape) == tuple(variance.shape) == (8, 5, 5, 4)


def test_float64_and_mixed_precision():
    x, labels = _classification(rows=16)
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")
    model = _cnn(kd.EmpiricalBayesRegularizer(16))
    out = model(x.astype("float64"))
    assert keras.backend.standardize_dtype(out.dtype) == "float64"
    keras.config.set_floatx("float32")
    keras.config.set_dtype_policy("mixed_float16")
    model = _cnn(kd.EmpiricalBayesRegularizer(16))
    assert keras.backend.standardize_dtype(model(x).dtype) == "float32"  # moments in float32
    model.compile(keras.optimizers.Adam(1e-2), loss=kd.SoftmaxDeltaELL())
    history = model.fit(x, labels, epochs=2, batch_size=8, verbose=0).history
    assert np.isfinite(history["loss"]).all()


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_mixed_precision_convolves_in_half_precision_within_monte_carlo(policy):
    """Under a mixed precision policy the conv layers run the convolution of the means in the
    compute dtype (bfloat16: every convolution) and the moment maths in float32: a first layer
    still matches Monte Carlo over its kernels within the standard errors, and a network of
    two convolutions differs from its float32 twin (the same weights) by a small fraction of a
    predictive sd, inside the 0.1 sd the Monte Carlo tests allow (measured: 6e-4 sd in
    float16, 3e-3 in bfloat16). The difference is not zero: the half-precision path runs."""
    half = policy.split("_")[1]
    keras.config.set_dtype_policy(policy)
    x = _images(8, rows=3, channels=2)
    first = keras.Sequential([keras.Input(x.shape[1:]), kd.Conv2DDVI(5, 3, activation="relu")])
    assert first.layers[0].half_dtype == half and first.layers[0].moment_dtype == "float32"
    _set_variances(first, 0.5)
    _assert_exact(first, x, 20_000)
    keras.utils.set_random_seed(12)
    network = _issue_cnn(12, "pre")
    _set_variances(network, 0.3)
    keras.config.set_dtype_policy("float32")
    twin = _issue_cnn(12, "pre")
    twin.set_weights(network.get_weights())
    x = _images(12, rows=6)
    (mean, cov), (mean_32, cov_32) = ([to_numpy(t) for t in kd.unpack(m(x))] for m in (network, twin))
    error = np.abs(mean - mean_32) / np.sqrt(np.diagonal(cov_32, axis1=-2, axis2=-1))
    bound = {"float16": 0.005, "bfloat16": 0.02}[half]
    assert 0 < error.max() < bound, error.max()
    assert np.abs(cov - cov_32).max() < bound * np.abs(cov_32).max()


class SubclassedModel(keras.Model):
    """A subclassed model of a list of layers, whose `call(self, inputs)` passes no `training` on."""

    def __init__(self, layers):
        super().__init__()
        self.body = layers

    def call(self, inputs):
        for layer in self.body:
            inputs = layer(inputs)
        return inputs


def test_functional_and_subclassed_models_train_like_sequential():
    """A subclassed CNN whose `call(self, inputs)` passes no `training` on: the same logs and
    weights as the `Sequential` of the same layers from the same start."""
    x, labels = _classification(rows=32)
    prior = kd.EmpiricalBayesRegularizer(32)

    sequential = _cnn(prior)
    weights = sequential.get_weights()
    clone = _cnn(prior)
    subclassed = SubclassedModel(clone.layers)
    subclassed(x[:1])
    subclassed.set_weights(weights)
    inputs = keras.Input((10, 10, 1))
    functional = keras.Model(inputs, _cnn(prior)(inputs))
    functional.set_weights(weights)
    logs = []
    for model in (sequential, subclassed, functional):
        model.compile(keras.optimizers.SGD(1e-2), loss=kd.SoftmaxDeltaELL())
        history = model.fit(x, labels, epochs=2, batch_size=16, shuffle=False, verbose=0).history
        logs.append((history["nll"][-1], history["kl"][-1], model.get_weights()))
    for nll, kl, trained in logs[1:]:
        assert nll == pytest.approx(logs[0][0], rel=1e-4) and kl == pytest.approx(logs[0][1], rel=1e-4)
        for a, b in zip(trained, logs[0][2]):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_layers_built_from_keras_layers_find_their_place_in_a_subclassed_model():
    """`from_conv`, `from_depthwise_conv` and `from_dense` build a layer before it is placed;
    in a subclassed model its place (whether it reads the data, and so holds the network's
    ELBO tracker) is decided at its first call. The logs and the metric list equal those of the
    functional model of the same layers (before: every such layer held a tracker, the last one
    logged only its own KL, under a false "no keras-dvi loss" warning)."""
    x, labels = _classification(rows=32)
    prior = kd.EmpiricalBayesRegularizer(32)
    plain = keras.Sequential([keras.Input((10, 10, 1)), keras.layers.Conv2D(4, 3, activation="relu"),
                              keras.layers.DepthwiseConv2D(3, activation="relu"), keras.layers.Flatten(),
                              keras.layers.Dense(3)])

    def converted():
        conv, depthwise, _, dense = plain.layers
        return [kd.Conv2DDVI.from_conv(conv, regularizer=prior),
                kd.DepthwiseConv2DDVI.from_depthwise_conv(depthwise, regularizer=prior),
                kd.FlattenDVI(), kd.DenseDVI.from_dense(dense, regularizer=prior)]

    inputs = outputs = keras.Input((10, 10, 1))
    for layer in converted():
        outputs = layer(outputs)
    logs = []
    for model in (keras.Model(inputs, outputs), SubclassedModel(converted())):
        model.compile(keras.optimizers.SGD(1e-2), loss=kd.SoftmaxDeltaELL())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            history = model.fit(x, labels, epochs=2, batch_size=16, shuffle=False, verbose=0).history
        assert not [w for w in caught if "no keras-dvi loss" in str(w.message)]
        assert [metric.name for metric in model.metrics] == ["loss", "elbo"]
        assert [layer.elbo_tracker is not None for layer in model.layers if hasattr(layer, "elbo_tracker")] == [
            True, False, False, False]
        logs.append((history["nll"][-1], history["kl"][-1]))
    assert logs[1] == pytest.approx(logs[0], rel=1e-4)
    kl_total = sum(float(layer.kl_divergence()) for layer in model.layers if hasattr(layer, "kl_divergence"))
    assert logs[1][1] == pytest.approx(kl_total / 32, rel=1e-3)  # (measured 1.5e-4: the weights move a little)


@pytest.mark.tensorflow_only
def test_xla_compiled_training_matches_eager_graph():
    x, labels = _classification(rows=32)
    prior = kd.EmpiricalBayesRegularizer(32)
    results = []
    for jit in (False, True):
        keras.utils.set_random_seed(5)
        model = _cnn(prior, rank=1, size=12)
        model.compile(keras.optimizers.Adam(1e-2), loss=kd.SoftmaxDeltaELL(), jit_compile=jit)
        signal = x[:, :, :2, 0].reshape(32, 10, 2)
        signal = np.concatenate([signal, signal[:, :2]], axis=1)
        results.append(model.fit(signal, labels, epochs=2, batch_size=16, shuffle=False, verbose=0).history["loss"])
    np.testing.assert_allclose(results[0], results[1], rtol=1e-4)


@pytest.mark.parametrize("plain", ["batch_norm", "dropout", "conv", "max_pool", "flatten"])
def test_plain_layers_between_conv_layers_are_refused(plain):
    """A plain Keras layer between keras-dvi conv layers reads the packed map as numbers:
    Conv2D and MaxPooling2D refuse the 5-D map when the model is built; BatchNormalization and
    Dropout keep its shape (building warns) and Flatten makes "data" of it: calling or training
    the model is refused with an error naming the plain layer."""
    prior = kd.EmpiricalBayesRegularizer(32)
    layer = {"batch_norm": keras.layers.BatchNormalization(), "dropout": keras.layers.Dropout(0.2),
             "conv": keras.layers.Conv2D(4, 3), "max_pool": keras.layers.MaxPooling2D(2),
             "flatten": keras.layers.Flatten()}[plain]
    follower = kd.DenseDVI(3, regularizer=prior) if plain == "flatten" else kd.Conv2DDVI(4, 3, regularizer=prior)
    stack = [keras.Input((10, 10, 1)), kd.Conv2DDVI(4, 3, activation="relu", regularizer=prior), layer, follower]
    if plain in ("conv", "max_pool"):
        with pytest.raises(ValueError, match="ndim|same length as input"):
            keras.Sequential(stack)
        return
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        model = keras.Sequential(stack + ([] if plain == "flatten" else [kd.FlattenDVI(), kd.DenseDVI(3)]))
    found = [str(w.message) for w in record if "that no keras-dvi layer produced" in str(w.message)]
    assert (not found) if plain == "flatten" else (found and type(layer).__name__ in found[0])
    x, labels = _classification(rows=32)
    model.compile(keras.optimizers.Adam(1e-3), loss=kd.SoftmaxDeltaELL())
    with pytest.raises(ValueError, match=f"Layer {type(layer).__name__} '{layer.name}' .* reads the output of "
                                         f"Conv2DDVI"):
        model.fit(x, labels, epochs=1, batch_size=16, verbose=0)


def test_gradients_are_finite_at_the_edges():
    """Units no input switches on (variance underflowing to 0 after the ReLU), zero inputs and
    deterministic "same" padding: finite values and gradients through every layer."""
    from tests.conftest import model_gradients

    x = np.concatenate([np.zeros((1, 8, 8, 1)), np.full((1, 8, 8, 1), 50.0)]).astype("float32")
    model = keras.Sequential([
        keras.Input((8, 8, 1)),
        kd.Conv2DDVI(4, 3, padding="same", bias_mean_initializer=keras.initializers.Constant(-30.0)),
        kd.MaxPooling2DDVI(2, activation="relu", padding="same"),
        kd.Conv2DDVI(4, 3, activation="relu"),
        kd.AveragePooling2DDVI(2),
        kd.GlobalAveragePooling2DDVI(),
        kd.DenseDVI(2, regularizer=kd.EmpiricalBayesRegularizer(2)),
    ])
    outputs, grads = model_gradients(model, x, lambda out: ops.sum(out), training=True)
    assert np.isfinite(outputs).all() and all(np.isfinite(g).all() for g in grads)


def test_from_conv_starts_from_a_trained_keras_layer():
    conv = keras.layers.Conv2D(4, 3, strides=2, padding="same", activation="relu")
    x = _images(8, rows=3)
    expected = to_numpy(conv(x))
    layer = kd.Conv2DDVI.from_conv(conv, kernel_variance=1e-12, bias_variance=1e-12)
    assert (layer.strides, layer.padding, layer.activation) == ((2, 2), "same", "relu")
    np.testing.assert_allclose(to_numpy(kd.unpack(layer(x))[0]), expected, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="conv"):
        kd.Conv1DDVI.from_conv(conv)


def test_mcvi_conv_samples_match_the_closed_form():
    """`Conv2DMCVI` draws one kernel per sample shared by every position: its samples' moments
    are the closed form of the `Conv2DDVI` with the same posterior."""
    x = _images(8, rows=2, channels=2)
    dvi = kd.Conv2DDVI(3, 3, activation="relu")
    mcvi = kd.Conv2DMCVI(3, 3, activation="relu", num_samples=20_000, seed=3)
    dvi.build(x.shape)
    mcvi.build(x.shape)
    _set_variances(keras.Sequential([keras.Input(x.shape[1:]), dvi]), 0.5)
    mcvi.set_posterior(*(to_numpy(t) for t in dvi._posterior()))  # noqa: SLF001
    samples = to_numpy(mcvi(x)).astype("float64")  # (batch, samples, ...)
    mean, variance = (to_numpy(t) for t in kd.unpack(dvi(x)))
    _assert_moments_match_samples(mean, variance, samples)
    sd = samples.std(1)
    centred = samples - samples.mean(1, keepdims=True)
    # ... and the positions of one sample share their kernel (correlated across positions).
    centred = samples - samples.mean(1, keepdims=True)
    assert np.mean(centred[:, :, 0, 0, 0] * centred[:, :, 1, 1, 0]) > 0.1 * np.mean(sd[:, 0, 0, 0] ** 2)


def test_mcvi_cnn_trains():
    x, labels = _classification(rows=32)
    prior = kd.EmpiricalBayesRegularizer(32)
    model = keras.Sequential([
        keras.Input((10, 10, 1)),
        kd.Conv2DMCVI(4, 3, activation="relu", num_samples=3, regularizer=prior, seed=1),
        keras.layers.TimeDistributed(keras.layers.MaxPooling2D()),
        keras.layers.TimeDistributed(keras.layers.Flatten()),
        kd.DenseMCVI(2, regularizer=prior, seed=2),
    ])
    model.compile(keras.optimizers.Adam(1e-2), loss=kd.SampledSoftmaxELL())
    history = model.fit(x, labels, epochs=4, batch_size=16, verbose=0).history
    assert np.isfinite(history["loss"]).all() and "kl" in history
    assert kd.predict_samples(model, x[:3], 5).shape == (3, 5, 2)


def test_bad_arguments_are_refused():
    for kwargs, name in [({"filters": 0, "kernel_size": 3}, "filters"), ({"filters": 2, "kernel_size": 0}, "kernel_size"),
                         ({"filters": 2, "kernel_size": 3, "padding": "causal"}, "padding"),
                         ({"filters": 2, "kernel_size": 3, "strides": 2, "dilation_rate": 2}, "dilation_rate"),
                         ({"filters": 2, "kernel_size": (3, 3, 3)}, "kernel_size")]:
        with pytest.raises(ValueError, match=name):
            kd.Conv2DDVI(**kwargs)
    with pytest.raises(ValueError, match="pool_size"):
        kd.MaxPooling2DDVI(0)
    with pytest.raises(ValueError, match="smaller than"):
        keras.Sequential([keras.Input((2, 2, 1)), kd.Conv2DDVI(2, 3)])
    with pytest.raises(ValueError, match="FlattenDVI"):
        keras.Sequential([keras.Input((8, 8, 1)), kd.Conv2DDVI(2, 3), kd.DenseDVI(2)])
    with pytest.raises(ValueError, match="inputs"):
        kd.Conv2DDVI(2, 3)(np.full((1, 4, 4, 1), np.nan, "float32"))
    with pytest.raises(ValueError, match="same shape"):
        a = keras.Input((6, 6, 1))
        kd.AddDVI()([kd.Conv2DDVI(2, 3)(a), kd.Conv2DDVI(3, 3)(a)])


# --------------------------------------------------------------------------- channels first


@pytest.fixture
def image_data_format():
    """Restores Keras' global image data format after the test."""
    previous = keras.config.image_data_format()
    yield
    keras.config.set_image_data_format(previous)


def _to_first(x):
    """A channels-last array (data, or a packed map / samples with one more leading axis) as
    channels first."""
    x = np.asarray(x)
    lead = 1 if x.ndim in (3, 4) and x.shape[1] not in (2, 3) else 2  # data (batch, ...) or (batch, rows, ...)
    return np.moveaxis(x, -1, lead)


def _network(kind, data_format):
    """The same network in either data format (weights shaped alike, so they transfer)."""
    f = {"data_format": data_format}
    first = data_format == "channels_first"
    if kind == "cnn":
        shape = (1, 12, 12) if first else (12, 12, 1)
        return keras.Sequential([
            keras.Input(shape), kd.Conv2DDVI(4, 3, **f), kd.MaxPooling2DDVI(2, activation="relu", **f),
            kd.Conv2DDVI(5, 3, activation="relu", padding="same", **f), kd.AveragePooling2DDVI(2, **f),
            kd.FlattenDVI(**f), kd.DenseDVI(3)])
    if kind == "residual":
        inputs = keras.Input((1, 12, 12) if first else (12, 12, 1))
        x = kd.Conv2DDVI(4, 3, padding="same", activation="relu", **f)(inputs)
        branch = kd.Conv2DDVI(4, 3, padding="same", **f)(x)
        x = kd.AddDVI(activation="relu", **f)([x, branch])
        return keras.Model(inputs, kd.DenseDiagDVI(2)(kd.GlobalAveragePooling2DDVI(**f)(x)))
    if kind == "signal":
        return keras.Sequential([
            keras.Input((2, 16) if first else (16, 2)), kd.Conv1DDVI(4, 3, strides=2, **f),
            kd.MaxPooling1DDVI(2, activation="relu", padding="same", **f), kd.AveragePooling1DDVI(2, **f),
            kd.Conv1DDVI(3, 2, dilation_rate=1, **f), kd.GlobalAveragePooling1DDVI(**f), kd.DenseDVI(2)])
    return keras.Sequential([  # "mcvi"
        keras.Input((1, 12, 12) if first else (12, 12, 1)),
        kd.Conv2DMCVI(4, 3, activation="relu", num_samples=5, seed=1, **f),
        kd.Conv2DMCVI(3, 3, strides=2, num_samples=5, **f)])


def _inputs(kind):
    return _signals()[:, ::2] if kind == "signal" else _images(12, rows=4)


def _moved(shape):
    """A channels-last map shape `(batch, rows or samples, *spatial, channels)` as channels first."""
    shape = tuple(shape)
    return shape[:2] + shape[-1:] + shape[2:-1]


@pytest.mark.parametrize("kind", ["cnn", "residual", "signal", "mcvi"])
def test_channels_first_networks_compute_what_channels_last_ones_do(kind):
    """Every conv, pooling, flatten and add layer with `data_format="channels_first"` computes the
    channels-last network's numbers on the transposed data, with the same weights: the output
    shapes Keras infers, every feature map on the way (transposed), the outputs, and the Monte
    Carlo samples of `predict_samples` (the same draws for the same seed)."""
    last, first = _network(kind, "channels_last"), _network(kind, "channels_first")
    _set_variances(last, 0.3)
    first.set_weights(last.get_weights())
    x = _inputs(kind)
    x_first = np.moveaxis(x, -1, 1)
    for a, b in zip(last.layers, first.layers):
        if isinstance(a, keras.layers.InputLayer):
            continue
        maps = len(a.output.shape) >= 4
        assert tuple(b.output.shape) == (_moved(a.output.shape) if maps else tuple(a.output.shape)), a.name
        if maps and kind != "mcvi":  # every feature map on the way, transposed
            cut_a, cut_b = keras.Model(last.inputs[0], a.output), keras.Model(first.inputs[0], b.output)
            np.testing.assert_allclose(to_numpy(cut_b(x_first)), np.moveaxis(to_numpy(cut_a(x)), -1, 2),
                                       rtol=1e-4, atol=1e-6)
    if kind == "mcvi":  # samples (batch, samples, *spatial, channels): the same draws
        kd.set_sampling_seed(last, 3)
        kd.set_sampling_seed(first, 3)
        np.testing.assert_allclose(to_numpy(first(x_first)), np.moveaxis(to_numpy(last(x)), -1, 2),
                                   rtol=1e-4, atol=1e-5)
        return
    np.testing.assert_allclose(to_numpy(first(x_first)), to_numpy(last(x)), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(kd.predict_samples(first, x_first, 50, seed=5),
                               kd.predict_samples(last, x, 50, seed=5), rtol=1e-4, atol=1e-5)


def test_channels_first_cnn_matches_monte_carlo(image_data_format):
    """The channels-first path against its own Monte Carlo oracle, within the bound of the
    channels-last CNNs; built with `data_format=None` under
    `keras.config.set_image_data_format("channels_first")`, which every layer honours."""
    keras.config.set_image_data_format("channels_first")
    keras.utils.set_random_seed(16)
    model = keras.Sequential([
        keras.Input((1, 16, 16)), kd.Conv2DDVI(8, 3), kd.MaxPooling2DDVI(2, activation="relu"),
        kd.Conv2DDVI(8, 3, activation="relu"), kd.GlobalAveragePooling2DDVI(), kd.DenseDiagDVI(3)])
    assert all(getattr(layer, "data_format", "channels_first") == "channels_first" for layer in model.layers)
    _set_variances(model, 0.3)
    mean_error, ratio = _compare(model, np.moveaxis(_images(16, rows=6), -1, 1), 4000)
    assert np.median(np.abs(mean_error)) < 0.1
    assert 0.8 < np.median(ratio) < 1.25


def test_channels_first_round_trips_converts_and_is_checked(tmp_path, image_data_format):
    """`data_format` in every layer's config and in `.keras` files (the loaded model predicts
    the same numbers); `from_conv` of a channels-first `keras.layers.Conv2D` keeps its format,
    and `FlattenDVI` flattens in `keras.layers.Flatten`'s order, so a converted plain network
    gives the plain network's outputs when the variances are zero; a bad format is refused,
    and TAGI, whose steps are channels last, refuses channels-first layers."""
    for layer in [kd.Conv2DDVI(2, 3, data_format="channels_first"), kd.Conv1DMCVI(2, 3, data_format="channels_first"),
                  kd.MaxPooling2DDVI(data_format="channels_first"), kd.AveragePooling1DDVI(data_format="channels_first"),
                  kd.GlobalAveragePooling2DDVI(data_format="channels_first"),
                  kd.FlattenDVI(data_format="channels_first"), kd.AddDVI(data_format="channels_first")]:
        config = layer.get_config()
        assert config["data_format"] == "channels_first"
        assert type(layer).from_config(config).get_config() == config
    model = _network("cnn", "channels_first")
    model.compile(keras.optimizers.Adam(1e-3), loss=kd.SoftmaxDeltaELL())
    x = np.moveaxis(_images(12, rows=4), -1, 1)
    model.fit(x, np.arange(4) % 3, epochs=1, verbose=0)
    loaded = reloaded(model, tmp_path, "first")
    np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0), rtol=1e-6, atol=1e-7)
    # A plain channels-first network, converted layer by layer.
    keras.config.set_image_data_format("channels_first")
    plain = keras.Sequential([keras.Input((1, 8, 8)), keras.layers.Conv2D(3, 3, activation="relu"),
                              keras.layers.Flatten(), keras.layers.Dense(2)])
    bayes = keras.Sequential([keras.Input((1, 8, 8)),
                              kd.Conv2DDVI.from_conv(plain.layers[0], kernel_variance=1e-12, bias_variance=1e-12),
                              kd.FlattenDVI(),
                              kd.DenseDVI.from_dense(plain.layers[2], kernel_variance=1e-12, bias_variance=1e-12)])
    assert bayes.layers[0].data_format == "channels_first"
    x = np.moveaxis(_images(8, rows=3), -1, 1)
    np.testing.assert_allclose(to_numpy(kd.unpack(bayes(x))[0]), plain_outputs(plain, x), rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="data_format"):
        kd.Conv2DDVI(2, 3, data_format="NCHW")
    network = keras.Sequential([keras.Input((1, 8, 8)), kd.Conv2DDVI(2, 3, activation="relu"), kd.FlattenDVI(),
                                kd.DenseDiagDVI(1)])
    with pytest.raises(ValueError, match="channels_last"):
        kd.TAGIModel(network, observation_noise=0.3)


# ------------------------------------------------------------------ depthwise convolutions


def test_depthwise_moments_are_those_of_a_block_diagonal_convolution():
    """A depthwise convolution is a convolution whose kernel is zero, with zero variance,
    between different channels: `conv_moments(depthwise=True)` equals `conv_moments` with that
    block-diagonal kernel (itself tested against Monte Carlo above), shared components, strides
    and padding included."""
    rng = np.random.default_rng(0)
    shape, multiplier = (2, 7, 6, 3), 2
    mean, variance = rng.normal(size=shape), rng.uniform(0.1, 2.0, shape)
    shared = rng.uniform(-0.9, 0.9, shape) * np.sqrt(variance)
    kernel_mean, kernel_var = rng.normal(size=(3, 3, 3, multiplier)), rng.uniform(0.01, 0.2, (3, 3, 3, multiplier))
    bias_mean, bias_var = rng.normal(size=3 * multiplier), rng.uniform(0.01, 0.1, 3 * multiplier)
    dense_mean, dense_var = (np.zeros((3, 3, 3, 3 * multiplier)) for _ in range(2))
    for c in range(3):
        dense_mean[..., c, c * multiplier:(c + 1) * multiplier] = kernel_mean[..., c, :]
        dense_var[..., c, c * multiplier:(c + 1) * multiplier] = kernel_var[..., c, :]
    for window in ({"strides": 1, "padding": "same"}, {"strides": 2, "padding": "valid"}):
        got = conv_moments_of(mean, kernel_mean, kernel_var, bias_mean, bias_var, variance, shared, depthwise=True, **window)
        want = conv_moments_of(mean, dense_mean, dense_var, bias_mean, bias_var, variance, shared, **window)
        for a, b in zip(got, want):
            np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


def conv_moments_of(*arrays, **kwargs):
    tensors = [keras.ops.convert_to_tensor(a, "float64") for a in arrays]
    return [to_numpy(t) for t in kd.conv_moments.conv_moments(*tensors, **kwargs)]


def _depthwise_network(data_format="channels_last"):
    shape = (12, 12, 1) if data_format == "channels_last" else (1, 12, 12)
    f = {"data_format": data_format}
    inputs = keras.Input(shape)
    h = kd.Conv2DDVI(4, 3, **f)(inputs)
    h = kd.DepthwiseConv2DDVI(3, padding="same", depth_multiplier=2, activation="relu6", **f)(h)
    h = kd.Conv2DDVI(4, 1, activation="relu", **f)(h)
    h = kd.DepthwiseConv2DDVI(3, strides=2, **f)(h)
    return keras.Model(inputs, kd.DenseDiagDVI(3)(kd.GlobalAveragePooling2DDVI(**f)(h)))


@pytest.mark.parametrize("scale", [0.03, 0.3])
def test_depthwise_network_with_relu6_matches_monte_carlo(scale):
    """Depthwise convolutions (a multiplier of 2, strides 2) and ReLU6 in a MobileNet-style
    network, on inputs scaled so that ReLU6's upper kink matters: the conv networks' bounds
    (means within 0.1 sd, variances within 1.25x, medians; measured 0.01-0.07 sd and
    0.91-1.07)."""
    keras.utils.set_random_seed(4)
    model = _depthwise_network()
    _set_variances(model, scale)
    mean_error, ratio = _compare(model, 4.0 * _images(12, rows=6), 4000)
    assert np.median(np.abs(mean_error)) < 0.1
    assert 0.8 < np.median(ratio) < 1.25


def test_depthwise_layer_channels_first_config_and_refusals():
    keras.utils.set_random_seed(5)
    last, first = _depthwise_network(), _depthwise_network("channels_first")
    first.set_weights(last.get_weights())
    x = _images(12, rows=3)
    np.testing.assert_allclose(to_numpy(first(np.moveaxis(x, -1, 1))), to_numpy(last(x)), rtol=1e-5, atol=1e-6)
    layer = last.layers[2]
    assert layer.depth_multiplier == 2 and tuple(layer.kernel_mean.shape) == (3, 3, 4, 2)
    config = layer.get_config()
    assert "filters" not in config and type(layer).from_config(config).get_config() == config
    with pytest.raises(ValueError, match="depth_multiplier|filters"):
        kd.DepthwiseConv2DDVI(3, depth_multiplier=0)
    with pytest.raises(ValueError, match="depthwise"):
        kd.tagi.steps.step_of(layer)
