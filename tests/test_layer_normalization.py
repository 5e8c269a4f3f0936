"""Layer normalisation of keras-dvi feature maps and vectors (`LayerNormalizationDVI`,
`keras_dvi.maths.moments.layer_norm_moments`), and what `convert` makes of it (ConvNeXt).

The oracle of the maths is Monte Carlo through Keras' own `LayerNormalization`: inputs are drawn
from keras-dvi's representation (a feature map's units `u = m + s z_k + e` with one factor per
channel; a vector with a full covariance), normalised by the Keras layer, and the draws' means,
variances and covariances compared with the moments. The rule is the delta method about the
means with the normaliser at its expectation, so it is exact only where the variances vanish;
the bounds below are the measured errors (N = 20,000 draws, a variance ratio's standard error
0.01) with room for the seeds, for inputs from nearly deterministic to pure noise.
"""

import warnings

import keras
import numpy as np
import pytest

import keras_dvi as kd
from keras_dvi.layers import vectors
from keras_dvi.maths import conv_moments, moments
from tests.conftest import gradients, reloaded, to_numpy
from tests.test_conv import _compare, _images, _set_variances

N = 20_000


def _keras_norm(channels, seed, epsilon=1e-3, rms=False):
    """A built `keras.layers.LayerNormalization` with random `gamma` (some negative) and `beta`
    (`rms`: a `keras.layers.RMSNormalization` with a random `scale`, and `beta` 0)."""
    rng = np.random.default_rng(seed)
    norm = keras.layers.RMSNormalization(epsilon=epsilon) if rms else keras.layers.LayerNormalization(epsilon=epsilon)
    norm.build((None, channels))
    weights = [rng.uniform(-2.0, 2.0, channels), rng.normal(size=channels)]
    norm.set_weights(weights[:1] if rms else weights)
    return norm, [weights[0].astype("float64"), np.zeros(channels) if rms else weights[1].astype("float64")]


def _moments(mean, second, gamma, beta, shared=None, epsilon=1e-3, center=True):
    """The rule's moments of Keras' layer with `gamma` and `beta`: the normalisation
    (`layer_norm_moments`; `center=False`: RMS normalisation), then the per-unit affine map as
    the layer applies it (maps: `conv_moments.channel_affine_moments`; vectors:
    `vectors.unit_affine`)."""
    if shared is not None:
        normalised = moments.layer_norm_moments(mean, second, epsilon, shared=shared, center=center)
        return tuple(to_numpy(t) for t in conv_moments.channel_affine_moments(*normalised, gamma, beta))
    normalised_mean, normalised = moments.layer_norm_moments(mean, second, epsilon, center=center)
    return to_numpy(normalised_mean * gamma + beta), to_numpy(vectors.unit_affine(normalised, gamma))


def _normalised(norm, samples):
    """Keras' layer on draws `(N, ..., C)`, in float64."""
    flat = samples.reshape((-1, samples.shape[-1])).astype("float32")
    return to_numpy(norm(flat)).astype("float64").reshape(samples.shape)


def _map_draws(channels, noise, seed, positions=6):
    """Moments `(m, v, s)` of `positions` units per channel, variances `noise` times the means'
    square scale, and `N` draws of the representation with the factors `z`."""
    rng = np.random.default_rng(seed)
    mean = rng.normal(size=(positions, channels))
    variance = noise * rng.uniform(0.2, 2.0, (positions, channels))
    shared = rng.uniform(-0.9, 0.9, (positions, channels)) * np.sqrt(variance)
    z = rng.normal(size=(N, 1, channels))
    samples = mean + shared * z + rng.normal(size=(N, positions, channels)) * np.sqrt(variance - shared**2)
    return (mean, variance, shared), samples, z[:, 0]


