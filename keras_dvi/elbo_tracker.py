"""`ELBOTracker`: the metric of a keras-dvi network (`nll`, `kl`) and its check for a classifier
collapsed to its prior.

The network's first keras-dvi layer owns it (`keras_dvi.layers.kl_term.KLTerm`), so
`model.metrics` lists it once; the keras-dvi losses update it through the step's hand-off
(`keras_dvi.objective.report_nll`), inside the loss computation, where Keras (under JAX
too) collects metric updates.
"""

import math
import warnings
import weakref

import keras
from keras import ops

from keras_dvi import objective


#: A classifier whose predictions carry less than this share of the information of their own
#: average (`prediction_information`), or whose `nll` is no better than a uniform guess, after
#: the KL warm-up, at two checks in a row, has collapsed to the prior.
COLLAPSE_INFORMATION_SHARE = 0.1


def prediction_information(probabilities):
    """`(information, spread)` of a batch of class probabilities `(batch, C)`: the spread is the
    entropy of the batch's average prediction, `H(mean p)`, and the information the predictions
    carry about their inputs is `H(mean p) - mean H(p)` (the mutual information between the
    input and the predicted class over the batch), in nats. A classifier at its prior predicts
    the same distribution for every input: information 0."""
    probabilities = ops.maximum(probabilities, 1e-12)
    average = ops.mean(probabilities, axis=0)
    spread = -ops.sum(average * ops.log(average))
    own = -ops.sum(probabilities * ops.log(probabilities), axis=-1)
    return spread - ops.mean(own), spread


class HeadRef:
    """A weak reference to a network's first keras-dvi layer, held by its tracker (a plain
    object: Keras does not track it as a sub-layer of the metric)."""

    def __init__(self, layer):
        self.layer = weakref.ref(layer)


