"""Keras metrics for keras-dvi outputs (plain Keras metrics such as `"mae"` see the packed
tensor, not the prediction): pass these to `model.compile(metrics=[...])`.

Each wraps a function of `keras_dvi.predictive` and averages it over examples like any
`keras.metrics.MeanMetricWrapper`.
"""

import keras
from keras import ops

from keras_dvi import packing, predictive


def _squared_error(y_true, y_pred):
    mean = predictive.regression_moments(y_pred)["mean"]
    y = ops.reshape(ops.cast(y_true, mean.dtype), (-1, mean.shape[-1]))
    return ops.mean(ops.square(y - mean), axis=-1)


def _log_likelihood(y_true, y_pred):
    return predictive.log_predictive_density(y_pred, y_true)


def _accuracy(y_true, y_pred):
    mean, _ = packing.unpack(y_pred)
    classes = mean.shape[-1]
    y_true = ops.convert_to_tensor(y_true)
    if len(y_true.shape) == 2 and y_true.shape[-1] == classes:
        labels = ops.argmax(y_true, axis=-1)
    else:
        labels = ops.reshape(y_true, (-1,))
    predicted = ops.cast(ops.argmax(mean, axis=-1), "int32")
    return ops.cast(predicted == ops.cast(labels, "int32"), "float32")


@keras.saving.register_keras_serializable(package="keras_dvi")
class PredictiveMSE(keras.metrics.MeanMetricWrapper):
    """Mean squared error of the predictive mean of a heteroscedastic regression output.

    `sqrt` of it is the RMSE (in the units of the targets the model was trained on).
    """

    def __init__(self, name="predictive_mse", dtype=None):
        super().__init__(_squared_error, name=name, dtype=dtype)

    def get_config(self):
        return {"name": self.name, "dtype": self.dtype}


@keras.saving.register_keras_serializable(package="keras_dvi")
class PredictiveLogLikelihood(keras.metrics.MeanMetricWrapper):
    """Mean log predictive density of the targets (eq. 9 Gaussian), per example."""

    def __init__(self, name="predictive_log_likelihood", dtype=None):
        super().__init__(_log_likelihood, name=name, dtype=dtype)

    def get_config(self):
        return {"name": self.name, "dtype": self.dtype}


@keras.saving.register_keras_serializable(package="keras_dvi")
class MeanLogitAccuracy(keras.metrics.MeanMetricWrapper):
    """Classification accuracy of the argmax of the mean logits (integer or one-hot labels)."""

    def __init__(self, name="accuracy", dtype=None):
        super().__init__(_accuracy, name=name, dtype=dtype)

    def get_config(self):
        return {"name": self.name, "dtype": self.dtype}
