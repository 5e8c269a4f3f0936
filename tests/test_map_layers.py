"""Zero padding, cropping, concatenation and batch normalisation of keras-dvi feature maps.

The oracle of the maths is Monte Carlo through Keras' own layers: feature maps are drawn from
keras-dvi's representation (`u = m + s z_k + e`, one factor `z_k` per channel), pushed through
`keras.layers.ZeroPadding2D`, `Cropping2D`, `Concatenate` and `BatchNormalization` (inference),
and the samples' means, variances and covariances with the factors are compared with the
moment functions' within 5 standard errors. The layers are then checked end to end against
Monte Carlo over the weights, in both data formats, saved and loaded, and misused.
"""

import warnings

import keras
import numpy as np
import pytest

import keras_dvi as kd
from keras_dvi.maths import conv_moments
from tests.conftest import plain_outputs, reloaded, to_numpy
from tests.test_conv import _compare, _images, _set_variances

N = 20_000


def _map(seed, shape=(3, 5, 4, 3)):
    """Random moments `(mean, variance, shared)` of a map, `|s| <= sqrt(v)`."""
    rng = np.random.default_rng(seed)
    mean = rng.normal(size=shape)
    variance = rng.uniform(0.2, 2.0, shape)
    shared = rng.uniform(-0.9, 0.9, shape) * np.sqrt(variance)
    return mean, variance, shared


def _draw(moments, seed):
    """`(samples (N, *shape), factors (N, channels))` of the representation."""
    mean, variance, shared = moments
    rng = np.random.default_rng(seed)
    z = rng.normal(size=(N, mean.shape[-1]))
    e = rng.normal(size=(N, *mean.shape)) * np.sqrt(variance - shared**2)
    return mean + shared * z[:, None, None, None, :] + e, z


def _assert_matches(samples, factors, moments):
    """Means, variances and covariances with each output channel's factor within 5 standard errors."""
    mean, variance, shared = (np.asarray(t, "float64") for t in moments)
    mc_mean, mc_var = samples.mean(0), samples.var(0)
    centred = samples - mc_mean
    mc_shared = np.einsum("n...c,nc->...c", centred, factors - factors.mean(0)) / N
    se = np.sqrt(np.maximum(mc_var, 1e-12) / N)
    np.testing.assert_array_less(np.abs(mean - mc_mean), 5 * se + 1e-12)
    var_se = np.sqrt(np.mean((centred**2 - mc_var) ** 2, axis=0) / N)  # (any distribution: after an activation too)
    np.testing.assert_array_less(np.abs(variance - mc_var), 5 * var_se + 1e-12)
    np.testing.assert_array_less(np.abs(shared - mc_shared), 5 * se + 1e-12)


def _keras(layer, inputs):
    """`layer` on samples `(N, batch, ...)` (or a list of them) with the two leading axes as one."""
    rows = lambda x: keras.ops.convert_to_tensor(x.reshape((-1,) + x.shape[2:]).astype("float32"))  # noqa: E731
    inputs = [rows(x) for x in inputs] if isinstance(inputs, list) else rows(inputs)
    return to_numpy(layer(inputs, training=False)).astype("float64")


def _through(layer, samples):
    """A plain Keras layer applied to every sample of every row: `(N, batch, ...)`."""
    n, batch = samples.shape[:2]
    out = _keras(layer, samples)
    return out.reshape((n, batch) + out.shape[1:])


def test_padding_and_cropping_match_monte_carlo_through_keras_layers():
    moments = _map(0)
    samples, z = _draw(moments, 1)
    pads, crops = ((1, 2), (0, 1)), ((1, 1), (0, 2))
    _assert_matches(_through(keras.layers.ZeroPadding2D(pads), samples), z, conv_moments.pad_moments(*moments, pads))
    _assert_matches(_through(keras.layers.Cropping2D(crops), samples), z, conv_moments.crop_moments(*moments, crops))


def test_concatenation_matches_monte_carlo_through_keras_layers():
    first, second = _map(2), _map(3, shape=(3, 5, 4, 2))
    (a, za), (b, zb) = _draw(first, 4), _draw(second, 5)
    n, batch = a.shape[:2]
    joined = _keras(keras.layers.Concatenate(), [a, b])
    joined = joined.reshape((n, batch) + joined.shape[1:])
    _assert_matches(joined, np.concatenate([za, zb], axis=1), conv_moments.concatenate_moments([first, second]))


