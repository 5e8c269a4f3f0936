"""UCI regression benchmark: DVI, dDVI, MCVI, hoDVI and global inducing points.

    python -m benchmarks.uci --data ../shared/uci/boston ../shared/uci/yacht --jobs 2

Standard protocol (`../shared/uci/README.md`): every split (default all 20); inputs and target
normalised with the training split's statistics; test log-likelihood and RMSE reported in the
target's original units; mean and standard error over splits. One fixed recipe for every data
set, tuned on no data set's test split:

* `dvi`, `ddvi`, `mcvi`, `hodvi`: one hidden layer of 50 ReLU units (`--hidden`), empirical
  Bayes prior (`alpha = 1`, `beta = 10`), Adam with batches of 32 for `--steps` updates
  (6,000; batches drawn from fresh permutations of the training rows), learning rate `--lr`
  (1e-2) decayed to 1% along a cosine (`--no-cosine`: constant). The schedule was chosen on
  the training objective alone: at a constant 1e-3, -ELBO / N on boston was still 2.1 after
  6,000 steps (0.75 after 24,000); the cosine schedule reaches 0.86 in 6,000 (BENCHMARKS.md
  has the history). KL warm-up (`keras_dvi.KLWarmup`, as in the authors' code): the KL weight
  rises linearly from 0 to 1 over the first `--kl-warmup` updates (default: half the run,
  3,000), then the full ELBO is trained for the rest; `--kl-warmup 0` turns it off (the
  recipe of `benchmarks/results/uci_no_warmup`). `dvi`: a `DenseDiagDVI` first layer (after
  data it computes exactly what `DenseDVI` does, in the compact form), `DenseDVI` layers
  after it and as the heteroscedastic head; `ddvi`: `DenseDiagDVI` layers throughout, so the head's mean/log-variance
  covariance is dropped as well (with one hidden layer that is the only difference: hidden
  units after a deterministic input are uncorrelated); `mcvi`: `DenseMCVI` with 10 weight
  samples per step (`--mcvi-samples`), evaluated with 100; `hodvi`: DVI with a learned
  homoscedastic noise (`HomoscedasticNoise` starting at log-variance -3 with the Appendix H
  scale of 10, as for `gi`: unscaled, Adam at 1e-3 cannot reach yacht's log-variance of
  about -6 in time).
* `gi`: 2 x 50 ReLU `GlobalInducingDense`, 100 inducing points from the training data,
  shared precisions (eq. 11; `--gi-precision per_unit` for App. K's per-unit ones, about 5x
  slower), NealPrior, learned homoscedastic noise (start -3, App. H scale 10), 10 samples
  per step, batches of `--gi-batch` rows (1,000; full batches for smaller data sets), Adam
  1e-2 for `--gi-steps` (3,000) updates; evaluated with 100 samples (Ober & Aitchison 2021,
  App. K/O, shorter: they take 10,000 full-batch steps, every training row an inducing point:
  `--gi-precision per_unit --inducing all --gi-batch 10000 --gi-steps 10000`; their rule, as many
  inducing points as a batch has rows, is `--inducing batch`). No KL warm-up.
  A cached global inducing split records its recipe (`--inducing`, `--gi-steps`, `--gi-batch`,
  `--gi-lr`); a run asking for another one in the same `--results` folder is an error.

Every fixed-recipe split also records `final_loss`, the training loss (the negative ELBO per
training row) averaged over its last 1,000 steps: the objective the paper chooses its learning
rate by (`--gi-lr 3e-3` and `1e-2` in two `--results` folders, then
`benchmarks/experiments/select_by_elbo.py`).

Results are cached per data set, method and split (`--results`, JSON files), so an
interrupted run resumes where it stopped (a cached result made with another `--kl-warmup` is
an error, not reused); `--jobs 2` runs two splits at a time (one process
per job, one thread each). On a GPU, several jobs share it (each process takes GPU memory as
it needs it, not all of it up front), e.g. the paper's whole global inducing recipe:

    KERAS_BACKEND=jax python -m benchmarks.uci --jobs 12 --methods gi --gi-prior standard \
        --gi-precision per_unit --inducing all --gi-batch 10000 --gi-steps 10000 \
        --results benchmarks/results/uci_gi_paper_recipe --data ../shared/uci/energy

Prints the table of the data sets, methods and splits asked for,
and rewrites `summary.md` and `summary.json` next to the cache from every split cached there
(`summary_gi_per_unit.*` for the `--gi-precision per_unit` results), so a run on one data
set keeps the others in the summary; `--summary-only` just summarises what is cached.
"""

import argparse
import concurrent.futures
import glob
import json
import math
import multiprocessing
import os
import time
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
from benchmarks import cache  # noqa: E402

METHODS = ("dvi", "ddvi", "mcvi", "hodvi", "gi", "facgi", "dvigi", "tagi")

#: The methods trained with the global inducing recipe (`--gi-*`).
GI_METHODS = ("gi", "facgi", "dvigi")

#: Minibatch size of the factorised methods (`dvi`, `ddvi`, `mcvi`, `hodvi`).
BATCH = 32


def cache_label(method, gi_precision="shared", tagi_forward="linearized", gi_prior="neal"):
    """The cache folder (`<results>/<data set>/<label>/`) of a method's splits. Per-unit
    global inducing results are cached apart from the shared-precision ones, and `ScalePrior`
    and `StandardPrior` ones apart from `NealPrior` ones; TAGI with exact moments apart from the
    linearised one."""
    if method == "tagi" and tagi_forward == "moments":
        return "tagi_moments"
    if method not in GI_METHODS:
        return method
    return method + ("_per_unit" if gi_precision == "per_unit" else "") + ("" if gi_prior == "neal" else "_" + gi_prior)


