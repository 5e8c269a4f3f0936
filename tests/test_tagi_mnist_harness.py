"""The TAGI MNIST benchmark harness (`benchmarks/tagi_mnist.py`) on small synthetic data."""

import argparse

import keras
import numpy as np
import pytest
from scipy import stats

import keras_dvi as kd
from benchmarks import tagi_mnist

jax_only = pytest.mark.skipif(keras.backend.backend() != "jax", reason="the compiled engine is JAX's")


def _class_clusters(rows, seed=0):
    """Ten noisy class centres in 784 dimensions: `(x, y)`."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(10, 784))
    y = rng.integers(0, 10, rows)
    return (centres[y] + 2.0 * rng.normal(size=(rows, 784))).astype("float32"), y


def test_early_stopping_keeps_the_best_validation_epoch_and_the_first_epoch(monkeypatch):
    x, y = _class_clusters(400)
    data = (x[:300], y[:300], x[300:], y[300:])
    tests = []
    real = tagi_mnist.evaluate
    monkeypatch.setattr(tagi_mnist, "evaluate", lambda m, a, b: tests.append(len(a)) or real(m, a, b))
    args = argparse.Namespace(forward="linearized", init="xavier", max_epochs=6, patience=2, noises=[0.3],
                              stop_on="error")
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


def test_scores_match_scipy_on_the_tree_observations():
    """`scores`' likelihood is the Gaussian density of each row's path observations (scipy's
    logpdf, node by node), its error and NLL those of `keras_dvi.predict`'s probabilities."""
    x, y = _class_clusters(40)
    model = tagi_mnist.tagi_model(16, 0.3, 0)
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    got = tagi_mnist.scores(model, x, y)
    outputs = np.asarray(model.predict(x, verbose=0), "float64")
    paths = np.asarray(kd.tagi.tree(10)[1])  # (class, node): +-1 on the class's path, 0 off it
    expected = [sum(stats.norm.logpdf(paths[label, node], outputs[i, 0, node], np.sqrt(outputs[i, 1, node] + 0.09))
                    for node in np.flatnonzero(paths[label])) for i, label in enumerate(y)]
    assert got["likelihood"] == pytest.approx(np.mean(expected), rel=1e-5)
    assert (np.abs(paths).sum(1) == 4).all()  # 4 observed nodes a class (10 leaves, depth 4)
    probs = kd.predict(model, x)["probabilities"]
    assert got["error"] == pytest.approx(100.0 * np.mean(probs.argmax(1) != y))
    assert got["nll"] == pytest.approx(-np.mean(np.log(probs[np.arange(40), y])), rel=1e-5)


def test_early_stopping_on_the_validation_likelihood():
    x, y = _class_clusters(300)
    data = (x[:240], y[:240], x[240:], y[240:])
    args = argparse.Namespace(forward="linearized", init="xavier", max_epochs=5, patience=1, stop_on="likelihood")
    record = tagi_mnist.run_seed(16, 10, 0, 0.3, data, args)
    curve = record["validation_criterion"]  # minus the likelihood: lower is better
    assert record["stop_on"] == "likelihood" and len(curve) == len(record["validation_errors"]) == record["epochs_run"]
    assert record["best_epoch"] == 1 + int(np.argmin(curve))
    assert record["epochs_run"] == 5 or record["epochs_run"] == record["best_epoch"] + 1
    assert tagi_mnist.stop_value({"error": 2.0, "likelihood": 0.5}, "likelihood") == -0.5
    assert tagi_mnist.stop_value({"error": 2.0, "likelihood": 0.5}, "error") == 2.0
    assert tagi_mnist.make_parser().parse_args([]).stop_on == "likelihood"


def test_patience_and_best_epoch_on_a_hand_made_curve():
    curve = [3.0, 2.0, 2.5, 2.0, 2.4]
    assert tagi_mnist.best_epoch(curve) == 2  # the first of equal minima
    assert [tagi_mnist.patience_ran_out(curve[:n], 3) for n in range(1, 6)] == [False, False, False, False, True]
    assert tagi_mnist.patience_ran_out(curve[:3], 1) and not tagi_mnist.patience_ran_out(curve[:2], 1)


@jax_only
def test_compiled_epoch_gives_fits_weights():
    """Two runs in one compiled program end where `fit` ends each of them, given the same batches
    in the same order (a smaller last batch included)."""
    x, y = _class_clusters(40)
    rng = np.random.default_rng(1)
    orders = [rng.permutation(40)[:20], rng.permutation(40)[:20]]
    models = [tagi_mnist.tagi_model(16, 0.3, seed) for seed in (0, 1)]
    before = [np.asarray(v.value) for v in models[0].trainable_variables]
    tagi_mnist.CompiledEpochs(models, x, y).run(orders, 3)  # 6 batches of 3, then 2 rows
    for seed, order, model in zip((0, 1), orders, models):
        reference = tagi_mnist.tagi_model(16, 0.3, seed)
        reference.fit(x[order], y[order], batch_size=3, epochs=1, shuffle=False, verbose=0)
        for got, want in zip(model.trainable_variables, reference.trainable_variables):
            np.testing.assert_allclose(np.asarray(got.value), np.asarray(want.value), rtol=1e-5, atol=1e-6)
    moved = max(np.abs(np.asarray(v.value) - b).max() for v, b in zip(models[0].trainable_variables, before))
    assert moved > 1e-2  # the epoch did update the weights


@jax_only
def test_compiled_seeds_read_early_stopping_off_their_curves():
    x, y = _class_clusters(300)
    data = (x, y, *_class_clusters(100, seed=1))
    args = argparse.Namespace(forward="linearized", init="xavier", max_epochs=6, patience=1, stop_on="likelihood")
    records = tagi_mnist.run_seeds_compiled(16, 5, [0, 1], 0.3, data, args)
    assert [r["seed"] for r in records] == [0, 1] and records[0]["num_fit"] == 285
    for r in records:
        full = [-s["likelihood"] for s in r["validation_scores"]]
        run = r["epochs_run"]
        assert r["validation_criterion"] == full[:run] and run <= len(full) <= 6
        assert run == len(full) or (tagi_mnist.patience_ran_out(full[:run], 1)
                                    and not tagi_mnist.patience_ran_out(full[:run - 1], 1))
        assert r["best_epoch"] == 1 + int(np.argmin(full[:run]))
        assert r["test_error"] == r["test_scores"][r["best_epoch"] - 1]["error"]
        assert r["one_epoch_test_error"] == r["test_scores"][0]["error"] and not r["stopped_by_deadline"]
    # the program ran until both seeds had run out of patience (or the budget ran out)
    assert len(records[0]["validation_scores"]) == max(r["epochs_run"] for r in records) or \
        len(records[0]["validation_scores"]) == 6


def test_compiled_engine_refuses_tensorflow():
    if keras.backend.backend() == "jax":
        pytest.skip("runs where the backend is not JAX")
    model = tagi_mnist.tagi_model(16, 0.3, 0)
    with pytest.raises(ValueError, match="KERAS_BACKEND=jax"):
        tagi_mnist.CompiledEpochs([model], np.zeros((4, 784), "float32"), np.zeros(4, int))
