"""The classification benchmark harness (`benchmarks/classification.py`), on a tiny budget."""

import argparse

import numpy as np
import pytest

from benchmarks import classification as cls


def test_scores_and_auroc_by_hand():
    probs = np.array([[0.9, 0.1], [0.8, 0.2], [0.3, 0.7], [0.45, 0.55]])
    labels = np.array([0, 1, 1, 0])
    s = cls.scores(probs, labels)
    assert s["accuracy"] == 0.5
    np.testing.assert_allclose(s["nll"], -np.mean(np.log([0.9, 0.2, 0.7, 0.45])))
    # 15 bins: 0.9 and 0.8 and 0.7 and 0.55 fall in bins 13, 12, 10, 8, one example each.
    np.testing.assert_allclose(s["ece"], (0.1 + 0.8 + 0.3 + 0.55) / 4)
    np.testing.assert_allclose(s["brier"], np.mean([0.02, 1.28, 0.18, 0.605]))
    confident, uniform = np.array([[0.99, 0.01]] * 3), np.array([[0.5, 0.5]] * 3)
    assert cls.auroc(confident, uniform) == 1.0 and cls.auroc(uniform, confident) == 0.0


@pytest.mark.parametrize("dataset", ["digits", "wine"])
def test_splits_are_stratified_and_scaled(dataset):
    x, y, xt, yt = cls.load_split(1, dataset=dataset)
    assert len(xt) == pytest.approx(0.3 * (len(x) + len(xt)), abs=1)
    np.testing.assert_allclose(np.bincount(y) / len(y), np.bincount(yt) / len(yt), atol=0.02)
    if dataset == "digits":
        assert x.min() >= 0 and x.max() <= 1
    else:
        np.testing.assert_allclose(x.mean(0), 0.0, atol=1e-5)
    xv, yv, xe, ye = cls.load_split(1, validation=True, dataset=dataset)
    assert len(xv) + len(xe) == len(x)  # validation rows come from the training rows only


def test_a_run_records_every_evaluation_set(monkeypatch):
    monkeypatch.setattr(cls, "EPOCHS", 1)
    args = argparse.Namespace(validation=True, dataset="digits", kl_weight=None, kl_warmup_steps=None,
                              loss_method=None, prob_method=None)
    record = cls.run_one("dvi", 0, args)
    for key in ["clean", "rotate_15", "rotate_60", "noise_0.4", "auroc_uniform", "auroc_digits_5_9"]:
        assert key in record, key
    assert set(record["by_prob_method"]) == {"mean", "probit", "mc", "delta"}
    from keras_dvi.priors import DEFAULT_KL_WARMUP_STEPS

    assert record["recipe"] == "dvi_validation"  # the library's defaults: nothing in the label
    assert record["config"]["prior"]["kl_warmup_steps"] == DEFAULT_KL_WARMUP_STEPS
    args.dataset = "wine"
    record = cls.run_one("mlp", 0, args)
    assert record["recipe"] == "wine/mlp_validation" and 0.0 <= record["clean"]["accuracy"] <= 1.0
