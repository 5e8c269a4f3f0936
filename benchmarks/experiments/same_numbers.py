"""Fingerprints of training and prediction, to show that a refactoring changes no number.

    python -m benchmarks.experiments.same_numbers OUT.npz              # run in each tree
    python -m benchmarks.experiments.same_numbers --compare A.npz B.npz

For fixed seeds, trains small networks of every model kind (Sequential, functional,
subclassed, a custom `train_step`) and every layer family (dense DVI regression with the
empirical Bayes prior and the `"auto"` warm-up, a Bayesian CNN classifier, the Monte Carlo
layers, a global inducing network) with `fit`, and stores the `History` (`loss`, `nll`, `kl`),
the predictions and `predict_samples`. `--compare` prints the largest relative difference of
each entry between two runs, as a fraction of the entry's largest value (run both on the same
backend: `KERAS_BACKEND`); float32 round-off is about 1e-7.
"""

import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_dvi as kd  # noqa: E402


def _regression(kind):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(96, 3)).astype("float32")
    y = (np.sin(x[:, :1]) + 0.1 * rng.normal(size=(96, 1))).astype("float32")
    prior = kd.EmpiricalBayesRegularizer(num_train=len(x))
    layers = [kd.DenseDiagDVI(16, activation="relu", regularizer=prior),
              kd.DenseDVI(16, activation="relu", regularizer=prior), kd.DenseDVI(2, regularizer=prior)]
    if kind == "sequential":
        model = keras.Sequential([keras.Input((3,)), *layers])
    elif kind == "functional":
        inputs = keras.Input((3,))
        h = inputs
        for layer in layers:
            h = layer(h)
        model = keras.Model(inputs, h)
    else:
        class Subclassed(keras.Model):
            def __init__(self):
                super().__init__()
                self.stack = layers

            def call(self, inputs, training=None):
                h = inputs
                for layer in self.stack:
                    h = layer(h, training=training)
                return h

        class CustomStep(Subclassed):
            def train_step(self, data):  # TensorFlow's own step, written out
                import tensorflow as tf

                x, y = data
                with tf.GradientTape() as tape:
                    y_pred = self(x, training=True)
                    loss = self.compute_loss(x=x, y=y, y_pred=y_pred)
                grads = tape.gradient(loss, self.trainable_variables)
                self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
                for metric in self.metrics:
                    if metric.name == "loss":
                        metric.update_state(loss)
                return self.compute_metrics(x, y, y_pred, sample_weight=None)

        model = CustomStep() if kind == "custom_step" else Subclassed()
    model.compile(keras.optimizers.Adam(1e-2), loss=kd.HeteroscedasticELL())
    return model, x, y


def _cnn():
    rng = np.random.default_rng(1)
    x = rng.uniform(size=(64, 8, 8, 1)).astype("float32")
    y = (x[:, :4].mean((1, 2, 3)) > x[:, 4:].mean((1, 2, 3))).astype("int32")
    prior = kd.EmpiricalBayesRegularizer(num_train=len(x))
    model = keras.Sequential([
        keras.Input((8, 8, 1)),
        kd.Conv2DDVI(4, 3, padding="same", regularizer=prior),
        kd.MaxPooling2DDVI(2, activation="relu"),
        kd.Conv2DDVI(6, 3, padding="same", regularizer=prior),
        kd.AveragePooling2DDVI(2),
        kd.FlattenDVI(),
        kd.DenseDVI(2, regularizer=prior),
    ])
    model.compile(keras.optimizers.Adam(3e-3), loss=kd.SoftmaxDeltaELL())
    return model, x, y


def _mcvi():
    rng = np.random.default_rng(2)
    x = rng.uniform(size=(48, 6, 6, 1)).astype("float32")
    y = x.mean((1, 2)).astype("float32")
    prior = kd.EmpiricalBayesRegularizer(num_train=len(x))
    model = keras.Sequential([
        keras.Input((6, 6, 1)),
        kd.Conv2DMCVI(3, 3, activation="relu", num_samples=4, regularizer=prior, seed=1),
        keras.layers.TimeDistributed(keras.layers.Flatten()),
        kd.DenseMCVI(8, activation="relu", regularizer=prior, seed=2),
        kd.DenseMCVI(2, regularizer=prior, seed=3),
    ])
    model.compile(keras.optimizers.Adam(1e-2), loss=kd.SampledHeteroscedasticELL())
    return model, x, y


def _global_inducing():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(40, 2)).astype("float32")
    y = np.cos(x[:, :1]).astype("float32")
    model = keras.Sequential([
        keras.Input((2,)),
        kd.GlobalInducingDense(8, activation="relu", num_inducing=6, regularizer=kd.NealPrior(len(x)), seed=4),
        kd.GlobalInducingDense(1, output_layer=True, seed=5),
        kd.SampledHomoscedasticNoise(),
    ])
    model.compile(keras.optimizers.Adam(1e-2), loss=kd.SampledHeteroscedasticELL())
    return model, x, y


def fingerprints():
    found = {}
    kinds = ["sequential", "functional", "subclassed"]
    if keras.backend.backend() == "tensorflow":
        kinds.append("custom_step")
    cases = [(f"regression_{kind}", lambda kind=kind: _regression(kind)) for kind in kinds]
    cases += [("cnn", _cnn), ("mcvi", _mcvi), ("global_inducing", _global_inducing)]
    for name, build in cases:
        keras.utils.set_random_seed(0)
        model, x, y = build()
        history = model.fit(x, y, batch_size=16, epochs=3, verbose=0, shuffle=False).history
        for key in ("loss", "nll", "kl"):
            if key in history:
                found[f"{name}/{key}"] = np.asarray(history[key])
        if name in ("mcvi", "global_inducing"):
            kd.set_sampling_seed(model, 0)
        found[f"{name}/predict"] = np.asarray(model.predict(x, verbose=0))
        if name.startswith("regression") or name == "cnn":
            found[f"{name}/samples"] = kd.predict_samples(model, x[:8], 16, seed=0)
        print(name, {key: float(np.asarray(v).ravel()[-1]) for key, v in history.items()}, flush=True)
    return found


def compare(first, second):
    a, b = np.load(first), np.load(second)
    worst = 0.0
    for key in sorted(set(a) | set(b)):
        if key not in a or key not in b:
            print(f"{key}: only in {'first' if key in a else 'second'}")
            worst = np.inf
            continue
        x, y = a[key], b[key]
        scale = max(float(np.max(np.abs(x))), 1e-12)
        diff = float(np.max(np.abs(x - y))) / scale if x.shape == y.shape else np.inf
        worst = max(worst, diff)
        print(f"{key:40s} largest difference / largest value {diff:.2e}")
    print(f"largest over all entries: {worst:.2e}")
    return worst


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", nargs="?", help="npz file to write")
    parser.add_argument("--compare", nargs=2, metavar=("A", "B"))
    args = parser.parse_args(argv)
    if args.compare:
        sys.exit(0 if compare(*args.compare) < 1e-4 else 1)
    np.savez(args.out, **fingerprints())


if __name__ == "__main__":
    main()
