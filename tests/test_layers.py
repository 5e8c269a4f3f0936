"""Layer API: shapes, composition, introspection, errors, config, saving, gradients."""

import keras
import numpy as np
import pytest

import keras_dvi
from keras_dvi import (
    DenseDiagDVI,
    DenseDVI,
    SkipDiagDVI,
    SkipDVI,
    predict_samples,
    predictive,
    unpack,
)
from tests.conftest import model_gradients, reloaded, to_numpy

LAYER_FACTORIES = {
    "DenseDVI": lambda: DenseDVI(4, "relu"),
    "DenseDVI-exact": lambda: DenseDVI(4, "heaviside", covariance_approximation="exact"),
    "DenseDiagDVI": lambda: DenseDiagDVI(4, "relu"),
    "SkipDVI": lambda: SkipDVI("relu"),
    "SkipDiagDVI": lambda: SkipDiagDVI("heaviside", use_bias=False),
}


def _x(batch=5, features=3, seed=0):
    return np.random.default_rng(seed).normal(size=(batch, features)).astype("float32")


def _gaussian_inputs(batch=5, features=3, seed=0):
    rng = np.random.default_rng(seed)
    g = rng.normal(size=(batch, features, features))
    cov = g @ np.swapaxes(g, 1, 2) / features
    return rng.normal(size=(batch, features)).astype("float32"), cov.astype("float32")


# ------------------------------------------------------------------ shapes and composition


@pytest.mark.parametrize("name", list(LAYER_FACTORIES))
@pytest.mark.parametrize("structure", ["deterministic", "diagonal", "full", "packed-full"])
def test_output_shape_matches_compute_output_shape(name, structure):
    layer = LAYER_FACTORIES[name]()
    mean, cov = _gaussian_inputs()
    inputs = {
        "deterministic": mean,
        "diagonal": (mean, np.diagonal(cov, axis1=1, axis2=2).copy()),
        "full": (mean, cov),
        "packed-full": np.concatenate([mean[:, None], cov], axis=1),
    }[structure]
    out = layer(inputs)
    shapes = (
        tuple(inputs.shape)
        if not isinstance(inputs, tuple)
        else (tuple(inputs[0].shape), tuple(inputs[1].shape))
    )
    assert tuple(out.shape) == tuple(layer.compute_output_shape(shapes))
    mean_out, second = unpack(out, covariance="full")
    assert np.isfinite(to_numpy(second)).all()
    eig = np.linalg.eigvalsh(to_numpy(second).astype("float64"))
    assert eig.min() >= -1e-4 * max(1.0, eig.max())


def test_layers_compose_full_and_diagonal_in_both_orders():
    x = _x()
    model = keras.Sequential(
        [
            keras.Input((3,)),
            DenseDiagDVI(8, "relu"),
            DenseDVI(6, "relu"),  # full after diagonal
            DenseDiagDVI(5, "relu"),  # diagonal after full (exact diagonal of the input)
            DenseDVI(4),
            SkipDVI("relu"),
            SkipDiagDVI("relu"),
            DenseDVI(2),
        ]
    )
    mean, cov = unpack(model(x))
    assert mean.shape == (5, 2) and cov.shape == (5, 2, 2)


def test_diagonal_layer_after_full_layer_uses_the_exact_input_covariance():
    """Var(a_i) includes the input correlations: (M^T Cov(h) M)_ii, not only sum M^2 var."""
    mean, cov = _gaussian_inputs(features=4)
    full = DenseDVI(3, dtype="float32")
    diag = DenseDiagDVI(3)
    full.build((None, 4))
    diag.build((None, 4))
    diag.set_weights(full.get_weights())
    want = np.diagonal(to_numpy(unpack(full((mean, cov)))[1]), axis1=1, axis2=2)
    got = to_numpy(unpack(diag((mean, cov)))[1])
    np.testing.assert_allclose(got, want, rtol=1e-5)
    dropped = to_numpy(unpack(diag((mean, np.diagonal(cov, axis1=1, axis2=2).copy())))[1])
    assert np.abs(dropped - want).max() > 1e-2  # the test input has strong correlations


