"""The UCI benchmark harness (`benchmarks/uci.py`) on a tiny data set in the UCI layout."""

import json
import math
import os

import keras
import numpy as np
import pytest
from scipy import stats

from benchmarks import uci
from keras_dvi.packing import pack


@pytest.fixture
def folder(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((30, 3)) * [1.0, 10.0, 0.0] + [0.0, 5.0, 2.0]  # a constant column
    y = 100.0 + 20.0 * x[:, :1] + rng.standard_normal((30, 1))
    np.savetxt(tmp_path / "data.txt", np.hstack([y, x]))  # target first, features after
    (tmp_path / "index_features.txt").write_text("1\n2\n3\n")
    (tmp_path / "index_target.txt").write_text("0\n")
    (tmp_path / "n_splits.txt").write_text("2\n")
    for k in range(2):
        perm = np.random.default_rng(k).permutation(30)
        np.savetxt(tmp_path / f"index_train_{k}.txt", perm[:25], fmt="%d")
        np.savetxt(tmp_path / f"index_test_{k}.txt", perm[25:], fmt="%d")
    return str(tmp_path)


def test_load_split_and_normalise_with_training_statistics(folder):
    (x, y), (xt, yt) = uci.load_split(folder, 1)
    data = np.loadtxt(os.path.join(folder, "data.txt"))
    train = np.loadtxt(os.path.join(folder, "index_train_1.txt"), dtype=int)
    np.testing.assert_array_equal(x, data[train, 1:])
    np.testing.assert_array_equal(y, data[train, 0])
    assert xt.shape == (5, 3) and uci.num_splits(folder) == 2
    d = uci.normalise((x, y), (xt, yt))
    np.testing.assert_allclose(d["x"][:, :2].mean(axis=0), 0.0, atol=1e-6)
    np.testing.assert_allclose(d["x"][:, :2].std(axis=0), 1.0, rtol=1e-5)
    np.testing.assert_array_equal(d["x"][:, 2], 0.0)  # zero std counts as 1, no NaN
    assert d["y_mean"] == pytest.approx(y.mean()) and d["y_std"] == pytest.approx(y.std())
    np.testing.assert_allclose(d["y_test"], (yt - y.mean()) / y.std(), rtol=1e-5)


def test_log_likelihood_is_reported_in_original_units(folder):
    d = uci.normalise(*uci.load_split(folder, 0))
    m = np.linspace(-1, 1, 5).astype("float32")
    log_var = np.full(5, -1.0, dtype="float32")
    y_pred = pack(np.stack([m, log_var], axis=1), np.zeros((5, 2), dtype="float32"))  # deterministic
    ll, rmse = uci.score(y_pred, d, sampled=False)
    y_orig = d["y_test"] * d["y_std"] + d["y_mean"]
    mean_orig = m * d["y_std"] + d["y_mean"]
    sd_orig = math.exp(-0.5) * d["y_std"]
    assert ll == pytest.approx(stats.norm(mean_orig, sd_orig).logpdf(y_orig).mean(), rel=1e-5)
    assert rmse == pytest.approx(np.sqrt(np.mean((mean_orig - y_orig) ** 2)), rel=1e-5)
    # Samples all equal to (m, log_var) give the same density.
    samples = np.repeat(np.stack([m, log_var], axis=1)[:, None, :], 3, axis=1)
    assert uci.score(samples, d, sampled=True)[0] == pytest.approx(ll, rel=1e-5)


def test_runs_caches_and_resumes(folder, tmp_path, monkeypatch):
    results = str(tmp_path / "results")
    args = ["--data", folder, "--methods", "dvi", "mcvi", "gi", "--splits", "0", "1", "--results", results,
            "--jobs", "1", "--steps", "3", "--gi-steps", "2", "--inducing", "5", "--mcvi-samples", "2"]
    summary = uci.main(args)
    assert {s["method"] for s in summary} == {"dvi", "mcvi", "gi"}
    assert all(s["splits"] == 2 and np.isfinite(s["test_ll"]) for s in summary)
    cached = os.path.join(results, os.path.basename(folder), "dvi", "split_1.json")
    with open(cached) as f:
        record = json.load(f)
    assert record["split"] == 1 and record["num_train"] == 25
    assert record["kl_warmup"] == 1  # default: a KL ramp over half of the 3 steps
    # Where it ran (its seconds depend on it): the backend and the kind of device.
    assert record["backend"] == keras.backend.backend() and isinstance(record["device"], str) and record["device"]
    # A cache made with another KL warm-up is refused, not mixed in.
    with pytest.raises(SystemExit, match="--kl-warmup 1"):
        uci.main(args + ["--kl-warmup", "0"])
    os.remove(os.path.join(results, os.path.basename(folder), "gi", "split_0.json"))
    calls = []
    real = uci.run_one
    monkeypatch.setattr(uci, "run_one", lambda *a: calls.append(a[1:3]) or real(*a))
    again = uci.main(args)
    assert calls == [("gi", 0)]  # only the missing split is recomputed
    assert [s["test_ll"] for s in again if s["method"] == "dvi"] == [s["test_ll"] for s in summary if s["method"] == "dvi"]
    assert os.path.exists(os.path.join(results, "summary.md"))
    # Per-unit precisions are cached and summarised apart: nothing of the shared run is
    # reused or overwritten.
    with open(os.path.join(results, "summary.md")) as f:
        shared_summary = f.read()
    calls.clear()
    uci.main(args[:3] + ["gi", "--splits", "0"] + args[9:] + ["--gi-precision", "per_unit"])
    assert calls == [("gi", 0)]
    with open(os.path.join(results, os.path.basename(folder), "gi_per_unit", "split_0.json")) as f:
        assert json.load(f)["precision"] == "per_unit"
    with open(os.path.join(results, "summary.md")) as f:
        assert f.read() == shared_summary
    assert os.path.exists(os.path.join(results, "summary_gi_per_unit.md"))
    # A run on another data set and one method keeps everything cached in the summary.
    other = tmp_path / "other"
    other.mkdir()
    for entry in os.listdir(folder):
        if entry.endswith(".txt"):
            (other / entry).write_bytes((tmp_path / entry).read_bytes())
    printed = uci.main(["--data", str(other), "--methods", "dvi"] + args[6:])
    assert [(s["dataset"], s["method"]) for s in printed] == [("other", "dvi")]
    with open(os.path.join(results, "summary.json")) as f:
        rows = {(s["dataset"], s["method"]): s["splits"] for s in json.load(f)}
    name = os.path.basename(folder)
    assert rows == {(name, "dvi"): 2, (name, "mcvi"): 2, (name, "gi"): 2, ("other", "dvi"): 2}
    with open(os.path.join(results, "summary_gi_per_unit.json")) as f:
        assert [(s["dataset"], s["method"], s["splits"]) for s in json.load(f)] == [(name, "gi", 1)]
    # --summary-only needs no --data; without it, --data is required.
    os.remove(os.path.join(results, "summary.json"))
    assert uci.main(["--summary-only", "--results", results]) == []
    with open(os.path.join(results, "summary.json")) as f:
        assert len(json.load(f)) == 4
    with pytest.raises(SystemExit):
        uci.main(["--results", results])


def test_epoch_stream_is_consecutive_fresh_permutations_with_aligned_targets():
    x = np.arange(10.0)[:, None] * [1.0, -1.0]
    y = np.arange(10.0) * 3.0
    xs, ys = uci.epoch_stream(x, y, steps=7, batch=4, seed=0)
    assert xs.shape == (28, 2) and ys.shape == (28,)
    np.testing.assert_array_equal(ys, xs[:, 0] * 3.0)  # rows stay paired
    rows = xs[:, 0].astype(int)
    assert sorted(rows[:10]) == list(range(10)) and sorted(rows[10:20]) == list(range(10))
    assert len(set(rows[20:])) == 8  # the last, partial pass repeats no row
    assert not np.array_equal(rows[:10], rows[10:20])  # a fresh order every pass


@pytest.mark.parametrize("steps_per_execution", [1, 4])
def test_final_loss_is_the_mean_loss_of_the_last_steps(steps_per_execution):
    """`final_loss` against each step's loss computed directly (a frozen model: learning rate 0)."""
    import keras

    rng = np.random.default_rng(0)
    steps, batch, tail = 12, 3, 5
    x = rng.standard_normal((steps * batch, 2)).astype("float32")
    y = (x @ [[1.0], [-2.0]] + 3.0 * rng.standard_normal((steps * batch, 1))).astype("float32")
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1, kernel_initializer="ones")])
    model.compile(keras.optimizers.SGD(0.0), loss="mse", steps_per_execution=steps_per_execution)
    callback = uci.tail_loss_callback(tail)
    model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0, callbacks=[callback])
    per_step = ((x.sum(axis=1, keepdims=True) - y) ** 2).reshape(steps, batch).mean(axis=1)
    # With steps_per_execution 4, the callback sees every 4th step: the tail starts at a step it saw.
    start = steps - tail if steps_per_execution == 1 else 4
    assert callback.result() == pytest.approx(per_step[start:].mean(), rel=1e-5)
    assert abs(per_step[start:].mean() - per_step.mean()) > 1e-2  # the tail differs from the whole run


