"""`KerasDVILayer`: the base of every keras-dvi layer, which guards the model boundary.

keras-dvi layers pass each other packed moments `(batch, 2 or K + 1, K)` (feature maps:
`(batch, 3, *spatial, channels)`) or weight samples `(batch, samples, K)`: tensors that only
keras-dvi layers and keras-dvi losses can read. A plain Keras layer placed between them or
after the last one (`Dropout`, `BatchNormalization`, `Dense`, `Activation`, ...) would treat
the mean and (co)variance rows as numbers and silently break the model.

When a functional or `Sequential` model is built, Keras asks each layer for its output's
spec; a keras-dvi layer then stamps its symbolic output with itself
(`keras_dvi.packing.producer_of` reads the stamp; no private Keras attribute is read), and warns
when a packed symbolic input (`KerasDVILayer.takes_packed`) reaches it that no keras-dvi layer
produced (a subclassed or nested model's own plumbing): a warning, because the output of a
nested keras-dvi model (a `Model` used as a layer), which Keras rebuilds without the stamp,
looks the same. When a model is called outside a symbolic build, the network's first
keras-dvi layer runs the checks of `keras_dvi.validation` that read the stamps
(`check_running_models`: plain layers reading packed moments, Keras' own losses and metrics on
keras-dvi outputs), before Keras wraps the call of the layer, so the message leads.
"""


import warnings

import keras

from keras_dvi import objective, validation
from keras_dvi.packing import PRODUCER, inducing_rows_of, producer_of
from keras_dvi.layers.kl_term import elect_one_tracker, reads_data_changed

class KerasDVILayer(keras.layers.Layer):
    """A Keras layer that reads and writes keras-dvi tensors (see the module docstring).

    `outputs_moments`: whether its outputs are packed moments (`False` for layers whose outputs
    are weight samples, on which plain layers may act per sample). `kl_term`: the layer's
    `keras_dvi.layers.kl_term.KLTerm` if it has weights under a prior (set by the layer), else
    `None`; the first keras-dvi layer of a network lists the network's `ELBOTracker` in its
    `metrics`."""

    outputs_moments = True
    kl_term = None

    @property
    def elbo_tracker(self):
        """The network's `ELBOTracker` if this is its first keras-dvi layer, else `None`."""
        return None if self.kl_term is None else self.kl_term.tracker

    @property
    def metrics(self):
        tracker = self.elbo_tracker
        return super().metrics + ([tracker] if tracker is not None else [])

    @property
    def moment_dtype(self):
        """The dtype of the moment computations: the compute dtype, but float32 under a mixed
        precision policy (`mixed_float16`, `mixed_bfloat16`): erfc, arcsin and exp of
        standardised quantities, and the global inducing layers' Cholesky factorisations,
        need float32 range and precision (a convolution layer's convolutions may run in its
        `half_dtype`)."""
        dtype = keras.backend.standardize_dtype(self.compute_dtype)
        return "float32" if dtype in ("float16", "bfloat16") else dtype

    def _reads_data(self, input_shape):
        """Whether inputs of `input_shape` are data (this is then the network's first keras-dvi
        layer), or `None` if the layer cannot tell."""
        return None

    def takes_packed(self, shape):
        """Whether an input of `shape` is a keras-dvi tensor (packed moments or weight samples)
        rather than data: 3-D for the dense layers; conv and pooling layers say for their
        feature maps; `False` for layers whose inputs are weight samples (`DenseMCVI`,
        `Conv*MCVI`: samples are ordinary numbers, and plain layers may act on them per
        sample, e.g. `keras.layers.TimeDistributed(keras.layers.MaxPooling2D())`)."""
        return len(shape) == 3

    def packed_inputs(self, tensors):
        """Which of the symbolic input `tensors` are keras-dvi tensors: all of them if each
        `takes_packed` (not a `(mean, covariance)` pair), else none."""
        return list(tensors) if tensors and all(self.takes_packed(t.shape) for t in tensors) else []

    def __call__(self, *args, **kwargs):
        inputs = args[0] if args else kwargs.get("inputs")
        if not any(keras.utils.is_keras_tensor(t) for t in keras.tree.flatten(inputs)):  # not a symbolic build
            if self.kl_term is not None and self.kl_term.unplaced:  # built on its own, first called here
                reads_data_changed(self, inputs)
            if not getattr(self, "_in_symbolic_graph", False):  # (its stamps are checked at build)
                objective.check_inputs(self, inputs)
            if getattr(self, "elbo_tracker", None) is not None or not self.built:  # the network's first layer
                validation.check_running_models(self)  # (here, not in `call`: Keras would name this layer's call)
        outputs = super().__call__(*args, **kwargs)
        objective.record_outputs(outputs)
        return outputs

    def compute_output_spec(self, *args, **kwargs):
        inputs = args[0] if args else kwargs.get("inputs")
        reads_data_changed(self, inputs)
        self._in_symbolic_graph = True
        tensors = [t for t in keras.tree.flatten(inputs) if keras.utils.is_keras_tensor(t)]
        self.inducing_rows = max([inducing_rows_of(t) for t in tensors] + [0])
        unstamped = [t for t in self.packed_inputs(tensors) if producer_of(t) is None]
        if unstamped:
            inputs = unstamped[0]
            warnings.warn(
                f"Layer {type(self).__name__} {self.name!r} receives a {len(inputs.shape)}-D input of shape "
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
        if len(tensors) > 1:  # branches meet: one tracker for the network
            elect_one_tracker(tensors)
        return outputs
