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


#: XLA without LLVM's optimisation passes, for the JAX subprocesses: their compiled steps are
#: small and run a few times, so compiling cost more than running (the JAX cross-section took
#: a fifth less CPU time). XLA builds the same program; only the machine code it emits for it is
#: left unoptimised. (Not for the TensorFlow processes: Keras runs TensorFlow's grouped
#: convolutions through XLA even eagerly, and unoptimised they ran 20 times slower.) The
#: benchmarks run at XLA's defaults.
FAST_COMPILE = "--xla_backend_optimization_level=0"


def jax_env(x64):
    """The environment of a JAX subprocess, float64 enabled or not."""
    env = dict(os.environ, KERAS_BACKEND="jax", TF_CPP_MIN_LOG_LEVEL="3")
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {FAST_COMPILE}".strip()
    env.pop("JAX_ENABLE_X64", None)
    if x64:
        env["JAX_ENABLE_X64"] = "1"
    return env


#: The cross-section of the suite that runs again on JAX (`JAX_ENABLE_X64=1`): one test of each
#: path that differs between backends (tracing, gradients, the objective's hand-off, saving,
#: float64), not every case of each (those are backend-independent `keras.ops` maths, and the
#: whole suite on JAX would double the test time).
JAX_SUITE = [
    # what keras_frames reads off the call stack, pinned on the installed Keras
    "tests/test_keras_frames.py",
    # dense layers: every moment path end to end, fit, save/load, edge gradients (float64 included)
    "tests/test_layers.py::test_network_gradients_finite_at_edges[float64-relu-paper]",
    "tests/test_layers.py::test_trains_with_model_fit_on_packed_outputs",
    "tests/test_layers.py::test_saved_model_predicts_the_same",
    "tests/test_saving.py::test_dvi_files_of_0_1_0_predict_the_same_and_resume_their_schedule",
    # losses and moments at their numerical edges (values and gradients)
    "tests/test_losses.py::test_losses_finite_at_extreme_values",
    "tests/test_priors.py::test_auto_kl_weight_is_n_over_p_for_classifiers[classifier-64]",
    "tests/test_moments.py::test_owens_t_gradients_match_closed_form",
    "tests/test_moments.py::test_float32_erfc_and_arcsin_match_scipy_and_numpy",
    "tests/test_moments.py::test_cross_covariance_finite_values_and_gradients_at_edges",
    "tests/test_moments.py::test_moments_and_slope_gradients_match_finite_differences[relu]",
    "tests/test_moments.py::test_relu6_moments_match_quadrature_around_both_kinks_and_in_the_tails",
    "tests/test_moments.py::test_smooth_activations_are_finite_at_the_edges_and_deterministic_in_the_limit",
    "tests/test_moments.py::test_hard_silu_moments_match_quadrature_across_both_kinks_and_in_the_tails",
    # global inducing: maths, Bayesian linear regression, training (dense; the conv layer's draws and KL)
    "tests/test_global_inducing.py::test_posterior_moments_match_dense_inverse",
    "tests/test_global_inducing.py::test_float32_round_off_of_the_gram_matrix_does_not_break_the_factor",
    "tests/test_global_inducing.py::test_monte_carlo_kl_averages_to_closed_form",
    "tests/test_global_inducing.py::test_log_gamma_and_gamma_density_match_scipy",
    "tests/test_global_inducing.py::test_scale_prior_trains_saves_and_loads",
    "tests/test_global_inducing.py::test_top_layer_is_bayesian_linear_regression_on_propagated_features",
    "tests/test_global_inducing_conv.py::test_draws_and_kl_match_the_posterior_by_monte_carlo",
    "tests/test_global_inducing_conv.py::test_spatial_iw_density_and_log_ratio_match_scipy",
    "tests/test_mcvi.py::test_one_layer_samples_match_the_closed_form",
    # the objective: KL schedule and weight, logs, every kind of model, misuse
    "tests/test_training.py::test_kl_warmup_ramps_by_training_step_and_evaluation_uses_the_full_weight",
    "tests/test_training.py::test_every_way_of_writing_a_model_trains_the_same",
    "tests/test_training.py::test_a_model_with_several_outputs_logs_the_nll_of_every_output",
    "tests/test_training.py::test_sample_and_class_weights_weigh_the_logged_nll_as_they_weigh_the_loss",
    "tests/test_training.py::test_a_shared_layer_counts_its_kl_once_and_steps_its_warm_up_once",
    "tests/test_training.py::test_branches_on_several_inputs_log_one_nll_and_kl",
    "tests/test_training.py::test_heads_of_separate_outputs_on_the_same_data_log_one_nll_and_kl",
    "tests/test_training.py::test_an_explicit_training_false_is_respected",
    "tests/test_training.py::test_the_auto_warm_up_ends_on_the_objective_kl_weight_asks_for[10-6]",
    "tests/test_training.py::test_the_schedule_resumes_after_saving",
    "tests/test_training.py::test_a_custom_loss_that_scores_no_keras_dvi_loss_warns_once[False]",
    "tests/test_training.py::test_plain_layers_between_keras_dvi_layers_of_a_subclassed_model_warn",
    "tests/test_training.py::test_no_keras_dvi_module_holds_state",
    # conv layers: first layer exact against Monte Carlo, the MCVI kernels, the max pooling's
    # custom gradient, fit / logs / warm-up / safe-mode round trip
    "tests/test_conv.py::test_first_conv_layer_moments_are_exact[relu-2-kwargs1]",
    "tests/test_conv.py::test_mcvi_conv_samples_match_the_closed_form",
    "tests/test_conv.py::test_max_pool_gradient_matches_finite_differences[overlapping]",
    "tests/test_conv.py::test_global_max_pool_gradient_matches_finite_differences",
    "tests/test_conv.py::test_max_pair_is_finite_at_the_edges[float64]",
    "tests/test_conv.py::test_trains_saves_and_loads_in_safe_mode",
    # dense prediction: the transposed convolution against Monte Carlo (its sampled form through
    # the backend's convolutions), per-pixel losses in fit, a converted decoder's folding
    "tests/test_dense_prediction.py::test_first_transposed_conv_layer_moments_are_exact[relu-2-kwargs1]",
    "tests/test_dense_prediction.py::test_binary_segmentation_and_per_pixel_regression_convert",
    # interpolated upsampling: the weights read off the backend's own resize
    "tests/test_dense_prediction.py::test_interpolated_upsampling_is_keras_upsampling_on_data_and_on_samples[lanczos3]",
    # volumes: the window sums (Keras' depthwise convolution has no 3D form), a strided 3D
    # convolution's moments against the backend's grouped 3D convolutions
    "tests/test_volumes.py::test_window_sums_of_volumes_are_convolutions_with_ones",
    "tests/test_volumes.py::test_first_volume_layer_moments_are_exact[strided]",
    # group normalisation: the delta method against finite differences (float64), edges and misuse
    "tests/test_group_normalization.py::test_near_deterministic_inputs_give_the_linearised_plain_function[2]",
    "tests/test_group_normalization.py::test_channels_first_config_edges_and_misuse",
    # attention: the plain function against Keras' layer, the moments against Monte Carlo, convert
    "tests/test_attention.py::test_attend_is_keras_multi_head_attention[False-causal]",
    "tests/test_attention.py::test_convert_transformer_is_the_plain_function_at_tiny_variances[True]",
    # a Vision Transformer's tokens: the reshape, the class token and position embedding recognised
    # on a probe, the head's `keras.ops.take` of the class token
    "tests/test_vision_transformer.py::test_convert_vision_transformer_with_a_class_token[concatenate-take]",
    # layer normalisation: gradients at the edges (its data formats, fit and save are
    # backend-independent layer code, run on TensorFlow)
    "tests/test_layer_normalization.py::test_edges_are_finite_with_finite_gradients",
    # sums and joins of vectors (full covariances, data, several inputs) against Monte Carlo
    "tests/test_vectors.py::test_networks_of_independent_branches_match_monte_carlo_over_the_weights[full]",
    # deployment: jax2tf's SavedModel and TFLite's builtin operations (full covariances; a converted
    # MobileNet block: depthwise convolution, batch normalisation, ReLU6, max pooling; the other
    # networks' operations are the same `keras.ops` on both backends, exported through TensorFlow)
    "tests/test_conversion.py::test_networks_export_and_convert_to_tflite_builtins[dense]",
    "tests/test_conversion.py::test_networks_export_and_convert_to_tflite_builtins[mobilenet]",
    # (converted networks - folded batch normalisation, Add, ReLU, pooling, a softmax head - train
    # on JAX in test_distribution.py's DataParallel test; their activations' moments are the
    # backend-independent maths of test_moments.py, whose edge cases run here)
    # TAGI: exactness, the paper's equations, fit / save / load (stateless steps)
    "tests/test_tagi.py::test_linear_layer_update_is_the_exact_posterior",
    "tests/test_tagi.py::test_update_matches_the_papers_equations",
    "tests/test_tagi.py::test_fit_evaluate_predict_save_and_load",
    "tests/test_tagi.py::test_variances_stay_positive_with_large_batches",
    "tests/test_tagi.py::test_sample_and_class_weights_are_refused_not_ignored",
    # the TAGI MNIST harness's compiled engine (JAX only): fit's weights, early stopping read off the curves
    "tests/test_tagi_mnist_harness.py::test_compiled_epoch_gives_fits_weights",
    "tests/test_tagi_mnist_harness.py::test_compiled_seeds_read_early_stopping_off_their_curves",
]
JAX_SUITE_TEST = "tests/test_backends.py::test_suite_runs_on_the_jax_backend"
JAX_SUITE_TIMEOUT = 1500  # seconds
#: `(process, folder)` of the JAX run that `conftest.py` started at collection.
JAX_SUITE_KEY = pytest.StashKey()
#: The key of `config.workerinput` naming the run's folder when pytest-xdist's workers run the
#: suite (the controller starts the run; a worker's test waits for it).
JAX_SUITE_WORKERINPUT = "keras_dvi_jax_suite"

