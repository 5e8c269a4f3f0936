"""The TAGI MNIST benchmark harness (`benchmarks/tagi_mnist.py`) on small synthetic data."""

import argparse

import numpy as np
import pytest

from benchmarks import tagi_mnist


def test_early_stopping_keeps_the_best_validation_epoch_and_the_first_epoch(monkeypatch):
    rng = np.random.default_rng(0)
    centres = rng.normal(size=(10, 784))
    y = rng.integers(0, 10, 400)
    x = (centres[y] + 2.0 * rng.normal(size=(400, 784))).astype("float32")
    data = (x[:300], y[:300], x[300:], y[300:])
    tests = []
    real = tagi_mnist.evaluate
    monkeypatch.setattr(tagi_mnist, "evaluate", lambda m, a, b: tests.append(len(a)) or real(m, a, b))
    args = argparse.Namespace(forward="linearized", init="xavier", max_epochs=6, patience=2, noises=[0.3])
    record = tagi_mnist.run_seed(100, 10, 0, 0.3, data, args)
    val = record["validation_errors"]
    assert record["num_fit"] == 285 and len(val) == record["epochs_run"] <= 6  # 5% held out
    assert record["best_epoch"] == 1 + int(np.argmin(val))  # the first of equal minima
    stopped_early = record["epochs_run"] < 6
    assert not stopped_early or record["epochs_run"] == record["best_epoch"] + 2
    if record["best_epoch"] == 1:
        assert record["one_epoch_test_error"] == record["test_error"]
    assert 0.0 <= record["test_error"] <= 100.0 and np.isfinite(record["test_nll"])
    assert record["init"] == "xavier"
    # the test rows are scored only at a new best validation epoch
    assert tests.count(100) == len(set(np.minimum.accumulate(val)))
    choice = tagi_mnist.choose_noise(100, 10, data, argparse.Namespace(noises=[0.1, 0.4], forward="linearized", init="he"))
    assert choice["init"] == "he"
    assert choice["observation_noise"] == float(min(choice["validation_error"], key=choice["validation_error"].get))


def test_prior_option_is_parsed_and_refused_at_the_command_line():
    parse = tagi_mnist.make_parser().parse_args
    assert parse([]).init == "xavier" and parse(["--init", "he"]).init == "he" and parse(["--init", "0.25"]).init == 0.25
    with pytest.raises(SystemExit):
        parse(["--init", "kaiming"])