def test_batch_normalisation_matches_monte_carlo_through_keras_layers():
    moments = _map(6)
    samples, z = _draw(moments, 7)
    rng = np.random.default_rng(8)
    norm = keras.layers.BatchNormalization(epsilon=1e-2)
    norm.build((None, 5, 4, 3))
    weights = [rng.uniform(-2, 2, 3), rng.normal(size=3), rng.normal(size=3), rng.uniform(0.3, 3, 3)]
    norm.set_weights(weights)  # gamma (one negative scale at least is likely), beta, statistics
    layer = kd.BatchNormalizationDVI(epsilon=1e-2)
    layer.build((None, 3, 5, 4, 3))
    layer.set_weights(weights)
    scale, shift = (to_numpy(t).astype("float64") for t in layer.affine("float64"))
    _assert_matches(_through(norm, samples), z, conv_moments.channel_affine_moments(*moments, scale, shift))


def _network(data_format="channels_last", shared_ancestor=False):
    """Conv, batch normalisation with a ReLU, zero padding, conv; beside it a second conv on
    the inputs (or, with `shared_ancestor`, the first branch's normalised map, as a DenseNet
    block concatenates a map with features computed from it), zero padded and cropped back;
    concatenation, global average pooling, dense: every new layer between keras-dvi layers."""
    shape = (12, 12, 1) if data_format == "channels_last" else (1, 12, 12)
    f = {"data_format": data_format}
    inputs = keras.Input(shape)
    h = kd.Conv2DDVI(4, 3, **f)(inputs)  # 10x10
    norm = kd.BatchNormalizationDVI(activation="relu", **f)
    h = norm(h)
    a = kd.ZeroPadding2DDVI(1, **f)(h)  # 12x12
    a = kd.Conv2DDVI(4, 3, activation="relu", **f)(a)  # 10x10
    b = h if shared_ancestor else kd.Conv2DDVI(4, 3, activation="relu", **f)(inputs)
    b = kd.Cropping2DDVI(((1, 1), (0, 2)), **f)(kd.ZeroPadding2DDVI(((1, 1), (0, 2)), **f)(b))
    h = kd.ConcatenateDVI(**f)([a, b])
    h = kd.GlobalAveragePooling2DDVI(**f)(h)
    model = keras.Model(inputs, kd.DenseDiagDVI(3)(h))
    rng = np.random.default_rng(0)
    norm.set_weights([rng.uniform(0.5, 2, 4), rng.normal(size=4) * 0.1, rng.normal(size=4) * 0.1,
                      rng.uniform(0.5, 2, 4)])
    return model


@pytest.mark.parametrize("scale", [0.03, 0.3])
def test_network_of_the_new_layers_matches_monte_carlo_over_the_weights(scale):
    """The bounds of the other conv networks (`tests/test_conv.py`): means within 0.1 predictive
    sd and variances within a factor 1.25 (medians); measured 0.97-1.04 (3 seeds, TensorFlow and
    JAX): the new layers add no error of their own."""
    keras.utils.set_random_seed(4)
    model = _network()
    _set_variances(model, scale)
    mean_error, ratio = _compare(model, _images(12, rows=6), 4000)
    assert np.median(np.abs(mean_error)) < 0.1
    assert 0.8 < np.median(ratio) < 1.25


@pytest.mark.parametrize("seed", [4, 5])
def test_concatenating_a_map_with_features_of_it_states_its_error(seed):
    """A DenseNet-style concatenation of a map and features computed from it: the channels are
    correlated through their common ancestor, which keras-dvi's feature maps (independent
    channels) leave out, so the variance of what sums over channels is off by the correlation's
    sign and size. Measured medians 0.73-1.24 of Monte Carlo at posterior variances 0.03 and
    0.3 (3 seeds, TensorFlow and JAX; 0.97-1.04 without the common ancestor); means stay within
    0.03 sd."""
    keras.utils.set_random_seed(seed)
    model = _network(shared_ancestor=True)
    _set_variances(model, 0.3)
    mean_error, ratio = _compare(model, _images(12, rows=6), 4000)
    assert np.median(np.abs(mean_error)) < 0.1
    assert 0.67 < np.median(ratio) < 1.5


