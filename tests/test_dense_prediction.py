"""Dense prediction (segmentation, per-pixel regression): the transposed convolutions and
upsampling of U-Nets and autoencoders against Keras' own operations and Monte Carlo over the
weights, the losses, metrics and predictions of a feature-map output against their formulas at
every position, and `convert` of U-Nets (the plain model's function at tiny variances)."""

import itertools
import math
import warnings

import keras
import numpy as np
import pytest
from keras import ops

import keras_dvi as kd
from keras_dvi import conv_moments
from tests.conftest import plain_outputs, reloaded, to_numpy
from tests.test_conv import _assert_exact, _compare, _images, _set_variances

TINY = {"kernel_variance": 1e-12, "bias_variance": 1e-12}

# ----------------------------------------------------------------- transposed convolutions


def _transpose_cases():
    """Keras' transposed convolutions: kernel sizes, strides, paddings, output paddings,
    dilations (strides above 1 and dilation above 1 do not combine, as in Keras)."""
    for rank, k, s, padding, extra, d in itertools.product((1, 2), (1, 2, 3, 4), (1, 2, 3), ("valid", "same"),
                                                           (None, 0, 1), (1, 2)):
        if (extra is not None and extra >= s) or (s > 1 and d > 1):
            continue
        yield rank, k, s, padding, extra, d


def test_transposed_moments_at_zero_variance_are_keras_conv_transpose():
    """A transposed convolution is a convolution of the input with zeros between its positions:
    with no weight variance the means are `keras.ops.conv_transpose`'s (the oracle), with
    Keras' output sizes, for every kernel size, stride, padding, output padding and dilation
    that Keras' own operation computes on this backend; the sampled form, one kernel per sample,
    too."""
    rng = np.random.default_rng(0)
    checked = 0
    for rank, k, s, padding, extra, d in _transpose_cases():
        x = rng.normal(size=(2,) + (5,) * (rank - 1) + (7, 3)).astype("float32")
        kernel = rng.normal(size=(k,) * rank + (4, 3)).astype("float32")
        arguments = {"strides": s, "padding": padding, "output_padding": extra, "dilation_rate": d}
        try:
            expected = to_numpy(ops.conv_transpose(x, kernel, data_format="channels_last", **arguments))
        except Exception:  # noqa: BLE001 - a configuration the backend's own kernel refuses (oneDNN on TensorFlow)
            continue
        mean, variance, shared = (to_numpy(t) for t in conv_moments.conv_transpose_moments(
            ops.convert_to_tensor(x), kernel, np.zeros_like(kernel), **arguments))
        np.testing.assert_allclose(mean, expected, rtol=1e-5, atol=2e-5)  # (measured: within 3.3e-6)
        assert np.all(variance == 0) and np.all(shared == 0)
        layer = kd.Conv2DTransposeDVI(4, k, **arguments) if rank == 2 else kd.Conv1DTransposeDVI(4, k, **arguments)
        assert layer.compute_output_shape(x.shape)[2:] == expected.shape[1:]
        samples = to_numpy(conv_moments.sampled_conv_transpose(
            ops.convert_to_tensor(np.stack([x, x])), np.stack([kernel, 0.5 * kernel]), None, **arguments))
        np.testing.assert_allclose(samples[1], 0.5 * expected, rtol=1e-5, atol=2e-5)
        checked += 1
    assert checked >= 100


@pytest.mark.parametrize("rank, kwargs", [
    (2, {"strides": 1, "padding": "same"}),
    (2, {"strides": 2, "padding": "same"}),
    (2, {"strides": 2, "padding": "valid", "output_padding": 1}),
    (1, {"strides": 3, "padding": "same"}),
])
@pytest.mark.parametrize("activation", [None, "relu"])
def test_first_transposed_conv_layer_moments_are_exact(rank, kwargs, activation):
    """The first layer's per-position means and variances are exact: Monte Carlo over kernels
    (each shared by every position, through Keras' `conv_transpose`) agrees within its
    standard errors."""
    x = _images(8, rows=2, channels=2)
    if rank == 1:
        x = x[:, :, :, 0]
    layer = (kd.Conv2DTransposeDVI if rank == 2 else kd.Conv1DTransposeDVI)(5, 3, activation=activation, **kwargs)
    model = keras.Sequential([keras.Input(x.shape[1:]), layer])
    _set_variances(model, 0.5)
    _assert_exact(model, x, 10_000)