#: Summary files and the cache folders each one covers.
SUMMARIES = {"summary": tuple(cache_label(m) for m in METHODS),
             "summary_gi_per_unit": (cache_label("gi", "per_unit"),),
             "summary_gi_scale": (cache_label("gi", gi_prior="scale"), cache_label("gi", "per_unit", gi_prior="scale"),
                                  cache_label("facgi", gi_prior="scale")),
             "summary_gi_standard": tuple(cache_label(m, p, gi_prior="standard") for m in GI_METHODS
                                          for p in ("shared", "per_unit")),
             "summary_tagi_moments": (cache_label("tagi", tagi_forward="moments"),)}

#: Published test log-likelihoods: Wu et al. 2019 Table 2 (DVI, dDVI, MCVI, hoDVI) and
#: Ober & Aitchison 2021 Appendix P (`gi`, `facgi`: the best of three priors, from `APPENDIX_P` below).
PUBLISHED = {
    "boston": {"dvi": -2.41, "ddvi": -2.42, "mcvi": -2.46, "hodvi": -2.58},
    "energy": {"dvi": -1.01, "ddvi": -1.06, "mcvi": -1.03, "hodvi": -2.09},
    "kin8nm": {"dvi": 1.13, "ddvi": 1.13, "mcvi": 1.14, "hodvi": 1.01},
    "power": {"dvi": -2.80, "ddvi": -2.80, "mcvi": -2.80, "hodvi": -2.82},
    "wine": {"dvi": -0.90, "ddvi": -0.91, "mcvi": -0.92, "hodvi": -0.96},
    "yacht": {"dvi": -0.47, "ddvi": -0.47, "mcvi": -0.68, "hodvi": -1.41},
}
#: Ober & Aitchison 2021, Appendix P (Table 5): test log-likelihood and standard error of
#: 2 x 50 BNNs, global inducing (`gi`) and factorised to global (`facgi`), under each prior.
APPENDIX_P = {
    ("gi", "standard"): {"boston": (-2.59, 0.03), "energy": (-0.73, 0.03), "kin8nm": (1.22, 0.01),
                         "power": (-2.80, 0.01), "wine": (-0.96, 0.01), "yacht": (-0.68, 0.03)},
    ("gi", "neal"): {"boston": (-2.55, 0.05), "energy": (-0.72, 0.02), "kin8nm": (1.18, 0.01),
                     "power": (-2.82, 0.01), "wine": (-0.97, 0.01), "yacht": (-0.81, 0.03)},
    ("gi", "scale"): {"boston": (-2.50, 0.04), "energy": (-0.73, 0.02), "kin8nm": (1.19, 0.01),
                      "power": (-2.82, 0.01), "wine": (-0.96, 0.01), "yacht": (-0.79, 0.02)},
    ("facgi", "standard"): {"boston": (-2.60, 0.02), "energy": (-0.68, 0.03), "kin8nm": (1.28, 0.01),
                            "power": (-2.79, 0.01), "wine": (-0.96, 0.01), "yacht": (-1.12, 0.02)},
    ("facgi", "neal"): {"boston": (-2.63, 0.05), "energy": (-0.70, 0.02), "kin8nm": (1.29, 0.01),
                        "power": (-2.81, 0.01), "wine": (-0.96, 0.01), "yacht": (-1.04, 0.01)},
    ("facgi", "scale"): {"boston": (-2.61, 0.04), "energy": (-0.74, 0.02), "kin8nm": (1.29, 0.00),
                         "power": (-2.81, 0.01), "wine": (-0.96, 0.01), "yacht": (-0.97, 0.05)},
}
PRIOR_NAMES = {"standard": "N(0, 1)", "neal": "NealPrior", "scale": "ScalePrior"}
for (_method, _prior), _cells in APPENDIX_P.items():  # PUBLISHED: the best of the three priors
    for _name, (_ll, _se) in _cells.items():
        PUBLISHED[_name][_method] = max(PUBLISHED[_name].get(_method, -math.inf), _ll)


def cached_records(results, label):
    """Every split cached in `<results>/<data set>/<label>/`, all data sets."""
    records = []
    for path in sorted(glob.glob(os.path.join(results, "*", label, "split_*.json"))):
        with open(path) as f:
            records.append(json.load(f))
    return records


def meets(mean, se, published):
    """Whether a mean reaches the published figure minus its standard error (bold in tables)."""
    return mean >= published - (0.0 if math.isnan(se) else se)


def appendix_p_markdown(results):
    """Appendix P's Table 5 against the shared-precision runs cached in `results`: one row per
    data set, a column per method and prior, `ours ± se (paper ± se)`, bold where ours reaches
    the paper's figure minus our standard error; then the best of three priors of each (the
    paper's bold cells), for comparison only (chosen on test scores, as in the paper).
    `None` when no global inducing run is cached."""
    cells = {}
    for method, prior in APPENDIX_P:
        for row in summarise(cached_records(results, cache_label(method, gi_prior=prior)), [method]):
            if row["dataset"] in APPENDIX_P[method, prior]:  # the paper's data sets only
                cells[row["dataset"], method, prior] = row
    if not cells:
        return None
    datasets = sorted({d for d, _, _ in cells})
    header = [f"{m}, {PRIOR_NAMES[p]}" for m, p in APPENDIX_P] + ["gi, best of three", "facgi, best of three"]
    lines = ["| data | " + " | ".join(header) + " |", "|---|" + "---|" * len(header)]
    for dataset in datasets:
        row = []
        for method, prior in APPENDIX_P:
            paper, paper_se = APPENDIX_P[method, prior][dataset]
            s = cells.get((dataset, method, prior))
            if s is None:
                row.append(f"not run ({paper:.2f} ± {paper_se:.2f})")
                continue
            se = 0.0 if math.isnan(s["test_ll_se"]) else s["test_ll_se"]
            text = f"{s['test_ll']:.2f} ± {se:.2f}"
            text = f"**{text}**" if meets(s["test_ll"], se, paper) else text
            count = "" if s["splits"] == 20 else f" [{s['splits']} splits]"
            row.append(f"{text} ({paper:.2f} ± {paper_se:.2f}){count}")
        for method in ("gi", "facgi"):
            ours = [(cells[dataset, method, p]["test_ll"], p) for m, p in APPENDIX_P
                    if m == method and (dataset, method, p) in cells]
            paper = max((APPENDIX_P[method, p][dataset][0], p) for m, p in APPENDIX_P if m == method)
            best = max(ours) if ours else None
            row.append(("not run" if best is None else f"{best[0]:.2f} ({PRIOR_NAMES[best[1]]})")
                       + f" ({paper[0]:.2f}, {PRIOR_NAMES[paper[1]]})")
        lines.append(f"| {dataset} | " + " | ".join(row) + " |")
    return "\n".join(lines)


