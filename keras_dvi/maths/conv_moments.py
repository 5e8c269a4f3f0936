"""Closed-form moments of convolutional networks: the pure maths of keras-dvi's conv, pooling,
flatten and residual layers.

Everything here is a stateless function of channels-last tensors `(batch, *spatial, channels)`
with one or two spatial axes, written with `keras.ops`; the layers in `keras_dvi.layers` hold
the variables and call these functions. Tests check each function against Monte Carlo or
quadrature (`tests/test_conv.py`).

**What a feature map carries.** A covariance over all positions and channels is not tractable,
so each unit `u = (position p, channel k)` carries its mean `m`, its variance `v` and one more
number, its *shared component* `s`:

    u = m + s z_k + e,    z_k ~ N(0, 1) shared by every position of channel k,
                          e independent of everything else, Var(e) = v - s^2 >= 0.

Why: a convolution applies the same random kernel at every position, so one weight draw moves
all positions of a channel together. A per-position diagonal (`s = 0`) ignores that, and a
layer that sums positions (pooling, global pooling, a dense layer after flatten) then adds
variances that are in truth strongly correlated, and under-states the output variance.
Different channels' factors are taken to be
independent, and so are the factors a layer makes and the ones it receives (each layer
re-expresses them as one factor per output channel, below).

**The approximations, layer by layer** (exact parts first):

* conv (`conv_moments`): the mean and the variance of every unit are those of Wu et al.
  (2019, eqs. 3-4) applied per position (exact for given input moments), plus the variance the
  input units' shared components add through the kernel means,
  `sum_c (sum_o s[p + o, c] M[o, c, k])^2`, taken with `s` constant over the kernel's window
  (its window mean). The new shared component is the projection of each unit on the sum of
  its channel over all positions (the direction every position sum sees): for the kernel's
  own noise `N[p, k] = sum_{o,c} h[p+o, c] dW[o, c, k] + db[k]`,
  `Cov(N[p, k], sum_p' N[p', k]) = sum_{o,c} V[o, c, k] (m[p+o, c] T_c + s[p+o, c] S_c) + P V_b[k]`
  with `T_c`, `S_c` the sums of `m` and `s` over the input positions the windows cover
  (`sum_p' m[p' + o, c]`, averaged over the offsets `o`), one convolution with the kernel
  variances.
* activation (`activation_moments`): exact Gaussian moments of the unit (DVI, Table 1), and
  `s_h = E[f'(a)] s` (Stein's lemma: exact for the covariance with the factor).
* max pooling (`max_pool_moments`): Clark's (1961) recursion, the max of two Gaussians taken
  as Gaussian, pair by pair over the window, with the pairs' correlation from the shared
  components; `Cov(max(X1, X2), Z) = Cov(X1, Z) Phi(alpha) + Cov(X2, Z) Phi(-alpha)` carries
  the shared component through (exact for Gaussian inputs, Clark's eq. 4).
* average and global average pooling: exact within the representation (shared components
  add coherently, the independent parts as independent variables).
* flatten (`flatten_moments`): keeps each unit's mean and variance and drops the shared
  factors: the dense layer after it treats its inputs as independent, as every diagonal
  keras-dvi layer does (the dense layers' own weight noise then dominates the output
  variance).
* residual addition (`add_moments`): the two branches are taken to be independent.
* a map times a per-channel gate (`scale_moments`, squeeze-and-excitation): the map and the
  gate are taken to be independent (the gate is computed from the map's global average).
* zero padding, cropping, nearest-neighbour upsampling, concatenation along channels and a
  per-channel affine map (batch normalisation with fixed statistics): exact within the
  representation (`pad_moments`, `crop_moments`, `upsample_moments`, `concatenate_moments`,
  `channel_affine_moments`).
* upsampling by interpolation (bilinear, bicubic, Lanczos; `interpolate_moments`): each output
  unit a fixed weighted sum of input units, exact within the representation as average
  pooling is.
* transposed convolution (`conv_transpose_moments`): the convolution of the input with zeros
  between its positions, as above.
* layer normalisation of the channels at each position (`moments.layer_norm_moments`, shared
  components included): the centring exact, the normaliser at its expectation, the map
  linearised about the means; each unit keeps its component on its own channel's factor
  (its loads on the other channels' factors, O(1/C) each, join its independent part).
"""

import functools
import itertools
import math

import keras
import numpy as np
from keras import ops

from keras_dvi.maths import moments

#: Floor of a shared component's normalising variance (a channel with no variance at all).
_FLOOR = 1e-30


def spatial_axes(x):
    """The spatial axes of a channels-last feature map `(batch, *spatial, channels)`."""
    return tuple(range(1, len(x.shape) - 1))


def _tuple(value, rank):
    return tuple(value) if isinstance(value, (list, tuple)) else (int(value),) * rank


def window_sum(x, window, strides=1, padding="valid", dilation_rate=1):
    """The sum of `x` over each window of a convolution or pooling (zero padding), per channel:
    a depthwise convolution with a kernel of ones."""
    rank = len(x.shape) - 2
    if rank <= 2:
        ones = ops.ones(_tuple(window, rank) + (x.shape[-1], 1), dtype=x.dtype)
        return ops.depthwise_conv(x, ones, strides=strides, padding=padding, data_format="channels_last",
                                  dilation_rate=dilation_rate)
    # (Keras' depthwise convolution has one or two spatial axes: the channels go to the batch)
    channels, shape = x.shape[-1], ops.shape(x)
    rows = ops.reshape(ops.moveaxis(x, -1, 1), (-1,) + tuple(shape[1:-1]) + (1,))
    ones = ops.ones(_tuple(window, rank) + (1, 1), dtype=x.dtype)
    sums = ops.conv(rows, ones, strides=strides, padding=padding, data_format="channels_last",
                    dilation_rate=dilation_rate)
    return ops.moveaxis(ops.reshape(sums, (shape[0], channels) + tuple(ops.shape(sums)[1:-1])), 1, -1)


