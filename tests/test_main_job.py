"""The bundled data set and the README's main job."""

import subprocess
import sys

import numpy as np

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


def test_main_job_runs_and_prints_results():
    out = subprocess.run(
        [sys.executable, "-m", "keras_dvi", "--epochs", "3"],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    ).stdout
    assert "test RMSE" in out
    assert "MC mean" in out
