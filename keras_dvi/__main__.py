"""Main job: train and evaluate a DVI regression network with empirical Bayes.

`python -m keras_dvi` trains the paper's 1-128-128-2 ReLU network (heteroscedastic output,
empirical Bayes prior) on the bundled toy data set, prints train and test log-likelihood and
RMSE, and writes a PNG of the predictive mean and 95% intervals. The toy data are used as
they are (already of unit scale). `--data DIR --split K` runs the same on a data set in the
standard UCI layout instead (one hidden layer of 50 units; inputs and targets normalised with
training statistics; metrics in original units).
"""

import argparse
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def load_uci(folder, split):
    """Train/test arrays of split `split` of a data set in the standard UCI layout."""
    import numpy as np

    needed = ["data.txt", "index_features.txt", "index_target.txt", f"index_train_{split}.txt",
              f"index_test_{split}.txt"]
    if not os.path.isdir(folder):
        raise SystemExit(f"python -m keras_dvi: --data {folder!r} is not a folder (expected the UCI "
                         f"layout: {', '.join(needed[:3])}, index_train_K.txt, index_test_K.txt).")
    missing = [name for name in needed if not os.path.exists(os.path.join(folder, name))]
    if missing:
        splits = sorted(int(n[12:-4]) for n in os.listdir(folder) if n.startswith("index_train_") and n[12:-4].isdigit())
        raise SystemExit(f"python -m keras_dvi: {folder!r} lacks {', '.join(missing)}"
                         + (f" (splits available: {splits[0]}..{splits[-1]})" if splits else "") + ".")

    def ints(name):
        return np.loadtxt(os.path.join(folder, name), dtype=int, ndmin=1)

    data = np.loadtxt(os.path.join(folder, "data.txt"))
    features, target = ints("index_features.txt"), int(ints("index_target.txt")[0])
    train, test = ints(f"index_train_{split}.txt"), ints(f"index_test_{split}.txt")
    x, y = data[:, features].astype("float32"), data[:, target].astype("float32")
    return (x[train], y[train]), (x[test], y[test])


def toy_truth_ll(x, y):
    """Mean test log-likelihood of the toy data's generating model (`datasets.load_toy_regression`)."""
    import numpy as np

    x = x[:, 0].astype("float64")
    mean = -(x + 0.5) * np.sin(3 * np.pi * x)
    sd = 0.45 * (x + 0.5) ** 2
    return float(np.mean(-0.5 * np.log(2 * np.pi * sd**2) - 0.5 * ((y - mean) / sd) ** 2))


def constant_ll(y_train, y_test):
    import numpy as np

    mean, sd = float(np.mean(y_train)), float(np.std(y_train))
    return float(np.mean(-0.5 * np.log(2 * np.pi * sd**2) - 0.5 * ((y_test - mean) / sd) ** 2))


def build_model(input_dim, hidden, method, prior, learning_rate):
    """The DVI regression network: `hidden` ReLU layers and a 2-unit (mean, log-variance) head."""
    import keras

    from keras_dvi import DenseDiagDVI, DenseDVI, HeteroscedasticELL

    body = {"dvi": DenseDVI, "ddvi": DenseDiagDVI}[method]
    layers = [keras.Input((input_dim,))]
    layers += [body(width, "relu", regularizer=prior) for width in hidden]
    layers.append(DenseDVI(2, regularizer=prior))  # full covariance keeps S_ml for the loss
    model = keras.Sequential(layers)
    model.compile(keras.optimizers.Adam(learning_rate), loss=HeteroscedasticELL())
    return model


