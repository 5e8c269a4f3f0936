"""The bundled data set and the README's main job."""

import os
import re
import subprocess
import sys

import numpy as np
import pytest
from scipy import stats

from keras_dvi import datasets


def test_toy_regression_data_ships_with_the_package():
    (x_train, y_train), (x_test, y_test) = datasets.load_toy_regression()
    assert x_train.shape == (500, 1) and y_train.shape == (500,)
    assert x_test.shape == (100, 1) and y_test.shape == (100,)
    assert x_train.dtype == np.float32 and np.isfinite(y_train).all()
    assert -0.5 <= x_train.min() and x_train.max() <= 0.5
    # Heteroscedastic: residuals around the true function grow with x.
    resid = y_train - (-(x_train[:, 0] + 0.5) * np.sin(3 * np.pi * x_train[:, 0]))
    assert resid[x_train[:, 0] > 0.25].std() > 3 * resid[x_train[:, 0] < -0.25].std()


def test_main_job_help_answers_before_keras_is_imported():
    """`python -m keras_dvi --help` parses its arguments before Keras or TensorFlow load, so it
    answers at once (-X importtime lists every module imported)."""
    run = subprocess.run([sys.executable, "-X", "importtime", "-m", "keras_dvi", "--help"],
                         capture_output=True, text=True, timeout=120, check=True)
    assert "--data" in run.stdout and "--reference" in run.stdout
    # Every option states its default.
    options = re.split(r"\n  (?=-)", run.stdout.split("options:", 1)[1])[1:]
    assert len(options) == 12, options
    for option in options:
        if not option.startswith("-h"):
            assert "(default:" in option, option
    imported = {line.rsplit("|", 1)[-1].strip() for line in run.stderr.splitlines() if "|" in line}
    assert "json" in imported or "argparse" in imported  # the listing is there
    assert not {"keras", "tensorflow", "jax", "numpy"} & imported


def test_main_job_reads_the_uci_layout(tmp_path):
    rng = np.random.default_rng(0)
    data = rng.normal(size=(40, 4))
    data[:, 3] = data[:, 0] - data[:, 1] + 0.1 * rng.normal(size=40)
    np.savetxt(tmp_path / "data.txt", data)
    np.savetxt(tmp_path / "index_features.txt", [0, 1, 2], fmt="%d")
    np.savetxt(tmp_path / "index_target.txt", [3], fmt="%d")
    np.savetxt(tmp_path / "index_train_0.txt", np.arange(30), fmt="%d")
    np.savetxt(tmp_path / "index_test_0.txt", np.arange(30, 40), fmt="%d")
    from keras_dvi.__main__ import main

    (x_train, y_train), (x_test, y_test) = datasets.load_uci(str(tmp_path), 0)
    assert x_train.shape == (30, 3) and y_test.shape == (10,)
    np.testing.assert_allclose(y_train, data[:30, 3].astype("float32"))
    results = main(["--data", str(tmp_path), "--epochs", "2", "--verbose", "0", "--plot", ""])
    assert np.isfinite(results["test_ll"]) and np.isfinite(results["test_rmse"])


def test_main_job_explains_itself_and_refuses_missing_data(tmp_path, capsys):
    from keras_dvi.__main__ import main

    with pytest.raises(SystemExit, match="is not a folder"):
        main(["--data", str(tmp_path / "nowhere")])
    with pytest.raises(SystemExit, match=r"lacks data\.txt"):
        main(["--data", str(tmp_path)])
    rng = np.random.default_rng(1)
    np.savetxt(tmp_path / "data.txt", rng.normal(size=(30, 3)))
    np.savetxt(tmp_path / "index_features.txt", [0, 1], fmt="%d")
    np.savetxt(tmp_path / "index_target.txt", [2], fmt="%d")
    np.savetxt(tmp_path / "index_train_0.txt", np.arange(24), fmt="%d")
    np.savetxt(tmp_path / "index_test_0.txt", np.arange(24, 30), fmt="%d")
    with pytest.raises(SystemExit, match=r"index_train_3\.txt.*splits available: 0\.\.0"):
        main(["--data", str(tmp_path), "--split", "3"])
    main(["--data", str(tmp_path), "--method", "ddvi", "--epochs", "2", "--plot", ""])
    out = capsys.readouterr().out
    assert "dDVI computes exactly what DVI does" in out
    assert "Epoch 2/2" in out and "━" not in out  # a line per epoch when output is not a terminal