#: `channels: (variance ratio band, worst mean error in sd, band of the shared components' median
#: ratio, their worst error in sd)`, over the four noise levels; measured 0.79-1.11, 0.14,
#: 0.99-1.01, 0.056 with 8 channels; 0.87-1.05, 0.046, 0.995-1.004, 0.037 with 32; 0.94-1.03,
#: 0.034, 0.999-1.002, 0.032 with 128. RMS normalisation (`RMSNormalization`, no centring):
#: 0.75-1.11, 0.12, 0.98-1.01, 0.066; 0.88-1.05, 0.047, 0.994-1.004, 0.041; 0.95-1.04, 0.031,
#: 0.999-1.001, 0.033. (The rule with the normaliser's linearisation left out,
#: `r (m - m_bar)` and `r^2 v~`, has variance ratios up to 3 with 8 channels; its shared
#: components `r s (1 - 1 / C)` a median ratio of 1.1.)
BOUNDS = {8: ((0.7, 1.2), 0.16, (0.95, 1.05), 0.08), 32: ((0.83, 1.08), 0.07, (0.97, 1.03), 0.05),
          128: ((0.9, 1.06), 0.05, (0.98, 1.02), 0.05)}


@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize("channels", sorted(BOUNDS))
@pytest.mark.parametrize("noise", [1e-3, 0.1, 1.0, 100.0])
def test_feature_map_moments_match_monte_carlo_through_keras_layer(channels, noise, kind):
    (mean, variance, shared), samples, z = _map_draws(channels, noise, seed=channels + int(noise * 10))
    rms = kind == "rms"
    epsilon = 1e-6 if rms else 1e-3
    norm, (gamma, beta) = _keras_norm(channels, seed=3, epsilon=epsilon, rms=rms)
    out = _normalised(norm, samples)
    got_mean, got_var, got_shared = _moments(mean, variance, gamma, beta, shared, epsilon=epsilon, center=not rms)
    mc_mean, mc_var = out.mean(0), out.var(0)
    mc_shared = np.einsum("npc,nc->pc", out - mc_mean, z) / N
    (low, high), worst_error, (shared_low, shared_high), worst_shared = BOUNDS[channels]
    ratio = got_var / mc_var
    assert low < ratio.min() and ratio.max() < high, (ratio.min(), ratio.max())
    assert np.max(np.abs(got_mean - mc_mean) / np.sqrt(mc_var)) < worst_error
    assert shared_low < np.median(got_shared / mc_shared) < shared_high
    assert np.max(np.abs(got_shared - mc_shared) / np.sqrt(mc_var)) < worst_shared
    # the components are bounded by the standard deviations, as the representation needs
    assert np.all(np.abs(got_shared) <= np.sqrt(got_var) * (1 + 1e-9))


def test_nearly_deterministic_inputs_give_the_plain_function_and_the_delta_method_variance():
    """With variances 1e-8 the means are Keras' layer on the means, and the variances the
    Jacobian's quadratic form (the delta method is exact in this limit): Monte Carlo through
    the layer's formula in float64 (Keras' float32 layer would round the draws' differences
    away) agrees within its standard error, unit by unit (measured 0.97-1.02)."""
    (mean, variance, shared), samples, z = _map_draws(16, 1e-8, seed=11)
    norm, (gamma, beta) = _keras_norm(16, seed=12)
    got_mean, got_var, _ = _moments(mean, variance, gamma, beta, shared)
    np.testing.assert_allclose(got_mean, _normalised(norm, mean[None])[0], rtol=1e-5, atol=1e-5)
    centred = samples - samples.mean(-1, keepdims=True)
    out = gamma * centred / np.sqrt((centred**2).mean(-1, keepdims=True) + 1e-3) + beta
    ratio = got_var / out.var(0)
    assert 0.95 < ratio.min() and ratio.max() < 1.05, (ratio.min(), ratio.max())


