"""TAGI on MNIST against the TAGI paper's Table 2 (issue 24), and TAGI's cost per epoch against
DVI and a plain Keras network of the same shape.

Protocol (the paper's, section 4.2):

* data: MNIST, `--data ../shared/data/mnist.npz` (the `keras.datasets.mnist` layout; without
  `--data`, `keras.datasets.mnist.load_data()`), pixels / 255, flattened. Each seed holds out a
  random 5% of the 60,000 training rows for validation; the network trains on the other 95%.
* networks: 784-W-W-11 `DenseDiagDVI` layers, ReLU, W = 100 or 800 (`--widths`), the last
  layer one unit per node of the classification tree (Appendix C), trained by
  `keras_dvi.TAGIModel` with the paper's initialisation (`--init he`: the authors' MNIST
  code's `1 / fan_in` prior instead; rows and caches kept apart), batches of 1 or 10 (`--batches`).
  `--widths cnn`: the CNN of the authors' cuTAGI MNIST example with average pooling (conv 32
  3x3 "same" ReLU, average pool 2, conv 64 3x3 "same" ReLU, average pool 2, dense 150 ReLU,
  11; `max_step="auto"` caps its updates; cuTAGI reports 2.07% error after one epoch with
  batches of 16 and max pooling, 0.65% after 50).
* `sigma_V` from {0.1, 0.2, 0.3, 0.4} (`--noises`): the value with the lowest validation error
  after one epoch, chosen once per (width, batch) on seed 0's split and kept for every seed
  (`--noise` fixes it instead).
* reported: the test error after one epoch, and the test error at the epoch of the lowest
  validation error (early stopping: training stops after `--patience` epochs without a better
  validation error, or at `--max-epochs`); the test NLL at that epoch; seconds per epoch.
* `--timing`: seconds per epoch of TAGI, of the same network trained by DVI (the library's
  defaults, Adam 1e-3, a 10-unit `DenseDVI` head and `SoftmaxDeltaELL`, as in
  `benchmarks/images.py`'s dense rows) and of a plain Keras network of the same shape, at the
  same batch sizes, in one process, interleaved (`--timing-rounds`, the fastest round kept),
  each timed on `--timing-rows` training rows and scaled to 60,000.

Every (width, batch, seed) is cached as JSON in `--results` (per epoch budget), so an
interrupted run resumes; each run rewrites `summary.md` there from every cached record.

    python benchmarks/tagi_mnist.py --data ../shared/data/mnist.npz --widths 100 --batches 10 --seeds 0 1 2 3 4
    python benchmarks/tagi_mnist.py --data ../shared/data/mnist.npz --timing
"""

import argparse
import glob
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cache import cached  # noqa: E402
from images import load_mnist  # noqa: E402
from uci import tagi_initialize  # noqa: E402

NOISES = (0.1, 0.2, 0.3, 0.4)
VALIDATION = 0.05
#: The paper's Table 2: test error (%) after one epoch, and early-stopped (mean +- sd).
PUBLISHED = {(100, 1): (3.39, 2.29, 0.06), (100, 10): (3.56, 2.45, 0.20),
             (800, 1): (3.15, 1.54, 0.07), (800, 10): (3.10, 1.53, 0.07)}
#: ... and its standard deviations of the one-epoch errors, its early-stopped epochs e and sigma_V.
PUBLISHED_DETAILS = {(100, 1): (0.17, "21 +- 12", 0.2), (100, 10): (0.2, "20 +- 12", 0.4),
                     (800, 1): (0.2, "14 +- 9", 0.1), (800, 10): (0.2, "15 +- 6", 0.4)}
CNN = "cnn"


def width_arg(value):
    return CNN if value == CNN else int(value)


def load(path):
    x, y, x_test, y_test = load_mnist(path)
    return x.reshape(len(x), -1), y, x_test.reshape(len(x_test), -1), y_test


def split(x, y, seed):
    rows = np.random.default_rng(seed).permutation(len(x))
    held = int(round(VALIDATION * len(x)))
    return (x[rows[held:]], y[rows[held:]]), (x[rows[:held]], y[rows[:held]])


