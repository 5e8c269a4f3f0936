"""TAGI on scikit-learn's digits (issue 24): dense against convolutional networks, the
linearised against the exact-moment forward pass, and the update cap `max_step`.

Protocol: the 1,797 digits as 8x8 images, pixels / 16; per seed a stratified 70 / 30 split of
which the network trains on the 70% (`--validation` splits those 70% again, 70 / 30, and scores
the held-out part instead: the rows used to choose settings); batches of 10, `--epochs` (5),
sigma_V 0.3 (the value the MNIST choice picks; `--noise`), the paper's initialisation.
Networks: `dense` 64-100-100-11, `dense32` 64-32-32-11 (`_cap`: `max_step=1`, the cap conv
networks get by default, on a dense network), `cnn16` / `cnn32` conv 3x3 ("same", 16 / 32 filters, ReLU) -
average pool 2 - flatten - dense 64 ReLU - 11 (the tree head of Appendix C). Reported:
accuracy and NLL of `keras_dvi.predict`'s probabilities, seconds per epoch.

    python -m benchmarks.tagi_digits --seeds 0 1 2
    python -m benchmarks.tagi_digits --configs dense dense_cap dense32 dense32_cap --seeds 0 1 2 3 4 --validation --noise 0.1
"""

import argparse
import os
import time

import numpy as np

CONFIGS = {  # name: (network, forward, max_step)
    "dense": ("dense", "linearized", "auto"),
    "dense_moments": ("dense", "moments", "auto"),
    "dense_cap": ("dense", "linearized", 1.0),
    "dense32": ("dense32", "linearized", "auto"),
    "dense32_cap": ("dense32", "linearized", 1.0),
    "cnn16": ("cnn16", "linearized", "auto"),
    "cnn16_no_cap": ("cnn16", "linearized", None),
    "cnn32": ("cnn32", "linearized", "auto"),
    "cnn32_no_cap": ("cnn32", "linearized", None),
}


def network(kind):
    import keras

    import keras_dvi as kd

    units, _ = kd.tagi.tree(10)
    if kind.startswith("dense"):
        width = int(kind[5:] or 100)
        body = [keras.layers.Flatten(), kd.DenseDiagDVI(width, "relu"), kd.DenseDiagDVI(width, "relu")]
    else:
        body = [kd.Conv2DDVI(int(kind[3:]), 3, padding="same", activation="relu"), kd.AveragePooling2DDVI(2),
                kd.FlattenDVI(), kd.DenseDiagDVI(64, "relu")]
    return keras.Sequential([keras.Input((8, 8, 1))] + body + [kd.DenseDiagDVI(units)])


def run(name, seed, args):
    import keras
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    import keras_dvi as kd

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).reshape(-1, 8, 8, 1).astype("float32")
    x_fit, x_test, y_fit, y_test = train_test_split(x, y, test_size=0.3, stratify=y, random_state=seed)
    if args.validation:
        x_fit, x_test, y_fit, y_test = train_test_split(x_fit, y_fit, test_size=0.3, stratify=y_fit,
                                                        random_state=seed)
    kind, forward, max_step = CONFIGS[name]
    keras.utils.set_random_seed(seed)
    model = kd.TAGIModel(network(kind), observation_noise=args.noise, classes=10, forward=forward, seed=seed,
                         max_step=max_step)
    model.compile(steps_per_execution=50)
    model.fit(x_fit[:20], y_fit[:20], batch_size=10, epochs=1, verbose=0)  # compile outside the timing
    model = kd.TAGIModel(network(kind), observation_noise=args.noise, classes=10, forward=forward, seed=seed,
                         max_step=max_step)
    model.compile(steps_per_execution=50)
    start = time.time()
    model.fit(x_fit, y_fit, batch_size=10, epochs=args.epochs, verbose=0)
    seconds = (time.time() - start) / args.epochs
    probs = kd.predict(model, x_test)["probabilities"]
    accuracy = float(np.mean(probs.argmax(1) == y_test))
    nll = float(-np.mean(np.log(np.maximum(probs[np.arange(len(y_test)), y_test], 1e-300))))
    return accuracy, nll, seconds


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--noise", type=float, default=0.3)
    parser.add_argument("--validation", action="store_true")
    args = parser.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    rows = [f"{'validation' if args.validation else 'test'} rows, {args.epochs} epochs, sigma_V {args.noise}, "
            f"seeds {args.seeds} (mean +- standard error):", "",
            "| config | network | forward | max_step | accuracy | NLL | s / epoch |", "|---|---|---|---|---|---|---|"]
    for name in args.configs:
        results = np.array([run(name, seed, args) for seed in args.seeds])
        mean, se = results.mean(0), results.std(0, ddof=1) / np.sqrt(len(results)) if len(results) > 1 else 0 * results[0]
        kind, forward, max_step = CONFIGS[name]
        rows.append(f"| {name} | {kind} | {forward} | {max_step} | {mean[0]:.3f} +- {se[0]:.3f} | "
                    f"{mean[1]:.3f} +- {se[1]:.3f} | {mean[2]:.2f} |")
        print(rows[-1], flush=True)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
