"""How good is the Gaussian approximation? The paper's Figure 3 / Appendix C as a script.

    python -m benchmarks.approximation --out benchmarks/results/approximation.md

For each network (width 5, 25, 125; depth 2 and 5 ReLU layers: plain `DenseDVI` stacks, or a
linear `DenseDVI` followed by that many `SkipDVI` residual blocks; heteroscedastic 2-unit head; empirical Bayes) on the
bundled toy data: the deterministic output distribution is compared with 20,000 Monte Carlo
weight samples (`keras_dvi.predict_samples`) at 5 inputs (quantiles of the training inputs),
before training and after `--epochs` epochs (Adam 1e-3, batch 50; at 1e-2 the 5 x 125
residual network diverges within 15 steps: its output log-variance reaches -80), with the covariance
method `"paper"` and `"exact"` (the same posterior: trained once with `"paper"`, evaluated
both ways). Reported, as the largest over inputs and both output units:

* mean error in Monte Carlo standard deviations, `|m_DVI - m_MC| / sd_MC`;
* variance ratio `v_DVI / v_MC` (the one furthest from 1);
* Kolmogorov-Smirnov distance between the Monte Carlo samples and `N(m_DVI, v_DVI)`
  (0: identical; the Monte Carlo noise floor is about 0.01 for 20,000 samples).
"""

import argparse
import itertools
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from scipy import stats  # noqa: E402

from benchmarks.report import report  # noqa: E402
import keras_dvi as kd  # noqa: E402


def build(width, depth, skip, num_train, method="paper"):
    prior = kd.EmpiricalBayesRegularizer(num_train)
    layers = [keras.Input((1,))]
    if skip:  # a linear projection, then `depth` residual ReLU blocks on pre-activations
        layers.append(kd.DenseDVI(width, regularizer=prior))
        layers += [kd.SkipDVI("relu", regularizer=prior, covariance_approximation=method) for _ in range(depth)]
    else:
        layers += [kd.DenseDVI(width, "relu", regularizer=prior, covariance_approximation=method) for _ in range(depth)]
    layers.append(kd.DenseDVI(2, regularizer=prior))
    model = keras.Sequential(layers)
    model.compile(keras.optimizers.Adam(1e-3), loss=kd.HeteroscedasticELL())
    return model


def distances(model, x, num_samples, seed):
    mean, var = kd.unpack(model.predict(x, verbose=0), covariance="diagonal")
    mean, var = np.asarray(mean, dtype=float), np.asarray(var, dtype=float)
    samples = np.swapaxes(kd.predict_samples(model, x, num_samples, seed=seed), 0, 1).astype(float)  # (S, B, 2)
    mc_mean, mc_sd = samples.mean(axis=0), samples.std(axis=0)
    mean_err = np.max(np.abs(mean - mc_mean) / mc_sd)
    ratio = (var / mc_sd**2).ravel()
    worst_ratio = ratio[np.argmax(np.abs(np.log(ratio)))]
    ks = max(
        stats.kstest(samples[:, b, u], "norm", args=(mean[b, u], np.sqrt(var[b, u]))).statistic
        for b in range(x.shape[0]) for u in range(2)
    )
    return mean_err, worst_ratio, ks


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--widths", type=int, nargs="+", default=[5, 25, 125])
    parser.add_argument("--depths", type=int, nargs="+", default=[2, 5])
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--samples", type=int, default=20000)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    (x, y), _ = kd.datasets.load_toy_regression()
    points = np.quantile(x[:, 0], [0.05, 0.25, 0.5, 0.75, 0.95])[:, None].astype("float32")
    rows = []
    for width, depth, skip in itertools.product(args.widths, args.depths, (False, True)):
        keras.utils.set_random_seed(0)
        model = build(width, depth, skip, len(x))
        stages = {"init": model.get_weights()}
        start = time.time()
        model.fit(x, y, epochs=args.epochs, batch_size=50, verbose=0)
        stages["trained"] = model.get_weights()
        seconds = time.time() - start
        for method in ("paper", "exact"):
            probe = build(width, depth, skip, len(x), method)
            for stage, weights in stages.items():
                probe.set_weights(weights)
                d = distances(probe, points, args.samples, seed=1)
                rows.append((width, depth, "skip" if skip else "plain", method, stage) + d)
                print(rows[-1], f"(trained in {seconds:.0f} s)", flush=True)
    lines = [
        f"Toy data, {args.epochs} epochs, {args.samples} Monte Carlo samples, 5 inputs, both output units "
        "(largest over them).",
        "",
        "| width | depth | body | method | weights | mean error (MC sd) | variance ratio | KS distance |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append("| " + " | ".join(str(v) for v in r[:5]) + f" | {r[5]:.3f} | {r[6]:.3f} | {r[7]:.3f} |")
    report("\n".join(lines), args.out, "benchmarks.approximation", argv)


if __name__ == "__main__":
    main()