@pytest.mark.heavy
def test_the_wheel_installs_into_a_fresh_environment_and_runs_the_main_job(tmp_path):
    """The README's main job as a user runs it (`pip install .`, then `python -m keras_dvi`, here
    on 30 of its 100 epochs to keep the suite within its budget; its figures at the default
    budget, test log-likelihood 1.01 and RMSE 0.166, are measured in BENCHMARKS.md, "The toy
    problem and the main job"): `pip wheel .` builds a wheel with the licence and the bundled
    data; installed into a fresh virtual environment (its dependencies are this environment's,
    put on its path without this environment's own keras-dvi), it imports from there, not from
    the source tree, and the main job prints its results, writes its plot and beats a constant
    Gaussian by far."""
    import glob
    import site
    import zipfile

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(wheels), root], check=True, capture_output=True, timeout=600)
    (wheel,) = glob.glob(str(wheels / "keras_dvi-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert any(name.endswith("LICENSE") for name in names)
    assert any(name.startswith("keras_dvi/data/") and name.endswith(".csv") for name in names)
    assert not any(name.startswith(("tests/", "benchmarks/")) for name in names)
    env_dir = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True, timeout=300)
    python = str(env_dir / "bin" / "python")
    (env_site,) = glob.glob(str(env_dir / "lib" / "python*" / "site-packages"))
    # (paths listed in a .pth file are appended as they are: the .pth files inside them, such as
    # an editable install of keras-dvi, are not read)
    with open(os.path.join(env_site, "dependencies.pth"), "w") as handle:
        handle.write("\n".join(site.getsitepackages()) + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", "--no-index",
                    wheel], check=True, capture_output=True, timeout=600)
    env = dict(os.environ, MPLBACKEND="Agg")
    for name in ("PYTHONPATH", "TF_CPP_MIN_LOG_LEVEL"):  # (a user's shell sets neither; conftest sets the second)
        env.pop(name, None)
    # Where `python -m keras_dvi` imports the package from: the environment, not the source tree
    # (without reading Keras: a second import of TensorFlow would cost seconds).
    where = subprocess.run([python, "-c", "import importlib.util; print(importlib.util.find_spec('keras_dvi').origin)"],
                           cwd=str(tmp_path), capture_output=True, text=True, timeout=300, env=env)
    assert where.returncode == 0, where.stderr
    assert where.stdout.strip().splitlines()[-1].startswith(env_site)
    (_, y_train), (_, y_test) = datasets.load_toy_regression()
    baseline = stats.norm.logpdf(y_test, y_train.mean(), y_train.std()).mean()
    assert -0.5 < baseline < -0.4  # measured: -0.45
    plot = tmp_path / "toy.png"
    run = subprocess.run([python, "-m", "keras_dvi", "--epochs", "30", "--plot", str(plot)],
                         cwd=str(tmp_path), capture_output=True, text=True, timeout=1200, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout
    assert "trained 30 epochs" in out and "train: log-likelihood" in out
    match = re.search(r"test:  log-likelihood\s+(\S+)\s+RMSE (\S+)", out)
    assert match, out[-2000:]
    test_ll, test_rmse = float(match.group(1)), float(match.group(2))
    assert test_ll > 0.3  # measured after 30 epochs: 0.558 (100 epochs: 1.007; a constant Gaussian: -0.45)
    assert test_rmse < 0.19  # measured after 30 epochs: 0.176 (100 epochs: 0.166; constant prediction: 0.37)
    assert "true mean and noise:" in out and re.search(r"plain Keras network.*log-likelihood\s+-?\d", out)
    assert "moves with the seed" in out  # the reference's figure is not promised
    # No start-up noise: TensorFlow's native notices are dropped, nothing else is written.
    assert "oneDNN" not in run.stderr and "cuda" not in run.stderr, run.stderr[-2000:]
    from matplotlib import image

    png = image.imread(plot)  # an independent reader: a decodable 720x480 PNG, not blank
    assert png.shape[:2] == (480, 720) and png[..., :3].std() > 0.05
