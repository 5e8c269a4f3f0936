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
import json
import os
import subprocess
import sys

_CELL = r'''
import hashlib, json, os, sys, time, warnings
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
warnings.simplefilter("ignore")
import numpy as np
import keras
import keras_dvi as kd

network, prebuild = sys.argv[1], sys.argv[2] == "1"
traces = []


class Count(keras.layers.Layer):
    """An identity layer counting how often the model is called (each trace calls it once)."""

    def call(self, inputs):
        traces.append(1)
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
    batch_size = 64
else:
    (x, y), _ = kd.datasets.load_toy_regression()
    if network == "plain":
        model = keras.Sequential([keras.Input((1,)), Count(), keras.layers.Dense(64, "relu"),
                                  keras.layers.Dense(64, "relu"), keras.layers.Dense(1)])
        model.compile(keras.optimizers.Adam(1e-2), loss="mse")
    else:
        prior = kd.EmpiricalBayesRegularizer(num_train=len(x))
        model = keras.Sequential([
            keras.Input((1,)), Count(),
            kd.DenseDiagDVI(64, activation="relu", regularizer=prior),
            kd.DenseDiagDVI(64, activation="relu", regularizer=prior),
            kd.DenseDVI(2, regularizer=prior),
        ])
        model.compile(keras.optimizers.Adam(1e-2), loss=kd.HeteroscedasticELL())
    batch_size = 50
if prebuild:
    model.optimizer.build(model.trainable_variables)
before = len(traces)
start = time.perf_counter()
model.fit(x, y, epochs=2, batch_size=batch_size, verbose=0)
seconds = time.perf_counter() - start
weights = np.concatenate([np.ravel(w) for w in model.get_weights()])
print(json.dumps({"seconds": seconds, "traces": len(traces) - before,
                  "checksum": hashlib.sha256(weights.tobytes()).hexdigest()}))
'''

NETWORKS = ("regression", "cnn", "plain")


def run_cell(network, prebuild):
    out = subprocess.run([sys.executable, "-c", _CELL, network, "1" if prebuild else "0"], capture_output=True,
                         text=True, check=True, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    return json.loads(out.stdout.strip().splitlines()[-1])


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
        median = lambda cs: sorted(c["seconds"] for c in cs)[len(cs) // 2]  # noqa: E731
        rows.append(f"| {network} | {median(lazy):.2f} ({lazy[0]['traces']} traces) | "
                    f"{median(built):.2f} ({built[0]['traces']} trace) | {'yes' if same else 'NO'} |")
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