#: TAGI's Table 1 (Goulet et al. 2021): test log-likelihood and RMSE with their standard deviations.
for _name, _ll in {"boston": -2.58, "energy": -1.81, "kin8nm": 0.88, "power": -2.83, "wine": -0.96,
                   "yacht": -1.49}.items():
    PUBLISHED[_name]["tagi"] = _ll
PUBLISHED_RMSE = {"tagi": {"boston": 2.98, "energy": 1.46, "kin8nm": 0.10, "power": 4.12, "wine": 0.63, "yacht": 1.02}}

#: `tagi` (Goulet et al. 2021, Section 4.2): 40 epochs, batches of 10, one hidden layer of 50
#: ReLU units (100 above 40,000 training rows), the observation noise sigma_V (standardised
#: target units) optimised by 5-fold cross-validation on the training rows (`tagi_noise_search`:
#: the octave grid TAGI_NOISES, extended by an octave while the best is at its edge, at most
#: TAGI_EXTEND times, then at most TAGI_PARABOLIC steps of parabolic interpolation in log sigma_V).
TAGI_EPOCHS, TAGI_BATCH, TAGI_NOISES = 40, 10, (0.05, 0.1, 0.2, 0.4, 0.8)
TAGI_EXTEND, TAGI_PARABOLIC = 2, 2


def load_split(folder, split, validation=False):
    """`((x, y), (x_test, y_test))` of split `split` in the standard layout, float64. With
    `validation`, the training rows are split again (the last 20% of a fixed permutation are
    the evaluation rows): recipe choices are made there, never on the test rows
    (`keras_dvi.datasets.load_uci`)."""
    from keras_dvi import datasets

    return datasets.load_uci(folder, split, validation=validation, dtype="float64")


def num_splits(folder):
    return int(np.loadtxt(os.path.join(folder, "n_splits.txt")))


def normalise(train, test):
    """Inputs and target scaled with training statistics (a zero std counts as 1)."""
    (x, y), (xt, yt) = train, test
    x_mean, x_std = x.mean(axis=0), x.std(axis=0)
    x_std = np.where(x_std == 0, 1.0, x_std)
    y_mean, y_std = float(y.mean()), float(y.std()) or 1.0
    return {
        "x": ((x - x_mean) / x_std).astype("float32"),
        "y": ((y - y_mean) / y_std).astype("float32"),
        "x_test": ((xt - x_mean) / x_std).astype("float32"),
        "y_test": ((yt - y_mean) / y_std).astype("float32"),
        "y_mean": y_mean,
        "y_std": y_std,
    }


def score(y_pred, data, sampled):
    """Test log-likelihood per point and RMSE in the target's original units."""
    from keras_dvi import predictive

    y, scale = data["y_test"], data["y_std"]
    if sampled:
        ll = predictive.sampled_log_predictive_density(y_pred, y, y_scale=scale)
        mean = np.asarray(predictive.sampled_regression_moments(y_pred)["mean"])[:, 0]
        rmse = float(np.sqrt(np.mean((mean - y) ** 2)) * scale)
    else:
        ll = predictive.log_predictive_density(y_pred, y, y_scale=scale)
        rmse = float(np.asarray(predictive.rmse(y_pred, y, y_scale=scale)))
    return float(np.mean(np.asarray(ll))), rmse


def epoch_stream(x, y, steps, batch, seed):
    """Rows for `steps` minibatches of `batch`: concatenated random permutations of the data."""
    rng = np.random.default_rng(seed)
    n = len(x)
    passes = math.ceil(steps * batch / n)
    order = np.concatenate([rng.permutation(n) for _ in range(passes)])[: steps * batch]
    return x[order], y[order]


#: Steps at the end of a fixed-recipe run whose mean training loss is recorded (`final_loss`).
TAIL_STEPS = 1000


