"""Every notebook in `notebooks/` runs top to bottom (small budget) and passes its final check.

Executed with nbclient on a fresh Python kernel, with `KERAS_DVI_NOTEBOOK_BUDGET=small` (fewer
epochs and samples; each notebook reads it) and the working directory set to a temporary
folder, so a notebook cannot depend on local files.
"""

import glob
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = sorted(glob.glob(os.path.join(ROOT, "notebooks", "*.ipynb")))


def test_every_notebook_is_listed_in_the_readme():
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    assert len(NOTEBOOKS) == 7
    for path in NOTEBOOKS:
        assert f"notebooks/{os.path.basename(path)}" in readme, path


@pytest.mark.heavy
@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_runs(path, tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    monkeypatch.setenv("KERAS_DVI_NOTEBOOK_BUDGET", "small")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "3")
    mnist = os.path.join(ROOT, "..", "shared", "data", "mnist.npz")  # CI and development machines are offline
    if os.path.exists(mnist):
        monkeypatch.setenv("MNIST_NPZ", os.path.abspath(mnist))
    notebook = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()  # raises CellExecutionError, with the cell and traceback, on failure
    last = notebook.cells[-1]
    assert last.cell_type == "code" and "assert" in last.source  # each ends with a check
    printed = "".join(o.get("text", "") for o in last.get("outputs", []) if o.get("output_type") == "stream")
    assert "all checks passed" in printed
