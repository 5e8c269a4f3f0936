"""How a benchmark publishes its table: printed, and written to `--out` under the command that
made it (so a results file says how to reproduce it)."""

import os
import sys


def report(text, out, module, argv=None):
    """Prints `text` and, if `out` is given, writes it to `out` headed by the command line:
    `python -m <module> <argv>` (`argv` default: the process's arguments), prefixed by
    `KERAS_BACKEND=...` when the run set a backend other than TensorFlow."""
    print(text)
    if out:
        backend = os.environ.get("KERAS_BACKEND", "tensorflow")
        prefix = "" if backend == "tensorflow" else f"KERAS_BACKEND={backend} "
        arguments = " ".join(sys.argv[1:] if argv is None else argv)
        with open(out, "w") as f:
            f.write(f"`{prefix}python -m {module} {arguments}`\n\n{text}\n")
