"""Classification benchmark after Ovadia et al. (2019), "Can you trust your model's uncertainty?",
at a small scale: scikit-learn's digits.

    python -m benchmarks.classification --jobs 2                  # every method, 5 splits
    python -m benchmarks.classification --validation --methods dvi --kl-weight 0.1   # an ablation

Protocol (fixed before any result was seen, the same for every method):

* data: the 1,797 8x8 digits, pixels scaled to [0, 1]; 5 stratified 70/30 train/test splits
  (`random_state = split`). `--validation` holds out 20% of the training rows (stratified) and
  scores on them instead of the test split: ablations and recipe choices use that, never the
  test rows.
* network: 64-100-100-10 ReLU; Adam 3e-3, batches of 64, 100 epochs.
* methods: `mlp` (plain Keras), `dropout` (MC dropout, p = 0.1 after each hidden layer, 50
  samples at test time), `ensemble` (5 plain networks from different seeds, probabilities
  averaged), `ivon` (the plain network's weights under a mean-field Gaussian posterior trained
  by IVON, Shen et al. 2024, `lambda = N`: `ivon.py`; `--ivon-lr`, `--ivon-hess-init`), and keras-dvi with its defaults: `dvi` (`DenseDiagDVI` body, `DenseDVI` head),
  `ddvi` (diagonal throughout), `mcvi` (`DenseMCVI`, 10 samples per step, 100 at test time).
  `gi` (added with the global inducing layers): `GlobalInducingDense` layers of the same shape,
  `--gi-inducing` inducing points (100) from the training rows and labels, `NealPrior`, the
  ELBO (KL weight 1, no warm-up: the paper's objective), 10 samples per step, 100 at test time.
  Convolutional networks (the check that the conv layers' defaults carry over to small images
  and signals; the MNIST benchmark's shape, "same" padding): `cnn` / `cnn_dvi` read the digits as
  8x8 images, `cnn1d` / `cnn1d_dvi` as 64-step signals (rows one after the other): conv 32 (3)
  ReLU, max pool 2, conv 64 (3) ReLU, max pool 2, dense 128 ReLU, 10 outputs, as a plain Keras
  network and as keras-dvi layers with their defaults (`Conv*DDVI`, `MaxPooling*DDVI(2,
  activation="relu")`, `FlattenDVI`, `DenseDiagDVI`, `DenseDVI`).
  keras-dvi networks use `EmpiricalBayesRegularizer(num_train)` and `SoftmaxDeltaELL()` with
  their default arguments (`kl_weight="auto"`, Jankowiak's bound) unless `--kl-weight`,
  `--kl-warmup-steps` or `--loss-method` say otherwise (cache folders name every argument that
  differs from the defaults: `kl_weight=1.0,loss_method=delta` is the full ELBO with the delta
  method), and `keras_dvi.predictive.class_probabilities` with its default method unless
  `--prob-method` does.
* evaluation sets: the clean test set; rotations by 15, 30, 45 and 60 degrees
  (`scipy.ndimage.rotate(reshape=False)`, clipped to [0, 1]); Gaussian pixel noise of sd 0.1,
  0.2 and 0.4 (clipped); out of distribution: uniform-noise images against the clean test set,
  and a second network of the same method trained on the digits 0-4 of the training rows,
  detecting the test digits 5-9 among 0-9. OOD detection is scored by the AUROC of the
  predictive entropy.
* metrics: accuracy, NLL (mean negative log probability of the label), ECE (15 equal-width
  bins of the top-class confidence), Brier score (sum over classes), AUROC, seconds per epoch.

The ablations behind the classifier defaults (`--validation`) vary, for keras-dvi methods: the
prior (`--prior`: empirical Bayes, a fixed `N(0, v)`, a fixed `N(0, c / fan_in)`, empirical Bayes
with its variance floored at `c / fan_in`), the KL weight (`--kl-weight`: 1 for the full ELBO, a
number, or `auto`, the library's default: `min(1, N / P)` for `N` training rows and `P`
weights), the loss (`--loss-method delta` for the delta method), the initialisation (`--init plain`: the
posterior means of a plain network of the same shape trained `--init-epochs` first, converted
with `keras_dvi.convert`), a Bayesian last layer (`--body plain`), and, for every method, the
hidden widths (`--hidden`) and epochs (`--epochs`). Records keep the training rows' `nll` and
`kl` at the end (`-ELBO / N = nll + kl` of the stated prior at KL weight 1).

Results are cached per method (and recipe) and split as JSON in `--results`, so an interrupted
run resumes; `--jobs 2` runs two at a time. Every run rewrites `summary.md` next to the cache
from all cached results (mean and standard error over splits).
"""