def test_channels_first_computes_the_same_and_the_layers_save(tmp_path):
    keras.utils.set_random_seed(5)
    last, first = _network("channels_last"), _network("channels_first")
    first.set_weights(last.get_weights())
    x = _images(12, rows=4)
    np.testing.assert_allclose(to_numpy(first(np.moveaxis(x, -1, 1))), to_numpy(last(x)), rtol=1e-5, atol=1e-6)
    last.compile(keras.optimizers.Adam(1e-2), loss=kd.SoftmaxDeltaELL())
    last.fit(x, np.arange(4) % 3, epochs=1, verbose=0)
    loaded = reloaded(last, tmp_path, "map_layers")
    np.testing.assert_array_equal(to_numpy(loaded(x)), to_numpy(last(x)))
    for layer in last.layers:
        if isinstance(layer, kd.layers.feature_map.MapLayer):
            assert type(layer).from_config(layer.get_config()).get_config() == layer.get_config()


@pytest.mark.parametrize("activation, keras_layer, stretch", [
    ("relu", keras.layers.ReLU(), 1.0),
    ("relu6", keras.layers.ReLU(6.0), 4.0),  # means and spreads reaching both kinks
    ("hard_silu", keras.layers.Activation("hard_swish"), 3.0),  # (MobileNetV3's name): both kinks
    ("hard_sigmoid", keras.layers.Activation("hard_sigmoid"), 3.0),  # MobileNetV3's gates: both kinks
    ("leaky_relu", keras.layers.LeakyReLU(0.2), 1.0),
    # the smooth activations, variances on both sides of SMOOTH_SWITCH (up to 18 with the stretch)
    ("silu", keras.layers.Activation("swish"), 1.0),
    ("silu", keras.layers.Activation("silu"), 3.0),
    ("gelu", keras.layers.Activation("gelu"), 2.0),
    ("sigmoid", keras.layers.Activation("sigmoid"), 3.0),
    ("tanh", keras.layers.Activation("tanh"), 2.0),
])
def test_activation_matches_monte_carlo_through_keras_layers(activation, keras_layer, stretch):
    """`ActivationDVI` on a map against Keras' own activation layer on draws of the map: each
    unit's mean and variance, and its covariance with its channel's factor (Stein's lemma:
    `Cov(f(u), z) = E[f'(u)] Cov(u, z)` for jointly Gaussian `u`, `z`, so the shared component
    is exact too)."""
    mean, variance, shared = _map(9)
    moments = (mean * stretch + (2.0 if activation == "relu6" else 0.0), variance * stretch**2, shared * stretch)
    samples, z = _draw(moments, 10)
    layer = kd.ActivationDVI(activation)
    packed = keras.ops.convert_to_tensor(np.stack(moments, axis=1).astype("float32"))
    out = to_numpy(layer(packed)).astype("float64")
    _assert_matches(_through(keras_layer, samples), z, (out[:, 0], out[:, 1], out[:, 2]))


def test_gated_map_matches_monte_carlo_through_keras_layers():
    """`MultiplyDVI`'s maths (`scale_moments`) against Keras' `Multiply` on draws of a map and
    an independent per-channel gate (broadcast over the positions, as in squeeze-and-excitation):
    each unit's mean and variance (exact for independent factors), and the variance of each
    channel's mean over the positions (what a global pooling reads), which the one shared
    factor per channel carries up to the stated excess: the gate's and the map's factors,
    two per channel, become one, and each unit's own share of the two is over-stated by
    `m_p^2 Var[g] + s_p^2 E[g^2] - s'_p^2` (zero when either factor is absent)."""
    moments = _map(11)
    samples, _ = _draw(moments, 12)
    rng = np.random.default_rng(13)
    gate_mean, gate_variance = rng.normal(0.5, 1.0, (3, 3)), rng.uniform(0.05, 0.5, (3, 3))
    gates = gate_mean + np.sqrt(gate_variance) * rng.normal(size=(N, 3, 3))
    n, batch = samples.shape[:2]
    out = _keras(keras.layers.Multiply(), [samples, gates[:, :, None, None, :]]).reshape(samples.shape)
    mean, variance, shared = (np.asarray(t, "float64") for t in conv_moments.scale_moments(
        *(keras.ops.convert_to_tensor(t) for t in moments), keras.ops.convert_to_tensor(gate_mean),
        keras.ops.convert_to_tensor(gate_variance)))
    mc_mean, mc_var = out.mean(0), out.var(0)
    se = np.sqrt(mc_var / n)
    np.testing.assert_array_less(np.abs(mean - mc_mean), 5 * se)
    var_se = np.sqrt(np.mean(((out - mc_mean) ** 2 - mc_var) ** 2, axis=0) / n)
    np.testing.assert_array_less(np.abs(variance - mc_var), 5 * var_se)
    pooled = out.mean(axis=(2, 3))  # (N, batch, channels)
    positions = 20
    m, _, s = moments
    excess = (np.square(m) * gate_variance[:, None, None, :] + np.square(s) * (gate_mean**2 + gate_variance)[:, None, None, :]
              - np.square(shared)).sum(axis=(1, 2)) / positions**2
    got = (np.sum(variance - np.square(shared), axis=(1, 2)) / positions**2 + np.square(shared.sum(axis=(1, 2)) / positions))
    pooled_se = np.sqrt(np.mean((np.square(pooled - pooled.mean(0)) - pooled.var(0)) ** 2, axis=0) / n)
    assert (excess >= -1e-12).all()
    np.testing.assert_array_less(np.abs(got - excess - pooled.var(0)), 5 * pooled_se)


