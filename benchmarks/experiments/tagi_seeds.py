"""How much TAGI's fit of the training rows depends on the seed (issue 24, yacht split 4).

Trains `TAGIModel` with the UCI protocol (1 x 50 ReLU, batches of 10, 40 epochs, the paper's
initialisation) at one `sigma_V`, once per seed (the seed draws the initial means and the
batch order), and prints the log-likelihood and RMSE of the *training* rows (original units)
for each `max_step`. Test rows are never read: this separates an unstable fit from test rows
unlike the training rows.

    python -m benchmarks.experiments.tagi_seeds --data ../shared/uci/yacht --splits 4 3 --noise 0.05 --seeds 0 1 2 3 4 5
"""

import argparse

import numpy as np
from benchmarks import uci  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True, help="a folder in the standard UCI layout")
    parser.add_argument("--splits", nargs="+", type=int, default=[0])
    parser.add_argument("--noise", type=float, required=True, help="sigma_V (standardised targets)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4, 5])
    parser.add_argument("--max-steps", nargs="+", default=["none", "2", "1"],
                        help="TAGIModel max_step values ('none': the paper's uncapped update)")
    args = parser.parse_args(argv)
    protocol = uci.make_parser().parse_args([])  # the UCI benchmark's defaults (forward, prior)
    print("| split | max_step | training LL per seed | training RMSE per seed |")
    print("|---|---|---|---|")
    for split in args.splits:
        train, _ = uci.load_split(args.data, split)
        data = uci.normalise(train, train)  # the training rows only
        for label in args.max_steps:
            max_step = None if label == "none" else float(label)
            scores = np.array([uci.tagi_scores(uci.tagi_fit(data["x"], data["y"], args.noise, seed, protocol, max_step),
                                               data["x"], data["y"], data["y_std"]) for seed in args.seeds])
            print(f"| {split} | {label} | {' '.join(f'{v:.2f}' for v in scores[:, 0])} | "
                  f"{' '.join(f'{v:.2f}' for v in scores[:, 1])} |", flush=True)


if __name__ == "__main__":
    main()
