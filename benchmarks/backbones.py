"""The models people have, made Bayesian (issue 49, item 6): a CIFAR-style ResNet-20 and
MobileNetV2 under shift, plain against a deep ensemble, MC dropout, keras-dvi on the last
layer and the whole network converted.

    python -m benchmarks.backbones --data ../shared/data/mnist.npz                  # ResNet-20, 3 seeds
    python -m benchmarks.backbones --data ../shared/data/mnist.npz --networks mobilenetv2
    python -m benchmarks.backbones --data ../shared/data/mnist.npz --networks convnext --seeds 0 1
    python -m benchmarks.backbones --data ../shared/data/mnist.npz --validation     # choosing recipes

Protocol (fixed before any test score was seen; `benchmarks/images.py`'s shifts and metrics):

* data: MNIST from `--data` (the `keras.datasets.mnist` layout), pixels in [0, 1], zero-padded
  to 32x32 (one channel). The standard 60,000 training rows; the first `--test-rows` (default
  2,000) of the test set for every evaluation set, so that a keras-dvi network's 18
  evaluation sets cost minutes, not hours, on two cores.
* networks: `resnet20`, the CIFAR ResNet-20 of He et al. (2016; `benchmarks.conv_speed`:
  batch normalisation, `Add`, global pooling, dense 10), and `mobilenetv2`,
  `keras.applications.MobileNetV2(alpha=0.35, include_top=False, pooling="avg")` under a dense
  softmax layer; random initial weights; its batch normalisation with Keras' default momentum
  0.99, the ResNet-20's (changed after the first plain MobileNetV2: with keras.applications'
  0.999 the moving statistics of a 938-step training stay near their initial values, and the
  trained network classified its own training rows at chance in inference mode, 0.086, against
  0.954 with batch statistics). Added later, with its protocol fixed before any result:
  `convnext`, a small ConvNeXt (`convnext`: keras.applications' ConvNeXt blocks at widths
  32, 64, 128, with 1, 1, 2 blocks; layer normalisation, no batch normalisation; MC dropout
  before its dense layer, as the MobileNetV2's).
* training: Adam 1e-3, batches of 128, `--epochs` (default 2: 938 steps) for every plain
  network, sparse categorical cross-entropy.
* methods:
  - `plain`: one network (member 0 of the ensemble, seed `1000 * seed`).
  - `ensemble`: 5 plain networks (members 0-4, seeds `1000 * seed + 100 * member`), their
    softmax probabilities averaged.
  - `dropout`: MC dropout, the same network with dropout of rate 0.1 after every residual
    block and before the dense layer (ResNet-20; MobileNetV2: before the dense layer, the only
    place Keras' architecture leaves for it), trained as plain; 20 passes at test time, with
    dropout on and batch normalisation in inference mode.
  - `plain_finetuned` (a control, added after the first converted results): the plain
    network fine-tuned as `converted` is (the same steps and rows, Adam 1e-3, cross-entropy),
    with its batch normalisation frozen at the inference statistics, which is what the
    converted network's folded batch normalisation amounts to. It separates what fine-tuning
    with frozen statistics does from what the Bayesian layers do.
  - `last_layer`: `keras_dvi.convert(plain, last_layers=1)` with the plain backbone frozen
    (`trainable=False`: batch normalisation in inference mode), fine-tuned for
    `--finetune-steps` (default 150) with what `convert` compiles (`SoftmaxDeltaELL`, a copy
    of the plain optimizer) and `EmpiricalBayesRegularizer(60000)` at its defaults.
  - `converted`: `keras_dvi.convert(plain)` (every layer Bayesian, batch normalisation folded
    or fixed), fine-tuned likewise.
  The fine-tuning length follows from the cost target (the whole training of a converted
  network at most half a 5-member ensemble's), not from any score.
* evaluation sets (`images.py`): the clean test rows; rotations 15-180 degrees in 15-degree
  steps; Gaussian pixel noise of sd 0.1, 0.2, 0.4; uniform-noise images (AUROC of the
  predictive entropy against the clean rows).
* metrics: accuracy, NLL, ECE (15 bins), Brier, AUROC (keras-dvi networks: from
  `keras_dvi.predict`'s default probabilities, the softmax of the mean logits, and, in the
  rows marked "(probit)", from the same pass's probit probabilities, which use the logit
  variances); training seconds (a converted
  network's include its plain network's and the conversion), each relative to one plain
  training; seconds to predict 1,000 images with uncertainty (one keras-dvi pass; the
  ensemble's 5 passes; dropout's 20); peak resident memory of the run's process.

Plain networks are trained once per seed and member and cached as `.weights.h5` files with
their training seconds in `--results/<network>/models`; every (network, method, seed) runs in a
fresh process and is cached as JSON, so an interrupted run resumes. Every run rewrites
`summary.md` next to the cache.
"""

