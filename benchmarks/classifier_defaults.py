"""The ablation behind the classifier defaults: which objective, prior, initialisation and body
train a keras-dvi classifier on small data and short runs, measured on validation rows only.

    python -m benchmarks.classifier_defaults --jobs 2                 # every variant, 3 data sets
    python -m benchmarks.classifier_defaults --widths                 # the full ELBO and the defaults at other widths
    python -m benchmarks.classifier_defaults --summary-only

Each variant is a recipe of `benchmarks/classification.py` (its `--validation` protocol: 20% of
each training split held out and scored, never a test split; splits 0-2; 64-100-100-10 on the
digits, 13- and 30-100-100-C on scikit-learn's wine and breast cancer; Adam 3e-3, batches of
64, 100 epochs), run on the digits, wine and breast cancer, beside the plain MLP of the same
shape and the same network trained by IVON (a natural-gradient variational optimiser,
`ivon.py`). The summary (`summary_ablation.md` in `--results`) gives, per data set and variant,
accuracy, NLL, ECE, the training rows' `-ELBO / N` of the stated prior (`nll + kl`, KL weight
1), the training time in seconds (the plain network's too, where the recipe starts from one), and
on the digits the NLL at 60 degrees of rotation and the uniform-noise AUROC.
"""

import argparse
import glob
import json
import math
import os

import numpy as np
from benchmarks import classification  # noqa: E402

#: `(name, classification.py arguments)`.
#: `(name, classification.py arguments)`. The library's defaults: `kl_weight="auto"` (the KL
#: weight min(1, N / P)) and Jankowiak's bound; "full ELBO" is `--kl-weight 1`, "delta" the
#: delta method of Wu et al. (the defaults before this ablation: full ELBO, delta).
FULL_ELBO = ["--kl-weight", "1", "--loss-method", "delta"]
VARIANTS = [
    ("full ELBO, delta (empirical Bayes; the former defaults)", FULL_ELBO),
    ("tempered recipe (kl_weight 0.03, Jankowiak)", ["--kl-weight", "0.03"]),
    ("full ELBO, Jankowiak", ["--kl-weight", "1"]),
    ("fixed N(0, 1)", FULL_ELBO + ["--prior", "gauss:1"]),
    ("fixed N(0, 1 / fan_in)", FULL_ELBO + ["--prior", "fanin:1"]),
    ("fixed N(0, 2 / fan_in)", FULL_ELBO + ["--prior", "fanin:2"]),
    ("ScalePrior (Gamma(2, 2) on the precision scale, KL counted)", FULL_ELBO + ["--prior", "scale"]),
    ("empirical Bayes, floor 1 / fan_in", FULL_ELBO + ["--prior", "ebfloor:1"]),
    ("empirical Bayes, floor 2 / fan_in", FULL_ELBO + ["--prior", "ebfloor:2"]),
    ("KL weight min(1, N / P), delta", ["--loss-method", "delta"]),
    ("**KL weight min(1, N / P), Jankowiak (the defaults)**", []),
    ("Bayesian last layer (plain body), full ELBO, delta", FULL_ELBO + ["--body", "plain"]),
    ("means from a plain network (20 epochs), then the full ELBO", FULL_ELBO + ["--init", "plain", "--init-epochs", "20"]),
    ("initial variances 0.003 / fan_in, full ELBO", FULL_ELBO + ["--variance-scale", "0.003"]),
    ("train plain (20 epochs), convert, fine-tune 20 epochs, full ELBO", FULL_ELBO + ["--init", "plain", "--init-epochs",
                                                                                   "20", "--epochs", "20"]),
    ("train plain (20 epochs), convert, fine-tune 20 epochs, the defaults",
     ["--init", "plain", "--init-epochs", "20", "--epochs", "20"]),
]
#: IVON's rows: the plain network trained by IVON (`ivon.py`), the paper's Hessian momentum
#: and a faster one.
IVON = {"ivon": "IVON (the plain network, N(0, 1) prior, lambda = N, beta2 0.99999)",
        "ivon,beta2=0.999": "IVON, beta2 0.999"}
DATASETS = ("digits", "wine", "breast_cancer")
WIDTHS = ([50], [50, 50], [100], [400], [400, 400], [1000], [1000, 1000])
#: The recipes run at every width, beside the plain MLP: the full ELBO (delta), the defaults
#: (the KL weight rule with Jankowiak's bound), and the rule with the delta method.
WIDTH_RECIPES = (FULL_ELBO, [], ["--loss-method", "delta"])


def run(args):
    base = ["--validation", "--splits", *map(str, args.splits), "--results", args.results, "--jobs", str(args.jobs)]
    if args.widths:
        for dataset in args.datasets:
            for hidden in WIDTHS:
                for extra in WIDTH_RECIPES:
                    classification.main(base + ["--dataset", dataset, "--methods", "dvi", "--hidden",
                                                *map(str, hidden), *extra])
                classification.main(base + ["--dataset", dataset, "--methods", "mlp", "--hidden", *map(str, hidden)])
        return
    for dataset in args.datasets:
        classification.main(base + ["--dataset", dataset, "--methods", "mlp", "ivon"])
        classification.main(base + ["--dataset", dataset, "--methods", "ivon", "--ivon-beta2", "0.999"])
        for _, extra in VARIANTS:
            classification.main(base + ["--dataset", dataset, "--methods", "dvi", *extra])