def test_the_output_form_is_fixed_by_the_layer_class_not_its_position():
    """A `DenseDVI` once returned the diagonal form after data and the full form after another
    layer, so `unpack(..., "auto")` changed shape with the layer's position. `DenseDVI` always
    returns the full form (exactly diagonal after data: the units are independent) and
    `DenseDiagDVI` always the diagonal one."""
    first = DenseDVI(4, "relu")(_x())
    assert tuple(first.shape) == (5, 5, 4)
    mean, cov = unpack(first)
    assert tuple(cov.shape) == (5, 4, 4)
    cov = to_numpy(cov)
    np.testing.assert_array_equal(cov - np.eye(4) * np.diagonal(cov, axis1=1, axis2=2)[:, None, :], 0.0)
    assert tuple(DenseDVI(4, "relu")(first).shape) == (5, 5, 4)
    assert tuple(DenseDiagDVI(4, "relu")(_x()).shape) == tuple(DenseDiagDVI(4, "relu")(first).shape) == (5, 2, 4)


def test_functional_model_with_gaussian_pair_input():
    mean_in = keras.Input((3,))
    cov_in = keras.Input((3, 3))
    hidden = DenseDVI(8, "relu")((mean_in, cov_in))
    out = DenseDiagDVI(2)(hidden)
    model = keras.Model([mean_in, cov_in], out)
    mean, cov = _gaussian_inputs()
    got = model.predict([mean, cov], verbose=0)
    assert got.shape == (5, 2, 2)


# ------------------------------------------------------------------ unpack


def test_unpack_forms():
    mean, cov = _gaussian_inputs(features=2)
    packed = np.concatenate([mean[:, None], cov], axis=1)
    m, c = unpack(packed)
    np.testing.assert_array_equal(to_numpy(m), mean)
    np.testing.assert_array_equal(to_numpy(c), cov)
    _, v = unpack(packed, covariance="diagonal")
    np.testing.assert_array_equal(to_numpy(v), np.diagonal(cov, axis1=1, axis2=2))
    var = np.diagonal(cov, axis1=1, axis2=2).copy()
    m, c = unpack(np.stack([mean, var], axis=1), covariance="full")
    np.testing.assert_array_equal(to_numpy(c)[:, 0, 1], 0.0)
    np.testing.assert_array_equal(to_numpy(c)[:, 1, 1], var[:, 1])
    m, c = unpack((mean, cov))
    np.testing.assert_array_equal(to_numpy(c), cov)
    m, v = unpack(mean)  # deterministic: zero variance
    np.testing.assert_array_equal(to_numpy(v), 0.0)
    # One unit: (batch, 2, 1) means mean and variance in both forms.
    m, v = unpack(np.stack([mean[:, :1], var[:, :1]], axis=1))
    assert tuple(v.shape) == (5, 1)
    with pytest.raises(ValueError, match="covariance"):
        unpack(packed, covariance="both")


# ------------------------------------------------------------------ introspection