import argparse
import json
import math
import multiprocessing
import os
import resource
import time

import numpy as np

from benchmarks import cache
from benchmarks.classification import auroc, scores
from benchmarks.images import NOISE_SDS, ROTATIONS, VALIDATION_ROWS, add_noise, load_mnist, rotate

NETWORKS = ("resnet20", "mobilenetv2", "convnext")
#: The small ConvNeXt: `(channels, blocks)` of each stage, after a 4x4 patchifying stem
#: (32x32 -> 8x8 -> 4x4 -> 2x2).
CONVNEXT_STAGES = ((32, 1), (64, 1), (128, 2))
#: The batch-normalisation momentum of the MobileNetV2 (keras.applications builds it with 0.999).
BATCH_NORM_MOMENTUM = 0.99
METHODS = ("plain", "ensemble", "dropout", "plain_finetuned", "last_layer", "converted")
BATCH = 128
LEARNING_RATE = 1e-3
ENSEMBLE_SIZE = 5
DROPOUT_RATE = 0.1
DROPOUT_SAMPLES = 20
NUM_CLASSES = 10
#: A keras-dvi network's probabilities: `keras_dvi.predict`'s default (`"mean"`, the softmax of
#: the mean logits) and `"probit"` (the logit variances too; the docs' advice under shift).
PROBABILITY_METHODS = ("mean", "probit")


def pad(x):
    """28x28 MNIST images zero-padded to 32x32."""
    return np.pad(x, ((0, 0), (2, 2), (2, 2), (0, 0)))


def load(args):
    x, y, x_test, y_test = load_mnist(args.data)
    if args.validation:  # the last 10,000 training rows are scored; the test set is not read
        x, y, x_test, y_test = x[:-VALIDATION_ROWS], y[:-VALIDATION_ROWS], x[-VALIDATION_ROWS:], y[-VALIDATION_ROWS:]
    if args.train_rows:
        x, y = x[: args.train_rows], y[: args.train_rows]
    return pad(x), y, pad(x_test[: args.test_rows]), y_test[: args.test_rows]


# ---------------------------------------------------------------- networks


def _monte_carlo_dropout(rate):
    """A `Dropout` layer that drops at prediction too (MC dropout), while batch normalisation
    stays in inference mode: `model(x, training=True)` would switch both."""
    import keras

    class MonteCarloDropout(keras.layers.Dropout):
        def call(self, inputs, training=None):
            return super().call(inputs, training=True)

    return MonteCarloDropout(rate)


def _layer_scale(channels):
    """keras.applications' ConvNeXt `LayerScale` (private there): `x * gamma`, `gamma` 1e-6 at first."""
    import keras

    class LayerScale(keras.layers.Layer):
        def build(self, _):
            self.gamma = self.add_weight(shape=(channels,), initializer=keras.initializers.Constant(1e-6))

        def call(self, x):
            return x * self.gamma

    return LayerScale()


