"""`HomoscedasticNoise`: a learned (or fixed) noise log-variance for `HeteroscedasticELL`."""

import keras
from keras import ops

from keras_dvi import packing, validation
from keras_dvi.layers.boundary import KerasDVILayer


class LearnedLogVariance(KerasDVILayer):
    """Base of the noise layers: one learned log-variance per target, optionally rescaled.

    The variable holds `l / log_variance_scale` (Ober & Aitchison 2021, Appendix H): with a
    scale `s`, one optimiser step moves `l` about `s` times as far, so a noise level that is
    far from its starting value is reached within a normal training budget.
    """

    def __init__(self, initial_log_variance=0.0, log_variance_scale=1.0, trainable=True, **kwargs):
        kwargs.setdefault("autocast", False)  # keep float32 moments under mixed precision
        super().__init__(trainable=trainable, **kwargs)
        self.initial_log_variance = float(initial_log_variance)
        self.log_variance_scale = validation.positive_number("log_variance_scale", log_variance_scale)

    def _add_log_variance(self, features):
        self.scaled_log_variance = self.add_weight(
            name="scaled_log_variance",
            shape=(features,),
            initializer=keras.initializers.Constant(self.initial_log_variance / self.log_variance_scale),
            autocast=False,
        )

    @property
    def log_variance(self):
        """The log noise variances, `(D,)`."""
        return self.log_variance_scale * ops.convert_to_tensor(self.scaled_log_variance)

    def get_config(self):
        config = super().get_config()
        config["initial_log_variance"] = self.initial_log_variance
        config["log_variance_scale"] = self.log_variance_scale
        return config


@keras.saving.register_keras_serializable(package="keras_dvi")
class HomoscedasticNoise(LearnedLogVariance):
    """Appends a constant log noise variance per target to a keras-dvi output (hoDVI).

    The paper's homoscedastic variant (hoDVI, Wu et al. 2019, Section 5): the noise variance
    does not depend on the input. The log-variances `l` are deterministic (`S_ll = S_ml = 0`),
    so `HeteroscedasticELL` reduces to the homoscedastic expected log-likelihood.

    Args:
        initial_log_variance: starting value of each target's log noise variance.
        log_variance_scale: Appendix H scaling (Ober & Aitchison 2021): the variable holds
            `l / scale`, so the optimiser moves `l` `scale` times faster. Use about 10 when
            the noise is far from `initial_log_variance`, e.g. normalised targets that a
            network fits closely (log-variance -6 on yacht), which Adam at 1e-3 would
            otherwise take thousands of steps to reach.
        trainable: `True` to learn it (by maximum likelihood), `False` to keep it fixed.
        **kwargs: base layer arguments.

    Input shape:
        A packed keras-dvi output with `D` units (full or diagonal), or a deterministic
        `(batch, D)` tensor; or a packed channels-last feature map `(batch, 3, *spatial, D)` (a
        dense prediction: one regression per position, `D` targets each).

    Output shape:
        The same form with `2 D` units (channels): the `D` means, then the `D` log-variances.

    Examples:
        >>> model = keras.Sequential([
        ...     keras.Input((8,)), DenseDVI(50, "relu"), DenseDVI(1), HomoscedasticNoise(),
        ... ])
        >>> model.compile("adam", loss=HeteroscedasticELL())
    """

    def build(self, input_shape):
        if packing.is_map(input_shape):
            self._add_log_variance(input_shape[-1])
            return
        _, features = packing.structure_of_shape(input_shape)
        self._add_log_variance(features)

    def compute_output_shape(self, input_shape):
        if packing.is_map(input_shape):
            return tuple(input_shape[:-1]) + (None if input_shape[-1] is None else 2 * input_shape[-1],)
        kind, features = packing.structure_of_shape(input_shape)
        return packing.packed_shape(input_shape, 2 * features, full=kind == packing.FULL)

    def call(self, inputs):
        if not isinstance(inputs, (list, tuple)) and packing.is_map(inputs.shape):
            rows = ops.unstack(inputs, num=int(inputs.shape[1]), axis=1)
            log_var = ops.cast(self.log_variance, rows[0].dtype) + ops.zeros_like(rows[0])
            constant = [log_var] + [ops.zeros_like(row) for row in rows[1:]]  # (variance, shared component 0)
            return ops.stack([ops.concatenate(pair, axis=-1) for pair in zip(rows, constant)], axis=1)
        mean, second, kind = packing.split(inputs)
        log_var = ops.cast(self.log_variance, mean.dtype) + ops.zeros_like(mean)
        out_mean = ops.concatenate([mean, log_var], axis=-1)
        if kind == packing.FULL:
            zeros = ops.zeros_like(second)
            top = ops.concatenate([second, zeros], axis=-1)
            bottom = ops.concatenate([zeros, zeros], axis=-1)
            return packing.pack(out_mean, ops.concatenate([top, bottom], axis=-2))
        variance = ops.zeros_like(mean) if second is None else second
        return packing.pack(out_mean, ops.concatenate([variance, ops.zeros_like(mean)], axis=-1))
