"""The global inducing benchmark harnesses: `benchmarks/uci.py --methods facgi dvigi`,
`benchmarks/mnist500.py` (Appendix N) and `benchmarks/gi_resnet.py`, at tiny sizes."""

import json
import os

import numpy as np
import pytest

from benchmarks import gi_resnet, mnist500, uci
from tests.test_uci_harness import folder  # noqa: F401  (the tiny UCI-layout fixture)


def test_uci_factorised_to_global_methods_run_and_cache_apart(folder, tmp_path):  # noqa: F811
    results = str(tmp_path / "results")
    args = ["--data", folder, "--methods", "facgi", "dvigi", "--splits", "0", "--results", results, "--jobs", "1",
            "--gi-steps", "2", "--inducing", "5"]
    summary = uci.main(args)
    assert {s["method"] for s in summary} == {"facgi", "dvigi"} and all(np.isfinite(s["test_ll"]) for s in summary)
    name = os.path.basename(folder)
    with open(os.path.join(results, name, "facgi", "split_0.json")) as f:
        assert json.load(f)["prior"] == "neal"
    uci.main(args[:3] + ["facgi"] + args[5:] + ["--gi-prior", "scale"])
    assert os.path.exists(os.path.join(results, name, "facgi_scale", "split_0.json"))
    with pytest.raises(SystemExit, match="neal or standard"):
        uci.main(args[:3] + ["dvigi"] + args[5:] + ["--gi-prior", "scale"])
    warm = str(tmp_path / "warm")
    uci.main(args[:2] + ["--methods", "dvigi"] + args[5:] + ["--gi-prior", "standard", "--gi-kl-warmup", "1",
                                                            "--results", warm])
    with open(os.path.join(warm, name, "dvigi_standard", "split_0.json")) as f:
        record = json.load(f)
    assert record["prior"] == "standard" and record["kl_warmup"] == 1
    model = uci.build("facgi", 3, 200, uci.make_parser().parse_args(["--gi-prior", "standard"]))
    body = model.layers[1].regularizer
    assert (body.variance, body.per_fan_in) == (1.0, False)
    assert type(model.layers[3].regularizer).__name__ == "StandardPrior"
    # --fac-variance-init: the authors' initial variances v / (fan_in + 1), bias included
    model = uci.build("facgi", 3, 200, uci.make_parser().parse_args(["--fac-variance-init", "1e-3"]))
    assert model.layers[1].kernel_variance_init == pytest.approx(1e-3 / 4)
    assert model.layers[2].bias_variance_init == pytest.approx(1e-3 / 51)


def test_uci_inducing_all_is_every_training_row_and_the_cache_keeps_the_recipe(folder, tmp_path):  # noqa: F811
    """The paper's recipe (every training row an inducing point) is one flag on every data set;
    a cached split made with another recipe is refused, not silently reused."""
    results = str(tmp_path / "results")
    args = ["--data", folder, "--methods", "gi", "--splits", "0", "--results", results, "--jobs", "1",
            "--gi-steps", "2", "--gi-batch", "10000", "--gi-precision", "per_unit"]
    uci.main(args + ["--inducing", "all"])
    with open(os.path.join(results, os.path.basename(folder), "gi_per_unit", "split_0.json")) as f:
        record = json.load(f)
    assert (record["inducing"], record["gi_batch"], record["gi_steps"]) == (25, 25, 2)  # 25 training rows
    assert uci.main(args + ["--inducing", "all"])  # reused
    with pytest.raises(SystemExit, match="'inducing': 25.*'inducing': 10"):
        uci.main(args + ["--inducing", "10"])
    with pytest.raises(SystemExit, match="more than the 25 training rows"):
        uci.main(args + ["--inducing", "26", "--results", str(tmp_path / "other")])
    with pytest.raises(SystemExit):
        uci.make_parser().parse_args(["--inducing", "some"])
    for batch, count in ((10, 10), (10000, 25)):  # `batch`: the batch's rows, every row up to --gi-batch
        assert uci.num_inducing(uci.make_parser().parse_args(["--inducing", "batch", "--gi-batch", str(batch)]), 25) == count
    path = os.path.join(results, os.path.basename(folder), "gi_per_unit", "split_0.json")
    before = os.stat(path).st_mtime_ns
    assert uci.main(args + ["--inducing", "batch"]) and os.stat(path).st_mtime_ns == before  # same 25 points: reused
    del record["inducing"], record["gi_steps"], record["gi_batch"], record["gi_lr"]  # an older record: defaults
    record["num_train"] = 500
    with pytest.raises(SystemExit, match="'inducing': 100, 'gi_steps': 3000"):
        uci._check_recipe(record, "old.json", uci.make_parser().parse_args(args + ["--inducing", "all"]))
    uci._check_recipe(record, "old.json", uci.make_parser().parse_args(["--inducing", "100", "--gi-precision", "per_unit"]))


