"""Training without gradients: tractable approximate Gaussian inference (TAGI; Goulet, Nguyen
and Amiri, JMLR 2021).

* `keras_dvi.TAGIModel` (`keras_dvi.tagi.model`): trains a network of keras-dvi layers with
  TAGI's closed-form updates inside Keras' `fit`.
* `keras_dvi.tagi.maths` (the module `keras_dvi.maths.tagi`): TAGI's equations, pure functions
  of `keras.ops` tensors (forward moments, output deltas, the layer-by-layer update, the
  classification tree) and each layer's linear map with its adjoints (`DenseStep`, `ConvStep`,
  ...).
* `keras_dvi.tagi.steps`: which step each keras-dvi layer is (`step_of`).

The names users need are also here: `tree(classes)` (the classification tree of Appendix C),
`class_probabilities`, `tree_targets`, `MAX_SHRINK`, `FORWARD_METHODS`, `ACTIVATIONS`.
"""

from keras_dvi.maths import tagi as maths
from keras_dvi.maths.tagi import (
    ACTIVATIONS,
    FORWARD_METHODS,
    MAX_SHRINK,
    TREE_ALPHA,
    activation_forward,
    class_probabilities,
    dense_forward,
    forward,
    observation_deltas,
    parameter_update,
    tree,
    tree_targets,
    update,
)
from keras_dvi.tagi.model import TAGIModel

__all__ = ["ACTIVATIONS", "FORWARD_METHODS", "MAX_SHRINK", "TREE_ALPHA", "TAGIModel", "activation_forward",
           "class_probabilities", "dense_forward", "forward", "observation_deltas", "parameter_update", "tree",
           "tree_targets", "update", "maths"]
