"""Bayesian segmentation: a converted U-Net against its plain network and a deep ensemble, on
MNIST segmentation, clean and under shift.

Protocol (fixed before any test score was seen):

* data: MNIST (`--data ../shared/data/mnist.npz`), pixels in [0, 1]; each pixel's class is 0
  (background, the pixel below 0.5) or the digit's label + 1 (11 classes): telling a stroke
  from the background is local, naming its digit needs the whole image. The first
  `--train-rows` training images (default 20,000) train, the first `--test-rows` test images
  (default 2,000) are scored.
* network, the same for every method: a U-Net with concatenated skips: conv 16 + batch
  normalisation + ReLU, max pool, conv 32 + batch normalisation + ReLU, max pool, conv 64 +
  ReLU (7x7), transposed conv 32 (stride 2) + ReLU, concatenated with the 14x14 skip, conv 32
  + ReLU, transposed conv 16 (stride 2) + ReLU, concatenated with the 28x28 skip, conv 16 +
  ReLU, a 1x1 conv to 11 classes with a softmax at every pixel.
* training: Adam 1e-3, batches of 64, `--epochs` (default 2) for every plain network.
* methods: `plain`; `ensemble` (5 plain networks, seeds `seed * 10 + member`; their
  probabilities averaged); `dvi` (the plain network converted by `keras_dvi.convert` with
  `EmpiricalBayesRegularizer(num_train=train rows)`, the library's defaults, and fine-tuned
  one epoch: an image's loss the sum over its pixels); `dvi_mean` (the same, but the loss the
  mean over an image's pixels with the same `num_train`, the convention the library did not
  choose: the KL 784 times as strong for the data); `plain_tuned` (the plain network trained one
  epoch more: the fine-tuning's budget, the control). Probabilities: `softmax` of the mean
  logits (`keras_dvi.predict`'s default) and the probit approximation (`_probit` rows).
* evaluation sets: clean; rotated by 45 and 90 degrees (`scipy.ndimage.rotate`, order 1, the
  masks rotated with their images by nearest neighbour); Gaussian pixel noise of sd 0.4 (the
  masks of the clean images).
* metrics, over every pixel of every scored image: accuracy, NLL, ECE (15 bins), the mean
  intersection over union of the 11 classes, and the AUROC of telling the misclassified pixels
  by a higher predictive entropy (an uncertainty map's worth).

Each (method, seed) is cached as JSON in `--results`; every run rewrites `summary.md`.

    python -m benchmarks.segmentation --data ../shared/data/mnist.npz --seeds 0   # ~25 min on 2 cores
"""

import argparse
import os
import time

import numpy as np

from benchmarks import cache
from benchmarks.classification import scores

METHODS = ("plain", "plain_tuned", "ensemble", "dvi", "dvi_mean")
CLASSES = 11
BATCH = 64
LEARNING_RATE = 1e-3
ENSEMBLE_SIZE = 5
SHIFTS = ("clean", "rotate45", "rotate90", "noise0.4")


def load(args):
    """`(x_train, masks_train, x_test, masks_test)`: images `(n, 28, 28, 1)`, masks `(n, 28, 28)`."""
    from benchmarks.images import load_mnist

    x_train, y_train, x_test, y_test = load_mnist(args.data)
    x_train, y_train = x_train[:args.train_rows], y_train[:args.train_rows]
    x_test, y_test = x_test[:args.test_rows], y_test[:args.test_rows]
    return x_train, masks(x_train, y_train), x_test, masks(x_test, y_test)


def masks(x, labels):
    """Each pixel's class: 0 below 0.5, else the image's label + 1."""
    return np.where(x[..., 0] >= 0.5, labels[:, None, None] + 1, 0).astype("int32")


def shifted(x, y, shift, seed=0):
    """An evaluation set `(images, masks)`."""
    from scipy import ndimage

    if shift == "clean":
        return x, y
    if shift.startswith("rotate"):
        degrees = float(shift[len("rotate"):])
        images = np.clip(ndimage.rotate(x, degrees, axes=(1, 2), reshape=False, order=1), 0, 1).astype("float32")
        return images, ndimage.rotate(y, degrees, axes=(1, 2), reshape=False, order=0).astype("int32")
    sd = float(shift[len("noise"):])
    rng = np.random.default_rng(seed)
    return np.clip(x + rng.normal(0.0, sd, x.shape), 0, 1).astype("float32"), y


def unet():
    """The protocol's U-Net (plain Keras)."""
    import keras

    layers = keras.layers
    inputs = keras.Input((28, 28, 1))
    s1 = layers.ReLU()(layers.BatchNormalization()(layers.Conv2D(16, 3, padding="same")(inputs)))
    h = layers.MaxPooling2D(2)(s1)
    s2 = layers.ReLU()(layers.BatchNormalization()(layers.Conv2D(32, 3, padding="same")(h)))
    h = layers.MaxPooling2D(2)(s2)
    h = layers.Conv2D(64, 3, padding="same", activation="relu")(h)
    h = layers.Conv2DTranspose(32, 3, strides=2, padding="same", activation="relu")(h)
    h = layers.Conv2D(32, 3, padding="same", activation="relu")(layers.Concatenate()([h, s2]))
    h = layers.Conv2DTranspose(16, 3, strides=2, padding="same", activation="relu")(h)
    h = layers.Conv2D(16, 3, padding="same", activation="relu")(layers.Concatenate()([h, s1]))
    return keras.Model(inputs, layers.Conv2D(CLASSES, 1, activation="softmax")(h))


