"""Zero padding, cropping and upsampling of keras-dvi feature maps
(`keras_dvi.conv_moments.pad_moments`, `crop_moments`, `upsample_moments`,
`interpolate_moments`): as `keras.layers.ZeroPadding*D`, `Cropping*D` and `UpSampling*D` on
the moments, exact (interpolation: exact within the representation)."""

import keras
from keras import ops

from keras_dvi import packing
from keras_dvi.layers.feature_map import MapLayer, integers
from keras_dvi.layers.pooling_dvi import DIMS
from keras_dvi.maths import conv_moments


def pairs(name, value, rank):
    """Keras' padding or cropping argument as one `(before, after)` pair of non-negative
    integers per spatial axis: an integer (the same everywhere), a tuple of `rank` integers
    (symmetric per axis; for rank 1 a pair `(before, after)`), or a tuple of `rank` pairs."""

    def count(v):
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0

    if count(value):
        return ((value, value),) * rank
    if isinstance(value, (tuple, list)):
        if rank == 1 and len(value) == 2 and all(count(v) for v in value):
            return (tuple(value),)
        if len(value) == rank and all(count(v) for v in value):
            return tuple((v, v) for v in value)
        if len(value) == rank and all(isinstance(p, (tuple, list)) and len(p) == 2 and all(count(v) for v in p)
                                      for p in value):
            return tuple(tuple(p) for p in value)
    raise ValueError(f"Argument `{name}` must be a non-negative integer, a tuple of {rank} of them, or a tuple of "
                     f"{rank} (before, after) pairs; received {name}={value!r}.")


class ZeroPaddingDVI(MapLayer):
    """Base class of `ZeroPadding1DDVI` / `ZeroPadding2DDVI` (see `ZeroPadding2DDVI`)."""

    def __init__(self, padding=1, data_format=None, **kwargs):
        super().__init__(data_format=data_format, **kwargs)
        self.padding = pairs("padding", padding, self.rank)

    def _output_shape(self, input_shape):
        spatial, channels = self._structure(input_shape)
        out = tuple(None if n is None else n + b + a for n, (b, a) in zip(spatial, self.padding))
        return packing.map_shape(input_shape, out, channels)

    def _propagate(self, mean, variance, shared):
        return packing.pack_map(*conv_moments.pad_moments(mean, variance, shared, self.padding))

    def _sample(self, samples):
        return ops.pad(samples, [(0, 0), (0, 0), *self.padding, (0, 0)])

    def get_config(self):
        config = super().get_config()
        config["padding"] = self.padding
        return config


class CroppingDVI(MapLayer):
    """Base class of `Cropping1DDVI` / `Cropping2DDVI` (see `Cropping2DDVI`)."""

    def __init__(self, cropping=1, data_format=None, **kwargs):
        super().__init__(data_format=data_format, **kwargs)
        self.cropping = pairs("cropping", cropping, self.rank)

    def _output_shape(self, input_shape):
        spatial, channels = self._structure(input_shape)
        out = tuple(None if n is None else n - b - a for n, (b, a) in zip(spatial, self.cropping))
        if any(n is not None and n < 1 for n in out):
            raise ValueError(f"Layer {self.name!r}: cropping {self.cropping} leaves nothing of inputs of spatial "
                             f"shape {tuple(spatial)}.")
        return packing.map_shape(input_shape, out, channels)

    def _propagate(self, mean, variance, shared):
        return packing.pack_map(*conv_moments.crop_moments(mean, variance, shared, self.cropping))

    def _sample(self, samples):
        index = (slice(None),) * 2 + tuple(slice(b, -a if a else None) for b, a in self.cropping) + (slice(None),)
        return samples[index]

    def get_config(self):
        config = super().get_config()
        config["cropping"] = self.cropping
        return config


