"""Main job: train and evaluate a DVI regression network with empirical Bayes.

`python -m keras_dvi` trains the paper's 1-128-128-2 ReLU network (heteroscedastic output,
empirical Bayes prior) on the bundled toy data set, prints train and test log-likelihood and
RMSE, and writes a PNG of the predictive mean and 95% intervals. The toy data are used as
they are (already of unit scale). `--data DIR --split K` runs the same on a data set in the
standard UCI layout instead (one hidden layer of 50 units; inputs and targets normalised with
training statistics; metrics in original units).
"""

import argparse
import contextlib
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def load_uci(folder, split):
    """Split `split` of the UCI data set in `folder` (`keras_dvi.datasets.load_uci`), or exit
    with the reason."""
    from keras_dvi import datasets

    try:
        return datasets.load_uci(folder, split)
    except FileNotFoundError as error:
        raise SystemExit(f"python -m keras_dvi: --data {error}") from None


def gaussian_ll(y, mean, sd):
    """Mean log density of `y` under independent normals."""
    import numpy as np

    return float(np.mean(-0.5 * np.log(2 * np.pi * sd**2) - 0.5 * ((y - mean) / sd) ** 2))


def toy_truth_ll(x, y):
    """Mean test log-likelihood of the toy data's generating model (`datasets.toy_regression_truth`)."""
    from keras_dvi import datasets

    return gaussian_ll(y, *datasets.toy_regression_truth(x[:, 0]))


def constant_ll(y_train, y_test):
    import numpy as np

    return gaussian_ll(y_test, float(np.mean(y_train)), float(np.std(y_train)))


