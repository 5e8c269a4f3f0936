"""Whole converted networks against Monte Carlo over their weights: the conversion guide's table
"The whole network against Monte Carlo".

Each network is built with random weights at 32x32 (75x75 for InceptionResNetV2, its smallest
input; Keras' applications with 5 classes; a U-Net with 3 classes per pixel),
its batch normalisation's scales and statistics randomised and then calibrated on a batch of
32 images (a normalised network, as after training), converted by `keras_dvi.convert` with
the default posterior variances, and its moments compared with 300 draws of the weights
through `keras_dvi.predict_samples` on 2 images: the logits' variance over Monte Carlo's (per
unit; a ratio's Monte Carlo standard error is 0.08), the means' error in Monte Carlo standard
deviations, and the median ratio over the units of the last feature map (the one the global
pooling reads). `tests/test_conversion.py` asserts the bands of the ResNet-20 and MobileNetV2
with these functions.

    python -m benchmarks.experiments.converted_against_monte_carlo --networks MobileNetV3Small --seeds 0 1 2
"""

import argparse
import time
import warnings

import keras
import numpy as np

import keras_dvi as kd


def _applications(build, size=32, **kwargs):
    return lambda: build(weights=None, input_shape=(size, size, 3), classes=5, **kwargs)


def _resnet20():
    from benchmarks.conv_speed import resnet20

    return resnet20()


def unet(size=32, classes=3):
    """keras.io's U-Net for the Oxford pets ("Image segmentation with a U-Net-like
    architecture"), at `size` x `size`: separable convolutions, batch normalisation and
    residual sums down, transposed convolutions and upsampling back up, a per-pixel softmax."""
    layers = keras.layers
    inputs = keras.Input((size, size, 3))
    x = layers.Activation("relu")(layers.BatchNormalization()(layers.Conv2D(32, 3, strides=2, padding="same")(inputs)))
    previous = x
    for filters in (64, 128, 256):
        x = layers.Activation("relu")(x)
        x = layers.BatchNormalization()(layers.SeparableConv2D(filters, 3, padding="same")(x))
        x = layers.Activation("relu")(x)
        x = layers.BatchNormalization()(layers.SeparableConv2D(filters, 3, padding="same")(x))
        x = layers.MaxPooling2D(3, strides=2, padding="same")(x)
        x = layers.add([x, layers.Conv2D(filters, 1, strides=2, padding="same")(previous)])
        previous = x
    for filters in (256, 128, 64, 32):
        x = layers.Activation("relu")(x)
        x = layers.BatchNormalization()(layers.Conv2DTranspose(filters, 3, padding="same")(x))
        x = layers.Activation("relu")(x)
        x = layers.BatchNormalization()(layers.Conv2DTranspose(filters, 3, padding="same")(x))
        x = layers.UpSampling2D(2)(x)
        x = layers.add([x, layers.Conv2D(filters, 1, padding="same")(layers.UpSampling2D(2)(previous))])
        previous = x
    return keras.Model(inputs, layers.Conv2D(classes, 3, activation="softmax", padding="same")(x))


NETWORKS = {
    "resnet20": _resnet20,
    "unet": unet,
    "MobileNetV2": _applications(keras.applications.MobileNetV2, alpha=0.35),
    "MobileNetV3Small": _applications(keras.applications.MobileNetV3Small),
    "MobileNetV3Small-minimalistic": _applications(keras.applications.MobileNetV3Small, minimalistic=True),
    "MobileNetV3Large": _applications(keras.applications.MobileNetV3Large),
    "EfficientNetB0": _applications(keras.applications.EfficientNetB0),
    "NASNetMobile": _applications(keras.applications.NASNetMobile),
    "ConvNeXtTiny": _applications(keras.applications.ConvNeXtTiny),
    "InceptionResNetV2": _applications(keras.applications.InceptionResNetV2, size=75),  # (its smallest input)
}


def images(rows, size=32, channels=3, seed=0):
    """Uniform random images in [0, 1), `(rows, size, size, channels)`, float32."""
    return np.random.default_rng(seed).uniform(size=(rows, size, size, channels)).astype("float32")


def _all_layers(model):
    """The layers of `model` and of the models nested in it (ConvNeXt's stem is a `Sequential`)."""
    for layer in model.layers:
        yield from _all_layers(layer) if isinstance(layer, keras.Model) else (layer,)


