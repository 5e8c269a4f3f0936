"""MNIST 500 (Ober & Aitchison 2021, Appendix N): factorised posteriors against global
inducing points on the first 500 MNIST training images.

Protocol (the paper's Appendix N and O where they say; fixed before any test score was seen):

* data: the first 500 images of MNIST's training set (`--data ../shared/data/mnist.npz`),
  normalised with the full training set's pixel mean and standard deviation; the 10,000 test
  images (curves on the first `--curve-rows`, default 1,000; the last point on all 10,000).
* network (the paper's LeNet-style one): conv 64 3x3 ReLU, max pool 2, conv 64 3x3 ReLU, max
  pool 2, conv 64 3x3 ReLU, linear 10 (on the flattened 7x7x64 maps); "same" padding.
* posteriors: `dvi` (factorised, closed-form moments: `Conv2DDVI`, `MaxPooling2DDVI`,
  `FlattenDVI`, `DenseDVI`; `SoftmaxDeltaELL()`, Jankowiak's bound), `mcvi` (factorised,
  sampled: `Conv2DMCVI`, `DenseMCVI`, `SampledSoftmaxELL`), `gi` (global inducing:
  `GlobalInducingConv2D`, `GlobalInducingDense`, `--inducing` points, initialised from the
  training images and labels as in Appendix O).
* priors: `neal` (`N(0, 1 / fan_in)`: `NealPrior` for global inducing,
  `GaussianPriorRegularizer(per_fan_in=True)` for the factorised layers) and `scale` (a learned
  per-layer precision scale with a Gamma(2, 2) prior: `ScalePrior`, `ScalePriorRegularizer`).
* objective: the ELBO, as in the paper (`kl_weight=1`, no warm-up); plus `dvi-defaults`, the
  library's classifier defaults (`EmpiricalBayesRegularizer`, `kl_weight="auto"`, the auto
  warm-up), for reference.
* training: full batches of 500, Adam 1e-3 (`--lr`), `--steps` steps (default 300: what two CPU cores
  allow, 2-4 s a step for the global inducing and sampled networks; the paper's step count is
  not stated); one weight draw per step for
  the sampled posteriors (`--samples`, as the paper's CIFAR-10 runs); 10 draws at test time.
* logged every `--every` steps: the ELBO per training point (`-(ELL + KL) / N` on the full
  training set, the sampled ones one estimate), test log likelihood and accuracy. The
  baseline of a uniform predictor is `log(1/10) = -2.30` for both.

Every (method, seed) runs in a fresh process and is cached as JSON in `--results`
(`benchmarks/results/mnist500`); every run rewrites `summary.md` and `curves.png` there.

Command: `python -m benchmarks.mnist500 --data ../shared/data/mnist.npz`.
"""

import argparse
import json
import multiprocessing
import os
import time

import numpy as np
from benchmarks.cache import cached  # noqa: E402
from benchmarks.images import load_mnist  # noqa: E402

METHODS = ["dvi-neal", "dvi-scale", "mcvi-neal", "mcvi-scale", "gi-neal", "gi-scale", "dvi-defaults"]
TRAIN_ROWS = 500
CHANNELS = 64
TEST_SAMPLES = 10
LEARNING_RATE = 1e-3


def load(path):
    x, y, x_test, y_test = load_mnist(path)
    mean, sd = x.mean(), x.std()
    return (x[:TRAIN_ROWS] - mean) / sd, y[:TRAIN_ROWS], (x_test - mean) / sd, y_test


