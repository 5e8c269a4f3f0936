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

Two more rows locate it within the posterior: the *mean network* (a plain Keras CNN of the
same shape holding the posterior means, no weight noise), and with `--plain` a plain CNN
trained the same way (`images.plain_cnn`): the entropies, the AUROC and the largest logit
(median over images). If the mean network is as unsure on noise as the plain CNN, the weight
noise makes the DVI CNN confident (through the ReLUs, a unit's mean grows with its input's
variance); if the mean network is confident too, the means learnt under the ELBO are.
"""

import argparse
import os
import sys
import time
import warnings

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import images  # noqa: E402
from classification import auroc, entropy  # noqa: E402 - the benchmarks' own metrics


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=None, help="mnist.npz in the keras.datasets layout (default: download)")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--train-rows", type=int, default=None, help="subsample the training rows (quick checks)")
    parser.add_argument("--rows", type=int, default=300, help="digits and noise images scored")
    parser.add_argument("--samples", type=int, default=200)
    parser.add_argument("--plain", action="store_true", help="also train and score a plain CNN")
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    import keras
    from scipy.special import softmax

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
    probabilities, logit_means = {}, {}
    for name, data in (("digits", x_test[: args.rows]), ("noise", noise)):
        mean_method = kd.predict(model, data)["probabilities"]
        probit = kd.predict(model, data, probability_method="probit")["probabilities"]
        mean, var = (np.asarray(a) for a in kd.unpack(model.predict(data, verbose=0), covariance="diagonal"))
        samples = kd.predict_samples(model, data, args.samples, seed=1)
        monte_carlo = softmax(samples, axis=-1).mean(1)
        probabilities[name], logit_means[name] = (mean_method, probit, monte_carlo), mean
        print(f"{name}: entropy (nats) mean-method {entropy(mean_method).mean():.3f}, probit "
              f"{entropy(probit).mean():.3f}, Monte Carlo over weights {entropy(monte_carlo).mean():.3f}; "
              f"logit sd closed form {np.sqrt(var).mean():.3f}, Monte Carlo {samples.std(1).mean():.3f}; "
              f"median |mean error| / sd {np.median(np.abs(mean - samples.mean(1)) / samples.std(1)):.2f}, "
              f"median variance ratio {np.median(var / samples.var(1)):.2f}")
    for i, label in enumerate(("mean-method", "probit", "Monte Carlo over weights")):
        score = auroc(probabilities["digits"][i], probabilities["noise"][i])
        print(f"AUROC (noise against digits, by entropy), {label}: {score:.3f}")
    networks = {"mean network (posterior means, no weight noise)": mean_network(model)}
    if args.plain:
        keras.utils.set_random_seed(0)
        plain = images.plain_cnn(10)
        start = time.time()
        plain.fit(x, y, batch_size=128, epochs=args.epochs, verbose=0)
        print(f"plain CNN: trained {args.epochs} epochs in {time.time() - start:.0f} s")
        networks["plain CNN"] = plain
    for label, network in networks.items():
        logits = {name: network.predict(data, verbose=0) for name, data in
                  (("digits", x_test[: args.rows]), ("noise", noise))}
        p = {name: softmax(v, axis=-1) for name, v in logits.items()}
        print(f"{label}: entropy digits {entropy(p['digits']).mean():.3f}, noise {entropy(p['noise']).mean():.3f}; "
              f"largest logit (median) digits {np.median(logits['digits'].max(-1)):.1f}, noise "
              f"{np.median(logits['noise'].max(-1)):.1f}; AUROC {auroc(p['digits'], p['noise']):.3f}")
    print(f"DVI CNN closed-form logit means: largest (median) on noise {np.median(logit_means['noise'].max(-1)):.1f}")


def mean_network(model):
    """A plain Keras CNN of `images.keras_dvi_cnn("dvi", ...)`'s shape (conv, max pool, ReLU,
    twice; flatten; dense ReLU; dense) holding the DVI CNN's posterior means."""
    import keras

    import keras_dvi as kd

    weighted = [layer for layer in model.layers if isinstance(layer, (kd.Conv2DDVI, kd.DenseDiagDVI, kd.DenseDVI))]
    plain = keras.Sequential([
        keras.Input(model.input_shape[1:]),
        keras.layers.Conv2D(weighted[0].filters, weighted[0].kernel_size), keras.layers.MaxPooling2D(2),
        keras.layers.ReLU(),
        keras.layers.Conv2D(weighted[1].filters, weighted[1].kernel_size), keras.layers.MaxPooling2D(2),
        keras.layers.ReLU(), keras.layers.Flatten(),
        keras.layers.Dense(weighted[2].units, activation="relu"), keras.layers.Dense(weighted[3].units)])
    for target, source in zip([layer for layer in plain.layers if layer.weights], weighted):
        target.set_weights([np.asarray(keras.ops.convert_to_numpy(source.kernel_mean)),
                            np.asarray(keras.ops.convert_to_numpy(source.bias_mean))])
    return plain


if __name__ == "__main__":
    main()
