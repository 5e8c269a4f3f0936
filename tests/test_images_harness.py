"""The MNIST CNN benchmark's helpers (`benchmarks/images.py`, `benchmarks/experiments/cnn_noise_check.py`)."""

import keras
import numpy as np

import keras_dvi as kd
from benchmarks import images
from benchmarks.experiments import cnn_noise_check


def test_mean_network_computes_the_dvi_cnns_posterior_mean_function():
    """`cnn_noise_check.mean_network`: a plain CNN holding the DVI CNN's posterior means. With
    every weight variance shrunk to ~0 the DVI CNN's closed-form logit means are that
    function, so the two must agree; with the variances left as built they must not (the
    ReLUs' means grow with their inputs' variances), which shows the check can fail."""
    keras.utils.set_random_seed(3)
    model = images.keras_dvi_cnn("dvi", 10, 1000)
    x = np.random.default_rng(0).uniform(0, 1, (4, 28, 28, 1)).astype("float32")
    for layer in model.layers:  # spread the means so that the maxima and ReLUs have work to do
        for weight in layer.weights:
            if "mean" in weight.path:
                value = keras.ops.convert_to_numpy(weight)
                weight.assign(value + np.random.default_rng(1).normal(0, 0.1, value.shape).astype(value.dtype))
    plain_logits = cnn_noise_check.mean_network(model).predict(x, verbose=0)
    built, _ = kd.unpack(model.predict(x, verbose=0), covariance="diagonal")
    assert np.max(np.abs(np.asarray(built) - plain_logits)) > 1e-2
    for layer in model.layers:
        for weight in layer.weights:
            if "log_std" in weight.path:
                weight.assign(np.full(weight.shape, -12.0, dtype=weight.dtype))
    mean, variance = kd.unpack(model.predict(x, verbose=0), covariance="diagonal")
    assert np.max(np.asarray(variance)) < 1e-6
    np.testing.assert_allclose(np.asarray(mean), plain_logits, rtol=1e-4, atol=1e-4)


def test_mean_network_of_the_dense_rows_matches_their_closed_form_without_weight_noise():
    """The same check for `images.py`'s dense rows (784-W-W-10 `DenseDiagDVI` / `DenseDVI`)."""
    keras.utils.set_random_seed(4)
    model = images.keras_dvi_cnn("dense100", 10, 1000)
    x = np.random.default_rng(2).uniform(0, 1, (4, 28, 28, 1)).astype("float32")
    for layer in model.layers:
        for weight in layer.weights:
            if "log_std" in weight.path:
                weight.assign(np.full(weight.shape, -12.0, dtype=weight.dtype))
    mean, _ = kd.unpack(model.predict(x, verbose=0), covariance="diagonal")
    np.testing.assert_allclose(np.asarray(mean), cnn_noise_check.mean_network(model).predict(x, verbose=0),
                               rtol=1e-4, atol=1e-4)


def test_pixel_groups_split_the_weight_noise_by_how_often_pixels_are_used():
    """`cnn_noise_check.pixel_groups` against a hand count: pixel 0 never used in training,
    pixel 1 in 1 of 200 images (rarely), pixels 2-3 always; on an all-ones input the shares are
    the groups' summed kernel variances over the total."""
    x_train = np.zeros((200, 4), dtype="float32")
    x_train[:, 2:] = 1.0
    x_train[0, 1] = 1.0
    kernel_variance = np.array([[1.0, 3.0], [2.0, 2.0], [0.5, 0.5], [1.0, 0.0]])
    groups = cnn_noise_check.pixel_groups(x_train, np.ones((3, 4)), kernel_variance)
    total = kernel_variance.sum()
    expected = {"never": (1, 2.0, 4.0), "rarely": (1, 2.0, 4.0), "often": (2, 0.5, 2.0)}
    for name, (count, median, share) in expected.items():
        assert groups[name][:2] == (count, median)
        assert np.isclose(groups[name][2], share / total)
    digits_only = cnn_noise_check.pixel_groups(x_train, x_train[1:], kernel_variance)
    assert digits_only["never"][2] == 0.0 and digits_only["rarely"][2] == 0.0


def test_plain_dense_rows_are_the_dvi_dense_rows_shape_without_the_bayesian_layers():
    """`images.py --methods dense100_plain`: a plain Keras 784-100-100-10 network (as many
    weights as the DVI row's means), trained and predicting probabilities."""
    assert [images.dense_width(m) for m in ("dense100", "dense800_tempered", "dense800_plain")] == [100, 800, 800]
    model = images.plain_dense(10, 100)
    dvi = images.keras_dvi_cnn("dense100", 10, 100)
    assert model.count_params() == sum(int(np.prod(layer.kernel_mean.shape)) + int(np.prod(layer.bias_mean.shape))
                                       for layer in dvi.layers if hasattr(layer, "kernel_mean"))
    x = np.random.default_rng(0).uniform(0, 1, (64, 28, 28, 1)).astype("float32")
    predict, _ = images.train("dense100_plain", x, np.arange(64) % 10, 10, 0, 1)
    probabilities = predict(x[:5])
    assert probabilities.shape == (5, 10)
    np.testing.assert_allclose(probabilities.sum(-1), 1.0, rtol=1e-5)
