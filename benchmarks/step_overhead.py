"""What a compiled training step holds besides training: assertion ops and step time.

    python -m benchmarks.step_overhead                      # TensorFlow
    KERAS_BACKEND=jax python -m benchmarks.step_overhead    # JAX

Two networks, each trained by `fit` on random data (the numbers do not matter, the work does):
a 5-layer Bayesian CNN (two `Conv2DDVI`, two `MaxPooling2DDVI`, `FlattenDVI`, `DenseDVI`;
MNIST-sized 28x28 inputs, batch 128) and the 1-128-128-2 `DenseDVI` regression network of the
main job (batch 50). For each it prints the `Assert` ops in a traced TensorFlow training step
(forward, loss and gradients; `validate=False`, the default) and the median time of a step of
`fit` over several epochs after a warm-up epoch, with `validate=True` on every layer and loss
beside it (what the checks cost when a user asks for them). Step times are medians over
epochs of epoch time / steps; compare rows of the same run only.
"""

import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_dvi as kd  # noqa: E402


def cnn(num_train, validate):
    prior = kd.EmpiricalBayesRegularizer(num_train=num_train)
    model = keras.Sequential([
        keras.Input((28, 28, 1)),
        kd.Conv2DDVI(16, 3, padding="same", regularizer=prior, validate=validate),
        kd.MaxPooling2DDVI(2, activation="relu"),
        kd.Conv2DDVI(32, 3, padding="same", regularizer=prior, validate=validate),
        kd.MaxPooling2DDVI(2, activation="relu"),
        kd.FlattenDVI(),
        kd.DenseDVI(10, regularizer=prior, validate=validate),
    ])
    model.compile(keras.optimizers.Adam(1e-3), loss=kd.SoftmaxDeltaELL(validate=validate))
    rng = np.random.default_rng(0)
    x = rng.uniform(size=(num_train, 28, 28, 1)).astype("float32")
    y = rng.integers(0, 10, size=num_train).astype("int32")
    return model, x, y, 128


def dense(num_train, validate):
    prior = kd.EmpiricalBayesRegularizer(num_train=num_train)
    model = keras.Sequential([
        keras.Input((1,)),
        kd.DenseDVI(128, activation="relu", regularizer=prior, validate=validate),
        kd.DenseDVI(128, activation="relu", regularizer=prior, validate=validate),
        kd.DenseDVI(2, regularizer=prior, validate=validate),
    ])
    model.compile(keras.optimizers.Adam(1e-3), loss=kd.HeteroscedasticELL(validate=validate))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(num_train, 1)).astype("float32")
    return model, x, np.sin(x).astype("float32"), 50


NETWORKS = {"cnn": (cnn, 1024), "dense": (dense, 1000)}


def assert_ops(model, x, y):
    """The `Assert` ops in a traced TensorFlow training step of `model` (forward, loss,
    gradients), or `None` on another backend."""
    if keras.backend.backend() != "tensorflow":
        return None
    import tensorflow as tf

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            y_pred = model(x, training=True)
            loss = model.loss(y, y_pred) + sum(model.losses)
        return loss, tape.gradient(loss, model.trainable_variables)

    graph = step.get_concrete_function(tf.constant(x), tf.constant(y)).graph
    return sum(op.type == "Assert" for op in graph.get_operations())


class EpochTimes(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.times = []

    def on_epoch_begin(self, epoch, logs=None):
        self.start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.times.append(time.perf_counter() - self.start)


def step_ms(model, x, y, batch_size, epochs):
    timer = EpochTimes()
    model.fit(x, y, batch_size=batch_size, epochs=epochs + 1, verbose=0, callbacks=[timer])
    steps = -(-len(x) // batch_size)
    return 1e3 * float(np.median(timer.times[1:])) / steps


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--networks", nargs="+", default=list(NETWORKS), choices=list(NETWORKS))
    parser.add_argument("--epochs", type=int, default=5, help="timed epochs after the warm-up epoch")
    args = parser.parse_args(argv)
    keras.utils.set_random_seed(0)
    print(f"backend {keras.backend.backend()}, keras {keras.__version__}")
    print("| network | Assert ops in a traced step | step (ms) | step with validate=True (ms) |")
    print("|---|---|---|---|")
    for name in args.networks:
        build, num_train = NETWORKS[name]
        model, x, y, batch = build(num_train, validate=False)
        asserts = assert_ops(model, x[:batch], y[:batch])
        plain = step_ms(model, x, y, batch, args.epochs)
        model, x, y, batch = build(num_train, validate=True)
        checked = step_ms(model, x, y, batch, args.epochs)
        print(f"| {name} | {'n/a' if asserts is None else asserts} | {plain:.2f} | {checked:.2f} |", flush=True)


if __name__ == "__main__":
    main()
