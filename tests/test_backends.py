"""The layers, losses and priors on Keras' JAX backend.

Runs the layer, validation, loss-edge and global-inducing tests again in a subprocess with
`KERAS_BACKEND=jax` (and `JAX_ENABLE_X64=1` for the float64 cases). Tests marked
`tensorflow_only` (the `nll` / `kl` log entries, `KLWarmup`, graph-mode validation, XLA
through `jit_compile`) are skipped there; `heavy` ones (long trainings) are left out.
"""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_suite_runs_on_the_jax_backend():
    pytest.importorskip("jax")
    env = dict(os.environ, KERAS_BACKEND="jax", JAX_ENABLE_X64="1", TF_CPP_MIN_LOG_LEVEL="3")
    command = [
        sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not heavy",
        "tests/test_layers.py", "tests/test_validation.py", "tests/test_global_inducing.py",
        "tests/test_objective.py::test_losses_finite_at_extreme_values",
        "tests/test_moments.py::test_owens_t_gradients_match_closed_form",
        "tests/test_moments.py::test_cross_covariance_finite_values_and_gradients_at_edges",
    ]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    tail = result.stdout[-6000:] + result.stderr[-2000:]
    assert result.returncode == 0, tail
    assert "passed" in result.stdout and " failed" not in result.stdout, tail
    print(result.stdout.strip().splitlines()[-1])
