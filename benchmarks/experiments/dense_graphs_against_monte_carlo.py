"""Converted networks of vectors against Monte Carlo over their weights: the conversion guide's
rows for residual MLPs (`Add` of vectors), wide and deep models (`Concatenate` of data and a
Bayesian branch) and a residual 1D CNN with `Dense` layers on its positions.

Each network is built with random (Glorot) weights, converted by `keras_dvi.convert` at the
default posterior variances, and its logits' moments compared with 2,000 draws of the weights
through `keras_dvi.predict_samples` on 8 standard normal inputs (a variance ratio's Monte Carlo
standard error is 0.03), with `benchmarks.experiments.converted_against_monte_carlo.agreement`:
the logits' variance over Monte Carlo's, and the means' error in Monte Carlo standard
deviations. `plain MLP` is the residual MLP without its skip connections: the sums' share of
the error is the difference.

    python -m benchmarks.experiments.dense_graphs_against_monte_carlo --seeds 0 1 2
"""

import argparse

import keras
import numpy as np

import keras_dvi as kd
from benchmarks.experiments.converted_against_monte_carlo import agreement


def residual_mlp(skip=True, width=64, blocks=3, features=8):
    """A residual MLP of `blocks` blocks `h + W2 relu(W1 h)` (ReLU after each sum), as in tabular
    ResNets; without `skip`, the same layers chained."""
    inputs = keras.Input((features,))
    h = keras.layers.Dense(width, activation="relu")(inputs)
    for _ in range(blocks):
        branch = keras.layers.Dense(width)(keras.layers.Dense(width, activation="relu")(h))
        h = keras.layers.ReLU()(keras.layers.Add()([h, branch]) if skip else branch)
    return keras.Model(inputs, keras.layers.Dense(5)(h))


def wide_and_deep(width=64, features=8):
    """Wide and deep: the data joined to a two-layer Bayesian branch, a dense head."""
    inputs = keras.Input((features,))
    deep = keras.layers.Dense(width, activation="relu")(keras.layers.Dense(width, activation="relu")(inputs))
    return keras.Model(inputs, keras.layers.Dense(5)(keras.layers.Concatenate()([inputs, deep])))


def residual_cnn_1d(width=32, steps=32, features=4):
    """A time-series ResNet: 1D convolutions in residual blocks, a `Dense` on the positions,
    global average pooling and a dense head."""
    inputs = keras.Input((steps, features))
    h = keras.layers.Conv1D(width, 7, padding="same", activation="relu")(inputs)
    for _ in range(2):
        branch = keras.layers.Conv1D(width, 3, padding="same", activation="relu")(h)
        h = keras.layers.ReLU()(keras.layers.Add()([h, keras.layers.Conv1D(width, 3, padding="same")(branch)]))
    h = keras.layers.Dense(width, activation="relu")(h)
    return keras.Model(inputs, keras.layers.Dense(5)(keras.layers.GlobalAveragePooling1D()(h)))


NETWORKS = {
    "residual MLP": residual_mlp,
    "plain MLP": lambda: residual_mlp(skip=False),
    "wide and deep": wide_and_deep,
    "residual 1D CNN": residual_cnn_1d,
}


def measure(network, seed, draws=2000):
    """`(logit ratio, logit error)` per unit of one network and seed (`agreement`)."""
    keras.utils.set_random_seed(seed)
    plain = NETWORKS[network]()
    x = np.random.default_rng(100 + seed).normal(size=(8,) + tuple(plain.inputs[0].shape[1:])).astype("float32")
    converted = kd.convert(plain, regularizer=kd.EmpiricalBayesRegularizer(num_train=10_000))
    mean, variance = (keras.ops.convert_to_numpy(t) for t in kd.unpack(converted(x), covariance="diagonal"))
    return agreement(mean, variance, kd.predict_samples(converted, x, draws, seed=seed))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--networks", nargs="+", choices=sorted(NETWORKS), default=list(NETWORKS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--draws", type=int, default=2000)
    args = parser.parse_args(argv)
    print("| network | seed | logits' variance / Monte Carlo (min-max, median) | logits' means, max error (sd) |")
    print("|---|---|---|---|")
    for network in args.networks:
        for seed in args.seeds:
            ratio, error = measure(network, seed, args.draws)
            print(f"| {network} | {seed} | {ratio.min():.2f}-{ratio.max():.2f}, {np.median(ratio):.2f} | "
                  f"{error.max():.2f} |", flush=True)


if __name__ == "__main__":
    main()
