"""Writes `tests/data/v0.1.0_*`, the files `tests/test_saving.py` loads: small trained models of
each kind saved by the keras-dvi 0.1.0 release (commit fdff30e), with their inputs and outputs.

    git worktree add /tmp/rel010 fdff30e
    PYTHONPATH=/tmp/rel010 python tests/data/write_v0_1_0.py tests/data
"""
import os, sys
import numpy as np
import keras
import keras_dvi as kd

out = sys.argv[1]
keras.utils.set_random_seed(3)
rng = np.random.default_rng(3)
x = rng.normal(size=(16, 3)).astype("float32")
y = (x @ np.array([1.0, -0.5, 0.2], "float32") + 0.1 * rng.normal(size=16)).astype("float32")
labels = rng.integers(0, 3, size=16)
images = rng.uniform(size=(16, 8, 8, 1)).astype("float32")
expected = {"x": x, "y": y, "labels": labels, "images": images}

# Regression: DVI with empirical Bayes, the auto warm-up, a noise head.
reg = keras.Sequential([keras.Input((3,)), kd.DenseDVI(8, "relu", regularizer=kd.EmpiricalBayesRegularizer(16)),
                        kd.DenseDVI(8, "relu", regularizer=kd.EmpiricalBayesRegularizer(16)),
                        kd.DenseDVI(1, regularizer=kd.EmpiricalBayesRegularizer(16)), kd.HomoscedasticNoise()])
reg.compile(keras.optimizers.Adam(1e-2), loss=kd.HeteroscedasticELL())
reg.fit(x, y, epochs=2, batch_size=8, verbose=0)
reg.save(os.path.join(out, "v0.1.0_regression.keras"))
expected["regression"] = reg.predict(x, verbose=0)

# CNN classifier: conv, max pooling with ReLU, flatten, a dense head.
cnn = keras.Sequential([keras.Input((8, 8, 1)), kd.Conv2DDVI(4, 3, regularizer=kd.EmpiricalBayesRegularizer(16)),
                        kd.MaxPooling2DDVI(2, activation="relu"), kd.FlattenDVI(),
                        kd.DenseDVI(3, regularizer=kd.EmpiricalBayesRegularizer(16))])
cnn.compile(keras.optimizers.Adam(1e-2), loss=kd.SoftmaxDeltaELL())
cnn.fit(images, labels, epochs=2, batch_size=8, verbose=0)
cnn.save(os.path.join(out, "v0.1.0_cnn.keras"))
expected["cnn"] = cnn.predict(images, verbose=0)

# Monte Carlo layers.
mcvi = keras.Sequential([keras.Input((3,)), kd.DenseMCVI(8, "relu", regularizer=kd.EmpiricalBayesRegularizer(16)),
                         kd.DenseMCVI(3, regularizer=kd.EmpiricalBayesRegularizer(16))])
mcvi.compile(keras.optimizers.Adam(1e-2), loss=kd.SampledSoftmaxELL())
mcvi.fit(x, labels, epochs=2, batch_size=8, verbose=0)
mcvi.save(os.path.join(out, "v0.1.0_mcvi.keras"))
expected["mcvi_kernel"] = keras.ops.convert_to_numpy(mcvi.layers[0].kernel_mean)

# Global inducing points.
gi = keras.Sequential([keras.Input((3,)), kd.GlobalInducingDense(8, "relu", num_inducing=6, regularizer=kd.NealPrior(16)),
                       kd.GlobalInducingDense(1, output_layer=True, regularizer=kd.NealPrior(16)), kd.SampledHomoscedasticNoise()])
gi.compile(keras.optimizers.Adam(1e-2), loss=kd.SampledHeteroscedasticELL())
kd.initialize_from_data(gi, x, y)
gi.fit(x, y, epochs=2, batch_size=8, verbose=0)
gi.save(os.path.join(out, "v0.1.0_global_inducing.keras"))
kd.set_sampling_seed(gi, 7)
expected["gi_samples"] = kd.predict_samples(gi, x, 4)

# TAGI classifier.
net = keras.Sequential([keras.Input((3,)), kd.DenseDiagDVI(8, "relu"), kd.DenseDiagDVI(kd.tagi.tree(3)[0])])
tagi = kd.TAGIModel(net, classes=3)
tagi.compile()
tagi.fit(x, labels, batch_size=8, epochs=1, verbose=0)
tagi.save(os.path.join(out, "v0.1.0_tagi_classifier.keras"))
expected["tagi_outputs"] = tagi.predict(x, verbose=0)
expected["tagi_probabilities"] = kd.predict(tagi, x)["probabilities"]

np.savez(os.path.join(out, "v0.1.0_expected.npz"), **expected)
print({k: np.shape(v) for k, v in expected.items()})
