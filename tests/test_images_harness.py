"""The MNIST CNN benchmark's helpers (`benchmarks/images.py`, `benchmarks/cnn_noise_check.py`)."""

import keras
import numpy as np

import keras_dvi as kd
from benchmarks import cnn_noise_check, images


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