def _squeeze_excitation_network(data_format="channels_last"):
    """EfficientNet's block in small: conv, batch normalisation, SiLU; squeeze (global average
    pooling, `Reshape` to 1x1, 1x1 conv with SiLU, 1x1 conv with a sigmoid) and excitation
    (`Multiply` of the map by the gate); a 1x1 projection and a dense head."""
    f = {"data_format": data_format}
    inputs = keras.Input((8, 8, 3) if data_format == "channels_last" else (3, 8, 8))
    h = keras.layers.Conv2D(6, 3, padding="same", use_bias=False, **f)(inputs)
    h = keras.layers.BatchNormalization(axis=-1 if data_format == "channels_last" else 1)(h)
    h = keras.layers.Activation("swish")(h)
    gate = keras.layers.GlobalAveragePooling2D(**f)(h)
    gate = keras.layers.Reshape((1, 1, 6) if data_format == "channels_last" else (6, 1, 1))(gate)
    gate = keras.layers.Conv2D(2, 1, activation="swish", **f)(gate)
    gate = keras.layers.Conv2D(6, 1, activation="sigmoid", **f)(gate)
    h = keras.layers.Multiply()([h, gate])
    h = keras.layers.Conv2D(4, 1, activation="gelu", **f)(h)
    outputs = keras.layers.Dense(3)(keras.layers.GlobalAveragePooling2D(**f)(h))
    return keras.Model(inputs, outputs)


