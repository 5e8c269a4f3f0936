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
    """The first layer of `model` whose outputs are weight samples `(batch, samples, ...)`, not
    packed moments (`outputs_moments` false: `DenseMCVI`, `Conv1DMCVI`, `Conv2DMCVI`,
    `GlobalInducingDense`, `GlobalInducingConv2D`; it sets the sample axis), or `None` for a
    moment-propagating model (`GlobalInducingDenseDVI` returns moments)."""
    for layer in layers_of(model):
        if getattr(layer, "outputs_moments", True) is False:
            return layer
    return None
