"""XLA, tf.distribute.MirroredStrategy (two logical CPUs) and determinism."""

import subprocess
import sys
import textwrap

import keras
import numpy as np

from keras_dvi import DenseDiagDVI, DenseDVI, EmpiricalBayesRegularizer, HeteroscedasticELL, SkipDVI

COMMON = """
import os
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
import numpy as np
import tensorflow as tf
import keras
from keras_dvi import DenseDVI, DenseDiagDVI, EmpiricalBayesRegularizer, HeteroscedasticELL

rng = np.random.default_rng(0)
x = rng.normal(size=(256, 3)).astype("float32")
y = (x[:, 0] * x[:, 1] + 0.1 * rng.normal(size=256)).astype("float32")

def build():
    prior = EmpiricalBayesRegularizer(num_train=256)
    model = keras.Sequential([
        keras.Input((3,)),
        DenseDiagDVI(16, "relu", regularizer=prior),
        DenseDVI(16, "relu", regularizer=prior),
        DenseDVI(2, regularizer=prior),
    ])
    model.compile(keras.optimizers.SGD(0.05), loss=HeteroscedasticELL())
    return model
"""


def _run(script):
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(COMMON) + textwrap.dedent(script)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def _model():
    """Both covariance methods in one network (one XLA compilation): the second layer (its
    input covariance is diagonal, its pre-activations correlated) uses the paper's
    approximation, the skip layer (full input covariance) the exact Owen's T form."""
    prior = EmpiricalBayesRegularizer(num_train=128)
    return keras.Sequential(
        [
            keras.Input((3,)),
            DenseDVI(8, "relu", regularizer=prior),
            DenseDVI(8, "relu", covariance_approximation="paper", regularizer=prior),
            SkipDVI("relu", covariance_approximation="exact", regularizer=prior),
            DenseDiagDVI(8, "relu", regularizer=prior),
            DenseDVI(2, regularizer=prior),
        ]
    )


def test_xla_compiled_training_matches_uncompiled():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(128, 3)).astype("float32")
    y = rng.normal(size=(128,)).astype("float32")
    results = []
    for jit in (False, True):
        keras.utils.set_random_seed(5)
        model = _model()
        model.compile(keras.optimizers.SGD(0.01), loss=HeteroscedasticELL(), jit_compile=jit)
        history = model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0).history
        results.append((history, model.get_weights(), model.predict(x, verbose=0)))
    (h0, w0, p0), (h1, w1, p1) = results
    for key in ("loss", "nll", "kl"):
        np.testing.assert_allclose(h1[key], h0[key], rtol=1e-4)
    for a, b in zip(w0, w1):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(p1, p0, rtol=1e-4, atol=1e-6)


def test_mirrored_strategy_on_two_cpus_matches_single_device():
    out = _run(
        """
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

        def train(strategy):
            keras.utils.set_random_seed(0)
            with strategy.scope():
                model = build()
            history = model.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0).history
            return model.get_weights(), history

        w1, h1 = train(tf.distribute.get_strategy())
        strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
        assert strategy.num_replicas_in_sync == 2
        w2, h2 = train(strategy)
        for key in ("loss", "nll", "kl"):
            np.testing.assert_allclose(h2[key], h1[key], rtol=1e-5)
        for a, b in zip(w1, w2):
            np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
        print("OK", h1["kl"][-1], h2["kl"][-1])
        """
    )
    assert out.startswith("OK")


def test_seeded_training_is_deterministic():
    out = _run(
        """
        tf.config.experimental.enable_op_determinism()
        weights = []
        for _ in range(2):
            keras.utils.set_random_seed(3)
            model = build()
            model.fit(x, y, batch_size=32, epochs=2, verbose=0)
            weights.append(model.get_weights())
        for a, b in zip(*weights):
            np.testing.assert_array_equal(a, b)
        print("OK")
        """
    )
    assert out.startswith("OK")