@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize("noise", [0.01, 1.0])
def test_full_covariance_matches_monte_carlo_and_the_diagonal_is_its_diagonal(noise, kind):
    rng = np.random.default_rng(int(noise * 100))
    center = kind == "layer"
    channels = 16
    mean = rng.normal(size=(3, channels))
    root = rng.normal(size=(3, channels, channels)) * np.sqrt(noise / channels)
    covariance = root @ np.swapaxes(root, 1, 2) + 0.1 * noise * np.eye(channels)
    draws = mean + np.einsum("bij,nbj->nbi", np.linalg.cholesky(covariance), rng.normal(size=(N, 3, channels)))
    norm, (gamma, beta) = _keras_norm(channels, seed=5, epsilon=1e-3, rms=not center)
    out = _normalised(norm, draws)
    got_mean, got_cov = _moments(mean, covariance, gamma, beta, center=center)
    centred = out - out.mean(0)
    mc_cov = np.einsum("nbi,nbj->bij", centred, centred) / N
    sd = np.sqrt(np.einsum("bii->bi", mc_cov))
    correlation_error = np.abs(got_cov - mc_cov) / (sd[:, :, None] * sd[:, None, :])
    ratio = np.einsum("bii->bi", got_cov) / sd**2
    assert correlation_error.max() < (0.05 if noise < 0.1 else 0.2), correlation_error.max()  # measured 0.02 / 0.13
    assert 0.8 < ratio.min() and ratio.max() < 1.1, (ratio.min(), ratio.max())  # measured 0.87-1.06
    assert np.max(np.abs(got_mean - out.mean(0)) / sd) < 0.1
    # the diagonal rule is the diagonal of the full one for independent units
    variances = np.einsum("bii->bi", covariance)
    diag_mean, diag_var = _moments(mean, variances, gamma, beta, center=center)
    full_mean, full_cov = _moments(mean, variances[:, :, None] * np.eye(channels), gamma, beta, center=center)
    # (at 1e-6: Keras' `ops.mean` on JAX rounds float64 means at about 1e-8 of their scale)
    np.testing.assert_allclose(diag_var, np.einsum("bii->bi", full_cov), rtol=1e-6, atol=1e-12)
    np.testing.assert_allclose(diag_mean, full_mean, rtol=1e-6, atol=1e-12)


def test_edges_are_finite_with_finite_gradients():
    """One channel (the normalised unit is `beta`, variance zero), all-equal means, zero, tiny and
    huge variances: finite values and gradients in float32, variances non-negative."""
    rng = np.random.default_rng(0)
    cases = [(np.ones((2, 1)), np.ones((2, 1))), (np.zeros((2, 8)), np.zeros((2, 8))),
             (np.full((2, 8), 3.0), np.full((2, 8), 1e-30)), (rng.normal(size=(2, 8)) * 1e4, np.full((2, 8), 1e8)),
             (rng.normal(size=(2, 8)), np.full((2, 8), 1e-12))]
    for mean, variance in cases:
        shared = 0.5 * np.sqrt(variance)

        def total(m, v, s):
            out = moments.layer_norm_moments(m, v, 1e-3, shared=s)
            return sum(keras.ops.sum(t) for t in out)

        value, grads = gradients(total, [a.astype("float32") for a in (mean, variance, shared)])
        assert np.isfinite(value) and all(np.isfinite(g).all() for g in grads)
        out_mean, out_var, out_shared = (to_numpy(t) for t in moments.layer_norm_moments(
            mean.astype("float32"), variance.astype("float32"), 1e-3, shared=shared.astype("float32")))
        assert np.isfinite(out_mean).all() and np.all(out_var >= 0) and np.isfinite(out_shared).all()
    one, var_one = moments.layer_norm_moments(np.ones((2, 1), "float32"), np.ones((2, 1), "float32"), 1e-3)
    np.testing.assert_array_equal(to_numpy(one), 0.0)
    np.testing.assert_allclose(to_numpy(var_one), 0.0, atol=1e-12)


def _convnext_like(data_format="channels_last", size=12, channels=32):
    """A small ConvNeXt: a patchifying stem and its layer normalisation, two blocks (a 7x7
    depthwise convolution, layer normalisation, a pointwise expansion with GELU and a
    projection, a residual sum), global pooling, a layer normalisation of the vector, a head."""
    f = {"data_format": data_format, "regularizer": kd.EmpiricalBayesRegularizer(num_train=100)}
    inputs = keras.Input((size, size, 1) if data_format == "channels_last" else (1, size, size))
    h = kd.Conv2DDVI(channels, 2, strides=2, **f)(inputs)
    h = kd.LayerNormalizationDVI(epsilon=1e-6, data_format=data_format)(h)
    for _ in range(2):
        branch = kd.DepthwiseConv2DDVI(7, padding="same", **f)(h)
        branch = kd.LayerNormalizationDVI(epsilon=1e-6, data_format=data_format)(branch)
        branch = kd.Conv2DDVI(2 * channels, 1, activation="gelu", **f)(branch)
        branch = kd.Conv2DDVI(channels, 1, **f)(branch)
        h = kd.AddDVI(data_format=data_format)([h, branch])
    h = kd.GlobalAveragePooling2DDVI(data_format=data_format)(h)
    h = kd.LayerNormalizationDVI(activation="relu")(h)
    return keras.Model(inputs, kd.DenseDVI(3, regularizer=f["regularizer"])(h))