def convnext(input_shape=(32, 32, 1), dropout=0.0):
    """A small ConvNeXt (Liu et al., 2022), built as `keras.applications.ConvNeXtTiny` is (its
    blocks: a 7x7 depthwise convolution written as a `Conv2D` with one group per channel, layer
    normalisation, a 4x pointwise expansion with GELU, a projection, a layer scale, a residual
    sum `x + y`; layer normalisation and a 2x2 stride-2 convolution between stages; global
    pooling, layer normalisation, dense head) at `CONVNEXT_STAGES`' widths, logits out."""
    import keras

    layers = keras.layers
    inputs = keras.Input(input_shape)
    h = layers.LayerNormalization(epsilon=1e-6)(layers.Conv2D(CONVNEXT_STAGES[0][0], 4, strides=4)(inputs))
    for stage, (channels, blocks) in enumerate(CONVNEXT_STAGES):
        if stage:
            h = layers.Conv2D(channels, 2, strides=2)(layers.LayerNormalization(epsilon=1e-6)(h))
        for _ in range(blocks):
            branch = layers.Conv2D(channels, 7, padding="same", groups=channels)(h)
            branch = layers.LayerNormalization(epsilon=1e-6)(branch)
            branch = layers.Dense(4 * channels, activation="gelu")(branch)
            h = h + _layer_scale(channels)(layers.Dense(channels)(branch))
    h = layers.LayerNormalization(epsilon=1e-6)(layers.GlobalAveragePooling2D()(h))
    if dropout:
        h = _monte_carlo_dropout(dropout)(h)
    return keras.Model(inputs, layers.Dense(NUM_CLASSES)(h))


def network(name, dropout=0.0):
    """The plain Keras network, compiled: Adam 1e-3, sparse categorical cross-entropy."""
    import keras

    if name == "convnext":
        model = convnext(dropout=dropout)
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    elif name == "resnet20":
        from benchmarks.conv_speed import resnet20

        model = resnet20((32, 32, 1), dropout=dropout, dropout_layer=_monte_carlo_dropout)
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    else:
        backbone = keras.applications.MobileNetV2(input_shape=(32, 32, 1), alpha=0.35, include_top=False,
                                                  weights=None, pooling="avg")
        for layer in backbone.layers:  # Keras' default momentum, as in the ResNet-20 (see the docstring)
            if isinstance(layer, keras.layers.BatchNormalization):
                layer.momentum = BATCH_NORM_MOMENTUM
        h = backbone.output
        if dropout:
            h = _monte_carlo_dropout(dropout)(h)
        model = keras.Model(backbone.input, keras.layers.Dense(NUM_CLASSES, activation="softmax")(h))
        loss = keras.losses.SparseCategoricalCrossentropy()
    model.compile(keras.optimizers.Adam(LEARNING_RATE), loss=loss)
    return model


def probabilities(model, x):
    """Softmax probabilities of a plain network (its outputs are logits or probabilities)."""
    import keras

    out = model.predict(x, batch_size=500, verbose=0)
    if model.layers[-1].get_config().get("activation") == "softmax":
        return np.asarray(out, dtype="float64")
    return np.asarray(keras.ops.convert_to_numpy(keras.ops.softmax(out, axis=-1)), dtype="float64")


def _member_stem(name, seed, member, args, dropout=0.0):
    """The cache path of a plain network, less `.weights.h5` (weights) or `.json` (seconds)."""
    kind = "dropout" if dropout else "plain"
    return os.path.join(args.results, name, "models", f"{kind}_seed_{seed}_member_{member}")


def plain_member(name, seed, member, x, y, args, dropout=0.0):
    """`(model, training seconds)` of a plain network, trained once and cached as weights."""
    import keras

    stem = _member_stem(name, seed, member, args, dropout)
    keras.utils.set_random_seed(1000 * seed + 100 * member)
    model = network(name, dropout)
    if os.path.exists(stem + ".json"):
        model.load_weights(stem + ".weights.h5")
        with open(stem + ".json") as f:
            return model, json.load(f)["seconds"]
    start = time.time()
    model.fit(x, y, batch_size=BATCH, epochs=args.epochs, verbose=0)
    seconds = time.time() - start
    os.makedirs(os.path.dirname(stem), exist_ok=True)
    model.save_weights(stem + ".weights.h5")
    cache.write(stem + ".json", {"seconds": seconds, "epochs": args.epochs, "train_rows": len(x)})
    return model, seconds


