"""Training cost: time to the same accuracy, keras-dvi's default recipe against a plain network
and a 5-member deep ensemble, on the digits benchmark's network (`classification.py`).

    python -m benchmarks.training_cost                  # 3 splits, validation rows, ~15 min

Every method trains the 64-100-100-10 ReLU network of `classification.py` (Adam 3e-3, batches
of 64, 100 epochs) on the training rows of a split less 20% held out (stratified), and is
scored on those held-out rows after every epoch: never on the test split. Only the time spent
in `fit` counts (scoring is outside the clock). The ensemble's members train one after the
other; its curve at epoch e averages the members' probabilities at epoch e and its time is the
sum of the members' times to epoch e (the compute of training 5 networks). Methods: `mlp`,
`ensemble`, `dvi` (the library defaults: `DenseDiagDVI` body, `DenseDVI` head,
`EmpiricalBayesRegularizer(num_train)`, `SoftmaxDeltaELL()`: the KL weight `min(1, N / P)`,
Jankowiak's bound), `dvi_elbo` (the full ELBO with the delta method: `kl_weight=1`,
`method="delta"`) and `dvi_tempered` (`kl_weight=0.03`, Jankowiak's bound).

Output: per method, seconds per epoch, the best validation accuracy, and the seconds to reach
accuracies 0.95, 0.96 and 0.97 (first epoch at or above; "-" if never), mean over splits.
Records are cached per method and split as JSON in `--results`; the summary is rewritten to
`summary.md` there. Runs are sequential and use the machine's threads: run it on an otherwise
idle machine.
"""

import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402

from benchmarks import cache  # noqa: E402
from benchmarks import classification as bench  # noqa: E402

METHODS = ("mlp", "ensemble", "dvi", "dvi_elbo", "dvi_tempered")
THRESHOLDS = (0.95, 0.96, 0.97)


def _curve(model, x, y, x_eval, y_eval, to_probs):
    """Fits `model` for the benchmark's budget; returns `(seconds, probabilities)` per epoch."""
    import keras

    class Clock(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.seconds, self.probs, self.total = [], [], 0.0

        def on_epoch_begin(self, epoch, logs=None):
            self.start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            self.total += time.perf_counter() - self.start
            self.seconds.append(self.total)
            self.probs.append(to_probs(self.model.predict(x_eval, verbose=0, batch_size=1024)))

    clock = Clock()
    model.fit(x, y, epochs=bench.EPOCHS, batch_size=bench.BATCH, verbose=0, callbacks=[clock])
    return np.array(clock.seconds), np.stack(clock.probs)


def run_one(method, split):
    import keras

    import keras_dvi as kd

    x, y, x_eval, y_eval = bench.load_split(split, validation=True)
    classes = 10
    softmax = lambda logits: np.asarray(keras.ops.convert_to_numpy(keras.ops.softmax(logits, axis=-1)))  # noqa: E731
    if method in ("mlp", "ensemble"):
        seconds, probs = 0.0, 0.0
        for member in range(bench.ENSEMBLE_SIZE if method == "ensemble" else 1):
            keras.utils.set_random_seed(1000 * split + 1000 * member)
            s, p = _curve(bench.plain_network(classes), x, y, x_eval, y_eval, softmax)
            seconds, probs = seconds + s, probs + p
        probs = probs / (bench.ENSEMBLE_SIZE if method == "ensemble" else 1)
    else:
        keras.utils.set_random_seed(1000 * split)
        kl_weight, loss_method = {"dvi": (None, None), "dvi_elbo": (1.0, "delta"), "dvi_tempered": (0.03, None)}[method]
        args = argparse.Namespace(kl_weight=kl_weight, kl_warmup_steps=None, loss_method=loss_method,
                                  variance_scale=None)
        model = bench.keras_dvi_network("dvi", len(x), classes, args)
        seconds, probs = _curve(model, x, y, x_eval, y_eval,
                                lambda out: np.asarray(kd.predictive.class_probabilities(out)))
    accuracy = (probs.argmax(-1) == y_eval[None]).mean(-1)
    nll = -np.log(np.maximum(probs[:, np.arange(len(y_eval)), y_eval], 1e-300)).mean(-1)
    return {"method": method, "split": split, "seconds": seconds.tolist(), "accuracy": accuracy.tolist(),
            "nll": nll.tolist()}


def time_to(record, threshold):
    reached = np.nonzero(np.array(record["accuracy"]) >= threshold)[0]
    return record["seconds"][reached[0]] if len(reached) else None


def summary_markdown(records):
    heads = ["seconds/epoch", "best accuracy", "final accuracy", "final NLL"] + [f"s to {t}" for t in THRESHOLDS]
    lines = ["| method | splits | " + " | ".join(heads) + " |", "|---|---|" + "---|" * len(heads)]
    for method in METHODS:
        rows = [r for r in records if r["method"] == method]
        if not rows:
            continue
        cells = [f"{np.mean([r['seconds'][-1] / len(r['seconds']) for r in rows]):.3f}",
                 f"{np.mean([max(r['accuracy']) for r in rows]):.3f}",
                 f"{np.mean([r['accuracy'][-1] for r in rows]):.3f}",
                 f"{np.mean([r['nll'][-1] for r in rows]):.3f}"]
        for t in THRESHOLDS:
            times = [time_to(r, t) for r in rows]
            reached = [s for s in times if s is not None]
            cell = f"{np.mean(reached):.1f}" if reached else "-"
            if len(reached) < len(rows):
                cell += f" ({len(reached)}/{len(rows)} splits)"
            cells.append(cell)
        lines.append(f"| {method} | {len(rows)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--splits", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--results", default="benchmarks/results/training_cost", help="cache folder")
    args = parser.parse_args(argv)
    for split in args.splits:
        for method in args.methods:
            cache.cached(os.path.join(args.results, f"{method}_split_{split}.json"), lambda: run_one(method, split),
                         announce=lambda r: f"{r['method']} split {r['split']}: {r['seconds'][-1]:.1f} s, "
                                           f"best accuracy {max(r['accuracy']):.3f}")
    return cache.summarise(args.results, "*_split_*.json", summary_markdown)


if __name__ == "__main__":
    main()
