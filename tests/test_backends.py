"""The layers, losses and priors on Keras' JAX backend.

Runs a cross-section of the suite again in a subprocess with `KERAS_BACKEND=jax`: every
layer end to end, save/load, float64, gradients at the numerical edges, the losses, and the
core global inducing and MCVI tests, with `JAX_ENABLE_X64=1` for the float64 cases (the full
global inducing and MCVI files passed on JAX during development). Tests marked
`tensorflow_only` (graph-mode validation, XLA through `jit_compile`) are skipped there;
`heavy` ones (long trainings) are left out. A second check trains the same network from the
same weights, in the same data order, on both backends (inside the default KL warm-up) and
compares the losses, the `nll` / `kl` logs and the predictions.
"""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _jax_env(x64):
    """The environment of a JAX subprocess, float64 enabled or not."""
    env = dict(os.environ, KERAS_BACKEND="jax", TF_CPP_MIN_LOG_LEVEL="3")
    env.pop("JAX_ENABLE_X64", None)
    if x64:
        env["JAX_ENABLE_X64"] = "1"
    return env


#: The cross-section of the suite that runs again on JAX (`JAX_ENABLE_X64=1`).
JAX_SUITE = [
    # what keras_frames reads off the call stack, pinned on the installed Keras
    "tests/test_keras_frames.py",
    # layers: every layer type end to end, fit, save/load, edge gradients (float64 included)
    "tests/test_layers.py::test_network_gradients_finite_at_edges[float64-relu-paper]",
    "tests/test_layers.py::test_network_gradients_finite_at_edges[float64-heaviside-paper]",
    "tests/test_layers.py::test_network_gradients_finite_at_edges[float32-relu-exact]",
    "tests/test_layers.py::test_trains_with_model_fit_on_packed_outputs",
    "tests/test_layers.py::test_saved_model_predicts_the_same",
    "tests/test_saving.py::test_dvi_files_of_0_1_0_predict_the_same_and_resume_their_schedule",
    # losses and moments at their numerical edges (values and gradients)
    "tests/test_losses.py::test_losses_finite_at_extreme_values",
    "tests/test_priors.py::test_auto_kl_weight_is_n_over_p_for_classifiers[classifier-64]",
    "tests/test_priors.py::test_defaults_state_the_rule_and_the_elbo_stays_one_argument_away",
    "tests/test_moments.py::test_owens_t_gradients_match_closed_form",
    "tests/test_moments.py::test_cross_covariance_finite_values_and_gradients_at_edges",
    "tests/test_moments.py::test_moments_and_slope_gradients_match_finite_differences[relu]",
    # global inducing: maths, Bayesian linear regression, training
    "tests/test_global_inducing.py::test_posterior_moments_match_dense_inverse",
    "tests/test_global_inducing.py::test_float32_round_off_of_the_gram_matrix_does_not_break_the_factor",
    "tests/test_global_inducing.py::test_precision_matrix_jitter_is_four_epsilon_times_the_trace",
    "tests/test_global_inducing.py::test_monte_carlo_kl_averages_to_closed_form",
    "tests/test_global_inducing.py::test_log_gamma_and_gamma_density_match_scipy",
    "tests/test_global_inducing.py::test_scale_prior_kl_averages_to_closed_form",
    "tests/test_global_inducing.py::test_scale_prior_trains_saves_and_loads",
    "tests/test_global_inducing.py::test_top_layer_is_bayesian_linear_regression_on_propagated_features",
    "tests/test_global_inducing.py::test_per_unit_precision_and_classification_train",
    "tests/test_global_inducing_conv.py::test_posterior_is_regression_on_explicit_patches",
    "tests/test_global_inducing_conv.py::test_draws_and_kl_match_the_posterior_by_monte_carlo",
    "tests/test_global_inducing_conv.py::test_network_trains_saves_loads_and_predicts_samples",
    "tests/test_global_inducing_conv.py::test_spatial_iw_density_and_log_ratio_match_scipy",
    "tests/test_global_inducing_conv.py::test_spatial_iw_network_trains_saves_and_loads",
    "tests/test_factorised_to_global.py",
    "tests/test_mcvi.py::test_one_layer_samples_match_the_closed_form",
    # the objective: KL schedule and weight, logs, every kind of model
    "tests/test_training.py",
    # conv layers: first layer exact against Monte Carlo, the MCVI kernels, fit / logs /
    # warm-up / safe-mode round trip
    "tests/test_conv.py::test_first_conv_layer_moments_are_exact[relu-2-kwargs1]",
    "tests/test_conv.py::test_mcvi_conv_samples_match_the_closed_form",
    "tests/test_conv.py::test_max_pair_gradient_matches_finite_differences",
    "tests/test_conv.py::test_shared_component_clip_gradient_matches_finite_differences",
    "tests/test_conv.py::test_max_pool_gradient_matches_finite_differences",
    "tests/test_conv.py::test_max_pair_is_finite_at_the_edges[float64]",
    "tests/test_conv.py::test_trains_saves_and_loads_in_safe_mode",
    "tests/test_conv.py::test_small_cnn_end_to_end_matches_monte_carlo[0.3-28-pre]",
    # zero padding, cropping, concatenation, batch normalisation: maths, network, save / load
    "tests/test_map_layers.py",
    # depthwise convolutions and ReLU6 against Monte Carlo
    "tests/test_conv.py::test_depthwise_network_with_relu6_matches_monte_carlo[0.3]",
    "tests/test_moments.py::test_relu6_moments_match_quadrature_around_both_kinks_and_in_the_tails",
    # TAGI: exactness, the paper's equations, the toy, fit / save / load (stateless steps)
    "tests/test_tagi.py",
    # the TAGI MNIST harness's compiled engine (JAX only): fit's weights, early stopping read off the curves
    "tests/test_tagi_mnist_harness.py::test_compiled_epoch_gives_fits_weights",
    "tests/test_tagi_mnist_harness.py::test_compiled_seeds_read_early_stopping_off_their_curves",
]
JAX_SUITE_TEST = "tests/test_backends.py::test_suite_runs_on_the_jax_backend"
JAX_SUITE_TIMEOUT = 1500  # seconds
#: `(process, log path)` of the JAX run that `conftest.py` started at collection.
JAX_SUITE_KEY = pytest.StashKey()