def train(name, method, seed, x, y, args):
    """Trains `method`; returns `(predict(x) -> probabilities, seconds of training, details)`."""
    import keras

    import keras_dvi as kd
    from keras_dvi.predictive import class_probabilities

    if method in ("plain", "ensemble"):
        members = [plain_member(name, seed, m, x, y, args) for m in range(ENSEMBLE_SIZE if method == "ensemble" else 1)]
        models = [m for m, _ in members]
        return (lambda inputs: np.mean([probabilities(m, inputs) for m in models], axis=0),
                sum(s for _, s in members), {})
    if method == "dropout":
        model, seconds = plain_member(name, seed, 0, x, y, args, dropout=DROPOUT_RATE)

        def predict(inputs):  # every pass draws fresh dropout masks
            return np.mean([probabilities(model, inputs) for _ in range(DROPOUT_SAMPLES)], axis=0)

        return predict, seconds, {}
    plain, seconds = plain_member(name, seed, 0, x, y, args)
    start = time.time()
    keras.utils.set_random_seed(1000 * seed + 1)
    rows = args.finetune_steps * BATCH  # exactly that many steps: shuffled passes over the data, cut
    rng = np.random.default_rng(seed)
    order = np.concatenate([rng.permutation(len(x)) for _ in range(math.ceil(rows / len(x)))])[:rows]
    if method == "plain_finetuned":
        for layer in plain.layers:  # frozen: inference-mode statistics, as folded into `converted`
            if isinstance(layer, keras.layers.BatchNormalization):
                layer.trainable = False
        plain.compile(keras.optimizers.Adam(LEARNING_RATE), loss=plain.loss)
        plain.fit(x[order], y[order], batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        seconds += time.time() - start
        return (lambda inputs: probabilities(plain, inputs)), seconds, {
            "finetune_steps": int(keras.ops.convert_to_numpy(plain.optimizer.iterations))}
    prior = kd.EmpiricalBayesRegularizer(len(x))
    if method == "last_layer":
        for layer in plain.layers[:-1]:
            layer.trainable = False
        model = kd.convert(plain, regularizer=prior, last_layers=1)
    else:
        model = kd.convert(plain, regularizer=prior)
    history = model.fit(x[order], y[order], batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    seconds += time.time() - start
    details = {"finetune_steps": int(keras.ops.convert_to_numpy(model.optimizer.iterations)),
               "final_loss": float(history.history["loss"][-1]), "final_nll": float(history.history["nll"][-1]),
               "final_kl": float(history.history["kl"][-1])}

    def predict(inputs):  # one pass; the library's default probabilities and the probit ones
        outputs = model.predict(inputs, batch_size=500, verbose=0)
        return {kind: np.asarray(class_probabilities(outputs, method=kind), dtype="float64")
                for kind in PROBABILITY_METHODS}

    return predict, seconds, details


# ---------------------------------------------------------------- one run


def run_one(name, method, seed, args):
    x, y, x_test, y_test = load(args)
    predict, seconds, details = train(name, method, seed, x, y, args)
    if not os.path.exists(_member_stem(name, seed, 0, args) + ".json"):  # `dropout` trains its own network
        plain_member(name, seed, 0, x, y, args)
    with open(_member_stem(name, seed, 0, args) + ".json") as f:
        plain_seconds = json.load(f)["seconds"]
    predict(x_test[:500])  # compiled before it is timed
    start = time.time()
    clean = _by_method(predict(x_test))
    predict_seconds = time.time() - start
    record = {"network": name, "method": method, "seed": seed, "epochs": args.epochs, "train_rows": len(x),
              "test_rows": len(x_test), "validation": bool(args.validation), "device": cache.device(),
              "train_seconds": seconds, "train_relative": seconds / plain_seconds,
              "predict_seconds_per_1000": 1000 * predict_seconds / len(x_test), **details}
    sets = {"clean": x_test, **{f"rotate_{d}": rotate(x_test, d) for d in ROTATIONS[1:]},
            **{f"noise_{sd}": add_noise(x_test, sd, seed) for sd in NOISE_SDS}}
    probs = {key: clean if key == "clean" else _by_method(predict(inputs)) for key, inputs in sets.items()}
    uniform = _by_method(predict(np.random.default_rng(seed).uniform(0.0, 1.0, x_test.shape).astype("float32")))
    for kind in clean:  # "mean" (the library's default) at the top level; "probit" under its name
        target = record if kind == "mean" else record.setdefault(kind, {})
        for key in sets:
            target[key] = scores(probs[key][kind], y_test)
        target["rotate_0"] = target["clean"]
        target["auroc_uniform"] = auroc(clean[kind], uniform[kind])
    record["peak_memory_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    return record


def _by_method(probabilities):
    return probabilities if isinstance(probabilities, dict) else {"mean": probabilities}


def _worker(task):
    name, method, seed, args, path = task
    record = run_one(name, method, seed, args)
    cache.write(path, record)
    return record


# ---------------------------------------------------------------- summary

COLUMNS = [("clean", "accuracy"), ("clean", "nll"), ("clean", "ece")] + \
    [(f"rotate_{d}", "nll") for d in (30, 60, 90, 180)] + [("noise_0.4", "nll"), ("auroc_uniform", None),
                                                           ("train_relative", None), ("predict_seconds_per_1000", None),
                                                           ("peak_memory_mb", None)]


def summary_markdown(records):
    groups = {}
    for r in records:
        groups.setdefault((r["network"], r["method"]), []).append(r)
        if "probit" in r:  # the same run's probit probabilities, as a row of their own
            groups.setdefault((r["network"], r["method"] + " (probit)"), []).append({**r, **r["probit"]})
    heads = [f"{k} {m}" if m else k for k, m in COLUMNS]
    lines = ["| network | method | seeds | " + " | ".join(heads) + " |", "|---|---|---|" + "---|" * len(COLUMNS)]
    for key in [(n, m + k) for n in NETWORKS for m in METHODS for k in ("", " (probit)") if (n, m + k) in groups]:
        rows = groups[key]
        cells = []
        for column, metric in COLUMNS:
            values = np.array([r[column] if metric is None else r[column][metric] for r in rows], dtype=float)
            se = values.std(ddof=1) / math.sqrt(len(values)) if len(values) > 1 else float("nan")
            digits = 1 if column in ("train_relative", "predict_seconds_per_1000", "peak_memory_mb") else 3
            cells.append(f"{values.mean():.{digits}f}" + (f" ± {se:.{digits}f}" if len(values) > 1 else ""))
        lines.append(f"| {key[0]} | {key[1]} | {len(rows)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def make_parser():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", help="mnist.npz in the keras.datasets layout (default: download)")
    parser.add_argument("--networks", nargs="+", choices=NETWORKS, default=["resnet20"])
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--epochs", type=int, default=2, help="epochs of every plain network")
    parser.add_argument("--finetune-steps", type=int, default=150, help="training steps after `convert`")
    parser.add_argument("--train-rows", type=int, default=0, help="first training rows only (quick checks)")
    parser.add_argument("--test-rows", type=int, default=2000, help="first rows of the test set")
    parser.add_argument("--validation", action="store_true",
                        help="train on the first 50,000 training rows, score the last 10,000 (no test row is read)")
    parser.add_argument("--results", default=None, help="default: benchmarks/results/backbones[_validation]")
    parser.add_argument("--summary-only", action="store_true")
    return parser


def main(argv=None):
    args = make_parser().parse_args(argv)
    if args.results is None:
        args.results = "benchmarks/results/backbones" + ("_validation" if args.validation else "")
    os.makedirs(args.results, exist_ok=True)
    tasks = []  # seed-major: every method gets its first seed before any gets a second
    for name in args.networks:
        for seed in args.seeds:
            for method in args.methods:
                path = os.path.join(args.results, name, method, f"seed_{seed}.json")
                if not os.path.exists(path) and not args.summary_only:
                    tasks.append((name, method, seed, args, path))
    context = multiprocessing.get_context("spawn")  # a fresh process per run: its own peak memory
    with context.Pool(1, maxtasksperchild=1) as pool:
        for record in pool.imap(_worker, tasks):
            print(_line(record), flush=True)
    cache.summarise(args.results, "*/*/seed_*.json", summary_markdown)


def _line(r):
    return (f"{r['network']} {r['method']} seed {r['seed']}: acc {r['clean']['accuracy']:.4f} "
            f"nll {r['clean']['nll']:.4f} ece {r['clean']['ece']:.4f} rot60 nll {r['rotate_60']['nll']:.2f} "
            f"auroc {r['auroc_uniform']:.3f} train {r['train_relative']:.2f}x plain, "
            f"predict {r['predict_seconds_per_1000']:.2f} s / 1000")


if __name__ == "__main__":
    main()
