import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _seed_and_floatx():
    """Every test starts from the same seeds and float32 default."""
    keras.utils.set_random_seed(1234)
    previous = keras.config.floatx()
    yield
    keras.config.set_floatx(previous)


@pytest.fixture(params=["float32", "float64"])
def floatx(request):
    keras.config.set_floatx(request.param)
    return request.param


def to_numpy(x):
    return np.asarray(keras.ops.convert_to_numpy(x))
