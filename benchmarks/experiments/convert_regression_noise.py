"""How fast the noise variance of a converted regression is learned: `convert` appends
`HomoscedasticNoise` to a model compiled with the mean squared error; its log-variance starts at
0 (variance 1, whatever the targets' scale). With Adam at 1e-3 it moves about 1e-3 a step, so a
noise variance of 0.01 (log -4.6) takes thousands of steps; the Appendix H scaling
(`log_variance_scale=10`, as the UCI benchmarks use) moves it ten times faster.

Synthetic data (`y = c (tanh(x_1) + sd e)`, 512 training and 512 test rows), a plain
`Dense(32, relu)`-`Dense(1)` trained with the mean squared error (Adam 1e-2, 60 epochs),
converted and fine-tuned for 20 epochs (Adam 1e-3, batch 32); test log-likelihood and the
learned noise variance, means over seeds.

    python -m benchmarks.experiments.convert_regression_noise
"""

import warnings

import numpy as np
from scipy import stats

import keras

import keras_dvi as kd


def run(noise_sd, target_scale, log_variance_scale, seed):
    rng = np.random.default_rng(seed)

    def data():
        x = rng.normal(size=(512, 3)).astype("float32")
        return x, (target_scale * (np.tanh(x[:, :1]) + noise_sd * rng.normal(size=(512, 1)))).astype("float32")

    (x, y), (x_test, y_test) = data(), data()
    keras.utils.set_random_seed(seed)
    plain = keras.Sequential([keras.Input((3,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(1)])
    plain.compile(keras.optimizers.Adam(1e-2), "mse")
    plain.fit(x, y, epochs=60, verbose=0)
    converted = kd.convert(plain, regularizer=kd.EmpiricalBayesRegularizer(len(x)))
    model = keras.Sequential([keras.Input((3,)), *converted.layers[:-1],
                              kd.HomoscedasticNoise(log_variance_scale=log_variance_scale)])
    model.compile(keras.optimizers.Adam(1e-3), kd.HeteroscedasticELL())
    model.fit(x, y, epochs=20, batch_size=32, verbose=0)
    out = kd.predict(model, x_test)
    return (float(np.mean(stats.norm.logpdf(y_test[:, 0], out["mean"][:, 0], out["std"][:, 0]))),
            float(out["aleatoric"].mean()))


def main():
    warnings.simplefilter("ignore")
    print("| noise sd | log_variance_scale | test log-likelihood | learned noise variance (true) |")
    print("|---|---|---|---|")
    for noise_sd, target_scale in ((0.1, 1.0), (0.3, 1.0), (0.1, 10.0)):
        for scale in (1.0, 10.0):
            results = np.array([run(noise_sd, target_scale, scale, seed) for seed in range(3)])
            sd = noise_sd * target_scale
            print(f"| {sd:.1f} | {scale:g} | {results[:, 0].mean():.3f} ± {results[:, 0].std() / np.sqrt(3):.3f} | "
                  f"{results[:, 1].mean():.4f} ({sd ** 2:.4f}) |", flush=True)


if __name__ == "__main__":
    main()