def test_posterior_properties_and_set_posterior():
    layer = DenseDVI(3)
    layer.build((None, 2))
    assert (to_numpy(layer.kernel_variance) > 0).all()
    np.testing.assert_allclose(to_numpy(layer.kernel_variance), 0.03 / 2, rtol=1e-6)
    np.testing.assert_allclose(to_numpy(layer.bias_variance), 0.003 / 2, rtol=1e-6)
    km = np.arange(6.0).reshape(2, 3)
    layer.set_posterior(km, 0.5, bias_mean=[1.0, 2.0, 3.0], bias_variance=np.array([0.1, 0.2, 0.3]))
    np.testing.assert_allclose(to_numpy(layer.kernel_mean), km)
    np.testing.assert_allclose(to_numpy(layer.kernel_variance), 0.5, rtol=1e-6)
    np.testing.assert_allclose(to_numpy(layer.bias_mean), [1, 2, 3])
    np.testing.assert_allclose(to_numpy(layer.bias_variance), [0.1, 0.2, 0.3], rtol=1e-6)
    # The moments the layer computes follow the posterior (linear layer, deterministic x).
    x = np.array([[1.0, -2.0]], "float32")
    mean, var = unpack(layer(x), covariance="diagonal")
    np.testing.assert_allclose(to_numpy(mean), x @ km + [1, 2, 3], rtol=1e-6)
    np.testing.assert_allclose(to_numpy(var), (x**2) @ np.full((2, 3), 0.5) + [0.1, 0.2, 0.3], rtol=1e-6)


def test_no_bias_layer():
    layer = DenseDVI(3, use_bias=False)
    layer.build((None, 2))
    assert layer.bias_mean is None and layer.bias_variance is None
    assert len(layer.trainable_weights) == 2
    with pytest.raises(ValueError, match="bias"):
        layer.set_posterior(np.zeros((2, 3)), 1.0, bias_mean=np.zeros(3))


@pytest.mark.parametrize("cls", [DenseDVI, DenseDiagDVI])
def test_from_dense_uses_the_trained_weights_as_means(cls):
    dense = keras.layers.Dense(4, activation="relu")
    x = _x()
    want = to_numpy(dense(x))
    layer = cls.from_dense(dense, kernel_variance=1e-12, bias_variance=1e-12)
    assert layer.units == 4 and layer.activation == "relu"
    mean, var = unpack(layer(x), covariance="diagonal")
    np.testing.assert_allclose(to_numpy(mean), want, atol=1e-5)
    assert to_numpy(var).max() < 1e-9


def test_from_dense_refuses_unsupported_dense_layers():
    tanh = keras.layers.Dense(2, activation="tanh")
    tanh.build((None, 3))
    with pytest.raises(ValueError, match="activation"):
        DenseDVI.from_dense(tanh)
    with pytest.raises(ValueError, match="dense"):
        DenseDVI.from_dense(keras.layers.Dense(2))  # not built


# ------------------------------------------------------------------ errors


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"units": 0}, "units"),
        ({"units": -3}, "units"),
        ({"units": 2.5}, "units"),
        ({"units": True}, "units"),
        ({"units": 2, "activation": "tanh"}, "activation"),
        ({"units": 2, "activation": "softmax"}, "activation"),
        ({"units": 2, "covariance_approximation": "mc"}, "covariance_approximation"),
        ({"units": 2, "kernel_variance_init": -1.0}, "kernel_variance_init"),
        ({"units": 2, "bias_variance_init": 0.0}, "bias_variance_init"),
    ],
)
def test_bad_constructor_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DenseDVI(**kwargs)


def test_skip_refuses_bad_arguments():
    with pytest.raises(ValueError, match="activation"):
        SkipDVI("sigmoid")
    with pytest.raises(ValueError, match="covariance_approximation"):
        SkipDiagDVI("relu", covariance_approximation="approx")


@pytest.mark.parametrize(
    "inputs, match",
    [
        (np.zeros((4,), "float32"), "inputs"),  # rank 1
        (np.zeros((2, 3, 3, 3), "float32"), "inputs"),  # rank 4
        (np.zeros((2, 5, 3), "float32"), "inputs"),  # rank 3 but not a packed shape
        ((np.zeros((2, 3), "float32"), np.zeros((2, 3, 4), "float32")), "covariance"),
        ((np.zeros((2, 3), "float32"), np.zeros((2, 4), "float32")), "covariance"),
        ((np.zeros((2, 3, 1), "float32"), np.zeros((2, 3), "float32")), "mean"),
        ((np.zeros((2, 3), "float32"),) * 3, "pair"),
    ],
)
def test_bad_input_shapes_raise_clear_errors(inputs, match):
    with pytest.raises(ValueError, match=match):
        DenseDVI(2)(inputs)


