"""The benchmarks' result cache: one JSON record per run, written atomically, so an
interrupted benchmark resumes where it stopped."""

import glob
import json
import os


def cached(path, compute, announce=None):
    """The record at `path`; computed by `compute()` and written there first if absent.
    `announce(record)` returns a line to print for a fresh record."""
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    record = compute()
    write(path, record)
    if announce is not None:
        print(announce(record), flush=True)
    return record


def write(path, record):
    """Writes `record` to `path` as JSON atomically: a run counts as done only once its record
    is fully written."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)


def device():
    """Where a record is computed (its seconds depend on it; its scores should not): JAX's
    device kind (`'cpu'`, `'NVIDIA H200'`, ...); under TensorFlow `'gpu'` or `'cpu'`."""
    import keras

    if keras.backend.backend() == "jax":
        import jax

        return str(jax.devices()[0].device_kind)
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        return "gpu" if tf.config.list_logical_devices("GPU") else "cpu"
    return keras.backend.backend()


def summarise(folder, pattern, summary_markdown):
    """Reads every record of `folder` matching `pattern`, writes `summary_markdown(records)` to
    `folder/summary.md`, prints and returns it."""
    records = []
    for path in sorted(glob.glob(os.path.join(folder, pattern))):
        with open(path) as f:
            records.append(json.load(f))
    text = summary_markdown(records)
    with open(os.path.join(folder, "summary.md"), "w") as f:
        f.write(text + "\n")
    print(text)
    return records
