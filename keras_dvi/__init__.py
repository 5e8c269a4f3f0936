"""keras-dvi: Bayesian neural network layers for Keras 3 that train like ordinary ones.

Deterministic variational inference (Wu et al., ICLR 2019) propagates the mean and covariance
of every activation in closed form; global inducing points (Ober & Aitchison, ICML 2021) give
posteriors correlated across layers; TAGI (Goulet et al., JMLR 2021) trains the same Gaussian
networks without gradients. The public API, by topic:

* dense layers: `DenseDVI`, `DenseDiagDVI`, `SkipDVI`, `SkipDiagDVI`; regression heads
  `HomoscedasticNoise`, `TargetScaling`;
* convolutional layers (and the 3D ones, `Conv3DDVI`, ..., `UpSampling3DDVI`): `Conv1DDVI`,
  `Conv2DDVI`, `Conv1DTransposeDVI`, `Conv2DTransposeDVI`,
  `DepthwiseConv2DDVI`, `MaxPooling1DDVI`, `MaxPooling2DDVI`,
  `AveragePooling1DDVI`, `AveragePooling2DDVI`, `GlobalAveragePooling1DDVI`,
  `GlobalAveragePooling2DDVI`, `GlobalMaxPooling1DDVI`, `GlobalMaxPooling2DDVI`, `FlattenDVI`, `AddDVI`, `ActivationDVI`, `MultiplyDVI`, `ConcatenateDVI`,
  `BatchNormalizationDVI`, `LayerNormalizationDVI`, `RMSNormalizationDVI`, `GroupNormalizationDVI`, `ZeroPadding1DDVI`, `ZeroPadding2DDVI`, `Cropping1DDVI`,
  `Cropping2DDVI`, `UpSampling1DDVI`, `UpSampling2DDVI`;
* attention (Transformers): `MultiHeadAttentionDVI`; a Vision Transformer's tokens:
  `ReshapeDVI`, `ClassTokenDVI`, `PositionEmbeddingDVI`, `SelectTokenDVI`;
* the objective: losses `HeteroscedasticELL`, `SoftmaxDeltaELL`; priors
  `EmpiricalBayesRegularizer`, `GaussianPriorRegularizer`,
  `ScalePriorRegularizer` (by default `kl_weight="auto"`: the ELBO for regression, the rule
  `min(1, N / P)` for a classifier);
  `objective.describe(model)` (what `fit` minimises); the callback wrapper `AfterKLWarmup`;
  module `metrics` (Keras metrics for `compile`);
* predictions: `predict(model, x)` (NumPy summaries), `predict_samples(model, x, num_samples)`,
  `unpack(outputs)`; module `predictive` (predictive distributions and scores);
* Monte Carlo layers: `DenseMCVI`, `Conv1DMCVI`, `Conv2DMCVI`, `GlobalInducingDense`,
  `GlobalInducingConv2D`, `InducingInputs` and `GlobalInducingDenseDVI` (factorised-to-global
  networks),
  `SampledHomoscedasticNoise`, losses `SampledHeteroscedasticELL`, `SampledSoftmaxELL`, priors
  `NealPrior`, `StandardPrior`, `ScalePrior`, `SpatialIWPrior`, `initialize_from_data`, `set_sampling_seed`;
* training without gradients: `TAGIModel` (module `tagi`);
* `convert(model)`: the keras-dvi counterpart of a plain Keras model, its weights as posterior
  means;
* the maths, package `maths`: modules `moments` (dense layers), `conv_moments` (feature maps),
  `attention` (multi-head attention), `inducing` (global inducing posteriors), `tagi` (also `keras_dvi.moments`, ... and
  `keras_dvi.tagi.maths`); `datasets` (the bundled toy data set, the UCI reader `load_uci`).
"""

