"""ReLU's paper covariance with its hand-written gradient against autodiff of the pairwise form.

    python -m benchmarks.experiments.relu_covariance_gradient --out benchmarks/results/relu_covariance_gradient.md

    KERAS_BACKEND=jax python -m benchmarks.experiments.relu_covariance_gradient --out benchmarks/results/relu_covariance_gradient_jax.md

`activation_covariance(mean, cov, "relu", "paper")` (what `DenseDVI` and `SkipDVI` compute by
default) runs in one pass with a closed-form gradient. This script times it against the same
matrix assembled from the elementwise `activation_moments` and `cross_covariance`, whose gradient
the backend derives by autodiff (the former implementation), interleaved in one process so the
machine's drift cancels: the operation alone (forward + backward, compiled: `tf.function` or
`jax.jit`; its graph nodes or jaxpr equations) and whole `DenseDVI` networks' training steps
(`fit`, Adam, empirical Bayes); the first `fit` (tracing, and on JAX compiling) in CPU seconds.
TensorFlow runs on one thread; JAX at its defaults.
"""

import argparse
import contextlib
import dataclasses
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from keras import ops  # noqa: E402

import keras_dvi as kd  # noqa: E402
from keras_dvi.maths import moments  # noqa: E402
from benchmarks.report import report  # noqa: E402


#: The two forms, as `"relu"` entries of the activation registry: the one-pass form, and the
#: same entry without it (`activation_covariance` then assembles the matrix pair by pair).
RELU = moments.get_activation("relu")
FORMS = {"hand-written gradient": RELU,
         "autodiff of the pairwise form": dataclasses.replace(RELU, paper_covariance_matrix=None)}


@contextlib.contextmanager
def relu_as(entry):
    """While open, ReLU's covariance is computed with `entry` (what a step traced meanwhile keeps)."""
    moments._ACTIVATIONS["relu"] = entry
    try:
        yield
    finally:
        moments._ACTIVATIONS["relu"] = RELU


def relu_covariance(mean, covariance):
    return moments.activation_covariance(mean, covariance, "relu", "paper")


def _compiled_step(w_mean, w_cov):
    """`(step, size)`: forward + backward of ReLU's covariance compiled, and its graph nodes
    (TensorFlow) or jaxpr equations (JAX)."""
    if keras.backend.backend() == "jax":
        import jax

        def total(m, c):
            mean_h, cov_h = relu_covariance(m, c)
            return ops.sum(mean_h * w_mean) + ops.sum(cov_h * w_cov)

        grad = jax.grad(total, argnums=(0, 1))
        step = jax.jit(grad)
        return (lambda m, c: jax.block_until_ready(step(m, c))), (
            lambda m, c: len(jax.make_jaxpr(grad)(m, c).jaxpr.eqns))
    import tensorflow as tf

    def step(m, c):
        with tf.GradientTape() as tape:
            tape.watch([m, c])
            mean_h, cov_h = relu_covariance(m, c)
            total = tf.reduce_sum(mean_h * w_mean) + tf.reduce_sum(cov_h * w_cov)
        return tape.gradient(total, [m, c])

    compiled = tf.function(step)
    return compiled, lambda m, c: len(compiled.get_concrete_function(m, c).graph.as_graph_def().node)


def operation_rows(batch, units, rounds, repeats):
    rng = np.random.default_rng(0)
    a = rng.normal(size=(batch, units, units))
    cov = ops.convert_to_tensor((a @ np.swapaxes(a, -1, -2) / units + 1e-3 * np.eye(units)).astype("float32"))
    mean = ops.convert_to_tensor(rng.normal(size=(batch, units)).astype("float32"))
    w_mean = ops.convert_to_tensor(rng.normal(size=(batch, units)).astype("float32"))
    w_cov = ops.convert_to_tensor(rng.normal(size=(batch, units, units)).astype("float32"))
    steps, nodes = {}, {}
    for name, entry in FORMS.items():
        with relu_as(entry):  # traced and compiled with it
            steps[name], size = _compiled_step(w_mean, w_cov)
            nodes[name] = size(mean, cov)
            steps[name](mean, cov)
    times = {name: [] for name in FORMS}
    for _ in range(rounds):
        for name, step in steps.items():
            start = time.perf_counter()
            for _ in range(repeats):
                step(mean, cov)
            times[name].append((time.perf_counter() - start) / repeats)
    return {name: (1e3 * float(np.median(times[name])), nodes[name]) for name in FORMS}


def network_rows(width, batch, rounds, steps):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch * steps, 1)).astype("float32")
    y = rng.normal(size=(batch * steps,)).astype("float32")
    models, first = {}, {}
    for name, entry in FORMS.items():
        keras.utils.set_random_seed(0)
        prior = kd.EmpiricalBayesRegularizer(len(x))
        model = keras.Sequential([keras.Input((1,)), kd.DenseDVI(width, "relu", regularizer=prior),
                                  kd.DenseDVI(width, "relu", regularizer=prior), kd.DenseDVI(2, regularizer=prior)])
        model.compile(keras.optimizers.Adam(1e-3), loss=kd.HeteroscedasticELL())
        start = time.process_time()
        with relu_as(entry):  # the training step is traced in the first fit
            model.fit(x[:batch], y[:batch], batch_size=batch, epochs=1, verbose=0)
        first[name] = time.process_time() - start
        models[name] = model
    times = {name: [] for name in FORMS}
    for _ in range(rounds):
        for name, model in models.items():
            start = time.perf_counter()
            model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
            times[name].append((time.perf_counter() - start) / steps)
    return {name: (1e3 * float(np.median(times[name])), first[name]) for name in FORMS}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds (the median is reported)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(1)
        tf.config.threading.set_inter_op_parallelism_threads(1)
    threads = "one thread" if backend == "tensorflow" else "JAX's default threads"
    lines = [f"{backend}. The operation alone: mean and covariance of `relu(a)`, `a ~ N(m, S)`, forward + "
             f"backward (compiled), float32, {threads}, median of {args.rounds} interleaved rounds:", "",
             "| batch x units | form | ms | graph nodes (TensorFlow) / jaxpr equations (JAX) |", "|---|---|---|---|"]
    for batch, units in ((10, 256), (50, 128), (50, 256)):
        for name, (ms, nodes) in operation_rows(batch, units, args.rounds, 10).items():
            lines.append(f"| {batch} x {units} | {name} | {ms:.1f} | {nodes} |")
    lines += ["", "Training steps of 1-w-w-2 `DenseDVI` ReLU networks (`fit`, batch 50, Adam, empirical Bayes), "
              f"{threads}, median of {args.rounds} interleaved epochs of 20 steps; the first `fit` (tracing"
              + (", compiling" if backend == "jax" else "") + ") in CPU seconds:", "",
              "| w | form | ms / step | first fit, CPU s |", "|---|---|---|---|"]
    for width in (128, 256):
        for name, (ms, first) in network_rows(width, 50, args.rounds, 20).items():
            lines.append(f"| {width} | {name} | {ms:.1f} | {first:.2f} |")
    report("\n".join(lines), args.out, "benchmarks.experiments.relu_covariance_gradient", argv)


if __name__ == "__main__":
    main()
