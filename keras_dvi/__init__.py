"""keras-dvi: deterministic variational inference layers for Keras 3.

Public API:

* layers `DenseDVI`, `DenseDiagDVI`, `SkipDVI`, `SkipDiagDVI` (`keras_dvi.layers`);
* `unpack(outputs)` -> `(mean, covariance or variance)` for any keras-dvi output;
* `sample_outputs(model, x, num_samples, seed)`: the Monte Carlo reference;
* `keras_dvi.moments`: the closed-form moment functions the layers are built from.
"""

__version__ = "0.1.0.dev0"

from keras_dvi.layers import DenseDiagDVI, DenseDVI, SkipDiagDVI, SkipDVI
from keras_dvi.packing import unpack
from keras_dvi.sampling import sample_outputs

__all__ = [
    "DenseDVI",
    "DenseDiagDVI",
    "SkipDVI",
    "SkipDiagDVI",
    "unpack",
    "sample_outputs",
    "__version__",
]
