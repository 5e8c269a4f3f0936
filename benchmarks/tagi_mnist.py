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
* early stopping (`--stop-on`): on the validation rows' marginal likelihood, the criterion of
  the paper's section 3.4 ("stopped when the marginal likelihood ... for the validation set has
  reached its maximal value"): the Gaussian density of each row's tree observations (`+-1` on
  its path) under the output moments plus `sigma_V^2` (`scores`). Training stops after
  `--patience` epochs without a better value, or at `--max-epochs`. `--stop-on error` stops on
  the validation error instead (the first runs here; on 3,000 validation rows its noise, about
  0.3 points, stops 784-100-100 early, BENCHMARKS.md).
* reported: the test error after one epoch and at the early-stopped epoch (the best
  validation value), the test NLL there, seconds per epoch.
* `--engine compiled` (JAX): the seeds train together, each epoch one compiled program over
  the model's own `train_step` (`CompiledEpochs`), with its own shuffling (`epoch_order`):
  what makes batches of 1 affordable (784-800-800: about 6 s an epoch of five seeds on one
  H100; `fit` takes about 9 minutes an epoch of one seed under TensorFlow on two CPU cores, 2
  under JAX). Early stopping is read off the recorded curves, which gives what stopping
  would have.
* `--timing`: seconds per epoch of TAGI, of the same network trained by DVI (the library's
  defaults, Adam 1e-3, a 10-unit `DenseDVI` head and `SoftmaxDeltaELL`, as in
  `benchmarks/images.py`'s dense rows) and of a plain Keras network of the same shape, at the
  same batch sizes, in one process, interleaved (`--timing-rounds`, the fastest round kept),
  each timed on `--timing-rows` training rows and scaled to 60,000.

Every (width, batch, seed) is cached as JSON in `--results` (per epoch budget), so an
interrupted run resumes; each run rewrites `summary.md` there from every cached record.

    python -m benchmarks.tagi_mnist --data ../shared/data/mnist.npz --widths 100 --batches 10 --seeds 0 1 2 3 4
    KERAS_BACKEND=jax python -m benchmarks.tagi_mnist --data ../shared/data/mnist.npz --engine compiled --widths 800 --batches 1 --noise 0.1
    python -m benchmarks.tagi_mnist --data ../shared/data/mnist.npz --timing
"""

import argparse
import glob
import json
import os
import time

import numpy as np
from benchmarks.cache import cached, device  # noqa: E402
from benchmarks.images import load_mnist  # noqa: E402
from benchmarks.uci import tagi_initialize  # noqa: E402

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


def split_rows(n, seed):
    """`(training rows, validation rows)` of seed `seed`'s split of `n` rows (5% held out)."""
    rows = np.random.default_rng(seed).permutation(n)
    held = int(round(VALIDATION * n))
    return rows[held:], rows[:held]


def split(x, y, seed):
    fit, val = split_rows(len(x), seed)
    return (x[fit], y[fit]), (x[val], y[val])


def best_epoch(history):
    """The 1-based epoch of a validation curve's lowest value (lower is better; the first of
    equal minima)."""
    return 1 + int(np.argmin(history))


def patience_ran_out(history, patience):
    """Whether early stopping ends training after these epochs of a validation curve:
    `patience` epochs without a better value."""
    return len(history) - best_epoch(history) >= patience


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


def scores(model, x, y):
    """The TAGI predictive's scores of labelled rows, from the model's own logs (`evaluate`):
    `error` (%), `nll` (of the class probabilities, eq. 24) and `likelihood`, the mean log
    marginal likelihood of the rows' tree observations (minus `observation_nll`: the
    validation criterion the paper's early stopping maximises, section 3.4)."""
    logs = model.evaluate(x, y, batch_size=2000, verbose=0, return_dict=True)
    return {"error": 100.0 * (1.0 - float(logs["accuracy"])), "nll": float(logs["nll"]),
            "likelihood": -float(logs["observation_nll"])}


def evaluate(model, x, y):
    """`(error in %, NLL)` of the TAGI predictive probabilities."""
    s = scores(model, x, y)
    return s["error"], s["nll"]


def choose_noise(width, batch, data, args):
    """sigma_V with the lowest validation error after one epoch (seed 0's split)."""
    x, y, _, _ = data
    fit, held = split_rows(len(x), 0)
    engine = getattr(args, "engine", "fit")
    errors = {}
    for noise in args.noises:
        model = tagi_model(width, noise, 0, args.forward, args.init)
        if engine == "compiled":
            CompiledEpochs([model], x, y).run([epoch_order(fit, 0, 1)], batch)
        else:
            model.fit(x[fit], y[fit], batch_size=batch, epochs=1, verbose=0, shuffle=True)
        errors[str(noise)] = evaluate(model, x[held], y[held])[0]
    best = min(errors, key=errors.get)
    return {"width": width, "batch": batch, "observation_noise": float(best), "validation_error": errors,
            "forward": args.forward, "init": str(args.init), "engine": engine}


def stop_value(validation, stop_on):
    """The number early stopping minimises: the validation error (`"error"`) or minus the
    validation marginal log likelihood (`"likelihood"`, the paper's section 3.4)."""
    return validation["error"] if stop_on == "error" else -validation["likelihood"]


def run_seed(width, batch, seed, noise, data, args):
    x, y, x_test, y_test = data
    (x_fit, y_fit), (x_val, y_val) = split(x, y, seed)
    model = tagi_model(width, noise, seed, args.forward, args.init)
    stop_on = getattr(args, "stop_on", "likelihood")
    errors, history, best, seconds = [], [], None, []
    for epoch in range(1, args.max_epochs + 1):
        start = time.time()
        model.fit(x_fit, y_fit, batch_size=batch, epochs=1, verbose=0, shuffle=True)
        seconds.append(time.time() - start)
        validation = scores(model, x_val, y_val)
        errors.append(validation["error"])
        history.append(stop_value(validation, stop_on))
        if best is None or history[-1] < best[1]:
            test_error, test_nll = evaluate(model, x_test, y_test)
            best = (epoch, history[-1], test_error, test_nll)
        if epoch == 1:
            first = best[2:]  # the first epoch is always the best so far
        if patience_ran_out(history, args.patience):
            break
    return {"width": width, "batch": batch, "seed": seed, "observation_noise": noise, "forward": args.forward,
            "init": str(args.init), "stop_on": stop_on,
            "max_epochs": args.max_epochs, "patience": args.patience, "epochs_run": len(history),
            "validation_errors": errors, "validation_criterion": history,
            "one_epoch_test_error": first[0], "one_epoch_test_nll": first[1],
            "best_epoch": best[0], "test_error": best[2], "test_nll": best[3],
            "seconds_per_epoch": float(np.mean(seconds)), "num_fit": len(x_fit)}


# ---------------------------------------------------------------- compiled engine (JAX)


class CompiledEpochs:
    """Trains several runs of one TAGI network together, an epoch per call of one compiled
    JAX program (`--engine compiled`).

    Each batch goes through the model's own `TAGIModel.train_step` (JAX's stateless step, the
    one `fit` compiles), mapped over the runs with `jax.vmap` and looped over the epoch's
    batches with `jax.lax.scan`, so a batch costs no Python dispatch: with batches of 1 `fit`
    spends most of an epoch there (57,000 steps). The runs share the architecture and
    `sigma_V` and differ in initial weights and rows. `tests/test_tagi_mnist_harness.py`
    checks that an epoch gives `fit`'s weights for the same batches in the same order.

    Args:
        models: compiled `TAGIModel`s of one architecture and `observation_noise`.
        x, y: the training rows every run draws from.
    """

    def __init__(self, models, x, y):
        import jax
        import jax.numpy as jnp
        import keras

        if keras.backend.backend() != "jax":
            raise ValueError(f"--engine compiled needs the JAX backend (KERAS_BACKEND=jax); it is {keras.backend.backend()}.")
        self.models = models
        model = models[0]
        x, y = jnp.asarray(x), jnp.asarray(y)
        rest = ([v.value for v in model.non_trainable_variables], [v.value for v in model.optimizer.variables],
                [v.value for v in model.metrics_variables])

        def step(trainable, rows):  # one run's update on the batch `rows`
            _, (new, *_) = model.train_step((trainable, *rest), (x[rows], y[rows]))
            return new

        runs_step = jax.vmap(step)
        self._step = jax.jit(runs_step)
        self._epoch = jax.jit(lambda trainable, order: jax.lax.scan(
            lambda t, rows: (runs_step(t, rows), None), trainable, order)[0])

    def run(self, orders, batch):
        """One epoch: run `r` takes its rows in the order `orders[r]` (all the same length), in
        batches of `batch` (the last one smaller if they do not divide); the models' weights
        are updated. Returns the seconds it took."""
        import jax
        import jax.numpy as jnp

        start = time.time()
        orders = np.asarray(orders, dtype="int32")
        full = orders.shape[1] // batch * batch
        trainable = [jnp.stack([m.trainable_variables[i].value for m in self.models])
                     for i in range(len(self.models[0].trainable_variables))]
        if full:
            steps = orders[:, :full].reshape(len(orders), -1, batch).transpose(1, 0, 2)
            trainable = self._epoch(trainable, steps)
        if full < orders.shape[1]:
            trainable = self._step(trainable, orders[:, full:])
        jax.block_until_ready(trainable)
        for r, model in enumerate(self.models):
            for variable, value in zip(model.trainable_variables, trainable):
                variable.assign(value[r])
        return time.time() - start


def epoch_order(rows, seed, epoch):
    """The shuffled order of `rows` in epoch `epoch` of seed `seed` (compiled engine)."""
    return np.random.default_rng([seed, epoch]).permutation(rows)


def run_seeds_compiled(width, batch, seeds, noise, data, args, deadline=None):
    """`run_seed`'s protocol for several seeds at once (`CompiledEpochs`): every seed trains
    `args.max_epochs` epochs or until each has run out of patience (or until `deadline`, a
    `time.time()`), scoring validation and test rows after every epoch; early stopping is read
    off the validation curve afterwards, which gives what stopping would have (it changes no
    earlier epoch). Returns one `run_seed` record per seed, with the test curve added and
    `stopped_by_deadline` where the deadline ended a seed before its patience did."""
    import keras

    x, y, x_test, y_test = data
    models = [tagi_model(width, noise, seed, args.forward, args.init) for seed in seeds]
    rows = [split_rows(len(x), seed) for seed in seeds]
    engine = CompiledEpochs(models, x, y)
    stop_on = getattr(args, "stop_on", "likelihood")
    val, test, seconds = [[] for _ in seeds], [[] for _ in seeds], []
    for epoch in range(1, args.max_epochs + 1):
        seconds.append(engine.run([epoch_order(fit, seed, epoch) for seed, (fit, _) in zip(seeds, rows)], batch))
        for r, (model, (_, held)) in enumerate(zip(models, rows)):
            val[r].append(scores(model, x[held], y[held]))
            test[r].append(scores(model, x_test, y_test))
        shown = " ".join("{error:.2f}/{likelihood:.4f}".format(**v[-1]) for v in val)
        print(f"w{width} b{batch} epoch {epoch} ({seconds[-1]:.0f} s): validation error / likelihood {shown}, test "
              + " ".join("{error:.2f}".format(**t[-1]) for t in test), flush=True)
        curves = [[stop_value(e, stop_on) for e in v] for v in val]
        done = all(patience_ran_out(c, args.patience) for c in curves)
        if done or (deadline is not None and time.time() + seconds[-1] + 5 > deadline):
            break
    records = []
    for seed, v, t, (fit, _) in zip(seeds, val, test, rows):
        curve = [stop_value(e, stop_on) for e in v]
        run = next((n for n in range(1, len(v) + 1) if patience_ran_out(curve[:n], args.patience)), len(v))
        best = best_epoch(curve[:run])
        records.append({
            "width": width, "batch": batch, "seed": seed, "observation_noise": noise, "forward": args.forward,
            "init": str(args.init), "stop_on": stop_on, "max_epochs": args.max_epochs, "patience": args.patience,
            "epochs_run": run, "validation_errors": [e["error"] for e in v[:run]],
            "validation_criterion": curve[:run],
            "one_epoch_test_error": t[0]["error"], "one_epoch_test_nll": t[0]["nll"],
            "best_epoch": best, "test_error": t[best - 1]["error"], "test_nll": t[best - 1]["nll"],
            "seconds_per_epoch": float(np.mean(seconds)), "num_fit": len(fit), "epoch_seconds": seconds,
            "engine": "compiled", "runs_per_program": len(seeds), "backend": keras.backend.backend(),
            "device": device(), "validation_scores": v, "test_scores": t,
            "stopped_by_deadline": len(v) < args.max_epochs and not patience_ran_out(curve, args.patience)})
    return records


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


def seconds_cell(records):
    """Seconds per epoch of a row; the compiled engine's are those of all its seeds at once."""
    seconds = float(np.mean([r["seconds_per_epoch"] for r in records]))
    text = f"{seconds:.0f}" if seconds >= 10 else f"{seconds:.1f}"
    runs = records[0].get("runs_per_program")
    return text if not runs else f"{text} ({runs} seeds at once, {records[0]['device']})"


def summary_markdown(folder):
    records = []
    for path in sorted(glob.glob(os.path.join(folder, "w*_b*_e*", "seed_*.json"))):
        with open(path) as f:
            records.append(json.load(f))
    lines = ["| network | batch | sigma_V | seeds | epochs (max, patience) | error after 1 epoch (%) | early-stopped error (%) | "
             "test NLL | best epoch | s/epoch | paper: 1 epoch / early-stopped (e; sigma_V) |", "|" + "---|" * 11]
    groups = {}
    for r in records:
        groups.setdefault((r["width"], r["batch"], r["max_epochs"], r["forward"], r.get("init", "xavier"),
                           r.get("stop_on", "error")), []).append(r)
    for (width, batch, max_epochs, forward, init, stop_on), rs in sorted(groups.items(), key=str):
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
            ("" if forward == "linearized" else f" ({forward})") + ("" if init == "xavier" else f" (prior {init})") + \
            ("" if stop_on == "error" else f" (stop on {stop_on})")
        lines.append(f"| {name} | {batch} | {rs[0]['observation_noise']} | {len(rs)} | "
                     f"{np.mean([r['epochs_run'] for r in rs]):.1f} ({max_epochs}, {rs[0]['patience']}) | {stat('one_epoch_test_error')} | "
                     f"{stat('test_error')} | {stat('test_nll', 3)} | {np.mean([r['best_epoch'] for r in rs]):.1f} | "
                     f"{seconds_cell(rs)} | {paper} |")
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
    parser.add_argument("--stop-on", default="likelihood", choices=["likelihood", "error"],
                        help="early stopping's validation criterion: the marginal likelihood of the tree observations "
                             "(default, the paper's section 3.4) or the error; caches and rows kept apart")
    parser.add_argument("--engine", default="fit", choices=["fit", "compiled"],
                        help='"fit": one Keras fit per seed and epoch; "compiled" (JAX only): the seeds together, '
                             "an epoch per compiled program (CompiledEpochs; its own shuffling)")
    parser.add_argument("--deadline-s", type=float, default=None,
                        help="compiled engine: stop starting epochs after this many seconds (records say so)")
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
    deadline = None if args.deadline_s is None else time.time() + args.deadline_s
    tag = ("" if args.forward == "linearized" else f"_{args.forward}") + ("" if args.init == "xavier" else f"_init_{args.init}")
    stop = "" if args.stop_on == "error" else f"_stop_{args.stop_on}"  # error: the folders of the first runs
    for width in args.widths:
        for batch in args.batches:
            noise = args.noise
            if noise is None:
                choice = cached(os.path.join(args.results, f"noise_w{width}_b{batch}{tag}.json"),
                                lambda: choose_noise(width, batch, data, args),
                                lambda r: f"w{width} b{batch}: sigma_V {r['observation_noise']} ({r['validation_error']})")
                noise = choice["observation_noise"]
            folder = os.path.join(args.results, f"w{width}_b{batch}_e{args.max_epochs}{tag}{stop}")
            if args.engine == "compiled":
                todo = [seed for seed in args.seeds if not os.path.exists(os.path.join(folder, f"seed_{seed}.json"))]
                records = run_seeds_compiled(width, batch, todo, noise, data, args, deadline) if todo else []
                for record in records:
                    cached(os.path.join(folder, f"seed_{record['seed']}.json"), lambda: record,
                           lambda r: f"w{width} b{batch} seed {r['seed']}: 1 epoch {r['one_epoch_test_error']:.2f}%, "
                                     f"early-stopped {r['test_error']:.2f}% (epoch {r['best_epoch']}"
                                     f"{', cut short' if r['stopped_by_deadline'] else ''})")
                continue
            for seed in args.seeds:
                cached(os.path.join(folder, f"seed_{seed}.json"),
                       lambda: run_seed(width, batch, seed, noise, data, args),
                       lambda r: f"w{width} b{batch} seed {seed}: 1 epoch {r['one_epoch_test_error']:.2f}%, "
                                 f"early-stopped {r['test_error']:.2f}% (epoch {r['best_epoch']})")
    return summary_markdown(args.results)


if __name__ == "__main__":
    main()
