"""Small datasets that ship with keras-dvi (no download)."""

import importlib.resources

import numpy as np


def load_toy_regression():
    """The 1-D heteroscedastic toy problem of Wu et al. (2019), Figure 3 (500 + 100 points).

    `x ~ U(-0.5, 0.5)`, `y = -(x + 0.5) sin(3 pi x) + 0.45 (x + 0.5)^2 eps`, `eps ~ N(0, 1)`:
    the noise grows with `x`, which a heteroscedastic model should capture.

    Returns:
        `(x_train, y_train), (x_test, y_test)`: float32 arrays of shapes `(500, 1)`, `(500,)`,
        `(100, 1)`, `(100,)`.
    """
    text = importlib.resources.files("keras_dvi").joinpath("data/toy_heteroscedastic.csv").read_text()
    rows = [line.split(",") for line in text.splitlines() if line and not line.startswith(("#", "split"))]
    splits = {}
    for split in ("train", "test"):
        values = np.array([[float(x), float(y)] for s, x, y in rows if s == split], dtype="float32")
        splits[split] = (values[:, :1], values[:, 1])
    return splits["train"], splits["test"]


def toy_regression_truth(x):
    """`(mean, sd)` of `y` given `x` in the toy problem's generating model
    (`load_toy_regression`): `-(x + 0.5) sin(3 pi x)` and `0.45 (x + 0.5)^2`."""
    x = np.asarray(x, dtype="float64")
    return -(x + 0.5) * np.sin(3 * np.pi * x), 0.45 * (x + 0.5) ** 2
