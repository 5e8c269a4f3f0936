"""keras-dvi: deterministic variational inference layers for Keras 3.

Public API:

* layers `DenseDVI`, `DenseDiagDVI`, `SkipDVI`, `SkipDiagDVI`, `HomoscedasticNoise`;
* losses `HeteroscedasticELL`, `SoftmaxDeltaELL`; priors `EmpiricalBayesRegularizer`,
  `GaussianPriorRegularizer`; the `KLWarmup` callback;
* `unpack(outputs)` -> `(mean, covariance or variance)` for any keras-dvi output;
* `sample_outputs(model, x, num_samples, seed)`: the Monte Carlo reference;
* modules `moments` (closed-form moment maths), `predictive` (predictive distributions and
  metrics), `metrics` (Keras metrics for `compile`), `datasets` (bundled data).
"""

__version__ = "0.1.0.dev0"

from keras_dvi import datasets, metrics, moments, predictive, priors
from keras_dvi.callbacks import KLWarmup
from keras_dvi.layers import DenseDiagDVI, DenseDVI, HomoscedasticNoise, SkipDiagDVI, SkipDVI
from keras_dvi.losses import HeteroscedasticELL, SoftmaxDeltaELL
from keras_dvi.packing import unpack
from keras_dvi.priors import EmpiricalBayesRegularizer, GaussianPriorRegularizer
from keras_dvi.sampling import sample_outputs

__all__ = [
    "DenseDVI",
    "DenseDiagDVI",
    "SkipDVI",
    "SkipDiagDVI",
    "HomoscedasticNoise",
    "HeteroscedasticELL",
    "SoftmaxDeltaELL",
    "EmpiricalBayesRegularizer",
    "GaussianPriorRegularizer",
    "KLWarmup",
    "unpack",
    "sample_outputs",
    "datasets",
    "metrics",
    "moments",
    "predictive",
    "priors",
    "__version__",
]