def test_wide_table_marks_results_within_one_standard_error_of_the_paper():
    summary = [
        {"dataset": "yacht", "method": "dvi", "splits": 20, "test_ll": -0.50, "test_ll_se": 0.04, "published_ll": -0.47},
        {"dataset": "yacht", "method": "mcvi", "splits": 20, "test_ll": -0.75, "test_ll_se": 0.05, "published_ll": -0.68},
        {"dataset": "yacht", "method": "gi", "splits": 2, "test_ll": -0.60, "test_ll_se": 0.01, "published_ll": -0.68},
    ]
    row = uci.wide_markdown(summary, ["dvi", "ddvi", "mcvi", "gi"]).splitlines()[-1]
    cells = [c.strip() for c in row.strip("|").split("|")]
    # -0.50 >= -0.47 - 0.04: met; -0.75 < -0.68 - 0.05: missed; -0.60 beats -0.68.
    assert cells == ["yacht", "**-0.50 ± 0.04** (-0.47)", "", "-0.75 ± 0.05 (-0.68)", "**-0.60 ± 0.01** (-0.68) [2 splits]"]


def test_the_convergence_rule_never_stops_inside_the_warm_up_or_just_after(monkeypatch):
    """`--recipe defaults` stops when the full objective has not improved for 5 checks; while
    the KL weight rises it need not improve, so the rule starts counting after the warm-up.
    With frozen weights (nothing ever improves) the run stops exactly 5 checks after it."""
    import argparse

    import keras

    import keras_dvi as kd

    monkeypatch.setattr(uci, "CHUNK", 4)
    rng = np.random.default_rng(1)
    data = {"x": rng.normal(size=(32, 2)).astype("float32"), "y": rng.normal(size=(32,)).astype("float32")}
    prior = kd.EmpiricalBayesRegularizer(32)
    model = keras.Sequential([keras.Input((2,)), kd.DenseDiagDVI(4, "relu", regularizer=prior),
                              kd.DenseDVI(2, regularizer=prior)])
    model.compile(keras.optimizers.SGD(0.0), loss=kd.HeteroscedasticELL())
    steps, _ = uci.fit_to_convergence(model, data, 8, argparse.Namespace(max_steps=160), seed=0)
    # 40 checks planned: the warm-up is the first 120 steps (30 checks); the rule sees checks
    # 30-35 and stops after 5 without a gain (without the wrapper it would stop after check 6).
    assert float(keras.ops.convert_to_numpy(model.layers[0].kl_warmup_length)) == 120
    assert steps == 35 * 4