def _as_trained(model, seed=0):
    """Layer normalisations' scales and shifts, and every bias mean, away from their initial
    values (1, 0, 0), as after training. (With every bias at 0, a position of a digit's blank
    background has equal means in all channels: its layer normalisation normalises the weight
    noise itself, amplified up to `1 / sqrt(epsilon)`, as Monte Carlo confirms unit by unit, and
    the convolutions after it approximate those units' shared components poorly: the small
    ConvNeXt below then gave output variances 0.51-0.77 of Monte Carlo's, 3 seeds.)"""
    rng = np.random.default_rng(seed)
    for layer in model.layers:
        if isinstance(layer, (kd.LayerNormalizationDVI, keras.layers.LayerNormalization)):
            n = int(layer.gamma.shape[0])
            layer.set_weights([rng.uniform(0.5, 2.0, n), rng.normal(size=n) * 0.5])
        if isinstance(layer, kd.layers.BayesianLayer):
            kernel_mean, _, bias_mean, _ = layer._posterior()  # noqa: SLF001 - shapes only
            layer.set_posterior(to_numpy(kernel_mean), None, rng.normal(size=bias_mean.shape) * 0.2)


@pytest.mark.parametrize("scale", [0.03, 0.3])
def test_network_with_layer_normalisation_matches_monte_carlo_over_the_weights(scale):
    """A small ConvNeXt against Monte Carlo over its weights (`predict_samples`: the sampled form
    normalises each draw as Keras does): median mean error within 0.1 predictive sd, median
    variance ratio 0.75-1.25 (the other conv networks' bounds, `tests/test_conv.py`, are
    0.8-1.25; measured here 0.81-1.03 over seeds 0-3 at both scales, means within 0.014 sd)."""
    keras.utils.set_random_seed(3)
    model = _convnext_like()
    _set_variances(model, scale)
    _as_trained(model)
    mean_error, ratio = _compare(model, _images(12, rows=6), 4000)
    assert np.median(np.abs(mean_error)) < 0.1
    assert 0.75 < np.median(ratio) < 1.25, np.median(ratio)


def test_channels_first_computes_the_same_trains_and_saves(tmp_path):
    keras.utils.set_random_seed(8)
    last, first = _convnext_like("channels_last"), _convnext_like("channels_first")
    _as_trained(last)
    first.set_weights(last.get_weights())
    x = _images(12, rows=4)
    np.testing.assert_allclose(to_numpy(first(np.moveaxis(x, -1, 1))), to_numpy(last(x)), rtol=1e-4, atol=1e-5)
    last.compile(keras.optimizers.Adam(1e-2), loss=kd.SoftmaxDeltaELL())
    history = last.fit(x, np.arange(4) % 3, epochs=2, verbose=0).history
    assert np.isfinite(history["loss"]).all()
    loaded = reloaded(last, tmp_path, "layer_norm")
    np.testing.assert_array_equal(to_numpy(loaded(x)), to_numpy(last(x)))
    norm = next(layer for layer in last.layers if isinstance(layer, kd.LayerNormalizationDVI))
    assert kd.LayerNormalizationDVI.from_config(norm.get_config()).get_config() == norm.get_config()


def test_misuse_is_refused_by_name():
    with pytest.raises(ValueError, match="`epsilon`"):
        kd.LayerNormalizationDVI(epsilon=-1.0)
    with pytest.raises(ValueError, match="`activation`"):
        kd.LayerNormalizationDVI(activation="softplus")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match="packed keras-dvi feature map"):  # data, not moments
            kd.LayerNormalizationDVI()(keras.Input((6, 6, 2)))
        with pytest.raises(ValueError, match="full covariance.*'silu'"):
            kd.LayerNormalizationDVI(activation="silu")(keras.Input((5, 4)))


