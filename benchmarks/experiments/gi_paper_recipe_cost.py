"""What Appendix P's own recipe would cost here: the time of one training step of the paper's
UCI network (2 x 50 `GlobalInducingDense`, `NealPrior`, 10 weight draws) with per-unit
precisions and every training row an inducing point (the paper's batches of 10,000 rows cap
at the data set, so `M = N`), against the recipe of BENCHMARKS.md (shared precisions, 100
inducing points), and against the same 2 x 50 network factorised (`DenseMCVI`, 10 weight
draws a step) and plain (Keras `Dense`, mean squared error) with `--baselines`. The paper
trains 10,000 steps; the script prints the step time and what 10,000 steps and 20 splits take.

    python -m benchmarks.experiments.gi_paper_recipe_cost --data ../shared/uci/yacht ../shared/uci/power --baselines

Full batches (every training row in every step, as the paper's 10,000-row batches are for
these sets); the first `--warmup` steps (tracing) are not timed.
"""

import argparse
import os
import time
from benchmarks import uci  # noqa: E402


def step_seconds(folder, network, steps, warmup, precision="shared", inducing=100):
    """Seconds a full-batch training step of `network` ('gi', 'mcvi' or 'plain') takes."""
    import keras

    import keras_dvi as kd

    data = uci.normalise(*uci.load_split(folder, 0, False))
    n = len(data["x"])
    args = uci.make_parser().parse_args(["--gi-precision", precision, "--inducing", str(min(inducing, n)),
                                         "--hidden", "50", "50", "--steps-per-execution", "1"])
    keras.utils.set_random_seed(0)
    if network == "plain":
        model = keras.Sequential([keras.Input((data["x"].shape[1],)), keras.layers.Dense(50, "relu"),
                                  keras.layers.Dense(50, "relu"), keras.layers.Dense(1)])
        model.compile(keras.optimizers.Adam(1e-2), loss="mse", steps_per_execution=1)
    else:
        model = uci.build(network, data["x"].shape[1], n, args)
    if network == "gi":
        kd.initialize_from_data(model, data["x"], data["y"], seed=0)
    fit = lambda count: model.fit(data["x"], data["y"], batch_size=n, epochs=count, verbose=0)  # noqa: E731
    fit(warmup)
    start = time.time()
    fit(steps)
    return n, (time.time() - start) / steps


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", nargs="+", required=True)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--baselines", action="store_true", help="also time DenseMCVI and a plain network")
    args = parser.parse_args(argv)
    recipes = [("ours: shared, M = 100", "gi", "shared", 100), ("paper: per-unit, M = N", "gi", "per_unit", 10**6)]
    if args.baselines:
        recipes += [("`DenseMCVI`, 10 draws", "mcvi", "shared", 100), ("plain Keras", "plain", "shared", 100)]
    print("| data | N | recipe | s / step | 10,000 steps (h) | 20 splits (h) |")
    print("|---|---|---|---|---|---|")
    for folder in args.data:
        name = os.path.basename(os.path.normpath(folder))
        for label, network, precision, inducing in recipes:
            n, seconds = step_seconds(folder, network, args.steps, args.warmup, precision, inducing)
            print(f"| {name} | {n} | {label} | {seconds:.3g} | {seconds * 1e4 / 3600:.2g} | "
                  f"{seconds * 2e5 / 3600:.2g} |", flush=True)


if __name__ == "__main__":
    main()
