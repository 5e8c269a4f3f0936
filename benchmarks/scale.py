"""The defaults at the sizes Keras users build: 100,000 rows, two hidden layers of 500 units.

    python -m benchmarks.scale            # both tasks, DVI defaults and a plain network, ~5 min
    python -m benchmarks.scale --tasks classification --epochs 40 --results benchmarks/results/scale_40_epochs

Synthetic data from scikit-learn, so nothing is downloaded: `make_classification` (100,000
rows, 20 features of which 10 informative, 5 classes, 5% label noise) and `make_friedman1`
(100,000 rows, 10 features, noise sd 1, targets standardised with the training rows). Inputs
standardised with the training rows; 80,000 rows train, 20,000 are held out and scored.

Network: 20-500-500-C (classification) or 10-500-500-2 (regression) ReLU; Adam 1e-3, batches
of 256, 10 epochs (3,130 steps; `--epochs`), for both methods. keras-dvi with its defaults exactly as the
README writes them (`dvi_elbo`: the full ELBO, `kl_weight=1` with the delta method): `DenseDiagDVI` body, `DenseDVI` head, `EmpiricalBayesRegularizer(num_train)`,
`SoftmaxDeltaELL()` / `HeteroscedasticELL()`; `keras_dvi.predict` for the scores. The plain
network: `Dense` layers, softmax cross-entropy or a Gaussian mean / log-variance head.

What it shows: whether the defaults train (no collapse to the prior) at this size, how they
compare with the plain network, and the time per epoch. Results are cached per task and
method as JSON in `--results`; `summary.md` there is rewritten from them.
"""

import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402

from benchmarks import cache  # noqa: E402

ROWS, TRAIN, WIDTH, EPOCHS, BATCH, LEARNING_RATE = 100_000, 80_000, 500, 10, 256, 1e-3


def load(task):
    from sklearn import datasets

    if task == "classification":
        x, y = datasets.make_classification(ROWS, 20, n_informative=10, n_classes=5, flip_y=0.05,
                                            random_state=0)
        y = y.astype("int32")
    else:
        x, y = datasets.make_friedman1(ROWS, n_features=10, noise=1.0, random_state=0)
        y = ((y - y[:TRAIN].mean()) / y[:TRAIN].std()).astype("float32")
    x = ((x - x[:TRAIN].mean(0)) / x[:TRAIN].std(0)).astype("float32")
    return x[:TRAIN], y[:TRAIN], x[TRAIN:], y[TRAIN:]


def network(task, method, features, outputs):
    import keras

    import keras_dvi as kd

    if method in ("dvi", "dvi_elbo"):  # dvi_elbo: the full ELBO with the delta method
        elbo = method == "dvi_elbo"
        prior = kd.EmpiricalBayesRegularizer(num_train=TRAIN, **({"kl_weight": 1.0} if elbo else {}))
        layers = [kd.DenseDiagDVI(WIDTH, "relu", regularizer=prior) for _ in range(2)]
        layers.append(kd.DenseDVI(outputs if task == "classification" else 2, regularizer=prior))
        softmax = kd.SoftmaxDeltaELL(method="delta") if elbo else kd.SoftmaxDeltaELL()
        loss = softmax if task == "classification" else kd.HeteroscedasticELL()
    else:
        layers = [keras.layers.Dense(WIDTH, "relu") for _ in range(2)]
        layers.append(keras.layers.Dense(outputs if task == "classification" else 2))
        if task == "classification":
            loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        else:
            def loss(y, out):
                y = keras.ops.reshape(keras.ops.cast(y, out.dtype), (-1,))
                return 0.5 * (np.log(2 * np.pi) + out[:, 1] + (y - out[:, 0]) ** 2 * keras.ops.exp(-out[:, 1]))
    model = keras.Sequential([keras.Input((features,))] + layers)
    model.compile(keras.optimizers.Adam(LEARNING_RATE), loss=loss)
    return model


def run_one(task, method, epochs=EPOCHS):
    import keras

    import keras_dvi as kd

    keras.utils.set_random_seed(0)
    x, y, x_eval, y_eval = load(task)
    classes = int(y.max()) + 1 if task == "classification" else None
    model = network(task, method, x.shape[1], classes)
    start = time.perf_counter()
    history = model.fit(x, y, epochs=epochs, batch_size=BATCH, verbose=2).history
    seconds = time.perf_counter() - start
    record = {"task": task, "method": method, "epochs": epochs, "seconds_per_epoch": seconds / epochs,
              "train_loss": history["loss"]}
    if method != "plain":
        record.update(train_nll=history.get("nll"), train_kl=history.get("kl"))
        out = kd.predict(model, x_eval)
    out_plain = None if method != "plain" else model.predict(x_eval, verbose=0, batch_size=4096).astype("float64")
    if task == "classification":
        if method != "plain":
            probs = out["probabilities"]
        else:
            logits = out_plain - out_plain.max(1, keepdims=True)
            probs = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
        true = np.maximum(probs[np.arange(len(y_eval)), y_eval], 1e-300)
        record.update(accuracy=float((probs.argmax(1) == y_eval).mean()), nll=float(-np.log(true).mean()))
    else:
        if method != "plain":
            mean, sd = out["mean"][:, 0], out["std"][:, 0]
        else:
            mean, sd = out_plain[:, 0], np.exp(0.5 * out_plain[:, 1])
        ll = -0.5 * np.log(2 * np.pi * sd**2) - 0.5 * ((y_eval - mean) / sd) ** 2
        record.update(rmse=float(np.sqrt(np.mean((y_eval - mean) ** 2))), log_likelihood=float(ll.mean()))
    return record


def summary_markdown(records):
    lines = ["| task | method | epochs | s / epoch | held-out scores | training loss, first -> last epoch |",
             "|---|---|---|---|---|---|"]
    for r in sorted(records, key=lambda r: (r["task"], r["method"])):
        scores = (f"accuracy {r['accuracy']:.3f}, NLL {r['nll']:.3f}" if r["task"] == "classification"
                  else f"log-likelihood {r['log_likelihood']:.3f}, RMSE {r['rmse']:.3f}")
        lines.append(f"| {r['task']} | {r['method']} | {r.get('epochs', EPOCHS)} | {r['seconds_per_epoch']:.1f} | {scores} | "
                     f"{r['train_loss'][0]:.3f} -> {r['train_loss'][-1]:.3f} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", nargs="+", default=["classification", "regression"],
                        choices=["classification", "regression"])
    parser.add_argument("--methods", nargs="+", default=["plain", "dvi"], choices=["plain", "dvi", "dvi_elbo"])
    parser.add_argument("--epochs", type=int, default=EPOCHS)
    parser.add_argument("--results", default="benchmarks/results/scale")
    args = parser.parse_args(argv)
    for task in args.tasks:
        for method in args.methods:
            cache.cached(os.path.join(args.results, f"{task}_{method}.json"),
                         lambda: run_one(task, method, args.epochs), announce=str)
    cache.summarise(args.results, "*.json", summary_markdown)


if __name__ == "__main__":
    main()