def start_jax_suite():
    """Starts the JAX cross-section in a subprocess, its output to a file: `(process, path)`.

    `conftest.py` calls this when the test below is collected and moves the test to the end
    of the session, so the JAX run overlaps the rest of the suite (most tests use one core)."""
    import tempfile

    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not heavy", *JAX_SUITE]
    out = tempfile.NamedTemporaryFile(prefix="keras_dvi_jax_suite_", suffix=".log", delete=False)
    process = subprocess.Popen(command, cwd=ROOT, env=_jax_env(x64=True), stdout=out, stderr=subprocess.STDOUT)
    out.close()
    return process, out.name


def test_suite_runs_on_the_jax_backend(request):
    pytest.importorskip("jax")
    started = request.config.stash.get(JAX_SUITE_KEY, None)
    process, path = started if started else start_jax_suite()
    try:
        returncode = process.wait(timeout=JAX_SUITE_TIMEOUT)
    except subprocess.TimeoutExpired:
        process.kill()
        raise
    with open(path) as f:
        output = f.read()
    os.remove(path)
    tail = output[-8000:]
    assert returncode == 0, tail
    assert "passed" in output and " failed" not in output, tail
    print(output.strip().splitlines()[-1])


def _small_network():
    """A network with every moment path (diagonal, full, residual) and the empirical Bayes KL."""
    import keras

    import keras_dvi as kd

    prior = kd.EmpiricalBayesRegularizer(num_train=200, alpha=1.0, beta=10.0)
    model = keras.Sequential([
        keras.Input((1,)),
        kd.DenseDiagDVI(16, "relu", regularizer=prior),
        kd.DenseDVI(16, regularizer=prior),
        kd.SkipDVI("relu", regularizer=prior),
        kd.DenseDVI(2, regularizer=prior),
    ])
    model.compile(keras.optimizers.Adam(1e-2), loss=kd.HeteroscedasticELL())
    return model


def _train(weights):
    """Loads `weights` into the small network, trains 2 epochs on 200 toy points in a fixed
    order, and returns the epoch losses, `nll` and `kl` logs, and the predictions on 20 test
    points."""
    import numpy as np

    from keras_dvi import datasets

    (x, y), (x_test, _) = datasets.load_toy_regression()
    model = _small_network()
    model.load_weights(weights)
    history = model.fit(x[:200], y[:200], epochs=2, batch_size=50, shuffle=False, verbose=0).history
    logs = np.asarray([history["loss"], history["nll"], history["kl"]])
    return logs, np.asarray(model.predict(x_test[:20], verbose=0))


def test_jax_training_follows_tensorflow_step_for_step(tmp_path):
    """The same weights and data order give the same training on both backends: an oracle
    with its own ops and automatic differentiation for every gradient in the layers."""
    pytest.importorskip("jax")
    import keras
    import numpy as np

    if keras.backend.backend() != "tensorflow":
        pytest.skip("the reference run is TensorFlow's")
    keras.utils.set_random_seed(3)
    weights = str(tmp_path / "start.weights.h5")
    _small_network().save_weights(weights)
    losses, predictions = _train(weights)
    out = str(tmp_path / "jax.npz")
    result = subprocess.run([sys.executable, __file__, weights, out], cwd=ROOT,
                            env=_jax_env(x64=False), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    jax_run = np.load(out)
    assert losses[1, 1] < losses[1, 0]  # it trained (nll)
    # The default warm-up is three quarters of the 8 planned steps: (loss - nll) / kl is the mean
    # KL weight of each epoch's 4 steps, (1 + 2 + 3 + 4) / 24, then (5 + 6 + 6 + 6) / 24.
    np.testing.assert_allclose((losses[0] - losses[1]) / losses[2], [10 / 24, 23 / 24], rtol=0.05)
    np.testing.assert_allclose(jax_run["losses"], losses, rtol=1e-4)  # loss, nll and kl
    np.testing.assert_allclose(jax_run["predictions"], predictions, rtol=1e-3, atol=1e-4)


if __name__ == "__main__":  # the JAX side of the test above
    import numpy as np

    sys.path.insert(0, ROOT)
    jax_losses, jax_predictions = _train(sys.argv[1])
    np.savez(sys.argv[2], losses=jax_losses, predictions=jax_predictions)
