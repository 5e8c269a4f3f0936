"""Global inducing points against factorised DVI on UCI splits (2 x 50 ReLU networks).

    python benchmarks/global_inducing_uci.py --data ../shared/uci/boston --splits 0 1 2

Per split: inputs and target normalised with training statistics; metrics in original units.

* `gi`: `GlobalInducingDense` 2 x 50 ReLU, `num_inducing` points (default 100, from the
  training data), per-unit precisions, NealPrior, learned homoscedastic noise (start -3, App. H
  scale 10), 10 weight samples per step, full batch, Adam; evaluated with 100 samples.
* `dvi`: `DenseDVI` 2 x 50 ReLU, heteroscedastic head, empirical Bayes; `hodvi`: the same
  with a learned homoscedastic noise. Adam, batch 32 (the main job's recipe).

Prints a Markdown table (test log-likelihood and RMSE, mean and standard error over splits,
seconds per epoch) and writes it with JSON next to `--out`.
"""

import argparse
import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_dvi as kd  # noqa: E402
from keras_dvi import predictive  # noqa: E402
from keras_dvi.__main__ import load_uci  # noqa: E402


def normalise(train, test):
    (x, y), (xt, yt) = train, test
    xm, xs = x.mean(0), x.std(0)
    xs[xs == 0] = 1.0
    ym, ys = float(y.mean()), float(y.std()) or 1.0
    f = lambda a: ((a - xm) / xs).astype("float32")  # noqa: E731
    return f(x), ((y - ym) / ys).astype("float32"), f(xt), ((yt - ym) / ys).astype("float32"), ys


def run_gi(x, y, xt, yt, ys, args):
    n = len(x)
    model = keras.Sequential([
        keras.Input((x.shape[1],)),
        kd.GlobalInducingDense(50, "relu", num_inducing=args.inducing, num_train=n,
                               num_samples=10, precision="per_unit"),
        kd.GlobalInducingDense(50, "relu", precision="per_unit"),
        kd.GlobalInducingDense(1, output_layer=True, precision="per_unit"),
        kd.SampledHomoscedasticNoise(-3.0, log_variance_scale=10.0),
    ])
    model.compile(keras.optimizers.Adam(args.gi_lr), loss=kd.SampledGaussianELL())
    kd.initialize_from_data(model, x, y, seed=0)
    batch = min(n, args.gi_batch)
    epochs = max(1, args.gi_steps * batch // n)
    start = time.time()
    model.fit(x, y, epochs=epochs, batch_size=batch, verbose=0)
    per_epoch = (time.time() - start) / epochs
    samples = kd.predict_samples(model, xt, 100)
    ll = float(np.mean(predictive.sample_log_predictive_density(samples, yt, y_scale=ys)))
    mean = np.asarray(predictive.sample_regression_moments(samples)["mean"])[:, 0]
    return ll, float(np.sqrt(np.mean((mean - yt) ** 2)) * ys), per_epoch


def run_dvi(x, y, xt, yt, ys, args, homoscedastic):
    n = len(x)
    prior = kd.EmpiricalBayesRegularizer(n)
    layers = [keras.Input((x.shape[1],)), kd.DenseDVI(50, "relu", regularizer=prior),
              kd.DenseDVI(50, "relu", regularizer=prior)]
    layers += [kd.DenseDVI(1, regularizer=prior), kd.HomoscedasticNoise(-3.0)] if homoscedastic else [kd.DenseDVI(2, regularizer=prior)]
    model = keras.Sequential(layers)
    model.compile(keras.optimizers.Adam(args.dvi_lr), loss=kd.HeteroscedasticELL())
    start = time.time()
    model.fit(x, y, epochs=args.dvi_epochs, batch_size=32, verbose=0)
    per_epoch = (time.time() - start) / args.dvi_epochs
    out = model.predict(xt, verbose=0)
    ll = float(np.mean(predictive.log_predictive_density(out, yt, y_scale=ys)))
    return ll, float(predictive.rmse(out, yt, y_scale=ys)), per_epoch


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True)
    parser.add_argument("--splits", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--methods", nargs="+", default=["gi", "dvi", "hodvi"])
    parser.add_argument("--inducing", type=int, default=100)
    parser.add_argument("--gi-steps", type=int, default=2000)
    parser.add_argument("--gi-batch", type=int, default=10000)
    parser.add_argument("--gi-lr", type=float, default=1e-2)
    parser.add_argument("--dvi-epochs", type=int, default=200)
    parser.add_argument("--dvi-lr", type=float, default=1e-3)
    parser.add_argument("--out", default=None, help="path prefix of the .md/.json results")
    args = parser.parse_args(argv)
    results = {m: [] for m in args.methods}
    for split in args.splits:
        x, y, xt, yt, ys = normalise(*load_uci(args.data, split))
        for method in args.methods:
            keras.utils.set_random_seed(split)
            if method == "gi":
                r = run_gi(x, y, xt, yt, ys, args)
            else:
                r = run_dvi(x, y, xt, yt, ys, args, homoscedastic=method == "hodvi")
            results[method].append(r)
            print(f"split {split} {method}: test LL {r[0]:.3f} RMSE {r[1]:.3f} ({r[2]:.2f} s/epoch)", flush=True)
    name = os.path.basename(os.path.normpath(args.data))
    lines = [f"| {name} | test LL | RMSE | s/epoch |", "|---|---|---|---|"]
    summary = {}
    for method, rows in results.items():
        a = np.array(rows)
        se = a.std(0, ddof=1) / np.sqrt(len(a)) if len(a) > 1 else np.zeros(3)
        summary[method] = {"ll": a[:, 0].mean(), "ll_se": se[0], "rmse": a[:, 1].mean(), "rmse_se": se[1], "s_per_epoch": a[:, 2].mean(), "splits": args.splits}
        lines.append(f"| {method} | {a[:, 0].mean():.2f} ± {se[0]:.2f} | {a[:, 1].mean():.2f} ± {se[1]:.2f} | {a[:, 2].mean():.3f} |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        with open(args.out + ".md", "w") as f:
            f.write(f"`python {' '.join(sys.argv)}`\n\n{table}\n")
        with open(args.out + ".json", "w") as f:
            json.dump({"args": vars(args), "results": summary}, f, indent=1)


if __name__ == "__main__":
    main()
