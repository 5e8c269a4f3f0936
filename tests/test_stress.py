"""Long trainings on badly scaled data: no NaN or inf in losses, weights or gradients.

Each run takes 2,000 optimizer steps (Adam, learning rate 1e-2, batches of 32 from 256
examples) and checks every logged loss, every weight at the end, and the gradients of the
last batch. Scenarios: targets in the thousands (mean 5,000, standard deviation 2,000),
near-constant targets (standard deviation 1e-3 around 7), and inputs whose features span
1e-3 to 1e3 (with the `keras.layers.Normalization` layer in front that any network needs for
such inputs; see the README, "Numerics").
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import ops

import keras_dvi as kd
from tests.conftest import model_gradients

STEPS = 2000
N = 256
BATCH = 32


def _data(kind):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((N, 3))
    signal = np.sin(x[:, :1]) + 0.5 * x[:, 1:2]
    if kind == "large_targets":
        y = 5000.0 + 2000.0 * signal + 50.0 * rng.standard_normal((N, 1))
    elif kind == "constant_targets":
        y = 7.0 + 1e-3 * (0.1 * signal + rng.standard_normal((N, 1)))
    else:  # wide_inputs: features of scale 1e-3, 1 and 1e3
        x = x * np.array([1e-3, 1.0, 1e3])
        y = np.sin(x[:, :1] * 1e3) + 0.5 * x[:, 1:2] + 0.1 * rng.standard_normal((N, 1))
    return x.astype("float32"), y.astype("float32")


def _front(x):
    norm = keras.layers.Normalization()
    norm.adapt(x)
    return [keras.Input((3,)), norm]


def _dvi_model(x, method):
    prior = kd.EmpiricalBayesRegularizer(N)
    body = kd.DenseDVI if method == "dvi" else kd.DenseDiagDVI
    model = keras.Sequential(
        _front(x) + [body(16, "relu", regularizer=prior), body(16, "relu", regularizer=prior),
                     kd.DenseDVI(2, regularizer=prior)]
    )
    model.compile(keras.optimizers.Adam(1e-2), loss=kd.HeteroscedasticELL())
    return model, kd.HeteroscedasticELL()


def _gi_model(x, method):
    model = keras.Sequential(
        _front(x) + [
            kd.GlobalInducingDense(16, "relu", num_inducing=16, regularizer=kd.NealPrior(N), num_samples=2),
            kd.GlobalInducingDense(1, output_layer=True),
            kd.SampledHomoscedasticNoise(),
        ]
    )
    model.compile(keras.optimizers.Adam(1e-2), loss=kd.SampledHeteroscedasticELL())
    return model, kd.SampledHeteroscedasticELL()


@pytest.mark.parametrize(
    "method, kind",
    [("dvi", "large_targets"), ("dvi", "constant_targets"), ("dvi", "wide_inputs"),
     ("gi", "large_targets"), ("gi", "constant_targets")],
)
def test_long_training_stays_finite(method, kind):
    """Targets are used as they are (unnormalised): the learned noise and output scale
    must absorb thousands and thousandths alike."""
    x, y = _data(kind)
    keras.utils.set_random_seed(0)
    model, loss_fn = (_gi_model if method == "gi" else _dvi_model)(x, method)
    if method == "gi":
        kd.initialize_from_data(model, x, y, seed=0)
    data = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(N, seed=0).batch(BATCH).repeat()
    history = model.fit(data, steps_per_epoch=STEPS // 10, epochs=10, verbose=0).history
    assert np.isfinite(history["loss"]).all(), history["loss"]
    for variable in model.weights:
        assert np.isfinite(ops.convert_to_numpy(variable)).all(), variable.path
    _, grads = model_gradients(model, x[:BATCH], lambda out: loss_fn(y[:BATCH], out), training=True)
    assert all(np.isfinite(g).all() for g in grads if g is not None)
    # It learned, not just survived: the data term fell (the loss itself can rise while the
    # KL warm-up brings the KL in).
    assert history["nll"][-1] < history["nll"][0]
