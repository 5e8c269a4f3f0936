"""Former names still work, warn with a DeprecationWarning naming the replacement, and compute
exactly what their replacements compute."""

import warnings

import keras
import numpy as np
import pytest

import keras_dvi as kd
from keras_dvi import predictive
from tests.conftest import to_numpy


def _samples(seed=0, batch=6, samples=5, units=4):
    return np.random.default_rng(seed).normal(size=(batch, samples, units)).astype("float32")


def test_sampled_gaussian_ell_is_sampled_heteroscedastic_ell():
    y, out = np.random.default_rng(1).normal(size=(6, 2)).astype("float32"), _samples()
    with pytest.warns(DeprecationWarning, match=r"keras_dvi\.SampledGaussianELL is deprecated.*SampledHeteroscedasticELL"):
        old = kd.SampledGaussianELL()
    assert isinstance(old, kd.SampledHeteroscedasticELL)
    np.testing.assert_array_equal(to_numpy(old(y, out)), to_numpy(kd.SampledHeteroscedasticELL()(y, out)))


@pytest.mark.parametrize("old, new, args", [
    ("sample_regression_moments", "sampled_regression_moments", ()),
    ("sample_log_predictive_density", "sampled_log_predictive_density", (np.zeros((6, 2), "float32"),)),
    ("sample_class_probabilities", "sampled_class_probabilities", ()),
])
def test_former_sample_functions_of_predictive(old, new, args):
    with pytest.warns(DeprecationWarning, match=rf"predictive\.{old} is deprecated.*predictive\.{new}"):
        got = getattr(predictive, old)(_samples(), *args)
    want = getattr(predictive, new)(_samples(), *args)
    for key in (got if isinstance(got, dict) else [None]):
        a, b = (got, want) if key is None else (got[key], want[key])
        np.testing.assert_array_equal(to_numpy(a), to_numpy(b))


def test_global_inducing_prior_and_num_train_arguments():
    """`GlobalInducingDense(prior=..., num_train=N)` is `regularizer=<that prior>(num_train=N)`."""
    with pytest.warns(DeprecationWarning, match=r"regularizer=keras_dvi\.NealPrior\(num_train"):
        old = kd.GlobalInducingDense(3, num_inducing=4, num_train=20, prior="standard")
    assert isinstance(old.regularizer, kd.StandardPrior) and old.num_train == 20
    new = kd.GlobalInducingDense(3, num_inducing=4, regularizer=kd.StandardPrior(num_train=20))
    assert old.get_config() == {**new.get_config(), "name": old.name}
    with pytest.raises(ValueError, match="not also in the deprecated"):
        kd.GlobalInducingDense(3, num_train=20, regularizer=kd.NealPrior(20))
    # A configuration saved with the former arguments loads, silently, into the new form.
    config = {**new.get_config(), "num_train": 20, "prior": {"module": "keras_dvi.priors", "class_name": "NealPrior",
                                                             "config": {}, "registered_name": "keras_dvi>NealPrior"}}
    del config["regularizer"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loaded = kd.GlobalInducingDense.from_config(config)
    assert isinstance(loaded.regularizer, kd.NealPrior) and loaded.num_train == 20
    model = keras.Sequential([keras.Input((2,)), loaded, kd.GlobalInducingDense(1, output_layer=True)])
    assert model.layers[1].num_train == 20