@pytest.mark.parametrize("rank", [1, 2])
def test_upsampling_is_exact_per_unit(rank):
    """Nearest-neighbour upsampling repeats each unit: after an exact first layer, every copy's
    mean and variance agree with Monte Carlo within its standard errors."""
    x = _images(8, rows=3, channels=2)
    if rank == 1:
        x = x[:, :, :, 0]
    conv, up = (kd.Conv2DDVI, kd.UpSampling2DDVI) if rank == 2 else (kd.Conv1DDVI, kd.UpSampling1DDVI)
    model = keras.Sequential([keras.Input(x.shape[1:]), conv(4, 3, padding="same", strides=2, activation="relu"),
                              up((2, 3) if rank == 2 else 3)])
    _set_variances(model, 0.5)
    assert model.output_shape[2:-1] == ((8, 12) if rank == 2 else (12,))
    _assert_exact(model, x, 20_000)


INTERPOLATIONS = ("bilinear", "bicubic", "lanczos3", "lanczos5")


@pytest.mark.parametrize("interpolation", INTERPOLATIONS)
def test_interpolated_upsampling_is_keras_upsampling_on_data_and_on_samples(interpolation):
    """At zero variance `UpSampling2DDVI` computes Keras' `UpSampling2D` with the same
    interpolation (the oracle: Keras' layer), for factors above 1 and 1 along either axis and
    both data formats; its sampled form applies Keras' function to every sample."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 4, 5, 3)).astype("float32")
    for size in [(2, 3), (3, 1), 2]:
        expected = to_numpy(keras.layers.UpSampling2D(size, interpolation=interpolation)(x))
        layer = kd.UpSampling2DDVI(size, interpolation=interpolation)
        packed = np.stack([x, np.zeros_like(x), np.zeros_like(x)], axis=1)
        out = to_numpy(layer(packed))
        assert out.shape[1:] == layer.compute_output_shape(packed.shape)[1:] == (3,) + expected.shape[1:]
        np.testing.assert_allclose(out[:, 0], expected, rtol=1e-5, atol=1e-5)  # (measured: within 2.4e-7)
        assert np.all(out[:, 1:] == 0)
        first = kd.UpSampling2DDVI(size, interpolation=interpolation, data_format="channels_first")
        out_first = to_numpy(first(np.moveaxis(packed, -1, 2)))
        np.testing.assert_allclose(np.moveaxis(out_first, 2, -1), out, rtol=1e-6, atol=1e-6)
    samples = np.stack([x, 2.0 * x + 1.0])
    sampled = to_numpy(conv_moments.interpolate(ops.convert_to_tensor(samples), (2, 3), interpolation))
    for i in range(2):
        np.testing.assert_allclose(
            sampled[i], to_numpy(keras.layers.UpSampling2D((2, 3), interpolation=interpolation)(samples[i])),
            rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("interpolation", INTERPOLATIONS)
def test_interpolated_upsampling_moments_are_exact_within_the_representation(interpolation):
    """Each output unit is a fixed weighted sum of input units: with inputs drawn from the map
    the moments describe (independent parts per unit, one shared factor per channel and
    example), the means and variances of Keras' own `UpSampling2D` over 100,000 draws agree
    with the layer's within 5 standard errors (the outputs are Gaussian, so the variance's is
    `v sqrt(2 / n)`). Measured: within 3.1 (means) and 1.1% (variances) over 720 units."""
    rng = np.random.default_rng(1)
    mean = rng.normal(size=(2, 4, 5, 3))
    variance = rng.uniform(0.2, 2.0, size=mean.shape)
    shared = np.sqrt(variance) * rng.uniform(-0.9, 0.9, size=mean.shape)
    out = to_numpy(kd.UpSampling2DDVI((2, 3), interpolation=interpolation)(
        np.stack([mean, variance, shared], axis=1).astype("float32"))).astype("float64")
    plain = keras.layers.UpSampling2D((2, 3), interpolation=interpolation)
    n, chunk = 100_000, 2_000
    independent = np.sqrt(variance - shared ** 2)
    total, total_squares = 0.0, 0.0
    for _ in range(n // chunk):
        draws = (mean + independent * rng.normal(size=(chunk,) + mean.shape)
                 + shared * rng.normal(size=(chunk, 2, 1, 1, 3)))
        y = to_numpy(plain(draws.reshape((-1,) + mean.shape[1:]).astype("float32"))).astype("float64")
        y = y.reshape((chunk,) + out[:, 0].shape)
        total, total_squares = total + y.sum(0), total_squares + np.square(y).sum(0)
    mc_mean = total / n
    mc_var = total_squares / n - np.square(mc_mean)
    assert np.all(np.abs(out[:, 0] - mc_mean) < 5 * np.sqrt(mc_var / n))
    assert np.all(np.abs(out[:, 1] / mc_var - 1) < 5 * np.sqrt(2 / n))
    assert np.all(np.abs(out[:, 2]) <= np.sqrt(out[:, 1]) * (1 + 1e-6))


def _encoder_decoder(interpolation="nearest"):
    """A small segmentation network: a strided convolution and a max pooling down, a transposed
    convolution and an upsampling back up, three classes per pixel."""
    return keras.Sequential([
        keras.Input((16, 16, 1)),
        kd.Conv2DDVI(8, 3, padding="same"),
        kd.MaxPooling2DDVI(2, activation="relu"),
        kd.Conv2DDVI(8, 3, padding="same", strides=2, activation="relu"),
        kd.Conv2DTransposeDVI(8, 3, strides=2, padding="same", activation="relu"),
        kd.UpSampling2DDVI(2, interpolation=interpolation),
        kd.Conv2DDVI(8, 3, padding="same", activation="relu"),
        kd.Conv2DDVI(3, 1),
    ])


@pytest.mark.parametrize("interpolation", ["nearest", "bilinear"])
@pytest.mark.parametrize("scale", [0.03, 0.3])
def test_encoder_decoder_matches_monte_carlo(scale, interpolation):
    """Every pixel's logits through the whole network against 2,000 weight draws: the CNN
    bounds (median mean error within 0.1 predictive sd, median variance ratio within 0.8-1.25;
    measured 0.03 and 0.85-0.88 for nearest upsampling, 0.02-0.03 and 0.91-0.94 for bilinear), at
    the layers' initial variances and ten times them."""
    keras.utils.set_random_seed(1)
    model = _encoder_decoder(interpolation)
    _set_variances(model, scale)
    mean_error, ratio = _compare(model, _images(16, rows=4), 2000)
    assert mean_error.shape == (4, 16, 16, 3)
    assert np.median(np.abs(mean_error)) < 0.1
    assert 0.8 < np.median(ratio) < 1.25