def test_tagi_chooses_the_noise_by_cross_validation_on_training_rows_only(folder, tmp_path, monkeypatch):
    """`--methods tagi`: sigma_V is the value with the best 5-fold validation log-likelihood
    on the training rows (the test rows never enter the choice), the record keeps every
    scored value, a grid-only record is refined later without recomputing its grid, and the
    linearised and moment runs are cached apart."""
    monkeypatch.setattr(uci, "TAGI_EPOCHS", 1)
    monkeypatch.setattr(uci, "TAGI_NOISES", (0.1, 1.0))
    monkeypatch.setattr(uci, "TAGI_EXTEND", 1)
    monkeypatch.setattr(uci, "TAGI_PARABOLIC", 1)
    results = str(tmp_path / "results")
    path = os.path.join(results, os.path.basename(folder), "tagi", "split_0.json")
    seen = []
    real = uci.tagi_scores
    monkeypatch.setattr(uci, "tagi_scores", lambda model, x, y, s: seen.append(len(x)) or real(model, x, y, s))
    command = ["--data", folder, "--methods", "tagi", "--splits", "0", "--results", results, "--jobs", "1"]
    uci.main(command + ["--tagi-noise-search", "grid"])
    with open(path) as f:
        record = json.load(f)
    assert set(record["cv_ll"]) == {"0.1", "1.0"} and record["noise_search"] == "grid"
    assert record["observation_noise"] == float(max(record["cv_ll"], key=record["cv_ll"].get))
    assert np.isfinite(record["test_ll"]) and record["forward"] == "linearized"
    assert seen == [5] * 10 + [5]  # 2 noises x 5 folds of the 25 training rows, then the 5 test rows
    seen.clear()
    uci.main(command)  # the default refines the cached grid: only the new values are scored
    with open(path) as f:
        refined = json.load(f)
    new = set(refined["cv_ll"]) - set(record["cv_ll"])
    assert refined["noise_search"] == "refine" and new and len(new) <= uci.TAGI_EXTEND + uci.TAGI_PARABOLIC
    assert all(refined["cv_ll"][k] == record["cv_ll"][k] for k in record["cv_ll"])
    assert refined["observation_noise"] == float(max(refined["cv_ll"], key=refined["cv_ll"].get))
    assert seen == [5] * (5 * len(new)) + [5]
    seen.clear()
    uci.main(command)  # cached now
    assert seen == []
    uci.main(command + ["--tagi-forward", "moments"])
    assert os.path.exists(os.path.join(results, os.path.basename(folder), "tagi_moments", "split_0.json"))
    with pytest.raises(SystemExit, match="tagi-init"):  # another prior is never mixed into the cache
        uci.main(command + ["--tagi-init", "0.25"])
    assert uci.tagi_initialize("0.25") == 0.25 and uci.tagi_initialize("he") == "he"