class ELBOTracker(keras.metrics.Metric):
    """The metric of a keras-dvi network: running means over steps of `nll` and `kl`.

    `nll` is the negative expected log-likelihood as the loss reports it (its batch mean,
    weighted by `sample_weight` / `class_weight` as the loss is), `kl`
    the sum over layers of `KL / N` (without the warm-up or `kl_weight`), per step. Keras resets
    it at every epoch and `evaluate`, and shows it in the progress bar, the `History` and
    `evaluate`'s results.

    For classifiers it also keeps the running means of `prediction_information` and of
    `log C` and of the unweighted `nll` per example, and checks them whenever Keras reads the
    result outside a compiled function (at the end of every epoch of `fit`, and of `evaluate`):
    a classifier trained past its KL warm-up whose predictions carry almost no information
    about its inputs, or whose `nll` per example is no better than a uniform guess, at two such checks in a row, has collapsed to its prior,
    and a warning says so, with the cause and the fixes.
    """

    #: The running totals, entries of one variable (one variable to create, one update per
    #: step): `nll`, `kl`, steps, and for classifiers the information, the spread, `log C`, the
    #: unweighted `nll` per example and the classified steps. Read and written by name (`INDEX`).
    FIELDS = ("nll", "kl", "steps", "information", "spread", "log_classes", "classified_nll", "classified_steps")
    INDEX = {field: i for i, field in enumerate(FIELDS)}

    def __init__(self, name="elbo", dtype="float32"):
        super().__init__(name=name, dtype=dtype)
        self.totals = self.add_variable(shape=(len(self.FIELDS),), initializer="zeros", name="totals")
        self.collapse_checks = 0  # consecutive checks that found a collapse (Python: read eagerly)

    def update_state(self, nll, kl, probabilities=None, steps=1.0, unweighted=None):
        """Adds a step's `nll` and its `kl`; `probabilities`: a classifier's predicted class
        probabilities `(batch, C)`, and `unweighted` its unweighted mean `nll` per example
        (default: `nll`), for the collapse check, or `None`; `steps` 0 adds the `nll` of a
        further output to the step already counted."""
        step = {"nll": nll, "kl": kl, "steps": steps}
        if probabilities is not None:
            probabilities = ops.stop_gradient(ops.cast(probabilities, "float32"))
            information, spread = prediction_information(probabilities)
            step.update(information=information, spread=spread, log_classes=math.log(int(probabilities.shape[-1])),
                        classified_nll=nll if unweighted is None else unweighted, classified_steps=1.0)
        self.totals.assign_add(ops.stack([ops.cast(step.get(field, 0.0), self.dtype) for field in self.FIELDS]))

    def result(self):
        """`{"nll": ..., "kl": ...}`. Keras reads it at the end of every training or test step,
        after the loss: a step of this network still open then was scored by no keras-dvi loss
        (a warning if it was a training step), and is closed. Read outside a compiled function,
        it also checks a classifier for a collapse to its prior."""
        record = getattr(self, "open_record", None)
        if record is not None:
            self.open_record = None
            if record.open:
                record.close()
                if not record.scored and record.training and not getattr(self, "warned_loss", False):
                    self._warn_no_loss(record.head)
        totals = ops.convert_to_tensor(self.totals)
        steps = ops.maximum(totals[self.INDEX["steps"]], 1.0)
        nll = totals[self.INDEX["nll"]] / steps
        if _executing_eagerly(self.totals):
            self._check_collapse()
        return {"nll": nll, "kl": totals[self.INDEX["kl"]] / steps}

    def _check_collapse(self):
        totals = ops.convert_to_numpy(self.totals).astype("float64")
        steps = float(totals[self.INDEX["classified_steps"]])
        head = getattr(self, "head", None)
        layer = None if head is None else head.layer()
        if steps < 1 or layer is None or getattr(self, "warned_collapse", False):
            return
        if layer.regularizer is None or not layer.kl_term.warmup_done():
            self.collapse_checks = 0
            return
        information, spread, log_classes, nll = (float(totals[self.INDEX[field]]) / steps for field in
                                                 ("information", "spread", "log_classes", "classified_nll"))
        uninformed = information < COLLAPSE_INFORMATION_SHARE * max(spread, 1e-6)
        if not (uninformed or nll >= log_classes - 0.01):
            self.collapse_checks = 0
            return
        self.collapse_checks += 1
        if self.collapse_checks < 2:
            return
        self.warned_collapse = True
        from keras_dvi import priors

        if not getattr(layer.regularizer, "accepts_auto_kl_weight", True):  # a global inducing prior
            fixes = ("Fixes: a global inducing network leaves its prior as its precisions grow, "
                     "so train longer (the paper's learning rate 1e-2 with the Appendix H "
                     "`log_precision_scale`), start from data (`keras_dvi.initialize_from_data`), "
                     "or state a tempered `kl_weight` below 1; ")
        elif getattr(layer.regularizer, "kl_weight", None) == priors.AUTO_KL_WEIGHT:
            fixes = ("Fixes: a Bayesian last layer over plain Keras layers, fewer weights, or more "
                     "data (the KL weight is already the rule of kl_weight='auto'); ")
        else:
            fixes = ("Fixes: a tempered posterior by a stated rule, the priors' default "
                     "`kl_weight='auto'` (KL weight min(1, N / P) for N examples and P weights, "
                     "with `SoftmaxDeltaELL()`, Jankowiak's bound), a Bayesian last layer over "
                     "plain Keras layers, or more data; ")
        warnings.warn(
            f"The classifier whose first keras-dvi layer is {layer.name!r} has collapsed to its "
            f"prior: after the KL warm-up its predictions carry {information:.3f} nats of "
            f"information about its inputs (against {spread:.3f} for the spread of its average "
            f"prediction) and its nll per example is {nll:.3f} (a uniform guess: {log_classes:.3f}). It "
            f"predicts about the same class probabilities for every input. Cause: the KL term "
            f"(weight {layer.kl_term.weight_after_warmup():.3g} after the warm-up) outweighs what the data "
            "can pay for, which happens with many weights per training example (small data sets, "
            "wide networks, short runs): the posterior is pulled back to the prior. "
            + fixes + "`kl_warmup_steps=0` makes this worse (the documentation's classification "
            "guide).",
            UserWarning,
            stacklevel=2,
        )

    def _warn_no_loss(self, head):
        self.warned_loss = True
        warnings.warn(
                f"The network whose first keras-dvi layer is {head!r} trained a step that no "
                "keras-dvi loss scored: its loss reads the packed output (mean and (co)variance "
                "rows, or weight samples) as if it were a prediction, and its `nll` is not "
                "logged. Compile with a keras-dvi loss: "
                "`keras_dvi.HeteroscedasticELL()` (regression) or `keras_dvi.SoftmaxDeltaELL()` "
                "(classification); `SampledHeteroscedasticELL` / `SampledSoftmaxELL` for sampled layers. "
                "(A custom loss that reads the moments with `keras_dvi.unpack` is legitimate.)",
                UserWarning,
                stacklevel=3,
            )

    def reset_state(self):
        self.totals.assign(ops.zeros(self.totals.shape, dtype=self.totals.dtype))


def _executing_eagerly(variable):
    """Whether this code runs eagerly (with concrete values), not traced into a compiled
    function: TensorFlow's executing mode, or a JAX variable's value that is no tracer."""
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        return tf.executing_eagerly()
    return objective.trace_of(ops.convert_to_tensor(variable)) is None
