"""Group (and instance) normalisation: `conv_moments.group_norm_moments` against Monte Carlo
through Keras' own `GroupNormalization` and against the plain function's Jacobian (finite
differences), `GroupNormalizationDVI` in networks against Monte Carlo over the weights, and
`convert` of networks that normalise groups (the plain model's function at tiny variances)."""

import warnings

import keras
import numpy as np
import pytest
from keras import ops

import keras_dvi as kd
from benchmarks.experiments.new_layers_against_monte_carlo import group_normalised_cnn
from keras_dvi import conv_moments
from tests.conftest import gradients, plain_outputs, reloaded, to_numpy
from tests.test_conv import _compare, _set_variances

TINY = {"kernel_variance": 1e-12, "bias_variance": 1e-12}


def _map_moments(rng, noise, share, shape=(3, 6, 6, 16)):
    """Moments `(m, v, s)` of a map in keras-dvi's representation: means that differ between
    channels and examples, variances `noise` times U(0.5, 1.5), shared components a fraction
    `share` (times U(0.5, 1)) of the sd, one sign per channel."""
    m = rng.normal(size=shape) + rng.normal(size=(shape[0], 1, 1, shape[-1]))
    v = noise * rng.uniform(0.5, 1.5, size=shape)
    s = np.sqrt(v) * share * rng.uniform(0.5, 1.0, size=shape) * rng.choice([-1, 1], size=(1, 1, 1, shape[-1]))
    return m, v, s


