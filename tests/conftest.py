import functools
import importlib.util
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
# One thread for TensorFlow's operations. The suite runs three busy processes on two cores
# (two pytest-xdist workers and the JAX cross-section) and its models are small: TensorFlow's
# thread pools spent more CPU time handing tiny operations between threads than they saved (the
# convolution and layer tests: 229 CPU-seconds with the default pools, 187 with one thread, and
# less wall time even alone). Subprocesses (the main job, notebooks, distribution runs) inherit it.
os.environ.setdefault("TF_NUM_INTRAOP_THREADS", "1")
os.environ.setdefault("TF_NUM_INTEROP_THREADS", "1")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _seed_and_floatx():
    """Every test starts from the same seeds and float32 default."""
    keras.utils.set_random_seed(1234)
    previous = keras.config.floatx()
    previous_policy = keras.config.dtype_policy()
    yield
    keras.config.set_floatx(previous)
    keras.config.set_dtype_policy(previous_policy)


@pytest.fixture(autouse=True)
def _optimizer_built_before_fit(request, monkeypatch):
    """On TensorFlow, builds a compiled model's optimizer before `fit` traces the training step.

    Keras 3 builds the optimizer inside the first trace of the training step, and TensorFlow
    traces a function again when its first trace created variables: every first `fit` traces
    the step twice (the test suite is trace-bound: about 1 ms of Python per graph operation).
    Building the optimizer first is what Keras itself does under a distribution strategy and
    on JAX; the optimizer's variables and the training are the same. Tests of what a user's
    first `fit` does (warnings issued once, the step count, the objective logged) opt out with
    `@pytest.mark.keras_lazy_optimizer` where it matters, and
    `test_training.py::test_a_first_fit_that_builds_the_optimizer_in_its_trace_trains_the_same`
    checks that both ways give the same `History`."""
    if keras.backend.backend() != "tensorflow" or request.node.get_closest_marker("keras_lazy_optimizer"):
        return
    fit = keras.Model.fit

    @functools.wraps(fit)  # (`fit`'s own signature: tests bind and read it)
    def fit_with_built_optimizer(self, *args, **kwargs):
        optimizer = getattr(self, "optimizer", None)
        if optimizer is not None and not optimizer.built and self.built and self.trainable_variables:
            optimizer.build(self.trainable_variables)
        return fit(self, *args, **kwargs)

    monkeypatch.setattr(keras.Model, "fit", fit_with_built_optimizer)


@pytest.fixture(params=["float32", "float64"])
def floatx(request):
    """Runs a test in float32 and float64 (default float and layer dtype policy)."""
    keras.config.set_floatx(request.param)
    keras.config.set_dtype_policy(request.param)
    return request.param


def to_numpy(x):
    return np.asarray(keras.ops.convert_to_numpy(x))


def reloaded(model, folder, name="model"):
    """`model` after a `.keras` round trip: saved as `folder/name.keras` and loaded back in
    safe mode (Keras' default), as a user's saved model is. Tests compare what it predicts."""
    path = os.path.join(folder, f"{name}.keras")
    model.save(path)
    return keras.saving.load_model(path, safe_mode=True)


def plain_outputs(model, x):
    """A plain Keras model's `model(x, training=False)` as NumPy, the oracle of a conversion.
    A channels-first model runs compiled by XLA on TensorFlow: TensorFlow's own CPU kernels
    refuse channels-first convolutions ("Conv2D op currently only supports the NHWC tensor
    format on the CPU", TensorFlow 2.21), XLA's take any layout."""
    def layers(layer):
        return [layer] + [inner for child in getattr(layer, "layers", []) for inner in layers(child)]

    first = any(getattr(layer, "data_format", None) == "channels_first" for layer in layers(model))
    if first and keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        return to_numpy(tf.function(lambda t: model(t, training=False), jit_compile=True)(x))
    return to_numpy(model(x, training=False))


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "tensorflow_only: uses a TensorFlow-only feature (skipped on other backends)"
    )
    config.addinivalue_line("markers", "heavy: long-running (left out of the JAX backend run)")
    config.addinivalue_line(
        "markers", "keras_lazy_optimizer: `fit` builds the optimizer in its first trace, as Keras does by itself"
    )


@pytest.hookimpl(trylast=True)  # after `-k` / `-m` deselection
def pytest_collection_modifyitems(config, items):
    if keras.backend.backend() == "tensorflow":
        # The long tests first (a stable sort: the same order in every pytest-xdist worker), so
        # that parallel workers do not end on one of them.
        items.sort(key=lambda item: "heavy" not in item.keywords)
        _start_the_jax_suite_early(config, items)
        return
    skip = pytest.mark.skip(reason=f"TensorFlow-only feature; backend is {keras.backend.backend()}")
    for item in items:
        if "tensorflow_only" in item.keywords:
            item.add_marker(skip)


