"""Model-level helpers shared by the callbacks, the global-inducing helpers and the checks:
walking a model's layers with public Keras API only."""


def layers_of(model):
    """Every layer inside `model`, depth first in the order Keras lists them (`model.layers`,
    recursively into nested models); `model` itself is not included."""
    found, seen = [], set()

    def visit(layer):
        for child in getattr(layer, "layers", None) or []:
            if id(child) not in seen:
                seen.add(id(child))
                found.append(child)
                visit(child)

    visit(model)
    return found


def sampling_layer(model):
    """The layer that sets the sample axis of a sampled model (the first with a `num_samples`
    setting and a seed generator: `GlobalInducingDense`, `DenseMCVI`, `Conv1DMCVI`,
    `Conv2DMCVI`), whose outputs are weight samples `(batch, samples, ...)`, or `None` for a
    moment-propagating model."""
    for layer in layers_of(model):
        if hasattr(layer, "num_samples") and hasattr(layer, "seed_generator"):
            return layer
    return None