def test_layers_round_trip_their_config_and_channels_first_computes_the_same(tmp_path):
    """Config round trips, output shapes as computed, a `.keras` file that predicts the same
    numbers, and channels-first layers computing what channels-last ones do."""
    layers = [kd.Conv2DTransposeDVI(4, (3, 2), strides=(2, 1), padding="same", output_padding=(1, 0),
                                    activation="relu"),
              kd.Conv1DTransposeDVI(3, 4, strides=2, use_bias=False), kd.UpSampling2DDVI((2, 3)),
              kd.UpSampling1DDVI(4), kd.UpSampling2DDVI(2, interpolation="bicubic")]
    for layer in layers:
        config = layer.get_config()
        assert type(layer).from_config(config).get_config() == config
        assert keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(layer)).get_config() == config
    assert layers[0].output_padding == (1, 0) and layers[2].size == (2, 3)
    keras.utils.set_random_seed(2)
    model = _encoder_decoder()
    _set_variances(model, 0.3)
    x = _images(16, rows=2)
    np.testing.assert_allclose(reloaded(model, tmp_path, "segmentation").predict(x, verbose=0), model.predict(x, verbose=0),
                               rtol=1e-6, atol=1e-7)
    first = keras.Sequential([keras.Input((1, 16, 16)), kd.Conv2DDVI(4, 3, padding="same", data_format="channels_first"),
                              kd.Conv2DTransposeDVI(3, 3, strides=2, data_format="channels_first", activation="relu"),
                              kd.UpSampling2DDVI(2, data_format="channels_first")])
    last = keras.Sequential([keras.Input((16, 16, 1)), kd.Conv2DDVI(4, 3, padding="same"),
                             kd.Conv2DTransposeDVI(3, 3, strides=2, activation="relu"), kd.UpSampling2DDVI(2)])
    _set_variances(last, 0.3)
    first.set_weights(last.get_weights())
    out_first = to_numpy(first(np.moveaxis(x, -1, 1)))
    np.testing.assert_allclose(np.moveaxis(out_first, 2, -1), to_numpy(last(x)), rtol=1e-5, atol=1e-6)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="output_padding.*below the stride"):
        kd.Conv2DTransposeDVI(4, 3, strides=2, output_padding=2)
    with pytest.raises(ValueError, match="output_padding.*transposed"):
        kd.layers.conv_dvi.ConvArguments(2, 4, 3, strides=2, output_padding=1)
    with pytest.raises(ValueError, match="interpolation.*'nearest' or one of 'bilinear'.*'area'"):
        kd.UpSampling2DDVI(2, interpolation="area")
    with pytest.raises(ValueError, match="size"):
        kd.UpSampling2DDVI(0)