def tail_loss_callback(tail=TAIL_STEPS):
    """A callback whose `.result()` is the mean training loss of the last `tail` steps of one epoch.

    Keras logs the epoch's running mean `m_k` after `k` steps, so the mean over steps
    `(k1, k2]` is `(k2 m_k2 - k1 m_k1) / (k2 - k1)`: the objective where training ended (the
    negative ELBO per training row, KL included), what the paper chooses its learning rate by.
    """
    import keras

    class TailLoss(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.points = [(0, 0.0)]

        def on_train_batch_end(self, batch, logs=None):
            self.points.append((batch + 1, float(logs["loss"])))

        def result(self):
            end, mean = self.points[-1]
            start, start_mean = max(p for p in self.points if p[0] <= max(0, end - tail))
            return (end * mean - start * start_mean) / (end - start)

    return TailLoss()


def inducing_count(text):
    """`--inducing`: a positive integer, `all` (every training row) or `batch` (the batch's rows)."""
    if text in ("all", "batch"):
        return text
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, `all` or `batch`, got {text!r}")
    return value


def num_inducing(args, num_train):
    """The inducing points of a global inducing network trained on `num_train` rows."""
    if args.inducing == "all":
        return num_train
    if args.inducing == "batch":  # the paper's choice: as many inducing points as a batch has rows
        return min(num_train, args.gi_batch)
    if args.inducing > num_train:
        raise SystemExit(f"--inducing {args.inducing} is more than the {num_train} training rows: "
                         "pass a smaller number, or `all`.")
    return args.inducing


def gi_recipe(args, num_train):
    """What a global inducing run's cache records of its recipe (older records: the defaults)."""
    return {"inducing": num_inducing(args, num_train), "gi_steps": args.gi_steps,
            "gi_batch": min(num_train, args.gi_batch), "gi_lr": args.gi_lr}


def build(method, input_dim, num_train, args):
    import keras

    import keras_dvi as kd

    GI_PRIORS = {"neal": kd.NealPrior, "standard": kd.StandardPrior, "scale": kd.ScalePrior}

    if method in ("facgi", "dvigi"):
        prior = getattr(args, "gi_prior", "neal")
        if prior == "scale" and method == "dvigi":
            raise SystemExit("dvigi's head computes its KL in closed form: --gi-prior neal or standard.")
        elbo = dict(kl_weight=1.0, kl_warmup_steps=kl_warmup_steps(method, args))
        # The factorised body under the head's prior: N(0, 1 / fan_in), N(0, 1) or a learned scale.
        body_prior = (kd.ScalePriorRegularizer(num_train, **elbo) if prior == "scale"
                      else kd.GaussianPriorRegularizer(num_train, per_fan_in=prior == "neal", **elbo))
        inducing = num_inducing(args, num_train)
        head = dict(num_inducing=inducing, precision=args.gi_precision,
                    regularizer=GI_PRIORS[prior](num_train=num_train, **elbo))
        layers = [keras.Input((input_dim,)), kd.InducingInputs(inducing)]
        if method == "facgi":
            def init(fan_in):  # --fac-variance-init v: the authors' code's v / (fan_in + 1), bias included
                v = getattr(args, "fac_variance_init", None)
                return {} if v is None else dict(kernel_variance_init=v / (fan_in + 1), bias_variance_init=v / (fan_in + 1))
            layers += [kd.DenseMCVI(50, "relu", num_samples=10, regularizer=body_prior, **init(input_dim)),
                       kd.DenseMCVI(50, "relu", regularizer=body_prior, **init(50)),
                       kd.GlobalInducingDense(1, output_layer=True, **head),
                       kd.SampledHomoscedasticNoise(-3.0, log_variance_scale=10.0)]
            loss = kd.SampledHeteroscedasticELL()
        else:
            layers += [kd.DenseDiagDVI(50, "relu", regularizer=body_prior), kd.DenseDiagDVI(50, "relu", regularizer=body_prior),
                       kd.GlobalInducingDenseDVI(1, **head), kd.HomoscedasticNoise(-3.0, log_variance_scale=10.0)]
            loss = kd.HeteroscedasticELL()
        model = keras.Sequential(layers)
        model.compile(keras.optimizers.Adam(args.gi_lr), loss=loss, steps_per_execution=args.steps_per_execution)
        return model
    if method == "gi":
        model = keras.Sequential([
            keras.Input((input_dim,)),
            kd.GlobalInducingDense(50, "relu", num_inducing=num_inducing(args, num_train), num_samples=10,
                                   precision=args.gi_precision,
                                   regularizer=GI_PRIORS[getattr(args, "gi_prior", "neal")](
                                       num_train=num_train, kl_warmup_steps=kl_warmup_steps(method, args))),
            kd.GlobalInducingDense(50, "relu", precision=args.gi_precision),
            kd.GlobalInducingDense(1, output_layer=True, precision=args.gi_precision),
            kd.SampledHomoscedasticNoise(-3.0, log_variance_scale=10.0),
        ])
        model.compile(keras.optimizers.Adam(args.gi_lr), loss=kd.SampledHeteroscedasticELL(),
                      steps_per_execution=args.steps_per_execution)
        return model
    warmup = kl_warmup_steps(method, args)
    prior_args = {} if warmup is None else {"kl_warmup_steps": warmup}
    if args.kl_weight is not None:
        prior_args["kl_weight"] = args.kl_weight
    prior = kd.EmpiricalBayesRegularizer(num_train, alpha=1.0, beta=args.prior_beta, **prior_args)
    layers = [keras.Input((input_dim,))]
    if method == "mcvi":
        layers += [kd.DenseMCVI(w, "relu", num_samples=args.mcvi_samples, regularizer=prior) for w in args.hidden]
        layers.append(kd.DenseMCVI(2, regularizer=prior))
        loss = kd.SampledHeteroscedasticELL()
    else:
        dense = kd.DenseDiagDVI if method == "ddvi" else kd.DenseDVI
        # The first layer after data: DenseDiagDVI computes exactly what DenseDVI does there, in
        # the compact form (the recipe's numbers are those of the earlier DenseDVI-first code).
        layers += [(kd.DenseDiagDVI if i == 0 else dense)(w, "relu", regularizer=prior) for i, w in enumerate(args.hidden)]
        if method == "hodvi":
            layers += [kd.DenseDVI(1, regularizer=prior), kd.HomoscedasticNoise(-3.0, log_variance_scale=10.0)]
        else:
            layers.append(dense(2, regularizer=prior))
        loss = kd.HeteroscedasticELL()
    model = keras.Sequential(layers)
    # Cosine decay of the learning rate to 1% over the run (Loshchilov & Hutter 2017); constant
    # under --recipe defaults, where ReduceLROnPlateau decays it (`fit_to_convergence`).
    use_cosine = args.cosine and args.recipe == "fixed"
    lr = keras.optimizers.schedules.CosineDecay(args.lr, args.steps, alpha=0.01) if use_cosine else args.lr
    model.compile(keras.optimizers.Adam(lr), loss=loss, steps_per_execution=args.steps_per_execution)
    return model


def run_one(folder, method, split, args):
    """Trains and evaluates one method on one split; returns the result record."""
    import keras

    import keras_dvi as kd

    data = normalise(*load_split(folder, split, args.validation))
    if args.max_rows:
        data["x"], data["y"] = data["x"][: args.max_rows], data["y"][: args.max_rows]
    n = len(data["x"])
    keras.utils.set_random_seed(args.seed + split)
    if method == "tagi":
        return run_tagi(folder, split, data, args)
    model = build(method, data["x"].shape[1], n, args)
    start = time.time()
    if method in GI_METHODS:
        kd.initialize_from_data(model, data["x"], data["y"], seed=split)
        steps, batch = args.gi_steps, min(n, args.gi_batch)
    else:
        steps, batch = args.steps, min(n, BATCH)
    # All `steps` minibatches as ONE epoch of pre-shuffled rows (a fresh permutation per pass
    # through the data): Keras' per-epoch overhead (~30 ms) would otherwise dominate small
    # data sets, where an epoch is only a few steps (one, for full batches).
    warmup = kl_warmup_steps(method, args)
    objective = None
    if args.recipe == "defaults" and method not in GI_METHODS:
        steps, objective = fit_to_convergence(model, data, batch, args, args.seed + split)
    else:
        x, y = epoch_stream(data["x"], data["y"], steps, batch, args.seed + split)
        tail = tail_loss_callback()
        with warnings.catch_warnings():
            if batch == n:  # full batches, stacked into one epoch: each batch is the data set
                warnings.filterwarnings("ignore", message=".*`num_train` is also", category=UserWarning)
            model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0, callbacks=[tail])
        objective = tail.result()
    seconds = time.time() - start
    sampled = method in ("gi", "facgi", "mcvi")
    if sampled:
        y_pred = kd.predict_samples(model, data["x_test"], 100)
    else:
        y_pred = model.predict(data["x_test"], verbose=0)
    ll, rmse = score(y_pred, data, sampled)
    record = {"dataset": os.path.basename(os.path.normpath(folder)), "method": method, "split": split,
              "test_ll": ll, "test_rmse": rmse, "seconds": seconds, "num_train": n,
              "backend": keras.backend.backend(), "device": cache.device()}
    if method in GI_METHODS:
        record["precision"] = args.gi_precision
        record["prior"] = getattr(args, "gi_prior", "neal")
        record.update(gi_recipe(args, n))
        if method == "facgi" and args.fac_variance_init is not None:
            record["fac_variance_init"] = args.fac_variance_init
    record["kl_warmup"] = warmup if warmup is not None else model.layers[0].regularizer.kl_warmup_steps
    if record["kl_warmup"] == "auto":  # the length the first step planned
        record["kl_warmup_length"] = int(keras.ops.convert_to_numpy(model.layers[0].kl_warmup_length))
    record["recipe"] = args.recipe
    if args.recipe == "defaults":
        record["steps"], record["train_objective"] = steps, objective
    else:  # the training loss of the last TAIL_STEPS steps (-ELBO / N)
        record["final_loss"] = objective
    if args.kl_weight is not None:
        record["kl_weight"] = args.kl_weight
    if args.prior_beta != 10.0:
        record["prior_beta"] = args.prior_beta
    if args.validation:
        record["validation"] = True
    return record