def _gaussian_score(residual, c=1.3):
    """The cross-validated log-likelihood of fixed residuals of variance `residual` at noise s."""
    return lambda s: c - math.log(s) - residual / (2 * s ** 2)


def test_parabola_vertex_is_exact_on_a_parabola():
    t = [-1.0, 0.5, 2.0]
    assert uci.parabola_vertex(t, [-3.0 * (x - 0.7) ** 2 + 2.0 for x in t]) == pytest.approx(0.7, abs=1e-12)
    assert uci.parabola_vertex(t, [1.0, 2.5, 4.0]) is None  # collinear: no vertex


@pytest.mark.parametrize("best", [0.237, 0.067, 1.1, 0.02, 0.005])
def test_tagi_noise_search_finds_the_best_noise_of_a_gaussian_score(best):
    """On the closed-form score `c - log s - R / (2 s^2)`, best at `sqrt(R)`: inside the grid
    (power's 0.237, yacht's 0.067), past its top (1.1), past its bottom by more than one
    octave (0.02: two extensions) and out of reach (0.005: the search stops at the last
    extension). The refined value is
    within 1/8 octave of the optimum where the optimum is in reach, the grid's choice never
    beats it, at most TAGI_EXTEND + TAGI_PARABOLIC values are added, and scores given in
    `cv` are not recomputed."""
    score = _gaussian_score(best ** 2)
    calls = []

    def evaluate(s):
        calls.append(s)
        return score(s)

    grid_choice = uci.tagi_noise_search(evaluate, search="grid")
    assert calls == list(uci.TAGI_NOISES) and grid_choice == max(uci.TAGI_NOISES, key=score)
    cv = {s: score(s) for s in uci.TAGI_NOISES}
    calls.clear()
    chosen = uci.tagi_noise_search(evaluate, cv)
    assert 1 <= len(calls) <= uci.TAGI_EXTEND + uci.TAGI_PARABOLIC and not set(calls) & set(uci.TAGI_NOISES)
    assert set(cv) == set(uci.TAGI_NOISES) | set(calls) and chosen == max(cv, key=cv.get)
    assert score(chosen) >= score(grid_choice)
    reach = min(uci.TAGI_NOISES) / 2 ** uci.TAGI_EXTEND
    if best >= reach:
        assert abs(math.log2(chosen / best)) < 1 / 8
        assert score(chosen) > score(grid_choice) + 1e-3  # no optimum here sits on a grid point
    else:
        assert chosen == reach