def tagi_model(width, noise, seed, forward="linearized", initialize="xavier"):
    import keras

    import keras_dvi as kd

    units, _ = kd.tagi.tree(10)
    keras.utils.set_random_seed(seed)
    if width == CNN:
        body = [keras.layers.Reshape((28, 28, 1)), kd.Conv2DDVI(32, 3, padding="same", activation="relu"),
                kd.AveragePooling2DDVI(2), kd.Conv2DDVI(64, 3, padding="same", activation="relu"),
                kd.AveragePooling2DDVI(2), kd.FlattenDVI(), kd.DenseDiagDVI(150, "relu")]
    else:
        body = [kd.DenseDiagDVI(width, "relu"), kd.DenseDiagDVI(width, "relu")]
    network = keras.Sequential([keras.Input((784,))] + body + [kd.DenseDiagDVI(units)])
    model = kd.TAGIModel(network, observation_noise=noise, classes=10, seed=seed, forward=forward, initialize=initialize)
    model.compile(steps_per_execution=200)
    return model


def evaluate(model, x, y):
    """`(error in %, NLL)` of the TAGI predictive probabilities."""
    import keras_dvi as kd

    probs = kd.predict(model, x, batch_size=2000)["probabilities"]
    error = 100.0 * float(np.mean(probs.argmax(1) != y))
    nll = float(-np.mean(np.log(np.maximum(probs[np.arange(len(y)), y], 1e-300))))
    return error, nll


def choose_noise(width, batch, data, args):
    """sigma_V with the lowest validation error after one epoch (seed 0's split)."""
    x, y, _, _ = data
    (x_fit, y_fit), (x_val, y_val) = split(x, y, 0)
    errors = {}
    for noise in args.noises:
        model = tagi_model(width, noise, 0, args.forward, args.init)
        model.fit(x_fit, y_fit, batch_size=batch, epochs=1, verbose=0, shuffle=True)
        errors[str(noise)] = evaluate(model, x_val, y_val)[0]
    best = min(errors, key=errors.get)
    return {"width": width, "batch": batch, "observation_noise": float(best), "validation_error": errors,
            "forward": args.forward, "init": str(args.init)}


def run_seed(width, batch, seed, noise, data, args):
    x, y, x_test, y_test = data
    (x_fit, y_fit), (x_val, y_val) = split(x, y, seed)
    model = tagi_model(width, noise, seed, args.forward, args.init)
    history, best, seconds = [], None, []
    for epoch in range(1, args.max_epochs + 1):
        start = time.time()
        model.fit(x_fit, y_fit, batch_size=batch, epochs=1, verbose=0, shuffle=True)
        seconds.append(time.time() - start)
        val_error = evaluate(model, x_val, y_val)[0]
        history.append(val_error)
        if best is None or val_error < best[1]:
            test_error, test_nll = evaluate(model, x_test, y_test)
            best = (epoch, val_error, test_error, test_nll)
        if epoch == 1:
            first = best[2:]  # the first epoch is always the best so far
        if epoch - best[0] >= args.patience:
            break
    return {"width": width, "batch": batch, "seed": seed, "observation_noise": noise, "forward": args.forward,
            "init": str(args.init),
            "max_epochs": args.max_epochs, "patience": args.patience, "epochs_run": len(history),
            "validation_errors": history, "one_epoch_test_error": first[0], "one_epoch_test_nll": first[1],
            "best_epoch": best[0], "test_error": best[2], "test_nll": best[3],
            "seconds_per_epoch": float(np.mean(seconds)), "num_fit": len(x_fit)}


# ---------------------------------------------------------------- timing