def tagi_model(input_dim, num_train, noise, seed, args, max_step="auto"):
    import keras

    import keras_dvi as kd

    width = 100 if num_train > 40000 else 50
    network = keras.Sequential([keras.Input((input_dim,)), kd.DenseDiagDVI(width, "relu"), kd.DenseDiagDVI(1)])
    model = kd.TAGIModel(network, observation_noise=noise, forward=args.tagi_forward, seed=seed,
                         initialize=args.tagi_init, max_step=max_step)
    model.compile(steps_per_execution=100)
    return model


def tagi_initialize(label):
    """`--tagi-init` as `TAGIModel`'s `initialize`: "xavier", "he" or a number c (c / fan_in)."""
    return label if label in ("xavier", "he") else float(label)


def tagi_fit(x, y, noise, seed, args, max_step="auto"):
    import keras

    keras.utils.set_random_seed(seed)
    model = tagi_model(x.shape[1], len(x), noise, seed, args, max_step)
    model.fit(x, y, batch_size=TAGI_BATCH, epochs=TAGI_EPOCHS, verbose=0)
    return model


def tagi_scores(model, x, y, y_std):
    """Test log-likelihood per point and RMSE, in the target's units (scaled by `y_std`)."""
    import keras_dvi as kd

    out = kd.predict(model, x)
    mean, var = out["mean"][:, 0], out["variance"][:, 0]
    ll = -0.5 * (np.log(2 * np.pi * var) + (y - mean) ** 2 / var) - np.log(y_std)
    return float(np.mean(ll)), float(np.sqrt(np.mean((mean - y) ** 2)) * y_std)


def parabola_vertex(t, y):
    """Abscissa of the vertex of the parabola through three points `(t[i], y[i])` (Brent's
    step), or None where they are collinear."""
    a, b = (t[1] - t[0]) * (y[1] - y[2]), (t[1] - t[2]) * (y[1] - y[0])
    if a == b:
        return None
    return t[1] - 0.5 * ((t[1] - t[0]) * a - (t[1] - t[2]) * b) / (a - b)


def tagi_noise_search(evaluate, cv=None, search="refine"):
    """Maximises the cross-validated log-likelihood `evaluate(noise)` over sigma_V: the octave
    grid TAGI_NOISES; with `search="refine"` (the paper optimises sigma_V, Section 4.2; its
    Table 3 reports values between grid points) then an octave beyond the grid's edge while the
    best value is there (at most TAGI_EXTEND times), then successive parabolic interpolation in
    log sigma_V through the best value and its two evaluated neighbours (at most
    TAGI_PARABOLIC steps, stopping once a step lands within 1/16 octave of an evaluated value).
    `cv` (noise -> score) holds scores already computed and receives the new ones; returns the
    best noise."""
    cv = {} if cv is None else cv
    for noise in TAGI_NOISES:
        if noise not in cv:
            cv[noise] = evaluate(noise)
    if search == "grid":
        return max(TAGI_NOISES, key=cv.get)
    for _ in range(TAGI_EXTEND):
        tried, best = sorted(cv), max(cv, key=cv.get)
        if best not in (tried[0], tried[-1]):
            break
        noise = best / 2 if best == tried[0] else best * 2
        if noise not in cv:
            cv[noise] = evaluate(noise)
    for _ in range(TAGI_PARABOLIC):
        tried, best = sorted(cv), max(cv, key=cv.get)
        i = tried.index(best)
        if i in (0, len(tried) - 1):
            break
        three = tried[i - 1:i + 2]
        vertex = parabola_vertex(np.log(three), [cv[k] for k in three])
        if vertex is None:
            break
        noise = float(f"{math.exp(vertex):.4g}")
        if min(abs(math.log2(noise / k)) for k in tried) < 1 / 16:
            break
        cv[noise] = evaluate(noise)
    return max(cv, key=cv.get)


