"""A setting chosen by the ELBO, as Ober & Aitchison choose their learning rate (App. K).

Reads the same method's UCI splits cached by `benchmarks/uci.py` in several `--results` folders
(one setting each, e.g. `--gi-lr 3e-3` and `--gi-lr 1e-2`) and chooses between them by each
run's `final_loss` (the negative ELBO per training row over its last 1,000 steps), never by a
test score: per split (the run with the lowest `final_loss`) and per data set (the folder with
the lowest mean `final_loss`). Prints each folder's test log-likelihood, the two choices', and
how often each folder was chosen. Only splits cached in every folder count.

    python -m benchmarks.uci --methods facgi --gi-prior standard --gi-lr 3e-3 --results runs/lr_3e-3 --data ../shared/uci/energy
    python -m benchmarks.uci --methods facgi --gi-prior standard --gi-lr 1e-2 --results runs/lr_1e-2 --data ../shared/uci/energy
    python -m benchmarks.experiments.select_by_elbo --label facgi_standard --results runs/lr_3e-3 runs/lr_1e-2
"""

import argparse
import math
import os

import numpy as np
from benchmarks import uci  # noqa: E402


def paired_splits(folders, label):
    """`{data set: {split: [record of each folder]}}` for the splits every folder has."""
    by_folder = []
    for folder in folders:
        records = {}
        for r in uci.cached_records(folder, label):
            if "final_loss" not in r:
                raise SystemExit(f"{folder}: split {r['split']} of {r['dataset']} has no final_loss (cached "
                                 "before uci.py recorded it): run it again into another --results folder.")
            records[(r["dataset"], r["split"])] = r
        by_folder.append(records)
    common = set.intersection(*(set(records) for records in by_folder))
    table = {}
    for dataset, split in sorted(common):
        table.setdefault(dataset, {})[split] = [records[(dataset, split)] for records in by_folder]
    return table


def choose(splits):
    """Test log-likelihoods of each folder, the per-split and the per-data-set choice, and the picks."""
    ll = np.array([[r["test_ll"] for r in runs] for runs in splits.values()])  # (splits, folders)
    loss = np.array([[r["final_loss"] for r in runs] for runs in splits.values()])
    per_split = np.argmin(loss, axis=1)
    per_data_set = int(np.argmin(loss.mean(axis=0)))
    return {"folders": ll.T, "per_split": ll[np.arange(len(ll)), per_split],
            "per_data_set": ll[:, per_data_set], "picks": np.bincount(per_split, minlength=ll.shape[1]),
            "data_set_pick": per_data_set}


def _cell(values):
    se = np.std(values, ddof=1) / math.sqrt(len(values)) if len(values) > 1 else float("nan")
    return f"{np.mean(values):.3f} ± {se:.3f}"


def markdown(table, folders):
    names = [os.path.basename(os.path.normpath(f)) for f in folders]
    lines = ["| data | splits | " + " | ".join(names) + " | chosen per split (picks) | chosen per data set |",
             "|---|---|" + "---|" * len(names) + "---|---|"]
    for dataset, splits in table.items():
        c = choose(splits)
        picks = ", ".join(f"{name} {count}" for name, count in zip(names, c["picks"]))
        lines.append(f"| {dataset} | {len(splits)} | " + " | ".join(_cell(v) for v in c["folders"])
                     + f" | {_cell(c['per_split'])} ({picks}) | {_cell(c['per_data_set'])} ({names[c['data_set_pick']]}) |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", nargs="+", required=True, help="uci.py --results folders, one setting each")
    parser.add_argument("--label", required=True, help="the cached method, e.g. facgi_per_unit_standard")
    args = parser.parse_args(argv)
    if len(args.results) < 2:
        parser.error("--results: give at least two folders to choose between")
    table = paired_splits(args.results, args.label)
    if not table:
        raise SystemExit(f"no split of {args.label} is cached in every one of {args.results}")
    text = markdown(table, args.results)
    print(text)
    return text


if __name__ == "__main__":
    main()
