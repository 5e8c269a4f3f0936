"""keras-dvi: deterministic variational inference layers for Keras 3.

Public API:

* layers `DenseDVI`, `DenseDiagDVI`, `SkipDVI`, `SkipDiagDVI`, `HomoscedasticNoise`, and the
  Monte Carlo baseline `DenseMCVI`;
* global inducing points: `GlobalInducingDense`, `SampledHomoscedasticNoise`, the losses
  `SampledGaussianELL` / `SampledSoftmaxELL`, the priors `NealPrior` / `StandardPrior`,
  `initialize_from_data(model, x, y)`, `predict_samples(model, x, num_samples)` and
  `set_sampling_seed(model, seed)`;
* losses `HeteroscedasticELL`, `SoftmaxDeltaELL`; priors `EmpiricalBayesRegularizer`,
  `GaussianPriorRegularizer` (each with `num_train`, `kl_weight` and `kl_warmup_steps`); the
  deprecated `KLWarmup` callback;
* `predict(model, x)`: predictions as NumPy arrays (mean, std, epistemic and aleatoric parts,
  intervals; or class probabilities and entropy);
* `TargetScaling`: a regression head in the targets' own units;
* `unpack(outputs)` -> `(mean, covariance or variance)` for any keras-dvi output;
* `sample_outputs(model, x, num_samples, seed)`: the Monte Carlo reference;
* modules `moments` (closed-form moment maths), `predictive` (predictive distributions and
  metrics), `metrics` (Keras metrics for `compile`), `datasets` (bundled data).
"""

__version__ = "0.1.0.dev0"

from keras_dvi import datasets, inducing, metrics, moments, predictive, priors
from keras_dvi.callbacks import KLWarmup
from keras_dvi.global_inducing import initialize_from_data, predict_samples, set_sampling_seed
from keras_dvi.layers import (
    DenseDiagDVI,
    DenseDVI,
    DenseMCVI,
    GlobalInducingDense,
    HomoscedasticNoise,
    SampledHomoscedasticNoise,
    SkipDiagDVI,
    SkipDVI,
    TargetScaling,
)
from keras_dvi.losses import HeteroscedasticELL, SampledGaussianELL, SampledSoftmaxELL, SoftmaxDeltaELL
from keras_dvi.packing import unpack
from keras_dvi.prediction import predict
from keras_dvi.priors import EmpiricalBayesRegularizer, GaussianPriorRegularizer, NealPrior, StandardPrior
from keras_dvi.sampling import sample_outputs

__all__ = [
    "DenseDVI",
    "DenseDiagDVI",
    "DenseMCVI",
    "SkipDVI",
    "SkipDiagDVI",
    "HomoscedasticNoise",
    "TargetScaling",
    "GlobalInducingDense",
    "SampledHomoscedasticNoise",
    "SampledGaussianELL",
    "SampledSoftmaxELL",
    "NealPrior",
    "StandardPrior",
    "initialize_from_data",
    "predict_samples",
    "set_sampling_seed",
    "HeteroscedasticELL",
    "SoftmaxDeltaELL",
    "EmpiricalBayesRegularizer",
    "GaussianPriorRegularizer",
    "KLWarmup",
    "unpack",
    "predict",
    "sample_outputs",
    "datasets",
    "metrics",
    "moments",
    "inducing",
    "predictive",
    "priors",
    "__version__",
]
