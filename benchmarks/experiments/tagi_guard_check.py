"""Whether one of TAGI's guards acts on a UCI data set: each split is trained twice with the
paper's protocol (`benchmarks/uci.py`'s TAGI: 1 x 50 units, batches of 10, 40 epochs, its
cached cross-validated `sigma_V` and seed), with the guard and without it, and the weights and
test scores compared. `--guard shrink`: the variance guard `keras_dvi.tagi.maths.MAX_SHRINK` (not in
the paper; on against off). `--guard cap`: the update cap `max_step=1` (the conv networks'
default, off for dense ones) against no cap.

    python -m benchmarks.experiments.tagi_guard_check --data ../shared/uci/kin8nm --splits 0 1 2
    python -m benchmarks.experiments.tagi_guard_check --guard cap --data ../shared/uci/yacht --splits 0
"""

import argparse
import json
import os

import numpy as np
from benchmarks import uci  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True, help="a data set folder in the shared UCI layout")
    parser.add_argument("--splits", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--results", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "uci"),
                        help="benchmarks/uci.py's results (the cached sigma_V of each split)")
    parser.add_argument("--guard", default="shrink", choices=["shrink", "cap"])
    parser.add_argument("--validation", action="store_true",
                        help="train on 80%% of each split's training rows and score the other 20%% (uci.py's)")
    parser.add_argument("--out", default=None, help="a text file for the lines printed")
    args = parser.parse_args(argv)
    import keras_dvi as kd

    name = os.path.basename(os.path.normpath(args.data))
    options = argparse.Namespace(tagi_forward="linearized", tagi_init="xavier", seed=0)
    shrink, lines = kd.tagi.maths.MAX_SHRINK, []
    # (label, MAX_SHRINK, max_step) with the guard, then without it
    settings = ([("with the guard", shrink, "auto"), ("without", 0.0, "auto")] if args.guard == "shrink"
                else [("capped at 1", shrink, 1.0), ("uncapped", shrink, None)])
    for split in args.splits:
        data = uci.normalise(*uci.load_split(args.data, split, validation=args.validation))
        with open(os.path.join(args.results, name, "tagi", f"split_{split}.json")) as f:
            noise = json.load(f)["observation_noise"]
        runs = []
        for label, guard, max_step in settings:
            kd.tagi.maths.MAX_SHRINK = guard  # read when the update is traced
            try:
                model = uci.tagi_fit(data["x"], data["y"], noise, options.seed + split, options, max_step)
            finally:
                kd.tagi.maths.MAX_SHRINK = shrink
            runs.append((label, [np.asarray(v.value) for v in model.trainable_variables],
                         uci.tagi_scores(model, data["x_test"], data["y_test"], data["y_std"])))
        difference = max(float(np.abs(a - b).max()) for a, b in zip(runs[0][1], runs[1][1]))
        rows = "validation" if args.validation else "test"
        lines.append(f"{name} split {split} (sigma_V {noise}, {rows} rows): " + "; ".join(
            f"{label} LL {ll:.4f} RMSE {rmse:.5f}" for label, _, (ll, rmse) in runs) +
            f"; largest weight difference {difference:.3g}")
        print(lines[-1], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