@keras.saving.register_keras_serializable(package="keras_dvi_tests")
class ChannelScale(keras.layers.Layer):
    """ConvNeXt's `LayerScale` (which `keras.applications` keeps private): `x * gamma`."""

    def build(self, input_shape):
        self.gamma = self.add_weight(shape=(input_shape[-1],), initializer="ones")

    def call(self, x):
        return x * self.gamma


@keras.saving.register_keras_serializable(package="keras_dvi_tests")
class ChannelShift(ChannelScale):
    """A custom layer with one weight per channel that is not a scale: `x + gamma`."""

    def call(self, x):
        return x + self.gamma


def _plain_convnext(size=12, channels=16, last=ChannelScale):
    """keras.applications' ConvNeXt in small, in Keras layers: its depthwise convolution as a
    `Conv2D` with one group per channel, its layer scale, its residual sum written `x + y`."""
    layers = keras.layers
    inputs = keras.Input((size, size, 3))
    h = layers.LayerNormalization(epsilon=1e-6)(layers.Conv2D(channels, 2, strides=2)(inputs))
    for _ in range(2):
        branch = layers.Conv2D(channels, 7, padding="same", groups=channels)(h)
        branch = layers.LayerNormalization(epsilon=1e-6)(branch)
        branch = layers.Activation("gelu")(layers.Dense(2 * channels)(branch))
        branch = last()(layers.Dense(channels)(branch))
        h = h + branch
    h = layers.LayerNormalization(epsilon=1e-6)(layers.GlobalAveragePooling2D()(h))
    return keras.Model(inputs, layers.Dense(3, activation="softmax")(h))


def _randomise_plain(model, seed=0):
    rng = np.random.default_rng(seed)
    for layer in model.layers:
        if isinstance(layer, (keras.layers.LayerNormalization, ChannelScale)):
            layer.set_weights([w * rng.uniform(0.5, 2.0, w.shape) + (rng.normal(size=w.shape) * 0.5 if i else 0)
                               for i, w in enumerate(layer.get_weights())])


@pytest.mark.filterwarnings("ignore:.*collapsed to its prior")  # (4 images, 3 epochs)
def test_convert_turns_a_convnext_into_its_keras_dvi_counterpart(tmp_path):
    """With the posterior variances at 1e-12 the converted network computes the plain one: the
    grouped convolution as a depthwise one (its kernel rearranged), the layer scale folded into
    the projection before it, `x + y` as `AddDVI`, the GELU folded into the expansion, the layer
    normalisations of maps and of the pooled vector as `LayerNormalizationDVI`. It trains, and
    saves and loads to the same numbers."""
    keras.utils.set_random_seed(3)
    plain = _plain_convnext()
    _randomise_plain(plain)
    x = np.random.default_rng(1).uniform(size=(4, 12, 12, 3)).astype("float32")
    converted = kd.convert(plain, kernel_variance=1e-12, bias_variance=1e-12)
    kinds = [type(layer).__name__ for layer in converted.layers]
    assert kinds.count("LayerNormalizationDVI") == 4 and kinds.count("DepthwiseConv2DDVI") == 2
    assert kinds.count("AddDVI") == 2 and "ChannelScale" not in kinds
    mean, _ = kd.unpack(converted(x))
    np.testing.assert_allclose(to_numpy(keras.ops.softmax(mean)), to_numpy(plain(x)), atol=2e-6)
    converted = kd.convert(plain, regularizer=kd.EmpiricalBayesRegularizer(num_train=len(x)))
    history = converted.fit(x, np.arange(4) % 3, epochs=3, verbose=0).history
    assert np.isfinite(history["loss"]).all() and history["nll"][-1] < history["nll"][0]
    np.testing.assert_array_equal(reloaded(converted, tmp_path, "convnext").predict(x, verbose=0), converted.predict(x, verbose=0))


