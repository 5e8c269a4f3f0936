"""`keras_dvi.predict`: what a trained model predicts, as NumPy arrays users can read."""

import numpy as np

from keras_dvi import losses, predictive
from keras_dvi.global_inducing import predict_samples, sampling_layer

REGRESSION, CLASSIFICATION = "regression", "classification"
_TASK_OF_LOSS = {
    losses.HeteroscedasticELL: REGRESSION,
    losses.SampledHeteroscedasticELL: REGRESSION,
    losses.SoftmaxDeltaELL: CLASSIFICATION,
    losses.SampledSoftmaxELL: CLASSIFICATION,
}


def _task(model, task):
    if task is not None:
        if task not in (REGRESSION, CLASSIFICATION):
            raise ValueError(f"Argument `task` must be 'regression' or 'classification'; received {task!r}.")
        return task
    loss = getattr(model, "loss", None)
    for cls, name in _TASK_OF_LOSS.items():
        if isinstance(loss, cls):
            return name
    raise ValueError(
        "keras_dvi.predict could not tell the task from the model's loss "
        f"({type(loss).__name__ if loss is not None else 'not compiled'}): pass "
        "`task='regression'` or `task='classification'`."
    )


def predict(model, x, task=None, level=0.95, num_samples=100, batch_size=None, probability_method="mean"):
    """Predictions of a keras-dvi model, as a dict of NumPy arrays.

    Regression (a `HeteroscedasticELL` / `SampledHeteroscedasticELL` model, in the targets' own units
    when it ends in `TargetScaling`), each `(n, D)`:

    * `mean`, `std` and `variance` of the predictive distribution (eq. 9),
    * `epistemic` and `aleatoric`: the two parts of `variance` (weight uncertainty; noise),
    * `lower`, `upper`: the central interval of probability `level` (Gaussian predictive;
      for sampled models, a Gaussian with the mixture's mean and variance).

    Classification (`SoftmaxDeltaELL` / `SampledSoftmaxELL`):

    * `probabilities` `(n, C)` (`keras_dvi.predictive.class_probabilities` with
      `probability_method`; sampled models: the mean softmax of the samples), `label` `(n,)` the most
      probable class, `entropy` `(n,)` the predictive entropy in nats (high: uncertain or
      out of distribution).

    Args:
        model: a trained keras-dvi model.
        x: inputs (anything `model.predict` takes).
        task: `"regression"` or `"classification"`; `None` reads it from the compiled loss.
        level: probability of the interval (regression).
        num_samples: weight samples per input for models with a sample axis (`DenseMCVI`,
            `GlobalInducingDense`).
        batch_size: as in `model.predict`.
        probability_method: method of `keras_dvi.predictive.class_probabilities` for DVI
            classifiers: `"mean"` (default, calibrated in distribution) or `"probit"` (for
            inputs that may be shifted or out of distribution; BENCHMARKS.md).

    Returns:
        A dict of NumPy arrays, as above.

    Example:

    >>> out = keras_dvi.predict(model, x_test)
    >>> out["mean"], out["std"], out["lower"], out["upper"]
    """
    from keras_dvi.tagi_model import TAGIModel  # (here: tagi_model imports the layers)

    if isinstance(model, TAGIModel):  # its own predictive distribution (fixed noise, the tree)
        return model.predictive(model.predict(x, batch_size=batch_size, verbose=0), level=level)
    task = _task(model, task)
    quantile = predictive.central_quantile(level) if task == REGRESSION else None  # checks `level`
    sampled = sampling_layer(model) is not None
    if sampled:
        y_pred = predict_samples(model, x, num_samples, batch_size=batch_size)
    else:
        y_pred = model.predict(x, batch_size=batch_size, verbose=0)
    if task == CLASSIFICATION:
        if sampled:
            probs = np.asarray(predictive.sampled_class_probabilities(y_pred))
        else:
            probs = np.asarray(predictive.class_probabilities(y_pred, method=probability_method))
        entropy = -np.sum(probs * np.log(probs), axis=-1)
        return {"probabilities": probs, "label": probs.argmax(-1), "entropy": entropy}
    if sampled:
        parts = predictive.sampled_regression_moments(y_pred)
    else:
        parts = predictive.regression_moments(y_pred)
    out = {name: np.asarray(value) for name, value in parts.items()}
    out["std"] = np.sqrt(out["variance"])
    half = quantile * out["std"]
    out["lower"], out["upper"] = out["mean"] - half, out["mean"] + half
    return out

