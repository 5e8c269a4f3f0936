"""Bayesian CNNs on MNIST under shift (issue 25), after Ovadia et al. (2019).

Protocol (fixed before any test score was seen):

* data: MNIST, `--data ../shared/data/mnist.npz` (the `keras.datasets.mnist` layout); without
  `--data`, `keras.datasets.mnist.load_data()`. Pixels scaled to [0, 1]; the standard 60,000 /
  10,000 split (`--train-rows` subsamples the training rows, for quick checks only).
* architecture, the same for every method: conv 32 3x3 ReLU, max pool 2, conv 64 3x3 ReLU,
  max pool 2, dense 128 ReLU, 10 outputs. keras-dvi writes it `Conv2DDVI(32, 3)`,
  `MaxPooling2DDVI(2, activation="relu")`, ... (the same function: the ReLU sits on the
  pooling layer, as the layers' docstrings advise), `FlattenDVI`, `DenseDiagDVI(128, "relu")`,
  `DenseDVI(10)`.
* training: Adam 1e-3, batches of 128, `--epochs` (default 3: 1,407 steps; the budget two
  CPU cores allow for every method and seed) for every method.
* methods: `plain` (a Keras CNN), `dropout` (MC dropout, p = 0.1 after each pooling layer and
  the dense layer, 20 samples), `ensemble` (5 plain CNNs), `flipout` (keras-proba's
  `Conv2DFlipout` / `DenseFlipout`, `kl_weight = 1 / N`, 20 samples; the `benchmarks` extra),
  `dvi` (keras-dvi with the library's defaults: `EmpiricalBayesRegularizer(N)` with
  `kl_weight="auto"`, the KL weight `min(1, N / P)`, `SoftmaxDeltaELL()` with Jankowiak's
  bound, the auto KL warm-up; `keras_dvi.predict`), `dvi_elbo` (the full ELBO with the delta
  method: `kl_weight=1`, `SoftmaxDeltaELL(method="delta")`; the library's defaults before the
  classifier ablation), `dvi_tempered` (a constant KL weight: `kl_weight=0.03`, Jankowiak's
  bound), `dvi_delta` (the defaults' KL weight rule with the delta method), `mcvi`
  (`Conv2DMCVI` / `DenseMCVI`, 2 kernel draws per step, 20 at test time; the full ELBO), and
  the dense rows `dense100` / `dense800` (784-100-100-10 and 784-800-800-10 keras-dvi
  networks under the full ELBO with the delta method, against the TAGI paper's Table 2;
  `dense100_tempered` / `dense800_tempered` with `kl_weight=0.03`; `dense100_plain` /
  `dense800_plain`: plain Keras networks of the same shapes, added later to separate the
  objective from the shape and budget); `dvi_ensemble` (5 `dvi_elbo` networks, seeds as the
  plain ensemble's, their `keras_dvi.predict` probabilities averaged: added later, as a remedy
  for the full ELBO's confidence on uniform noise after 20 epochs).
* `--validation` (for choosing recipes): train on the first 50,000 training rows and score
  the last 10,000 in place of the test set.
* evaluation sets: the clean test set; rotations from 0 to 180 degrees in 15-degree steps
  (`scipy.ndimage.rotate(reshape=False)`, clipped to [0, 1]); Gaussian pixel noise of sd 0.1,
  0.2 and 0.4 (clipped); out of distribution: uniform-noise images against the clean test
  set, and a second network of the same method trained on the digits 0-4, detecting the test
  digits 5-9 among 0-9 (`--no-ood-digits` skips it). OOD by the AUROC of the predictive
  entropy.
* metrics: accuracy, NLL, ECE (15 bins), Brier, AUROC, seconds per epoch (training only),
  peak resident memory of the run's process.

Every (method, seed) runs in a fresh process and is cached as JSON in `--results`, so an
interrupted run resumes. Every run rewrites `summary.md` and the two plots
(`rotation_accuracy.png`, `rotation_nll.png`) next to the cache from all cached results.
"""

import argparse
import json
import math
import multiprocessing
import os
import resource
import time

import numpy as np

from benchmarks import cache  # noqa: E402
from benchmarks.classification import auroc, scores  # noqa: E402 - the same metrics as the digits benchmark

