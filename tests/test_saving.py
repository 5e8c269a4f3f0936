"""Saving: a compiled model round-trips a `.keras` file into a fresh process, and files saved by
the keras-dvi 0.1.0 release load, predict the same numbers and train on.

The files `tests/data/v0.1.0_*` were written by `tests/data/write_v0_1_0.py` with the 0.1.0
release (commit fdff30e): a regression network (empirical Bayes, the `"auto"` warm-up), a CNN
classifier, a Monte Carlo network, a global inducing network and a TAGI classifier, each trained
for a few steps, with their inputs and outputs in `v0.1.0_expected.npz`. (Files of the
development versions before 0.1.0 no longer load: no release wrote them.)"""

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
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # loads silently
        model = keras.saving.load_model(os.path.join(DATA, f"v0.1.0_{name}.keras"), safe_mode=True)
    if keras.backend.backend() == "jax":
        # TensorFlow wrote the files on a CPU, where compile's "auto" saves `jit_compile=False`;
        # JAX then runs every operation on its own, each compiled separately (a minute for these
        # tests). Compiled steps, as `compile` gives on JAX:
        model.jit_compile = True
    return model


@pytest.fixture(scope="module")
def expected():
    return np.load(os.path.join(DATA, "v0.1.0_expected.npz"))


def test_dvi_files_of_0_1_0_predict_the_same_and_resume_their_schedule(expected):
    regression = _load("regression")
    np.testing.assert_allclose(regression.predict(expected["x"], verbose=0), expected["regression"], rtol=1e-6, atol=1e-7)
    first = regression.layers[0]
    assert isinstance(first.regularizer, kd.EmpiricalBayesRegularizer) and first.regularizer.kl_warmup_steps == "auto"
    # 2 epochs of 2 steps; the "auto" warm-up planned 3/4 of fit's 4 steps
    assert float(to_numpy(first.kl_step)) == 4.0 and float(to_numpy(first.kl_warmup_length)) == 3.0
    history = regression.fit(expected["x"], expected["y"], epochs=1, batch_size=8, verbose=0).history
    assert np.isfinite(history["loss"]).all() and set(history) >= {"loss", "nll", "kl"}
    assert float(to_numpy(first.kl_step)) == 6.0
    cnn = _load("cnn")
    assert [type(layer).__name__ for layer in cnn.layers] == ["Conv2DDVI", "MaxPooling2DDVI", "FlattenDVI", "DenseDVI"]
    np.testing.assert_allclose(cnn.predict(expected["images"], verbose=0), expected["cnn"], rtol=1e-5, atol=1e-6)
    assert np.isfinite(cnn.fit(expected["images"], expected["labels"], epochs=1, batch_size=8, verbose=0).history["loss"]).all()


def test_monte_carlo_and_global_inducing_files_of_0_1_0_load_and_train_on(expected):
    mcvi = _load("mcvi")
    np.testing.assert_array_equal(to_numpy(mcvi.layers[0].kernel_mean), expected["mcvi_kernel"])
    assert isinstance(mcvi.loss, kd.SampledSoftmaxELL)
    mcvi.fit(expected["x"], expected["labels"], epochs=1, batch_size=8, verbose=0)
    gi = _load("global_inducing")
    assert isinstance(gi.loss, kd.SampledHeteroscedasticELL)
    assert isinstance(gi.layers[0].regularizer, kd.NealPrior) and gi.layers[0].num_train == 16
    kd.set_sampling_seed(gi, 7)
    samples = kd.predict_samples(gi, expected["x"], 4)
    assert samples.shape == expected["gi_samples"].shape and np.isfinite(samples).all()
    if keras.backend.backend() == "tensorflow":  # the file's draws were TensorFlow's random numbers
        np.testing.assert_allclose(samples, expected["gi_samples"], rtol=1e-4, atol=1e-4)
    gi.fit(expected["x"], expected["y"], epochs=1, batch_size=8, verbose=0)


def test_a_tagi_classifier_of_0_1_0_loads_predicts_and_trains_on(expected):
    model = _load("tagi_classifier")
    assert isinstance(model, kd.TAGIModel) and model.classes == 3
    np.testing.assert_allclose(model.predict(expected["x"], verbose=0), expected["tagi_outputs"], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(kd.predict(model, expected["x"])["probabilities"], expected["tagi_probabilities"],
                               rtol=1e-5, atol=1e-7)
    logs = model.evaluate(expected["x"], expected["labels"], verbose=0, return_dict=True)
    assert set(logs) == {"nll", "accuracy", "observation_nll"} and np.isfinite(list(logs.values())).all()
    model.fit(expected["x"], expected["labels"], batch_size=8, epochs=1, verbose=0)


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
