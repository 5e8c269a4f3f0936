"""The steps of a TAGI network: how each keras-dvi layer enters TAGI's passes.

A step is one layer's linear map with its adjoints: `DenseStep` and `ConvStep` (layers with
weights: the map `apply(a, W)`, its adjoint to the inputs `adjoint_input(d, W)`, through which
the deltas go down, and to the kernel `adjoint_kernel(a, d)`, which sums a batch's terms of a
weight's update), and the weightless maps `AveragePoolStep`, `GlobalAveragePoolStep`,
`FlattenStep` (`forward(mean, variance)` and `adjoint(dm, ds, input_shape)`). `step_of(layer)`
gives the step of a keras-dvi layer; `keras_dvi.tagi.maths.forward` and `update` run a list of
steps.
"""

import math

import numpy as np
from keras import ops

from keras_dvi.layers.conv_dvi import ConvDVI
from keras_dvi.layers.dense_diag_dvi import DenseDiagDVI
from keras_dvi.layers.flatten_dvi import FlattenDVI
from keras_dvi.layers.pooling_dvi import AveragePoolingDVI, GlobalAveragePoolingDVI

#: Activations TAGI can learn through (Heaviside has no slope to pass deltas down).
ACTIVATIONS = ("linear", "relu", "leaky_relu")
#: The layers TAGI updates, and the weightless maps it passes its deltas through.
WEIGHT_LAYERS = (DenseDiagDVI, ConvDVI)
MAP_LAYERS = (AveragePoolingDVI, GlobalAveragePoolingDVI, FlattenDVI)


class DenseStep:
    """A dense layer `z = a W + b` with its activation: the linear map and its two adjoints
    (to the inputs, for the deltas; to the kernel, for the update)."""

    has_weights = True

    def __init__(self, activation="linear"):
        if activation not in ACTIVATIONS:
            raise ValueError(f"TAGI supports the activations {ACTIVATIONS}; received {activation!r}.")
        self.activation = activation

    def apply(self, x, kernel):
        return ops.matmul(x, kernel)

    def adjoint_input(self, d, kernel):
        return ops.matmul(d, ops.transpose(kernel))

    def adjoint_kernel(self, x, d):
        return ops.matmul(ops.transpose(x), d)


class ConvStep(DenseStep):
    """A convolution (channels last, stride 1, no dilation, `"valid"` or `"same"` padding) with
    its activation. Every output position is a dense layer on its input patch with the shared
    kernel: the forward moments are eq. 10 per position, the deltas go down through the
    transposed convolution, and the kernel's update sums every position's term (the weights'
    covariance with each position's output), as the authors' code does."""

    def __init__(self, activation, kernel_size, padding):
        super().__init__(activation)
        if padding not in ("valid", "same"):
            raise ValueError(f"TAGI convolutions take padding 'valid' or 'same'; received {padding!r}.")
        self.kernel_size, self.padding = tuple(kernel_size), padding

    def apply(self, x, kernel):
        return ops.conv(x, kernel, strides=1, padding=self.padding, data_format="channels_last")

    def adjoint_input(self, d, kernel):
        return ops.conv_transpose(d, kernel, strides=1, padding=self.padding, data_format="channels_last")

    def adjoint_kernel(self, x, d):
        if self.padding == "same":  # Keras' "same" with stride 1: (k - 1) // 2 before, the rest after
            x = ops.pad(x, [(0, 0)] + [((k - 1) // 2, k - 1 - (k - 1) // 2) for k in self.kernel_size] + [(0, 0)])
        out = tuple(d.shape[1:-1])
        channels, filters = x.shape[-1], d.shape[-1]
        flat_d = ops.reshape(d, (-1, filters))
        taps = []  # one (in, filters) block per kernel offset: sum over batch and positions
        for offset in np.ndindex(*self.kernel_size):
            window = x[(slice(None),) + tuple(slice(o, o + n) for o, n in zip(offset, out)) + (slice(None),)]
            taps.append(ops.matmul(ops.transpose(ops.reshape(window, (-1, channels))), flat_d))
        return ops.reshape(ops.stack(taps), self.kernel_size + (channels, filters))


class AveragePoolStep:
    """Average pooling, windows of `pool_size` with the same strides, `"valid"` padding: a
    linear map, exact for independent units (variances divided by the window's size)."""

    has_weights = False

    def __init__(self, pool_size):
        self.pool_size = tuple(pool_size)
        self.count = math.prod(self.pool_size)

    def forward(self, mean, variance):
        pool = lambda x: ops.average_pool(x, self.pool_size, strides=self.pool_size, padding="valid",  # noqa: E731
                                          data_format="channels_last")
        return pool(mean), None if variance is None else pool(variance) / self.count

    def adjoint(self, dm, ds, input_shape):
        """Deltas of the inputs: each input gets its window's delta over the window's size (its
        square for the variance deltas); rows no window covers get 0."""
        for axis, size in enumerate(self.pool_size, start=1):
            dm, ds = ops.repeat(dm, size, axis=axis), ops.repeat(ds, size, axis=axis)
        pad = [(0, 0)] + [(0, n - m) for n, m in zip(input_shape[1:-1], dm.shape[1:-1])] + [(0, 0)]
        if any(p[1] for p in pad):
            dm, ds = ops.pad(dm, pad), ops.pad(ds, pad)
        return dm / self.count, ds / self.count**2


class GlobalAveragePoolStep:
    """The mean over every position of each channel (variances: their sum over the count squared)."""

    has_weights = False

    def forward(self, mean, variance):
        axes = tuple(range(1, len(mean.shape) - 1))
        count = math.prod(mean.shape[1:-1])  # (sums: Keras' JAX `ops.mean` loses float64 digits)
        return ops.sum(mean, axis=axes) / count, None if variance is None else ops.sum(variance, axis=axes) / count**2

    def adjoint(self, dm, ds, input_shape):
        spatial = tuple(input_shape[1:-1])
        count = math.prod(spatial)
        shape = (-1,) + (1,) * len(spatial) + (dm.shape[-1],)
        ones = ops.ones((1,) + spatial + (1,), dtype=dm.dtype)
        return ops.reshape(dm, shape) * ones / count, ops.reshape(ds, shape) * ones / count**2


class FlattenStep:
    """Feature maps to vectors, in `keras.layers.Flatten`'s order."""

    has_weights = False

    def forward(self, mean, variance):
        flat = lambda x: ops.reshape(x, (-1, math.prod(x.shape[1:])))  # noqa: E731
        return flat(mean), None if variance is None else flat(variance)

    def adjoint(self, dm, ds, input_shape):
        shape = (-1,) + tuple(input_shape[1:])
        return ops.reshape(dm, shape), ops.reshape(ds, shape)


def step_of(layer):
    """The step of a keras-dvi layer of a TAGI network (`TAGIModel` checks the layers first)."""
    if isinstance(layer, DenseDiagDVI):
        return DenseStep(layer.activation)
    if isinstance(layer, ConvDVI):
        return ConvStep(layer.activation, layer.kernel_size, layer.padding)
    if isinstance(layer, AveragePoolingDVI):
        return AveragePoolStep(layer.pool_size)
    if isinstance(layer, GlobalAveragePoolingDVI):
        return GlobalAveragePoolStep()
    if isinstance(layer, FlattenDVI):
        return FlattenStep()
    raise ValueError(f"TAGI has no step for layer {layer.name!r} ({type(layer).__name__}).")
