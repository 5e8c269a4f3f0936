"""How long the first `fit` of a keras-dvi network takes, and what building the optimizer first saves.

    python -m benchmarks.experiments.first_fit --rounds 3 --out benchmarks/results/first_fit.md

The first call of `fit` traces the training step, and a keras-dvi network's step is a graph
several times a plain network's. Keras' TensorFlow trainer (without a distribution strategy)
builds the optimizer lazily, inside that first trace; `tf.function` then traces the step a
second time, since its first trace created variables. Building the optimizer after `compile`
(`model.optimizer.build(model.trainable_variables)`, public Keras API) makes it trace once.

Each cell is a fresh Python process (nothing traced or cached before): the first `fit` of 2
epochs, with and without the optimizer built beforehand, the number of times the step was
traced, and whether the weights after `fit` are the same to the bit. Networks: the README's
regression network (toy data, 500 rows, batches of 50), a small MNIST-shaped CNN (256 random
images, batches of 64) and a plain Keras network of the README's shape.
"""

import argparse
import multiprocessing
import os
import statistics

NETWORKS = ("regression", "cnn", "plain")


def _model_and_data(network):
    """`(compiled model, x, y, batch size)`; the model's first layer counts its calls (one per trace)."""
    import keras
    import numpy as np

    import keras_dvi as kd

    class Count(keras.layers.Layer):
        """An identity layer counting how often the model is called (each trace calls it once)."""

        calls = 0

        def call(self, inputs):
            Count.calls += 1
            return inputs

    keras.utils.set_random_seed(0)
    if network == "cnn":
        rng = np.random.default_rng(0)
        x, y = rng.random((256, 28, 28, 1)).astype("float32"), rng.integers(0, 10, 256)
        prior = kd.EmpiricalBayesRegularizer(num_train=len(x))
        model = keras.Sequential([
            keras.Input((28, 28, 1)), Count(),
            kd.Conv2DDVI(16, 3, regularizer=prior), kd.MaxPooling2DDVI(2, activation="relu"),
            kd.Conv2DDVI(32, 3, regularizer=prior), kd.MaxPooling2DDVI(2, activation="relu"),
            kd.FlattenDVI(), kd.DenseDVI(10, regularizer=prior),
        ])
        model.compile(keras.optimizers.Adam(1e-3), loss=kd.SoftmaxDeltaELL())
        return model, x, y, 64, Count
    (x, y), _ = kd.datasets.load_toy_regression()
    if network == "plain":
        model = keras.Sequential([keras.Input((1,)), Count(), keras.layers.Dense(64, "relu"),
                                  keras.layers.Dense(64, "relu"), keras.layers.Dense(1)])
        model.compile(keras.optimizers.Adam(1e-2), loss="mse")
        return model, x, y, 50, Count
    prior = kd.EmpiricalBayesRegularizer(num_train=len(x))  # the README's regression network
    model = keras.Sequential([
        keras.Input((1,)), Count(),
        kd.DenseDiagDVI(64, activation="relu", regularizer=prior),
        kd.DenseDiagDVI(64, activation="relu", regularizer=prior),
        kd.DenseDVI(2, regularizer=prior),
    ])
    model.compile(keras.optimizers.Adam(1e-2), loss=kd.HeteroscedasticELL())
    return model, x, y, 50, Count


def _first_fit(task):
    """One cell, in a fresh process: `{seconds, traces, checksum}` of the first `fit` (2 epochs)."""
    network, prebuild = task
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    import hashlib
    import time
    import warnings

    import numpy as np

    warnings.simplefilter("ignore")
    model, x, y, batch_size, counter = _model_and_data(network)
    if prebuild:
        model.optimizer.build(model.trainable_variables)
    before = counter.calls
    start = time.perf_counter()
    model.fit(x, y, epochs=2, batch_size=batch_size, verbose=0)
    seconds = time.perf_counter() - start
    weights = np.concatenate([np.ravel(w) for w in model.get_weights()])
    return {"seconds": seconds, "traces": counter.calls - before,
            "checksum": hashlib.sha256(weights.tobytes()).hexdigest()}


def run_cell(network, prebuild):
    with multiprocessing.get_context("spawn").Pool(1) as pool:  # a fresh process: nothing traced before
        return pool.map(_first_fit, [(network, prebuild)])[0]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="fresh processes per cell (alternated)")
    parser.add_argument("--out", default=None, help="write the Markdown table here")
    args = parser.parse_args(argv)
    rows = []
    for network in NETWORKS:
        cells = {False: [], True: []}
        for _ in range(args.rounds):
            for prebuild in (False, True):
                cells[prebuild].append(run_cell(network, prebuild))
        lazy, built = cells[False], cells[True]
        same = all(a["checksum"] == b["checksum"] for a, b in zip(lazy, built))
        seconds = [statistics.median(c["seconds"] for c in runs) for runs in (lazy, built)]
        traces = ["/".join(str(t) for t in sorted({c["traces"] for c in runs})) for runs in (lazy, built)]
        rows.append(f"| {network} | {seconds[0]:.2f} (traced {traces[0]}x) | "
                    f"{seconds[1]:.2f} (traced {traces[1]}x) | {'yes' if same else 'NO'} |")
        print(rows[-1], flush=True)
    table = "\n".join(["| network | first fit, optimizer built by Keras (s) | optimizer built first (s) | same weights |",
                       "|---|---|---|---|"] + rows)
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(f"`python -m benchmarks.experiments.first_fit --rounds {args.rounds}` (medians of fresh "
                    "processes, 2 epochs each)\n\n" + table + "\n")


if __name__ == "__main__":
    main()
