"""The layers, losses and priors on Keras' JAX backend.

Runs a cross-section of the suite again in a subprocess with `KERAS_BACKEND=jax`: every
layer end to end, save/load, float64, gradients at the numerical edges, the losses, and the
core global inducing and MCVI tests, with `JAX_ENABLE_X64=1` for the float64 cases (the full
global inducing and MCVI files passed on JAX during development). Tests marked
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
        # layers: every layer type end to end, fit, save/load, edge gradients (float64 included)
        "tests/test_layers.py::test_network_gradients_finite_at_edges[float64-relu-paper]",
        "tests/test_layers.py::test_network_gradients_finite_at_edges[float64-heaviside-paper]",
        "tests/test_layers.py::test_network_gradients_finite_at_edges[float32-relu-exact]",
        "tests/test_layers.py::test_trains_with_model_fit_on_packed_outputs",
        "tests/test_layers.py::test_saved_model_predicts_the_same",
        # losses and moments at their numerical edges (values and gradients)
        "tests/test_objective.py::test_losses_finite_at_extreme_values",
        "tests/test_moments.py::test_owens_t_gradients_match_closed_form",
        "tests/test_moments.py::test_cross_covariance_finite_values_and_gradients_at_edges",
        # global inducing: maths, Bayesian linear regression, training
        "tests/test_global_inducing.py::test_posterior_moments_match_dense_inverse",
        "tests/test_global_inducing.py::test_monte_carlo_kl_averages_to_closed_form",
        "tests/test_global_inducing.py::test_top_layer_is_bayesian_linear_regression_on_propagated_features",
        "tests/test_global_inducing.py::test_per_unit_precision_and_classification_train",
        "tests/test_mcvi.py::test_one_layer_samples_match_the_closed_form",
    ]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    tail = result.stdout[-6000:] + result.stderr[-2000:]
    assert result.returncode == 0, tail
    assert "passed" in result.stdout and " failed" not in result.stdout, tail
    print(result.stdout.strip().splitlines()[-1])