def test_convert_normalised_mlp_folds_the_activation_into_the_normalisation():
    """A Transformer feed-forward style MLP on vectors: Dense, a residual sum `x + y` (as
    `AddDVI`), LayerNormalization, ReLU (folded into it)."""
    keras.utils.set_random_seed(4)
    inputs = keras.Input((10,))
    h = keras.layers.Dense(32)(inputs)
    h = h + keras.layers.Dense(32)(h)  # a residual sum of vectors written `x + y`
    h = keras.layers.ReLU()(keras.layers.LayerNormalization()(h))
    plain = keras.Model(inputs, keras.layers.Dense(3, activation="softmax")(h))
    _randomise_plain(plain)
    converted = kd.convert(plain, kernel_variance=1e-12, bias_variance=1e-12)
    norm = next(layer for layer in converted.layers if isinstance(layer, kd.LayerNormalizationDVI))
    assert norm.activation == "relu" and not any(isinstance(layer, kd.ActivationDVI) for layer in converted.layers)
    assert any(isinstance(layer, kd.AddDVI) for layer in converted.layers)
    x = np.random.default_rng(2).normal(size=(5, 10)).astype("float32")
    mean, _ = kd.unpack(converted(x))
    np.testing.assert_allclose(to_numpy(keras.ops.softmax(mean)), to_numpy(plain(x)), atol=2e-6)


