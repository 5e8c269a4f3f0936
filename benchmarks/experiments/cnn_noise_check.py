"""Is the DVI CNN's over-confidence on uniform noise its posterior or its moment approximation?

    python -m benchmarks.experiments.cnn_noise_check --data ../shared/data/mnist.npz --epochs 20

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

`--network dense100` (or `dense800`) checks `images.py`'s dense DVI network (784-W-W-10, the
same defaults) instead, and adds where its first layer's weight noise comes from: its weights
grouped by how often their pixel is non-zero in the training images (never, in under 1% of
them, more often), each group's median posterior variance, and its share of the layer's
weight-noise variance on digits and on noise: a test of the hypothesis that weights left at
the prior on pixels the digits never use give a dense network the uncertainty on noise that a
CNN, sharing every kernel weight across positions, cannot have (BENCHMARKS.md: ruled out).
"""

import argparse
import time
import warnings

import numpy as np
from benchmarks import images  # noqa: E402
from benchmarks.classification import auroc, entropy  # noqa: E402 - the benchmarks' own metrics


#: `--network` -> `images.keras_dvi_cnn`'s method.
NETWORKS = {"cnn": "dvi", "dense100": "dense100", "dense800": "dense800"}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=None, help="mnist.npz in the keras.datasets layout (default: download)")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--train-rows", type=int, default=None, help="subsample the training rows (quick checks)")
    parser.add_argument("--rows", type=int, default=300, help="digits and noise images scored")
    parser.add_argument("--samples", type=int, default=200)
    parser.add_argument("--plain", action="store_true", help="also train and score a plain CNN")
    parser.add_argument("--network", choices=NETWORKS, default="cnn",
                        help="the DVI network checked: the CNN, or `images.py`'s dense rows (784-W-W-10)")
    args = parser.parse_args(argv)
    if args.plain and args.network != "cnn":
        parser.error("argument --plain: only with --network cnn (the plain network trained is the CNN).")
    warnings.simplefilter("ignore")
    import keras
    from scipy.special import softmax

    import keras_dvi as kd

    x, y, x_test, _ = images.load_mnist(args.data)
    if args.train_rows:
        x, y = x[: args.train_rows], y[: args.train_rows]
    keras.utils.set_random_seed(0)
    model = images.keras_dvi_cnn(NETWORKS[args.network], 10, len(x))
    label = "DVI CNN" if args.network == "cnn" else f"DVI {args.network}"
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
    for i, method in enumerate(("mean-method", "probit", "Monte Carlo over weights")):
        score = auroc(probabilities["digits"][i], probabilities["noise"][i])
        print(f"AUROC (noise against digits, by entropy), {method}: {score:.3f}")
    networks = {"mean network (posterior means, no weight noise)": mean_network(model)}
    if args.plain:
        keras.utils.set_random_seed(0)
        plain = images.plain_cnn(10)
        start = time.time()
        plain.fit(x, y, batch_size=128, epochs=args.epochs, verbose=0)
        print(f"plain CNN: trained {args.epochs} epochs in {time.time() - start:.0f} s")
        networks["plain CNN"] = plain
    for name_of_network, network in networks.items():
        logits = {name: network.predict(data, verbose=0) for name, data in
                  (("digits", x_test[: args.rows]), ("noise", noise))}
        p = {name: softmax(v, axis=-1) for name, v in logits.items()}
        print(f"{name_of_network}: entropy digits {entropy(p['digits']).mean():.3f}, "
              f"noise {entropy(p['noise']).mean():.3f}; "
              f"largest logit (median) digits {np.median(logits['digits'].max(-1)):.1f}, noise "
              f"{np.median(logits['noise'].max(-1)):.1f}; AUROC {auroc(p['digits'], p['noise']):.3f}")
    print(f"{label} closed-form logit means: largest (median) on noise {np.median(logit_means['noise'].max(-1)):.1f}")
    if args.network != "cnn":
        first = next(layer for layer in model.layers if isinstance(layer, kd.DenseDiagDVI))
        kernel_variance = np.asarray(keras.ops.convert_to_numpy(first.kernel_variance))
        prior = float(keras.ops.convert_to_numpy(first.regularizer.optimal_prior_variance(
            first.kernel_mean, first.kernel_variance, kernel_variance.shape[0])))
        print(f"first layer: empirical Bayes prior variance {prior:.2e}")
        for name, data in (("digits", x_test[: args.rows]), ("noise", noise)):
            for group, (count, median_variance, share) in pixel_groups(x, data, kernel_variance).items():
                print(f"{name}: pixels {group} ({count}): median kernel variance {median_variance:.2e}, share of "
                      f"the first layer's weight-noise variance {share:.3f}")


def pixel_groups(x_train, x_eval, kernel_variance, rare=0.01):
    """The first dense layer's weights grouped by their pixel's use in training: `"never"`
    non-zero, `"rarely"` (in under `rare` of the images), `"often"`. For each group: the
    number of pixels, the median posterior variance of their weights, and their share of the
    weight-noise variance `sum_i x_i^2 V_ij` of the layer's pre-activations on `x_eval`
    (summed over units and images)."""
    used = (np.reshape(x_train, (len(x_train), -1)) > 0).mean(0)
    squares = np.square(np.reshape(x_eval, (len(x_eval), -1)).astype("float64"))
    total = (squares @ kernel_variance).sum()
    groups = {"never": used == 0, "rarely": (used > 0) & (used < rare), "often": used >= rare}
    return {name: (int(mask.sum()), float(np.median(kernel_variance[mask])) if mask.any() else float("nan"),
                   float((squares[:, mask] @ kernel_variance[mask]).sum() / total))
            for name, mask in groups.items()}


def mean_network(model):
    """A plain Keras network of the DVI network's shape holding its posterior means (no weight
    noise): `Conv2DDVI` -> `Conv2D`, `MaxPooling2DDVI(activation=...)` -> `MaxPooling2D` and the
    activation, `DenseDiagDVI` / `DenseDVI` -> `Dense`, flattening kept."""
    import keras

    import keras_dvi as kd

    layers, weighted = [keras.Input(model.input_shape[1:])], []
    for layer in model.layers:
        config = layer.get_config()
        if isinstance(layer, kd.Conv2DDVI):
            layers.append(keras.layers.Conv2D(layer.filters, layer.kernel_size, strides=config["strides"],
                                              padding=config["padding"], dilation_rate=config["dilation_rate"],
                                              activation=config["activation"]))
            weighted.append((layers[-1], layer))
        elif isinstance(layer, kd.MaxPooling2DDVI):
            layers.append(keras.layers.MaxPooling2D(config["pool_size"], config["strides"], config["padding"]))
            if config["activation"] is not None:
                layers.append(keras.layers.Activation(config["activation"]))
        elif isinstance(layer, (kd.FlattenDVI, keras.layers.Flatten)):
            layers.append(keras.layers.Flatten())
        elif isinstance(layer, (kd.DenseDiagDVI, kd.DenseDVI)):
            layers.append(keras.layers.Dense(layer.units, activation=config["activation"]))
            weighted.append((layers[-1], layer))
        else:
            raise ValueError(f"mean_network: no plain counterpart for layer {layer.name!r} ({type(layer).__name__}).")
    plain = keras.Sequential(layers)
    for target, source in weighted:
        target.set_weights([np.asarray(keras.ops.convert_to_numpy(source.kernel_mean)),
                            np.asarray(keras.ops.convert_to_numpy(source.bias_mean))])
    return plain


if __name__ == "__main__":
    main()