# ----------------------------------------------------------------- losses, metrics, predictions


def _map_output(rng, classes, rows=2, spatial=(3, 4)):
    """A packed feature-map output `(rows, 3, *spatial, classes)` and its means and variances."""
    mean = rng.normal(size=(rows,) + spatial + (classes,))
    variance = rng.uniform(0.0, 2.0, mean.shape)
    shared = np.sqrt(variance) * rng.uniform(-1, 1, mean.shape)
    return np.stack([mean, variance, shared], axis=1).astype("float32"), mean, variance


def test_softmax_loss_scores_every_position():
    """On a feature map the loss is Jankowiak's bound (eq. 38) at every position, summed over an
    image's positions (12 here) and averaged over the batch, so that `num_train` counts images;
    per-pixel sample weights weigh each position as in Keras' per-pixel losses; labels as
    integers `(batch, *spatial)` or `(batch, *spatial, 1)`, or one-hot; two classes take the
    probability of class 1 (a binary segmentation's soft labels)."""
    rng = np.random.default_rng(3)
    packed, mean, variance = _map_output(rng, 4)
    positions = 12
    labels = rng.integers(0, 4, size=mean.shape[:-1])
    log_norm = np.log(np.sum(np.exp(mean) * (1 + 0.5 * variance), axis=-1))
    expected = positions * np.mean(log_norm - np.take_along_axis(mean, labels[..., None], -1)[..., 0])
    loss = kd.SoftmaxDeltaELL()
    for y in (labels, labels[..., None], np.eye(4)[labels]):
        assert float(to_numpy(loss(y, packed))) == pytest.approx(expected, rel=1e-5)
    weights = rng.uniform(size=labels.shape)  # per pixel, as Keras weighs its own per-pixel losses
    per_pixel = log_norm - np.take_along_axis(mean, labels[..., None], -1)[..., 0]
    assert float(to_numpy(loss(labels, packed, sample_weight=weights))) == pytest.approx(
        positions * np.mean(per_pixel * weights), rel=1e-5)
    packed, mean, variance = _map_output(rng, 2)
    soft = rng.uniform(size=mean.shape[:-1] + (1,))
    log_norm = np.log(np.sum(np.exp(mean) * (1 + 0.5 * variance), axis=-1))
    expected = positions * np.mean(log_norm - (1 - soft[..., 0]) * mean[..., 0] - soft[..., 0] * mean[..., 1])
    assert float(to_numpy(loss(soft, packed))) == pytest.approx(expected, rel=1e-5)
    with pytest.raises(ValueError, match=r"\(batch, 3, 4\) or \(batch, 3, 4, 1\).*received shape \(2, 4, 3\)"):
        loss(np.zeros((2, 4, 3)), packed)