@pytest.mark.parametrize("data_format", ["channels_last", "channels_first"])
def test_squeeze_and_excitation_converts_computes_the_plain_network_and_saves(tmp_path, data_format):
    """A squeeze-and-excitation block converts (the gate's 1x1 convolutions become dense layers
    with SiLU and sigmoid moments, the product `MultiplyDVI`); at tiny variances it computes the
    plain network, at the default variances its outputs are finite with positive variances, and
    it saves and loads (safe mode)."""
    keras.utils.set_random_seed(3)
    plain = _squeeze_excitation_network(data_format)
    x = _images(rows=4, size=8, channels=3)
    if data_format == "channels_first":
        x = np.transpose(x, (0, 3, 1, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no warning: the gates are not what falls short (the next test)
        tiny = kd.convert(plain, kernel_variance=1e-12, bias_variance=1e-12)
    kinds = [type(layer).__name__ for layer in tiny.layers]
    assert "MultiplyDVI" in kinds and kinds.count("DenseDiagDVI") == 2, kinds
    assert {getattr(layer, "activation", None) for layer in tiny.layers} >= {"silu", "sigmoid", "gelu"}
    np.testing.assert_allclose(to_numpy(kd.unpack(tiny(x))[0]), plain_outputs(plain, x), rtol=1e-4, atol=1e-5)
    converted = kd.convert(plain, regularizer=kd.EmpiricalBayesRegularizer(num_train=4))
    mean, variance = (to_numpy(t) for t in kd.unpack(converted(x), covariance="diagonal"))
    assert np.isfinite(mean).all() and (variance > 0).all()
    loaded = reloaded(converted, tmp_path, "se")
    np.testing.assert_allclose(loaded.predict(x, verbose=0), converted.predict(x, verbose=0), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("activation", ["swish", "gelu", "relu", "relu6"])
def test_convert_warns_of_unbounded_activations_on_stacked_depthwise_convolutions(activation):
    """EfficientNet's shortfall (the conversion guide: variances 0.01-0.42 of Monte Carlo's at its
    logits) follows an unbounded activation after depthwise convolutions block after block, not
    its gates: `convert` warns for two such blocks (SiLU, GELU, ReLU) and not with ReLU6
    (MobileNetV2's blocks, which agree), nor for one block."""
    def network(blocks):
        inputs = keras.Input((8, 8, 3))
        h = keras.layers.Conv2D(4, 1)(inputs)
        for _ in range(blocks):
            h = keras.layers.DepthwiseConv2D(3, padding="same", use_bias=False)(h)
            h = keras.layers.BatchNormalization()(h)
            h = keras.layers.ReLU(6.0)(h) if activation == "relu6" else keras.layers.Activation(activation)(h)
            h = keras.layers.Conv2D(4, 1)(h)
        return keras.Model(inputs, keras.layers.Dense(3)(keras.layers.GlobalAveragePooling2D()(h)))

    name = {"swish": "silu"}.get(activation, activation)
    quiet = [network(1)]
    if activation == "relu6":
        quiet.append(network(2))
    else:
        with pytest.warns(UserWarning, match=f"2 depthwise convolutions .*unbounded activation \\({name}\\).*"
                                             "stray far from Monte Carlo.*predict_samples.*last_layers"):
            kd.convert(network(2))
    for plain in quiet:
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)
            kd.convert(plain)


def test_activation_layer_saves_refuses_dense_inputs_and_converts_after_a_shared_sum(tmp_path):
    """A ReLU after an `Add` whose sum another layer also reads (Xception's blocks) converts to
    `ActivationDVI`; the converted network computes the plain one at tiny variances, saves and
    loads; dense inputs are refused."""
    inputs = keras.Input((8, 8, 3))
    h = keras.layers.Conv2D(4, 3, padding="same")(inputs)
    total = keras.layers.Add()([h, keras.layers.Conv2D(4, 1)(h)])
    branch = keras.layers.Conv2D(4, 3, padding="same")(keras.layers.ReLU()(total))
    h = keras.layers.Add()([total, branch])
    outputs = keras.layers.Dense(3)(keras.layers.GlobalAveragePooling2D()(h))
    plain = keras.Model(inputs, outputs)
    converted = kd.convert(plain, kernel_variance=1e-12, bias_variance=1e-12)
    assert [type(layer).__name__ for layer in converted.layers].count("ActivationDVI") == 1
    x = _images(rows=4, size=8, channels=3)
    np.testing.assert_allclose(to_numpy(kd.unpack(converted(x))[0]), to_numpy(plain(x)), rtol=1e-4, atol=1e-5)
    loaded = reloaded(converted, tmp_path, "activation")
    np.testing.assert_allclose(loaded.predict(x, verbose=0), converted.predict(x, verbose=0), rtol=1e-6, atol=1e-7)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match="packed keras-dvi feature map"):  # data, not moments
            kd.ActivationDVI("relu")(keras.Input((6, 6, 2)))
        with pytest.raises(ValueError, match="Argument `activation` must be one of.*'swish-ish'"):
            kd.ActivationDVI("swish-ish")


@pytest.mark.filterwarnings("ignore:.*that no keras-dvi layer produced")
def test_misuse_is_refused_by_name():
    packed = keras.Input((3, 6, 6, 2))
    with pytest.raises(ValueError, match="`padding`"):
        kd.ZeroPadding2DDVI(-1)
    with pytest.raises(ValueError, match="`cropping`"):
        kd.Cropping2DDVI(((1, 2, 3), (0, 0)))
    with pytest.raises(ValueError, match="leaves nothing"):
        kd.Cropping2DDVI(3)(packed)
    with pytest.raises(ValueError, match="same spatial shape"):
        kd.ConcatenateDVI()([packed, keras.Input((3, 5, 6, 2))])
    with pytest.raises(ValueError, match="two or more"):
        kd.ConcatenateDVI()([packed])
    with pytest.raises(ValueError, match="`epsilon`"):
        kd.BatchNormalizationDVI(epsilon=-1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match="packed keras-dvi feature map"):  # data, not moments
            kd.BatchNormalizationDVI()(keras.Input((6, 6, 2)))