def test_width_mismatch_after_build():
    layer = DenseDVI(2)
    layer(np.zeros((1, 3), "float32"))
    with pytest.raises(ValueError, match="expects inputs with 3 features"):
        layer(np.zeros((1, 4), "float32"))
    with pytest.raises(ValueError, match="expects inputs with 3 features"):
        layer(np.zeros((1, 2, 4), "float32"))


def test_set_posterior_errors():
    layer = DenseDVI(3)
    with pytest.raises(ValueError, match="built"):
        layer.set_posterior(np.zeros((2, 3)), 1.0)
    layer.build((None, 2))
    with pytest.raises(ValueError, match="kernel_mean"):
        layer.set_posterior(np.zeros((3, 3)), 1.0)
    with pytest.raises(ValueError, match="kernel_variance"):
        layer.set_posterior(np.zeros((2, 3)), -1.0)
    with pytest.raises(ValueError, match="bias_variance"):
        layer.set_posterior(np.zeros((2, 3)), 1.0, bias_variance=np.zeros(3))


def test_predict_samples_of_a_moment_network_errors_and_reproducibility():
    """Monte Carlo over the weights of a DVI network, `(batch, samples, units)` like every
    sampled output."""
    model = keras.Sequential([keras.Input((3,)), DenseDVI(4, "relu"), DenseDVI(1)])
    x = _x()
    with pytest.raises(ValueError, match="num_samples"):
        predict_samples(model, x, 0)
    with pytest.raises(ValueError, match="x"):
        predict_samples(model, np.zeros((2, 3, 3), "float32"), 5)
    a = predictive.weight_samples(model, x, 50, seed=3, chunk_size=7)
    b = predict_samples(model, x, 50, seed=3)
    c = predict_samples(model, x, 50, seed=4)
    assert a.shape == b.shape == (5, 50, 1)
    np.testing.assert_array_equal(a[:, :7], b[:, :7])  # same seed, same first chunk
    assert np.abs(a - c).max() > 0
    # Rows in batches draw the same weights (the seed restarts per batch): the same samples.
    np.testing.assert_allclose(predict_samples(model, x, 50, seed=3, batch_size=2), b, rtol=1e-5, atol=1e-6)
    # Without a seed too: one row in two batches gets the same draws (one function per sample).
    twice = predict_samples(model, np.concatenate([x[:1], x[:1]]), 50, batch_size=1)
    np.testing.assert_allclose(twice[0], twice[1], rtol=1e-5, atol=1e-6)
    # The same weights are used for every row of x within one sample: a linear model's
    # samples are exactly affine in x.
    lin = keras.Sequential([keras.Input((1,)), DenseDVI(1)])
    s = predict_samples(lin, np.array([[0.0], [1.0], [2.0]], "float32"), 10, seed=0)[..., 0]
    np.testing.assert_allclose(s[2] - s[1], s[1] - s[0], atol=1e-5)


# ------------------------------------------------------------------ config and saving


@pytest.mark.parametrize("name", list(LAYER_FACTORIES))
def test_config_round_trip(name):
    layer = LAYER_FACTORIES[name]()
    x = _x(features=4)
    out = layer(x)
    config = layer.get_config()
    clone = type(layer).from_config(config)
    assert clone.get_config() == config
    clone(x)
    clone.set_weights(layer.get_weights())
    np.testing.assert_array_equal(to_numpy(clone(x)), to_numpy(out))
    for key in ("activation", "use_bias", "kernel_mean_initializer", "bias_mean_initializer", "kernel_variance_init", "bias_variance_init"):
        assert key in config