def test_regression_loss_metrics_and_moments_score_every_position():
    """A per-pixel regression (means, then log noise variances, as channels): the expected
    Gaussian log-likelihood (eq. 8, no mean-noise covariance across a map's channels) at every
    position, summed over an image's 12 positions; the predictive moments (eq. 9) per position,
    and the metrics averaged over pixels."""
    rng = np.random.default_rng(4)
    packed, mean, variance = _map_output(rng, 2)
    y = rng.normal(size=mean.shape[:-1] + (1,))
    m, log_var, s_mm, s_ll = mean[..., :1], mean[..., 1:], variance[..., :1], variance[..., 1:]
    nll = 0.5 * (math.log(2 * math.pi) + log_var + (s_mm + (m - y) ** 2) * np.exp(0.5 * s_ll - log_var))
    assert float(to_numpy(kd.HeteroscedasticELL()(y, packed))) == pytest.approx(12 * nll.mean(), rel=1e-5)
    assert float(to_numpy(kd.HeteroscedasticELL()(y[..., 0], packed))) == pytest.approx(12 * nll.mean(), rel=1e-5)
    moments = {k: to_numpy(v) for k, v in kd.predictive.regression_moments(packed).items()}
    aleatoric = np.exp(log_var + 0.5 * s_ll)
    np.testing.assert_allclose(moments["mean"], m, rtol=1e-6)
    np.testing.assert_allclose(moments["variance"], s_mm + aleatoric, rtol=1e-5)
    mse = kd.metrics.PredictiveMSE()
    mse.update_state(y, packed)
    assert float(to_numpy(mse.result())) == pytest.approx(np.mean((m - y) ** 2), rel=1e-5)
    packed, mean, variance = _map_output(rng, 3)
    labels = rng.integers(0, 3, size=mean.shape[:-1])
    accuracy = kd.metrics.MeanLogitAccuracy()
    accuracy.update_state(labels, packed)
    assert float(to_numpy(accuracy.result())) == pytest.approx(np.mean(mean.argmax(-1) == labels), rel=1e-6)


def test_class_probabilities_at_every_position():
    """`softmax(m)` and the pairwise probit approximation (Lu, Ie & Sha) at every position,
    against their formulas written out in NumPy."""
    rng = np.random.default_rng(5)
    packed, mean, variance = _map_output(rng, 3)
    softmax = np.exp(mean) / np.exp(mean).sum(-1, keepdims=True)
    np.testing.assert_allclose(to_numpy(kd.predictive.class_probabilities(packed)), softmax, rtol=1e-5)
    scale = np.sqrt(1 + math.pi / 8 * (variance[..., :, None] + variance[..., None, :]))
    pairwise = -np.log(np.sum(np.exp(-(mean[..., :, None] - mean[..., None, :]) / scale), axis=-1))
    probit = np.exp(pairwise) / np.exp(pairwise).sum(-1, keepdims=True)
    np.testing.assert_allclose(to_numpy(kd.predictive.class_probabilities(packed, "probit")), probit, rtol=1e-5)


# ----------------------------------------------------------------- convert


def _unet(classes=3, head_activation="softmax"):
    """keras.io's U-Net for the Oxford pets, at 16x16 and a few filters: separable
    convolutions, batch normalisation and residual sums down, transposed convolutions and
    upsampling back up, a per-pixel softmax."""
    layers = keras.layers
    inputs = keras.Input((16, 16, 3))
    x = layers.Activation("relu")(layers.BatchNormalization()(layers.Conv2D(8, 3, strides=2, padding="same")(inputs)))
    previous = x
    for filters in (8, 16):
        x = layers.Activation("relu")(x)
        x = layers.BatchNormalization()(layers.SeparableConv2D(filters, 3, padding="same")(x))
        x = layers.MaxPooling2D(3, strides=2, padding="same")(x)
        x = layers.add([x, layers.Conv2D(filters, 1, strides=2, padding="same")(previous)])
        previous = x
    for filters in (16, 8, 8):
        x = layers.Activation("relu")(x)
        x = layers.BatchNormalization()(layers.Conv2DTranspose(filters, 3, padding="same")(x))
        x = layers.UpSampling2D(2)(x)
        x = layers.add([x, layers.Conv2D(filters, 1, padding="same")(layers.UpSampling2D(2)(previous))])
        previous = x
    return keras.Model(inputs, layers.Conv2D(classes, 3, activation=head_activation, padding="same")(x))


