"""keras-dvi: deterministic variational inference layers for Keras 3.

Public API:

* layers `DenseDVI`, `DenseDiagDVI`, `SkipDVI`, `SkipDiagDVI`, `HomoscedasticNoise`, and the
  Monte Carlo baseline `DenseMCVI`;
* convolutional layers `Conv1DDVI`, `Conv2DDVI`, `MaxPooling1DDVI`, `MaxPooling2DDVI`,
  `AveragePooling1DDVI`, `AveragePooling2DDVI`, `GlobalAveragePooling1DDVI`,
  `GlobalAveragePooling2DDVI`, `FlattenDVI`, `AddDVI`, and the Monte Carlo baselines
  `Conv1DMCVI`, `Conv2DMCVI`;
* global inducing points: `GlobalInducingDense`, `SampledHomoscedasticNoise`, the losses
  `SampledHeteroscedasticELL` / `SampledSoftmaxELL`, the priors `NealPrior` / `StandardPrior`,
  `initialize_from_data(model, x, y)` and `set_sampling_seed(model, seed)`;
* losses `HeteroscedasticELL`, `SoftmaxDeltaELL`; priors `EmpiricalBayesRegularizer`,
  `GaussianPriorRegularizer` (each with `num_train`, `kl_weight` and `kl_warmup_steps`);
  `AfterKLWarmup(callback)`, which holds a stopping or learning-rate rule back until the KL
  warm-up is over; the deprecated `KLWarmup` callback;
* `predict(model, x)`: predictions as NumPy arrays (mean, std, epistemic and aleatoric parts,
  intervals; or class probabilities and entropy);
* `TAGIModel(network, observation_noise=..., classes=None)`: trains a network of `DenseDiagDVI`
  layers without gradients, by TAGI's closed-form updates (module `tagi`: the maths);
* `TargetScaling`: a regression head in the targets' own units;
* `unpack(outputs)` -> `(mean, covariance or variance)` for any keras-dvi output;
* `predict_samples(model, x, num_samples, seed=None)`: output samples `(batch, samples, units)` of
  any keras-dvi model (for moment networks, the Monte Carlo reference over their weights); the
  deprecated `sample_outputs` returns them sample-first;
* modules `moments` (closed-form moment maths), `conv_moments` (the same for feature maps), `predictive` (predictive distributions and
  metrics), `metrics` (Keras metrics for `compile`), `datasets` (bundled data).
"""

__version__ = "0.1.0.dev0"

import importlib
import sys

#: Where each public name lives (a module itself when the value is None).
_EXPORTS = {
    "DenseDVI": "keras_dvi.layers",
    "DenseDiagDVI": "keras_dvi.layers",
    "DenseMCVI": "keras_dvi.layers",
    "SkipDVI": "keras_dvi.layers",
    "SkipDiagDVI": "keras_dvi.layers",
    "HomoscedasticNoise": "keras_dvi.layers",
    "TargetScaling": "keras_dvi.layers",
    "Conv1DDVI": "keras_dvi.layers",
    "Conv2DDVI": "keras_dvi.layers",
    "Conv1DMCVI": "keras_dvi.layers",
    "Conv2DMCVI": "keras_dvi.layers",
    "MaxPooling1DDVI": "keras_dvi.layers",
    "MaxPooling2DDVI": "keras_dvi.layers",
    "AveragePooling1DDVI": "keras_dvi.layers",
    "AveragePooling2DDVI": "keras_dvi.layers",
    "GlobalAveragePooling1DDVI": "keras_dvi.layers",
    "GlobalAveragePooling2DDVI": "keras_dvi.layers",
    "FlattenDVI": "keras_dvi.layers",
    "AddDVI": "keras_dvi.layers",
    "GlobalInducingDense": "keras_dvi.layers",
    "SampledHomoscedasticNoise": "keras_dvi.layers",
    "SampledHeteroscedasticELL": "keras_dvi.losses",
    "SampledGaussianELL": "keras_dvi.losses",  # deprecated name
    "SampledSoftmaxELL": "keras_dvi.losses",
    "NealPrior": "keras_dvi.priors",
    "StandardPrior": "keras_dvi.priors",
    "initialize_from_data": "keras_dvi.global_inducing",
    "predict_samples": "keras_dvi.global_inducing",
    "set_sampling_seed": "keras_dvi.global_inducing",
    "HeteroscedasticELL": "keras_dvi.losses",
    "SoftmaxDeltaELL": "keras_dvi.losses",
    "EmpiricalBayesRegularizer": "keras_dvi.priors",
    "GaussianPriorRegularizer": "keras_dvi.priors",
    "KLWarmup": "keras_dvi.callbacks",
    "AfterKLWarmup": "keras_dvi.callbacks",
    "unpack": "keras_dvi.packing",
    "predict": "keras_dvi.prediction",
    "TAGIModel": "keras_dvi.tagi_model",
    "sample_outputs": "keras_dvi.sampling",
    "datasets": None,
    "metrics": None,
    "moments": None,
    "conv_moments": None,
    "inducing": None,
    "predictive": None,
    "priors": None,
    "tagi": None,
}


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'keras_dvi' has no attribute {name!r}")
    module = _EXPORTS[name]
    value = importlib.import_module(f"keras_dvi.{name}" if module is None else module)
    if module is not None:
        value = getattr(value, name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))


# `python -m keras_dvi` (the main job) parses its arguments before Keras and TensorFlow are
# imported, so `--help` answers at once; while Python locates that module, `sys.argv[0]` is
# "-m". Every other import loads the whole API now, which also registers the serializable
# classes with Keras (so `keras.saving.load_model` finds them after `import keras_dvi`).
if sys.argv[:1] != ["-m"]:
    for _name in _EXPORTS:
        __getattr__(_name)
    del _name

__all__ = [*_EXPORTS, "__version__"]