def plain_network(seed, x, y, epochs):
    import keras

    keras.utils.set_random_seed(seed)
    model = unet()
    model.compile(keras.optimizers.Adam(LEARNING_RATE), "sparse_categorical_crossentropy")
    model.fit(x, y, batch_size=BATCH, epochs=epochs, verbose=0)
    return model


def _mean_over_pixels_loss():
    """`SoftmaxDeltaELL` with an image's loss the mean over its pixels (`dvi_mean`)."""
    import keras_dvi as kd

    class MeanOverPixels(kd.SoftmaxDeltaELL):
        def call(self, y_true, y_pred):
            positions = float(np.prod(y_pred.shape[2:-1]))
            return super().call(y_true, y_pred) / positions

    return MeanOverPixels()


def train(method, seed, x, y, args):
    """`(predict, seconds)`: `predict(images)` gives `{name: probabilities (n, 28, 28, 11)}`."""
    import keras

    import keras_dvi as kd

    start = time.perf_counter()
    if method == "ensemble":
        members = [plain_network(seed * 10 + member, x, y, args.epochs) for member in range(ENSEMBLE_SIZE)]
        seconds = time.perf_counter() - start
        return (lambda images: {method: np.mean([m.predict(images, batch_size=256, verbose=0) for m in members], 0)},
                seconds)
    plain = plain_network(seed, x, y, args.epochs)
    if method == "plain":
        return lambda images: {method: plain.predict(images, batch_size=256, verbose=0)}, time.perf_counter() - start
    if method == "plain_tuned":
        plain.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
        return lambda images: {method: plain.predict(images, batch_size=256, verbose=0)}, time.perf_counter() - start
    converted = kd.convert(plain, regularizer=kd.EmpiricalBayesRegularizer(num_train=len(x)))
    if method == "dvi_mean":
        converted.compile(keras.optimizers.Adam(LEARNING_RATE), loss=_mean_over_pixels_loss())
    keras.utils.set_random_seed(seed)
    converted.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    seconds = time.perf_counter() - start

    def predict(images):
        out = {}
        for suffix, how in (("", "mean"), ("_probit", "probit")):
            out[method + suffix] = kd.predict(converted, images, batch_size=256, task="classification",
                                              probability_method=how)["probabilities"]
        return out

    return predict, seconds


def segmentation_scores(probabilities, masks_true):
    """The protocol's metrics over every pixel."""
    from sklearn.metrics import roc_auc_score

    rows = probabilities.reshape(-1, CLASSES).astype("float64")
    truth = masks_true.reshape(-1)
    result = scores(rows, truth)
    predicted = rows.argmax(1)
    ious = []
    for c in range(CLASSES):
        union = np.sum((predicted == c) | (truth == c))
        if union:
            ious.append(np.sum((predicted == c) & (truth == c)) / union)
    wrong = predicted != truth
    entropy = -np.sum(rows * np.log(np.maximum(rows, 1e-300)), axis=1)
    result["mean_iou"] = float(np.mean(ious))
    result["error_auroc"] = float(roc_auc_score(wrong, entropy)) if 0 < wrong.sum() < len(wrong) else None
    return result


def run_one(method, seed, args):
    import keras

    x, y, x_test, y_test = load(args)
    predict, seconds = train(method, seed, x, y, args)
    record = {"method": method, "seed": seed, "epochs": args.epochs, "train_rows": len(x), "test_rows": len(x_test),
              "seconds": seconds, "backend": keras.backend.backend(), "device": cache.device(), "scores": {}}
    for shift in SHIFTS:
        images, truth = shifted(x_test, y_test, shift, seed=100 + seed)
        for name, probabilities in predict(images).items():
            record["scores"].setdefault(name, {})[shift] = segmentation_scores(probabilities, truth)
    return record


def summary_markdown(records):
    lines = ["| method | seed | " + " | ".join(f"{s}: accuracy / NLL / ECE / mIoU / error AUROC" for s in SHIFTS)
             + " | training s |", "|---|---|" + "---|" * len(SHIFTS) + "---|"]
    for r in sorted(records, key=lambda r: (r["seed"], METHODS.index(r["method"]))):
        for name, by_shift in r["scores"].items():
            cells = []
            for shift in SHIFTS:
                s = by_shift[shift]
                auroc = "-" if s["error_auroc"] is None else f"{s['error_auroc']:.3f}"
                cells.append(f"{s['accuracy']:.4f} / {s['nll']:.3f} / {s['ece']:.4f} / {s['mean_iou']:.3f} / {auroc}")
            lines.append(f"| {name} | {r['seed']} | " + " | ".join(cells) + f" | {r['seconds']:.0f} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", help="mnist.npz in the keras.datasets layout (default: download)")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--train-rows", type=int, default=20_000)
    parser.add_argument("--test-rows", type=int, default=2_000)
    parser.add_argument("--results", default=os.path.join("benchmarks", "results", "segmentation"))
    args = parser.parse_args(argv)
    for seed in args.seeds:
        for method in args.methods:
            path = os.path.join(args.results, f"{method}_seed{seed}_rows{args.train_rows}_epochs{args.epochs}.json")
            cache.cached(path, lambda: run_one(method, seed, args),
                         lambda r: f"{r['method']} seed {r['seed']}: {r['seconds']:.0f} s")
            cache.summarise(args.results, "*.json", summary_markdown)


if __name__ == "__main__":
    main()
