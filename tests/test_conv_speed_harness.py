"""The convolution speed benchmark (`benchmarks/conv_speed.py`): its networks and its tables."""

import warnings

import numpy as np

import keras_dvi as kd
from benchmarks import conv_speed


def test_networks_convert_to_the_bayesian_networks_timed():
    """Both networks convert (batch normalisation folded, ReLUs moved onto the pooling and
    addition layers) and predict packed moments of the right shape."""
    layer_types = {}
    for network, spec in conv_speed.NETWORKS.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = conv_speed.build(network, "dvi")
        layer_types[network] = [type(layer).__name__ for layer in model.layers]
        x, _ = conv_speed.data(network, 2)
        assert x.shape == (2,) + spec["shape"]
        mean, covariance = (np.asarray(t) for t in kd.unpack(model.predict_on_batch(x)))
        assert mean.shape == (2, 10) and covariance.shape == (2, 10, 10) and np.all(np.isfinite(mean))
        assert np.all(np.diagonal(covariance, axis1=1, axis2=2) > 0)
    assert layer_types["mnist_convnet"][:4] == ["Conv2DDVI", "MaxPooling2DDVI", "Conv2DDVI", "MaxPooling2DDVI"]
    resnet = layer_types["resnet20"]
    # 19 3x3 convolutions and 2 projection shortcuts, 9 residual additions, no batch normalisation
    assert resnet.count("Conv2DDVI") == 21 and resnet.count("AddDVI") == 9
    assert not any("Normalization" in name for name in resnet)
    assert conv_speed.resnet20().count_params() > 270_000  # He et al.'s 0.27M parameters


def test_summary_gives_ratios_and_layer_increments():
    record = {"backend": "tensorflow", "threads": 1, "label": "after", "operations": {"plain relu": 0.002},
              "networks": [{"network": "mnist_convnet", "predict_rows": 1024, "train_rows": 128,
                            "plain predict": 0.1, "dvi predict": 0.25, "plain train": 0.05, "dvi train": 0.2,
                            "layers": [{"system": "dvi", "layer": "conv", "type": "Conv2DDVI", "seconds": 0.1},
                                       {"system": "dvi", "layer": "pool", "type": "MaxPooling2DDVI", "seconds": 0.25}]}]}
    text = conv_speed.summary([record])
    assert "| 100.0 | 250.0 | 2.50x | 50.0 | 200.0 | 4.00x |" in text
    assert "| dvi | pool | MaxPooling2DDVI | 250.0 | +150.0 |" in text
    assert "| plain relu | 2.0 |" in text


def test_interleaved_times_every_function_and_takes_the_median():
    calls = []
    times = conv_speed.interleaved({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, rounds=3, warmup=1)
    assert calls == ["a", "b"] + ["a", "b"] * 3  # warm-up, then rounds that alternate
    assert set(times) == {"a", "b"} and all(t >= 0.0 for t in times.values())
