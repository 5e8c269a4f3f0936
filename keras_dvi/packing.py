"""How Gaussian moments travel between keras-dvi layers and reach losses.

Keras 3 hands a loss each model output separately, never a tuple, so every keras-dvi layer
returns ONE tensor that packs the mean and the (co)variance along axis 1:

* full covariance: shape `(batch, K + 1, K)`: row 0 is the mean, rows 1..K the covariance;
* diagonal: shape `(batch, 2, K)`: row 0 is the mean, row 1 the variances;
* feature map (conv and pooling layers): shape `(batch, 3, *spatial, channels)`: row 0 the
  means, row 1 the variances, row 2 the shared components (`keras_dvi.conv_moments`); a
  `(batch, 2, *spatial, channels)` map (no shared components) is accepted as input.

The dense forms are told apart by shape alone (for `K = 1` they coincide and mean the same
thing); a feature map has one or two spatial axes more. A layer also accepts a deterministic
`(batch, K)` tensor (a conv layer: `(batch, *spatial, channels)`), or an explicit pair
`(mean, covariance)` / `(mean, variance)`. `unpack` turns any of these back into tensors.
"""

from keras import ops

from keras_dvi.maths import moments

DETERMINISTIC = "deterministic"
DIAGONAL = "diagonal"
FULL = "full"


def pack(mean, second):
    """Packs `(mean (B, K), covariance (B, K, K) or variance (B, K))` into one tensor."""
    if len(second.shape) == 3:
        return ops.concatenate([mean[:, None, :], second], axis=1)
    return ops.stack([mean, second], axis=1)


#: Rows of a packed feature map: means, variances, shared components.
MAP_ROWS = 3


def pack_map(mean, variance, shared):
    """Packs the moments of a feature map, each `(B, *spatial, C)`, into `(B, 3, *spatial, C)`."""
    return ops.stack([mean, variance, shared], axis=1)


def map_shape(input_shape, spatial, channels):
    """Shape of a packed feature map with `spatial` positions and `channels`, batch size taken
    from `input_shape`."""
    nested = isinstance(input_shape, (list, tuple)) and isinstance(input_shape[0], (list, tuple))
    batch = input_shape[0][0] if nested else input_shape[0]
    return (batch, MAP_ROWS) + tuple(spatial) + (channels,)


def structure_of_map(shape, rank, name="inputs"):
    """Classifies the input shape of a layer on feature maps with `rank` spatial axes; returns
    `(kind, spatial, channels)`: `DETERMINISTIC` for `(batch, *spatial, channels)` data,
    `DIAGONAL` for a packed map `(batch, 2 or 3, *spatial, channels)` or a `(mean, variance)`
    pair; raises `ValueError` naming `name` for anything else."""
    nested = isinstance(shape, (list, tuple)) and any(isinstance(s, (list, tuple)) for s in shape)
    if nested:
        if len(shape) != 2 or tuple(shape[0]) != tuple(shape[1]) or len(shape[0]) != rank + 2:
            raise ValueError(
                f"Argument `{name}` given as a sequence must be a pair (mean, variance) of two feature "
                f"maps of the same shape (batch, {', '.join(['size'] * rank)}, channels); received {shape}."
            )
        shape = tuple(shape[0])
        return DIAGONAL, shape[1:-1], _static_dim(shape, -1)
    shape = tuple(shape)
    if len(shape) == rank + 2:
        return DETERMINISTIC, shape[1:-1], _static_dim(shape, -1)
    if len(shape) == rank + 3 and shape[1] in (2, MAP_ROWS):
        return DIAGONAL, shape[2:-1], _static_dim(shape, -1)
    dims = ", ".join(["size"] * rank)
    raise ValueError(
        f"Argument `{name}` must be data of shape (batch, {dims}, channels) or a packed keras-dvi "
        f"feature map of shape (batch, 3, {dims}, channels) (means, variances, shared components); "
        f"received shape {shape}."
        + (" A dense keras-dvi output (batch, 2 or K + 1, K) has no spatial axes: conv and pooling "
           "layers go before FlattenDVI / GlobalAveragePooling*DVI and the dense layers." if len(shape) == 3 and rank > 1 else "")
    )


def split_map(inputs, rank, name="inputs"):
    """Splits the inputs of a layer on feature maps into `(mean, variance, shared, kind)`:
    `variance` and `shared` are `None` for data; a map without shared components gets zeros."""
    if isinstance(inputs, (list, tuple)):
        kind, _, _ = structure_of_map((tuple(inputs[0].shape), tuple(inputs[1].shape)), rank, name)
        mean, variance = inputs
        return mean, variance, ops.zeros_like(mean), kind
    kind, _, _ = structure_of_map(tuple(inputs.shape), rank, name)
    if kind == DETERMINISTIC:
        return inputs, None, None, kind
    # `unstack`, not three slices: its gradient is one `stack`, where each slice's is a zero
    # tensor of the whole map (measured: the DVI CNN's training step 35% faster).
    rows = ops.unstack(inputs, num=int(inputs.shape[1]), axis=1)
    shared = rows[2] if len(rows) == MAP_ROWS else ops.zeros_like(rows[0])
    return rows[0], rows[1], shared, kind