def test_rms_normalisation_converts_computes_the_plain_function_trains_and_saves(tmp_path):
    """`RMSNormalization` of a sequence's channels (its SiLU folded in) and of a vector's units
    converts to `RMSNormalizationDVI`: at tiny variances the plain probabilities; against 2,000
    weight draws at the default variances and ten times them, over five initialisations,
    means within 0.15 sd and variances 0.72-2.48 of Monte Carlo's (medians 0.89-1.43), as
    with `LayerNormalization` in its place (0.63-2.17, medians 0.89-1.70: the 1D network on
    noise and the vector's normaliser of 16 units, not the RMS rule, whose layer-level bands
    are layer normalisation's); it trains, a `.keras` file predicts the same numbers, and
    channels first computes what channels last does."""
    layers = keras.layers
    keras.utils.set_random_seed(5)
    inputs = keras.Input((12, 4))
    h = layers.Activation("silu")(layers.RMSNormalization()(layers.Conv1D(16, 3, padding="same")(inputs)))
    h = layers.RMSNormalization()(layers.Dense(16)(layers.GlobalAveragePooling1D()(layers.Conv1D(16, 3)(h))))
    plain = keras.Model(inputs, layers.Dense(3, activation="softmax")(h))
    rng = np.random.default_rng(0)
    for layer in plain.layers:
        if isinstance(layer, layers.RMSNormalization):
            layer.set_weights([rng.uniform(0.5, 1.5, layer.scale.shape)])
    plain.compile("adam", "sparse_categorical_crossentropy")
    x = rng.normal(size=(4, 12, 4)).astype("float32")
    converted = kd.convert(plain, kernel_variance=1e-12, bias_variance=1e-12)
    norms = [layer for layer in converted.layers if isinstance(layer, kd.RMSNormalizationDVI)]
    assert [layer.activation for layer in norms] == ["silu", "linear"]
    np.testing.assert_allclose(kd.predict(converted, x)["probabilities"], to_numpy(plain(x)), atol=2e-6)
    bayesian = kd.convert(plain, regularizer=kd.EmpiricalBayesRegularizer(num_train=len(x)))
    for scale in (0.03, 0.3):
        _set_variances(bayesian, scale)
        error, ratio = _compare(bayesian, x, 2000)
        assert np.abs(error).max() < 0.2 and 0.6 < ratio.min() and ratio.max() < 2.7, (error, ratio)
        assert 0.8 < np.median(ratio) < 1.5, ratio
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (4 sequences for 2 epochs: the collapse check may speak)
        assert np.isfinite(bayesian.fit(x, np.arange(4) % 3, epochs=2, verbose=0).history["loss"]).all()
    np.testing.assert_allclose(reloaded(bayesian, tmp_path, "rms").predict(x, verbose=0), bayesian.predict(x, verbose=0),
                               rtol=1e-6, atol=1e-7)
    config = norms[0].get_config()
    assert "center" not in config and kd.RMSNormalizationDVI.from_config(config).get_config() == config
    packed = to_numpy(kd.Conv1DDVI(6, 3)(x))
    last, first = kd.RMSNormalizationDVI(activation="relu"), kd.RMSNormalizationDVI(activation="relu",
                                                                                  data_format="channels_first")
    np.testing.assert_allclose(np.moveaxis(to_numpy(first(np.moveaxis(packed, -1, 2))), 2, -1), to_numpy(last(packed)),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.filterwarnings("ignore:You passed `rms_scaling=True`")  # (Keras deprecates it; refused here)
def test_convert_refuses_what_has_no_counterpart_by_name():
    layers = keras.layers
    inputs = keras.Input((8, 8, 3))
    h = layers.Conv2D(8, 3)(inputs)
    across = keras.Model(inputs, layers.LayerNormalization(axis=[1, 2, 3])(h))
    with pytest.raises(ValueError, match="LayerNormalization .* must normalise the channels.*axis=\\[1, 2, 3\\]"):
        kd.convert(across)
    for norm in (layers.GroupNormalization(2, axis=1), layers.RMSNormalization(axis=1),
                 layers.LayerNormalization(rms_scaling=True)):
        with pytest.raises(ValueError, match=f"{type(norm).__name__} .* must normalise the channels"):
            kd.convert(keras.Model(inputs, norm(layers.Conv2D(8, 3)(inputs))))
    with pytest.raises(ValueError, match="ChannelShift.*has no keras-dvi counterpart"):
        kd.convert(_plain_convnext(last=ChannelShift))
    h = layers.Conv2D(8, 3)(inputs)
    shared = ChannelScale()(h)  # a layer scale on a convolution that another layer also reads
    with pytest.raises(ValueError, match="multiplies each channel by a weight"):
        kd.convert(keras.Model(inputs, layers.Add()([h, shared])))
    grouped = keras.Model(inputs, layers.Conv2D(6, 3, groups=3)(layers.Conv2D(6, 3)(inputs)))  # 2 channels a group
    with pytest.raises(ValueError, match="groups=1 \\(or, in 2D, one group per input channel"):
        kd.convert(grouped)


def test_a_convolution_with_one_group_per_channel_is_a_depthwise_one():
    """`Conv2D(6, 3, groups=3)` on 3 channels: two filters per channel, output `c * 2 + j`, as
    `DepthwiseConv2D(depth_multiplier=2)`; strided and dilated too."""
    keras.utils.set_random_seed(5)
    inputs = keras.Input((9, 9, 3))
    h = keras.layers.Conv2D(6, 3, strides=2, padding="same", groups=3, activation="relu")(inputs)
    h = keras.layers.Conv2D(6, 3, dilation_rate=2, groups=6)(h)
    plain = keras.Model(inputs, keras.layers.Dense(2)(keras.layers.Flatten()(h)))
    converted = kd.convert(plain, kernel_variance=1e-12, bias_variance=1e-12)
    assert [type(layer).__name__ for layer in converted.layers].count("DepthwiseConv2DDVI") == 2
    x = np.random.default_rng(3).normal(size=(2, 9, 9, 3)).astype("float32")
    np.testing.assert_allclose(to_numpy(kd.unpack(converted(x))[0]), to_numpy(plain(x)), rtol=1e-4, atol=1e-5)


def test_operations_after_a_nested_model_convert_as_in_an_unnested_one():
    """A hard sigmoid written as operations after a nested `Sequential` stem folds into the
    convolution it follows (before the fix the operations stayed plain, on the packed moments:
    variances near 0.4 at zero weight variance, and a warning)."""
    inputs = keras.Input((8, 8, 3))
    stem = keras.Sequential([keras.Input((8, 8, 3)), keras.layers.Conv2D(4, 3, padding="same")])
    h = keras.layers.ReLU(6.0)(stem(inputs) + 3.0) * (1.0 / 6.0)
    h = keras.layers.Conv2D(4, 3)(h)
    plain = keras.Model(inputs, keras.layers.Dense(2)(keras.layers.GlobalAveragePooling2D()(h)))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # (no plain operation between keras-dvi layers)
        converted = kd.convert(plain, kernel_variance=1e-12, bias_variance=1e-12)
        x = np.random.default_rng(0).normal(size=(2, 8, 8, 3)).astype("float32")
        mean, variance = (to_numpy(t) for t in kd.unpack(converted(x)))
    assert converted.layers[1].activation == "hard_sigmoid"
    np.testing.assert_allclose(mean, to_numpy(plain(x)), rtol=1e-5, atol=1e-6)
    assert variance.max() < 1e-6