def run_tagi(folder, split, data, args):
    """TAGI with the paper's protocol: sigma_V optimised by 5-fold cross-validation on the
    training rows (validation log-likelihood; `tagi_noise_search`), then 40 epochs on all of
    them. Cross-validation scores that a cached record of this split already holds (the same
    folds, seed, prior and forward pass) are reused, not recomputed."""
    x, y = data["x"], data["y"]
    start = time.time()
    folds = np.array_split(np.random.default_rng(split).permutation(len(x)), 5)
    cv = {}
    cached = _cache_path(args.results, folder, cache_label("tagi", tagi_forward=args.tagi_forward), split)
    if os.path.exists(cached):
        with open(cached) as f:
            record = json.load(f)
        if str(record.get("init", "xavier")) == str(args.tagi_init) and bool(record.get("validation")) == \
                bool(args.validation) and not args.max_rows:
            cv = {float(k): v for k, v in record["cv_ll"].items()}

    def evaluate(noise):
        lls = []
        for k, held in enumerate(folds):
            keep = np.concatenate([f for i, f in enumerate(folds) if i != k])
            model = tagi_fit(x[keep], y[keep], noise, args.seed + split, args)
            lls.append(tagi_scores(model, x[held], y[held], 1.0)[0])
        return float(np.mean(lls))

    noise = tagi_noise_search(evaluate, cv, args.tagi_noise_search)
    model = tagi_fit(x, y, noise, args.seed + split, args)
    ll, rmse = tagi_scores(model, data["x_test"], data["y_test"], data["y_std"])
    return {"dataset": os.path.basename(os.path.normpath(folder)), "method": "tagi", "split": split,
            "test_ll": ll, "test_rmse": rmse, "seconds": time.time() - start, "num_train": len(x),
            "observation_noise": noise, "cv_ll": {str(k): v for k, v in sorted(cv.items())}, "kl_warmup": 0,
            "recipe": args.recipe, "forward": args.tagi_forward, "init": args.tagi_init,
            "noise_search": args.tagi_noise_search, **({"validation": True} if args.validation else {})}


def kl_warmup_steps(method, args):
    """Length of the KL ramp: `--kl-warmup`, default half the run (`--recipe fixed`) or the
    prior's default (`--recipe defaults`, `None`); `--gi-kl-warmup` (default none) for the
    global inducing methods; none for `tagi`."""
    if method in GI_METHODS:
        return getattr(args, "gi_kl_warmup", 0)
    if method == "tagi":
        return 0
    if args.recipe == "defaults" and args.kl_warmup is None:
        return None
    return args.steps // 2 if args.kl_warmup is None else args.kl_warmup


#: `--recipe defaults`: the training objective is checked every CHUNK steps; the learning rate
#: drops 10x after PATIENCE checks without an improvement of MIN_DELTA nats, and training stops
#: after 2 * PATIENCE + 1 such checks (keeping the best weights).
CHUNK, PATIENCE, MIN_DELTA = 500, 2, 0.005