class UpSamplingDVI(MapLayer):
    """Base class of `UpSampling1DDVI` / `UpSampling2DDVI` (see `UpSampling2DDVI`)."""

    def __init__(self, size=2, data_format=None, interpolation="nearest", **kwargs):
        super().__init__(data_format=data_format, **kwargs)
        self.size = integers("size", size, self.rank)
        if interpolation != "nearest" and interpolation not in conv_moments.INTERPOLATIONS:
            raise ValueError(
                f"Argument `interpolation` must be 'nearest' or one of {', '.join(map(repr, conv_moments.INTERPOLATIONS))}"
                f" (those of keras.layers.UpSampling2D); received interpolation={interpolation!r}.")
        self.interpolation = interpolation

    def _output_shape(self, input_shape):
        spatial, channels = self._structure(input_shape)
        out = tuple(None if n is None else n * k for n, k in zip(spatial, self.size))
        return packing.map_shape(input_shape, out, channels)

    def _propagate(self, mean, variance, shared):
        if self.interpolation == "nearest":
            return packing.pack_map(*conv_moments.upsample_moments(mean, variance, shared, self.size))
        return packing.pack_map(*conv_moments.interpolate_moments(mean, variance, shared, self.size,
                                                                  self.interpolation))

    def _sample(self, samples):
        if self.interpolation == "nearest":
            return conv_moments.upsample(samples, self.size)
        return conv_moments.interpolate(samples, self.size, self.interpolation)

    def get_config(self):
        config = super().get_config()
        config["size"] = self.size[0] if self.rank == 1 else self.size
        if self.rank == 2:
            config["interpolation"] = self.interpolation
        return config


_UPSAMPLING_DOC = """Upsampling of a keras-dvi feature map ({rank}D), arguments as
    `keras.layers.UpSampling{rank}D`.

    {nearest}: every unit is repeated `size` times
    along each spatial axis, each copy with its mean, variance and shared component
    (`keras_dvi.conv_moments.upsample_moments`).{interpolation_how} As for every position of a
    keras-dvi map, neighbouring outputs are taken as independent of each other beyond their
    shared components (a copy, or an interpolation, of the same units); a convolution after it
    sees them as such.

    Args:
        size: a positive integer{pair}: the upsampling factor (default 2).
        data_format: `"channels_last"` or `"channels_first"`; `None` (default) is
            `keras.config.image_data_format()`.{interpolation}

    Input shape:
        A packed feature map `(batch, 3, {dims}, channels)` from a keras-dvi layer (channels
        first: `(batch, 3, channels, {dims})`).

    Output shape:
        Packed, each spatial axis `size` times longer.

    Examples:
        >>> x = keras_dvi.Conv{rank}DDVI(16, 3, padding="same", activation="relu", regularizer=prior)(inputs)
        >>> x = keras_dvi.UpSampling{rank}DDVI(2{example})(x)
    """


@keras.saving.register_keras_serializable(package="keras_dvi")
class UpSampling1DDVI(UpSamplingDVI):
    __doc__ = _UPSAMPLING_DOC.format(rank=1, pair="", dims="steps", interpolation="", interpolation_how="",
                                     example="", nearest="Exact per unit")
    rank = 1

    def __init__(self, size=2, data_format=None, **kwargs):
        super().__init__(size=size, data_format=data_format, **kwargs)


@keras.saving.register_keras_serializable(package="keras_dvi")
class UpSampling3DDVI(UpSamplingDVI):
    __doc__ = _UPSAMPLING_DOC.format(rank=3, pair=" or a tuple of 3 (depth, rows, cols)", dims=DIMS[3],
                                     interpolation="", interpolation_how="", example="", nearest="Exact per unit")
    rank = 3

    def __init__(self, size=2, data_format=None, **kwargs):
        super().__init__(size=size, data_format=data_format, **kwargs)