def build(method, num_train, inducing, samples, learning_rate=LEARNING_RATE):
    import keras

    import keras_dvi as kd

    posterior, prior_name = method.split("-")
    elbo = dict(kl_weight=1.0, kl_warmup_steps=0)
    if posterior == "gi":
        prior = (kd.NealPrior if prior_name == "neal" else kd.ScalePrior)(num_train)
        gi = dict(num_inducing=inducing, regularizer=prior)
        layers = [
            keras.Input((28, 28, 1)),
            kd.GlobalInducingConv2D(CHANNELS, 3, "relu", num_samples=samples, **gi),
            keras.layers.TimeDistributed(keras.layers.MaxPooling2D()),
            kd.GlobalInducingConv2D(CHANNELS, 3, "relu", **gi),
            keras.layers.TimeDistributed(keras.layers.MaxPooling2D()),
            kd.GlobalInducingConv2D(CHANNELS, 3, "relu", **gi),
            keras.layers.TimeDistributed(keras.layers.Flatten()),
            kd.GlobalInducingDense(10, output_layer=True, **gi),
        ]
        loss = kd.SampledSoftmaxELL()
    else:
        if prior_name == "neal":
            prior = kd.GaussianPriorRegularizer(num_train, per_fan_in=True, **elbo)
        elif prior_name == "scale":
            prior = kd.ScalePriorRegularizer(num_train, **elbo)
        else:  # the library's classifier defaults
            prior = kd.EmpiricalBayesRegularizer(num_train)
        if posterior == "mcvi":
            conv = lambda **kw: kd.Conv2DMCVI(CHANNELS, 3, padding="same", activation="relu",  # noqa: E731
                                              regularizer=prior, **kw)
            pool = lambda: keras.layers.TimeDistributed(keras.layers.MaxPooling2D())  # noqa: E731
            layers = [keras.Input((28, 28, 1)), conv(num_samples=samples), pool(), conv(), pool(), conv(),
                      keras.layers.TimeDistributed(keras.layers.Flatten()), kd.DenseMCVI(10, regularizer=prior)]
            loss = kd.SampledSoftmaxELL()
        else:
            layers = [
                keras.Input((28, 28, 1)),
                kd.Conv2DDVI(CHANNELS, 3, padding="same", regularizer=prior),
                kd.MaxPooling2DDVI(2, activation="relu"),
                kd.Conv2DDVI(CHANNELS, 3, padding="same", regularizer=prior),
                kd.MaxPooling2DDVI(2, activation="relu"),
                kd.Conv2DDVI(CHANNELS, 3, padding="same", activation="relu", regularizer=prior),
                kd.FlattenDVI(),
                kd.DenseDVI(10, regularizer=prior),
            ]
            loss = kd.SoftmaxDeltaELL()
    model = keras.Sequential(layers)
    model.compile(keras.optimizers.Adam(learning_rate), loss=loss)
    return model


def test_scores(model, x, y):
    import keras_dvi as kd

    probs = kd.predict(model, x, num_samples=TEST_SAMPLES, batch_size=500)["probabilities"]
    probs = np.clip(probs, 1e-12, 1.0)
    return {"test_ll": float(np.mean(np.log(probs[np.arange(len(y)), y]))),
            "accuracy": float(np.mean(probs.argmax(axis=1) == y))}


