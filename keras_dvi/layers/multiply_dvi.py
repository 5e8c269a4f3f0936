"""`MultiplyDVI`: a keras-dvi feature map times a per-channel gate (squeeze-and-excitation)."""

import keras
from keras import ops

from keras_dvi import packing, sampling, validation
from keras_dvi.layers.feature_map import MapLayer, from_channels_last, to_channels_last
from keras_dvi.maths import conv_moments, moments


def _map_first(items, shapes):
    """`items` (the layer's two inputs or their shapes) with the feature map first (a packed
    map or its samples has more axes than the gate's dense form)."""
    return list(items) if len(shapes[0]) >= len(shapes[1]) else [items[1], items[0]]


@keras.saving.register_keras_serializable(package="keras_dvi")
class MultiplyDVI(MapLayer):
    """Multiplies a keras-dvi feature map by a per-channel gate, as `keras.layers.Multiply` does
    in a squeeze-and-excitation block (`x * sigmoid(dense(dense(global_pool(x))))`, EfficientNet,
    MobileNetV3).

    **Assumption: the map and the gate are independent** (`keras_dvi.conv_moments.scale_moments`):
    the product's mean and variance are then exact, `E[x g] = m E[g]`,
    `Var[x g] = m^2 Var[g] + v E[g^2]`, and the gate's one draw per channel becomes part of
    the channel's shared component. In a squeeze-and-excitation block the gate is computed from
    the map's global average, so the two are correlated through it.

    Args:
        data_format: `"channels_last"` or `"channels_first"` (of the map); `None` (default) is
            `keras.config.image_data_format()`.

    Input shape:
        A list `[map, gate]` (either order): a packed feature map `(batch, 3, *spatial, channels)` (channels
        first: `(batch, 3, channels, *spatial)`) and the gate, a dense keras-dvi output
        `(batch, 2, channels)` (means and variances; a full covariance `(batch, channels + 1,
        channels)` is read on its diagonal) or deterministic `(batch, channels)`.

    Output shape:
        Packed, as the map.

    Examples:
        >>> squeeze = keras_dvi.GlobalAveragePooling2DDVI()(x)
        >>> squeeze = keras_dvi.DenseDiagDVI(8, activation="silu", regularizer=prior)(squeeze)
        >>> gate = keras_dvi.DenseDiagDVI(32, activation="sigmoid", regularizer=prior)(squeeze)
        >>> x = keras_dvi.MultiplyDVI()([x, gate])
    """

    def takes_packed(self, shape):
        return len(shape) >= 4

    def _shapes(self, input_shape):
        if not isinstance(input_shape, (list, tuple)) or len(input_shape) != 2 or not all(
                isinstance(s, (list, tuple)) for s in input_shape):
            raise ValueError(f"{type(self).__name__} takes a list [feature map, gate]; received {input_shape}.")
        first, gate = _map_first([tuple(s) for s in input_shape], [tuple(s) for s in input_shape])
        _, channels = self._structure(self._last(first))
        kind, units = packing.structure_of_shape(gate, name="gate")
        if channels is not None and units is not None and channels != units:
            raise ValueError(f"{type(self).__name__} {self.name!r}: the gate has {units} units for a feature map of "
                             f"{channels} channels; it needs one per channel. Received shapes {first} and {gate}.")
        return first, kind

    def build(self, input_shape):
        self._shapes(input_shape)

    def compute_output_shape(self, input_shape):
        first, _ = self._shapes(input_shape)
        return first

    def call(self, inputs):
        inputs = _map_first(inputs, [tuple(t.shape) for t in inputs])
        rank = len(inputs[0].shape) - 3
        if sampling.current_context(self) is not None:  # (samples, batch, *spatial, channels), (samples, batch, channels)
            samples = to_channels_last(inputs[0], rank, self.data_format)
            gate = ops.reshape(inputs[1], tuple(ops.shape(inputs[1])[:2]) + (1,) * rank + (ops.shape(inputs[1])[-1],))
            return from_channels_last(samples * gate, rank, self.data_format)
        _, kind = self._shapes([tuple(t.shape) for t in inputs])
        mean, variance, shared = self._split(to_channels_last(inputs[0], rank, self.data_format))
        gate_mean, gate_second, _ = packing.split(inputs[1], name="gate")
        gate_mean = ops.cast(gate_mean, mean.dtype)
        if kind == packing.DETERMINISTIC:
            gate_variance = ops.zeros_like(gate_mean)
        else:
            gate_variance = ops.cast(gate_second if kind == packing.DIAGONAL
                                     else moments.diagonal(gate_second), mean.dtype)
            gate_mean, gate_variance = validation.check_moments(gate_mean, gate_variance, packing.DIAGONAL, "gate",
                                                                where=f"{type(self).__name__} {self.name!r}")
        return self._from_last(packing.pack_map(*conv_moments.scale_moments(mean, variance, shared, gate_mean,
                                                                            gate_variance)))
