"""`KerasDVILayer`: the base of every keras-dvi layer, which guards the model boundary.

keras-dvi layers pass each other packed moments `(batch, 2 or K + 1, K)` or weight samples
`(batch, samples, K)`: 3-D tensors that only keras-dvi layers can read. A plain Keras layer
placed between them (`Dropout`, `BatchNormalization`, `Dense`, `Activation`, ...) would treat
the mean and (co)variance rows, or the samples, as numbers and silently break the model.

When a functional or `Sequential` model is built, Keras asks each layer for its output's
spec; a keras-dvi layer then stamps its symbolic output with itself (`producer_of` reads the
stamp; no private Keras attribute is read), and warns, naming the fix, when a 3-D symbolic
input reaches it that no keras-dvi layer produced. Plain layers before the first keras-dvi
layer (whose 2-D output is data) stay welcome. It is a warning, not an error, because one
legitimate case looks the same: the output of a nested keras-dvi model (a `Model` used as a
layer), whose output Keras rebuilds without the stamp. Plain layers that mix rows
(`Dense`, `BatchNormalization`) are also refused at run time, by the negative variances they
produce (`keras_dvi.validation.check_moments`).
"""

import warnings

import keras

#: The attribute of a symbolic tensor naming the keras-dvi layer that produced it.
PRODUCER = "keras_dvi_producer"


def producer_of(tensor):
    """The keras-dvi layer that produced the symbolic tensor `tensor`, or `None`."""
    return getattr(tensor, PRODUCER, None)


class KerasDVILayer(keras.layers.Layer):
    """A Keras layer that reads and writes keras-dvi tensors (see the module docstring)."""

    def compute_output_spec(self, *args, **kwargs):
        inputs = args[0] if args else kwargs.get("inputs")
        if keras.utils.is_keras_tensor(inputs) and len(inputs.shape) == 3 and producer_of(inputs) is None:
            warnings.warn(
                f"Layer {type(self).__name__} {self.name!r} receives a 3-D input of shape "
                f"{tuple(inputs.shape)} that no keras-dvi layer produced. Between keras-dvi "
                "layers the tensors hold packed means and (co)variances (or weight samples), "
                "which plain Keras layers (Dropout, BatchNormalization, Dense, Activation, "
                "Reshape, ...) treat as numbers, silently breaking the model. Remove the plain "
                "layer: keras-dvi layers take each other's outputs directly, apply their own "
                "activation (`activation=`) and model weight noise themselves (no Dropout "
                "needed); plain layers are welcome before the first keras-dvi layer. (If the "
                "input is the output of a nested keras-dvi model, this warning does not apply.)",
                UserWarning,
                stacklevel=2,
            )
        outputs = super().compute_output_spec(*args, **kwargs)
        for output in keras.tree.flatten(outputs):
            setattr(output, PRODUCER, self)
        return outputs
