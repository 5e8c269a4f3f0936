"""Checks of input values: clear errors for NaN/inf, negative variances, asymmetric covariances.

Shapes are always checked (they are static). Values are checked whenever they are concrete
(eager calls: `model(x)`, `layer(x)`, `loss(y, y_pred)`), at the cost of one pass over the
inputs. Inside compiled functions (`fit`, `predict`, `evaluate`) values are not concrete;
there, `validate=True` on a layer or loss adds TensorFlow assertions to the graph (a cheap
pass over the inputs per step; TensorFlow backend only).
"""

import keras
import numpy as np
from keras import ops


def _concrete(x):
    """NumPy value of `x` if it is concrete (eager), else `None`."""
    if x is None or isinstance(x, keras.KerasTensor):
        return None
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        if not tf.executing_eagerly() and tf.is_tensor(x):
            return None
    try:
        return np.asarray(ops.convert_to_numpy(x))
    except Exception:  # a symbolic tensor of another backend (a tracer)
        return None


def _fail(message):
    raise ValueError(message)


def check_finite(x, name, validate=False):
    """Raises `ValueError` naming `name` if `x` holds NaN or infinite values."""
    value = _concrete(x)
    if value is not None:
        if not np.isfinite(value).all():
            bad = int(np.size(value) - np.isfinite(value).sum())
            _fail(f"Argument `{name}` contains {bad} NaN or infinite value(s); expected finite numbers.")
        return x
    if validate and keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        return tf.debugging.check_numerics(x, f"Argument `{name}` contains NaN or infinite values")
    return x


def check_moments(mean, second, kind, name="inputs", validate=False):
    """Validates the values of layer inputs `(mean, second)` of structure `kind`.

    `second` is `None`, variances `(batch, K)` or covariances `(batch, K, K)`. Variances
    (and covariance diagonals) must be >= 0 and finite; covariances symmetric (relative
    tolerance 1e-5).
    """
    mean = check_finite(mean, name, validate)
    if second is None:
        return mean, second
    second = check_finite(second, name, validate)
    value = _concrete(second)
    if value is not None:
        variances = np.diagonal(value, axis1=-2, axis2=-1) if value.ndim == 3 else value
        if (variances < 0).any():
            _fail(
                f"Argument `{name}` has negative variances (min {variances.min():.3g}); "
                "expected variances >= 0."
            )
        if value.ndim == 3:
            scale = max(float(np.abs(value).max()), 1e-30)
            asym = float(np.abs(value - np.swapaxes(value, -1, -2)).max())
            if asym > 1e-5 * scale:
                _fail(
                    f"Argument `{name}`: covariance matrices must be symmetric; largest "
                    f"|C - C^T| is {asym:.3g} (relative {asym / scale:.3g})."
                )
        return mean, second
    if validate and keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        variances = ops.diagonal(second, axis1=-2, axis2=-1) if len(second.shape) == 3 else second
        with tf.control_dependencies(
            [tf.debugging.assert_non_negative(variances, message=f"Argument `{name}` has negative variances")]
        ):
            second = tf.identity(second)
    return mean, second


def check_same_batch(y_true, y_pred, message):
    """Raises `ValueError(message)` if `y_pred` has a different batch size than `y_true`
    (checked statically, eagerly, or with a TensorFlow assertion inside compiled steps)."""
    true_rows, pred_rows = y_true.shape[0], y_pred.shape[0]
    if true_rows is not None and pred_rows is not None:
        if true_rows != pred_rows:
            _fail(message + f" (targets: {true_rows} rows, output: {pred_rows} rows)")
        return y_pred
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        with tf.control_dependencies(
            [tf.debugging.assert_equal(tf.shape(y_true)[0], tf.shape(y_pred)[0], message=message)]
        ):
            return tf.identity(y_pred)
    return y_pred
