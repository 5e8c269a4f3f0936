"""Which TAGI step each keras-dvi layer is: `step_of(layer)` gives the linear map with its
adjoints (`keras_dvi.maths.tagi`: `DenseStep`, `ConvStep`, `AveragePoolStep`,
`GlobalAveragePoolStep`, `FlattenStep`) through which `keras_dvi.maths.tagi.forward` and
`update` pass a layer's moments and deltas.
"""

from keras_dvi.layers.conv_dvi import ConvDVI
from keras_dvi.layers.dense_diag_dvi import DenseDiagDVI
from keras_dvi.layers.flatten_dvi import FlattenDVI
from keras_dvi.layers.pooling_dvi import AveragePoolingDVI, GlobalAveragePoolingDVI
from keras_dvi.maths.tagi import (
    AveragePoolStep,
    ConvStep,
    DenseStep,
    FlattenStep,
    GlobalAveragePoolStep,
)

#: The layers TAGI updates, and the weightless maps it passes its deltas through.
WEIGHT_LAYERS = (DenseDiagDVI, ConvDVI)
MAP_LAYERS = (AveragePoolingDVI, GlobalAveragePoolingDVI, FlattenDVI)


def step_of(layer):
    """The step of a keras-dvi layer of a TAGI network (`TAGIModel` checks the layers first)."""
    if isinstance(layer, DenseDiagDVI):
        return DenseStep(layer.activation)
    if isinstance(layer, ConvDVI) and layer.depthwise:
        raise ValueError(f"TAGI has no step for the depthwise convolution {layer.name!r}.")
    if isinstance(layer, ConvDVI):
        return ConvStep(layer.activation, layer.kernel_size, layer.padding)
    if isinstance(layer, AveragePoolingDVI):
        return AveragePoolStep(layer.pool_size)
    if isinstance(layer, GlobalAveragePoolingDVI):
        return GlobalAveragePoolStep()
    if isinstance(layer, FlattenDVI):
        return FlattenStep()
    raise ValueError(f"TAGI has no step for layer {layer.name!r} ({type(layer).__name__}).")
