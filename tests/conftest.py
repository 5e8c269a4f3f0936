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
    previous_policy = keras.config.dtype_policy()
    yield
    keras.config.set_floatx(previous)
    keras.config.set_dtype_policy(previous_policy)


@pytest.fixture(params=["float32", "float64"])
def floatx(request):
    """Runs a test in float32 and float64 (default float and layer dtype policy)."""
    keras.config.set_floatx(request.param)
    keras.config.set_dtype_policy(request.param)
    return request.param


def to_numpy(x):
    return np.asarray(keras.ops.convert_to_numpy(x))