def test_select_by_elbo_chooses_by_final_loss_never_by_test_score(tmp_path):
    from benchmarks.experiments import select_by_elbo

    # Folder a: lower final_loss on splits 0 and 2, folder b on split 1; b's mean final_loss is lower.
    runs = {"a": [(-1.0, 0.5), (-2.0, 3.0), (-1.5, 0.4)], "b": [(-0.5, 0.6), (-0.2, 0.1), (-3.0, 0.5)]}
    for name, values in runs.items():
        for split, (ll, loss) in enumerate(values + ([(9.0, -9.0)] if name == "a" else [])):  # split 3: a only
            path = tmp_path / name / "energy" / "facgi" / f"split_{split}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"dataset": "energy", "split": split, "test_ll": ll, "final_loss": loss}))
    folders = [str(tmp_path / "a"), str(tmp_path / "b")]
    table = select_by_elbo.paired_splits(folders, "facgi")
    assert list(table["energy"]) == [0, 1, 2]  # split 3 is not in every folder
    chosen = select_by_elbo.choose(table["energy"])
    np.testing.assert_allclose(chosen["per_split"], [-1.0, -0.2, -1.5])
    np.testing.assert_allclose(chosen["per_data_set"], [-0.5, -0.2, -3.0])  # b: mean loss 0.4 against 1.3
    assert list(chosen["picks"]) == [2, 1] and chosen["data_set_pick"] == 1
    assert "| energy | 3 |" in select_by_elbo.main(["--label", "facgi", "--results"] + folders)
    (tmp_path / "b" / "energy" / "facgi" / "split_0.json").write_text(json.dumps({"dataset": "energy", "split": 0,
                                                                                  "test_ll": -1.0}))
    with pytest.raises(SystemExit, match="no final_loss"):
        select_by_elbo.main(["--label", "facgi", "--results"] + folders)


def test_appendix_p_table_marks_cells_within_one_standard_error(tmp_path):
    def cache(method, prior, lls):
        path = tmp_path / "yacht" / uci.cache_label(method, gi_prior=prior)
        path.mkdir(parents=True)
        for split, ll in enumerate(lls):
            record = {"dataset": "yacht", "method": method, "split": split, "test_ll": ll, "test_rmse": 1.0,
                      "seconds": 1.0}
            (path / f"split_{split}.json").write_text(json.dumps(record))

    assert uci.appendix_p_markdown(str(tmp_path)) is None
    cache("gi", "neal", [-0.80, -0.84])  # -0.82 ± 0.02 against the paper's -0.81: met
    cache("gi", "scale", [-1.0, -1.2])  # -1.10 against -0.79: missed
    cache("facgi", "scale", [-0.9, -0.9])
    table = uci.appendix_p_markdown(str(tmp_path))
    row = table.splitlines()[2].split(" | ")
    assert row[1] == "not run (-0.68 ± 0.03)"
    assert row[2] == "**-0.82 ± 0.02** (-0.81 ± 0.03) [2 splits]"
    assert row[3] == "-1.10 ± 0.10 (-0.79 ± 0.02) [2 splits]"
    assert row[7] == "-0.82 (NealPrior) (-0.68, N(0, 1))"
    assert row[8] == "-0.90 (ScalePrior) (-0.97, ScalePrior) |"


@pytest.mark.parametrize("method", mnist500.METHODS)
def test_mnist500_networks_build_with_the_papers_shape(method):
    """Every method is the paper's LeNet-style network: three 64-channel 3x3 convolutions, two
    max pools, a linear layer on the 7x7x64 maps; predictions have the method's layout."""
    model = mnist500.build(method, 500, inducing=4, samples=1)
    x = np.random.default_rng(0).standard_normal((3, 28, 28, 1)).astype("float32")
    out = model.predict(x, verbose=0)
    assert out.shape == ((3, 1, 10) if method.split("-")[0] in ("gi", "mcvi") else (3, 11, 10))
    kernels = [w for w in model.weights if len(w.shape) == 4 and w.shape[:2] == (3, 3)]
    if method.startswith(("dvi", "mcvi")):
        assert [tuple(w.shape[2:]) for w in kernels][::2] == [(1, 64), (64, 64), (64, 64)]  # (means; variances)


def test_mnist500_summary_names_the_baseline():
    record = {"method": "gi-scale", "seed": 0, "steps": 100, "lr": 0.01, "seconds_per_step": 2.0, "final": {"test_ll": -2.1, "accuracy": 0.3},
              "curve": [{"step": 50, "elbo": -3.0, "test_ll": -2.2, "accuracy": 0.2},
                        {"step": 100, "elbo": -2.5, "test_ll": -2.1, "accuracy": 0.3}]}
    text = mnist500.summary_markdown([record])
    assert "| gi-scale | 0.01 | 100 | 0 | -2.500 | -2.100 | 0.300 | -2.100 (100) | 2.00 |" in text and "-2.303" in text


def test_resnet_step_timing_runs_for_every_network(capsys):
    gi_resnet.main(["--batch", "4", "--inducing", "4", "--steps", "1"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "s / step" not in line]
    assert [row.split("|")[1].strip() for row in rows] == ["plain", "mcvi", "gi"]
