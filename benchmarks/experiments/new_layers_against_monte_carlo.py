"""Networks with 3D convolutions, group normalisation and RMS normalisation against Monte Carlo
over their weights, over several initialisations: the figures of the conversion guide's rows
and of the layers' references.

Each network is built with random weights (its normalisations' scales U(0.5, 1.5), shifts
N(0, 0.3)), converted by `keras_dvi.convert`, given posterior variances `scale / fan_in` (biases
a tenth of that) at `scale` 0.03 (the default) and 0.3, and its logits' moments compared with
2,000 draws of the weights through `keras_dvi.predict_samples` on 4 random inputs
(`benchmarks.experiments.converted_against_monte_carlo.agreement`: the logits' variance over
Monte Carlo's, and the means' error in Monte Carlo standard deviations). The tests
(`tests/test_volumes.py`, `tests/test_group_normalization.py`,
`tests/test_layer_normalization.py`) assert one initialisation each within bands that cover
these.

    python -m benchmarks.experiments.new_layers_against_monte_carlo --seeds 1 2 3 4 5
"""

import argparse

import keras
import numpy as np

import keras_dvi as kd
from benchmarks.experiments.converted_against_monte_carlo import agreement


def volume_cnn(pooling="average"):
    """A small 3D CNN of keras-dvi layers: convolutions, a max pooling with the ReLU on the max,
    an average (or max) pooling, a global pooling (max: with the ReLU on it), a dense head of
    three classes."""
    last = kd.AveragePooling3DDVI(2) if pooling == "average" else kd.MaxPooling3DDVI(2)
    return keras.Sequential([
        keras.Input((10, 10, 10, 2)),
        kd.Conv3DDVI(4, 3),
        kd.MaxPooling3DDVI(2, activation="relu"),
        kd.Conv3DDVI(6, 3, padding="same", activation=None if pooling == "max" else "relu"),
        last,
        kd.GlobalAveragePooling3DDVI() if pooling == "average" else kd.GlobalMaxPooling3DDVI(activation="relu"),
        kd.DenseDVI(3),
    ])


def _randomise_normalisations(plain, seed=0):
    rng = np.random.default_rng(seed)
    for layer in plain.layers:
        if isinstance(layer, (keras.layers.GroupNormalization, keras.layers.LayerNormalization,
                              keras.layers.RMSNormalization)):
            weights = layer.get_weights()
            layer.set_weights([rng.uniform(0.5, 1.5, weights[0].shape)]
                              + [rng.normal(0, 0.3, w.shape) for w in weights[1:]])
    plain.compile("adam", "sparse_categorical_crossentropy")
    return plain


def group_normalised_cnn():
    """Convolutions with group normalisation (4 groups, then instance normalisation) and the
    activations after them, a global average, a dense layer with its 16 units in 2 groups, a
    softmax head."""
    layers = keras.layers
    inputs = keras.Input((12, 12, 3))
    h = layers.Activation("silu")(layers.GroupNormalization(4)(layers.Conv2D(16, 3, padding="same")(inputs)))
    h = layers.Conv2D(16, 3, strides=2, padding="same")(h)
    h = layers.ReLU()(layers.GroupNormalization(-1, epsilon=1e-5)(h))
    h = layers.GroupNormalization(2)(layers.Dense(16)(layers.GlobalAveragePooling2D()(h)))
    return _randomise_normalisations(keras.Model(inputs, layers.Dense(3, activation="softmax")(h)))


def normalised_sequence_net(norm="rms"):
    """A 1D network on sequences: a convolution, RMS (or layer) normalisation of its channels and
    a SiLU, a convolution, a global average, a dense layer normalised the same way, a softmax
    head."""
    layers = keras.layers
    make = layers.RMSNormalization if norm == "rms" else layers.LayerNormalization
    inputs = keras.Input((12, 4))
    h = layers.Activation("silu")(make()(layers.Conv1D(16, 3, padding="same")(inputs)))
    h = make()(layers.Dense(16)(layers.GlobalAveragePooling1D()(layers.Conv1D(16, 3)(h))))
    return _randomise_normalisations(keras.Model(inputs, layers.Dense(3, activation="softmax")(h)))


NETWORKS = {
    "3D CNN, average pooling": (lambda: volume_cnn("average"), True),
    "3D CNN, max pooling": (lambda: volume_cnn("max"), True),
    "group-normalised CNN": (group_normalised_cnn, False),
    "RMS-normalised 1D net": (lambda: normalised_sequence_net("rms"), False),
    "layer-normalised 1D net": (lambda: normalised_sequence_net("layer"), False),
}


def set_variances(model, scale):
    """Posterior variances `scale / fan_in` for every kernel (biases a tenth of that)."""
    for layer in model.layers:
        if isinstance(layer, kd.layers.BayesianLayer):
            kernel, bias = layer.kernel_mean, layer.bias_mean
            fan_in = int(np.prod(kernel.shape[:-1]))
            layer.set_posterior(keras.ops.convert_to_numpy(kernel), np.full(kernel.shape, scale / fan_in, "float32"),
                                None if bias is None else keras.ops.convert_to_numpy(bias),
                                None if bias is None else np.full(bias.shape, 0.1 * scale / fan_in, "float32"))


def measure(network, seed, scale, draws=2000):
    """`(logit ratio, logit error)` per unit of one network, seed and variance scale."""
    build, bayesian = NETWORKS[network]
    keras.utils.set_random_seed(seed)
    model = build() if bayesian else kd.convert(build())
    set_variances(model, scale)
    x = np.random.default_rng(0).uniform(size=(4,) + tuple(model.inputs[0].shape[1:])).astype("float32")
    mean, variance = (keras.ops.convert_to_numpy(t) for t in kd.unpack(model(x), covariance="diagonal"))
    return agreement(mean, variance, kd.predict_samples(model, x, draws, seed=seed))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--networks", nargs="+", choices=sorted(NETWORKS), default=list(NETWORKS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3, 4, 5])
    parser.add_argument("--draws", type=int, default=2000)
    args = parser.parse_args(argv)
    print(f"backend {keras.backend.backend()}")
    print("| network | variance scale | logits' variance / Monte Carlo: min-max over the seeds, medians | "
          "logits' means, max error (sd) |")
    print("|---|---|---|---|")
    for network in args.networks:
        for scale in (0.03, 0.3):
            results = [measure(network, seed, scale, args.draws) for seed in args.seeds]
            ratios = np.concatenate([r for r, _ in results])
            medians = [np.median(r) for r, _ in results]
            print(f"| {network} | {scale} | {ratios.min():.2f}-{ratios.max():.2f}, medians "
                  f"{min(medians):.2f}-{max(medians):.2f} | {max(e.max() for _, e in results):.2f} |", flush=True)


if __name__ == "__main__":
    main()