def evaluate(model, x, y, y_mean, y_std):
    """Log-likelihood per point and RMSE in original units."""
    import numpy as np

    from keras_dvi import predictive

    y_pred = model.predict(x, verbose=0)
    y_norm = (y - y_mean) / y_std
    ll = predictive.log_predictive_density(y_pred, y_norm, y_scale=y_std)
    rmse = predictive.rmse(y_pred, y_norm, y_scale=y_std)
    return float(np.mean(np.asarray(ll))), float(np.asarray(rmse))


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m keras_dvi", description=__doc__)
    parser.add_argument("--data", help="folder in the UCI layout (default: bundled toy data)")
    parser.add_argument("--split", type=int, default=0, help="UCI split index")
    parser.add_argument("--method", choices=["dvi", "ddvi"], default="dvi")
    parser.add_argument("--prior", choices=["eb", "fixed"], default="eb",
                        help="empirical Bayes (alpha=1, beta=10) or fixed N(0, 1)")
    parser.add_argument("--epochs", type=int, default=None, help="default: 100 (toy), 40 (UCI)")
    parser.add_argument("--batch-size", type=int, default=50)
    parser.add_argument("--learning-rate", type=float, default=1e-2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", default="keras_dvi_toy.png",
                        help="PNG of the predictive (1-D inputs only); '' to skip")
    parser.add_argument("--verbose", type=int, default=None,
                        help="Keras fit verbosity (default: a progress bar on a terminal, else a line per epoch)")
    args = parser.parse_args(argv)
    if args.verbose is None:
        args.verbose = 1 if sys.stdout.isatty() else 2

    import keras
    import numpy as np

    import keras_dvi
    from keras_dvi import EmpiricalBayesRegularizer, GaussianPriorRegularizer, datasets

    keras.utils.set_random_seed(args.seed)
    if args.data:
        (x_train, y_train), (x_test, y_test) = load_uci(args.data, args.split)
        name, hidden = f"{os.path.basename(os.path.normpath(args.data))} split {args.split}", [50]
        epochs = args.epochs or 40
        x_mean, x_std = x_train.mean(0), x_train.std(0)
        x_std[x_std == 0] = 1.0
        y_mean, y_std = float(y_train.mean()), float(y_train.std() or 1.0)
    else:
        (x_train, y_train), (x_test, y_test) = datasets.load_toy_regression()
        name, hidden, epochs = "toy heteroscedastic", [128, 128], args.epochs or 100
        x_mean, x_std, y_mean, y_std = 0.0, 1.0, 0.0, 1.0
    norm_x = lambda x: (x - x_mean) / x_std  # noqa: E731
    n = len(x_train)
    prior = (
        EmpiricalBayesRegularizer(num_train=n, alpha=1.0, beta=10.0)
        if args.prior == "eb"
        else GaussianPriorRegularizer(num_train=n, variance=1.0)
    )
    model = build_model(x_train.shape[1], hidden, args.method, prior, args.learning_rate)
    arch = "-".join(str(d) for d in [x_train.shape[1], *hidden, 2])
    print(f"keras-dvi {keras_dvi.__version__}: {args.method.upper()} {arch} ReLU, "
          f"{'empirical Bayes' if args.prior == 'eb' else 'fixed N(0, 1)'} prior, {name} "
          f"({n} train / {len(x_test)} test)")
    if args.method == "ddvi" and len(hidden) == 1:
        print("note: with one hidden layer dDVI computes exactly what DVI does: the units of a layer fed "
              "with data are uncorrelated, and both use a full-covariance head; the two differ from "
              "the second hidden layer on (the toy network without --data has two)")
    start = time.perf_counter()
    model.fit(norm_x(x_train), (y_train - y_mean) / y_std, epochs=epochs,
              batch_size=args.batch_size, verbose=args.verbose)
    seconds = time.perf_counter() - start
    train_ll, train_rmse = evaluate(model, norm_x(x_train), y_train, y_mean, y_std)
    test_ll, test_rmse = evaluate(model, norm_x(x_test), y_test, y_mean, y_std)
    print(f"trained {epochs} epochs in {seconds:.1f} s")
    print(f"train: log-likelihood {train_ll:8.4f}  RMSE {train_rmse:.4f}")
    print(f"test:  log-likelihood {test_ll:8.4f}  RMSE {test_rmse:.4f}")
    if not args.data:
        print(f"reference on the same test points: the data's true mean and noise {toy_truth_ll(x_test, y_test):.4f}, "
              f"a constant Gaussian (training mean and sd) {constant_ll(y_train, y_test):.4f}")
    if args.plot and x_train.shape[1] == 1:
        from keras_dvi import plotting

        grid = np.linspace(x_train.min(), x_train.max(), 300, dtype="float32")[:, None]
        moments = keras_dvi.predictive.regression_moments(model.predict(norm_x(grid), verbose=0))
        mean = np.asarray(moments["mean"])[:, 0] * y_std + y_mean
        sd = np.sqrt(np.asarray(moments["variance"])[:, 0]) * y_std
        plotting.write_band_plot(args.plot, grid[:, 0], mean, 1.96 * sd, x_train[:, 0], y_train)
        print(f"wrote {args.plot}: predictive mean and 95% interval over the training data")
    return {"train_ll": train_ll, "test_ll": test_ll, "train_rmse": train_rmse,
            "test_rmse": test_rmse, "seconds": seconds}


if __name__ == "__main__":
    main()