@keras.saving.register_keras_serializable(package="keras_dvi")
class UpSampling2DDVI(UpSamplingDVI):
    __doc__ = _UPSAMPLING_DOC.format(
        rank=2, pair=" or a tuple of 2 (rows, cols)", dims="rows, cols", nearest="Nearest neighbour (the default) is exact per unit",
        interpolation_how=(
            "\n\n    The other interpolations make each output unit a fixed weighted sum\n"
            "    `sum_j a_j x_j` of neighbouring units, with Keras' weights (`ops.image.resize`, read\n"
            "    off Keras' own function, `keras_dvi.conv_moments.interpolation_matrix`): the mean\n"
            "    `sum_j a_j m_j` and the shared component `sum_j a_j s_j` are exact, the independent\n"
            "    part's variance `sum_j a_j^2 (v_j - s_j^2)` exact within the representation, as for\n"
            "    average pooling (`keras_dvi.conv_moments.interpolate_moments`)."),
        interpolation=(
            "\n        interpolation: `\"nearest\"` (default), `\"bilinear\"`, `\"bicubic\"`,\n"
            "            `\"lanczos3\"` or `\"lanczos5\"`, as in `keras.layers.UpSampling2D`."),
        example=', interpolation="bilinear"')
    rank = 2


_DOC = """{what} of a keras-dvi feature map ({rank}D), arguments as `keras.layers.{keras_name}`.

    Exact: {how}

    Args:
        {argument}: a non-negative integer (every side), a tuple of {rank} integers (both sides of
            each spatial axis){pair}, or a tuple of {rank} `(before, after)` pairs.
        data_format: `"channels_last"` or `"channels_first"`; `None` (default) is
            `keras.config.image_data_format()`.

    Input shape:
        A packed feature map `(batch, 3, {dims}, channels)` from a keras-dvi layer (channels
        first: `(batch, 3, channels, {dims})`).

    Output shape:
        Packed, with each spatial axis {change}.

    Examples:
        >>> x = keras_dvi.Conv2DDVI(16, 3, regularizer=prior)(inputs)
        >>> x = keras_dvi.{name}{example}(x)
    """
_PAD_HOW = "the new units are the constant 0 (mean, variance and shared component 0)."
_CROP_HOW = "the units kept keep their moments."


def _doc(kind, rank):
    pad = kind == "ZeroPadding"
    return _DOC.format(
        what="Zero padding" if pad else "Cropping", rank=rank, keras_name=f"{kind}{rank}D",
        how=_PAD_HOW if pad else _CROP_HOW, argument="padding" if pad else "cropping",
        pair="; for 1D a pair `(before, after)`" if rank == 1 else "",
        dims=DIMS[rank],
        change="longer by its two paddings" if pad else "shorter by its two croppings",
        name=f"{kind}{rank}DDVI", example={1: "(1)", 2: "((1, 1), (2, 2))", 3: "(1)"}[rank])


@keras.saving.register_keras_serializable(package="keras_dvi")
class ZeroPadding1DDVI(ZeroPaddingDVI):
    __doc__ = _doc("ZeroPadding", 1)
    rank = 1


@keras.saving.register_keras_serializable(package="keras_dvi")
class ZeroPadding2DDVI(ZeroPaddingDVI):
    __doc__ = _doc("ZeroPadding", 2)
    rank = 2


@keras.saving.register_keras_serializable(package="keras_dvi")
class Cropping1DDVI(CroppingDVI):
    __doc__ = _doc("Cropping", 1)
    rank = 1


@keras.saving.register_keras_serializable(package="keras_dvi")
class Cropping2DDVI(CroppingDVI):
    __doc__ = _doc("Cropping", 2)
    rank = 2


@keras.saving.register_keras_serializable(package="keras_dvi")
class ZeroPadding3DDVI(ZeroPaddingDVI):
    __doc__ = _doc("ZeroPadding", 3)
    rank = 3


@keras.saving.register_keras_serializable(package="keras_dvi")
class Cropping3DDVI(CroppingDVI):
    __doc__ = _doc("Cropping", 3)
    rank = 3