def timing(data, args):
    """Seconds per 60,000-row epoch of TAGI, DVI and a plain network of each width and batch."""
    import keras

    import keras_dvi as kd

    x, y, _, _ = data
    x, y = x[: args.timing_rows], y[: args.timing_rows]

    def dvi(width):
        prior = kd.EmpiricalBayesRegularizer(60000)
        if width == CNN:
            body = [keras.layers.Reshape((28, 28, 1)), kd.Conv2DDVI(32, 3, padding="same", activation="relu",
                                                                    regularizer=prior),
                    kd.AveragePooling2DDVI(2), kd.Conv2DDVI(64, 3, padding="same", activation="relu", regularizer=prior),
                    kd.AveragePooling2DDVI(2), kd.FlattenDVI(), kd.DenseDiagDVI(150, "relu", regularizer=prior)]
        else:
            body = [kd.DenseDiagDVI(width, "relu", regularizer=prior), kd.DenseDiagDVI(width, "relu", regularizer=prior)]
        model = keras.Sequential([keras.Input((784,))] + body + [kd.DenseDVI(10, regularizer=prior)])
        model.compile(keras.optimizers.Adam(1e-3), loss=kd.SoftmaxDeltaELL(), steps_per_execution=200)
        return model

    def plain(width):
        if width == CNN:
            body = [keras.layers.Reshape((28, 28, 1)), keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
                    keras.layers.AveragePooling2D(2), keras.layers.Conv2D(64, 3, padding="same", activation="relu"),
                    keras.layers.AveragePooling2D(2), keras.layers.Flatten(), keras.layers.Dense(150, "relu")]
        else:
            body = [keras.layers.Dense(width, "relu"), keras.layers.Dense(width, "relu")]
        model = keras.Sequential([keras.Input((784,))] + body + [keras.layers.Dense(10)])
        model.compile(keras.optimizers.Adam(1e-3), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      steps_per_execution=200)
        return model

    builders = {"tagi": lambda w: tagi_model(w, 0.2, 0, args.forward), "dvi": dvi, "plain": plain}
    models = {(name, w, b): builders[name](w) for name in builders for w in args.widths for b in args.batches}
    for (name, w, b), model in models.items():  # compile and warm up
        model.fit(x[: 20 * b], y[: 20 * b], batch_size=b, epochs=1, verbose=0)
    times = {key: [] for key in models}
    for _ in range(args.timing_rounds):
        for key, model in models.items():
            start = time.time()
            model.fit(x, y, batch_size=key[2], epochs=1, verbose=0)
            times[key].append((time.time() - start) * 60000 / len(x))
    rows = [{"method": n, "width": w, "batch": b, "seconds_per_epoch": min(t)} for (n, w, b), t in times.items()]
    return {"rows": rows, "timing_rows": len(x), "rounds": args.timing_rounds, "backend": keras.backend.backend(),
            "threads": os.environ.get("TF_NUM_INTEROP_THREADS", "default")}


# ---------------------------------------------------------------- summary


def summary_markdown(folder):
    records = []
    for path in sorted(glob.glob(os.path.join(folder, "w*_b*_e*", "seed_*.json"))):
        with open(path) as f:
            records.append(json.load(f))
    lines = ["| network | batch | sigma_V | seeds | epochs (max, patience) | error after 1 epoch (%) | early-stopped error (%) | "
             "test NLL | best epoch | s/epoch | paper: 1 epoch / early-stopped (e; sigma_V) |", "|" + "---|" * 11]
    groups = {}
    for r in records:
        groups.setdefault((r["width"], r["batch"], r["max_epochs"], r["forward"], r.get("init", "xavier")), []).append(r)
    for (width, batch, max_epochs, forward, init), rs in sorted(groups.items(), key=str):
        def stat(key, digits=2):
            v = np.array([r[key] for r in rs], dtype=float)
            if len(v) == 1:
                return f"{v[0]:.{digits}f}"
            return f"{v.mean():.{digits}f} +- {v.std(ddof=1) / np.sqrt(len(v)):.{digits}f}"
        one, stopped, sd = PUBLISHED.get((width, batch), ("-", "-", "-"))
        one_sd, epochs, paper_noise = PUBLISHED_DETAILS.get((width, batch), ("-", "-", "-"))
        paper = (f"{one} +- {one_sd} / {stopped} +- {sd} ({epochs}; {paper_noise})" if (width, batch) in PUBLISHED
                 else "cuTAGI's example (max pooling, batches of 16): 2.07 / 0.65 after 50 epochs" if width == CNN
                 else "-")
        name = ("CNN 32-64-150-11" if width == CNN else f"784-{width}-{width}-11") + \
            ("" if forward == "linearized" else f" ({forward})") + ("" if init == "xavier" else f" (prior {init})")
        lines.append(f"| {name} | {batch} | {rs[0]['observation_noise']} | {len(rs)} | "
                     f"{np.mean([r['epochs_run'] for r in rs]):.1f} ({max_epochs}, {rs[0]['patience']}) | {stat('one_epoch_test_error')} | "
                     f"{stat('test_error')} | {stat('test_nll', 3)} | {np.mean([r['best_epoch'] for r in rs]):.1f} | "
                     f"{np.mean([r['seconds_per_epoch'] for r in rs]):.0f} | {paper} |")
    for timing_path in sorted(glob.glob(os.path.join(folder, "timing*.json"))):
        with open(timing_path) as f:
            t = json.load(f)
        lines += ["", f"Seconds per 60,000-row epoch ({t['backend']}, timed on {t['timing_rows']} rows, fastest of "
                  f"{t['rounds']} interleaved rounds):", "",
                  "| network | batch | TAGI | DVI | plain | TAGI / DVI |", "|---|---|---|---|---|---|"]
        by = {(r["method"], r["width"], r["batch"]): r["seconds_per_epoch"] for r in t["rows"]}
        for width, batch in sorted({(r["width"], r["batch"]) for r in t["rows"]}, key=str):
            tagi, dvi, plain = (by[(m, width, batch)] for m in ("tagi", "dvi", "plain"))
            name = "CNN 32-64-150" if width == CNN else f"784-{width}-{width}"
            lines.append(f"| {name} | {batch} | {tagi:.1f} | {dvi:.1f} | {plain:.1f} | {tagi / dvi:.2f} |")
    text = "\n".join(lines)
    with open(os.path.join(folder, "summary.md"), "w") as f:
        f.write(text + "\n")
    print(text)
    return text