__version__ = "0.1.0"

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
    "DepthwiseConv2DDVI": "keras_dvi.layers",
    "Conv1DMCVI": "keras_dvi.layers",
    "Conv2DMCVI": "keras_dvi.layers",
    "MaxPooling1DDVI": "keras_dvi.layers",
    "MaxPooling2DDVI": "keras_dvi.layers",
    "AveragePooling1DDVI": "keras_dvi.layers",
    "AveragePooling2DDVI": "keras_dvi.layers",
    "GlobalAveragePooling1DDVI": "keras_dvi.layers",
    "GlobalAveragePooling2DDVI": "keras_dvi.layers",
    "GlobalMaxPooling1DDVI": "keras_dvi.layers",
    "GlobalMaxPooling2DDVI": "keras_dvi.layers",
    "FlattenDVI": "keras_dvi.layers",
    "AddDVI": "keras_dvi.layers",
    "ActivationDVI": "keras_dvi.layers",
    "MultiplyDVI": "keras_dvi.layers",
    "ConcatenateDVI": "keras_dvi.layers",
    "BatchNormalizationDVI": "keras_dvi.layers",
    "LayerNormalizationDVI": "keras_dvi.layers",
    "MultiHeadAttentionDVI": "keras_dvi.layers",
    "ReshapeDVI": "keras_dvi.layers",
    "PositionEmbeddingDVI": "keras_dvi.layers",
    "ClassTokenDVI": "keras_dvi.layers",
    "SelectTokenDVI": "keras_dvi.layers",
    "ZeroPadding1DDVI": "keras_dvi.layers",
    "ZeroPadding2DDVI": "keras_dvi.layers",
    "Cropping1DDVI": "keras_dvi.layers",
    "Cropping2DDVI": "keras_dvi.layers",
    "Conv1DTransposeDVI": "keras_dvi.layers",
    "Conv2DTransposeDVI": "keras_dvi.layers",
    "UpSampling1DDVI": "keras_dvi.layers",
    "UpSampling2DDVI": "keras_dvi.layers",
    "GroupNormalizationDVI": "keras_dvi.layers",
    "RMSNormalizationDVI": "keras_dvi.layers",
    "Conv3DDVI": "keras_dvi.layers",
    "Conv3DTransposeDVI": "keras_dvi.layers",
    "MaxPooling3DDVI": "keras_dvi.layers",
    "AveragePooling3DDVI": "keras_dvi.layers",
    "GlobalAveragePooling3DDVI": "keras_dvi.layers",
    "GlobalMaxPooling3DDVI": "keras_dvi.layers",
    "ZeroPadding3DDVI": "keras_dvi.layers",
    "Cropping3DDVI": "keras_dvi.layers",
    "UpSampling3DDVI": "keras_dvi.layers",
    "GlobalInducingDense": "keras_dvi.layers",
    "GlobalInducingConv2D": "keras_dvi.layers",
    "InducingInputs": "keras_dvi.layers",
    "GlobalInducingDenseDVI": "keras_dvi.layers",
    "SampledHomoscedasticNoise": "keras_dvi.layers",
    "SampledHeteroscedasticELL": "keras_dvi.losses",
    "SampledSoftmaxELL": "keras_dvi.losses",
    "NealPrior": "keras_dvi.priors",
    "StandardPrior": "keras_dvi.priors",
    "ScalePrior": "keras_dvi.priors",
    "SpatialIWPrior": "keras_dvi.priors",
    "initialize_from_data": "keras_dvi.global_inducing",
    "predict_samples": "keras_dvi.predictive",
    "set_sampling_seed": "keras_dvi.predictive",
    "HeteroscedasticELL": "keras_dvi.losses",
    "SoftmaxDeltaELL": "keras_dvi.losses",
    "EmpiricalBayesRegularizer": "keras_dvi.priors",
    "GaussianPriorRegularizer": "keras_dvi.priors",
    "ScalePriorRegularizer": "keras_dvi.priors",
    "AfterKLWarmup": "keras_dvi.callbacks",
    "unpack": "keras_dvi.packing",
    "predict": "keras_dvi.predictive",
    "convert": "keras_dvi.conversion",
    "TAGIModel": "keras_dvi.tagi",
    "datasets": None,
    "metrics": None,
    "maths": None,
    "moments": "keras_dvi.maths",
    "conv_moments": "keras_dvi.maths",
    "attention": "keras_dvi.maths",
    "inducing": "keras_dvi.maths",
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
    # The maths modules' import paths of 0.1.0 (`import keras_dvi.moments`, ...) name the same
    # modules in `keras_dvi.maths`.
    for _name in ("moments", "conv_moments", "inducing"):
        sys.modules.setdefault(f"keras_dvi.{_name}", globals()[_name])
    sys.modules.setdefault("keras_dvi.tagi.maths", globals()["maths"].tagi)
    del _name

__all__ = [*_EXPORTS, "__version__"]