def _randomise_statistics(model, seed=0):
    """Non-trivial batch normalisation statistics and scales (as after training), so that
    folding them is tested."""
    rng = np.random.default_rng(seed)
    for layer in model.layers:
        if isinstance(layer, keras.layers.BatchNormalization):
            channels = layer.gamma.shape[0]
            layer.set_weights([rng.uniform(0.5, 1.5, channels), rng.normal(0, 0.2, channels),
                               rng.normal(0, 0.2, channels), rng.uniform(0.5, 1.5, channels)])


def test_a_unet_converts_whole_and_computes_the_plain_segmentation():
    """keras.io's U-Net converts layer for layer (transposed convolutions with their batch
    normalisation folded, upsampling), compiled with the per-pixel `SoftmaxDeltaELL` and its
    accuracy; at tiny variances it computes the plain per-pixel probabilities; it trains, and
    `keras_dvi.predict` gives every pixel's probabilities, label and entropy."""
    keras.utils.set_random_seed(0)
    plain = _unet()
    _randomise_statistics(plain)
    plain.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"])
    rng = np.random.default_rng(0)
    x = rng.uniform(size=(8, 16, 16, 3)).astype("float32")
    converted = kd.convert(plain, **TINY)
    names = {type(layer).__name__ for layer in converted.layers}
    assert {"Conv2DTransposeDVI", "UpSampling2DDVI", "DepthwiseConv2DDVI", "AddDVI"} <= names
    assert not any(isinstance(layer, keras.layers.BatchNormalization) for layer in converted.layers)
    assert isinstance(converted.loss, kd.SoftmaxDeltaELL)
    out = kd.predict(converted, x)
    np.testing.assert_allclose(out["probabilities"], plain_outputs(plain, x), rtol=1e-4, atol=1e-5)
    assert out["label"].shape == out["entropy"].shape == (8, 16, 16)
    y = rng.integers(0, 3, size=(8, 16, 16))
    bayesian = kd.convert(plain, regularizer=kd.EmpiricalBayesRegularizer(num_train=len(x)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (8 images for 2 epochs: the collapse check may speak)
        history = bayesian.fit(x, y, epochs=2, batch_size=4, verbose=0).history
    assert sorted(history) == ["kl", "loss", "mean_logit_accuracy", "nll"]
    assert np.all(np.isfinite(history["loss"])) and np.all(np.array(history["kl"]) > 0)
    # the collapse check compares the nll per pixel (the logged nll is per image) with log C
    tracker = next(layer.elbo_tracker for layer in bayesian.layers if getattr(layer, "elbo_tracker", None))
    totals = dict(zip(tracker.FIELDS, to_numpy(tracker.totals)))
    assert totals["classified_nll"] / totals["classified_steps"] == pytest.approx(history["nll"][-1] / 256, rel=1e-5)
    assert np.all(np.isfinite(kd.predict(bayesian, x, probability_method="probit")["probabilities"]))


def _autoencoder(head_activation):
    """A small encoder-decoder with one output channel: a strided convolution down, a strided
    transposed convolution (batch normalisation after it, folded) back up."""
    layers = keras.layers
    inputs = keras.Input((16, 16, 3))
    h = layers.Conv2D(6, 3, strides=2, padding="same", activation="relu")(inputs)
    h = layers.ReLU()(layers.BatchNormalization()(layers.Conv2DTranspose(6, 3, strides=2, padding="same")(h)))
    return keras.Model(inputs, layers.Conv2D(1, 3, padding="same", activation=head_activation)(h))


def test_binary_segmentation_and_per_pixel_regression_convert():
    """A one-channel sigmoid output under a binary cross-entropy (a binary mask) becomes the
    logits `(0, z)` of a two-channel convolution: the plain model's per-pixel probability at
    tiny variances, trained on the masks. A per-pixel regression under the mean squared error
    gets `HomoscedasticNoise` on every pixel: the plain prediction as its mean, its squared
    error carried as `PredictiveMSE`."""
    keras.utils.set_random_seed(1)
    rng = np.random.default_rng(1)
    x = rng.uniform(size=(8, 16, 16, 3)).astype("float32")
    prior = {"regularizer": kd.EmpiricalBayesRegularizer(num_train=1000), **TINY}
    plain = _autoencoder("sigmoid")
    _randomise_statistics(plain)
    plain.compile("adam", "binary_crossentropy")
    converted = kd.convert(plain, **prior)
    assert converted.layers[-1].filters == 2
    np.testing.assert_allclose(kd.predict(converted, x)["probabilities"][..., 1], plain_outputs(plain, x)[..., 0],
                               rtol=1e-4, atol=1e-5)
    history = converted.fit(x, rng.integers(0, 2, size=(8, 16, 16, 1)).astype("float32"), epochs=1, verbose=0).history
    assert np.isfinite(history["loss"]).all()
    plain = _autoencoder(None)
    _randomise_statistics(plain)
    plain.compile("adam", "mse", metrics=["mse"])
    converted = kd.convert(plain, **prior)
    assert isinstance(converted.layers[-1], kd.HomoscedasticNoise)
    out = kd.predict(converted, x)
    np.testing.assert_allclose(out["mean"], plain_outputs(plain, x), rtol=1e-4, atol=1e-5)
    assert out["std"].shape == (8, 16, 16, 1) and np.all(out["std"] > 0)
    history = converted.fit(x, x[..., :1], epochs=1, verbose=0).history
    assert sorted(history) == ["kl", "loss", "nll", "predictive_mse"]


def test_a_channels_first_dense_prediction_is_refused_by_name():
    """The losses and predictions read a dense prediction's classes on the last axis: a
    channels-first segmentation network is refused, not converted into a model whose loss
    would read its columns as classes."""
    layers = keras.layers
    inputs = keras.Input((1, 8, 8))
    h = layers.Conv2D(4, 3, padding="same", activation="relu", data_format="channels_first")(inputs)
    plain = keras.Model(inputs, layers.Conv2D(3, 1, activation="softmax", data_format="channels_first")(h))
    plain.compile("adam", "sparse_categorical_crossentropy")
    with pytest.raises(ValueError, match="channels-first feature map.*last axis"):
        kd.convert(plain)


def test_a_segmenter_with_bilinear_upsampling_converts_trains_and_saves(tmp_path):
    """keras.io's DeepLabV3+ pattern (features upsampled bilinearly, joined with earlier ones,
    the logits upsampled to the image): it converts whole, computes the plain per-pixel
    probabilities at tiny variances, trains, and a `.keras` file predicts the same numbers."""
    layers = keras.layers
    inputs = keras.Input((16, 16, 3))
    low = layers.Conv2D(6, 3, strides=2, padding="same", activation="relu")(inputs)
    high = layers.Conv2D(8, 3, strides=2, padding="same", activation="relu")(low)
    x = layers.Concatenate()([layers.UpSampling2D(2, interpolation="bilinear")(high), low])
    x = layers.Conv2D(8, 3, padding="same", activation="relu")(x)
    x = layers.UpSampling2D(2, interpolation="bilinear")(layers.Conv2D(3, 1)(x))
    plain = keras.Model(inputs, layers.Activation("softmax")(x))
    plain.compile("adam", "sparse_categorical_crossentropy")
    rng = np.random.default_rng(0)
    x = rng.uniform(size=(8, 16, 16, 3)).astype("float32")
    converted = kd.convert(plain, **TINY)
    ups = [layer for layer in converted.layers if isinstance(layer, kd.UpSampling2DDVI)]
    assert len(ups) == 2 and all(layer.interpolation == "bilinear" for layer in ups)
    np.testing.assert_allclose(kd.predict(converted, x)["probabilities"], plain_outputs(plain, x),
                               rtol=1e-4, atol=1e-5)
    bayesian = kd.convert(plain, regularizer=kd.EmpiricalBayesRegularizer(num_train=len(x)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (8 images for 2 epochs: the collapse check may speak)
        history = bayesian.fit(x, rng.integers(0, 3, size=(8, 16, 16)), epochs=2, batch_size=4, verbose=0).history
    assert np.all(np.isfinite(history["loss"])) and np.all(np.array(history["kl"]) > 0)
    np.testing.assert_allclose(reloaded(bayesian, tmp_path, "deeplab").predict(x, verbose=0), bayesian.predict(x, verbose=0),
                               rtol=1e-6, atol=1e-7)




def _deeplab_v3_plus(image_size, classes, filters=32):
    """keras.io's DeepLabV3+ ("Multiclass semantic segmentation using DeepLabV3+"), with fewer
    filters: a ResNet50 backbone on preprocessed input, dilated spatial pyramid pooling (a
    whole-map average pooling upsampled back bilinearly, dilations 6, 12 and 18), low-level
    features joined after a bilinear upsampling, the logits upsampled bilinearly to the image;
    its blocks are written `ops.nn.relu(BatchNormalization()(Conv2D(...)))`."""
    layers = keras.layers

    def block(x, num_filters=filters, kernel_size=3, dilation_rate=1, use_bias=False):
        x = layers.Conv2D(num_filters, kernel_size=kernel_size, dilation_rate=dilation_rate, padding="same",
                          use_bias=use_bias, kernel_initializer=keras.initializers.HeNormal())(x)
        return ops.nn.relu(layers.BatchNormalization()(x))

    def pyramid(x):
        dims = x.shape
        pooled = block(layers.AveragePooling2D(pool_size=(dims[-3], dims[-2]))(x), kernel_size=1, use_bias=True)
        pooled = layers.UpSampling2D(size=(dims[-3] // pooled.shape[1], dims[-2] // pooled.shape[2]),
                                     interpolation="bilinear")(pooled)
        branches = [block(x, kernel_size=1)] + [block(x, dilation_rate=d) for d in (6, 12, 18)]
        return block(layers.Concatenate(axis=-1)([pooled, *branches]), kernel_size=1)

    model_input = keras.Input(shape=(image_size, image_size, 3))
    preprocessed = keras.applications.resnet50.preprocess_input(model_input)
    resnet50 = keras.applications.ResNet50(weights=None, include_top=False, input_tensor=preprocessed)
    x = pyramid(resnet50.get_layer("conv4_block6_2_relu").output)
    input_a = layers.UpSampling2D(size=(image_size // 4 // x.shape[1], image_size // 4 // x.shape[2]),
                                  interpolation="bilinear")(x)
    input_b = block(resnet50.get_layer("conv2_block3_2_relu").output, num_filters=12, kernel_size=1)
    x = block(block(layers.Concatenate(axis=-1)([input_a, input_b])))
    x = layers.UpSampling2D(size=(image_size // x.shape[1], image_size // x.shape[2]), interpolation="bilinear")(x)
    return keras.Model(model_input, layers.Conv2D(classes, kernel_size=(1, 1), padding="same")(x))


@pytest.mark.heavy
def test_kerasio_deeplab_v3_plus_converts_whole_and_computes_the_plain_segmentation():
    """keras.io's DeepLabV3+ (logits out, compiled with a from-logits cross-entropy) converts
    layer for layer: its batch normalisations fold into the convolutions with the `ops.nn.relu`
    after them, its three bilinear upsamplings become `UpSampling2DDVI(interpolation="bilinear")`;
    at tiny variances the per-pixel logits are the plain model's."""
    from benchmarks.experiments.converted_against_monte_carlo import randomise_batch_norm

    keras.utils.set_random_seed(0)
    plain = _deeplab_v3_plus(32, 5)
    randomise_batch_norm(plain)
    plain.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    converted = kd.convert(plain, **TINY)
    kinds = [type(layer).__name__ for layer in converted.layers]
    assert kinds.count("UpSampling2DDVI") == 3 and "AddDVI" in kinds and "ConcatenateDVI" in kinds
    assert not any(isinstance(layer, keras.layers.BatchNormalization) for layer in converted.layers)
    assert isinstance(converted.loss, kd.SoftmaxDeltaELL)
    x = np.random.default_rng(0).uniform(0, 255, size=(2, 32, 32, 3)).astype("float32")
    logits = to_numpy(plain(x))
    mean, _ = kd.unpack(converted(x))
    np.testing.assert_allclose(to_numpy(mean), logits, rtol=1e-4, atol=1e-5 * np.abs(logits).max())