def is_map(shape):
    """Whether a tensor of `shape` is a packed feature map `(batch, 2 or 3, *spatial, channels)`
    (a dense form has 3 axes, data of a map one axis fewer)."""
    return len(shape) >= 4 and shape[1] in (2, MAP_ROWS)


def positions_as_rows(y_pred):
    """A packed feature map `(batch, 2 or 3, *spatial, channels)` as one diagonal packed row per
    position, `(batch * positions, 2, channels)` (means and variances; the shared components
    are dropped: different channels' are independent, so each position's covariance over the
    channels is diagonal), and `restore`, which turns a value per row back into `(batch,
    *spatial)`. The losses and predictions of a dense prediction (segmentation) read a map so."""
    y_pred = ops.convert_to_tensor(y_pred)
    mean, variance = ops.unstack(y_pred, num=int(y_pred.shape[1]), axis=1)[:2]
    rows = ops.reshape(ops.stack([mean, variance], axis=-2), (-1, 2, y_pred.shape[-1]))
    leading = ops.shape(mean)[:-1]
    return rows, lambda per_row: ops.reshape(per_row, leading + tuple(ops.shape(per_row)[1:]))


def per_position(y_true, y_pred, name, per_row_targets):
    """A dense prediction (segmentation; the output a packed feature map `(batch, 3, *spatial,
    C)`): its positions as rows `(batch * positions, 2, C)` (`positions_as_rows`), the
    targets as rows, and `restore`, which gives the loss per position `(batch, *spatial)` (Keras
    reduces it as it reduces its own per-pixel losses: the mean over the batch and the
    positions). Targets: `(batch, *spatial)`, `(batch, *spatial, 1)` or `(batch, *spatial,
    per_row_targets)` (one-hot labels; a regression's targets). Any other output: unchanged,
    `restore` `None`."""
    shape = tuple(y_pred.shape)
    if not is_map(shape):
        return y_true, y_pred, None
    spatial, target_shape = shape[2:-1], tuple(y_true.shape)
    last = target_shape[len(spatial) + 1:]
    if (len(target_shape) not in (len(spatial) + 1, len(spatial) + 2) or last not in ((), (1,), (per_row_targets,))
            or any(t is not None and s is not None and t != s for t, s in zip(target_shape[1:], spatial))):
        dims = ", ".join("?" if n is None else str(n) for n in spatial)
        raise ValueError(
            f"{name}: the model outputs a feature map (a dense prediction: one prediction per position, "
            f"spatial shape ({dims})), so `y_true` must have shape (batch, {dims}) or (batch, {dims}, 1) (class "
            f"labels; one target), or (batch, {dims}, {per_row_targets}) (one-hot labels; targets); received "
            f"shape {target_shape}."
        )
    rows, restore = positions_as_rows(y_pred)
    y_rows = ops.reshape(y_true, (-1,) if not last else (-1, last[0]))
    return y_rows, rows, restore


def packed_shape(input_shape, units, full):
    """Shape of a packed output with `units` features, batch size taken from `input_shape`."""
    nested = isinstance(input_shape, (list, tuple)) and isinstance(input_shape[0], (list, tuple))
    batch = input_shape[0][0] if nested else input_shape[0]
    return (batch, units + 1 if full else 2, units)


def _static_dim(shape, axis):
    dim = shape[axis]
    return None if dim is None else int(dim)


def structure_of_shape(shape, name="inputs"):
    """Classifies a (possibly nested) input shape; returns `(kind, features)`.

    `kind` is `DETERMINISTIC`, `DIAGONAL` or `FULL`; raises `ValueError` naming `name` for
    anything else.
    """
    nested = isinstance(shape, (list, tuple)) and any(isinstance(s, (list, tuple)) for s in shape)
    if nested and len(shape) != 2:
        raise ValueError(
            f"Argument `{name}` given as a sequence must be a pair (mean, covariance); "
            f"received {len(shape)} tensors."
        )
    if nested:
        mean_shape, second_shape = tuple(shape[0]), tuple(shape[1])
        if len(mean_shape) != 2:
            raise ValueError(
                f"Argument `{name}`: the mean of a (mean, covariance) pair must have shape "
                f"(batch, features); received mean shape {mean_shape}."
            )
        features = _static_dim(mean_shape, -1)
        if len(second_shape) == 2:
            expected, kind = (features,), DIAGONAL
        elif len(second_shape) == 3:
            expected, kind = (features, features), FULL
        else:
            expected, kind = None, None
        if kind is None or tuple(second_shape[1:]) != expected:
            raise ValueError(
                f"Argument `{name}`: a (mean, covariance) pair needs a covariance of shape "
                f"(batch, {features}, {features}) or variances of shape (batch, {features}) "
                f"to match the mean of shape {mean_shape}; received {second_shape}."
            )
        return kind, features
    shape = tuple(shape)
    if is_map(shape):
        raise ValueError(
            f"Argument `{name}` is a packed keras-dvi feature map of shape {shape}: dense keras-dvi "
            "layers take vectors. Put `keras_dvi.FlattenDVI()` or a `GlobalAveragePooling1DDVI` / "
            "`GlobalAveragePooling2DDVI` layer between the conv or pooling layers and the dense ones."
        )
    if len(shape) == 2:
        return DETERMINISTIC, _static_dim(shape, -1)
    if len(shape) == 3:
        rows, features = _static_dim(shape, 1), _static_dim(shape, 2)
        if rows == 2:
            return DIAGONAL, features
        if rows is not None and features is not None and rows == features + 1:
            return FULL, features
    raise ValueError(
        f"Argument `{name}` must be a deterministic tensor of shape (batch, features), a packed "
        "keras-dvi tensor of shape (batch, 2, features) (mean and variances) or "
        "(batch, features + 1, features) (mean and covariance), or a pair (mean, covariance); "
        f"received shape {shape}."
    )