import argparse
import concurrent.futures
import glob
import json
import math
import multiprocessing
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402

from benchmarks import cache  # noqa: E402

METHODS = ("mlp", "dropout", "ensemble", "ivon", "dvi", "ddvi", "mcvi", "gi", "cnn", "cnn_dvi", "cnn1d", "cnn1d_dvi")
KERAS_DVI_METHODS = ("dvi", "ddvi", "mcvi", "cnn_dvi", "cnn1d_dvi")
#: The convolutional networks (issue 25's "same defaults on other image or signal data"): the
#: digits as 8x8 images (`cnn`, `cnn_dvi`) or as 64-step signals, the image read row by row
#: (`cnn1d`, `cnn1d_dvi`); the MNIST benchmark's shape with "same" padding.
CNN_METHODS = ("cnn", "cnn_dvi", "cnn1d", "cnn1d_dvi")
ROTATIONS = (15, 30, 45, 60)
NOISE_SDS = (0.1, 0.2, 0.4)
HIDDEN = (100, 100)
EPOCHS, BATCH, LEARNING_RATE = 100, 64, 3e-3
ENSEMBLE_SIZE, DROPOUT_RATE, DROPOUT_SAMPLES, MCVI_TEST_SAMPLES = 5, 0.1, 50, 100


#: Data sets (`--dataset`): digits (the benchmark), and two small tabular sets of
#: scikit-learn, never used to choose anything, to check that the defaults carry over.
DATASETS = ("digits", "breast_cancer", "wine")


def load_split(split, validation=False, dataset="digits"):
    """`(x_train, y_train, x_eval, y_eval)`: the 70/30 split `split`, or with `validation` the
    training rows split again 80/20 (evaluation on the 20%). Digits' pixels are scaled to
    [0, 1]; the tabular sets are standardised with the training rows' statistics."""
    from sklearn import datasets
    from sklearn.model_selection import train_test_split

    x, y = getattr(datasets, f"load_{dataset}")(return_X_y=True)
    x = x.astype("float64")
    if dataset == "digits":
        x = x / 16.0
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.3, stratify=y, random_state=split)
    if validation:
        x_train, x_test, y_train, y_test = train_test_split(
            x_train, y_train, test_size=0.2, stratify=y_train, random_state=split)
    if dataset != "digits":
        mean, std = x_train.mean(0), x_train.std(0)
        std = np.where(std > 0, std, 1.0)
        x_train, x_test = (x_train - mean) / std, (x_test - mean) / std
    return (x_train.astype("float32"), y_train.astype("int32"), x_test.astype("float32"),
            y_test.astype("int32"))


def rotate(x, degrees):
    from scipy import ndimage

    images = ndimage.rotate(x.reshape(-1, 8, 8), degrees, axes=(1, 2), reshape=False)
    return np.clip(images.reshape(-1, 64), 0.0, 1.0).astype("float32")


def add_noise(x, sd, seed):
    rng = np.random.default_rng(seed)
    return np.clip(x + rng.normal(0.0, sd, x.shape), 0.0, 1.0).astype("float32")


# ---------------------------------------------------------------- metrics