def _start_the_jax_suite_early(config, items):
    """When `test_backends.py`'s JAX run is selected, starts its subprocess now and moves the
    test last: the JAX run overlaps the rest of the suite instead of following it. Under
    pytest-xdist the workers only move the test (identically, as xdist requires); the
    controller starts the run once (`pytest_xdist_node_collection_finished`)."""
    from tests import test_backends

    selected = [item for item in items if item.nodeid == test_backends.JAX_SUITE_TEST]
    if not selected or config.option.collectonly or importlib.util.find_spec("jax") is None:
        return  # (without JAX the test skips itself)
    items.remove(selected[0])
    items.append(selected[0])
    if not hasattr(config, "workerinput"):
        _start_jax_suite(config)


def _start_jax_suite(config):
    import tempfile

    from tests import test_backends

    if config.stash.get(test_backends.JAX_SUITE_KEY, None) is None:
        folder = config.stash.get(_JAX_SUITE_FOLDER, None) or tempfile.mkdtemp(prefix="keras_dvi_jax_suite_")
        config.stash[test_backends.JAX_SUITE_KEY] = (test_backends.start_jax_suite(folder), folder)


_JAX_SUITE_FOLDER = pytest.StashKey()


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """pytest-xdist controller: tells each worker the folder of the JAX run."""
    import tempfile

    from tests import test_backends

    config = node.config
    if config.stash.get(_JAX_SUITE_FOLDER, None) is None:
        config.stash[_JAX_SUITE_FOLDER] = tempfile.mkdtemp(prefix="keras_dvi_jax_suite_")
    node.workerinput[test_backends.JAX_SUITE_WORKERINPUT] = config.stash[_JAX_SUITE_FOLDER]


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    """pytest-xdist controller: starts the JAX run as soon as a worker has collected its test."""
    from tests import test_backends

    if test_backends.JAX_SUITE_TEST in ids and importlib.util.find_spec("jax") is not None:
        _start_jax_suite(node.config)


def pytest_unconfigure(config):
    from tests import test_backends

    started = config.stash.get(test_backends.JAX_SUITE_KEY, None)
    if started:
        test_backends.stop_jax_suite(*started)
    folder = config.stash.get(_JAX_SUITE_FOLDER, None)
    if folder:  # (an xdist session that did not select the JAX run)
        import shutil

        shutil.rmtree(folder, ignore_errors=True)


def gradients(fn, arrays):
    """`(fn(*tensors), [d fn / d tensor])` as NumPy, on the TensorFlow or JAX backend.

    `fn` maps backend tensors made from `arrays` to a scalar."""
    if keras.backend.backend() == "jax":
        import jax

        # Compiled, as JAX runs a model's steps (op by op, JAX compiles every operation on its own)
        value, grads = jax.jit(jax.value_and_grad(lambda ts: fn(*ts)))([keras.ops.convert_to_tensor(a) for a in arrays])
        return to_numpy(value), [to_numpy(g) for g in grads]
    import tensorflow as tf

    tensors = [tf.Variable(a) for a in arrays]
    with tf.GradientTape() as tape:
        value = fn(*tensors)
    grads = tape.gradient(value, tensors, unconnected_gradients=tf.UnconnectedGradients.ZERO)
    return to_numpy(value), [to_numpy(g) for g in grads]


def model_gradients(model, inputs, loss_of_outputs=None, training=False):
    """`(outputs, gradients of loss_of_outputs(outputs) + sum(model.losses))` with respect to
    the model's trainable variables, as NumPy, on the TensorFlow or JAX backend."""
    loss_of_outputs = loss_of_outputs or keras.ops.sum
    if keras.backend.backend() == "jax":
        import jax

        trainable = [v.value for v in model.trainable_variables]
        non_trainable = [v.value for v in model.non_trainable_variables]

        def objective(values):
            out, _, losses = model.stateless_call(values, non_trainable, inputs, training=training, return_losses=True)
            return loss_of_outputs(out) + sum(losses), out

        (_, out), grads = jax.jit(jax.value_and_grad(objective, has_aux=True))(trainable)
        return to_numpy(out), [to_numpy(g) for g in grads]
    import tensorflow as tf

    with tf.GradientTape() as tape:
        out = model(inputs, training=training)
        loss = loss_of_outputs(out) + sum(model.losses)
    grads = tape.gradient(loss, model.trainable_variables)
    return to_numpy(out), [None if g is None else to_numpy(g) for g in grads]


def random_gaussian(rng, batch, k, scale=1.0):
    """`(mean (batch, k), covariance (batch, k, k))`: random Gaussians, well conditioned."""
    g = rng.normal(size=(batch, k, k))
    cov = scale * (g @ np.swapaxes(g, 1, 2) / k + 0.05 * np.eye(k))
    return rng.normal(size=(batch, k)), cov


def mc_gaussian(rng, mean, cov, n):
    """`n` draws of each Gaussian of `random_gaussian`: `(batch, n, k)`."""
    chol = np.linalg.cholesky(cov)
    return mean[:, None, :] + np.einsum("bij,bnj->bni", chol, rng.normal(size=(mean.shape[0], n, mean.shape[1])))
