"""XLA, tf.distribute.MirroredStrategy (two logical CPUs) and determinism."""

import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest

from keras_dvi import DenseDiagDVI, DenseDVI, EmpiricalBayesRegularizer, HeteroscedasticELL, SkipDVI
from tests.test_backends import jax_env

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


def _run(script, env=None):
    """Runs `COMMON` then `script` (each dedented) in a fresh Python; returns its output."""
    common = COMMON if (env or {}).get("KERAS_BACKEND", "tensorflow") == "tensorflow" else \
        COMMON.replace("import tensorflow as tf\n", "")
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(common) + textwrap.dedent(script)],
        env=env,
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


#: A converted residual network (batch normalisation folded, `Add`, ReLU layers, global
#: pooling, a softmax head): what `keras_dvi.convert` makes of a ResNet, small enough to train
#: in seconds (issue 49, item 7; `benchmarks/backbones.py` has the ResNet-20 figures).
CONVERTED = """
import keras_dvi as kd

rng = np.random.default_rng(0)
images = rng.uniform(size=(64, 8, 8, 1)).astype("float32")
labels = (np.arange(64) % 3).astype("int32")

def converted():
    inputs = keras.Input((8, 8, 1))
    h = keras.layers.Conv2D(4, 3, padding="same", use_bias=False)(inputs)
    h = keras.layers.ReLU()(keras.layers.BatchNormalization()(h))
    branch = keras.layers.Conv2D(4, 3, padding="same", use_bias=False)(h)
    branch = keras.layers.BatchNormalization()(branch)
    h = keras.layers.ReLU()(keras.layers.Add()([h, branch]))
    h = keras.layers.GlobalAveragePooling2D()(h)
    plain = keras.Model(inputs, keras.layers.Dense(3, activation="softmax")(h))
    model = kd.convert(plain, regularizer=kd.EmpiricalBayesRegularizer(num_train=64))
    model.compile(keras.optimizers.SGD(0.05), loss=kd.SoftmaxDeltaELL())
    return model

def totals(model):
    # The last epoch's means of the tracker's fields (its totals sum over the replicas): the
    # unweighted nll of a classifier's collapse check among them. (Its information and spread
    # are statistics of each replica's half batch, and differ a little.)
    tracker = next(layer.elbo_tracker for layer in model.layers if getattr(layer, "elbo_tracker", None) is not None)
    t = dict(zip(tracker.FIELDS, keras.ops.convert_to_numpy(tracker.totals)))
    classified = [t[f] / max(t["classified_steps"], 1) for f in ("log_classes", "classified_nll")]
    return np.array([t["nll"] / t["steps"], t["kl"] / t["steps"]] + classified)

def compare(one, two):
    (w1, h1, p1, t1), (w2, h2, p2, t2) = one, two
    for key in ("loss", "nll", "kl"):
        np.testing.assert_allclose(h2[key], h1[key], rtol=1e-5)
    np.testing.assert_allclose(t2, t1, rtol=1e-5, atol=1e-6)
    for a, b in zip(w1, w2):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(p2, p1, rtol=1e-5, atol=1e-6)
    print("OK", h1["loss"], h2["loss"])
"""


def test_mirrored_strategy_on_two_cpus_matches_single_device():
    """A dense network and a converted residual network train to the same losses, `nll` /
    `kl` logs, collapse-check totals, weights and predictions on two logical CPUs under
    `tf.distribute.MirroredStrategy` as on one device (each replica computes half of every
    batch; the gradients are summed)."""
    out = _run(CONVERTED + textwrap.dedent("""
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

        def train(strategy, make, inputs, targets, batch_size):
            keras.utils.set_random_seed(0)
            with strategy.scope():
                model = make()
            history = model.fit(inputs, targets, batch_size=batch_size, epochs=2, shuffle=False, verbose=0).history
            return model.get_weights(), history, model.predict(inputs, verbose=0), totals(model)

        strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
        assert strategy.num_replicas_in_sync == 2
        for network in [(build, x, y, 64), (converted, images, labels, 16)]:
            compare(train(tf.distribute.get_strategy(), *network), train(strategy, *network))
        """))
    assert out.startswith("OK")


def test_converted_resnet_block_trains_the_same_under_jax_data_parallel():
    """The same under JAX with `keras.distribution.DataParallel` over two CPU devices (each
    batch split between them)."""
    pytest.importorskip("jax")
    script = CONVERTED + textwrap.dedent("""
        import jax

        devices = jax.devices("cpu")
        assert len(devices) == 2, devices

        def train(distribution):
            keras.distribution.set_distribution(distribution)
            keras.utils.set_random_seed(0)
            model = converted()
            history = model.fit(images, labels, batch_size=16, epochs=2, shuffle=False, verbose=0).history
            return model.get_weights(), history, model.predict(images, verbose=0), totals(model)

        one = train(None)
        compare(one, train(keras.distribution.DataParallel(devices=devices)))
        """)
    env = jax_env(x64=False)
    env["XLA_FLAGS"] += " --xla_force_host_platform_device_count=2"
    out = _run(script, env=env)
    assert out.startswith("OK")
