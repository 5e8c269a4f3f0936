"""Volumes: 3D convolutional networks (CT and MRI scans, video clips). `Conv3DDVI`,
`Conv3DTransposeDVI`, the 3D poolings, padding, cropping and upsampling against Monte Carlo over
the weights and against Keras' own operations, and `convert` of keras.io's 3D CT-scan classifier
and of a small 3D U-Net (the plain model's function at tiny variances)."""

import itertools
import warnings

import keras
import numpy as np
import pytest
from keras import ops

import keras_dvi as kd
from benchmarks.experiments.new_layers_against_monte_carlo import volume_cnn
from keras_dvi import conv_moments
from tests.conftest import plain_outputs, reloaded, to_numpy
from tests.test_conv import _assert_exact, _compare, _set_variances

TINY = {"kernel_variance": 1e-12, "bias_variance": 1e-12}


def _volumes(rows=3, size=6, channels=2, seed=0):
    """Smooth random volumes `(rows, size, size, size, channels)` in [0, 1]."""
    rng = np.random.default_rng(seed)
    grid = np.linspace(0.0, 1.0, size)
    x, y, z = np.meshgrid(grid, grid, grid, indexing="ij")
    centres = rng.uniform(0.2, 0.8, size=(rows, channels, 3))
    volumes = np.exp(-((x[None, None] - centres[..., 0, None, None, None]) ** 2
                       + (y[None, None] - centres[..., 1, None, None, None]) ** 2
                       + (z[None, None] - centres[..., 2, None, None, None]) ** 2) / 0.1)
    return np.moveaxis(volumes, 1, -1).astype("float32")


def test_window_sums_of_volumes_are_convolutions_with_ones():
    """The window sum a 3D layer's shared components use (channels moved to the batch, Keras'
    depthwise convolution having one or two spatial axes) equals a full convolution with an
    identity kernel of ones (the oracle: Keras' `ops.conv`), for every padding, stride and
    dilation."""
    rng = np.random.default_rng(0)
    x = ops.convert_to_tensor(rng.normal(size=(2, 7, 6, 5, 3)).astype("float32"))
    for window, strides, padding, dilation in itertools.product((1, 2, 3), (1, 2), ("valid", "same"), (1, 2)):
        if strides > 1 and dilation > 1:
            continue
        kernel = np.zeros((window,) * 3 + (3, 3), "float32")
        kernel[..., np.arange(3), np.arange(3)] = 1.0
        expected = to_numpy(ops.conv(x, kernel, strides=strides, padding=padding, dilation_rate=dilation))
        got = to_numpy(conv_moments.window_sum(x, window, strides, padding, dilation))
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layer, activation", [
    (lambda a: kd.Conv3DDVI(4, 3, activation=a), None),
    (lambda a: kd.Conv3DDVI(4, 3, activation=a), "relu"),
    (lambda a: kd.Conv3DDVI(4, (3, 2, 2), strides=2, padding="same", activation=a), "relu"),
    (lambda a: kd.Conv3DTransposeDVI(2, 3, strides=2, padding="same", activation=a), "relu"),
], ids=["conv", "conv-relu", "strided", "transposed"])
def test_first_volume_layer_moments_are_exact(layer, activation):
    """A first 3D convolution's (and transposed convolution's) per-position means and
    variances are exact: Monte Carlo over kernels, each shared by every position (through the
    backend's grouped 3D convolution), agrees within its standard errors."""
    x = _volumes(rows=2, size=4)
    model = keras.Sequential([keras.Input(x.shape[1:]), layer(activation)])
    _set_variances(model, 0.5)
    _assert_exact(model, x, 5_000)


