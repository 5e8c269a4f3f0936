"""`AddDVI`: the addition of two keras-dvi feature maps (a residual block) or vectors."""

import functools
import operator

import keras
from keras import ops

from keras_dvi import packing, sampling
from keras_dvi.layers import vectors
from keras_dvi.layers.base import apply_activation
from keras_dvi.layers.feature_map import MapLayer, to_channels_last
from keras_dvi.maths import conv_moments, moments


@keras.saving.register_keras_serializable(package="keras_dvi")
class AddDVI(MapLayer):
    """Adds keras-dvi feature maps of the same shape, for residual blocks
    (`keras.layers.Add` for moments), or vectors (dense keras-dvi outputs, and data beside
    them), two or more, then applies an optional activation.

    **Assumption: the branches are independent.** Means and (co)variances add
    (`keras_dvi.conv_moments.add_moments`: each channel's two shared factors become one, the
    projection of every unit on its channel's sum; `keras_dvi.moments.add_moments` for
    vectors). In a residual block `x + F(x)` the branches are correlated, since `F(x)` is
    computed from `x`: with mostly positive correlation the sum's variance is under-stated. For
    dense residual blocks, `SkipDVI` accounts for that correlation exactly (Stein's lemma); a
    conv residual block has no such closed form here.

    Args:
        activation: `None` (default), `"relu"`, `"heaviside"`, `"leaky_relu"`, `"relu6"`,
            `"hard_silu"`, `"hard_sigmoid"`, `"silu"`, `"gelu"`, `"sigmoid"` or `"tanh"`, applied to
            the sum (as in `relu(x + F(x))`); on full-covariance vectors one of `"relu"`,
            `"heaviside"`, `"leaky_relu"` (the activations with a pairwise covariance).
        data_format: `"channels_last"` or `"channels_first"` (where the channel axis is: the
            shared components are per channel); `None` (default) is
            `keras.config.image_data_format()`.

    Input shape:
        A list of two or more packed feature maps `(batch, 3, *spatial, channels)` of the same
        shape (channels first: `(batch, 3, channels, *spatial)`); or of two or more vectors of
        `K` features: dense keras-dvi outputs `(batch, 2, K)` or `(batch, K + 1, K)`, and data
        `(batch, K)` (a network input: variance zero), one at least not data. Data beside
        feature maps, `(batch, *spatial, channels)` (an embedding beside a Transformer block's
        output), adds as a map with zero variance.

    Output shape:
        Packed, as the inputs: a feature map, or `(batch, 2, K)` (`(batch, K + 1, K)` if an
        input has a full covariance).

    Examples:
        >>> x = keras_dvi.Conv2DDVI(16, 3, padding="same", activation="relu", regularizer=prior)(inputs)
        >>> branch = keras_dvi.Conv2DDVI(16, 3, padding="same", activation="relu", regularizer=prior)(x)
        >>> branch = keras_dvi.Conv2DDVI(16, 3, padding="same", regularizer=prior)(branch)
        >>> x = keras_dvi.AddDVI(activation="relu")([x, branch])
        >>> h = keras_dvi.DenseDiagDVI(32, activation="relu", regularizer=prior)(features)
        >>> h = keras_dvi.AddDVI()([h, keras_dvi.DenseDiagDVI(32, activation="relu", regularizer=prior)(h)])
    """

    def __init__(self, activation=None, data_format=None, **kwargs):
        super().__init__(data_format=data_format, **kwargs)
        self.activation = moments.canonical_activation(activation)

    def takes_packed(self, shape):
        return len(shape) >= 3

    def _shapes(self, input_shape):
        """The output shape, the inputs' checked."""
        if not isinstance(input_shape, (list, tuple)) or len(input_shape) < 2 or not all(
                isinstance(s, (list, tuple)) for s in input_shape):
            raise ValueError(f"{type(self).__name__} takes a list of two or more packed feature maps or vectors; "
                             f"received {input_shape}.")
        shapes = [tuple(s) for s in input_shape]
        maps = [shape for shape in shapes if len(shape) >= 4]
        if not maps:
            return self._vector_shapes(shapes)
        if not self._data_beside_maps(shapes):
            vectors.on_vectors(self, shapes)  # (maps mixed with vectors: the error that says so)
        shapes = maps
        first = shapes[0]
        for other in shapes[1:]:
            if len(first) != len(other) or any(a is not None and b is not None and a != b
                                               for a, b in zip(first[1:], other[1:])):
                raise ValueError(f"{type(self).__name__} adds feature maps of the same shape; received {first} and "
                                 f"{other}.")
        for shape in shapes:
            self._structure(self._last(shape))
        return first

    def packed_inputs(self, tensors):
        if self._data_beside_maps([tuple(t.shape) for t in tensors]):
            return [t for t in tensors if len(t.shape) >= 4]
        return super().packed_inputs(tensors)

    @staticmethod
    def _data_beside_maps(shapes):
        """Whether the inputs mix packed maps with data of the same maps (`(batch, *spatial,
        channels)`: a network input, or an embedding, beside its Transformer block's output);
        the data then adds as a map with zero variance."""
        maps = [shape for shape in shapes if len(shape) >= 4]
        data = [shape for shape in shapes if len(shape) < 4]
        same = lambda a, b: all(x is None or y is None or x == y for x, y in zip(a, b))  # noqa: E731
        return bool(maps) and all(len(d) == len(maps[0]) - 1 and same(d[1:], maps[0][2:]) for d in data)

    def _vector_shapes(self, shapes):
        """The output shape of the sum of vectors, checked."""
        kinds = vectors.structures(self, shapes)
        widths = {features for _, features in kinds if features is not None}
        if len(widths) > 1:
            raise ValueError(f"{type(self).__name__} {self.name!r} adds vectors of the same width; received "
                             f"{' and '.join(str(features) for _, features in kinds)} features ({shapes}).")
        full = any(kind == packing.FULL for kind, _ in kinds)
        vectors.check_activation(self, self.activation, full)
        return packing.packed_shape(shapes[0], next(iter(widths), None), full=full)

    def build(self, input_shape):
        self._shapes(input_shape)

    def compute_output_shape(self, input_shape):
        return self._shapes(input_shape)

    def call(self, inputs):
        if sampling.current_context(self) is not None:  # (samples, batch, ...) each; data (batch, K) broadcasts
            return apply_activation(functools.reduce(operator.add, inputs), self.activation)
        self._shapes([tuple(t.shape) for t in inputs])
        if all(len(t.shape) <= 3 for t in inputs):  # vectors (checked above)
            summed = functools.reduce(moments.add_moments, vectors.split(self, inputs))
            return vectors.activated(*summed, self.activation)
        rank = max(len(t.shape) for t in inputs) - 3
        as_map = lambda t: t if len(t.shape) == rank + 3 else packing.pack_map(  # noqa: E731  (data: no variance)
            t, ops.zeros_like(t), ops.zeros_like(t))
        summed = functools.reduce(conv_moments.add_moments,
                                  [self._split(to_channels_last(as_map(t), rank, self.data_format)) for t in inputs])
        return self._from_last(packing.pack_map(*conv_moments.activation_moments(*summed, self.activation)))

    def get_config(self):
        config = super().get_config()
        config["activation"] = None if self.activation == "linear" else self.activation
        return config