def _coverage(size, window, stride, padding, dilation):
    """How many windows of a convolution cover each input position of one axis (Keras'
    padding: "same" pads `total // 2` before), as a NumPy vector of `size`."""
    if padding == "valid":
        out, before = (size - (window - 1) * dilation - 1) // stride + 1, 0
    else:
        out = -(-size // stride)
        before = max((out - 1) * stride + (window - 1) * dilation + 1 - size, 0) // 2
    starts = np.arange(out)[:, None] * stride + np.arange(window)[None, :] * dilation - before
    return np.bincount(starts[(starts >= 0) & (starts < size)], minlength=size).astype("float64")


def _window_total(x, window, strides, padding, dilation_rate):
    """`sum_p x[p + o]` over the output positions `p` of a convolution, averaged over the
    window's offsets `o`: `(batch, 1, ..., channels)`. With a known spatial shape it is
    `sum_q x[q] c[q] / prod(window)`, `c[q]` the number of windows covering `q` (a constant:
    one product and a sum instead of a depthwise convolution)."""
    rank = len(x.shape) - 2
    axes = spatial_axes(x)
    spatial = tuple(x.shape[1:-1])
    if any(n is None for n in spatial):
        sums = window_sum(x, window, strides, padding, dilation_rate)
        return ops.sum(sums, axis=axes, keepdims=True) / float(math.prod(window))
    counts = functools.reduce(np.multiply.outer, [
        _coverage(n, k, s, padding, d)
        for n, k, s, d in zip(spatial, _tuple(window, rank), _tuple(strides, rank), _tuple(dilation_rate, rank))])
    weights = ops.convert_to_tensor((counts / math.prod(_tuple(window, rank)))[..., None], dtype=x.dtype)
    return ops.sum(x * weights, axis=axes, keepdims=True)


def _positions(x):
    """The number of positions of a feature map, as a tensor of its dtype."""
    return ops.cast(ops.prod(ops.shape(x)[1:-1]), x.dtype)


def independent_variance(variance, shared):
    """The variance `v - s^2` of each unit's independent part, floored at 0 (`v` itself when
    `shared` is `None`)."""
    return variance if shared is None else ops.maximum(variance - ops.square(shared), 0.0)


def clip_shared(shared, variance):
    """Keeps `|s| <= sqrt(v)` (the independent part's variance `v - s^2` is never negative;
    the square root is floored so its gradient stays finite where a unit has no variance)."""
    return _clip_to_sd(shared, variance)


@ops.custom_gradient
def _clip_to_sd(shared, variance):
    """`clip(s, -sqrt(v), sqrt(v))` (`v` floored), with the gradient written out: `s`'s where
    `|s| <= sqrt(v)`, else `sign(s) / (2 sqrt(v))` to `v` (none where `v` is floored). The
    same values and gradient as differentiating `ops.clip`, in two masked products instead of
    its six broadcasting selects."""
    bound = ops.sqrt(ops.maximum(variance, moments.VARIANCE_FLOOR))

    def grad(upstream):
        inside = ops.less_equal(ops.abs(shared), bound)  # (only when differentiated)
        to_shared = ops.where(inside, upstream, 0.0)
        outside = ops.logical_and(ops.logical_not(inside), variance > moments.VARIANCE_FLOOR)
        return to_shared, ops.where(outside, upstream * ops.sign(shared) * 0.5 / bound, 0.0)

    return ops.clip(shared, -bound, bound), grad


def _through_columns(x, column, depthwise):
    """`sum_c x[..., c] column[c, k]` for every output channel `k` of a convolution (`column`:
    `(in, filters)`); for a depthwise one (`column`: `(in, multiplier)`) output channel
    `c * multiplier + j` reads input channel `c` alone: `x[..., c] column[c, j]`."""
    if not depthwise:
        return ops.matmul(x, column)
    out = ops.expand_dims(x, -1) * column
    return ops.reshape(out, (-1,) + tuple(x.shape[1:-1]) + (x.shape[-1] * column.shape[-1],))


def conv_moments(mean, kernel_mean, kernel_variance, bias_mean=None, bias_variance=None, variance=None,
                 shared=None, strides=1, padding="valid", dilation_rate=1, depthwise=False, conv_dtype=None):
    """Moments of `a = conv(h, W) + b` with factorised Gaussian `W`, `b` (see module docstring).

    With `depthwise=True`, `W` is a depthwise kernel `(*kernel_size, in, multiplier)` (Keras'
    `DepthwiseConv2D`: output channel `c * multiplier + j` convolves input channel `c` alone)
    and every term below is the same with `keras.ops.depthwise_conv` in place of the
    convolution: a depthwise convolution is a convolution whose kernel is zero, with zero
    variance, between different channels.

    Args:
        mean: `(batch, *spatial, in)` means of `h` (or the deterministic input).
        kernel_mean: `(*kernel_size, in, filters)` posterior means `M` (depthwise: `(*kernel_size,
            in, multiplier)`, `filters = in * multiplier`).
        kernel_variance: posterior variances `V` (>= 0), the shape of `kernel_mean`.
        bias_mean: `(filters,)` or `None` (no bias).
        bias_variance: `(filters,)` or `None`.
        variance: `(batch, *spatial, in)` variances of `h`, or `None` (deterministic `h`).
        shared: `(batch, *spatial, in)` shared components of `h`, or `None` (none).
        strides: as in `keras.ops.conv`.
        padding: `"valid"` or `"same"`, as in `keras.ops.conv`.
        dilation_rate: as in `keras.ops.conv`.
        depthwise: whether `W` is a depthwise kernel (above).
        conv_dtype: `None` (every convolution in the inputs' dtype), `"float16"` or
            `"bfloat16"` (a mixed precision policy's compute dtype): the convolution of the
            means runs in it, and under `"bfloat16"` (float32's exponent range) the
            convolutions of variances and shared components too; under `"float16"` those stay
            in the inputs' dtype (products of small variances, 1e-6 and below, fall under
            float16's normal range, 6e-5). Results and all element-wise work stay in the
            inputs' dtype.

    Returns:
        `(mean_a, variance_a, shared_a)`, each `(batch, *out_spatial, filters)`.
    """
    conv = functools.partial(ops.depthwise_conv if depthwise else ops.conv, strides=strides, padding=padding, data_format="channels_last",
                             dilation_rate=dilation_rate)
    mean_conv = _in_dtype(conv, conv_dtype)
    if conv_dtype == "bfloat16":
        conv = mean_conv
    axes = spatial_axes(mean)
    mean_a = mean_conv(mean, kernel_mean)
    second = ops.square(mean) if variance is None else ops.square(mean) + variance
    var_a = conv(second, kernel_variance)
    # Cov(N[p, k], sum_p' N[p', k]) of the kernel's own noise, and its sum over p (the variance
    # of the channel sum), with each input's sum over the windows the output positions see.
    window = functools.partial(_window_total, window=tuple(kernel_mean.shape[:-2]), strides=strides,
                               padding=padding, dilation_rate=dilation_rate)
    coupled = mean * window(mean)
    if shared is not None:
        kernel_size = tuple(kernel_mean.shape[:-2])
        s_bar = window_sum(shared, kernel_size, strides, padding, dilation_rate) / float(math.prod(kernel_size))
        total = ops.sum(s_bar, axis=axes, keepdims=True)  # = window(shared)
        coupled = coupled + shared * total
    numerator = conv(coupled, kernel_variance)
    if bias_mean is not None:
        mean_a = mean_a + bias_mean
    if bias_variance is not None:
        positions = _positions(mean_a)
        var_a = var_a + bias_variance
        numerator = numerator + positions * bias_variance
    denominator = ops.sum(numerator, axis=axes)
    if variance is not None:
        residual = independent_variance(variance, shared)
        var_a = var_a + conv(residual, ops.square(kernel_mean))
    if shared is not None:
        # The input's shared components through the kernel means, with `s` at its window mean:
        # sum_c (s_bar[p, c] sum_o M[o, c, k])^2, and its projection on the channel sums.
        column = ops.square(ops.sum(kernel_mean, axis=tuple(range(len(kernel_size)))))  # (in, filters)
        var_a = var_a + _through_columns(ops.square(s_bar), column, depthwise)
        numerator = numerator + _through_columns(s_bar * total, column, depthwise)
        denominator = denominator + _through_columns(ops.square(ops.squeeze(total, axis=axes)), column, depthwise)
    scale = ops.sqrt(ops.maximum(denominator, _FLOOR))
    for _ in axes:
        scale = ops.expand_dims(scale, 1)
    return mean_a, var_a, clip_shared(numerator / scale, var_a)


def transpose_pads(kernel_size, strides, padding, output_padding=None, dilation_rate=1):
    """Keras' transposed convolution (`keras.ops.conv_transpose`) as a convolution: per spatial
    axis, the `(before, after)` zero padding of the input once `strides - 1` zeros stand between
    its positions (`dilate`), for a stride-1 `"valid"` convolution with the transposed kernel
    (`transposed_kernel`). Keras' conventions: `"valid"` gives `(n - 1) s + k` positions (plus
    `output_padding`, default `max(k, s) - k`), `"same"` `n s` (with `output_padding`:
    `(n - 1) s + k % 2 + output_padding`), `k` the dilated kernel size."""
    rank = len(kernel_size)
    output_padding = (None,) * rank if output_padding is None else _tuple(output_padding, rank)
    pads = []
    for k, s, extra, d in zip(kernel_size, _tuple(strides, rank), output_padding, _tuple(dilation_rate, rank)):
        k = (k - 1) * d + 1
        if padding == "valid":
            extra = max(k, s) - k if extra is None else extra
            pads.append((k - 1, k - 1 + extra))
        else:
            total = s + k - 2 if extra is None else k + k % 2 - 2 + extra
            before = min(total // 2 + total % 2, k - 1)
            pads.append((before, total - before))
    return tuple(pads)


def dilate(x, strides, pads=None):
    """`x`, whose spatial axes are the `len(strides)` axes before its last (channels) axis
    (`(batch, *spatial, channels)`, or samples `(samples, batch, *spatial, channels)`), with
    `stride - 1` zeros between neighbouring positions along each spatial axis, then zero padded
    by `pads` (a `(before, after)` pair per spatial axis, or `None`)."""
    rank = len(strides)
    first = len(x.shape) - 1 - rank
    for i, stride in enumerate(strides):
        if stride == 1:
            continue
        axis = first + i
        shape = ops.shape(x)
        widths = [(0, 0)] * (len(x.shape) + 1)
        widths[axis + 1] = (0, stride - 1)
        x = ops.pad(ops.expand_dims(x, axis + 1), widths)  # (..., n, stride, ...)
        x = ops.reshape(x, tuple(shape[:axis]) + (shape[axis] * stride,) + tuple(shape[axis + 1:]))
        x = x[(slice(None),) * axis + (slice(None, 1 - stride),)]  # (n - 1) stride + 1 positions
    if pads is not None and any(tuple(p) != (0, 0) for p in pads):
        x = ops.pad(x, [(0, 0)] * first + [tuple(p) for p in pads] + [(0, 0)])
    return x


def transposed_kernel(kernel, rank):
    """A transposed convolution's kernel `(*kernel_size, filters, in)` (`rank` spatial axes; a
    leading samples axis may come first) as the kernel of the convolution it equals
    (`transpose_pads`): flipped along every spatial axis, its last two axes swapped:
    `(*kernel_size, in, filters)`."""
    ndim = len(kernel.shape)
    return ops.swapaxes(ops.flip(kernel, axis=tuple(range(ndim - 2 - rank, ndim - 2))), -1, -2)


def conv_transpose_moments(mean, kernel_mean, kernel_variance, bias_mean=None, bias_variance=None, variance=None,
                           shared=None, strides=1, padding="valid", output_padding=None, dilation_rate=1,
                           conv_dtype=None):
    """Moments of `a = conv_transpose(h, W) + b` (Keras' `Conv1DTranspose` / `Conv2DTranspose`,
    kernel `(*kernel_size, filters, in)`) with factorised Gaussian `W`, `b`.

    A transposed convolution is the stride-1 convolution of the input with `strides - 1` zeros
    between its positions and padded (`dilate`, `transpose_pads`) with the flipped kernel
    (`transposed_kernel`), exactly; the zeros are constants (mean, variance and shared
    component 0). So the moments are `conv_moments`' on that input: each unit's mean and
    variance exact for the given input moments, the shared components as for a convolution.
    The convolutions run on the dilated input (`prod(strides)` times the positions).

    Args:
        mean, variance, shared: as in `conv_moments`.
        kernel_mean: `(*kernel_size, filters, in)` posterior means (Keras' layout).
        kernel_variance: posterior variances, the shape of `kernel_mean`.
        bias_mean, bias_variance: `(filters,)` or `None`.
        strides, padding, output_padding, dilation_rate: as in `keras.ops.conv_transpose`.
        conv_dtype: as in `conv_moments`.

    Returns:
        `(mean_a, variance_a, shared_a)`, each `(batch, *out_spatial, filters)`.
    """
    rank = len(mean.shape) - 2
    strides = _tuple(strides, rank)
    pads = transpose_pads(tuple(kernel_mean.shape[:-2]), strides, padding, output_padding, dilation_rate)
    spread = lambda t: None if t is None else dilate(t, strides, pads)  # noqa: E731
    return conv_moments(spread(mean), transposed_kernel(kernel_mean, rank), transposed_kernel(kernel_variance, rank),
                        bias_mean, bias_variance, spread(variance), spread(shared), strides=1, padding="valid",
                        dilation_rate=dilation_rate, conv_dtype=conv_dtype)


def _in_dtype(conv, dtype):
    """`conv` run in `dtype` (operands cast to it, the result cast back), or `conv` itself if
    `dtype` is `None`."""
    if dtype is None:
        return conv

    def cast_conv(inputs, kernel):
        return ops.cast(conv(ops.cast(inputs, dtype), ops.cast(kernel, dtype)), inputs.dtype)

    return cast_conv


def activation_moments(mean, variance, shared, activation):
    """Moments of `h = f(a)` for every unit of a feature map: the exact one-unit moments
    (`keras_dvi.moments.activation_moments`) and the shared component `E[f'(a)] s` (Stein's
    lemma)."""
    if moments.get_activation(activation).identity:
        return mean, variance, shared
    mean_h, var_h, slope = moments.activation_moments_and_slope(mean, variance, activation)
    return mean_h, var_h, clip_shared(slope * shared, var_h)


def _clark(mean_1, var_1, mean_2, var_2, cov):
    """The terms of Clark's max (see `gaussian_max`): `(theta^2, theta, d, alpha, Phi,
    Phi(-alpha), phi, theta phi, mean, variance)`, the variance not yet clipped at 0."""
    spread2 = var_1 + var_2 - 2.0 * cov
    theta = ops.sqrt(ops.maximum(spread2, moments.VARIANCE_FLOOR))
    d = mean_1 - mean_2
    alpha = ops.clip(d / theta, -moments.MU_MAX, moments.MU_MAX)
    p, f = moments.normal_cdf(alpha), moments.normal_pdf(alpha)
    q = 1.0 - p  # (one erfc fewer; its absolute error, 6e-8 in float32, is what the terms see)
    spread = theta * f
    mean = mean_1 * p + mean_2 * q + spread  # (not m2 + d p: exact when one side is padding)
    # v1 p + v2 q + d^2 p q + d theta phi (q - p) - (theta phi)^2, in fewer operations
    var = var_2 + (var_1 - var_2) * p + d * (d * p * q + spread * (q - p)) - ops.square(spread)
    return spread2, theta, d, alpha, p, q, f, spread, mean, var


def gaussian_max(mean_1, var_1, mean_2, var_2, cov):
    """Mean and variance of `max(X1, X2)` for jointly Gaussian `X1`, `X2` (Clark 1961, eqs.
    2-3), and the weight `Phi(alpha)` with which `Cov(max, Z) = Cov(X1, Z) w + Cov(X2, Z) (1 - w)`.

    `alpha = (m1 - m2) / theta`, `theta^2 = v1 + v2 - 2 cov`. The variance is written without
    the cancellation of `E[max^2] - E[max]^2`:
    `v1 Phi + v2 Phi(-alpha) + d^2 Phi Phi(-alpha) + d theta phi (Phi(-alpha) - Phi) - theta^2 phi^2`,
    `d = m1 - m2`.
    """
    *_, p, _, _, _, mean, var = _clark(mean_1, var_1, mean_2, var_2, cov)
    return mean, ops.maximum(var, 0.0), p


@ops.custom_gradient
def max_pair_moments(mean_1, var_1, shared_1, mean_2, var_2, shared_2):
    """One step of Clark's recursion in keras-dvi's representation: the mean, variance and
    shared component of `max(X1, X2)` for units `X_i = m_i + s_i z + e_i` (`Cov(X1, X2) =
    s_1 s_2`), with a hand-written gradient.

    The values are `gaussian_max`'s (the same `_clark` terms) and `s = s_1 Phi(alpha) + s_2 Phi(-alpha)`. The gradient is
    the closed form (about a third of the operations of differentiating the ~35 elementwise
    operations of the forward pass, which was most of a DVI CNN's max pooling cost): with
    `d = m_1 - m_2`, `theta`, `alpha = d / theta`, `Phi`, `phi` at `alpha`, `Q = 1 - Phi`,
    `dM/dm_1 = Phi`, `dM/dm_2 = Q`, `dM/dtheta = phi`;
    `dV/dd = 2 d Phi Q + theta phi (Q - Phi) + phi (v_1 - v_2) / theta = -dV/dm_2`,
    `dV/dtheta = phi (d (Q - Phi) - 2 theta phi - alpha (v_1 - v_2) / theta)`,
    `dV/dv_1 = Phi + dV/dtheta / (2 theta)`, `dV/dv_2 = Q + dV/dtheta / (2 theta)`;
    `dS/dd = (s_1 - s_2) phi / theta`, `dS/dtheta = -alpha dS/dd`; and
    `theta^2 = v_1 + v_2 - 2 s_1 s_2` (no gradient where it is floored). Checked against finite
    differences in `tests/test_conv.py`.

    Returns:
        `(mean, variance, shared)`.
    """
    spread2, theta, d, alpha, p, q, f, spread, mean, var = _clark(mean_1, var_1, mean_2, var_2, shared_1 * shared_2)
    q_minus_p = q - p
    shared = shared_2 + (shared_1 - shared_2) * p

    def grad(*upstream):
        if len(upstream) == 1:  # JAX passes the outputs' cotangents as one tuple
            upstream = upstream[0]
        g_mean, g_var, g_shared = (ops.zeros_like(mean) if g is None else g for g in upstream)
        dv = var_1 - var_2
        f_over_theta = f / theta
        shared_slope = (shared_1 - shared_2) * f_over_theta  # dS/dd
        g_d = g_mean * p + g_var * (2.0 * d * p * q + spread * q_minus_p + dv * f_over_theta) + g_shared * shared_slope
        g_theta = (g_mean * f + g_var * f * (d * q_minus_p - 2.0 * spread - alpha * dv / theta)
                   - g_shared * alpha * shared_slope)
        g_spread2 = ops.where(spread2 > moments.VARIANCE_FLOOR, 0.5 * g_theta / theta, 0.0)
        g_cov = -2.0 * g_spread2
        return (g_d, g_var * p + g_spread2, g_shared * p + g_cov * shared_2,
                g_mean - g_d, g_var * q + g_spread2, g_shared * q + g_cov * shared_1)

    return (mean, ops.maximum(var, 0.0), shared), grad


def _pads(size, window, stride, padding):
    """`(before, after, out)` of one axis, as Keras' pooling pads ("same": output
    `ceil(size / stride)`, the extra element after)."""
    if padding == "valid":
        return 0, 0, (size - window) // stride + 1
    out = -(-size // stride)
    total = max((out - 1) * stride + window - size, 0)
    return total // 2, total - total // 2, out


def _window_taps(tensors, fills, pool_size, strides, padding, stacked=False):
    """For each input tensor, its elements at every offset of a pooling window (padded with
    `fills` for "same"), the offsets in `itertools.product` order: a list of tensors
    `(batch, *out_spatial, channels)` per input, or with `stacked` one tensor
    `(taps, batch, *out_spatial, channels)` per input."""
    shape = tensors[0].shape[1:-1]
    pads = [_pads(int(n), k, s, padding) for n, k, s in zip(shape, pool_size, strides)]
    if any(before or after for before, after, _ in pads):
        widths = [(0, 0)] + [(before, after) for before, after, _ in pads] + [(0, 0)]
        tensors = [ops.pad(t, widths, constant_values=fill) for t, fill in zip(tensors, fills)]
    outs = [out for _, _, out in pads]
    if tuple(strides) == tuple(pool_size):  # windows that tile the (padded) map
        tiled = [_tiled_taps(t, pool_size, outs) for t in tensors]
        return tiled if stacked else [ops.unstack(t, num=math.prod(pool_size), axis=0) for t in tiled]
    result = []
    for t in tensors:
        taps = []
        for offset in itertools.product(*(range(k) for k in pool_size)):
            index = (slice(None),) + tuple(
                slice(o, o + (out - 1) * s + 1, s) for o, s, out in zip(offset, strides, outs)) + (slice(None),)
            taps.append(t[index])
        result.append(ops.stack(taps) if stacked else taps)
    return result


def patches(x, kernel_size, strides=1, padding="valid"):
    """The input patch of every output position of a convolution, as rows of a regression:
    `(batch, *out_spatial, prod(kernel_size) * channels)`, ordered as
    `kernel.reshape(-1, filters)` of a Keras kernel `(*kernel_size, channels, filters)`, so that
    `patches(x) @ kernel.reshape(-1, filters)` is `keras.ops.conv(x, kernel)` (zero padding as
    Keras': "same" pads `total // 2` before). One strided slice per kernel offset.

    Args:
        x: channels-last feature maps `(batch, *spatial, channels)` with a known spatial shape.
        kernel_size: tuple of the kernel's spatial sizes.
        strides: integer or tuple.
        padding: `"valid"` or `"same"`.
    """
    rank = len(x.shape) - 2
    kernel_size, strides = _tuple(kernel_size, rank), _tuple(strides, rank)
    (taps,) = _window_taps([x], [0.0], kernel_size, strides, padding, stacked=True)  # (k, batch, *out, C)
    taps = ops.transpose(taps, tuple(range(1, rank + 2)) + (0, rank + 2))  # (batch, *out, k, C)
    shape = ops.shape(taps)
    return ops.reshape(taps, tuple(shape[:rank + 1]) + (math.prod(kernel_size) * x.shape[-1],))


def _tiled_taps(t, pool_size, outs):
    """`_window_taps` of one tensor when the windows tile it (strides = pool size): a crop,
    a reshape and one transpose (cheaper to differentiate than one strided slice per offset)."""
    rank = len(pool_size)
    covered = tuple(o * k for o, k in zip(outs, pool_size))
    if covered != tuple(t.shape[1:-1]):  # the rows and columns no window reaches: a `slice`, whose
        # gradient is one pad (a strided slice's took 50 ms of a 220 ms CNN step)
        t = ops.slice(t, (0,) * (rank + 2), (ops.shape(t)[0],) + covered + (t.shape[-1],))
    split = (-1,) + tuple(v for o, k in zip(outs, pool_size) for v in (o, k)) + (t.shape[-1],)
    t = ops.reshape(t, split)  # (batch, o1, k1, o2, k2, ..., channels)
    window_axes = tuple(2 + 2 * i for i in range(rank))
    out_axes = tuple(1 + 2 * i for i in range(rank))
    t = ops.transpose(t, window_axes + (0,) + out_axes + (2 * rank + 1,))
    return ops.reshape(t, (math.prod(pool_size),) + tuple(ops.shape(t)[rank:]))


#: The mean given to the padding of a "same" max pooling window: below any activation, so the
#: padded elements never win (as Keras pads with -inf).
_PAD_MEAN = -1e9


def max_pool_moments(mean, variance, shared, pool_size, strides, padding="valid"):
    """Moments of max pooling over windows of `pool_size` (Clark's recursion, pair by pair,
    correlations `s_i s_j` from the shared components).

    Under JAX the recursion is a `keras.ops.scan` over the window's offsets; TensorFlow runs it
    unrolled. XLA (JAX's compiler) fuses the unrolled recursion's gradient with the gather of
    the offsets' gradients back into the feature map and recomputes the recursion for every
    element; the scan keeps each step's gradient in memory instead (the step costs are in
    BENCHMARKS.md).

    Returns:
        `(mean, variance, shared)`, each `(batch, *out_spatial, channels)`.
    """
    scan = keras.backend.backend() == "jax"
    taps = _window_taps([mean, variance, shared], [_PAD_MEAN, 0.0, 0.0], pool_size, strides, padding, stacked=scan)
    if scan:
        m, v, s = _running_max(taps)
    else:
        m, v, s = (t[0] for t in taps)
        for tap in zip(*(t[1:] for t in taps)):
            m, v, s = max_pair_moments(m, v, s, *tap)
    return m, v, clip_shared(s, v)


def _running_max(taps):
    """Clark's recursion along the first axis of stacked taps `(means, variances, shared
    components)`, each `(taps, ...)`, as a `keras.ops.scan` from the first tap. (The first tap
    is split off, not indexed: a slice, where indexing became a gather in JAX's export with a
    dynamic batch size, which TFLite's builtin operations do not take.)"""
    first, rest = zip(*(ops.split(t, [1], axis=0) for t in taps))
    first = tuple(ops.squeeze(t, axis=0) for t in first)
    if taps[0].shape[0] == 1:
        return first

    def step(carry, tap):
        return max_pair_moments(*carry, *tap), None

    return ops.scan(step, first, rest)[0]


def average_pool_moments(mean, variance, shared, pool_size, strides, padding="valid"):
    """Moments of average pooling (padding excluded from the average, as in Keras): exact
    within the representation. Returns `(mean, variance, shared)`."""
    count = window_sum(ops.ones_like(mean[..., :1]), pool_size, strides, padding)
    residual = independent_variance(variance, shared)
    mean_p = window_sum(mean, pool_size, strides, padding) / count
    shared_p = window_sum(shared, pool_size, strides, padding) / count
    residual_p = window_sum(residual, pool_size, strides, padding) / ops.square(count)
    return mean_p, residual_p + ops.square(shared_p), shared_p


def global_average_pool_moments(mean, variance, shared):
    """Moments of the mean over all positions, `(batch, channels)` each: the channel's shared
    component adds coherently, the independent parts as independent variables; the result's
    channels are independent. Returns `(mean, variance)`."""
    axes = spatial_axes(mean)
    positions = _positions(mean)
    residual = independent_variance(variance, shared)
    # (sums over the count: Keras' JAX `ops.mean` computes float64 inputs in float32)
    shared_p = ops.sum(shared, axis=axes) / positions
    return ops.sum(mean, axis=axes) / positions, ops.sum(residual, axis=axes) / ops.square(positions) + ops.square(shared_p)


def global_max_pool_moments(mean, variance, shared):
    """Moments of the max over all positions, `(batch, channels)` each: Clark's recursion over
    the positions in order (`max_pair_moments`, correlations from the shared components), a
    `keras.ops.scan`. The result's channels are independent, as after a global average. The
    number of positions may be unknown (a TensorFlow sequence of any length).

    In order, each step takes the running max (a Gaussian approximation) and one exact
    position. A balanced tree of pairwise maxima, which needs fewer steps, approximates both
    sides of its later steps and under-stated the variance far more: on 64 positions whose
    means differ by less than their sds, 0.38 of Monte Carlo's (median) against 0.64 in order.

    Returns:
        `(mean, variance)`.
    """
    spatial = mean.shape[1:-1]
    positions = -1 if None in spatial else math.prod(int(n) for n in spatial)  # (-1: a sequence of any length)
    rows = ops.shape(mean)[0]
    taps = [ops.moveaxis(ops.reshape(t, (rows, positions, t.shape[-1])), 1, 0) for t in (mean, variance, shared)]
    if positions == -1:  # (a scan needs its length; a loop over the positions' indices does not)
        def body(i, running):
            return i + 1, max_pair_moments(*running, *(ops.take(t, i, axis=0) for t in taps))

        _, carry = ops.while_loop(lambda i, _: i < ops.shape(taps[0])[0], body, (1, tuple(t[0] for t in taps)))
    else:
        carry = _running_max(taps)
    return carry[0], ops.maximum(carry[1], 0.0)


def flatten_moments(mean, variance):
    """Means and variances of a feature map as `(batch, features)` vectors, in the order of
    `keras.layers.Flatten` (channels last). The shared factors are dropped (module docstring)."""
    rows = ops.shape(mean)[0]
    return ops.reshape(mean, (rows, -1)), ops.reshape(variance, (rows, -1))


def add_moments(first, second):
    """Moments of the sum of two feature maps taken to be independent: means and variances add;
    the two channels' factors become one, the projection of each unit on the channel sum.
    `first`, `second`: `(mean, variance, shared)`. Returns `(mean, variance, shared)`."""
    (m1, v1, s1), (m2, v2, s2) = first, second
    axes = spatial_axes(m1)
    t1, t2 = ops.sum(s1, axis=axes, keepdims=True), ops.sum(s2, axis=axes, keepdims=True)
    scale = ops.sqrt(ops.maximum(ops.square(t1) + ops.square(t2), _FLOOR))
    variance = v1 + v2
    return m1 + m2, variance, clip_shared((s1 * t1 + s2 * t2) / scale, variance)


def scale_moments(mean, variance, shared, gate_mean, gate_variance):
    """Moments of a feature map times a per-channel gate `g` (`(batch, channels)`, broadcast
    over the positions: squeeze-and-excitation), the map and the gate taken to be independent:
    `E[x g] = m E[g]`, `Var[x g] = m^2 Var[g] + v E[g^2]` (exact for independent factors). The
    gate is one draw per channel, so it adds a factor shared by the channel's positions,
    `m_p (g - E[g])`, beside the map's own `s_p z E[g]`; the two become one, the projection of
    each unit on its channel's sum (as `add_moments`):
    `s'_p = (m_p T_m Var[g] + s_p T_s E[g^2]) / sqrt(T_m^2 Var[g] + T_s^2 E[g^2])`, `T_m`, `T_s`
    the channel's sums of `m` and `s`. Returns `(mean, variance, shared)`."""
    axes = spatial_axes(mean)
    shape = (-1,) + (1,) * len(axes) + (int(mean.shape[-1]) if mean.shape[-1] is not None else -1,)
    gate_mean, gate_variance = ops.reshape(gate_mean, shape), ops.reshape(ops.maximum(gate_variance, 0.0), shape)
    gate_second = ops.square(gate_mean) + gate_variance
    variance_out = ops.square(mean) * gate_variance + variance * gate_second
    t_m, t_s = ops.sum(mean, axis=axes, keepdims=True), ops.sum(shared, axis=axes, keepdims=True)
    scale = ops.sqrt(ops.maximum(ops.square(t_m) * gate_variance + ops.square(t_s) * gate_second, _FLOOR))
    shared_out = (mean * t_m * gate_variance + shared * t_s * gate_second) / scale
    return mean * gate_mean, variance_out, clip_shared(shared_out, variance_out)


def group_norm_moments(mean, variance, shared, groups, epsilon):
    """Moments of group normalisation, `y = (x - x_bar) / sqrt(s^2 + epsilon)` with `x_bar`,
    `s^2` the mean and (biased) variance of the `n = positions * channels / groups` units of
    each group of channels over every position (`keras.layers.GroupNormalization` before its
    per-channel scale and shift; `groups = channels` is instance normalisation).

    As `moments.layer_norm_moments`, with the group's units correlated through their channels'
    shared factors. Unit `u` of channel `c`, `x_u = m_u + s_u z_c + e_u`:

    * the centring is linear, exact: `x~_u` loads `s_u - S_c / n` on its own channel's factor
      and `-S_c' / n` on each other channel's of the group (`S_c`: the sum of channel `c`'s
      shared components), and its independent part is `e_u - e_bar`;
    * the statistic is taken at its expectation, `S = mean(m~^2) + (sum_c (sum_q s_qc^2 -
      S_c^2 / n) + sum_u Var(e_u - e_bar)) / n`, and the map is linearised about the means:
      `J = r (I - a a^T / n)`, `r = (S + epsilon)^(-1/2)`, `a = r m~`;
    * so a unit's load on factor `c'` becomes `r (lambda_uc' - a_u Lambda_c' / n)`, with
      `Lambda_c' = sum_q a_qc' s_qc'`. The load on its own channel's factor is its shared
      component; the loads on the group's other channels' factors, `O(1 / n)` each, join its
      independent part (as in `layer_norm_moments`); the independent parts map through `J`
      as in `layer_norm_moments`' diagonal rule.

    Exact when the variances vanish (the plain layer's function).

    Args:
        mean, variance, shared: `(batch, *spatial, channels)` (no spatial axis: a vector of
            independent units, shared components 0).
        groups: the number of groups, dividing `channels`.
        epsilon: added to the normaliser, as in Keras.

    Returns:
        `(mean, variance, shared)`, each of the input's shape.
    """
    shape = ops.shape(mean)
    per_group = int(mean.shape[-1]) // groups
    grouped = lambda t: ops.reshape(t, (shape[0], -1, groups, per_group))  # noqa: E731  (batch, positions, G, k)
    m, s = grouped(mean), grouped(shared)
    independent = grouped(independent_variance(variance, shared))
    axes = (1, 3)
    units = ops.cast(ops.shape(m)[1] * per_group, mean.dtype)  # n
    group_sum = lambda t: ops.sum(t, axis=axes, keepdims=True)  # noqa: E731
    centred = m - group_sum(m) / units
    spread = moments.centred_spread(independent, units, group_sum)
    channel_shared = ops.sum(s, axis=1, keepdims=True)  # S_c, (batch, 1, G, k)
    shared_spread = group_sum(ops.square(s)) - ops.sum(ops.square(channel_shared), axis=3, keepdims=True) / units
    statistic = (group_sum(ops.square(centred)) + shared_spread + group_sum(spread)) / units
    rate = ops.rsqrt(statistic + epsilon)
    a = centred * rate
    out = moments.normalised_diagonal(independent, spread, a, rate, units, group_sum)
    loads = ops.sum(a * s, axis=1, keepdims=True)  # Lambda_c
    own = rate * (s - channel_shared / units - a * loads / units)
    channel = lambda t: ops.sum(t, axis=3, keepdims=True)  # noqa: E731
    others = ops.square(rate / units) * (channel(ops.square(channel_shared)) + 2.0 * a * channel(channel_shared * loads)
                                         + ops.square(a) * channel(ops.square(loads))
                                         - ops.square(channel_shared + a * loads))
    variance_out = out + ops.maximum(others, 0.0) + ops.square(own)
    back = lambda t: ops.reshape(t, shape)  # noqa: E731
    return back(a), back(variance_out), back(own)


def group_normalize(x, groups, epsilon, rank):
    """`keras.layers.GroupNormalization`'s normalisation of `x` (channels last, `rank` spatial
    axes before them, any leading axes: samples, batch; before its scale and shift): each group
    of `channels / groups` channels over every position, `(x - mean) / sqrt(var + epsilon)`.
    The sampled form of `group_norm_moments`."""
    shape = ops.shape(x)
    leading = tuple(shape[:len(x.shape) - rank - 1])
    grouped = ops.reshape(x, leading + (-1, groups, int(x.shape[-1]) // groups))
    mean, variance = ops.moments(grouped, axes=(-3, -1), keepdims=True)
    return ops.reshape((grouped - mean) * ops.rsqrt(variance + epsilon), shape)


def pad_moments(mean, variance, shared, pads):
    """Zero padding: the new units are the constant 0 (mean, variance and shared component 0),
    the others unchanged; exact.

    Args:
        mean, variance, shared: `(batch, *spatial, channels)`.
        pads: one `(before, after)` pair of non-negative integers per spatial axis.

    Returns:
        `(mean, variance, shared)` of the padded map.
    """
    spec = [(0, 0)] + [tuple(pair) for pair in pads] + [(0, 0)]
    return tuple(ops.pad(t, spec) for t in (mean, variance, shared))


def crop_moments(mean, variance, shared, crops):
    """Cropping: the units kept are unchanged; exact. `crops`: one `(before, after)` pair per
    spatial axis. Returns `(mean, variance, shared)` of the cropped map."""
    index = (slice(None),) + tuple(slice(before, -after if after else None) for before, after in crops) + (slice(None),)
    return tuple(t[index] for t in (mean, variance, shared))


def upsample(x, size):
    """`x`, whose spatial axes are the `len(size)` axes before its last (channels) axis (a map,
    or samples of one), with every position repeated `size[i]` times along spatial axis `i`:
    `keras.layers.UpSampling*D` (nearest neighbour)."""
    first = len(x.shape) - 1 - len(size)
    for i, times in enumerate(size):
        if times > 1:
            x = ops.repeat(x, times, axis=first + i)
    return x


def upsample_moments(mean, variance, shared, size):
    """Nearest-neighbour upsampling (`upsample`): each copy of a unit keeps its mean, variance
    and shared component (exact per unit; like every position of a map, the copies'
    independent parts are taken as independent). Returns `(mean, variance, shared)`."""
    return upsample(mean, size), upsample(variance, size), upsample(shared, size)


#: `keras.layers.UpSampling2D`'s interpolations other than `"nearest"`: each output unit a
#: fixed weighted sum of neighbouring input units (`interpolation_matrix`).
INTERPOLATIONS = ("bilinear", "bicubic", "lanczos3", "lanczos5")


def interpolation_matrix(length, factor, interpolation, dtype="float32"):
    """The `(length * factor, length)` matrix `A` of Keras' `ops.image.resize` along one axis
    of `length` units upsampled `factor` times: output unit `i` is `sum_j A[i, j] x[j]`. Read
    off Keras' own function (each column is the resized unit vector), so it holds Keras'
    weights on every backend; Keras' 2D resize is separable, one such matrix per axis.
    `length` may be a tensor (a map of unknown size)."""
    basis = ops.reshape(ops.eye(length, dtype=dtype), (length, length, 1, 1))  # (unit vectors, rows, 1, 1)
    resized = ops.image.resize(basis, (length * factor, 1), interpolation=interpolation,
                               data_format="channels_last")
    return ops.cast(ops.transpose(ops.reshape(resized, (length, length * factor))), dtype)


def _along(x, matrix, axis):
    """`x` with its axis `axis` mapped by `matrix` `(out, in)`."""
    moved = ops.moveaxis(x, axis, -1)
    return ops.moveaxis(ops.matmul(moved, ops.transpose(matrix)), -1, axis)


def interpolate(x, size, interpolation, squared=False):
    """`x`, whose spatial axes are the `len(size)` axes before its last (channels) axis (a map,
    or samples of one), upsampled `size[i]` times along spatial axis `i` by Keras'
    `interpolation` (one of `INTERPOLATIONS`): `keras.layers.UpSampling2D(size,
    interpolation=...)`, one `interpolation_matrix` per axis (`squared`: with the squared
    weights, the variances of independent units)."""
    first = len(x.shape) - 1 - len(size)
    for i, factor in enumerate(size):
        if factor > 1:
            matrix = interpolation_matrix(ops.shape(x)[first + i], factor, interpolation, x.dtype)
            x = _along(x, ops.square(matrix) if squared else matrix, first + i)
    return x


def interpolate_moments(mean, variance, shared, size, interpolation):
    """Upsampling by interpolation (`interpolate`): each output unit is a fixed weighted sum
    `sum_j a_j x_j` of neighbouring units, so its mean is `sum_j a_j m_j` and its shared
    component `sum_j a_j s_j` (exact), and its independent part's variance
    `sum_j a_j^2 (v_j - s_j^2)`: exact within the representation, as for average pooling
    (`average_pool_moments`). Neighbouring outputs, which share input units, are taken as
    independent beyond their shared components, as every two positions of a map are.
    Returns `(mean, variance, shared)`."""
    residual = interpolate(independent_variance(variance, shared), size, interpolation, squared=True)
    shared = interpolate(shared, size, interpolation)
    return interpolate(mean, size, interpolation), residual + ops.square(shared), shared


def concatenate_moments(maps):
    """Concatenation along the channel axis of feature maps `[(mean, variance, shared), ...]`
    of the same spatial shape: exact within the representation (each channel keeps its own
    shared factor; factors of different channels are independent). Returns
    `(mean, variance, shared)`."""
    return tuple(ops.concatenate(list(parts), axis=-1) for parts in zip(*maps))


def channel_affine_moments(mean, variance, shared, scale, shift):
    """`y = scale * x + shift` per channel (batch normalisation with fixed statistics):
    `m' = a m + b`, `v' = a^2 v`, `s' = a s`; exact. `scale`, `shift`: `(channels,)`.
    Returns `(mean, variance, shared)`."""
    return mean * scale + shift, variance * ops.square(scale), shared * scale


def sampled_conv(inputs, kernels, bias=None, strides=1, padding="valid", dilation_rate=1, depthwise=False):
    """`conv(h_s, W_s) + b_s` for every sample `s` at once (the Monte Carlo reference and the
    sampling baselines): one grouped convolution with the samples as groups (`depthwise`: one
    depthwise convolution over the samples' channels side by side).

    Args:
        inputs: `(samples, batch, *spatial, in)`.
        kernels: `(samples, *kernel_size, in, filters)`, one kernel per sample, shared by every
            position and example (depthwise: `(samples, *kernel_size, in, multiplier)`).
        bias: `(samples, filters)` or `None`.
        strides: as in `keras.ops.conv`.
        padding: `"valid"` or `"same"`, as in `keras.ops.conv`.
        dilation_rate: as in `keras.ops.conv`.

    Returns:
        `(samples, batch, *out_spatial, filters)`.
    """
    rank = len(kernels.shape) - 3
    samples, channels, filters = kernels.shape[0], kernels.shape[-2], kernels.shape[-1]
    spatial = tuple(range(2, rank + 2))
    x = ops.transpose(inputs, (1,) + spatial + (0, rank + 2))  # (batch, *spatial, samples, in)
    shape = ops.shape(x)
    x = ops.reshape(x, (-1,) + tuple(shape[1:rank + 1]) + (samples * channels,))
    if depthwise:  # input channel s * in + c -> outputs (s * in + c) * multiplier + j
        kernel = ops.transpose(kernels, tuple(range(1, rank + 1)) + (0, rank + 1, rank + 2))  # (*kernel, S, in, mult)
        kernel = ops.reshape(kernel, tuple(kernels.shape[1:rank + 1]) + (samples * channels, filters))
        out = ops.depthwise_conv(x, kernel, strides=strides, padding=padding, data_format="channels_last",
                                 dilation_rate=dilation_rate)
        filters = channels * filters
    else:
        kernel = ops.transpose(kernels, tuple(range(1, rank + 2)) + (0, rank + 2))  # (*kernel, in, samples, filters)
        kernel = ops.reshape(kernel, tuple(kernels.shape[1:rank + 1]) + (channels, samples * filters))
        out = ops.conv(x, kernel, strides=strides, padding=padding, data_format="channels_last",
                       dilation_rate=dilation_rate)
    shape = ops.shape(out)
    out = ops.reshape(out, (-1,) + tuple(shape[1:rank + 1]) + (samples, filters))
    out = ops.transpose(out, (rank + 1, 0) + tuple(range(1, rank + 1)) + (rank + 2,))
    if bias is not None:
        out = out + ops.reshape(bias, (samples, 1) + (1,) * rank + (filters,))
    return out


def sampled_conv_transpose(inputs, kernels, bias=None, strides=1, padding="valid", output_padding=None,
                           dilation_rate=1):
    """`conv_transpose(h_s, W_s) + b_s` for every sample `s` at once (as `sampled_conv`):
    `inputs` `(samples, batch, *spatial, in)`, `kernels` `(samples, *kernel_size, filters, in)`,
    `bias` `(samples, filters)` or `None`; returns `(samples, batch, *out_spatial, filters)`."""
    rank = len(kernels.shape) - 3
    strides = _tuple(strides, rank)
    pads = transpose_pads(tuple(kernels.shape[1:-2]), strides, padding, output_padding, dilation_rate)
    return sampled_conv(dilate(inputs, strides, pads), transposed_kernel(kernels, rank), bias, strides=1,
                        padding="valid", dilation_rate=dilation_rate)
