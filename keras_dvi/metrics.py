"""Keras metrics for keras-dvi outputs (plain Keras metrics such as `"mae"` see the packed
tensor, not the prediction): pass these to `model.compile(metrics=[...])`.

Each wraps a function of `keras_dvi.predictive` and averages it over examples like any
`keras.metrics.MeanMetricWrapper` (over examples and positions for a dense prediction, a
feature-map output, as Keras' own metrics score each pixel).
"""

import keras
from keras import ops

from keras_dvi import objective, packing, predictive, validation


def _per_position(function, name, regression):
    """`function(y_true, y_pred)` per example, and for a dense prediction (a feature map
    output, `packing.per_position`) per position `(batch, *spatial)`, as Keras' own metrics
    score each pixel."""

    def wrapped(y_true, y_pred):
        targets = y_pred.shape[-1] // 2 if regression else y_pred.shape[-1]
        y_true, y_pred, restore = packing.per_position(y_true, y_pred, name, targets)
        values = function(y_true, y_pred)
        return values if restore is None else restore(values)

    return wrapped


def _squared_error(y_true, y_pred):
    mean = predictive.regression_moments(y_pred)["mean"]
    y = ops.cast(validation.regression_targets(y_true, mean.shape[-1], "PredictiveMSE"), mean.dtype)
    return ops.mean(ops.square(y - mean), axis=-1)


def _log_likelihood(y_true, y_pred):
    return predictive.log_predictive_density(y_pred, y_true)


def _accuracy(y_true, y_pred):
    mean, _ = packing.unpack(y_pred)
    labels = validation.class_labels(y_true, mean.shape[-1], mean.dtype)  # one-hot, validated
    hits = ops.argmax(mean, axis=-1) == ops.argmax(labels, axis=-1)
    return ops.cast(hits, "float32")


class _PredictiveMetric(keras.metrics.MeanMetricWrapper):
    """Batch mean of a per-example function of `(y_true, packed y_pred)`."""

    fn = None
    default_name = None

    def __init__(self, name=None, dtype=None):
        super().__init__(type(self).fn, name=name or self.default_name, dtype=dtype)

    def update_state(self, y_true, y_pred, sample_weight=None):
        objective.refuse_samples(type(self).__name__, "Its logged `nll` is the sampled loss; score its predictions "
                                 "with keras_dvi.predict(model, x) (the predictive distribution of the samples).")
        return super().update_state(y_true, y_pred, sample_weight)

    def get_config(self):
        return {"name": self.name, "dtype": self.dtype}


@keras.saving.register_keras_serializable(package="keras_dvi")
class PredictiveMSE(_PredictiveMetric):
    """Mean squared error of the predictive mean of a heteroscedastic regression output.

    `sqrt` of it is the RMSE (in the units of the targets the model was trained on).
    """

    fn = staticmethod(_per_position(_squared_error, "PredictiveMSE", regression=True))
    default_name = "predictive_mse"


@keras.saving.register_keras_serializable(package="keras_dvi")
class PredictiveLogLikelihood(_PredictiveMetric):
    """Mean log predictive density of the targets (eq. 9 Gaussian), per example."""

    fn = staticmethod(_per_position(_log_likelihood, "PredictiveLogLikelihood", regression=True))
    default_name = "predictive_log_likelihood"


@keras.saving.register_keras_serializable(package="keras_dvi")
class MeanLogitAccuracy(_PredictiveMetric):
    """Classification accuracy of the argmax of the mean logits (integer or one-hot labels).

    Logged as `mean_logit_accuracy` (`val_mean_logit_accuracy` for validation data), the name
    a callback's `monitor` takes; before 0.1.0 it was logged as `accuracy`."""

    fn = staticmethod(_per_position(_accuracy, "MeanLogitAccuracy", regression=False))
    default_name = "mean_logit_accuracy"