def test_config_holds_every_constructor_argument():
    layer = DenseDVI(
        7,
        activation="heaviside",
        covariance_approximation="exact",
        use_bias=False,
        kernel_mean_initializer="glorot_uniform",
        bias_mean_initializer="ones",
        kernel_variance_init=0.02,
        bias_variance_init=0.003,
        name="custom",
    )
    clone = DenseDVI.from_config(layer.get_config())
    for attr in ("units", "activation", "covariance_approximation", "use_bias", "kernel_variance_init", "bias_variance_init", "name"):
        assert getattr(clone, attr) == getattr(layer, attr)
    assert isinstance(clone.kernel_mean_initializer, keras.initializers.GlorotUniform)
    assert isinstance(clone.bias_mean_initializer, keras.initializers.Ones)


def _all_layer_model():
    inputs = keras.Input((3,))
    h = DenseDiagDVI(6, "relu")(inputs)
    h = DenseDVI(6, "relu", covariance_approximation="exact")(h)
    h = DenseDVI(5)(h)
    h = SkipDVI("relu")(h)
    h = SkipDiagDVI("heaviside")(h)
    outputs = DenseDVI(2)(h)
    return keras.Model(inputs, outputs)


@pytest.mark.parametrize("kind", ["sequential", "functional"])
def test_saved_model_predicts_the_same(tmp_path, kind):
    if kind == "functional":
        model = _all_layer_model()
    else:
        model = keras.Sequential([keras.Input((3,)), DenseDVI(6, "relu"), SkipDVI(), DenseDiagDVI(2)])
    x = _x()
    before = model.predict(x, verbose=0)
    loaded = reloaded(model, tmp_path, "model")
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), before)
    assert [type(layer).__name__ for layer in loaded.layers] == [type(layer).__name__ for layer in model.layers]


def test_registered_names():
    for cls in (DenseDVI, DenseDiagDVI, SkipDVI, SkipDiagDVI):
        assert keras.saving.get_registered_name(cls) == f"keras_dvi>{cls.__name__}"


# ------------------------------------------------------------------ dtypes and gradients


def test_float64_layers(floatx):
    model = _all_layer_model()
    out = model(_x().astype(floatx))
    assert keras.backend.standardize_dtype(out.dtype) == floatx
    assert all(keras.backend.standardize_dtype(w.dtype) == floatx for w in model.weights)


def _finite_gradients(model, inputs):
    out, grads = model_gradients(model, inputs)
    assert np.isfinite(out).all()
    for g in grads:
        assert g is not None and np.isfinite(g).all()


@pytest.mark.parametrize("method", ["paper", "exact"])
@pytest.mark.parametrize("activation", ["relu", "heaviside"])
def test_network_gradients_finite_at_edges(floatx, method, activation):
    """Zero correlations (first layer), correlations of +-(1 - 1e-6), variances of 0 and
    1e-12, and means of +-40 in a full network, float32 and float64."""
    mean = np.array([[40.0, -40.0, 0.5], [0.0, 1e-3, -1.0], [2.0, 2.0, 2.0]])
    r = 1 - 1e-6
    base = np.array([[1.0, r, -r], [r, 1.0, -r * r], [-r, -r * r, 1.0]])
    cov = np.stack([base, np.zeros((3, 3)), 1e-12 * base])
    inputs_layer = keras.Input((3,))
    cov_layer = keras.Input((3, 3))
    h = DenseDVI(4, activation, covariance_approximation=method)((inputs_layer, cov_layer))
    h = DenseDVI(4, activation, covariance_approximation=method)(h)
    h = SkipDVI(activation, covariance_approximation=method)(h)
    out = DenseDVI(2)(h)
    model = keras.Model([inputs_layer, cov_layer], out)
    _finite_gradients(model, [mean.astype(floatx), cov.astype(floatx)])
    # And from a deterministic input (exactly zero correlations after the first layer).
    det = keras.Sequential([keras.Input((3,)), DenseDVI(4, activation, covariance_approximation=method), DenseDVI(4, activation, covariance_approximation=method), DenseDVI(1)])
    _finite_gradients(det, mean.astype(floatx))