def split(inputs, name="inputs"):
    """Splits layer inputs into `(mean, second, kind)`.

    `second` is `None` (deterministic), `(B, K)` variances (diagonal) or `(B, K, K)`
    covariances (full). Validates shapes; raises `ValueError` naming `name`.
    """
    if isinstance(inputs, (list, tuple)):
        if len(inputs) != 2:
            raise ValueError(
                f"Argument `{name}` given as a sequence must be a pair (mean, covariance); "
                f"received {len(inputs)} tensors."
            )
        mean, second = inputs
        kind, _ = structure_of_shape((tuple(mean.shape), tuple(second.shape)), name)
        return mean, second, kind
    kind, _ = structure_of_shape(tuple(inputs.shape), name)
    if kind == DETERMINISTIC:
        return inputs, None, kind
    # (split and unstack are slices on every backend; indexing became a gather in JAX's export
    # with a dynamic batch size, which TFLite's builtin operations do not take)
    if kind == FULL:
        mean, covariance = ops.split(inputs, [1], axis=1)
        return ops.squeeze(mean, axis=1), covariance, kind
    mean, variance = ops.unstack(inputs, num=2, axis=1)
    return mean, variance, kind


def unpack(outputs, covariance="auto"):
    """Returns `(mean, covariance_or_variance)` from the output of any keras-dvi layer or model.

    Args:
        outputs: a packed keras-dvi tensor (see the module docstring), a `(mean, covariance)`
            pair, or a deterministic `(batch, K)` tensor (variance zero). NumPy arrays from
            `model.predict` are accepted too.
        covariance: `"auto"` returns what the tensor holds: `(batch, K, K)` covariances for a
            full-covariance output, `(batch, K)` variances for a diagonal one (also when
            `K = 1`); `"full"` always returns `(batch, K, K)`; `"diagonal"` always `(batch, K)`.

    Returns:
        `(mean (batch, K), covariance (batch, K, K) or variance (batch, K))`; for a feature map
        `(batch, 3, *spatial, channels)`, the means and variances `(batch, *spatial, channels)`.

    Examples:
        >>> model = keras.Sequential([keras.Input((3,)), DenseDVI(8, "relu"), DenseDVI(2)])
        >>> mean, cov = keras_dvi.unpack(model(x), covariance="full")
    """
    if covariance not in ("auto", "full", "diagonal"):
        raise ValueError(
            "Argument `covariance` must be 'auto', 'full' or 'diagonal'; "
            f"received covariance={covariance!r}."
        )
    if not isinstance(outputs, (list, tuple)):
        outputs = ops.convert_to_tensor(outputs)
        if is_map(outputs.shape):  # a feature map
            mean, variance = outputs[:, 0], outputs[:, 1]
            if covariance == "full":
                raise ValueError(
                    "Argument `covariance='full'` does not apply to a feature map (per-position "
                    "means and variances); use 'auto' or 'diagonal'."
                )
            return mean, variance
    mean, second, kind = split(outputs, name="outputs")
    if kind == DETERMINISTIC:
        second = ops.zeros_like(mean)
        kind = DIAGONAL
    if covariance == "full" and kind == DIAGONAL:
        second = moments.diag_embed(second)
    elif covariance == "diagonal" and kind == FULL:
        second = moments.diagonal(second)
    return mean, second


# ---------------------------------------------------------------- stamps on symbolic tensors

#: The attribute of a symbolic tensor naming the keras-dvi layer that produced it.
PRODUCER = "keras_dvi_producer"


def producer_of(tensor):
    """The keras-dvi layer that produced the symbolic tensor `tensor`, or `None`."""
    return getattr(tensor, PRODUCER, None)


#: The attribute of a symbolic data tensor naming the first keras-dvi layer that reads it (heads
#: of separate outputs reading the same data share its tracker: `keras_dvi.layers.kl_term`).
DATA_READER = "keras_dvi_data_reader"


#: The attribute of a symbolic tensor counting the inducing rows that `InducingInputs` put
#: before its batch (so that the first layer checks `num_train` against the data rows only).
INDUCING_ROWS = "keras_dvi_inducing_rows"


def inducing_rows_of(tensor):
    """The number of inducing rows before the batch of the symbolic tensor `tensor` (0 if none)."""
    return getattr(tensor, INDUCING_ROWS, 0)
