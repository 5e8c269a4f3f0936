"""TAGI's equations: closed-form, gradient-free updates of the weights' posterior means and
variances, the pure maths behind `keras_dvi.TAGIModel`.

Goulet, Nguyen and Amiri, "Tractable approximate Gaussian inference for Bayesian neural
networks", JMLR 2021. Every function is stateless and written with
`keras.ops`, vectorised over the batch; tests check them against the exact (Kalman) posterior
of a linear-Gaussian model and against a direct NumPy evaluation of the paper's equations
(`tests/test_tagi.py`).

Notation (the paper's, diagonal covariances throughout, as in its experiments): a layer maps
input activations `a` (means `ma`, variances `sa`) to pre-activations `z = a W + b` (means
`mz`, variances `sz`), with independent Gaussian weights (`mw`, `sw`) and biases (`mb`, `sb`).

* **Forward** (eq. 10, diagonal): `mz = ma mw + mb`, `sz = sa (sw + mw^2) + ma^2 sw + sb`
  (the same moments as `DenseDiagDVI`). The activation `a+ = f(z)` is either **linearised**
  at the mean as in the paper (eqs. 11-12: `ma+ = f(mz)`, `sa+ = J^2 sz`, `J = f'(mz)`), or
  given its **exact Gaussian moments** (keras-dvi's `moments.activation_moments`) with
  `J = E[f'(z)]`, which by Stein's lemma makes `Cov(a+, z) = J sz` exact for Gaussian `z`.
* **Output** (eq. 14): observations `y = z_out + v`, `v ~ N(0, sigma_V^2)`. In the delta form
  of the authors' code, `mu_{z|y} = mz + sz dm`, `s_{z|y} = sz + sz^2 ds` with
  `dm = (y - mz) / (sz + sigma_V^2)`, `ds = -1 / (sz + sigma_V^2)` on observed units.
* **Backward** (eqs. 15-16, RTS smoother, diagonal): with `Cov(z_k, z+_i) = J_k sz_k mw_ki`,
  the deltas of a hidden layer are `dm_k = J_k sum_i mw_ki dm+_i`,
  `ds_k = J_k^2 sum_i mw_ki^2 ds+_i`; with `Cov(z+_i, w_ki) = sw_ki ma_k`, the parameters
  get `mw += sw * sum_batch ma dm+`, `sw += sw^2 * sum_batch ma^2 ds+` (biases: `ma = 1`).
  A batch is propagated through one prior and its deltas are summed (the paper's batch rule).
* **Convolutions** (`ConvStep`): every output position is a dense unit on its input patch with
  the shared kernel, so the same equations hold per position: the forward moments are
  convolutions, the deltas go down through the transposed convolution, and a kernel's update
  sums the terms of every position and example (the authors' conv rule). Average pooling,
  global average pooling and flatten are linear maps: means through the map, variances
  through its square, deltas through their adjoints. A network is a list of such steps
  (`DenseStep`, `ConvStep`, `AveragePoolStep`, `GlobalAveragePoolStep`, `FlattenStep`; the
  step of a keras-dvi layer: `keras_dvi.tagi.steps.step_of`), which `forward` and `update` run.

Classification (Appendix C): the classes are leaves of a binary tree of `H = ceil(log2 K)`
levels; each of its internal nodes is one output unit (11 for MNIST's 10 classes), and an
example observes `+1` or `-1` on the `H` nodes of its path (bit 0 or 1 of its class, most
significant first) with noise `sigma_V`. Class probabilities are products over the path of
`Phi(+-mz / sqrt(alpha^2 + sz))`, normalised over the classes (eq. 24).
"""

import math

import keras
import numpy as np
from keras import ops

from keras_dvi.maths import moments

#: Activations TAGI can learn through (Heaviside has no slope to pass deltas down).
ACTIVATIONS = ("linear", "relu", "leaky_relu")