def scores(probs, labels):
    """Accuracy, NLL, ECE (15 bins) and Brier score of `(n, C)` probabilities."""
    probs = np.asarray(probs, dtype="float64")
    n = len(labels)
    true = probs[np.arange(n), labels]
    confidence, correct = probs.max(1), probs.argmax(1) == labels
    bins = np.minimum((confidence * 15).astype(int), 14)
    ece = sum(abs(correct[bins == b].sum() - confidence[bins == b].sum()) for b in range(15)) / n
    one_hot = np.eye(probs.shape[1])[labels]
    return {"accuracy": float(correct.mean()), "nll": float(-np.mean(np.log(np.maximum(true, 1e-300)))),
            "ece": float(ece), "brier": float(np.mean(np.sum((probs - one_hot) ** 2, axis=1)))}


def entropy(probs):
    probs = np.asarray(probs, dtype="float64")
    return -np.sum(probs * np.log(np.maximum(probs, 1e-300)), axis=1)


def auroc(in_probs, out_probs):
    """AUROC of telling out-of-distribution inputs by a higher predictive entropy."""
    from sklearn.metrics import roc_auc_score

    values = np.concatenate([entropy(in_probs), entropy(out_probs)])
    truth = np.concatenate([np.zeros(len(in_probs)), np.ones(len(out_probs))])
    return float(roc_auc_score(truth, values))


# ---------------------------------------------------------------- methods


def _ivon_settings(args):
    settings = {}
    if getattr(args, "ivon_lr", None) is not None:
        settings["learning_rate"] = args.ivon_lr
    if getattr(args, "ivon_hess_init", None) is not None:
        settings["hess_init"] = args.ivon_hess_init
    if getattr(args, "ivon_prior_variance", None) is not None:
        settings["prior_variance"] = args.ivon_prior_variance
    if getattr(args, "ivon_beta2", None) is not None:
        settings["beta2"] = args.ivon_beta2
    return settings


def _hidden(args):
    return tuple(getattr(args, "hidden", None) or HIDDEN)


def _epochs(args):
    return getattr(args, "epochs", None) or EPOCHS


def make_prior(num_train, fan_in, args):
    """The prior of one layer with `fan_in` inputs (`--prior`, `--kl-weight`, `--kl-warmup-steps`,
    `--prior-beta`)."""
    from keras import ops

    import keras_dvi as kd

    settings = {}
    if args.kl_weight is not None:  # a number, or "auto" (the library's default rule, min(1, N / P))
        settings["kl_weight"] = args.kl_weight
    if args.kl_warmup_steps is not None:
        settings["kl_warmup_steps"] = args.kl_warmup_steps
    kind, _, value = (getattr(args, "prior", None) or "eb").partition(":")
    if kind == "gauss":
        return kd.GaussianPriorRegularizer(num_train, variance=float(value), **settings)
    if kind == "fanin":
        return kd.GaussianPriorRegularizer(num_train, variance=float(value) / fan_in, **settings)
    if kind == "scale":
        return kd.ScalePriorRegularizer(num_train, **settings)
    if getattr(args, "prior_beta", None) is not None:
        settings["beta"] = args.prior_beta
    if kind == "ebfloor":
        floor = float(value)

        class Floored(kd.EmpiricalBayesRegularizer):
            """Empirical Bayes with the prior variance floored at `floor / fan_in`."""

            def optimal_prior_variance(self, mean, variance, fan_in):
                return ops.maximum(super().optimal_prior_variance(mean, variance, fan_in), floor / fan_in)

        return Floored(num_train, **settings)
    return kd.EmpiricalBayesRegularizer(num_train, **settings)


