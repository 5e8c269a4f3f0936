"""Saving: a compiled model round-trips a `.keras` file into a fresh process, and files saved by
earlier keras-dvi 0.1.0.dev0 code still load, predict the same numbers and train on: files from before the layers had a `kl_step` counter and the priors a KL schedule,
and files from before the `"auto"` warm-up (with `kl_step`, without `kl_warmup_length`).

The files `tests/data/v0.1.0.dev0_*` were written at commit a14b115 by training small
regression, MCVI and global-inducing networks (`v0.1.0.dev0_expected.npz`: their inputs and
predictions); `tests/data/v0.1.0.dev0-kl_step_*` at commit 78098a0 by training a regression
network for 4 steps with the then-default 3,000-step warm-up; `tests/data/v0.1.0.dev0-tagi_*` at
commit 9b46395, a TAGI classifier from before it logged `observation_nll`."""

import os
import subprocess
import sys
import warnings

import keras
import numpy as np
import pytest

import keras_dvi as kd
from tests.conftest import to_numpy

DATA = os.path.join(os.path.dirname(__file__), "data")


def _load(name):
    return keras.saving.load_model(os.path.join(DATA, f"v0.1.0.dev0_{name}.keras"), safe_mode=True)


@pytest.fixture(scope="module")
def expected():
    return np.load(os.path.join(DATA, "v0.1.0.dev0_expected.npz"))


def test_regression_model_predicts_the_same_and_trains_on(expected):
    model = _load("regression")
    np.testing.assert_allclose(model.predict(expected["x"], verbose=0), expected["regression"], rtol=1e-6, atol=1e-7)
    assert [float(to_numpy(layer.kl_step)) for layer in model.layers[:3]] == [0.0] * 3
    prior = model.layers[0].regularizer  # an old config: the ELBO it trained, the default warm-up
    assert prior.kl_weight == 1.0 and prior.kl_warmup_steps == kd.priors.DEFAULT_KL_WARMUP_STEPS
    history = model.fit(expected["x"], expected["y"], epochs=2, batch_size=8, verbose=0).history
    assert np.isfinite(history["loss"]).all() and set(history) >= {"loss", "nll", "kl"}
    assert float(to_numpy(model.layers[0].kl_step)) == 4.0


def test_mcvi_and_global_inducing_models_load(expected):
    mcvi = _load("mcvi")
    np.testing.assert_array_equal(to_numpy(mcvi.layers[0].kernel_mean), expected["mcvi_kernel"])
    mcvi.fit(expected["x"], expected["labels"], epochs=1, batch_size=8, verbose=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the loaders of the former names are silent
        gi = _load("global_inducing")  # compiled with the loss's former name, SampledGaussianELL
    assert isinstance(gi.loss, kd.SampledHeteroscedasticELL)
    first = gi.layers[0]  # saved with the former `prior=` / `num_train=` arguments
    assert isinstance(first.regularizer, kd.NealPrior) and first.num_train == 16
    kd.set_sampling_seed(gi, 7)
    samples = kd.predict_samples(gi, expected["x"], 4)
    if keras.backend.backend() == "tensorflow":  # the file's draws were TensorFlow's random numbers
        np.testing.assert_allclose(samples, expected["gi_samples"], rtol=1e-5, atol=1e-6)
    assert samples.shape == expected["gi_samples"].shape and np.isfinite(samples).all()


def test_a_file_from_before_the_auto_warm_up_resumes_its_schedule():
    model = keras.saving.load_model(os.path.join(DATA, "v0.1.0.dev0-kl_step_regression.keras"), safe_mode=True)
    expected = np.load(os.path.join(DATA, "v0.1.0.dev0-kl_step_expected.npz"))
    np.testing.assert_allclose(model.predict(expected["x"], verbose=0), expected["regression"], rtol=1e-6, atol=1e-7)
    layer = model.layers[0]
    assert layer.regularizer.kl_warmup_steps == 3000  # saved in its config: the schedule it trained with
    assert float(to_numpy(layer.kl_step)) == 4.0 and float(to_numpy(layer.kl_warmup_length)) == 0.0
    assert float(to_numpy(layer.kl_term.weight(training=True))) == pytest.approx(5 / 3000)
    model.fit(expected["x"], expected["y"], epochs=1, batch_size=8, verbose=0)
    assert float(to_numpy(layer.kl_step)) == 6.0


def test_a_tagi_classifier_from_before_observation_nll_loads_and_logs_it():
    model = keras.saving.load_model(os.path.join(DATA, "v0.1.0.dev0-tagi_classifier.keras"), safe_mode=True)
    expected = np.load(os.path.join(DATA, "v0.1.0.dev0-tagi_expected.npz"))
    assert isinstance(model, kd.TAGIModel) and model.classes == 4
    np.testing.assert_allclose(model.predict(expected["x"], verbose=0), expected["outputs"], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(kd.predict(model, expected["x"])["probabilities"], expected["probabilities"],
                               rtol=1e-5, atol=1e-7)
    logs = model.evaluate(expected["x"], expected["labels"], verbose=0, return_dict=True)
    assert set(logs) == {"nll", "accuracy", "observation_nll"} and np.isfinite(list(logs.values())).all()
    model.fit(expected["x"], expected["labels"], batch_size=8, epochs=1, verbose=0)  # trains on


def test_compiled_model_saves_and_loads_in_a_fresh_process(tmp_path):
    rng = np.random.default_rng(12)
    x = rng.normal(size=(64, 2)).astype("float32")
    y = rng.normal(size=(64,)).astype("float32")
    model = keras.Sequential(
        [
            keras.Input((2,)),
            kd.DenseDVI(8, "relu", regularizer=kd.EmpiricalBayesRegularizer(64, alpha=2.0, beta=3.0)),
            kd.DenseDVI(1, regularizer=kd.GaussianPriorRegularizer(64, 0.5)),
            kd.HomoscedasticNoise(-1.0),
        ]
    )
    model.compile(keras.optimizers.Adam(1e-2), loss=kd.HeteroscedasticELL())
    model.fit(x, y, epochs=2, verbose=0)
    path = tmp_path / "model.keras"
    model.save(path)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    before = model.predict(x, verbose=0)
    loss_before = model.evaluate(x, y, verbose=0, return_dict=True)
    loaded = keras.saving.load_model(path, safe_mode=True)
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), before)
    assert isinstance(loaded.layers[0].regularizer, kd.EmpiricalBayesRegularizer)
    assert loaded.layers[0].regularizer.alpha == 2.0
    script = (
        "import keras, numpy as np, sys\n"
        "import keras_dvi  # registers the classes\n"
        f"m = keras.saving.load_model(r'{path}', safe_mode=True)\n"
        f"x = np.load(r'{tmp_path / 'x.npy'}'); y = np.load(r'{tmp_path / 'y.npy'}')\n"
        f"np.save(r'{tmp_path / 'out.npy'}', m.predict(x, verbose=0))\n"
        "r = m.evaluate(x, y, verbose=0, return_dict=True)\n"
        "print(r['loss'], r['nll'], r['kl'])\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=300)
    np.testing.assert_array_equal(np.load(tmp_path / "out.npy"), before)
    loss, nll, kl = (float(v) for v in out.stdout.split()[-3:])
    np.testing.assert_allclose([loss, nll, kl], [loss_before["loss"], loss_before["nll"], loss_before["kl"]], rtol=1e-5)