@pytest.mark.parametrize("pooling, scale", [("average", 0.3), ("max", 0.03)])
def test_volume_cnn_matches_monte_carlo(pooling, scale):
    """The logits of a 3D CNN on random volumes against 2,000 weight draws, at the layers'
    initial variances or ten times them. Measured over seeds 1-5, both scales and both
    poolings (TensorFlow's initial weights; `benchmarks/experiments/
    new_layers_against_monte_carlo.py`): means within 0.16 sd; variances 0.31-1.13 of Monte
    Carlo's (medians 0.50-1.04; on JAX's initialisations 0.72-1.09). The low end (seed 1, this
    test's on TensorFlow) is the approximation's: a 3x3x3 window sums 27 neighbours whose
    correlations beyond the shared component a keras-dvi map does not carry, as a 2D network
    with 5x5 kernels does (a 3x3 one sums 9). The bounds are set a little outside the
    measured values."""
    keras.utils.set_random_seed(1)
    model = volume_cnn(pooling)
    _set_variances(model, scale)
    x = np.random.default_rng(0).uniform(size=(4, 10, 10, 10, 2)).astype("float32")
    error, ratio = _compare(model, x, 2000)
    assert error.shape == (4, 3)
    assert np.abs(error).max() < 0.2, error
    assert 0.45 < np.median(ratio) < 1.1 and 0.25 < ratio.min() and ratio.max() < 1.15, ratio


def _ct_scan_classifier(width=16, height=16, depth=8):
    """keras.io's "3D image classification from CT scans", with fewer filters and units."""
    layers = keras.layers
    inputs = keras.Input((width, height, depth, 1))
    x = layers.Conv3D(filters=8, kernel_size=3, activation="relu")(inputs)
    x = layers.MaxPool3D(pool_size=2)(x)
    x = layers.BatchNormalization()(x)
    x = layers.Conv3D(filters=8, kernel_size=3, activation="relu", padding="same")(x)
    x = layers.MaxPool3D(pool_size=2, padding="same")(x)
    x = layers.BatchNormalization()(x)
    x = layers.GlobalAveragePooling3D()(x)
    x = layers.Dense(units=16, activation="relu")(x)
    x = layers.Dropout(0.3)(x)
    outputs = layers.Dense(units=1, activation="sigmoid")(x)
    return keras.Model(inputs, outputs, name="3dcnn")