#: Ways to push moments through an activation during TAGI's forward pass.
FORWARD_METHODS = ("linearized", "moments")
#: A variance shrinks by at most this factor in one update (not in the paper: summing a batch's
#: variance reductions computed from one prior can otherwise make a variance negative; the
#: authors' cuTAGI resets such variances to 1e-5, its MATLAB code has no guard).
MAX_SHRINK = 1e-3
#: The paper's `alpha` of the classification probabilities (Appendix C).
TREE_ALPHA = 1.0 / 3.0


def canonical_forward(method):
    if method not in FORWARD_METHODS:
        raise ValueError(
            f"Argument `forward` must be one of {', '.join(repr(m) for m in FORWARD_METHODS)}; "
            f"received forward={method!r}."
        )
    return method


def dense_forward(mean, variance, kernel_mean, kernel_variance, bias_mean=None, bias_variance=None,
                  linear=ops.matmul):
    """Means and variances of `z = a W + b` (eq. 10, diagonal covariances).

    Args:
        mean: `(batch, in)` means of `a` (data: the inputs).
        variance: `(batch, in)` variances of `a`, or `None` (deterministic inputs).
        kernel_mean: `(in, out)` weight means.
        kernel_variance: `(in, out)` weight variances.
        bias_mean: `(out,)` bias means or `None`.
        bias_variance: `(out,)` bias variances or `None`.
        linear: the map `(a, W) -> a W` (`Conv.apply` for a convolution: every position is a
            dense layer on its patch, and the moments are the same sums).

    Returns:
        `(mz, sz)`, each `(batch, out)`.
    """
    mz = linear(mean, kernel_mean)
    sz = linear(ops.square(mean), kernel_variance)
    if variance is not None:
        sz = sz + linear(variance, kernel_variance + ops.square(kernel_mean))
    if bias_mean is not None:
        mz = mz + bias_mean
    if bias_variance is not None:
        sz = sz + bias_variance
    return mz, sz


def _steps(steps):
    """Steps as objects: an activation name stands for a dense layer's step."""
    return [DenseStep(step) if isinstance(step, str) else step for step in steps]


def slope_at_mean(mz, activation):
    """`f'(mz)`, the paper's linearisation (eq. 11)."""
    if activation == "linear":
        return ops.ones_like(mz)
    if activation == "relu":
        return ops.cast(mz > 0, mz.dtype)
    if activation == "leaky_relu":
        return ops.where(mz > 0, ops.ones_like(mz), ops.full_like(mz, moments.LEAKY_SLOPE))
    raise ValueError(f"TAGI supports the activations {ACTIVATIONS}; received {activation!r}.")