def fit_to_convergence(model, data, batch, args, seed):
    """Trains until the training objective (-ELBO / N on all training rows, with the full KL
    weight: `val_loss` on the training data) stops improving, with Keras' own callbacks held
    back until the KL warm-up is over (`keras_dvi.AfterKLWarmup`: while the KL weight rises the
    full objective need not improve); returns the number of steps taken."""
    import keras
    import tensorflow as tf

    import keras_dvi as kd

    x, y = data["x"], data["y"]
    stream = (tf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(x), seed=seed).repeat()
              .batch(batch, drop_remainder=True))
    callbacks = [
        kd.AfterKLWarmup(keras.callbacks.ReduceLROnPlateau(monitor="val_loss", factor=0.1, patience=PATIENCE,
                                                           min_delta=MIN_DELTA)),
        kd.AfterKLWarmup(keras.callbacks.EarlyStopping(monitor="val_loss", patience=2 * PATIENCE + 1,
                                                       min_delta=MIN_DELTA, restore_best_weights=True)),
    ]
    history = model.fit(stream, epochs=max(1, args.max_steps // CHUNK), steps_per_epoch=CHUNK, verbose=0,
                        validation_data=(x, y), validation_batch_size=min(len(x), 4096), callbacks=callbacks)
    return CHUNK * len(history.history["loss"]), float(min(history.history["val_loss"]))


def _check_recipe(record, path, args):
    """A cached result must come from the same recipe and KL warm-up (older records had none)."""
    if record.get("recipe", "fixed") != args.recipe:
        raise SystemExit(f"{path} was computed with --recipe {record.get('recipe', 'fixed')}, not "
                         f"{args.recipe}: pass --results with another folder.")
    if record["method"] == "tagi" and str(record.get("init", "xavier")) != str(args.tagi_init):
        raise SystemExit(f"{path} was computed with --tagi-init {record.get('init', 'xavier')}, not "
                         f"{args.tagi_init}: pass --results with another folder.")
    if record["method"] in GI_METHODS:
        wanted = gi_recipe(args, record["num_train"])
        d = make_parser().parse_args([])  # older records: the defaults
        defaults = {"inducing": d.inducing, "gi_steps": d.gi_steps, "gi_batch": min(record["num_train"], d.gi_batch),
                    "gi_lr": d.gi_lr}
        cached = {key: record.get(key, defaults[key]) for key in wanted}
        if record["method"] == "facgi":
            wanted["fac_variance_init"] = args.fac_variance_init
            cached["fac_variance_init"] = record.get("fac_variance_init")
        if cached != wanted:
            raise SystemExit(f"{path} was computed with {cached}, but this run asks for {wanted}: pass "
                             "the same --inducing / --gi-steps / --gi-batch / --gi-lr (/ --fac-variance-init), or --results with "
                             "another folder.")
    cached, wanted = record.get("kl_warmup", 0), kl_warmup_steps(record["method"], args)
    if wanted is None:
        return
    if cached != wanted:
        raise SystemExit(
            f"{path} was computed with --kl-warmup {cached}, but this run uses {wanted}: pass "
            "--kl-warmup to match it, or --results with another folder."
        )


def _cache_path(results, folder, method, split):
    name = os.path.basename(os.path.normpath(folder))
    return os.path.join(results, name, method, f"split_{split}.json")


def _worker(task):
    folder, method, split, args, path = task
    os.environ["TF_NUM_INTEROP_THREADS"] = "1"
    os.environ["TF_NUM_INTRAOP_THREADS"] = "1"
    record = run_one(folder, method, split, args)
    cache.write(path, record)
    return record


def summarise(records, methods):
    """Rows of mean and standard error per data set and method."""
    table = {}
    for r in records:
        table.setdefault(r["dataset"], {}).setdefault(r["method"], []).append(r)
    summary = []
    for dataset in sorted(table):
        for method in methods:
            rows = table[dataset].get(method)
            if not rows:
                continue
            ll = np.array([r["test_ll"] for r in rows])
            rmse = np.array([r["test_rmse"] for r in rows])
            se = lambda a: float(a.std(ddof=1) / math.sqrt(len(a))) if len(a) > 1 else float("nan")  # noqa: E731
            summary.append({
                "dataset": dataset, "method": method, "splits": len(rows),
                "test_ll": float(ll.mean()), "test_ll_se": se(ll),
                "test_rmse": float(rmse.mean()), "test_rmse_se": se(rmse),
                "seconds": float(np.mean([r["seconds"] for r in rows])),
                "published_ll": PUBLISHED.get(dataset, {}).get(method),
                "published_rmse": PUBLISHED_RMSE.get(method, {}).get(dataset),
            })
    return summary


def wide_markdown(summary, methods):
    """Test log-likelihood, one row per data set, one column per method: `ours ± se (paper)`,
    and whether the mean reaches the published figure minus one standard error."""
    cells = {(s["dataset"], s["method"]): s for s in summary}
    lines = ["| data | " + " | ".join(methods) + " |", "|---|" + "---|" * len(methods)]
    for dataset in sorted({s["dataset"] for s in summary}):
        row = []
        for method in methods:
            s = cells.get((dataset, method))
            if s is None:
                row.append("")
                continue
            text = f"{s['test_ll']:.2f} ± {s['test_ll_se']:.2f}"
            if s["published_ll"] is not None:
                met = meets(s["test_ll"], s["test_ll_se"], s["published_ll"])
                text = f"{'**' + text + '**' if met else text} ({s['published_ll']:.2f})"
            if s["splits"] < 20:
                text += f" [{s['splits']} splits]"
            row.append(text)
        lines.append(f"| {dataset} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def markdown(summary):
    lines = ["| data | method | splits | test LL | published LL | test RMSE | published RMSE | s / split |",
             "|---|---|---|---|---|---|---|---|"]
    for s in summary:
        pub = "" if s["published_ll"] is None else f"{s['published_ll']:.2f}"
        pub_rmse = "" if s.get("published_rmse") is None else f"{s['published_rmse']:.2f}"
        lines.append(
            f"| {s['dataset']} | {s['method']} | {s['splits']} | {s['test_ll']:.2f} ± {s['test_ll_se']:.2f} | "
            f"{pub} | {s['test_rmse']:.2f} ± {s['test_rmse_se']:.2f} | {pub_rmse} | {s['seconds']:.0f} |"
        )
    return "\n".join(lines)


def make_parser():
    """The command line, whose defaults are the recipe (also used by `uci_overconfidence.py`)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", nargs="+", default=[],
                        help="folders in the UCI layout (required unless --summary-only)")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--splits", type=int, nargs="+", default=None, help="default: all")
    parser.add_argument("--results", default="benchmarks/results/uci", help="cache folder")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--hidden", type=int, nargs="+", default=[50])
    parser.add_argument("--recipe", choices=("fixed", "defaults"), default="fixed",
                        help="fixed: the 6,000-step cosine recipe of summary.md; defaults: the library's "
                             "defaults (no --kl-warmup), constant --lr, trained until the training "
                             "objective stops improving (--max-steps)")
    parser.add_argument("--max-steps", type=int, default=40000, help="cap of --recipe defaults")
    parser.add_argument("--steps", type=int, default=6000)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--no-cosine", dest="cosine", action="store_false", help="constant learning rate")
    parser.add_argument("--steps-per-execution", type=int, default=20, help="speed only")
    parser.add_argument("--mcvi-samples", type=int, default=10)
    parser.add_argument("--kl-warmup", type=int, default=None,
                        help="KL ramp 0 -> 1 over this many updates (dvi, ddvi, mcvi, hodvi; "
                             "default: half of --steps; 0: off)")
    parser.add_argument("--kl-weight", type=float, default=None,
                        help="KL weight after the warm-up (default: the prior's)")
    parser.add_argument("--prior-beta", type=float, default=10.0,
                        help="beta of EmpiricalBayesRegularizer (its default, the paper's: 10)")
    parser.add_argument("--validation", action="store_true",
                        help="score on 20%% of the training rows, not the test rows (recipe choices)")
    parser.add_argument("--inducing", type=inducing_count, default=100,
                        help="global inducing points (default 100), `all`: every training row (the "
                             "paper's recipe with --gi-batch 10000), or `batch`: as many as a batch has rows "
                             "(the paper's rule; every row up to --gi-batch)")
    parser.add_argument("--gi-steps", type=int, default=3000)
    parser.add_argument("--gi-batch", type=int, default=1000, help="gi batch size (full batch up to this)")
    parser.add_argument("--gi-lr", type=float, default=1e-2)
    parser.add_argument("--gi-kl-warmup", type=int, default=0,
                        help="gi, facgi, dvigi: KL ramp 0 -> 1 over this many updates (default 0: the ELBO "
                             "throughout; cached results must match, so use another --results)")
    parser.add_argument("--fac-variance-init", type=float, default=None,
                        help="facgi: the body's initial weight variances v / (fan_in + 1), as in the authors' "
                             "code (1e-3); default: the library's 0.03 / fan_in")
    parser.add_argument("--gi-precision", choices=("shared", "per_unit"), default="shared",
                        help="GlobalInducingDense precision (per_unit: App. K, about 5x slower)")
    parser.add_argument("--gi-prior", choices=("neal", "scale", "standard"), default="neal",
                        help="gi, facgi, dvigi: NealPrior, ScalePrior (Ober & Aitchison eqs. 16-18; cached as "
                             "<method>_scale) or StandardPrior (N(0, 1); cached as <method>_standard), the "
                             "factorised body of facgi / dvigi under the same prior")
    parser.add_argument("--tagi-forward", choices=("linearized", "moments"), default="linearized",
                        help="tagi: TAGIModel's forward (the paper's linearised activations, or exact moments)")
    parser.add_argument("--tagi-noise-search", choices=("refine", "grid"), default="refine",
                        help="tagi: sigma_V by the octave grid then a refinement (default), or the grid only "
                             "(the earlier protocol); cached scores of a split are reused")
    parser.add_argument("--tagi-init", type=tagi_initialize, default="xavier",
                        help="tagi: TAGIModel's initialize: xavier (the paper), he (1 / fan_in) or a number c "
                             "(c / fan_in; the authors' UCI code: 0.25)")
    parser.add_argument("--max-rows", type=int, default=None, help="subsample training rows (tests)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--summary-only", action="store_true", help="summarise the cache, run nothing")
    return parser


def main(argv=None):
    parser = make_parser()
    args = parser.parse_args(argv)
    if not args.data and not args.summary_only:
        parser.error("argument --data is required (folders in the UCI layout) unless --summary-only")

    tasks, records = [], []
    for folder in args.data:
        splits = args.splits if args.splits is not None else range(num_splits(folder))
        for split in splits:
            for method in args.methods:
                path = _cache_path(args.results, folder, cache_label(method, args.gi_precision, args.tagi_forward,
                                                                     args.gi_prior),
                                   split)
                if os.path.exists(path):
                    with open(path) as f:
                        record = json.load(f)
                    _check_recipe(record, path, args)
                    if method == "tagi" and not args.summary_only and \
                            record.get("noise_search", "grid") != args.tagi_noise_search:
                        tasks.append((folder, method, split, args, path))  # reuses its cross-validation
                    else:
                        records.append(record)
                elif not args.summary_only:
                    tasks.append((folder, method, split, args, path))
    print(f"{len(records)} cached, {len(tasks)} to run", flush=True)
    if tasks:
        if args.jobs > 1:
            # Jobs sharing a GPU: JAX and TensorFlow would each take (nearly) all its memory.
            os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
            os.environ.setdefault("TF_FORCE_GPU_ALLOW_GROWTH", "true")
            context = multiprocessing.get_context("spawn")
            with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=context) as pool:
                for record in pool.map(_worker, tasks):
                    print(_line(record), flush=True)
                    records.append(record)
        else:
            for task in tasks:
                record = _worker(task)
                print(_line(record), flush=True)
                records.append(record)
    summary = summarise(records, args.methods)
    if args.data:
        print(tables(summary, args.methods))
    for path in write_summaries(args.results):
        if not args.data:  # --summary-only of the whole cache
            with open(path) as f:
                print(f"{path}:\n\n{f.read()}")
        print(f"wrote {path} (every split cached in {args.results})")
    return summary


def tables(summary, methods):
    """The long Markdown table and the wide log-likelihood table of a summary."""
    return markdown(summary) + "\n\nTest log-likelihood (published figure in brackets; bold: at least the " \
        "published figure minus one standard error):\n\n" + wide_markdown(summary, methods)


def write_summaries(results):
    """Rewrites `summary.*` and `summary_gi_per_unit.*` in `results` from every cached split
    there, whatever data sets and methods the command named, so that running one data set or
    method never drops the others from a summary. Per-unit global inducing results are
    labelled `gi` like the shared ones, so they have a summary of their own. Returns the
    paths of the Markdown files written."""
    written = []
    for name, labels in SUMMARIES.items():
        records = [r for label in labels for r in cached_records(results, label)]
        if not records:
            continue
        methods = [m for m in METHODS if any(r["method"] == m for r in records)]
        summary = summarise(records, methods)
        with open(os.path.join(results, name + ".md"), "w") as f:
            f.write(tables(summary, methods) + "\n")
        with open(os.path.join(results, name + ".json"), "w") as f:
            json.dump(summary, f, indent=1)
        written.append(os.path.join(results, name + ".md"))
    table = appendix_p_markdown(results)
    if table is not None:
        with open(os.path.join(results, "appendix_p.md"), "w") as f:
            f.write("Ober & Aitchison Appendix P (Table 5), shared precisions: ours ± se (paper ± se); bold: at "
                    "least the paper's figure minus our standard error.\n\n" + table + "\n")
        written.append(os.path.join(results, "appendix_p.md"))
    return written


def _line(r):
    return f"{r['dataset']} split {r['split']} {r['method']}: test LL {r['test_ll']:.3f}, RMSE {r['test_rmse']:.3f}, {r['seconds']:.0f} s"


if __name__ == "__main__":
    main()
