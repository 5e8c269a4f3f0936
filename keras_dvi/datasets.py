"""Small datasets that ship with keras-dvi (no download), and the reader of the standard UCI
regression splits."""

import importlib.resources
import os

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


#: The files of a data set in the standard UCI layout (Hernandez-Lobato and Adams, 2015), split
#: `K`'s index files aside.
UCI_FILES = ("data.txt", "index_features.txt", "index_target.txt")


def load_uci(folder, split, validation=False, dtype="float32"):
    """Split `split` of a regression data set in the standard UCI layout (the folders of
    Hernandez-Lobato and Adams, 2015, used by Wu et al. and Ober and Aitchison): `data.txt`,
    `index_features.txt`, `index_target.txt`, `index_train_K.txt` and `index_test_K.txt`.

    Args:
        folder: the data set's folder.
        split: the split index `K`.
        validation: if `True`, the training rows are split again (the last 20% of a fixed
            permutation, seeded by `split`, become the evaluation rows) so that choices are made
            without the test rows.
        dtype: dtype of the arrays.

    Returns:
        `(x_train, y_train), (x_test, y_test)`: arrays `(n, features)` and `(n,)`.

    Raises:
        FileNotFoundError: `folder` is not a folder or lacks a file of the layout (the message
            lists the splits that are there).

    Examples:
        >>> (x, y), (x_test, y_test) = keras_dvi.datasets.load_uci("uci/boston", 0)
    """
    needed = [*UCI_FILES, f"index_train_{split}.txt", f"index_test_{split}.txt"]
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"{folder!r} is not a folder (expected the UCI layout: {', '.join(UCI_FILES)}, "
                                "index_train_K.txt, index_test_K.txt).")
    missing = [name for name in needed if not os.path.exists(os.path.join(folder, name))]
    if missing:
        splits = sorted(int(n[12:-4]) for n in os.listdir(folder) if n.startswith("index_train_") and n[12:-4].isdigit())
        raise FileNotFoundError(f"{folder!r} lacks {', '.join(missing)}"
                                + (f" (splits available: {splits[0]}..{splits[-1]})" if splits else "") + ".")

    def ints(name):
        return np.loadtxt(os.path.join(folder, name), dtype=int, ndmin=1)

    data = np.loadtxt(os.path.join(folder, "data.txt"), ndmin=2)
    features, target = ints("index_features.txt"), int(ints("index_target.txt")[0])
    train, test = ints(f"index_train_{split}.txt"), ints(f"index_test_{split}.txt")
    x, y = data[:, features].astype(dtype), data[:, target].astype(dtype)
    if validation:
        train = np.random.default_rng(split).permutation(train)
        cut = int(round(0.8 * len(train)))
        train, test = train[:cut], train[cut:]
    return (x[train], y[train]), (x[test], y[test])