@pytest.mark.parametrize("groups, noise, share", [
    (1, 0.03, 0.8), (4, 1.0, 0.8), (4, 0.03, 0.3), (16, 1.0, 0.8), (16, 0.03, 0.3),
])
def test_group_norm_moments_match_monte_carlo_through_keras_layer(groups, noise, share):
    """Inputs drawn from the map the moments describe (one shared factor per channel and
    example), through Keras' own `GroupNormalization` (16 channels in 1, 4 or 16 groups: layer
    normalisation over all axes, groups, instance normalisation), 20,000 draws: every unit's
    mean within 0.1 sd of Monte Carlo's, its variance within 0.85-1.06 of Monte Carlo's and its
    shared component (its covariance with its channel's factor) within 0.06 sd. Measured over
    these and seven more settings: 0.08 sd, 0.86-1.04, 0.04 sd (at the smaller noise the
    spread is Monte Carlo's own, a variance's standard error being 1% here)."""
    rng = np.random.default_rng(groups)
    m, v, s = _map_moments(rng, noise, share)
    out = [to_numpy(t).astype("float64") for t in conv_moments.group_norm_moments(
        *(ops.convert_to_tensor(t.astype("float32")) for t in (m, v, s)), groups, 1e-3)]
    layer = keras.layers.GroupNormalization(groups=groups, center=False, scale=False, epsilon=1e-3)
    n, chunk = 20_000, 2_000
    total = total_squares = total_z = total_yz = 0.0
    for _ in range(n // chunk):
        z = rng.normal(size=(chunk, m.shape[0], 1, 1, m.shape[-1]))
        x = m + s * z + np.sqrt(v - s ** 2) * rng.normal(size=(chunk,) + m.shape)
        y = to_numpy(layer(x.reshape((-1,) + m.shape[1:]).astype("float32"))).reshape(x.shape).astype("float64")
        total, total_squares = total + y.sum(0), total_squares + np.square(y).sum(0)
        total_z, total_yz = total_z + z.sum(0), total_yz + (y * z).sum(0)
    mc_mean = total / n
    mc_var = total_squares / n - np.square(mc_mean)
    mc_shared = total_yz / n - mc_mean * total_z / n
    sd = np.sqrt(mc_var)
    assert np.all(np.abs(out[0] - mc_mean) < 0.1 * sd)
    ratio = out[1] / mc_var
    assert 0.85 < ratio.min() and ratio.max() < 1.06, (ratio.min(), ratio.max())
    assert np.all(np.abs(out[2] - mc_shared) < 0.06 * sd)


def _group_norm(x, groups, epsilon=1e-3):
    """The plain function in float64 NumPy (channels last)."""
    grouped = x.reshape(x.shape[0], -1, groups, x.shape[-1] // groups)
    mean, var = grouped.mean(axis=(1, 3), keepdims=True), grouped.var(axis=(1, 3), keepdims=True)
    return ((grouped - mean) / np.sqrt(var + epsilon)).reshape(x.shape)


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_near_deterministic_inputs_give_the_linearised_plain_function(groups):
    """With variances 1e-8 of the means' scale the delta method is exact: the mean is the plain
    function; each unit's shared component is its derivative along its channel's factor, and its
    variance the diagonal of `J Cov J^T`, with `J` the plain function's Jacobian by central
    differences (float64) and `Cov` the input covariance of the representation (independent
    parts plus one factor per channel)."""
    rng = np.random.default_rng(groups)
    shape = (1, 3, 3, 4)
    m, _, _ = _map_moments(rng, 1.0, 0.0, shape)
    v = 1e-8 * rng.uniform(0.5, 1.5, size=shape)
    s = np.sqrt(v) * rng.uniform(-0.9, 0.9, size=shape)
    mean, variance, shared = (to_numpy(t) for t in conv_moments.group_norm_moments(
        *(ops.convert_to_tensor(t) for t in (m, v, s)), groups, 1e-3))
    units = m.size
    jacobian = np.empty((units, units))
    for j in range(units):
        step = np.zeros(units)
        step[j] = 1e-6
        jacobian[:, j] = (_group_norm(m + step.reshape(shape), groups)
                          - _group_norm(m - step.reshape(shape), groups)).ravel() / 2e-6
    loads = np.zeros((units, shape[-1]))  # each unit's load on each channel's factor
    loads[np.arange(units), np.arange(units) % shape[-1]] = s.ravel()
    covariance = np.diag((v - s ** 2).ravel()) + loads @ loads.T
    np.testing.assert_allclose(mean, _group_norm(m, groups), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(variance.ravel(), np.diag(jacobian @ covariance @ jacobian.T), rtol=1e-3)
    own = (jacobian @ loads)[np.arange(units), np.arange(units) % shape[-1]]
    np.testing.assert_allclose(shared.ravel(), own, rtol=1e-3, atol=1e-3 * np.sqrt(v.max()))


def test_group_normalize_is_keras_group_normalization():
    """The sampled form (`predict_samples`' path) is Keras' `GroupNormalization` before its
    scale and shift, on maps and on vectors, with leading sample axes."""
    rng = np.random.default_rng(0)
    for shape, groups in [((2, 3, 5, 8), 4), ((2, 3, 5, 8), 8), ((2, 4, 6), 3), ((3, 6), 2)]:
        x = rng.normal(size=(2,) + shape).astype("float32")
        layer = keras.layers.GroupNormalization(groups=groups, center=False, scale=False)
        expected = np.stack([to_numpy(layer(sample)) for sample in x])
        got = to_numpy(conv_moments.group_normalize(ops.convert_to_tensor(x), groups, 1e-3, len(shape) - 2))
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_a_normalised_network_converts_computes_the_plain_function_and_matches_monte_carlo(tmp_path):
    """Group normalisation of maps (its activation folded in) and of a vector converts to
    `GroupNormalizationDVI`; at tiny variances the converted model computes the plain
    probabilities; at the default variances and ten times them the logits agree with 2,000
    weight draws. Measured over five initialisations on each backend: means within 0.12 sd,
    variances 0.83-1.63 of Monte Carlo's (medians 0.91-1.26; the groups of 8 units of the
    vector normalise by a statistic of few units, and with 4 units per group the extremes
    reached 2.2). It trains, and a `.keras` file predicts the same numbers."""
    keras.utils.set_random_seed(0)
    plain = group_normalised_cnn()
    x = np.random.default_rng(0).uniform(size=(4, 12, 12, 3)).astype("float32")
    converted = kd.convert(plain, **TINY)
    normalisations = [layer for layer in converted.layers if isinstance(layer, kd.GroupNormalizationDVI)]
    assert [(layer.groups, layer.activation) for layer in normalisations] == [(4, "silu"), (16, "relu"), (2, "linear")]
    np.testing.assert_allclose(kd.predict(converted, x)["probabilities"], plain_outputs(plain, x), atol=1e-6)
    bayesian = kd.convert(plain, regularizer=kd.EmpiricalBayesRegularizer(num_train=len(x)))
    for scale in (0.03, 0.3):
        _set_variances(bayesian, scale)
        error, ratio = _compare(bayesian, x, 2000)
        assert np.abs(error).max() < 0.15 and 0.7 < ratio.min() and ratio.max() < 1.8, (error, ratio)
        assert 0.85 < np.median(ratio) < 1.35, ratio
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (4 images for 2 epochs: the collapse check may speak)
        history = bayesian.fit(x, np.arange(4) % 3, epochs=2, batch_size=2, verbose=0).history
    assert np.all(np.isfinite(history["loss"]))
    np.testing.assert_allclose(reloaded(bayesian, tmp_path, "groups").predict(x, verbose=0), bayesian.predict(x, verbose=0),
                               rtol=1e-6, atol=1e-7)


def test_channels_first_config_edges_and_misuse():
    """Channels first computes what channels last does; the config round trips; a unit whose
    group has equal means (a blank input) stays finite with finite gradients; groups that do
    not divide the channels, a bad `groups` and a full covariance are refused by name."""
    rng = np.random.default_rng(1)
    m, v, s = _map_moments(rng, 0.3, 0.5, (2, 4, 4, 6))
    packed = np.stack([m, v, s], axis=1).astype("float32")
    last = kd.GroupNormalizationDVI(3, activation="relu")
    first = kd.GroupNormalizationDVI(3, activation="relu", data_format="channels_first")
    out_last = to_numpy(last(packed))
    first(np.moveaxis(packed, -1, 2))
    first.set_weights([rng.uniform(0.5, 1.5, 6), rng.normal(0, 0.3, 6)])
    last.set_weights(first.get_weights())
    np.testing.assert_allclose(np.moveaxis(to_numpy(first(np.moveaxis(packed, -1, 2))), 2, -1),
                               to_numpy(last(packed)), rtol=1e-5, atol=1e-6)
    assert out_last.shape == packed.shape
    config = last.get_config()
    assert config["groups"] == 3 and kd.GroupNormalizationDVI.from_config(config).get_config() == config
    blank = np.stack([np.zeros_like(m), np.full_like(v, 1e-6), np.zeros_like(s)], 1).astype("float32")
    normalise = kd.GroupNormalizationDVI(3)
    assert np.all(np.isfinite(to_numpy(normalise(blank))))  # (built here, not while JAX traces the gradient)
    _, [gradient] = gradients(lambda t: ops.sum(normalise(t)), [blank])
    assert np.all(np.isfinite(gradient))
    with pytest.raises(ValueError, match="channels, 6, must be a multiple of `groups`, 4"):
        kd.GroupNormalizationDVI(4)(packed)
    with pytest.raises(ValueError, match="`groups` must be a positive integer or -1"):
        kd.GroupNormalizationDVI(0)
    full = np.concatenate([np.ones((2, 1, 4)), np.tile(np.eye(4), (2, 1, 1))], axis=1).astype("float32")
    with pytest.raises(ValueError, match="full covariance"):
        kd.GroupNormalizationDVI(2)(full)