def keras_dvi_network(method, num_train, classes, args, features=64):
    import keras

    import keras_dvi as kd

    hidden = _hidden(args)
    scale = getattr(args, "variance_scale", None)
    fan_ins = (features,) + hidden

    def prior(layer):
        return make_prior(num_train, fan_ins[layer], args)

    def variance(layer):  # the initial posterior variance: the layers' default unless --variance-scale
        return {} if scale is None else {"kernel_variance_init": scale / fan_ins[layer]}

    if method in CNN_METHODS:
        return _cnn(method, classes, features, prior(0), args)
    layers = [keras.Input((features,))]
    if method == "mcvi":
        layers += [kd.DenseMCVI(w, "relu", regularizer=prior(i), **variance(i)) for i, w in enumerate(hidden)]
        layers.append(kd.DenseMCVI(classes, regularizer=prior(len(hidden)), **variance(len(hidden))))
        loss = kd.SampledSoftmaxELL()
    else:
        body = kd.DenseDiagDVI
        head = kd.DenseDiagDVI if method == "ddvi" else kd.DenseDVI
        if getattr(args, "body", None) == "plain":  # a Bayesian last layer
            layers += [keras.layers.Dense(w, "relu") for w in hidden]
        else:
            layers += [body(w, "relu", regularizer=prior(i), **variance(i)) for i, w in enumerate(hidden)]
        layers.append(head(classes, regularizer=prior(len(hidden)), **variance(len(hidden))))
        loss = kd.SoftmaxDeltaELL() if args.loss_method is None else kd.SoftmaxDeltaELL(method=args.loss_method)
    model = keras.Sequential(layers)
    model.compile(keras.optimizers.Adam(LEARNING_RATE), loss=loss)
    return model


def weight_count(model):
    """The number of weights (kernels and biases) of a model's keras-dvi layers."""
    import keras_dvi as kd

    return sum(int(np.prod(v.shape)) for layer in model.layers if isinstance(layer, kd.layers.BayesianLayer)
               for v in (layer.kernel_mean, layer.bias_mean) if v is not None)