METHODS = ("plain", "dropout", "ensemble", "flipout", "dvi", "dvi_elbo", "dvi_tempered", "dvi_delta", "dvi_ensemble", "mcvi",
           "dense100", "dense800", "dense100_tempered", "dense800_tempered", "dense100_plain", "dense800_plain")
#: The objective of each keras-dvi method: `(prior arguments, SoftmaxDeltaELL method)`; `None`
#: is the library's default. `dvi` alone follows the library's defaults.
FULL_ELBO = ({"kl_weight": 1.0}, "delta")
OBJECTIVES = {"dvi": ({}, None), "dvi_elbo": FULL_ELBO, "dvi_ensemble": FULL_ELBO, "dvi_tempered": ({"kl_weight": 0.03}, None),
              "dvi_delta": ({}, "delta"), "mcvi": ({"kl_weight": 1.0}, None), "dense100": FULL_ELBO, "dense800": FULL_ELBO,
              "dense100_tempered": ({"kl_weight": 0.03}, None), "dense800_tempered": ({"kl_weight": 0.03}, None)}
ROTATIONS = tuple(range(0, 181, 15))
NOISE_SDS = (0.1, 0.2, 0.4)
BATCH = 128
LEARNING_RATE = 1e-3
ENSEMBLE_SIZE = 5
DROPOUT_RATE = 0.1
TEST_SAMPLES = 20  # weight or dropout samples per test input (18 evaluation sets of 10,000)
MCVI_SAMPLES = 2
VALIDATION_ROWS = 10_000  # `--validation`: the training rows held out and scored


def load_mnist(path=None):
    """`(x_train, y_train, x_test, y_test)`, pixels in [0, 1], `(n, 28, 28, 1)`."""
    if path:
        with np.load(path) as data:
            arrays = data["x_train"], data["y_train"], data["x_test"], data["y_test"]
    else:
        import keras

        (x_train, y_train), (x_test, y_test) = keras.datasets.mnist.load_data()
        arrays = x_train, y_train, x_test, y_test
    x_train, y_train, x_test, y_test = arrays
    scale = lambda x: (x.astype("float32") / 255.0)[..., None]  # noqa: E731
    return scale(x_train), y_train.astype("int32"), scale(x_test), y_test.astype("int32")


def rotate(x, degrees):
    from scipy import ndimage

    if degrees == 0:
        return x
    return np.clip(ndimage.rotate(x, degrees, axes=(1, 2), reshape=False, order=1), 0.0, 1.0).astype("float32")


def add_noise(x, sd, seed):
    rng = np.random.default_rng(seed)
    return np.clip(x + rng.normal(0.0, sd, x.shape), 0.0, 1.0).astype("float32")


# ---------------------------------------------------------------- networks