def test_trains_with_model_fit_on_packed_outputs():
    """The packed single-tensor output works with compile/fit/evaluate/predict."""

    def expected_squared_error(y_true, y_pred):
        mean, var = unpack(y_pred, covariance="diagonal")
        return keras.ops.mean(keras.ops.square(y_true - mean) + var, axis=-1)

    rng = np.random.default_rng(0)
    x = rng.uniform(-1, 1, size=(256, 1)).astype("float32")
    y = np.sin(3 * x).astype("float32")
    model = keras.Sequential([keras.Input((1,)), DenseDVI(32, "relu"), DenseDVI(32, "relu"), DenseDVI(1)])
    model.compile(keras.optimizers.Adam(1e-2), loss=expected_squared_error)
    first = model.evaluate(x, y, verbose=0, return_dict=True)["loss"]
    model.fit(x, y, epochs=30, batch_size=64, verbose=0)
    assert model.evaluate(x, y, verbose=0, return_dict=True)["loss"] < 0.5 * first


def test_public_api():
    """Every name in `keras_dvi.__all__` resolves; the names of unreleased versions are gone."""
    assert keras_dvi.__version__ == "0.1.0"
    for name in keras_dvi.__all__:
        assert getattr(keras_dvi, name) is not None, name
    for name in ("KLWarmup", "SampledGaussianELL", "sample_outputs"):
        assert not hasattr(keras_dvi, name), name
    # the maths lives in `keras_dvi.maths`; 0.1.0's module paths name the same modules
    import importlib

    for old_path, module in (("keras_dvi.moments", keras_dvi.maths.moments),
                             ("keras_dvi.conv_moments", keras_dvi.maths.conv_moments),
                             ("keras_dvi.inducing", keras_dvi.maths.inducing),
                             ("keras_dvi.tagi.maths", keras_dvi.maths.tagi)):
        assert importlib.import_module(old_path) is module, old_path
    assert keras_dvi.moments is keras_dvi.maths.moments and keras_dvi.tagi.maths is keras_dvi.maths.tagi
    from keras_dvi.tagi.maths import tree  # noqa: F401 (an import of 0.1.0 user code)


def test_every_public_layer_is_at_most_three_classes_below_keras_layer():
    """Layers in Keras' shape: shared behaviour by composition (the posterior's KL term, the
    convolution's arguments, the weight draws of the Monte Carlo layers), not deep chains or
    mixins."""
    import inspect

    import keras_dvi as kd

    deep = {}
    for name in dir(kd):
        obj = getattr(kd, name)
        if inspect.isclass(obj) and issubclass(obj, keras.layers.Layer) and not issubclass(obj, keras.Model):
            between = obj.__mro__.index(keras.layers.Layer) - 1
            if between > 3:
                deep[name] = [c.__name__ for c in obj.__mro__[1:between + 1]]
    assert deep == {}


def test_signatures_list_the_arguments_passed_on_to_the_posterior():
    """`help()`, IDEs and the API reference show `BayesianLayer`'s arguments with their defaults
    on every layer that passes them on in `**kwargs`; calls and configs are unchanged."""
    import inspect

    for cls in (DenseDVI, DenseDiagDVI, SkipDVI, keras_dvi.DenseMCVI, keras_dvi.Conv2DDVI, keras_dvi.Conv1DMCVI):
        parameters = inspect.signature(cls.__init__).parameters
        assert parameters["use_bias"].default is True and parameters["regularizer"].default is None, cls
        assert parameters["use_bias"].kind == inspect.Parameter.KEYWORD_ONLY
    layer = DenseDVI(3, "relu", use_bias=False, validate=True)
    assert not layer.use_bias and layer.validate
    assert DenseDVI.from_config(layer.get_config()).get_config() == layer.get_config()
