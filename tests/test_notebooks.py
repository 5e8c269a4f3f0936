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


def test_every_notebook_is_in_the_documentation():
    with open(os.path.join(ROOT, "mkdocs.yml")) as f:
        site = f.read()
    assert len(NOTEBOOKS) == 8
    for path in NOTEBOOKS:
        assert f"notebooks/{os.path.basename(path)}" in site, path


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
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert "assert" in code[-1].source  # each ends with a check ...
    printed = "".join(o.get("text", "") for o in code[-1].get("outputs", []) if o.get("output_type") == "stream")
    assert "all checks passed" in printed
    assert notebook.cells[-1].cell_type == "markdown" and "What to try next" in notebook.cells[-1].source  # ... and advice


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_committed_notebook_shows_its_full_run(path):
    """Committed with the outputs of the full budget: every code cell ran, in order, the figures
    are in the outputs, no error or log noise was kept, and it opens with what it teaches."""
    nbformat = pytest.importorskip("nbformat")
    notebook = nbformat.read(path, as_version=4)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert [cell.execution_count for cell in code] == list(range(1, len(code) + 1)), "not run top to bottom"
    outputs = [output for cell in code for output in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error" or o.get("name") == "stderr"]
    assert any("image/png" in o.get("data", {}) for o in outputs), "no figure"
    assert "all checks passed" in "".join(o.get("text", "") for o in code[-1].outputs)
    assert "What you will learn" in notebook.cells[0].source
