"""`initialize_from_data`: the initialisation of networks of `GlobalInducingDense` layers
(Ober & Aitchison 2021, Appendix O): inducing inputs from training inputs, the output layer's
pseudo-outputs from the matching targets."""

import keras
import numpy as np

from keras_dvi import network
from keras_dvi.layers.global_inducing_base import GlobalInducingLayer
from keras_dvi.layers.inducing_inputs import InducingInputs


def global_inducing_layers(model):
    """The global inducing layers (`GlobalInducingDense`, `GlobalInducingConv2D`) of `model`, in call order."""
    return [layer for layer in network.layers_of(model) if isinstance(layer, GlobalInducingLayer)]


def _first_and_output(model):
    """`(owner, output)`: the layer holding the inducing inputs (an `InducingInputs` layer, or
    the first global inducing layer) and the global inducing output layer (or `None`)."""
    layers = global_inducing_layers(model)
    if not layers:
        raise ValueError("Argument `model` has no GlobalInducingDense or GlobalInducingConv2D layer.")
    owners = [layer for layer in network.layers_of(model) if isinstance(layer, InducingInputs)]
    owners += [layer for layer in layers if layer._is_first]
    if not owners or not layers[0].built:
        raise ValueError("Argument `model` must be built (called on data or given an Input).")
    output = [layer for layer in layers if layer.output_layer]
    return owners[0], (output[0] if output else None)


def initialize_from_data(model, x, y=None, seed=None):
    """Sets the inducing inputs (and the output layer's pseudo-outputs) from training data.

    The inducing inputs `U0` (of the first global inducing layer, or of an `InducingInputs`
    layer) become `M` training inputs drawn without replacement (the features at that layer,
    when deterministic layers come before it); with fewer than `M` examples the remaining rows are `N(0, 1)`. The output layer's
    pseudo-outputs `V` become the targets of the same examples (regression; integer labels
    are one-hot encoded), so that with `U0 = X` and `V = Y` the top layer's posterior is
    Bayesian linear regression on the propagated features (paper eq. 8).

    Args:
        model: a built Keras model with `GlobalInducingDense` layers.
        x: training inputs (array).
        y: training targets `(n,)`/`(n, D)`, or integer labels; `None` leaves `V` as is.
        seed: seed of the row choice.
    """
    first, output = _first_and_output(model)
    x = np.asarray(x)
    rng = np.random.default_rng(seed)
    m = first.num_inducing
    take = min(m, len(x))
    rows = rng.choice(len(x), size=take, replace=False)
    features = x[rows]
    if first.input is not model.inputs[0]:
        features = keras.Model(model.inputs, first.input).predict(features, verbose=0)
    shape = tuple(first.inducing_inputs.shape)
    inducing = rng.standard_normal(shape)
    inducing[:take] = np.asarray(features).reshape((take,) + shape[1:])
    first.inducing_inputs.assign(inducing.astype(first.inducing_inputs.dtype))
    if y is None or output is None:
        return
    y = np.asarray(y)[rows]
    units = output.units
    if y.ndim == 1 or (y.ndim == 2 and y.shape[1] == 1 and units > 1):
        if units == 1:
            y = y.reshape(-1, 1)
        else:
            y = np.eye(units)[y.reshape(-1).astype(int)]
    if y.shape[1:] != (units,):
        raise ValueError(
            f"Argument `y` must have shape (n, {units}) (or integer labels) to initialise the "
            f"pseudo-outputs of {output.name!r}; received rows of shape {y.shape[1:]}."
        )
    pseudo = keras.ops.convert_to_numpy(output.pseudo_outputs).copy()
    pseudo[:take] = y
    output.pseudo_outputs.assign(pseudo.astype(output.pseudo_outputs.dtype))