def _mean_se(values):
    values = np.asarray([v for v in values if v is not None and np.isfinite(v)], dtype=float)
    if not len(values):
        return "-"
    se = values.std(ddof=1) / math.sqrt(len(values)) if len(values) > 1 else float("nan")
    return f"{values.mean():.3f}" + ("" if not np.isfinite(se) else f" ± {se:.3f}")


def summary(results):
    """One table per data set: every recipe cached in `results`."""
    records = []
    for path in sorted(glob.glob(os.path.join(results, "**", "split_*.json"), recursive=True)):
        with open(path) as f:
            records.append(json.load(f))
    labels = {classification.recipe_label("dvi", _namespace(extra)).replace("_validation", ""): name
              for name, extra in VARIANTS}
    out = []
    for dataset in DATASETS:
        rows = [r for r in records if r["dataset"] == dataset]
        if not rows:
            continue
        digits = dataset == "digits"
        out += [f"### {dataset}", "",
                "| recipe | splits | accuracy | NLL | ECE | -ELBO / N (train) | train nll | train kl | seconds"
                + (" | rot 60 NLL | AUROC uniform |" if digits else " |"),
                "|---|---|---|---|---|---|---|---|---|" + ("---|---|" if digits else "")]
        groups = {}
        for r in rows:
            groups.setdefault(r["recipe"].split("/")[-1].replace("_validation", ""), []).append(r)
        order = ["mlp"] + list(IVON) + list(labels)  # the plain MLP and IVON, then the variants (other widths: below)
        for recipe in [k for k in order if k in groups]:
            group = groups[recipe]
            name = labels.get(recipe, {"mlp": "plain MLP", **IVON}.get(recipe))
            elbo = [r["train_nll"] + r["train_kl"] if r.get("train_nll") is not None else None for r in group]
            cells = [_mean_se([r["clean"]["accuracy"] for r in group]), _mean_se([r["clean"]["nll"] for r in group]),
                     _mean_se([r["clean"]["ece"] for r in group]), _mean_se(elbo),
                     _mean_se([r.get("train_nll") for r in group]), _mean_se([r.get("train_kl") for r in group]),
                     _seconds(group)]
            if digits:
                cells += [_mean_se([r["rotate_60"]["nll"] for r in group]), _mean_se([r["auroc_uniform"] for r in group])]
            out.append(f"| {name} | {len(group)} | " + " | ".join(cells) + " |")
        out.append("")
    out += _widths_tables(records)
    text = "\n".join(out)
    with open(os.path.join(results, "summary_ablation.md"), "w") as f:
        f.write(text + "\n")
    return text


def _widths_tables(records):
    """Per data set, one row per hidden shape: accuracy / NLL of the MLP, the defaults and the
    KL weight rule (Jankowiak), and how many of the rule's and the defaults' splits collapsed
    (accuracy no better than the majority class of the held-out rows)."""
    out = []
    for dataset in DATASETS:
        rows = [r for r in records if r["dataset"] == dataset]
        table = []
        for hidden in [(100, 100)] + [tuple(h) for h in WIDTHS]:
            suffix = "" if hidden == (100, 100) else ",hidden=" + "x".join(map(str, hidden))
            cells = []
            for recipe in ("mlp", "dvi,kl_weight=1.0,loss_method=delta", "dvi", "dvi,loss_method=delta"):
                group = [r for r in rows if r["recipe"].split("/")[-1] == f"{recipe}{suffix}_validation"]
                if not group:
                    cells.append("-")
                    continue
                accuracy = np.mean([r["clean"]["accuracy"] for r in group])
                nll = np.mean([r["clean"]["nll"] for r in group])
                collapsed = 0 if recipe == "mlp" else sum(r["clean"]["nll"] > 0.9 * math.log(_classes(dataset))
                                                          for r in group)
                cells.append(f"{accuracy:.3f} / {nll:.3f}" + (f" ({collapsed} of {len(group)} at the prior)"
                                                              if collapsed else ""))
            if any(c != "-" for c in cells):
                table.append(f"| {'x'.join(map(str, hidden))} | " + " | ".join(cells) + " |")
        if table:
            out += [f"### {dataset}: widths (accuracy / NLL, validation rows, mean of splits)", "",
                    "| hidden | MLP | full ELBO, delta | defaults (KL weight rule, Jankowiak) | KL weight rule, delta |",
                    "|---|---|---|---|---|",
                    *table, ""]
    return out


def _classes(dataset):
    return {"digits": 10, "wine": 3, "breast_cancer": 2}[dataset]


def _seconds(group):
    """Mean training time of a recipe (older records kept seconds per epoch only)."""
    def one(r):
        if "seconds" in r:
            return r["seconds"]
        epochs = next((int(p.split("=")[1]) for p in r["recipe"].replace("_validation", "").split(",")
                       if p.startswith("epochs=")),
                      classification.EPOCHS)
        return r["seconds_per_epoch"] * epochs
    return f"{np.mean([one(r) for r in group]):.0f}"


def _namespace(extra):
    args = classification.make_parser().parse_args(["--validation", *extra])
    return args


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--datasets", nargs="+", default=list(DATASETS), choices=DATASETS)
    parser.add_argument("--splits", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--results", default="benchmarks/results/classifier_defaults")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--widths", action="store_true", help="the defaults and the KL weight rule at other widths")
    parser.add_argument("--summary-only", action="store_true")
    args = parser.parse_args(argv)
    if not args.summary_only:
        run(args)
    print(summary(args.results))


if __name__ == "__main__":
    main()
