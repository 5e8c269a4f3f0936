"""The sampling scope: how a keras-dvi layer knows to run with weights drawn from its posterior
instead of propagating moments.

`keras_dvi.predictive.weight_samples` (public as `keras_dvi.predict_samples` for moment
networks), the Monte Carlo oracle the moments are tested against, opens a `sampling_scope`
over a model; while it is open every keras-dvi layer of the model runs ordinary forward passes
with sampled weights (a sample axis in front of the batch axis). Monte Carlo layers
(`DenseMCVI`, ...) sample under a `SamplingContext` of their own.
"""

from keras_dvi import network


class SamplingContext:
    """What layers need to sample: the number of weight draws and a seed generator."""

    def __init__(self, num_samples, seed_generator):
        self.num_samples = int(num_samples)
        self.seed_generator = seed_generator


#: The attribute of a keras-dvi layer that holds the `SamplingContext` of the `weight_samples`
#: call running it (`None`, or absent, during ordinary moment propagation).
CONTEXT = "sampling_context"


class sampling_scope:  # noqa: N801 - a context manager, named as Keras' scopes are
    """Within `with sampling_scope(model, context):` every layer of `model` (nested models
    included, and `model` itself if it is a layer) samples under `context` instead of
    propagating moments: an explicit scope held by the layers while it is open, so no module
    holds state and no layer looks up who called it.

    Args:
        model: a keras-dvi layer or a `keras.Model`.
        context: the `SamplingContext`.
    """

    def __init__(self, model, context):
        self.layers = [model, *network.layers_of(model)]
        self.context = context

    def __enter__(self):
        for layer in self.layers:
            setattr(layer, CONTEXT, self.context)
        return self.context

    def __exit__(self, *exc_info):
        for layer in self.layers:
            setattr(layer, CONTEXT, None)
        return False


def current_context(layer):
    """The `SamplingContext` of the `weight_samples` call running `layer`, or `None` during
    ordinary moment propagation (`sampling_scope`)."""
    return getattr(layer, CONTEXT, None)