def make_parser():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default=None, help="an .npz in keras.datasets.mnist's layout (default: download)")
    parser.add_argument("--widths", type=width_arg, nargs="+", default=[100, 800], help="100, 800 or cnn")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 10])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--noises", type=float, nargs="+", default=list(NOISES))
    parser.add_argument("--noise", type=float, default=None, help="a fixed sigma_V (skips the choice)")
    parser.add_argument("--max-epochs", type=int, default=20)
    parser.add_argument("--patience", type=int, default=3)
    parser.add_argument("--forward", default="linearized", choices=["linearized", "moments"])
    parser.add_argument("--init", type=tagi_initialize, default="xavier",
                        help='TAGIModel(initialize=...): "xavier" (the paper\'s), "he" (1 / fan_in, the authors\' MNIST '
                             "code) or a number c (c / fan_in); caches and rows are kept apart by it")
    parser.add_argument("--timing", action="store_true", help="time TAGI, DVI and a plain network instead")
    parser.add_argument("--timing-rows", type=int, default=6000)
    parser.add_argument("--timing-rounds", type=int, default=2)
    parser.add_argument("--results", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                          "tagi_mnist"))
    return parser


def main(argv=None):
    args = make_parser().parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    data = load(args.data)
    if args.timing:
        name = "timing.json" if args.widths == [100, 800] else f"timing_{'_'.join(map(str, args.widths))}.json"
        cached(os.path.join(args.results, name), lambda: timing(data, args))
        return summary_markdown(args.results)
    tag = ("" if args.forward == "linearized" else f"_{args.forward}") + ("" if args.init == "xavier" else f"_init_{args.init}")
    for width in args.widths:
        for batch in args.batches:
            noise = args.noise
            if noise is None:
                choice = cached(os.path.join(args.results, f"noise_w{width}_b{batch}{tag}.json"),
                                lambda: choose_noise(width, batch, data, args),
                                lambda r: f"w{width} b{batch}: sigma_V {r['observation_noise']} ({r['validation_error']})")
                noise = choice["observation_noise"]
            folder = os.path.join(args.results, f"w{width}_b{batch}_e{args.max_epochs}{tag}")
            for seed in args.seeds:
                cached(os.path.join(folder, f"seed_{seed}.json"),
                       lambda: run_seed(width, batch, seed, noise, data, args),
                       lambda r: f"w{width} b{batch} seed {seed}: 1 epoch {r['one_epoch_test_error']:.2f}%, "
                                 f"early-stopped {r['test_error']:.2f}% (epoch {r['best_epoch']})")
    return summary_markdown(args.results)


if __name__ == "__main__":
    main()