def activation_forward(mz, sz, activation, method="linearized"):
    """Moments of `a+ = f(z)` and the slope `J` with `Cov(a+, z) = J sz`.

    `"linearized"` (the paper, eqs. 11-12): `ma+ = f(mz)`, `sa+ = J^2 sz`, `J = f'(mz)`.
    `"moments"`: the exact Gaussian moments of `f(z)` and `J = E[f'(z)]` (Stein's lemma).

    Returns:
        `(ma+, sa+, J)`, each shaped as `mz`.
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"TAGI supports the activations {ACTIVATIONS}; received {activation!r}.")
    if activation == "linear":
        return mz, sz, ops.ones_like(mz)
    if method == "linearized":
        slope = slope_at_mean(mz, activation)
        if activation == "relu":
            mean = ops.relu(mz)
        else:
            mean = mz * slope
        return mean, ops.square(slope) * sz, slope
    return moments.activation_moments_and_slope(mz, sz, activation)


def observation_deltas(mz, sz, y, noise_variance, observed=None):
    """Output deltas `(dm, ds)` of units observed as `y = z + v`, `v ~ N(0, noise_variance)`
    (eq. 14): `dm = (y - mz) / (sz + noise_variance)`, `ds = -1 / (sz + noise_variance)`;
    0 where `observed` (a 0/1 tensor shaped as `mz`) is 0."""
    total = sz + noise_variance
    dm = (y - mz) / total
    ds = -1.0 / total
    if observed is not None:
        dm, ds = dm * observed, ds * observed
    return dm, ds


def _shrink_guard(old, new):
    return ops.maximum(new, MAX_SHRINK * old)


def parameter_update(mean_in, dm_next, ds_next, kernel_mean, kernel_variance, bias_mean=None, bias_variance=None,
                     step=None, max_step=None):
    """The posterior of one layer's parameters after a batch (eq. 16, diagonal), its deltas
    summed over the batch: `mw += sw (ma^T dm+)`, `sw += sw^2 ((ma^2)^T ds+)`; biases alike
    with `ma = 1`. Variances shrink by at most `MAX_SHRINK` per update. For a `ConvStep`
    the sums run over the batch and every output position.

    `max_step` (`None`: no cap, the paper): a mean moves by at most `max_step` of its prior
    standard deviations in one update (the authors' cuTAGI caps its updates the same way, at
    `1 / cap_factor`). The summed terms of one batch all come from one prior; a kernel shared
    by many positions sums hundreds of them and can overshoot.

    Returns:
        `(kernel_mean, kernel_variance, bias_mean, bias_variance)` (the bias entries `None`
        without a bias).
    """
    step = step or DenseStep()

    def move(mean, variance, change):
        if max_step is None:
            return mean + change
        bound = max_step * ops.sqrt(variance)
        return mean + ops.clip(change, -bound, bound)

    mw = move(kernel_mean, kernel_variance, kernel_variance * step.adjoint_kernel(mean_in, dm_next))
    sw = kernel_variance + ops.square(kernel_variance) * step.adjoint_kernel(ops.square(mean_in), ds_next)
    sw = _shrink_guard(kernel_variance, sw)
    if bias_mean is None:
        return mw, sw, None, None
    axes = tuple(range(len(dm_next.shape) - 1))
    mb = move(bias_mean, bias_variance, bias_variance * ops.sum(dm_next, axis=axes))
    sb = _shrink_guard(bias_variance, bias_variance + ops.square(bias_variance) * ops.sum(ds_next, axis=axes))
    return mw, sw, mb, sb


def forward(x, params, steps, method="linearized"):
    """TAGI's forward pass through a chain of layers.

    Args:
        x: `(batch, ...)` deterministic inputs.
        params: per layer with weights `(kernel_mean, kernel_variance, bias_mean, bias_variance)`.
        steps: per layer, its step (`DenseStep`, `ConvStep`,
            `AveragePoolStep`, `GlobalAveragePoolStep`, `FlattenStep`; an activation name, one
            of `ACTIVATIONS`, stands for `DenseStep(activation)`).
        method: one of `FORWARD_METHODS` (hidden activations; see `activation_forward`).

    Returns:
        `(caches, (ma, sa, J))`: per step what the backward pass needs (for a layer with weights
        the `(ma, sa)` it received and the slope `J` of its own activation; for a map its input
        shape), and the last layer's output moments and slope.
    """
    mean, var, slope = x, None, None
    caches, weights = [], iter(params)
    for step in _steps(steps):
        if not step.has_weights:
            caches.append(tuple(mean.shape))
            mean, var = step.forward(mean, var)
            continue
        mw, sw, mb, sb = next(weights)
        mz, sz = dense_forward(mean, var, mw, sw, mb, sb, linear=step.apply)
        caches.append((mean, var))
        mean, var, slope = activation_forward(mz, sz, step.activation, method)
        caches[-1] = caches[-1] + (slope,)
    return caches, (mean, var, slope)


def update(params, caches, steps, dm_out, ds_out, max_step=None):
    """Updates every layer's parameters from the output deltas of a batch (the RTS pass):
    deltas go down with the prior's means, then each layer is updated once.

    Args:
        params: as for `forward`.
        caches: from `forward`.
        steps: as for `forward`.
        dm_out: the mean deltas of the last layer's outputs (after its activation:
            `observation_deltas`).
        ds_out: their variance deltas.
        max_step: `None` or the cap on the means' moves (see `parameter_update`).

    Returns:
        The new `params`.
    """
    steps = _steps(steps)
    params = list(params)
    new = [None] * len(params)
    index = len(params)
    dm, ds = dm_out, ds_out  # deltas of the outputs of the step below the cursor
    for j in range(len(steps) - 1, -1, -1):
        step = steps[j]
        if not step.has_weights:
            dm, ds = step.adjoint(dm, ds, caches[j])
            continue
        index -= 1
        mean_in, _, slope = caches[j]
        dm, ds = dm * slope, ds * ops.square(slope)  # from a = f(z) to z (eq. 15)
        mw, sw, mb, sb = params[index]
        new[index] = parameter_update(mean_in, dm, ds, mw, sw, mb, sb, step=step, max_step=max_step)
        if index:
            dm, ds = step.adjoint_input(dm, mw), step.adjoint_input(ds, ops.square(mw))
    return new


# ---------------------------------------------------------------- classification tree


def tree(classes):
    """The hierarchical output of Appendix C for `classes` classes.

    Returns:
        `(units, paths)`: the number of output units (the tree's internal nodes: 11 for 10
        classes), and a NumPy `(classes, units)` matrix holding `+1` / `-1` where a class
        observes a node (bit 0 / 1 of the class at that level, most significant first) and 0
        elsewhere.
    """
    if isinstance(classes, bool) or not isinstance(classes, int) or classes < 2:
        raise ValueError(f"Argument `classes` must be an integer >= 2; received classes={classes!r}.")
    levels = max(1, math.ceil(math.log2(classes)))
    offsets, units = [], 0
    for level in range(levels):  # nodes at a level: the distinct prefixes of `level` bits
        offsets.append(units)
        units += (classes - 1) // 2 ** (levels - level) + 1
    paths = np.zeros((classes, units))
    for c in range(classes):
        for level in range(levels):
            prefix = c >> (levels - level)
            bit = (c >> (levels - level - 1)) & 1
            paths[c, offsets[level] + prefix] = 1.0 - 2.0 * bit
    return units, paths


def class_probabilities(mz, sz, paths, alpha=TREE_ALPHA):
    """Class probabilities of tree outputs (eq. 24): per class, the product over its path of
    `Phi(+-mz / sqrt(alpha^2 + sz))`, normalised over the classes.

    Args:
        mz: `(batch, units)` output means.
        sz: `(batch, units)` output variances.
        paths: `(classes, units)` from `tree`.

    Returns:
        `(batch, classes)`.
    """
    paths = ops.convert_to_tensor(paths, dtype=mz.dtype)
    z = mz / ops.sqrt(alpha**2 + sz)
    # log Phi(+-z) for every node and sign, summed over each class's path (floored at a normal
    # number of the dtype: a path whose every factor underflows keeps a finite logit).
    tiny = 1e-300 if keras.backend.standardize_dtype(mz.dtype) == "float64" else 1e-30
    log_up = ops.log(ops.maximum(moments.normal_cdf(z), tiny))
    log_down = ops.log(ops.maximum(moments.normal_cdf(-z), tiny))
    up, down = ops.relu(paths), ops.relu(-paths)
    logits = ops.matmul(log_up, ops.transpose(up)) + ops.matmul(log_down, ops.transpose(down))
    return ops.softmax(logits, axis=-1)


def tree_targets(labels, paths):
    """`(y, observed)` `(batch, units)` of integer labels: `+-1` on each label's path, and the
    0/1 mask of the observed nodes."""
    paths = ops.convert_to_tensor(paths, dtype="float32")
    signed = ops.take(paths, ops.cast(labels, "int32"), axis=0)
    return signed, ops.abs(signed)


# ---------------------------------------------------------------- the steps: each layer's linear map


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
