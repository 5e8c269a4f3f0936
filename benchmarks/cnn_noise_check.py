"""Is the DVI CNN's over-confidence on uniform noise its posterior or its moment approximation?

    python benchmarks/cnn_noise_check.py --data ../shared/data/mnist.npz --epochs 20

Trains `benchmarks/images.py`'s DVI CNN (the library's defaults, Adam 1e-3, batches of 128,
seed 0) for `--epochs` on MNIST, then scores 300 test digits and 300 uniform-noise images
three ways: keras-dvi's closed-form predictive (`keras_dvi.predict`, the default "mean"
probabilities and "probit"), and Monte Carlo over the posterior weights of the same trained
network (`keras_dvi.predict_samples`, 200 draws, the mean softmax): the predictive entropies,
the AUROC of entropy for telling noise from digits, and how far the closed-form logit moments
are from the Monte Carlo ones (median mean error in Monte Carlo sd, median variance ratio).
If Monte Carlo is confident on noise too, the posterior is; if not, the approximation is.
"""

import argparse
import os
import sys
import time
import warnings

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import images  # noqa: E402


def _softmax(z):
    z = z - z.max(-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(-1, keepdims=True)


def _entropy(p):
    return -(p * np.log(np.clip(p, 1e-12, 1))).sum(-1)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=None, help="mnist.npz in the keras.datasets layout (default: download)")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--train-rows", type=int, default=None, help="subsample the training rows (quick checks)")
    parser.add_argument("--rows", type=int, default=300, help="digits and noise images scored")
    parser.add_argument("--samples", type=int, default=200)
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    import keras
    from sklearn.metrics import roc_auc_score

    import keras_dvi as kd

    x, y, x_test, _ = images.load_mnist(args.data)
    if args.train_rows:
        x, y = x[: args.train_rows], y[: args.train_rows]
    keras.utils.set_random_seed(0)
    model = images.keras_dvi_cnn("dvi", 10, len(x))
    start = time.time()
    model.fit(x, y, batch_size=128, epochs=args.epochs, verbose=0)
    print(f"trained {args.epochs} epochs in {time.time() - start:.0f} s")
    noise = np.random.default_rng(0).uniform(0, 1, (args.rows,) + x.shape[1:]).astype("float32")
    entropies = {}
    for name, data in (("digits", x_test[: args.rows]), ("noise", noise)):
        mean_method = kd.predict(model, data)["entropy"]
        probit = kd.predict(model, data, probability_method="probit")["entropy"]
        mean, var = (np.asarray(a) for a in kd.unpack(model.predict(data, verbose=0)))
        if var.ndim == 3:
            var = np.diagonal(var, axis1=1, axis2=2)
        samples = kd.predict_samples(model, data, args.samples, seed=1)
        monte_carlo = _entropy(_softmax(samples).mean(1))
        entropies[name] = (mean_method, probit, monte_carlo)
        print(f"{name}: entropy (nats) mean-method {mean_method.mean():.3f}, probit {probit.mean():.3f}, "
              f"Monte Carlo over weights {monte_carlo.mean():.3f}; logit sd closed form {np.sqrt(var).mean():.3f}, "
              f"Monte Carlo {samples.std(1).mean():.3f}; median |mean error| / sd "
              f"{np.median(np.abs(mean - samples.mean(1)) / samples.std(1)):.2f}, median variance ratio "
              f"{np.median(var / samples.var(1)):.2f}")
    labels = np.r_[np.zeros(args.rows), np.ones(args.rows)]
    for i, label in enumerate(("mean-method", "probit", "Monte Carlo over weights")):
        auroc = roc_auc_score(labels, np.r_[entropies["digits"][i], entropies["noise"][i]])
        print(f"AUROC (noise against digits, by entropy), {label}: {auroc:.3f}")


if __name__ == "__main__":
    main()