def randomise_batch_norm(model, seed=0):
    """Inference statistics and scales far from their initial values, so folding them matters
    (layer normalisations' scales and shifts too, and ConvNeXt's layer scales, whose initial
    1e-6 would leave its residual branches out)."""
    rng = np.random.default_rng(seed)
    for layer in _all_layers(model):
        if isinstance(layer, keras.layers.LayerNormalization):
            n = int(layer.gamma.shape[0])
            layer.gamma.assign(rng.uniform(0.5, 2.0, n))
            layer.beta.assign(rng.normal(size=n) * 0.5)
        if type(layer).__name__ == "LayerScale":  # (keras.applications' ConvNeXt)
            layer.weights[0].assign(rng.uniform(0.5, 1.5, layer.weights[0].shape))
        if isinstance(layer, keras.layers.BatchNormalization):
            n = int(layer.moving_mean.shape[0])
            if layer.gamma is not None:  # (scale=False: none)
                layer.gamma.assign(rng.uniform(0.5, 2.0, n))
            if layer.beta is not None:
                layer.beta.assign(rng.normal(size=n))
            layer.moving_mean.assign(rng.normal(size=n))
            layer.moving_variance.assign(rng.uniform(0.5, 2.0, n))


def calibrate_batch_norm(model, x):
    """Sets every `BatchNormalization`'s inference statistics to those of the batch `x` (its
    scale and shift as they are): a normalised network, as after training, where random weights
    and randomised statistics let the activations grow or vanish with depth."""
    layers = [layer for layer in model.layers if isinstance(layer, keras.layers.BatchNormalization)]
    momenta = [layer.momentum for layer in layers]
    for layer in layers:
        layer.momentum = 0.0
    model(x, training=True)
    for layer, momentum in zip(layers, momenta):
        layer.momentum = momentum


def moments_and_samples(plain, x, draws, seed):
    """The converted network's moments (default variances) and its Monte Carlo draws over the
    weights, for the feature map its last global pooling reads (a dense prediction: the map its
    output layer reads) and for its logits (a dense prediction: every pixel's):
    `((map mean, map variance, map samples), (logit mean, logit variance, logit samples))`."""
    converted = kd.convert(plain, regularizer=kd.EmpiricalBayesRegularizer(num_train=50000))
    pooling = [layer for layer in converted.layers if isinstance(layer, kd.GlobalAveragePooling2DDVI)]
    last_map = pooling[-1].input if pooling else converted.layers[-1].input
    both = keras.Model(converted.inputs, [last_map, converted.outputs[0]])
    packed_map, packed_logits = both(x)
    map_mean, map_variance = (keras.ops.convert_to_numpy(t) for t in kd.unpack(packed_map))
    logit_mean, logit_variance = (keras.ops.convert_to_numpy(t)
                                  for t in kd.unpack(packed_logits, covariance="diagonal"))
    map_samples, logit_samples = kd.predict_samples(both, x, draws, seed=seed)
    return (map_mean, map_variance, map_samples), (logit_mean, logit_variance, logit_samples)


def agreement(mean, variance, samples):
    """Per unit: the moments' variance over the Monte Carlo variance, and the mean's error in
    Monte Carlo standard deviations, over the units the draws move (a dead ReLU unit has none)."""
    samples = samples.astype("float64")
    mc_mean, mc_variance = samples.mean(1), samples.var(1)
    moving = mc_variance > 1e-3 * np.median(mc_variance[mc_variance > 0])
    ratio = variance.reshape(mc_variance.shape)[moving] / mc_variance[moving]
    error = np.abs(mean.reshape(mc_mean.shape) - mc_mean)[moving] / np.sqrt(mc_variance[moving])
    return ratio, error


def agreements(network, seed, draws=300):
    """`((logit ratio, logit error), (map ratio, map error))` per unit (`agreement`) of one
    network and seed under the protocol above."""
    keras.utils.set_random_seed(seed)
    plain = NETWORKS[network]()
    size = int(plain.inputs[0].shape[1])
    randomise_batch_norm(plain)
    calibrate_batch_norm(plain, images(32, size=size, seed=9))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (convert's warning on EfficientNets and MobileNetV3s is the subject)
        feature_map, logits = moments_and_samples(plain, images(2, size=size), draws=draws, seed=seed)
    return agreement(*logits), agreement(*feature_map)


def measure(network, seed, draws=300):
    """One network and seed: the figures of the guide's table, as a dict."""
    start = time.perf_counter()
    (logit_ratio, logit_error), (map_ratio, map_error) = agreements(network, seed, draws)
    return {"network": network, "seed": seed, "logit_ratio": (float(logit_ratio.min()), float(logit_ratio.max())),
            "logit_error_max": float(logit_error.max()), "map_ratio_median": float(np.median(map_ratio)),
            "map_error_median": float(np.median(map_error)), "seconds": time.perf_counter() - start}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--networks", nargs="+", choices=sorted(NETWORKS), default=sorted(NETWORKS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--draws", type=int, default=300)
    args = parser.parse_args(argv)
    print("| network | seed | logits' variance / Monte Carlo | logits' means, max error (sd) | last map, median ratio |")
    print("|---|---|---|---|---|")
    for network in args.networks:
        for seed in args.seeds:
            r = measure(network, seed, args.draws)
            low, high = r["logit_ratio"]
            print(f"| {network} | {seed} | {low:.2f}-{high:.2f} | {r['logit_error_max']:.2f} | "
                  f"{r['map_ratio_median']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