#: Runs the command `argv[2:]`, its output to `argv[1]/log`, then writes its exit code to
#: `argv[1]/returncode`: the test waits for that file, from any process.
_RUNNER = ("import subprocess, sys; log = open(sys.argv[1] + '/log', 'w'); "
           "code = subprocess.call(sys.argv[2:], stdout=log, stderr=subprocess.STDOUT); "
           "open(sys.argv[1] + '/returncode.part', 'w').write(str(code)); "
           "import os; os.replace(sys.argv[1] + '/returncode.part', sys.argv[1] + '/returncode')")


def start_jax_suite(folder):
    """Starts the JAX cross-section in a subprocess (its own process group) that writes its
    output and exit code into `folder`; returns the process.

    `conftest.py` calls this when the test below is collected and moves the test to the end
    of the session, so the JAX run overlaps the rest of the suite."""
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
               "--durations=15", "-m", "not heavy", *JAX_SUITE]
    return subprocess.Popen([sys.executable, "-c", _RUNNER, folder, *command], cwd=ROOT,
                            env=jax_env(x64=True), start_new_session=True)


def stop_jax_suite(process, folder):
    """Stops a run still going when the session ends (the test was deselected at run time, or
    the session was interrupted) and removes its folder."""
    import shutil
    import signal

    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    shutil.rmtree(folder, ignore_errors=True)


