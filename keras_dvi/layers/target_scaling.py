"""`TargetScaling`: a regression head in the original units of the targets."""

import math

import keras
import numpy as np
from keras import ops

from keras_dvi import packing, validation
from keras_dvi.layers.boundary import KerasDVILayer


@keras.saving.register_keras_serializable(package="keras_dvi")
class TargetScaling(KerasDVILayer):
    """Maps a heteroscedastic output from standardised units to the targets' own units.

    A keras-dvi regression network learns best when its targets have mean 0 and standard
    deviation 1: its initial mean is near 0, its initial noise variance near 1, and the prior
    keeps weights small. `TargetScaling(mean, std)` after the last layer lets it train on
    targets in any units: if the network's output describes standardised targets
    `z ~ N(m, exp(l))`, the targets `y = mean + std * z` are `N(mean + std m, exp(l + 2 log std))`.
    The map is affine and exact for the Gaussian `(m, l)` of every example (its covariance
    becomes `A S A` with `A = diag(std, 1)`), so the loss, `model.predict` and
    `keras_dvi.predictive` all work in the original units.

    Args:
        mean: the targets' mean, a number or one per target dimension.
        std: the targets' standard deviation (positive), a number or one per dimension.
        **kwargs: base layer arguments.

    Input shape:
        A packed keras-dvi output with `2 D` units (`D` means, then `D` log-variances), as
        `HeteroscedasticELL` reads it.

    Output shape:
        The same.

    Examples:
        >>> model = keras.Sequential([
        ...     keras.Input((10,)),
        ...     DenseDVI(50, "relu", regularizer=prior),
        ...     DenseDVI(2, regularizer=prior),
        ...     TargetScaling.from_targets(y_train),   # y_train in its own units
        ... ])
        >>> model.compile("adam", loss=HeteroscedasticELL())
        >>> model.fit(x_train, y_train)
    """

    def __init__(self, mean=0.0, std=1.0, **kwargs):
        kwargs.setdefault("autocast", False)
        super().__init__(**kwargs)
        self.mean = [float(v) for v in np.atleast_1d(np.asarray(mean, dtype="float64"))]
        self.std = [float(v) for v in np.atleast_1d(np.asarray(std, dtype="float64"))]
        for value in self.std:
            validation.positive_number("std", value)
        if not all(math.isfinite(v) for v in self.mean):
            raise ValueError(f"Argument `mean` must be finite; received mean={mean!r}.")

    @classmethod
    def from_targets(cls, y, **kwargs):
        """A `TargetScaling` with the mean and standard deviation of training targets `y`
        (`(n,)` or `(n, D)`); a constant target dimension gets standard deviation 1."""
        y = np.asarray(y, dtype="float64")
        y = y.reshape(len(y), -1)
        if not np.isfinite(y).all():
            raise ValueError("Argument `y` contains NaN or infinite values; expected finite targets.")
        std = y.std(axis=0)
        return cls(mean=y.mean(axis=0), std=np.where(std > 0, std, 1.0), **kwargs)

    def build(self, input_shape):
        kind, features = packing.structure_of_shape(input_shape)
        if kind == packing.DETERMINISTIC or features is None or features % 2:
            raise ValueError(
                "TargetScaling expects a packed keras-dvi regression output with 2 D units (D "
                f"means, then D log-variances); received shape {tuple(input_shape)}."
            )
        dims = features // 2
        if len(self.mean) not in (1, dims) or len(self.std) not in (1, dims):
            raise ValueError(
                f"TargetScaling has {len(self.mean)} mean(s) and {len(self.std)} std(s) for a "
                f"model output with {dims} target dimension(s); give one per dimension or one "
                "for all."
            )

    def compute_output_shape(self, input_shape):
        return input_shape

    def call(self, inputs):
        mean, second, kind = packing.split(inputs)
        dims = mean.shape[-1] // 2
        dtype = mean.dtype
        loc = ops.broadcast_to(ops.convert_to_tensor(self.mean, dtype=dtype), (dims,))
        scale = ops.broadcast_to(ops.convert_to_tensor(self.std, dtype=dtype), (dims,))
        a = ops.concatenate([scale, ops.ones((dims,), dtype=dtype)])  # A = diag(std, 1)
        b = ops.concatenate([loc, 2.0 * ops.log(scale)])
        new_mean = mean * a + b
        if kind == packing.FULL:
            return packing.pack(new_mean, second * a[:, None] * a[None, :])
        return packing.pack(new_mean, second * ops.square(a))

    def get_config(self):
        config = super().get_config()
        config.update({"mean": self.mean, "std": self.std})
        return config
