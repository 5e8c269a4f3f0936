"""Where a UCI split's test log-likelihood goes: DVI trained for several step budgets.

    python -m benchmarks.experiments.uci_overconfidence --data ../shared/uci/wine --split 8 --steps 6000 24000

Trains the `dvi` network of `benchmarks/uci.py` (same recipe, seeds and minibatch stream;
KL warm-up over the first half of each budget) and prints, per budget: the training objective
(-ELBO / N in normalised units, with its expected-log-likelihood and KL parts), the mean
train and test log-likelihood in original units, the three worst per-point log-likelihoods,
and the 1st / 50th / 99th percentiles of the predictive standard deviation (original units).
It shows whether a change in the mean test log-likelihood is spread over the points or
comes from a few over-confident ones (BENCHMARKS.md, "Boston and wine").
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True, help="folder in the UCI layout")
    parser.add_argument("--split", type=int, default=0)
    parser.add_argument("--steps", type=int, nargs="+", default=[6000, 24000])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    import keras
    import numpy as np

    from benchmarks import uci
    from keras_dvi import predictive

    data = uci.normalise(*uci.load_split(args.data, args.split))
    n = len(data["x"])
    name = os.path.basename(os.path.normpath(args.data))
    for steps in args.steps:
        # The `dvi` recipe is uci.py's defaults, with this budget.
        recipe = uci.make_parser().parse_args(["--steps", str(steps)])
        keras.utils.set_random_seed(args.seed + args.split)
        model = uci.build("dvi", data["x"].shape[1], n, recipe)
        batch = min(n, uci.BATCH)
        x, y = uci.epoch_stream(data["x"], data["y"], steps, batch, args.seed + args.split)
        model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)  # warm-up in the prior
        objective = model.evaluate(data["x"], data["y"], batch_size=n, verbose=0, return_dict=True)
        print(f"{name} split {args.split}, {steps} steps: -ELBO / N {objective['loss']:.3f} "
              f"(nll {objective['nll']:.3f}, kl {objective['kl']:.3f})")
        for part, inputs, targets in (("train", data["x"], data["y"]),
                                      ("test", data["x_test"], data["y_test"])):
            y_pred = model.predict(inputs, verbose=0)
            ll = np.asarray(predictive.log_predictive_density(y_pred, targets, y_scale=data["y_std"]))
            sd = np.sqrt(np.asarray(predictive.regression_moments(y_pred)["variance"])[:, 0]) * data["y_std"]
            print(f"  {part:5s} LL {ll.mean():7.3f}; worst three {np.round(np.sort(ll)[:3], 2)}; "
                  f"predictive sd p1 / p50 / p99 {np.round(np.percentile(sd, [1, 50, 99]), 3)}")
            if part == "train":
                train_sd = sd
        # Are the most confident training points repeated inputs (same features, other rows)?
        confident = np.argsort(train_sd)[: max(1, n // 100)]
        _, group, counts = np.unique(data["x"], axis=0, return_inverse=True, return_counts=True)
        repeated = counts[group.reshape(-1)[confident]] > 1
        print(f"  the {len(confident)} most confident training points: {repeated.sum()} have a "
              f"duplicate input row in the training set ({np.mean(counts[group.reshape(-1)] > 1):.0%} of all rows do)")


if __name__ == "__main__":
    main()