def run_one(method, seed, args):
    import keras

    import keras_dvi as kd

    x, y, x_test, y_test = load(args.data)
    keras.utils.set_random_seed(seed)
    model = build(method, len(x), args.inducing, args.samples, args.lr)
    if method.startswith("gi"):
        kd.initialize_from_data(model, x, y, seed=seed)
    curve = []
    start = time.time()
    curve_x, curve_y = x_test[:args.curve_rows], y_test[:args.curve_rows]

    class Log(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            step = epoch + 1
            if step % args.every and step != args.steps:
                return
            train_seconds = time.time() - start - sum(p["eval_seconds"] for p in curve)
            t0 = time.time()
            point = {"step": step, "elbo": -float(logs["loss"]), "nll": float(logs["nll"]),
                     "kl": float(logs.get("kl", 0.0)), "train_seconds": train_seconds}
            point.update(test_scores(model, curve_x, curve_y))
            point["eval_seconds"] = time.time() - t0
            curve.append(point)
            print(method, seed, json.dumps({k: round(v, 4) for k, v in point.items()}), flush=True)

    model.fit(x, y, batch_size=TRAIN_ROWS, epochs=args.steps, verbose=0, shuffle=False, callbacks=[Log()])
    record = {"method": method, "seed": seed, "steps": args.steps, "inducing": args.inducing,
              "samples": args.samples, "lr": args.lr, "curve": curve,
              "seconds_per_step": curve[-1]["train_seconds"] / args.steps}
    record["final"] = test_scores(model, x_test, y_test)
    return record


def _worker(task):
    method, seed, args, path = task
    return cached(path, lambda: run_one(method, seed, args))


def summary_markdown(records):
    lines = ["| method | Adam lr | steps | seed | ELBO / N | test LL (10k) | accuracy (10k) "
             "| best test LL on the curve (step) | s / step |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    order = lambda r: (r.get("lr", LEARNING_RATE), r["steps"],  # noqa: E731
                       METHODS.index(r["method"]) if r["method"] in METHODS else 99, r["seed"])
    for r in sorted(records, key=order):
        best = max(r["curve"], key=lambda p: p["test_ll"])
        lines.append(f"| {r['method']} | {r.get('lr', LEARNING_RATE):g} | {r['steps']} | {r['seed']} | "
                     f"{r['curve'][-1]['elbo']:.3f} | {r['final']['test_ll']:.3f} | "
                     f"{r['final']['accuracy']:.3f} | {best['test_ll']:.3f} ({best['step']}) | {r['seconds_per_step']:.2f} |")
    lines.append("")
    lines.append("Uniform predictor: ELBO / N and test LL `log(1/10) = -2.303`.")
    return "\n".join(lines)


def plot(records, folder):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    colours = {m: f"C{i}" for i, m in enumerate(METHODS)}
    for r in records:
        steps = [p["step"] for p in r["curve"]]
        lr = r.get("lr", LEARNING_RATE)
        style = dict(color=colours.get(r["method"], "k"), linestyle="-" if lr != LEARNING_RATE else "--")
        for ax, key in zip(axes, ("elbo", "test_ll", "accuracy")):
            ax.plot(steps, [p[key] for p in r["curve"]], label=f"{r['method']}, lr {lr:g} ({r['seed']})", **style)
    for ax, key in zip(axes, ("ELBO / N (from -6 up)", "test log likelihood", "test accuracy")):
        ax.set_xlabel("step")
        ax.set_title(key)
        if key != "test accuracy":
            ax.axhline(np.log(0.1), color="grey", linestyle=":")
    axes[0].set_ylim(-6.0, 0.0)  # the baseline region; the factorised NealPrior ELBOs start near -300
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(folder, "curves.png"), dpi=100)


def make_parser():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", default=None)
    parser.add_argument("--results", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "mnist500"))
    parser.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--inducing", type=int, default=100)
    parser.add_argument("--samples", type=int, default=1)
    parser.add_argument("--curve-rows", type=int, default=1000)
    parser.add_argument("--lr", type=float, default=LEARNING_RATE,
                        help="Adam's learning rate (the paper's 1e-3; another value is cached apart)")
    return parser


def main(argv=None):
    args = make_parser().parse_args(argv)
    os.makedirs(args.results, exist_ok=True)
    context = multiprocessing.get_context("spawn")
    for method in args.methods:
        for seed in args.seeds:
            lr = "" if args.lr == LEARNING_RATE else f",lr={args.lr:g}"
            name = f"{method},seed={seed},steps={args.steps},inducing={args.inducing},samples={args.samples}{lr}.json"
            path = os.path.join(args.results, name)
            if os.path.exists(path):
                continue
            with context.Pool(1) as pool:  # a fresh process per run
                pool.map(_worker, [(method, seed, args, path)])
    records = []
    for name in sorted(os.listdir(args.results)):
        if name.endswith(".json"):
            with open(os.path.join(args.results, name)) as f:
                records.append(json.load(f))
    text = summary_markdown(records)
    with open(os.path.join(args.results, "summary.md"), "w") as f:
        f.write(text + "\n")
    print(text)
    plot(records, args.results)


if __name__ == "__main__":
    main()
