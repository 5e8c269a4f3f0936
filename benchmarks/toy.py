"""Toy benchmark: the main job's network with DVI / dDVI and empirical Bayes / fixed prior.

Usage: python -m benchmarks.toy [--epochs 100] [--out benchmarks/results/toy.md]
Runs `python -m keras_dvi` in-process for the four combinations (same seed, same schedule)
and writes a Markdown table of train/test log-likelihood, RMSE and training time.
"""

import argparse

from keras_dvi.__main__ import main


def run(epochs, out):
    rows = []
    for method in ("dvi", "ddvi"):
        for prior in ("eb", "fixed"):
            r = main(["--method", method, "--prior", prior, "--epochs", str(epochs), "--verbose", "0", "--plot", ""])
            rows.append((method, prior, r))
    lines = [
        f"Toy heteroscedastic data (500 train / 100 test), 1-128-128-2 ReLU, {epochs} epochs, "
        "batch 50, Adam 1e-2, seed 0, 2-core CPU.",
        "",
        "| method | prior | train LL | test LL | test RMSE | train time (s) |",
        "|---|---|---|---|---|---|",
    ]
    for method, prior, r in rows:
        prior_name = "empirical Bayes" if prior == "eb" else "fixed N(0, 1)"
        lines.append(
            f"| {method.upper() if method == 'dvi' else 'dDVI'} | {prior_name} | {r['train_ll']:.3f} | "
            f"{r['test_ll']:.3f} | {r['test_rmse']:.4f} | {r['seconds']:.0f} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    with open(out, "w") as f:
        f.write(text)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--out", default="benchmarks/results/toy.md")
    args = parser.parse_args()
    run(args.epochs, args.out)
