"""`DenseMCVI`, the Monte Carlo baseline, against closed forms and Monte Carlo error bounds."""

import math

import keras
import numpy as np
import pytest
from keras import ops

import keras_dvi as kd
from keras_dvi import predictive
from tests.conftest import reloaded


def _layer(local, units=3, seed=0, **kwargs):
    layer = kd.DenseMCVI(units, num_samples=20000, local_reparameterization=local, seed=seed, **kwargs)
    layer.build((None, 4))
    rng = np.random.default_rng(1)
    layer.set_posterior(
        rng.standard_normal((4, units)), rng.uniform(0.05, 0.5, (4, units)),
        rng.standard_normal(units), rng.uniform(0.05, 0.3, units),
    )
    return layer


@pytest.mark.parametrize("local", [False, True])
def test_one_layer_samples_match_the_closed_form(local):
    """For deterministic inputs, `x W + b` is exactly `N(x M + m_b, x^2 V + v_b)`."""
    layer = _layer(local)
    x = np.array([[1.0, -2.0, 0.5, 0.0], [0.3, 0.3, -1.0, 2.0]], dtype="float32")
    out = ops.convert_to_numpy(layer(x))  # (2, S, 3)
    mean = x @ ops.convert_to_numpy(layer.kernel_mean) + ops.convert_to_numpy(layer.bias_mean)
    var = x**2 @ ops.convert_to_numpy(layer.kernel_variance) + ops.convert_to_numpy(layer.bias_variance)
    n = out.shape[1]
    assert np.all(np.abs(out.mean(axis=1) - mean) < 5 * np.sqrt(var / n))
    assert np.all(np.abs(out.var(axis=1) / var - 1) < 5 * math.sqrt(2 / n))


@pytest.mark.parametrize("local", [False, True])
def test_weight_draws_are_shared_across_the_batch_only_without_local_reparameterization(local):
    layer = _layer(local)
    x = np.ones((2, 4), dtype="float32")  # two identical rows
    out = ops.convert_to_numpy(layer(x))
    if local:
        corr = np.corrcoef(out[0, :, 0], out[1, :, 0])[0, 1]
        assert abs(corr) < 5 / math.sqrt(out.shape[1])  # independent draws per example
    else:
        np.testing.assert_array_equal(out[0], out[1])  # one function per sample


def test_kl_is_the_priors_closed_form_over_n():
    prior = kd.EmpiricalBayesRegularizer(num_train=50)
    layer = _layer(False, regularizer=prior)
    layer(np.ones((2, 4), dtype="float32"))
    (loss,) = layer.losses
    total = 0.0
    for mean, var in ((layer.kernel_mean, layer.kernel_variance), (layer.bias_mean, layer.bias_variance)):
        mean, var = ops.convert_to_numpy(mean).astype(float), ops.convert_to_numpy(var).astype(float)
        s = (np.sum(var + mean**2) + 20.0) / (mean.size + 4.0)  # eq. 13, alpha = 1, beta = 10
        total += 0.5 * np.sum(np.log(s / var) - 1 + (var + mean**2) / s)
    assert float(ops.convert_to_numpy(loss)) == pytest.approx(total / 50, rel=1e-5)


def test_trains_saves_and_predicts_samples(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.uniform(-1, 1, (128, 1)).astype("float32")
    y = (np.sin(3 * x) + 0.1 * rng.standard_normal(x.shape)).astype("float32")
    prior = kd.EmpiricalBayesRegularizer(128)
    model = keras.Sequential([
        keras.Input((1,)),
        kd.DenseMCVI(32, "relu", num_samples=4, regularizer=prior, seed=1),
        kd.DenseMCVI(2, regularizer=prior, seed=2, local_reparameterization=True),
    ])
    model.compile(keras.optimizers.Adam(1e-2), loss=kd.SampledHeteroscedasticELL())
    history = model.fit(x, y, epochs=60, batch_size=32, verbose=0).history
    # The KL weight rises over the run (auto warm-up), so the fit term shows the learning.
    assert np.isfinite(history["loss"]).all() and history["nll"][-1] < history["nll"][0] - 0.5
    samples = kd.predict_samples(model, x, 50)
    assert samples.shape == (128, 50, 2)
    assert float(np.mean(predictive.sampled_log_predictive_density(samples, y))) > 0.0  # noise sd 0.1
    loaded = reloaded(model, tmp_path, "mcvi")
    for a, b in zip(model.weights, loaded.weights):
        np.testing.assert_array_equal(ops.convert_to_numpy(a), ops.convert_to_numpy(b))
    assert loaded.layers[1].local_reparameterization and loaded.layers[0].num_samples == 4


def test_config_and_errors():
    layer = kd.DenseMCVI(5, "relu", num_samples=3, local_reparameterization=True, seed=4)
    config = layer.get_config()
    assert kd.DenseMCVI.from_config(config).get_config() == config
    with pytest.raises(ValueError, match="num_samples"):
        kd.DenseMCVI(5, num_samples=0)
    with pytest.raises(ValueError, match="units"):
        kd.DenseMCVI(0)
    with pytest.raises(ValueError, match="inputs"):
        kd.DenseMCVI(2)(np.array([[np.inf, 0.0]], dtype="float32"))


def test_predict_summarises_a_sampled_model():
    """`keras_dvi.predict` on an MCVI regression network: Monte Carlo moments of its samples."""
    rng = np.random.default_rng(31)
    x = rng.normal(size=(30, 2)).astype("float32")
    y = (3.0 * x[:, 0]).astype("float32")
    prior = kd.EmpiricalBayesRegularizer(30)
    model = keras.Sequential([keras.Input((2,)), kd.DenseMCVI(8, "relu", num_samples=4, regularizer=prior, seed=1),
                              kd.DenseMCVI(2, regularizer=prior, seed=2)])
    model.compile(keras.optimizers.Adam(1e-2), loss=kd.SampledHeteroscedasticELL())
    model.fit(x, y, epochs=2, verbose=0)
    out = kd.predict(model, x, num_samples=2000)
    assert out["mean"].shape == (30, 1) and np.isfinite(out["std"]).all()
    np.testing.assert_allclose(out["variance"], out["epistemic"] + out["aleatoric"], rtol=1e-5)
    assert (out["epistemic"] > 0).all() and (out["lower"] < out["mean"]).all()
