"""What `AddDVI` and `ConcatenateDVI` do on vectors: the dense keras-dvi outputs
`(batch, 2, K)` (means, variances) and `(batch, K + 1, K)` (mean, covariance), beside data
`(batch, K)` (a deterministic input of the network, variance zero). A feature map has more
axes (`(batch, 3, *spatial, channels)`); the two are not mixed."""

from keras import ops

from keras_dvi import packing, validation
from keras_dvi.maths import moments


def on_vectors(layer, shapes):
    """Whether inputs of `shapes` are vectors (every shape of rank 2 or 3) rather than feature
    maps (rank 4 or more); `ValueError` naming `layer` if they mix the two."""
    ranks = [len(shape) for shape in shapes]
    if all(rank <= 3 for rank in ranks):
        return True
    if all(rank >= 4 for rank in ranks):
        return False
    raise ValueError(
        f"{type(layer).__name__} {layer.name!r} joins vectors (dense keras-dvi outputs (batch, 2 or K + 1, K), "
        "or data (batch, K)) or feature maps (batch, 3, *spatial, channels), not one with the other; received "
        f"{[tuple(shape) for shape in shapes]}.")


def structures(layer, shapes):
    """`[(kind, features)]` of vector inputs (`packing.structure_of_shape`), checked: one at
    least holds moments (on data alone the plain Keras layer does the job)."""
    kinds = [packing.structure_of_shape(tuple(shape)) for shape in shapes]
    if all(kind == packing.DETERMINISTIC for kind, _ in kinds):
        raise ValueError(
            f"{type(layer).__name__} {layer.name!r} received data only (shapes {[tuple(s) for s in shapes]}): it "
            "reads keras-dvi outputs (and data beside them, if it joins several inputs). On data, use the plain "
            f"Keras layer (keras.layers.{type(layer).__name__[:-3]}).")
    return kinds


def split(layer, inputs):
    """`[(mean, second)]` of vector inputs in the layer's moment dtype, checked; `second` is
    `None` for data (`keras_dvi.maths.moments.add_moments` reads the structures)."""
    parts = []
    for tensor in inputs:
        mean, second, kind = packing.split(tensor)
        mean = ops.cast(mean, layer.moment_dtype)
        second = None if second is None else ops.cast(second, layer.moment_dtype)
        parts.append(validation.check_moments(mean, second, kind, "inputs",
                                              where=f"{type(layer).__name__} {layer.name!r}"))
    return parts


def samples(inputs, num_samples):
    """Sampled vector inputs `(samples, batch, K)`, data `(batch, K)` repeated over the samples."""
    return [t if len(t.shape) == 3 else ops.broadcast_to(t[None], (num_samples,) + tuple(ops.shape(t)))
            for t in inputs]


def check_activation(layer, activation, full):
    """`ValueError` naming `layer` if `activation` applies to full-covariance vectors and has no
    pairwise covariance rule."""
    if full and activation not in moments.COVARIANCE_ACTIVATIONS:
        raise ValueError(
            f"{type(layer).__name__} {layer.name!r}: its input has a full covariance, and activation "
            f"{activation!r} has no pairwise covariance here (only {moments.COVARIANCE_ACTIVATIONS}). Give it "
            "diagonal inputs (DenseDiagDVI), or apply the activation in the next layer.")


def activated(mean, second, activation):
    """The packed moments of `activation` on Gaussian vectors with variances or covariances
    `second` (`moments.activation_moments`, `moments.activation_covariance`)."""
    if len(second.shape) == len(mean.shape) + 1:
        return packing.pack(*moments.activation_covariance(mean, second, activation))
    return packing.pack(*moments.activation_moments(mean, second, activation))


def unit_affine(second, scale):
    """The (co)variances `second` of a vector after `x -> scale x + shift`, per unit."""
    if len(second.shape) == 3:
        return second * scale[:, None] * scale[None, :]
    return second * ops.square(scale)