def test_noise_grid_analysis_recovers_a_gaussian_score():
    """`benchmarks/experiments/tagi_noise_grid.py` on cross-validated log-likelihoods made by the closed
    form `c - log s - R / (2 s^2)` on uci.py's grid: the best `sigma_V` is `sqrt(R)`, the gain
    over the chosen grid point is the closed form's, and the check at the third point is 0;
    a curve that is not of that form shows in the check."""
    from benchmarks.experiments import tagi_noise_grid as grid

    c, residual = 1.3, 0.237 ** 2
    cv = {str(s): c - math.log(s) - residual / (2 * s ** 2) for s in uci.TAGI_NOISES}
    chosen = max(uci.TAGI_NOISES, key=lambda s: cv[str(s)])
    assert chosen == 0.2
    row = grid.analyse_split({"cv_ll": cv, "observation_noise": chosen})
    assert row["best"] == pytest.approx(0.237, rel=1e-12)
    assert row["gain"] == pytest.approx(math.log(0.2 / 0.237) + 0.5 * (residual / 0.04 - 1), rel=1e-12)
    assert row["gain"] > 0 and abs(row["check"]) < 1e-12
    refined = dict(cv, **{"0.237": c - math.log(0.237) - residual / (2 * 0.237 ** 2)})  # a refined record
    assert grid.analyse_split({"cv_ll": refined, "observation_noise": 0.237}) == row  # reads the grid's points only
    cv["0.1"] -= 0.5  # the fit itself changes with sigma_V at the third point
    assert grid.analyse_split({"cv_ll": cv, "observation_noise": chosen})["check"] == pytest.approx(0.5)


@pytest.mark.parametrize("noise, guard, acts", [(1.0, "shrink", False), (0.01, "cap", True)])
def test_guard_check_reports_whether_a_guard_acts(folder, tmp_path, noise, guard, acts):
    """`tagi_guard_check.py` trains a split with and without a guard: identical weights where the
    guard never acts (the variance guard, at a large sigma_V), different where it does (the
    cap, at a tiny sigma_V, whose updates are large)."""
    from benchmarks.experiments import tagi_guard_check

    name = os.path.basename(os.path.normpath(folder))
    cache = tmp_path / "results" / name / "tagi"
    cache.mkdir(parents=True)
    (cache / "split_0.json").write_text(json.dumps({"observation_noise": noise}))
    out = tmp_path / "lines.txt"
    tagi_guard_check.main(["--data", folder, "--splits", "0", "--guard", guard, "--results", str(tmp_path / "results"),
                           "--out", str(out)])
    line = out.read_text().strip()
    assert line.startswith(f"{name} split 0 (sigma_V {noise}, test rows)")
    difference = float(line.rsplit(" ", 1)[1])
    assert (difference > 1e-3) if acts else (difference == 0.0)
