"""What the `sigma_V` grid of `benchmarks/uci.py --methods tagi` costs, from the training rows only.

`uci.py` picks TAGI's observation noise `sigma_V` from an octave grid (0.05, 0.1, 0.2, 0.4, 0.8)
by 5-fold cross-validation on the training rows, and caches every grid point's
cross-validated log-likelihood per split (`cv_ll`). If a change of `sigma_V` left the
network's fit alone, the cross-validated log-likelihood would be a Gaussian score of fixed
residuals, `LL(s) = c - log s - R / (2 s^2)`, best at `s = sqrt(R)`. This script fits `c`
and `R` to the chosen grid point and its better neighbour, checks the model on the third
point (the other neighbour), and reports, per data set (medians over the cached splits),
the best `sigma_V` and the gain over the chosen one. No test row is read. Records of the
refined search (`--tagi-noise-search refine`, the default since) hold more points: only the
grid's are read here, and "chosen" is the grid's choice.

    python -m benchmarks.experiments.tagi_noise_grid                     # every data set cached
    python -m benchmarks.experiments.tagi_noise_grid --results benchmarks/results/uci --datasets power
"""

import argparse
import collections
import glob
import json
import math
import os

import numpy as np
from benchmarks.uci import TAGI_NOISES  # noqa: E402 - the grid uci.py searches first


def fit_gaussian_score(s1, ll1, s2, ll2):
    """`(c, R)` of `LL(s) = c - log s - R / (2 s^2)` through `(s1, ll1)` and `(s2, ll2)`;
    `R <= 0` when the two points admit no interior maximum."""
    residual = (math.log(s2 / s1) - (ll1 - ll2)) * 2.0 / (1.0 / s1 ** 2 - 1.0 / s2 ** 2)
    return ll1 + math.log(s1) + residual / (2.0 * s1 ** 2), residual


def gaussian_score(c, residual, s):
    return c - math.log(s) - residual / (2.0 * s ** 2)


def grid_scores(record):
    """The cached cross-validated log-likelihoods of the octave grid's points only."""
    return {float(k): v for k, v in record["cv_ll"].items() if float(k) in TAGI_NOISES}


def analyse_split(record):
    """For one cached split: `{"best": sqrt(R), "gain": LL(best) - LL(chosen), "check": the
    model's error at the third grid point (None without one)}`, or `None` where the fit has no
    maximum."""
    cv = grid_scores(record)
    grid = sorted(cv)
    chosen = max(cv, key=cv.get)
    i = grid.index(chosen)
    neighbours = [grid[j] for j in (i - 1, i + 1) if 0 <= j < len(grid)]
    partner = max(neighbours, key=lambda g: cv[g])
    c, residual = fit_gaussian_score(chosen, cv[chosen], partner, cv[partner])
    if residual <= 0:
        return None
    best = math.sqrt(residual)
    others = [g for g in neighbours if g != partner]
    check = gaussian_score(c, residual, others[0]) - cv[others[0]] if others else None
    return {"best": best, "gain": gaussian_score(c, residual, best) - cv[chosen], "check": check}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", default="benchmarks/results/uci", help="uci.py's cache folder")
    parser.add_argument("--datasets", nargs="+", default=None, help="default: every one cached")
    args = parser.parse_args(argv)
    datasets = args.datasets or sorted(d for d in os.listdir(args.results) if os.path.isdir(os.path.join(args.results, d, "tagi")))
    lines = ["| data | splits | chosen sigma_V (counts) | best sigma_V (median) | gain over the chosen, nats (median) | "
             "check at the third point, nats (median abs.) |", "|---|---|---|---|---|---|"]
    for name in datasets:
        records = []
        for path in sorted(glob.glob(os.path.join(args.results, name, "tagi", "split_*.json"))):
            with open(path) as f:
                records.append(json.load(f))
        rows = [r for r in (analyse_split(rec) for rec in records) if r is not None]
        if not rows:
            continue
        chosen = collections.Counter(max(cv, key=cv.get) for cv in map(grid_scores, records))
        checks = [abs(r["check"]) for r in rows if r["check"] is not None]
        lines.append(f"| {name} | {len(rows)} | {', '.join(f'{k:g} ({v})' for k, v in sorted(chosen.items()))} | "
                     f"{np.median([r['best'] for r in rows]):.3f} | {np.median([r['gain'] for r in rows]):.3f} | "
                     + (f"{np.median(checks):.2f} |" if checks else "none |"))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