def plain_cnn(classes, dropout=0.0):
    import keras

    layers = [keras.Input((28, 28, 1)), keras.layers.Conv2D(32, 3, activation="relu"), keras.layers.MaxPooling2D(2)]
    if dropout:
        layers.append(keras.layers.Dropout(dropout))
    layers += [keras.layers.Conv2D(64, 3, activation="relu"), keras.layers.MaxPooling2D(2)]
    if dropout:
        layers.append(keras.layers.Dropout(dropout))
    layers += [keras.layers.Flatten(), keras.layers.Dense(128, activation="relu")]
    if dropout:
        layers.append(keras.layers.Dropout(dropout))
    layers.append(keras.layers.Dense(classes))
    model = keras.Sequential(layers)
    model.compile(keras.optimizers.Adam(LEARNING_RATE),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def dense_width(method):
    """The hidden width of a dense row: `dense800_tempered` -> 800."""
    return int(method.split("_")[0][len("dense"):])


def plain_dense(classes, width):
    """A plain Keras 784-`width`-`width`-`classes` ReLU network, trained as `plain_cnn`."""
    import keras

    model = keras.Sequential([keras.Input((28, 28, 1)), keras.layers.Flatten(),
                              keras.layers.Dense(width, activation="relu"),
                              keras.layers.Dense(width, activation="relu"), keras.layers.Dense(classes)])
    model.compile(keras.optimizers.Adam(LEARNING_RATE),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def flipout_cnn(classes, num_train, seed):
    import keras
    import keras_proba as kp

    kl = 1.0 / num_train
    model = keras.Sequential([
        keras.Input((28, 28, 1)),
        kp.layers.Conv2DFlipout(32, 3, activation="relu", kl_weight=kl, seed=seed),
        keras.layers.MaxPooling2D(2),
        kp.layers.Conv2DFlipout(64, 3, activation="relu", kl_weight=kl, seed=seed + 1),
        keras.layers.MaxPooling2D(2),
        keras.layers.Flatten(),
        kp.layers.DenseFlipout(128, activation="relu", kl_weight=kl, seed=seed + 2),
        kp.layers.DenseFlipout(classes, kl_weight=kl, seed=seed + 3),
    ])
    model.compile(keras.optimizers.Adam(LEARNING_RATE),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def keras_dvi_cnn(method, classes, num_train):
    import keras

    import keras_dvi as kd

    settings, loss_method = OBJECTIVES[method]
    prior = kd.EmpiricalBayesRegularizer(num_train, **settings)
    softmax_loss = kd.SoftmaxDeltaELL() if loss_method is None else kd.SoftmaxDeltaELL(method=loss_method)
    if method == "mcvi":
        layers = [
            keras.Input((28, 28, 1)),
            kd.Conv2DMCVI(32, 3, activation="relu", num_samples=MCVI_SAMPLES, regularizer=prior),
            keras.layers.TimeDistributed(keras.layers.MaxPooling2D(2)),
            kd.Conv2DMCVI(64, 3, activation="relu", regularizer=prior),
            keras.layers.TimeDistributed(keras.layers.MaxPooling2D(2)),
            keras.layers.TimeDistributed(keras.layers.Flatten()),
            kd.DenseMCVI(128, "relu", regularizer=prior),
            kd.DenseMCVI(classes, regularizer=prior),
        ]
        loss = kd.SampledSoftmaxELL()
    elif method.startswith("dense"):
        width = dense_width(method)
        layers = [keras.Input((28, 28, 1)), keras.layers.Flatten(),
                  kd.DenseDiagDVI(width, "relu", regularizer=prior), kd.DenseDiagDVI(width, "relu", regularizer=prior),
                  kd.DenseDVI(classes, regularizer=prior)]
        loss = softmax_loss
    else:
        layers = [
            keras.Input((28, 28, 1)),
            kd.Conv2DDVI(32, 3, regularizer=prior),
            kd.MaxPooling2DDVI(2, activation="relu"),
            kd.Conv2DDVI(64, 3, regularizer=prior),
            kd.MaxPooling2DDVI(2, activation="relu"),
            kd.FlattenDVI(),
            kd.DenseDiagDVI(128, "relu", regularizer=prior),
            kd.DenseDVI(classes, regularizer=prior),
        ]
        loss = softmax_loss
    model = keras.Sequential(layers)
    model.compile(keras.optimizers.Adam(LEARNING_RATE), loss=loss)
    return model


def train(method, x, y, classes, seed, epochs):
    """Trains `method`; returns `(predict(x) -> probabilities, seconds of training)`."""
    import keras

    import keras_dvi as kd

    keras.utils.set_random_seed(seed)
    start = time.time()
    if method in ("plain", "dropout", "ensemble", "dense100_plain", "dense800_plain"):
        members = ENSEMBLE_SIZE if method == "ensemble" else 1
        models = []
        for member in range(members):
            keras.utils.set_random_seed(seed + 1000 * member)
            if method.endswith("_plain"):
                model = plain_dense(classes, dense_width(method))
            else:
                model = plain_cnn(classes, DROPOUT_RATE if method == "dropout" else 0.0)
            model.fit(x, y, epochs=epochs, batch_size=BATCH, verbose=0)
            models.append(model)
        seconds = time.time() - start

        def predict(inputs):
            if method == "dropout":
                logits = np.stack([keras.ops.convert_to_numpy(models[0](inputs, training=True))
                                   for _ in range(TEST_SAMPLES)])
            else:
                logits = np.stack([m.predict(inputs, batch_size=1000, verbose=0) for m in models])
            return np.asarray(keras.ops.convert_to_numpy(keras.ops.softmax(logits, axis=-1))).mean(0)

        return _batched(predict), seconds
    if method == "flipout":
        model = flipout_cnn(classes, len(x), seed)
        model.fit(x, y, epochs=epochs, batch_size=BATCH, verbose=0)
        seconds = time.time() - start

        def predict(inputs):
            logits = np.stack([keras.ops.convert_to_numpy(model(inputs)) for _ in range(TEST_SAMPLES)])
            return np.asarray(keras.ops.convert_to_numpy(keras.ops.softmax(logits, axis=-1))).mean(0)

        return _batched(predict), seconds
    members = ENSEMBLE_SIZE if method == "dvi_ensemble" else 1
    models = []
    for member in range(members):
        if members > 1:
            keras.utils.set_random_seed(seed + 1000 * member)
        models.append(keras_dvi_cnn(method, classes, len(x)))
        models[-1].fit(x, y, epochs=epochs, batch_size=BATCH, verbose=0)
    seconds = time.time() - start

    def predict(inputs):
        return np.mean([kd.predict(m, inputs, num_samples=TEST_SAMPLES, batch_size=500)["probabilities"]
                        for m in models], axis=0)

    predict = _batched(predict)
    predict.model = models[0]
    return predict, seconds


def _batched(predict, size=1000):
    def run(inputs):
        return np.concatenate([predict(inputs[i:i + size]) for i in range(0, len(inputs), size)])

    return run


# ---------------------------------------------------------------- one run


def run_one(method, seed, args):
    import keras

    x, y, x_test, y_test = load_mnist(args.data)
    if args.validation:  # the last 10,000 training rows are scored; the test set is not read
        x, y, x_test, y_test = x[:-VALIDATION_ROWS], y[:-VALIDATION_ROWS], x[-VALIDATION_ROWS:], y[-VALIDATION_ROWS:]
    if args.train_rows:
        rows = np.random.default_rng(seed).permutation(len(x))[: args.train_rows]
        x, y = x[rows], y[rows]
    if args.test_rows:
        x_test, y_test = x_test[: args.test_rows], y_test[: args.test_rows]
    predict, seconds = train(method, x, y, 10, 1000 * seed, args.epochs)
    record = {"method": method, "seed": seed, "epochs": args.epochs, "train_rows": len(x),
              "validation": bool(args.validation),
              "seconds_per_epoch": seconds / args.epochs}
    if hasattr(predict, "model"):
        model = predict.model
        record["kl_warmup_length"] = int(keras.ops.convert_to_numpy(model.layers[-1].kl_warmup_length))
        record["config"] = {"prior": model.layers[-1].regularizer.get_config()}
    clean_probs = predict(x_test)
    record["clean"] = scores(clean_probs, y_test)
    for degrees in ROTATIONS[1:]:
        record[f"rotate_{degrees}"] = scores(predict(rotate(x_test, degrees)), y_test)
    record["rotate_0"] = record["clean"]
    for sd in NOISE_SDS:
        record[f"noise_{sd}"] = scores(predict(add_noise(x_test, sd, seed)), y_test)
    uniform = np.random.default_rng(seed).uniform(0.0, 1.0, x_test.shape).astype("float32")
    record["auroc_uniform"] = auroc(clean_probs, predict(uniform))
    if args.ood_digits:
        low = y < 5
        predict_04, _ = train(method, x[low], y[low], 5, 1000 * seed + 1, args.epochs)
        probs = predict_04(x_test)
        record["auroc_digits_5_9"] = auroc(probs[y_test < 5], probs[y_test >= 5])
    record["peak_memory_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    return record


def _worker(task):
    method, seed, args, path = task
    record = run_one(method, seed, args)
    cache.write(path, record)
    return record


# ---------------------------------------------------------------- summary

COLUMNS = [("clean", "accuracy"), ("clean", "nll"), ("clean", "ece"), ("clean", "brier")] + \
    [(f"rotate_{d}", "nll") for d in (30, 60, 90, 180)] + [(f"noise_{s}", "nll") for s in NOISE_SDS] + \
    [("auroc_uniform", None), ("auroc_digits_5_9", None), ("seconds_per_epoch", None), ("peak_memory_mb", None)]


def summary_markdown(records):
    groups = {}
    for r in records:
        groups.setdefault(r["method"], []).append(r)
    heads = [f"{k} {m}" if m else k for k, m in COLUMNS]
    lines = ["| method | seeds | " + " | ".join(heads) + " |", "|---|---|" + "---|" * len(COLUMNS)]
    for method in [m for m in METHODS if m in groups]:
        rows = groups[method]
        cells = []
        for key, metric in COLUMNS:
            values = np.array([r[key] if metric is None else r[key][metric] for r in rows if key in r], dtype=float)
            if not len(values):
                cells.append("-")
                continue
            se = values.std(ddof=1) / math.sqrt(len(values)) if len(values) > 1 else float("nan")
            digits = 1 if key in ("seconds_per_epoch", "peak_memory_mb") else 3
            cells.append(f"{values.mean():.{digits}f} ± {se:.{digits}f}")
        lines.append(f"| {method} | {len(rows)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(records, folder):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = {}
    for r in records:
        groups.setdefault(r["method"], []).append(r)
    for metric, name in (("accuracy", "rotation_accuracy.png"), ("nll", "rotation_nll.png")):
        fig, ax = plt.subplots(figsize=(6, 4))
        for method in [m for m in METHODS if m in groups]:
            values = np.array([[r[f"rotate_{d}"][metric] for d in ROTATIONS] for r in groups[method]])
            ax.plot(ROTATIONS, values.mean(0), marker="o", markersize=3, label=method)
        ax.set_xlabel("rotation (degrees)")
        ax.set_ylabel(metric if metric == "accuracy" else "NLL")
        if metric == "nll":
            ax.set_yscale("log")
        ax.set_title(f"MNIST CNN, rotated test set: {metric}")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(os.path.join(folder, name), dpi=110)
        plt.close(fig)


def make_parser():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", help="mnist.npz in the keras.datasets layout (default: download)")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=["plain", "dropout", "ensemble", "flipout",
                                                                          "dvi", "mcvi"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--train-rows", type=int, default=0, help="subsample the training rows (quick checks)")
    parser.add_argument("--test-rows", type=int, default=0, help="first rows of the test set only (quick checks)")
    parser.add_argument("--no-ood-digits", dest="ood_digits", action="store_false")
    parser.add_argument("--validation", action="store_true",
                        help="train on the first 50,000 training rows, score the last 10,000 (no test row is read)")
    parser.add_argument("--results", default="benchmarks/results/images")
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--summary-only", action="store_true")
    return parser


def main(argv=None):
    args = make_parser().parse_args(argv)
    os.makedirs(args.results, exist_ok=True)
    tasks = []  # seed-major: every method gets its first seed before any gets a second
    for seed in args.seeds:
        for method in args.methods:
            path = os.path.join(args.results, method, f"seed_{seed}.json")
            if not os.path.exists(path) and not args.summary_only:
                tasks.append((method, seed, args, path))
    context = multiprocessing.get_context("spawn")  # a fresh process per run: its own peak memory
    with context.Pool(max(1, args.jobs), maxtasksperchild=1) as pool:
        for record in pool.imap_unordered(_worker, tasks):
            print(_line(record), flush=True)
    records = []
    for method in METHODS:
        folder = os.path.join(args.results, method)
        if os.path.isdir(folder):
            for name in sorted(os.listdir(folder)):
                if name.endswith(".json"):
                    with open(os.path.join(folder, name)) as f:
                        records.append(json.load(f))
    if records:
        with open(os.path.join(args.results, "summary.md"), "w") as f:
            f.write(summary_markdown(records) + "\n")
        plot(records, args.results)
        print(summary_markdown(records))


def _line(r):
    return (f"{r['method']} seed {r['seed']}: acc {r['clean']['accuracy']:.4f} nll {r['clean']['nll']:.4f} "
            f"ece {r['clean']['ece']:.4f} rot60 nll {r['rotate_60']['nll']:.2f} auroc {r['auroc_uniform']:.3f}/"
            f"{r.get('auroc_digits_5_9', float('nan')):.3f} {r['seconds_per_epoch']:.1f} s/epoch")


if __name__ == "__main__":
    main()
