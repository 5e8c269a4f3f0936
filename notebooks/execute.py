"""Runs the notebooks top to bottom with their full budget and saves them with their outputs.

    python notebooks/execute.py                       # every notebook
    python notebooks/execute.py notebooks/06_*.ipynb  # some

The notebooks are committed with these outputs. The kernel does not capture what native
libraries write to its standard error (TensorFlow's start-up notices), so only the cells' own
output is kept. MNIST is read from `MNIST_NPZ` when set (else `../shared/data/mnist.npz`
beside the repository, else `keras.datasets` downloads it).
"""

import glob
import os
import sys
import time
import uuid

import nbclient
import nbformat

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def execute(path, timeout=7200):
    notebook = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        notebook, timeout=timeout, kernel_name="python3",
        resources={"metadata": {"path": os.path.dirname(os.path.abspath(path))}},
        extra_arguments=["--IPKernelApp.capture_fd_output=False"],
    )
    client.execute()
    for cell in notebook.cells:  # nbformat 4.5 cells carry an id
        cell.setdefault("id", uuid.uuid4().hex[:8])
    nbformat.write(notebook, path)


def main(paths):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    os.environ.setdefault("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    mnist = os.path.join(ROOT, "..", "shared", "data", "mnist.npz")
    if "MNIST_NPZ" not in os.environ and os.path.exists(mnist):
        os.environ["MNIST_NPZ"] = os.path.abspath(mnist)
    os.environ.pop("KERAS_DVI_NOTEBOOK_BUDGET", None)  # the full budget
    for path in paths or sorted(glob.glob(os.path.join(ROOT, "notebooks", "*.ipynb"))):
        start = time.time()
        execute(path)
        print(f"{os.path.basename(path)}: {time.time() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