@pytest.mark.heavy  # (a minute on a busy worker: scheduled first, with the other long tests)
def test_kerasio_ct_scan_classifier_converts_trains_and_saves(tmp_path):
    """keras.io's 3D CT-scan classifier converts layer for layer (the ReLUs move onto the max
    poolings, batch normalisation after a pooling becomes `BatchNormalizationDVI`, the sigmoid
    head two logits); at tiny variances it computes the plain probabilities; the Bayesian
    conversion trains, and a `.keras` file predicts the same numbers."""
    from benchmarks.experiments.converted_against_monte_carlo import randomise_batch_norm

    keras.utils.set_random_seed(0)
    plain = _ct_scan_classifier()
    randomise_batch_norm(plain)
    plain.compile("adam", "binary_crossentropy", metrics=["acc"])
    rng = np.random.default_rng(0)
    x = rng.uniform(size=(8, 16, 16, 8, 1)).astype("float32")
    converted = kd.convert(plain, **TINY)
    kinds = [type(layer).__name__ for layer in converted.layers]
    assert kinds[1:] == ["Conv3DDVI", "MaxPooling3DDVI", "BatchNormalizationDVI", "Conv3DDVI", "MaxPooling3DDVI",
                         "BatchNormalizationDVI", "GlobalAveragePooling3DDVI", "DenseDiagDVI", "DenseDVI"], kinds
    assert converted.layers[2].activation == "relu"  # (moved from the convolution to the max)
    probabilities = kd.predict(converted, x)["probabilities"]
    np.testing.assert_allclose(probabilities[:, 1], plain_outputs(plain, x)[:, 0], rtol=1e-5, atol=1e-6)
    bayesian = kd.convert(plain, regularizer=kd.EmpiricalBayesRegularizer(num_train=len(x)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (8 volumes for 2 epochs: the collapse check may speak)
        history = bayesian.fit(x, rng.integers(0, 2, size=(8, 1)), epochs=2, batch_size=4, verbose=0).history
    assert np.all(np.isfinite(history["loss"])) and np.all(np.array(history["kl"]) > 0)
    np.testing.assert_allclose(reloaded(bayesian, tmp_path, "ct").predict(x, verbose=0), bayesian.predict(x, verbose=0),
                               rtol=1e-6, atol=1e-7)


def test_a_3d_unet_converts_whole_and_computes_the_plain_segmentation():
    """A small 3D U-Net (a strided convolution and a max pooling down, a transposed
    convolution and a nearest upsampling up, zero padding and cropping, a skip joined by
    concatenation, spatial dropout, a dense layer per voxel, a per-voxel softmax): every layer
    has its keras-dvi counterpart, and at tiny variances it computes the plain per-voxel
    probabilities."""
    layers = keras.layers
    keras.utils.set_random_seed(2)
    inputs = keras.Input((8, 8, 8, 1))
    skip = layers.Conv3D(4, 3, padding="same", activation="relu")(inputs)
    x = layers.Conv3D(6, 3, strides=2, padding="same", activation="relu")(skip)
    x = layers.MaxPooling3D(2)(layers.SpatialDropout3D(0.2)(x))
    x = layers.Conv3DTranspose(6, 3, strides=2, padding="same", activation="relu")(x)
    x = layers.UpSampling3D(2)(x)
    x = layers.Cropping3D(1)(layers.ZeroPadding3D(1)(x))
    x = layers.Concatenate()([x, skip])
    x = layers.Dense(5, activation="relu")(x)
    plain = keras.Model(inputs, layers.Conv3D(3, 1, activation="softmax")(x))
    plain.compile("adam", "sparse_categorical_crossentropy")
    converted = kd.convert(plain, **TINY)
    kinds = {type(layer).__name__ for layer in converted.layers}
    assert {"Conv3DDVI", "Conv3DTransposeDVI", "MaxPooling3DDVI", "UpSampling3DDVI", "ZeroPadding3DDVI",
            "Cropping3DDVI", "ConcatenateDVI"} <= kinds, kinds
    x = _volumes(rows=2, size=8, channels=1)
    out = kd.predict(converted, x)
    assert out["label"].shape == (2, 8, 8, 8)
    np.testing.assert_allclose(out["probabilities"], plain_outputs(plain, x), rtol=1e-4, atol=1e-5)


def test_volume_layers_round_trip_their_config_and_channels_first_computes_the_same():
    """Every 3D layer's config round trips, its output shape is what it computes, and a
    channels-first 3D network computes what the channels-last one does."""
    layers = [kd.Conv3DDVI(4, (3, 2, 1), strides=(1, 2, 1), padding="same", activation="relu"),
              kd.Conv3DTransposeDVI(3, 2, strides=2, output_padding=1), kd.MaxPooling3DDVI(2, activation="relu"),
              kd.AveragePooling3DDVI((2, 1, 2)), kd.GlobalAveragePooling3DDVI(), kd.GlobalMaxPooling3DDVI(),
              kd.ZeroPadding3DDVI(((1, 0), (0, 2), (1, 1))), kd.Cropping3DDVI(1), kd.UpSampling3DDVI((2, 1, 3))]
    x = _volumes(rows=2, size=6, channels=2)
    first = kd.Conv3DDVI(2, 1, padding="same")
    packed = first(x)
    for layer in layers:
        config = layer.get_config()
        assert type(layer).from_config(config).get_config() == config
        assert keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(layer)).get_config() == config
        assert tuple(layer(packed).shape) == tuple(layer.compute_output_shape(packed.shape)), layer.name
    keras.utils.set_random_seed(3)
    last = keras.Sequential([keras.Input((6, 6, 6, 2)), kd.Conv3DDVI(4, 3, padding="same"),
                             kd.MaxPooling3DDVI(2, activation="relu"),
                             kd.Conv3DTransposeDVI(3, 3, strides=2, padding="same", activation="relu"),
                             kd.UpSampling3DDVI(2)])
    channels_first = keras.Sequential([
        keras.Input((2, 6, 6, 6)), kd.Conv3DDVI(4, 3, padding="same", data_format="channels_first"),
        kd.MaxPooling3DDVI(2, activation="relu", data_format="channels_first"),
        kd.Conv3DTransposeDVI(3, 3, strides=2, padding="same", activation="relu", data_format="channels_first"),
        kd.UpSampling3DDVI(2, data_format="channels_first")])
    _set_variances(last, 0.3)
    channels_first.set_weights(last.get_weights())
    out_first = to_numpy(channels_first(np.moveaxis(x, -1, 1)))
    np.testing.assert_allclose(np.moveaxis(out_first, 2, -1), to_numpy(last(x)), rtol=1e-5, atol=1e-6)