def _cnn(method, classes, features, prior=None, args=None):
    """The convolutional networks of `CNN_METHODS` on flat `(features,)` digits."""
    import keras

    import keras_dvi as kd

    rank = 1 if method.startswith("cnn1d") else 2
    side = int(round(math.sqrt(features)))
    shape = (features, 1) if rank == 1 else (side, side, 1)
    layers = [keras.Input((features,)), keras.layers.Reshape(shape)]
    if prior is None:  # the plain network
        conv, pool = (keras.layers.Conv1D, keras.layers.MaxPooling1D) if rank == 1 else (keras.layers.Conv2D,
                                                                                         keras.layers.MaxPooling2D)
        layers += [conv(32, 3, padding="same", activation="relu"), pool(2),
                   conv(64, 3, padding="same", activation="relu"), pool(2), keras.layers.Flatten(),
                   keras.layers.Dense(128, "relu"), keras.layers.Dense(classes)]
        model = keras.Sequential(layers)
        model.compile(keras.optimizers.Adam(LEARNING_RATE),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model
    conv, pool = (kd.Conv1DDVI, kd.MaxPooling1DDVI) if rank == 1 else (kd.Conv2DDVI, kd.MaxPooling2DDVI)
    layers += [conv(32, 3, padding="same", regularizer=prior), pool(2, activation="relu"),
               conv(64, 3, padding="same", regularizer=prior), pool(2, activation="relu"), kd.FlattenDVI(),
               kd.DenseDiagDVI(128, "relu", regularizer=prior), kd.DenseDVI(classes, regularizer=prior)]
    model = keras.Sequential(layers)
    loss = kd.SoftmaxDeltaELL() if args.loss_method is None else kd.SoftmaxDeltaELL(method=args.loss_method)
    model.compile(keras.optimizers.Adam(LEARNING_RATE), loss=loss)
    return model


def plain_network(classes, dropout=0.0, features=64, hidden=HIDDEN):
    import keras

    layers = [keras.Input((features,))]
    for width in hidden:
        layers.append(keras.layers.Dense(width, "relu"))
        if dropout:
            layers.append(keras.layers.Dropout(dropout))
    layers.append(keras.layers.Dense(classes))
    model = keras.Sequential(layers)
    model.compile(keras.optimizers.Adam(LEARNING_RATE),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def train(method, x, y, classes, seed, args):
    """Trains `method`; returns `(predict(x) -> probabilities, seconds)`."""
    import keras

    import keras_dvi as kd

    keras.utils.set_random_seed(seed)
    start = time.time()
    if method == "ivon":  # the plain network's weights under IVON's mean-field posterior
        import ivon

        predict, seconds = ivon.train_ivon(plain_network(classes, 0.0, x.shape[1], _hidden(args)), x, y,
                                           _epochs(args), BATCH, seed, **_ivon_settings(args))
        predict.all = lambda inputs: {"default": predict(inputs)}
        return predict, seconds
    if method in ("mlp", "dropout", "ensemble", "cnn", "cnn1d"):
        members = ENSEMBLE_SIZE if method == "ensemble" else 1
        models = []
        for member in range(members):
            keras.utils.set_random_seed(seed + 1000 * member)
            if method.startswith("cnn"):
                model = _cnn(method, classes, x.shape[1])
            else:
                model = plain_network(classes, DROPOUT_RATE if method == "dropout" else 0.0, x.shape[1], _hidden(args))
            model.fit(x, y, epochs=_epochs(args), batch_size=BATCH, verbose=0)
            models.append(model)
        seconds = time.time() - start

        def predict(inputs):
            if method == "dropout":
                logits = np.stack([keras.ops.convert_to_numpy(models[0](inputs, training=True))
                                   for _ in range(DROPOUT_SAMPLES)])
            else:
                logits = np.stack([m.predict(inputs, verbose=0) for m in models])
            return np.asarray(keras.ops.convert_to_numpy(keras.ops.softmax(logits, axis=-1))).mean(0)

        predict.all = lambda inputs: {"default": predict(inputs)}
        return predict, seconds
    if method == "gi":
        hidden = _hidden(args)
        prior = kd.NealPrior(len(x))
        layers = [keras.Input((x.shape[1],)),
                  kd.GlobalInducingDense(hidden[0], "relu", num_inducing=args.gi_inducing, num_samples=10,
                                         regularizer=prior)]
        layers += [kd.GlobalInducingDense(width, "relu") for width in hidden[1:]]
        layers.append(kd.GlobalInducingDense(classes, output_layer=True))
        model = keras.Sequential(layers)
        model.compile(keras.optimizers.Adam(LEARNING_RATE), loss=kd.SampledSoftmaxELL())
        kd.initialize_from_data(model, x, y, seed=seed)
        model.fit(x, y, epochs=_epochs(args), batch_size=BATCH, verbose=0)
        seconds = time.time() - start

        def predict(inputs):
            samples = kd.predict_samples(model, inputs, MCVI_TEST_SAMPLES)
            return np.asarray(kd.predictive.sampled_class_probabilities(samples))

        predict.all = lambda inputs: {"default": predict(inputs)}
        predict.model = model
        return predict, seconds
    model = keras_dvi_network(method, len(x), classes, args, x.shape[1])
    if getattr(args, "init", None) == "plain":  # MOPED: the means of a trained plain network
        plain = plain_network(classes, 0.0, x.shape[1], _hidden(args))
        plain.fit(x, y, epochs=args.init_epochs, batch_size=BATCH, verbose=0)
        converted = kd.convert(plain, regularizer=None)
        for target, source in zip([l for l in model.layers if isinstance(l, kd.layers.BayesianLayer)],
                                  [l for l in converted.layers if isinstance(l, kd.layers.BayesianLayer)]):
            target.set_posterior(source.kernel_mean, target.kernel_variance, source.bias_mean)
    model.fit(x, y, epochs=_epochs(args), batch_size=BATCH, verbose=0)
    seconds = time.time() - start

    def predict_all(inputs):
        """`{method: probabilities}`; `"default"` is what the recipe reports."""
        if method == "mcvi":
            samples = kd.predict_samples(model, inputs, MCVI_TEST_SAMPLES)
            return {"default": np.asarray(kd.predictive.sampled_class_probabilities(samples))}
        out = model.predict(inputs, verbose=0)
        probs = {m: np.asarray(kd.predictive.class_probabilities(out, method=m, seed=0))
                 for m in kd.predictive.CLASS_PROBABILITY_METHODS}
        probs["default"] = probs[args.prob_method] if args.prob_method else np.asarray(
            kd.predictive.class_probabilities(out))
        return probs

    def predict(inputs):
        return predict_all(inputs)["default"]

    predict.all = predict_all
    predict.model = model
    return predict, seconds


def run_one(method, split, args):
    """Trains `method` on split `split` and scores it on every evaluation set. For DVI networks
    each method of `class_probabilities` is scored on the same networks (`by_prob_method`)."""
    import keras

    digits = args.dataset == "digits"
    x, y, x_eval, y_eval = load_split(split, args.validation, args.dataset)
    predict, seconds = train(method, x, y, int(y.max()) + 1, 1000 * split, args)
    record = {"method": method, "split": split, "validation": args.validation, "dataset": args.dataset,
              "recipe": recipe_label(method, args), "seconds_per_epoch": seconds / _epochs(args),
              "seconds": seconds}
    if hasattr(predict, "train_nll"):  # IVON: the objective reached (-ELBO / N = nll + kl)
        record["train_nll"], record["train_kl"] = predict.train_nll, predict.train_kl
    if hasattr(predict, "model"):  # keras-dvi: what training reached, with the full KL weight
        model = predict.model
        logs = model.evaluate(x, y, verbose=0, return_dict=True)
        record["train_nll"], record["train_kl"] = logs.get("nll"), logs.get("kl")
        first = next(layer for layer in model.layers if getattr(layer, "regularizer", None) is not None)
        record["config"] = {"prior": first.regularizer.get_config(), "loss": model.loss.get_config(),
                            "kl_warmup_length": int(keras.ops.convert_to_numpy(first.kl_warmup_length)),
                            "weights": weight_count(model), "num_train": len(x)}
    # Tabular data: clean scores only (no images to rotate, no 0-4 split).
    sets = _eval_sets(x_eval, split) if digits else {"clean": x_eval}
    by_set = {name: predict.all(inputs) for name, inputs in sets.items()}
    if digits:
        low = y < 5
        predict_04, _ = train(method, x[low], y[low], 5, 1000 * split + 1, args)
        probs_04 = predict_04.all(x_eval)
    by_method = {}
    for prob_method in by_set["clean"]:
        r = {name: scores(probs[prob_method], y_eval) for name, probs in by_set.items() if name != "uniform"}
        if digits:
            r["auroc_uniform"] = auroc(by_set["clean"][prob_method], by_set["uniform"][prob_method])
            p04 = probs_04[prob_method]
            r["auroc_digits_5_9"] = auroc(p04[y_eval < 5], p04[y_eval >= 5])
        by_method[prob_method] = r
    record.update(by_method.pop("default"))
    if by_method:
        record["by_prob_method"] = by_method
    return record


def _eval_sets(x_eval, split):
    sets = {"clean": x_eval}
    sets.update({f"rotate_{d}": rotate(x_eval, d) for d in ROTATIONS})
    sets.update({f"noise_{sd}": add_noise(x_eval, sd, seed=split) for sd in NOISE_SDS})
    sets["uniform"] = np.random.default_rng(split).uniform(0.0, 1.0, x_eval.shape).astype("float32")
    return sets


def recipe_label(method, args):
    """The cache folder of a method: its name, plus the recipe arguments that differ from the
    library defaults (keras-dvi methods only; the shape and budget for every method), plus
    `_validation`."""
    parts = [method]
    if method in KERAS_DVI_METHODS:
        for name in ("kl_weight", "kl_warmup_steps", "loss_method", "prob_method", "variance_scale", "prior_beta",
                     "prior", "body"):
            value = getattr(args, name, None)
            if value is not None:
                parts.append(f"{name}={value}")
        if getattr(args, "init", None) is not None:
            parts.append(f"init={args.init}{args.init_epochs}")
    if method == "ivon":
        for name in ("ivon_lr", "ivon_hess_init", "ivon_prior_variance", "ivon_beta2"):
            if getattr(args, name, None) is not None:
                parts.append(f"{name.replace('ivon_', '')}={getattr(args, name)}")
    if method == "gi" and getattr(args, "gi_inducing", 100) != 100:
        parts.append(f"inducing={args.gi_inducing}")
    if getattr(args, "hidden", None) and tuple(args.hidden) != HIDDEN:
        parts.append("hidden=" + "x".join(str(w) for w in args.hidden))
    if getattr(args, "epochs", None) and args.epochs != EPOCHS:
        parts.append(f"epochs={args.epochs}")
    label = ",".join(parts)
    if getattr(args, "dataset", "digits") != "digits":
        label = f"{args.dataset}/{label}"
    return label + ("_validation" if args.validation else "")


def _worker(task):
    method, split, args, path = task
    os.environ["TF_NUM_INTEROP_THREADS"] = "1"
    os.environ["TF_NUM_INTRAOP_THREADS"] = "1"
    record = run_one(method, split, args)
    cache.write(path, record)
    return record


# ---------------------------------------------------------------- summary

COLUMNS = [("clean", "accuracy"), ("clean", "nll"), ("clean", "ece"), ("clean", "brier")] + \
    [(f"rotate_{d}", "nll") for d in ROTATIONS] + [(f"noise_{s}", "nll") for s in NOISE_SDS] + \
    [("auroc_uniform", None), ("auroc_digits_5_9", None), ("seconds_per_epoch", None)]


def _value(record, key, metric):
    return record[key] if metric is None else record[key][metric]


def summary_markdown(records):
    """One row per recipe: mean ± standard error over splits of every column. DVI recipes also
    get a row per method of `class_probabilities` (`[probs=...]`) from the same networks."""
    groups = {}
    for r in records:
        groups.setdefault(r["recipe"], []).append(r)
        for prob_method, scored in r.get("by_prob_method", {}).items():
            groups.setdefault(f"{r['recipe']} [probs={prob_method}]", []).append(
                dict(scored, seconds_per_epoch=r["seconds_per_epoch"]))
    columns = [(k, m) for k, m in COLUMNS if any(k in r for r in records)] + \
        [(k, None) for k in ("train_nll", "train_kl") if any(r.get(k) is not None for r in records)]
    heads = [f"{k} {m}" if m else k for k, m in columns]
    lines = ["| recipe | splits | " + " | ".join(heads) + " |", "|---|---|" + "---|" * len(columns)]
    for recipe in sorted(groups):
        rows = groups[recipe]
        cells = []
        for key, metric in columns:
            values = np.array([np.nan if r.get(key) is None else _value(r, key, metric) for r in rows], dtype=float)
            se = values.std(ddof=1) / math.sqrt(len(values)) if len(values) > 1 else float("nan")
            digits = 1 if key == "seconds_per_epoch" else 3
            cells.append(f"{values.mean():.{digits}f} ± {se:.{digits}f}")
        lines.append(f"| {recipe} | {len(rows)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _kl_weight(text):
    return text if text == "auto" else float(text)


def make_parser():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--dataset", choices=DATASETS, default="digits",
                        help="digits (the benchmark) or a tabular check set (clean scores only)")
    parser.add_argument("--splits", type=int, nargs="+", default=list(range(5)))
    parser.add_argument("--validation", action="store_true",
                        help="score on 20%% of the training rows, not the test split (ablations)")
    parser.add_argument("--results", default="benchmarks/results/classification", help="cache folder")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--kl-weight", type=_kl_weight, default=None,
                        help="keras-dvi methods: a number (1: the full ELBO) or auto (default: the prior's, auto: "
                             "min(1, N / P) for N training rows and P weights)")
    parser.add_argument("--kl-warmup-steps", type=int, default=None, help="keras-dvi methods (default: the prior's)")
    parser.add_argument("--loss-method", default=None,
                        help="SoftmaxDeltaELL method: jankowiak or delta (default: the loss's, jankowiak)")
    parser.add_argument("--variance-scale", type=float, default=None,
                        help="keras-dvi methods: initial kernel variance = scale / fan_in (default: the layers')")
    parser.add_argument("--prior-beta", type=float, default=None,
                        help="beta of EmpiricalBayesRegularizer (default: the prior's, 10)")
    parser.add_argument("--prob-method", default=None, help="class_probabilities method (default: its default)")
    parser.add_argument("--prior", default=None,
                        help="keras-dvi methods: eb (default), gauss:V (N(0, V)), fanin:C (N(0, C / fan_in)), "
                             "ebfloor:C (empirical Bayes, variance at least C / fan_in), scale (ScalePriorRegularizer)")
    parser.add_argument("--init", choices=["plain"], default=None,
                        help="keras-dvi methods: posterior means from a plain network trained --init-epochs first")
    parser.add_argument("--init-epochs", type=int, default=20)
    parser.add_argument("--body", choices=["plain"], default=None,
                        help="keras-dvi dense methods: plain hidden layers under a Bayesian last layer")
    parser.add_argument("--ivon-lr", type=float, default=None, help="ivon: learning rate (default 0.2)")
    parser.add_argument("--ivon-hess-init", type=float, default=None, help="ivon: initial Hessian h0 (default 0.3)")
    parser.add_argument("--ivon-prior-variance", type=float, default=None,
                        help="ivon: variance of the fixed Gaussian prior, delta = 1 / (N variance) (default 1)")
    parser.add_argument("--ivon-beta2", type=float, default=None, help="ivon: Hessian momentum (default 0.99999)")
    parser.add_argument("--gi-inducing", type=int, default=100, help="gi: inducing points (default 100)")
    parser.add_argument("--hidden", type=int, nargs="+", default=None, help="hidden widths (default: 100 100)")
    parser.add_argument("--epochs", type=int, default=None, help=f"training epochs (default: {EPOCHS})")
    parser.add_argument("--summary-only", action="store_true")
    return parser


def main(argv=None):
    args = make_parser().parse_args(argv)
    tasks = []
    for method in args.methods:
        for split in args.splits:
            path = os.path.join(args.results, recipe_label(method, args), f"split_{split}.json")
            if not os.path.exists(path) and not args.summary_only:
                tasks.append((method, split, args, path))
    print(f"{len(tasks)} to run", flush=True)
    if args.jobs > 1 and len(tasks) > 1:
        context = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=context) as pool:
            for record in pool.map(_worker, tasks):
                print(_line(record), flush=True)
    else:
        for task in tasks:
            print(_line(_worker(task)), flush=True)
    records = []
    for path in sorted(glob.glob(os.path.join(args.results, "**", "split_*.json"), recursive=True)):
        with open(path) as f:
            records.append(json.load(f))
    if records:
        text = summary_markdown(records)
        with open(os.path.join(args.results, "summary.md"), "w") as f:
            f.write(text + "\n")
        print(text)
    return records


def _line(r):
    c = r["clean"]
    if "rotate_30" not in r:
        return f"{r['recipe']} split {r['split']}: acc {c['accuracy']:.3f} nll {c['nll']:.3f} ece {c['ece']:.3f}"
    return (f"{r['recipe']} split {r['split']}: acc {c['accuracy']:.3f} nll {c['nll']:.3f} ece {c['ece']:.3f} "
            f"rot30 nll {r['rotate_30']['nll']:.2f} auroc {r['auroc_uniform']:.3f}/{r['auroc_digits_5_9']:.3f} "
            f"{r['seconds_per_epoch']:.2f} s/epoch")


if __name__ == "__main__":
    main()
