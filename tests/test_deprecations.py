"""Former names still work, warn with a DeprecationWarning naming the replacement, and compute
exactly what their replacements compute."""

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