def test_suite_runs_on_the_jax_backend(request):
    import tempfile
    import time

    pytest.importorskip("jax")
    workerinput = getattr(request.config, "workerinput", {})
    if JAX_SUITE_WORKERINPUT in workerinput:
        folder = workerinput[JAX_SUITE_WORKERINPUT]
    else:
        started = request.config.stash.get(JAX_SUITE_KEY, None)
        if started is None:  # (run on its own, without conftest's early start)
            folder = tempfile.mkdtemp(prefix="keras_dvi_jax_suite_")
            started = request.config.stash[JAX_SUITE_KEY] = (start_jax_suite(folder), folder)
        folder = started[1]
    deadline = time.monotonic() + JAX_SUITE_TIMEOUT
    returncode_path = os.path.join(folder, "returncode")
    while not os.path.exists(returncode_path):
        assert time.monotonic() < deadline, f"the JAX run did not finish in {JAX_SUITE_TIMEOUT} s"
        time.sleep(2)
    with open(returncode_path) as f:
        returncode = int(f.read())
    with open(os.path.join(folder, "log")) as f:
        output = f.read()
    tail = output[-8000:]
    assert returncode == 0, tail
    assert "passed" in output and " failed" not in output, tail
    print(output[output.find("slowest"):] if "slowest" in output else output.strip().splitlines()[-1])


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
    with its own ops and automatic differentiation for every gradient in the layers. The JAX
    side runs in float32 alone, as JAX does by default, and no keras-dvi call there warns
    (`convert` and `predict` asked for float64 tensors, which JAX truncates with a warning)."""
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
                            env=jax_env(x64=False), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    jax_run = np.load(out)
    assert losses[1, 1] < losses[1, 0]  # it trained (nll)
    # The default warm-up is three quarters of the 8 planned steps: (loss - nll) / kl is the mean
    # KL weight of each epoch's 4 steps, (1 + 2 + 3 + 4) / 24, then (5 + 6 + 6 + 6) / 24.
    np.testing.assert_allclose((losses[0] - losses[1]) / losses[2], [10 / 24, 23 / 24], rtol=0.05)
    np.testing.assert_allclose(jax_run["losses"], losses, rtol=1e-4)  # loss, nll and kl
    np.testing.assert_allclose(jax_run["predictions"], predictions, rtol=1e-3, atol=1e-4)
    # JAX's default float32 (no x64) warns of every float64 tensor asked for: none from keras-dvi
    assert list(jax_run["warnings"]) == []


def _convert_and_predict():
    """What a user calls besides `fit`: `convert` (which sets every layer's posterior) and
    `predict` with an interval, on the small network and a plain CNN."""
    import keras
    import numpy as np

    import keras_dvi as kd
    from keras_dvi import datasets

    (x, _), _ = datasets.load_toy_regression()
    kd.predict(_small_network(), x[:5], level=0.9)
    plain = keras.Sequential([keras.Input((6, 6, 1)), keras.layers.Conv2D(2, 3, activation="relu"),
                              keras.layers.MaxPooling2D(), keras.layers.Flatten(), keras.layers.Dense(2)])
    kd.predict(kd.convert(plain), np.zeros((2, 6, 6, 1), "float32"), task="classification")


if __name__ == "__main__":  # the JAX side of the test above (float32 only: no JAX_ENABLE_X64)
    import warnings

    import numpy as np

    sys.path.insert(0, ROOT)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jax_losses, jax_predictions = _train(sys.argv[1])
        _convert_and_predict()
    messages = [f"{w.filename}:{w.lineno}: {w.message}" for w in caught if issubclass(w.category, UserWarning)]
    np.savez(sys.argv[2], losses=jax_losses, predictions=jax_predictions, warnings=np.asarray(messages, dtype=str))