@contextlib.contextmanager
def native_stderr_silenced():
    """Drops what native code writes to file descriptor 2 meanwhile: TensorFlow's libraries log
    start-up notices there as they load, whatever `TF_CPP_MIN_LOG_LEVEL` says. Python errors
    still show (they are printed after the descriptor is restored)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def plain_reference(x_train, y_train, x_test, y_test, hidden, epochs, batch_size, learning_rate):
    """Test log-likelihood and RMSE of a plain Keras network of the same shape (ReLU `Dense`
    layers, a mean and log-variance head), trained by maximum likelihood on the same
    (normalised) data and budget: what keras-dvi is compared against."""
    import keras
    import numpy as np
    from keras import ops

    def gaussian_nll(y, out):
        y = ops.reshape(ops.cast(y, out.dtype), (-1,))
        mean, log_var = out[:, 0], out[:, 1]
        return 0.5 * (np.log(2 * np.pi) + log_var + (y - mean) ** 2 * ops.exp(-log_var))

    layers = [keras.Input((x_train.shape[1],))] + [keras.layers.Dense(w, "relu") for w in hidden]
    model = keras.Sequential(layers + [keras.layers.Dense(2)])
    model.compile(keras.optimizers.Adam(learning_rate), loss=gaussian_nll)
    model.fit(x_train, y_train, epochs=epochs, batch_size=batch_size, verbose=0)
    out = model.predict(x_test, verbose=0).astype("float64")
    mean, sd = out[:, 0], np.exp(0.5 * out[:, 1])
    return gaussian_ll(y_test, mean, sd), float(np.sqrt(np.mean((y_test - mean) ** 2)))


def build_model(input_dim, hidden, method, prior, learning_rate):
    """The DVI regression network: `hidden` ReLU layers and a 2-unit (mean, log-variance) head."""
    import keras

    from keras_dvi import DenseDiagDVI, DenseDVI, HeteroscedasticELL

    body = {"dvi": DenseDVI, "ddvi": DenseDiagDVI}[method]
    layers = [keras.Input((input_dim,))]
    # After data the units are independent: DenseDiagDVI computes exactly what DenseDVI does
    # there, in the compact diagonal form (cheaper for the next layer).
    layers += [(DenseDiagDVI if i == 0 else body)(width, "relu", regularizer=prior) for i, width in enumerate(hidden)]
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


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The description as written, and every option's default in its help."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" not in text and action.default is not argparse.SUPPRESS and action.option_strings:
            text += f" (default: {action.default!r})"
        return text


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m keras_dvi", description=__doc__,
                                     formatter_class=_HelpFormatter)
    parser.add_argument("--data", default=None,
                        help="folder of a data set in the standard UCI layout (default: the bundled toy data)")
    parser.add_argument("--split", type=int, default=0, help="split index of a UCI data set")
    parser.add_argument("--method", choices=["dvi", "ddvi"], default="dvi",
                        help="dvi: full-covariance hidden layers; ddvi: diagonal (DenseDiagDVI)")
    parser.add_argument("--prior", choices=["eb", "fixed"], default="eb",
                        help="empirical Bayes (alpha=1, beta=10) or a fixed N(0, 1) prior")
    parser.add_argument("--epochs", type=int, default=None, help="training epochs (default: 100 toy, 40 UCI)")
    parser.add_argument("--batch-size", type=int, default=50, help="rows per training step")
    parser.add_argument("--learning-rate", type=float, default=1e-2, help="Adam's learning rate")
    parser.add_argument("--seed", type=int, default=0, help="seed of the initial weights and the batch order")
    parser.add_argument("--plot", default="keras_dvi_toy.png",
                        help="PNG of the predictive (1-D inputs only; needs matplotlib); '' to skip")
    parser.add_argument("--reference", action=argparse.BooleanOptionalAction, default=True,
                        help="also train a plain Keras network of the same shape, as a reference")
    parser.add_argument("--verbose", type=int, default=None,
                        help="Keras fit verbosity (default: a progress bar on a terminal, else a line per epoch)")
    args = parser.parse_args(argv)
    if args.verbose is None:
        args.verbose = 1 if sys.stdout.isatty() else 2

    with native_stderr_silenced():
        import keras
        import numpy as np

        import keras_dvi
        from keras_dvi import EmpiricalBayesRegularizer, GaussianPriorRegularizer, datasets, plotting

        keras.ops.convert_to_numpy(keras.ops.zeros(1))  # first op: TensorFlow's device notices
    if args.plot and not plotting.available():
        print(f"note: --plot {args.plot} needs matplotlib (pip install \"keras-dvi[plot]\"); no figure this time")
        args.plot = ""
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
    results = {"train_ll": train_ll, "test_ll": test_ll, "train_rmse": train_rmse,
               "test_rmse": test_rmse, "seconds": seconds}
    print("references on the same test points:")
    if not args.data:
        print(f"  the data's true mean and noise:              log-likelihood {toy_truth_ll(x_test, y_test):8.4f}")
    print(f"  a constant Gaussian (training mean and sd):  log-likelihood {constant_ll(y_train, y_test):8.4f}")
    if args.reference:
        keras.utils.set_random_seed(args.seed)
        ref_ll, ref_rmse = plain_reference(norm_x(x_train), (y_train - y_mean) / y_std, norm_x(x_test),
                                           (y_test - y_mean) / y_std, hidden, epochs, args.batch_size,
                                           args.learning_rate)
        ref_ll, ref_rmse = ref_ll - np.log(y_std), ref_rmse * y_std
        results.update(reference_test_ll=ref_ll, reference_test_rmse=ref_rmse)
        print(f"  a plain Keras network (same shape, budget):  log-likelihood {ref_ll:8.4f}  RMSE {ref_rmse:.4f}")
        print("  (maximum likelihood over-fits the noise, so this reference's figure moves with the seed and,\n"
              "  through rounding, with the CPU it runs on)")
    if args.plot and x_train.shape[1] == 1:
        grid = np.linspace(min(x_train.min(), x_test.min()), max(x_train.max(), x_test.max()), 300,
                           dtype="float32")[:, None]
        predictive = keras_dvi.predict(model, norm_x(grid))
        mean = predictive["mean"][:, 0] * y_std + y_mean
        half = (predictive["upper"][:, 0] - predictive["lower"][:, 0]) / 2 * y_std
        truth = None if args.data else (lambda x: datasets.toy_regression_truth(x)[0])
        title = (f"keras-dvi {args.method.upper()} {arch}, {name}: test log-likelihood {test_ll:.3f}")
        plotting.write_predictive_plot(args.plot, grid[:, 0], mean, half, (x_train[:, 0], y_train),
                                       (x_test[:, 0], y_test), truth=truth, title=title)
        print(f"wrote {args.plot}: predictive mean and 95% interval, training and test points")
    return results


if __name__ == "__main__":
    main()
