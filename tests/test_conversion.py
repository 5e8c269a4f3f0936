"""`keras_dvi.convert`: a plain Keras model's keras-dvi counterpart. With the posterior variances
shrunk to zero it computes the plain model's function (its logits), for every supported layer,
in Sequential and functional models, channels last and first; it trains, saves and loads; and
what it cannot convert is refused by name."""

import warnings

import keras
import numpy as np
import pytest

import keras_dvi as kd
from benchmarks.experiments.converted_against_monte_carlo import agreements, calibrate_batch_norm, randomise_batch_norm
from tests.conftest import plain_outputs, reloaded, to_numpy

TINY = {"kernel_variance": 1e-12, "bias_variance": 1e-12}


def _images(rows=6, size=10, channels=1, seed=0):
    return np.random.default_rng(seed).uniform(size=(rows, size, size, channels)).astype("float32")


def _residual_cnn(data_format="channels_last"):
    shape = (10, 10, 1) if data_format == "channels_last" else (1, 10, 10)
    f = {"data_format": data_format}
    axis = -1 if data_format == "channels_last" else 1
    inputs = keras.Input(shape)
    h = keras.layers.Rescaling(2.0)(inputs)
    h = keras.layers.Conv2D(4, 3, padding="same", activation="relu", **f)(h)
    h = keras.layers.MaxPooling2D(2, **f)(h)
    branch = keras.layers.Conv2D(4, 3, padding="same", use_bias=False, **f)(h)
    branch = keras.layers.BatchNormalization(axis=axis)(branch)
    branch = keras.layers.ReLU()(branch)
    h = keras.layers.Add()([h, branch])
    h = keras.layers.AveragePooling2D(1, **f)(h)
    h = keras.layers.Flatten(**f)(h)
    h = keras.layers.Dropout(0.3)(h)
    h = keras.layers.Dense(8, activation="relu")(h)
    return keras.Model(inputs, keras.layers.Dense(3, activation="softmax")(h))


def _logits(model, x):
    """A plain model's output before its final softmax (its logits)."""
    inner = keras.Model(model.inputs, model.layers[-1].input if not isinstance(model.layers[-1], keras.layers.Softmax)
                        else model.layers[-2].output)
    last = model.layers[-1]
    h = plain_outputs(inner, x)
    if isinstance(last, keras.layers.Dense):
        return to_numpy(keras.ops.matmul(h, last.kernel) + last.bias)
    return to_numpy(h)


@pytest.mark.parametrize("data_format", ["channels_last", "channels_first"])
def test_functional_cnn_computes_the_plain_function(data_format):
    """Conv, max pooling (the ReLU moved onto it), a residual block with batch normalisation
    folded into a bias-free convolution and a ReLU layer folded after it, average pooling,
    flatten, dropout (removed), dense layers and the output softmax (removed: logits); the
    preprocessing `Rescaling` stays plain."""
    plain = _residual_cnn(data_format)
    randomise_batch_norm(plain)
    x = _images()
    if data_format == "channels_first":
        x = np.moveaxis(x, -1, 1)
    converted = kd.convert(plain, **TINY)
    kinds = [type(layer).__name__ for layer in converted.layers]
    assert kinds == ["InputLayer", "Rescaling", "Conv2DDVI", "MaxPooling2DDVI", "Conv2DDVI", "AddDVI",
                     "AveragePooling2DDVI", "FlattenDVI", "DenseDiagDVI", "DenseDVI"], kinds
    conv, pool = converted.layers[2], converted.layers[3]
    assert (conv.activation, pool.activation) == ("linear", "relu") and conv.data_format == data_format
    assert converted.layers[4].activation == "relu" and converted.layers[4].use_bias  # ReLU and the folded shift
    mean, _ = kd.unpack(converted(x))
    np.testing.assert_allclose(to_numpy(mean), _logits(plain, x), rtol=1e-4, atol=1e-4)


#: A convolution's ReLU, as plain networks write it, before a max pooling (`stem`: ResNet's and
#: DenseNet's, through `ZeroPadding2D`).
RELU_BEFORE_POOLING = {
    "argument": lambda: [keras.layers.Conv2D(4, 3, activation="relu")],
    "layer": lambda: [keras.layers.Conv2D(4, 3), keras.layers.ReLU()],
    "batch_norm": lambda: [keras.layers.Conv2D(4, 3, use_bias=False), keras.layers.BatchNormalization(),
                           keras.layers.Activation("relu")],
    "stem": lambda: [keras.layers.Conv2D(4, 3), keras.layers.BatchNormalization(), keras.layers.ReLU(),
                     keras.layers.ZeroPadding2D(1)],
}


@pytest.mark.parametrize("chain", sorted(RELU_BEFORE_POOLING))
def test_the_relu_of_a_convolution_moves_to_the_max_pooling_it_feeds(chain):
    """The max commutes with a ReLU, and with zero padding under it (`relu(0) = 0`), so the
    converted network takes the max of the convolution's Gaussian outputs, whose moments Clark's
    recursion gives, and applies the ReLU after it: however the plain network writes the ReLU.
    The same function as the plain network, and no warning (a ReLU left on the convolution makes
    `MaxPooling2DDVI` warn that its moments are less accurate)."""
    plain = keras.Sequential([keras.Input((10, 10, 2)), *RELU_BEFORE_POOLING[chain](),
                              keras.layers.MaxPooling2D(3, strides=2), keras.layers.Flatten(), keras.layers.Dense(3)])
    randomise_batch_norm(plain)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        converted = kd.convert(plain, **TINY)
    conv, pool = (layer for layer in converted.layers if type(layer).__name__ in ("Conv2DDVI", "MaxPooling2DDVI"))
    assert (conv.activation, pool.activation) == ("linear", "relu")
    x = _images(channels=2) - 0.5
    np.testing.assert_allclose(to_numpy(kd.unpack(converted(x))[0]), _logits(plain, x), rtol=1e-4, atol=1e-5)


def test_frozen_layers_stay_frozen_with_a_warning(tmp_path):
    """A layer frozen in the plain model (`trainable=False`: a frozen backbone) becomes a frozen
    keras-dvi layer, as the plain part of `last_layers` keeps its settings, and `convert` warns
    that its variances are not fitted (with the way to a Bayesian head); the rest trains, and a
    `.keras` file keeps the setting."""
    plain = keras.Sequential([keras.Input((10, 10, 1)), keras.layers.Conv2D(4, 3, activation="relu"),
                              keras.layers.Flatten(), keras.layers.Dense(3, activation="softmax")])
    plain.layers[0].trainable = False
    with pytest.warns(UserWarning, match=r"1 of the 2 layers made Bayesian .* stay frozen.*last_layers=k"):
        converted = kd.convert(plain, regularizer=kd.EmpiricalBayesRegularizer(num_train=6))
    conv, dense = converted.layers[0], converted.layers[-1]
    assert (conv.trainable, dense.trainable) == (False, True)

    def posteriors():
        return [[to_numpy(getattr(layer, name)) for name in ("kernel_mean", "kernel_variance", "bias_mean")]
                for layer in (conv, dense)]

    before = posteriors()
    converted.fit(_images(), np.arange(6) % 3, epochs=1, verbose=0)
    after = posteriors()
    assert all(np.array_equal(b, a) for b, a in zip(before[0], after[0]))  # frozen
    assert not any(np.array_equal(b, a) for b, a in zip(before[1], after[1]))  # trained
    assert not reloaded(converted, tmp_path, "frozen").layers[0].trainable


#: A binary classifier's head as plain Keras writes it: `(layers, loss)`.
BINARY_HEADS = {
    "sigmoid": lambda: ([keras.layers.Dense(1, activation="sigmoid")], "binary_crossentropy"),
    "sigmoid_layer": lambda: ([keras.layers.Dense(1), keras.layers.Activation("sigmoid")], "binary_crossentropy"),
    "logit": lambda: ([keras.layers.Dense(1)], keras.losses.BinaryCrossentropy(from_logits=True)),
}


@pytest.mark.parametrize("head", sorted(BINARY_HEADS))
def test_a_binary_classifier_converts_to_two_logits(head):
    """A one-unit sigmoid output (or a logit under a binary cross-entropy) becomes the logits
    `(0, z)` of a two-class `DenseDVI` under `SoftmaxDeltaELL`: softmax `(1 - sigmoid(z),
    sigmoid(z))`, the plain model's probabilities at tiny variances; it trains on 0 / 1 labels."""
    layers, loss = BINARY_HEADS[head]()
    plain = keras.Sequential([keras.Input((4,)), keras.layers.Dense(6, activation="relu"), *layers])
    plain.compile("adam", loss=loss)
    x = np.random.default_rng(6).normal(size=(8, 4)).astype("float32")
    converted = kd.convert(plain, **TINY)
    assert isinstance(converted.loss, kd.SoftmaxDeltaELL)
    assert type(converted.layers[-1]).__name__ == "DenseDVI" and converted.layers[-1].units == 2
    out = to_numpy(plain(x))[:, 0]
    expected = 1.0 / (1.0 + np.exp(-out)) if head == "logit" else out  # the plain P(class 1)
    np.testing.assert_allclose(kd.predict(converted, x)["probabilities"][:, 1], expected, rtol=1e-5, atol=1e-6)
    history = converted.fit(x, (x[:, 0] > 0).astype("float32"), epochs=2, verbose=0).history
    assert np.isfinite(history["loss"]).all()


@pytest.mark.parametrize("head", ["argument", "softmax_layer", "activation_layer", "dropout_then_softmax"])
def test_the_output_layer_is_found_however_the_softmax_is_written(head):
    """The logits' layer is the network's output layer (a `DenseDVI`, full covariance over the
    logits) whether the softmax is its activation or a layer after it (through no-ops)."""
    layers = {"argument": [keras.layers.Dense(3, activation="softmax")],
              "softmax_layer": [keras.layers.Dense(3), keras.layers.Softmax()],
              "activation_layer": [keras.layers.Dense(3), keras.layers.Activation("softmax")],
              "dropout_then_softmax": [keras.layers.Dense(3), keras.layers.Dropout(0.1), keras.layers.Softmax()]}[head]
    plain = keras.Sequential([keras.Input((4,)), keras.layers.Dense(6, activation="relu"), *layers])
    converted = kd.convert(plain)
    assert [type(layer).__name__ for layer in converted.layers] == ["DenseDiagDVI", "DenseDVI"]
    assert isinstance(converted.loss, kd.SoftmaxDeltaELL)


def test_sequential_networks_every_other_layer():
    """A dense classifier with a `Softmax` layer, `leaky_relu` and `LeakyReLU(0.2)`; a 1D CNN with
    global average pooling and average pooling; `hidden_covariance="full"`; the prior given to
    every layer."""
    x = np.random.default_rng(1).normal(size=(7, 12)).astype("float32")
    dense = keras.Sequential([keras.Input((12,)), keras.layers.Dense(6, activation="leaky_relu"),
                              keras.layers.Dense(5), keras.layers.LeakyReLU(0.2), keras.layers.Dense(3),
                              keras.layers.Softmax()])
    prior = kd.EmpiricalBayesRegularizer(100)
    converted = kd.convert(dense, regularizer=prior, hidden_covariance="full", **TINY)
    assert [type(layer).__name__ for layer in converted.layers] == ["DenseDVI"] * 3
    assert [layer.activation for layer in converted.layers] == ["leaky_relu", "leaky_relu", "linear"]
    assert all(layer.regularizer is prior for layer in converted.layers)
    logits = keras.Sequential(dense.layers[:-1])(x)
    np.testing.assert_allclose(to_numpy(kd.unpack(converted(x))[0]), to_numpy(logits), rtol=1e-4, atol=1e-5)
    signals = np.random.default_rng(2).normal(size=(5, 16, 2)).astype("float32")
    cnn = keras.Sequential([keras.Input((16, 2)), keras.layers.Conv1D(4, 3, activation="relu"),
                            keras.layers.AveragePooling1D(2), keras.layers.Conv1D(3, 2, dilation_rate=2),
                            keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(2)])
    converted = kd.convert(cnn, **TINY)
    assert [type(layer).__name__ for layer in converted.layers] == [
        "Conv1DDVI", "AveragePooling1DDVI", "Conv1DDVI", "GlobalAveragePooling1DDVI", "DenseDVI"]
    np.testing.assert_allclose(to_numpy(kd.unpack(converted(signals))[0]), to_numpy(cnn(signals)), rtol=1e-4, atol=1e-5)


def _dense_graphs():
    """Plain networks of vectors and positions: `(name, model, inputs)`."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(5, 6)).astype("float32")
    inputs = keras.Input((6,))  # a residual MLP: sums of vectors, an activation after one
    h = keras.layers.Dense(8, activation="relu")(inputs)
    h = keras.layers.Add()([h, keras.layers.Dense(8, activation="relu")(h)])
    h = keras.layers.ReLU()(keras.layers.Add()([h, keras.layers.Dense(8)(h)]))
    h = keras.layers.BatchNormalization()(h)  # (after a ReLU: on the vector)
    branch = keras.layers.Activation("relu")(h)  # a pre-activation block: the activation's input has two readers
    h = keras.layers.Add()([h, keras.layers.Dense(8)(keras.layers.Dropout(0.2)(branch))])
    residual = keras.Model(inputs, keras.layers.Dense(3, activation="softmax")(h))
    wide, deep = keras.Input((4,)), keras.Input((6,))  # wide and deep: data joined to a Bayesian branch
    h = keras.layers.Concatenate()([wide, keras.layers.Dense(8, activation="relu")(deep)])
    h = keras.layers.Add()([h, keras.layers.Dense(12)(h), keras.layers.Dense(12)(deep)])  # three vectors
    wide_deep = keras.Model([wide, deep], keras.layers.Dense(3, activation="softmax")(h))
    sequences = keras.Input((7, 3))  # Dense on positions: convolutions of kernel size 1
    h = keras.layers.Dense(5, activation="relu")(sequences)
    h = keras.layers.Conv1D(4, 3, padding="same", activation="relu")(h)
    h = keras.layers.Add()([h, keras.layers.Dense(4)(h)])  # a residual sum of 1D maps
    positions = keras.Model(sequences, keras.layers.Dense(3)(keras.layers.GlobalAveragePooling1D()(h)))
    images = keras.Input((6, 6, 2))
    h = keras.layers.Dense(3, activation="relu")(keras.layers.Conv2D(4, 3)(images))
    h = keras.layers.Add()([h, keras.layers.Conv2D(3, 1)(h), keras.layers.Conv2D(3, 3, padding="same")(h)])  # three maps
    pixels = keras.Model(images, keras.layers.Dense(3)(keras.layers.Flatten()(h)))
    return [("residual", residual, x), ("wide_deep", wide_deep, [x[:, :4], x]),
            ("positions", positions, rng.normal(size=(5, 7, 3)).astype("float32")),
            ("pixels", pixels, rng.normal(size=(5, 6, 6, 2)).astype("float32"))]


@pytest.mark.parametrize("hidden_covariance", ["diagonal", "full"])
def test_dense_networks_with_sums_joins_and_dense_on_positions_convert_whole(hidden_covariance):
    """Residual MLPs (`Add` of vectors), wide and deep models (`Concatenate` of a second input
    with a Bayesian branch), a `Dense` on a sequence or an image (a convolution of kernel size
    1), the residual sum of 1D maps, sums of three: at tiny variances the plain function."""
    expected = {"residual": ["DenseDiagDVI", "DenseDiagDVI", "AddDVI", "DenseDiagDVI", "AddDVI",
                             "BatchNormalizationDVI", "ActivationDVI", "DenseDiagDVI", "AddDVI", "DenseDVI"],
                "wide_deep": ["DenseDiagDVI", "ConcatenateDVI", "DenseDiagDVI", "DenseDiagDVI", "AddDVI", "DenseDVI"],
                "positions": ["Conv1DDVI", "Conv1DDVI", "Conv1DDVI", "AddDVI", "GlobalAveragePooling1DDVI",
                              "DenseDVI"],
                "pixels": ["Conv2DDVI", "Conv2DDVI", "Conv2DDVI", "Conv2DDVI", "AddDVI", "FlattenDVI", "DenseDVI"]}
    for name, plain, x in _dense_graphs():
        converted = kd.convert(plain, hidden_covariance=hidden_covariance, **TINY)
        kinds = [type(layer).__name__ for layer in converted.layers if not isinstance(layer, keras.layers.InputLayer)]
        if hidden_covariance == "full":
            expected[name] = [k.replace("DenseDiagDVI", "DenseDVI") for k in expected[name]]
        assert kinds == expected[name], (name, kinds)
        mean = to_numpy(kd.unpack(converted(x))[0])
        samples = kd.predict_samples(converted, x, num_samples=2, seed=0)  # (every layer's Monte Carlo form)
        np.testing.assert_allclose(samples[:, 1], mean, rtol=1e-4, atol=1e-5, err_msg=name)
        want = plain_outputs(plain, x)
        if name in ("residual", "wide_deep"):
            mean = to_numpy(keras.ops.softmax(mean))
        np.testing.assert_allclose(mean, want, rtol=1e-4, atol=1e-5, err_msg=name)
        if name == "residual":  # the ReLU after the second sum folds into it
            assert [layer.activation for layer in converted.layers if isinstance(layer, kd.AddDVI)] == [
                "linear", "relu", "linear"]


def test_a_wide_and_deep_classifier_trains_predicts_and_samples_on_its_two_inputs(tmp_path):
    _, plain, _ = _dense_graphs()[1]
    rng = np.random.default_rng(4)
    x = [rng.normal(size=(64, 4)).astype("float32"), rng.normal(size=(64, 6)).astype("float32")]
    y = (x[0][:, 0] + x[1][:, 0] > 0).astype("int32")
    plain.compile("adam", "sparse_categorical_crossentropy")
    converted = kd.convert(plain, regularizer=kd.EmpiricalBayesRegularizer(num_train=64))
    history = converted.fit(x, y, epochs=2, batch_size=16, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    out = kd.predict(converted, x)
    assert out["probabilities"].shape == (64, 3)
    samples = kd.predict_samples(converted, x, num_samples=5, seed=0)
    assert samples.shape == (64, 5, 3)
    loaded = reloaded(converted, tmp_path, "wide_deep")
    np.testing.assert_allclose(loaded.predict(x, verbose=0), converted.predict(x, verbose=0), rtol=1e-6)


def test_a_model_with_several_outputs_is_compiled_output_by_output(tmp_path):
    """A classification, a regression and a binary head: each output gets its keras-dvi loss (a
    regression its noise layer). All were compiled with one `SoftmaxDeltaELL` (a softmax on one
    output made the model "a classifier"), which trained the regression head on a one-class
    softmax: no signal, silently."""
    rng = np.random.default_rng(6)
    inputs = keras.Input((8,))
    h = keras.layers.Dense(16, activation="relu")(inputs)
    plain = keras.Model(inputs, {"cls": keras.layers.Dense(3, activation="softmax")(h), "reg": keras.layers.Dense(1)(h),
                                 "bin": keras.layers.Dense(1, activation="sigmoid")(h)})
    plain.compile("adam", {"cls": keras.losses.SparseCategoricalCrossentropy(), "reg": "mse",
                           "bin": keras.losses.BinaryCrossentropy(label_smoothing=0.1)})
    converted = kd.convert(plain, regularizer=kd.EmpiricalBayesRegularizer(num_train=64), **TINY)
    assert {key: type(loss).__name__ for key, loss in converted.loss.items()} == {
        "cls": "SoftmaxDeltaELL", "reg": "HeteroscedasticELL", "bin": "SoftmaxDeltaELL"}
    assert converted.loss["bin"].label_smoothing == 0.1 and converted.loss["cls"].label_smoothing == 0.0
    x = rng.normal(size=(64, 8)).astype("float32")
    want = {key: to_numpy(value) for key, value in plain(x, training=False).items()}
    got = converted(x)
    np.testing.assert_allclose(to_numpy(keras.ops.softmax(kd.unpack(got["cls"])[0])), want["cls"], rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(to_numpy(keras.ops.softmax(kd.unpack(got["bin"])[0]))[:, 1:], want["bin"], rtol=1e-4,
                               atol=1e-6)
    np.testing.assert_allclose(to_numpy(kd.unpack(got["reg"])[0])[:, :1], want["reg"], rtol=1e-4, atol=1e-5)
    y = {"cls": rng.integers(0, 3, 64), "reg": rng.normal(size=64).astype("float32"), "bin": rng.integers(0, 2, 64)}
    logs = converted.fit(x, y, epochs=1, batch_size=32, verbose=0).history
    assert {"cls_loss", "reg_loss", "bin_loss", "nll", "kl"} <= set(logs) and np.isfinite(logs["loss"]).all()
    summary = kd.predict(converted, x[:4])
    assert summary["reg"]["std"].shape == (4, 1) and summary["bin"]["probabilities"].shape == (4, 2)
    unknown = keras.Model(inputs, [plain.outputs[0], keras.layers.Dense(2, name="scores")(h)])
    unknown.compile("adam", ["sparse_categorical_crossentropy", "mae"])
    with pytest.warns(UserWarning, match="uncompiled: convert cannot tell what output 'scores' predicts"):
        assert not kd.convert(unknown).compiled


def test_a_text_cnn_with_global_max_pooling_converts_whole():
    """Keras' text classifier (embedding, `Conv1D` with a ReLU, `GlobalMaxPooling1D`, dense
    layers) converts whole: the ReLU moves onto the global max (the same function), the
    embedding stays plain; at tiny variances the converted model computes the plain function."""
    tokens = np.random.default_rng(5).integers(0, 50, size=(6, 12))
    plain = keras.Sequential([keras.Input((12,), dtype="int32"), keras.layers.Embedding(50, 8),
                              keras.layers.Conv1D(6, 3, activation="relu"), keras.layers.GlobalMaxPooling1D(),
                              keras.layers.Dense(5, activation="relu"), keras.layers.Dense(3, activation="softmax")])
    converted = kd.convert(plain, **TINY)
    assert [type(layer).__name__ for layer in converted.layers] == [
        "Embedding", "Conv1DDVI", "GlobalMaxPooling1DDVI", "DenseDiagDVI", "DenseDVI"]
    assert converted.layers[1].activation == "linear" and converted.layers[2].activation == "relu"
    mean = kd.unpack(converted(tokens))[0]
    np.testing.assert_allclose(to_numpy(keras.ops.softmax(mean)), to_numpy(plain(tokens)), rtol=1e-4, atol=1e-6)
    images = _images(rows=4, size=9, channels=2)
    inputs = keras.Input((9, 9, 2))
    pooled = keras.layers.GlobalMaxPooling2D()(keras.layers.Conv2D(4, 3)(inputs))
    plain = keras.Model(inputs, keras.layers.Dense(2)(keras.layers.Activation("relu")(pooled)))
    converted = kd.convert(plain, **TINY)
    assert [layer.activation for layer in converted.layers if isinstance(layer, kd.GlobalMaxPooling2DDVI)] == ["relu"]
    np.testing.assert_allclose(to_numpy(kd.unpack(converted(images))[0]), to_numpy(plain(images)), rtol=1e-4, atol=1e-5)


def test_a_converted_model_trains_saves_and_loads(tmp_path):
    """Train plain, convert, fine-tune with the ELBO; the `.keras` file predicts the same; a
    `Normalization` layer keeps its adapted statistics."""
    rng = np.random.default_rng(3)
    x = rng.normal(loc=5.0, scale=3.0, size=(64, 4)).astype("float32")
    labels = (x[:, 0] > 5.0).astype("int32")
    normalization = keras.layers.Normalization()
    normalization.adapt(x)
    plain = keras.Sequential([keras.Input((4,)), normalization, keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(2)])
    plain.compile(keras.optimizers.Adam(1e-2), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    plain.fit(x, labels, epochs=20, verbose=0)
    converted = kd.convert(plain, regularizer=kd.EmpiricalBayesRegularizer(len(x)))
    np.testing.assert_allclose(to_numpy(converted.layers[0].mean), to_numpy(normalization.mean))
    # a classifier (its loss said so) comes back compiled: the keras-dvi loss, a copy of its optimizer
    assert isinstance(converted.loss, kd.SoftmaxDeltaELL) and converted.optimizer is not plain.optimizer
    assert isinstance(converted.optimizer, keras.optimizers.Adam)
    assert float(to_numpy(converted.optimizer.learning_rate)) == pytest.approx(1e-2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # (layers built on their own once each kept a tracker)
        history = converted.fit(x, labels, epochs=3, verbose=0).history
    assert np.isfinite(history["loss"]).all() and "kl" in history
    assert (kd.predict(converted, x)["label"] == labels).mean() > 0.9  # no `task=`: the loss tells
    loaded = reloaded(converted, tmp_path, "converted")
    np.testing.assert_allclose(loaded.predict(x, verbose=0), converted.predict(x, verbose=0), rtol=1e-6, atol=1e-7)


def test_a_classifier_keeps_its_label_smoothing_and_accuracy_metric():
    """The plain loss's label smoothing carries over to `SoftmaxDeltaELL` (it was dropped), its
    accuracy metric to `MeanLogitAccuracy`; a metric without a keras-dvi counterpart, and a
    focal loss, are named in a warning."""
    rng = np.random.default_rng(13)
    x = rng.normal(size=(64, 3)).astype("float32")
    labels = np.eye(3)[(x[:, 0] > 0).astype("int32") + (x[:, 1] > 1).astype("int32")]
    plain = keras.Sequential([keras.Input((3,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(3, activation="softmax")])
    plain.compile("adam", keras.losses.CategoricalCrossentropy(label_smoothing=0.1), metrics=["accuracy", "mae"])
    with pytest.warns(UserWarning, match=r"metric 'mae' is not carried over"):
        converted = kd.convert(plain, regularizer=kd.EmpiricalBayesRegularizer(len(x)))
    assert converted.loss.label_smoothing == pytest.approx(0.1)
    history = converted.fit(x, labels, epochs=1, verbose=0).history
    assert sorted(history) == ["kl", "loss", "mean_logit_accuracy", "nll"]
    logits = keras.Sequential([keras.Input((3,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(3)])
    logits.compile("adam", keras.losses.sparse_categorical_crossentropy)  # a loss function: a classifier too
    assert isinstance(kd.convert(logits, **TINY).loss, kd.SoftmaxDeltaELL)
    # metric objects carry by class (a serialised metric is one entry, not a structure of its
    # arguments: the warning named "'float32', '0.5', 'keras.metrics', 'None'")
    plain.compile("adam", keras.losses.CategoricalCrossentropy(),
                  metrics=[keras.metrics.CategoricalAccuracy(name="acc"), keras.metrics.MeanAbsoluteError(name="mae")])
    with pytest.warns(UserWarning, match=r"metric 'MeanAbsoluteError' is not carried over") as caught:
        converted = kd.convert(plain, **TINY)
    assert "float32" not in str(caught[0].message)
    assert sorted(converted.fit(x, labels, epochs=1, verbose=0).history) == ["kl", "loss", "mean_logit_accuracy", "nll"]
    plain.compile("adam", keras.losses.CategoricalFocalCrossentropy())
    with pytest.warns(UserWarning, match="CategoricalFocalCrossentropy is not carried over.*class_weight"):
        assert isinstance(kd.convert(plain, **TINY).loss, kd.SoftmaxDeltaELL)
    plain.compile("adam", "sparse_categorical_crossentropy")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # nothing dropped, nothing to say
        converted = kd.convert(plain, regularizer=kd.EmpiricalBayesRegularizer(len(x)))
    assert converted.loss.label_smoothing == 0.0 and sorted(converted.fit(
        x, labels.argmax(-1), epochs=1, verbose=0).history) == ["kl", "loss", "nll"]


@pytest.mark.parametrize("kind", ["sequential", "functional"])
def test_a_regression_compiled_with_the_mean_squared_error_comes_back_with_a_learned_noise(kind, tmp_path):
    """A plain regression under "mse" (a Gaussian of fixed variance) converts to the paper's
    homoscedastic DVI: `HomoscedasticNoise` after the output, compiled with `HeteroscedasticELL`
    and a copy of the optimizer; its mean is the plain prediction at tiny variances, and it
    trains. Under any other loss (here "mae") it comes back uncompiled, as before."""
    rng = np.random.default_rng(12)
    x = rng.normal(size=(96, 3)).astype("float32")
    y = (np.sin(2 * x[:, :1]) + 0.2 * rng.normal(size=(96, 1))).astype("float32")
    layers = [keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(1)]
    if kind == "sequential":
        plain = keras.Sequential([keras.Input((3,)), *layers])
    else:
        inputs = keras.Input((3,))
        plain = keras.Model(inputs, layers[1](layers[0](inputs)))
    plain.compile(keras.optimizers.Adam(5e-3), loss="mse")
    tiny = kd.convert(plain, **TINY)
    assert [type(layer).__name__ for layer in tiny.layers if not isinstance(layer, keras.layers.InputLayer)] == [
        "DenseDiagDVI", "DenseDVI", "HomoscedasticNoise"]
    assert tiny.layers[-1].log_variance_scale == 10.0  # the Appendix H scale (BENCHMARKS.md)
    assert isinstance(tiny.loss, kd.HeteroscedasticELL) and tiny.optimizer is not plain.optimizer
    assert float(to_numpy(tiny.optimizer.learning_rate)) == pytest.approx(5e-3)
    np.testing.assert_allclose(kd.predict(tiny, x)["mean"], to_numpy(plain(x)), rtol=1e-4, atol=1e-5)
    converted = kd.convert(plain, regularizer=kd.EmpiricalBayesRegularizer(len(x)))
    history = converted.fit(x, y, epochs=40, batch_size=32, verbose=0).history
    assert history["nll"][-1] < history["nll"][0] and np.isfinite(history["loss"]).all()
    np.testing.assert_allclose(reloaded(converted, tmp_path, "regression").predict(x, verbose=0), converted.predict(x, verbose=0),
                               rtol=1e-6, atol=1e-7)
    plain.compile(keras.optimizers.Adam(5e-3), loss="mae")
    assert not kd.convert(plain, **TINY).compiled


#: `keras.applications` families that convert: `(constructor, input size, keras-dvi layers it needs)`.
APPLICATIONS = {
    "ResNet50": (keras.applications.ResNet50, 32, {"ZeroPadding2DDVI", "AddDVI"}),
    "ResNet50V2": (keras.applications.ResNet50V2, 32, {"ZeroPadding2DDVI", "BatchNormalizationDVI"}),
    "DenseNet121": (keras.applications.DenseNet121, 32, {"ConcatenateDVI", "BatchNormalizationDVI",
                                                         "AveragePooling2DDVI"}),
    "InceptionV3": (keras.applications.InceptionV3, 75, {"ConcatenateDVI", "AveragePooling2DDVI"}),
    # residual sums `x + scale * r` written as a custom layer (the scale folded into `r`'s convolution)
    "InceptionResNetV2": (keras.applications.InceptionResNetV2, 75, {"ConcatenateDVI", "AddDVI"}),
    "MobileNetV2": (lambda **kw: keras.applications.MobileNetV2(alpha=0.35, **kw), 32,
                    {"DepthwiseConv2DDVI", "ZeroPadding2DDVI", "AddDVI"}),
    # the head: global pooling keeping its dimensions, a 1x1 convolution (the output Dense), Reshape
    "MobileNet": (lambda **kw: keras.applications.MobileNet(alpha=0.25, **kw), 32,
                  {"DepthwiseConv2DDVI", "ZeroPadding2DDVI", "GlobalAveragePooling2DDVI", "DenseDVI"}),
    # separable convolutions (depthwise, then pointwise), ReLUs on maps other layers also read
    "Xception": (keras.applications.Xception, 71, {"DepthwiseConv2DDVI", "ActivationDVI", "AddDVI"}),
    # hard SiLU, gates whose hard sigmoid is written with operations (`ReLU(6.0)(x + 3.0) * (1 / 6)`)
    "MobileNetV3Small": (keras.applications.MobileNetV3Small, 32, {"DepthwiseConv2DDVI", "ZeroPadding2DDVI", "AddDVI",
                                                                   "MultiplyDVI", "DenseDiagDVI"}),
    # separable convolutions, cropping, concatenated branches, batch normalisation after a
    # concatenation (771 layers)
    "NASNetMobile": (keras.applications.NASNetMobile, 32, {"DepthwiseConv2DDVI", "Cropping2DDVI", "ConcatenateDVI",
                                                           "BatchNormalizationDVI", "AveragePooling2DDVI"}),
    # SiLU everywhere, squeeze-and-excitation gates (1x1 convs as dense layers, a sigmoid, Multiply)
    "EfficientNetB0": (keras.applications.EfficientNetB0, 32, {"DepthwiseConv2DDVI", "ZeroPadding2DDVI", "AddDVI",
                                                               "MultiplyDVI", "DenseDiagDVI"}),
    # fused blocks (a plain convolution where V1 has depthwise-then-pointwise), SiLU, gates
    "EfficientNetV2B0": (keras.applications.EfficientNetV2B0, 32, {"DepthwiseConv2DDVI", "AddDVI", "MultiplyDVI"}),
    # layer normalisation of maps and of the pooled vector, depthwise convolutions written as
    # grouped ones, layer scales (folded), residual sums written `x + y`, GELU
    "ConvNeXtTiny": (keras.applications.ConvNeXtTiny, 32, {"LayerNormalizationDVI", "DepthwiseConv2DDVI", "AddDVI"}),
}


#: Families whose randomised plain network is chaotic: EfficientNetV2B0's pooled features move
#: by 7% when its input moves by 1e-7 (float round-off then decides its logits, measured in
#: thousands). Their batch normalisation is calibrated on a batch (a normalised network, as
#: after training), which leaves the statistics and scales far from their initial values.
#: (Calibrated, other families differ from the plain probabilities by 4-6e-5, over `atol`:
#: ResNet50V2 by the ReLUs' Jensen gap, its 1e-12 weight variances grown by the calibrated
#: scales, plus the variance floor's standard deviation of 1e-6 at every unit - in float64
#: 3.9e-5, 8e-6 with variances of 1e-16, 7e-15 with the floor lowered too; MobileNetV3Small by
#: float32 round-off, 8e-9 in float64.)
CHAOTIC_UNCALIBRATED = ("EfficientNetV2B0",)


@pytest.mark.heavy
@pytest.mark.parametrize("family", sorted(APPLICATIONS))
def test_keras_applications_compute_the_plain_function(family):
    """Keras' own architectures (random weights, batch normalisation statistics randomised so
    that folding and `BatchNormalizationDVI` matter): with the posterior variances shrunk to
    zero the converted model's class probabilities are the plain model's."""
    build, size, needs = APPLICATIONS[family]
    keras.utils.set_random_seed(0)
    plain = build(weights=None, input_shape=(size, size, 3), classes=5)
    randomise_batch_norm(plain)
    if family in CHAOTIC_UNCALIBRATED:
        calibrate_batch_norm(plain, _images(rows=32, size=size, channels=3, seed=1))
    x = _images(rows=2, size=size, channels=3)
    converted = kd.convert(plain, **TINY)
    kinds = {type(layer).__name__ for layer in converted.layers}
    assert needs <= kinds and not kinds & {"BatchNormalization", "LayerNormalization"}, kinds
    if family in ("MobileNetV2", "MobileNetV3Small", "EfficientNetB0", "EfficientNetV2B0"):
        # ReLU(6.0) folds in as relu6, swish as silu
        activations = {getattr(layer, "activation", None) for layer in converted.layers}
        expected = {"MobileNetV2": {"relu6"}, "MobileNetV3Small": {"hard_silu", "hard_sigmoid"},
                    "EfficientNetB0": {"silu"}, "EfficientNetV2B0": {"silu", "sigmoid"}}[family]
        assert expected <= activations, activations
    mean, _ = kd.unpack(converted(x))
    probabilities = to_numpy(keras.ops.softmax(mean))
    np.testing.assert_allclose(probabilities, to_numpy(plain(x, training=False)), atol=2e-5)
    np.testing.assert_allclose(to_numpy(mean), _logits(plain, x), rtol=1e-3, atol=1e-3 * np.abs(_logits(plain, x)).max())


class ScaledResidual(keras.layers.Layer):
    """InceptionResNetV2's residual sum as `keras.applications` writes it (its
    `CustomScaleLayer`): `x + scale * r`."""

    def __init__(self, scale, **kwargs):
        super().__init__(**kwargs)
        self.scale = scale

    def get_config(self):
        return {**super().get_config(), "scale": self.scale}

    def call(self, inputs):
        return inputs[0] + inputs[1] * self.scale


def _inception_resnet_block(form, branch_activation=None, blocks=1):
    """A stem and `blocks` Inception-ResNet blocks: two branches concatenated, a linear 1x1
    convolution `r` back to the stem's width, the residual sum `form` of the block's input and
    `r`, a ReLU; then pooling, a softmax head."""
    keras.utils.set_random_seed(5)
    images = keras.Input((8, 8, 3))
    x = keras.layers.Conv2D(8, 3, padding="same", activation="relu")(images)
    for block in range(blocks):
        branches = keras.layers.Concatenate()([keras.layers.Conv2D(4, 1, activation="relu")(x),
                                               keras.layers.Conv2D(4, 3, padding="same", activation="relu")(x)])
        residual = keras.layers.Conv2D(8, 1, activation=branch_activation, name=f"up{block or ''}")(branches)
        x = {"custom": lambda: ScaledResidual(0.17, name=f"sum{block or ''}")([x, residual]),
             "lambda": lambda: keras.layers.Lambda(lambda t: t[0] + 0.17 * t[1], name="sum")([x, residual]),
             "subtract": lambda: x - residual}[form]()
        x = keras.layers.Activation("relu")(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(images, keras.layers.Dense(3, activation="softmax")(x))


@pytest.mark.parametrize("form, scales", [("custom", (1.0, 0.17)), ("lambda", (1.0, 0.17)), ("subtract", (1.0, -1.0))],
                         ids=["custom", "lambda", "subtract"])
def test_a_scaled_residual_sum_folds_its_scales_into_the_layers_that_feed_it(form, scales):
    """InceptionResNetV2's residual sum `x + scale * r` (a custom layer), a `Lambda` computing
    the same, and `x - r` written as an operation: found on a probe, each scale folds
    into the linear convolution that feeds the sum alone (its kernel and bias times the scale),
    the sum becomes an `AddDVI` with the ReLU after it, and the converted network computes the
    plain probabilities at tiny variances. A scale on a branch that is not a linear layer
    feeding the sum alone is refused by name; scaled sums block after block (InceptionResNetV2's
    40) get the warning of their measured spread, one does not."""
    plain = _inception_resnet_block(form)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # (one scaled sum: no warning)
        converted = kd.convert(plain, **TINY)
    sums = [layer for layer in converted.layers if isinstance(layer, kd.AddDVI)]
    assert len(sums) == 1 and sums[0].activation == "relu"
    kernel, bias = (to_numpy(t) for t in plain.get_layer("up").weights)
    up = converted.get_layer("up")
    np.testing.assert_allclose(to_numpy(up.kernel_mean), scales[1] * kernel, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(to_numpy(up.bias_mean), scales[1] * bias, rtol=1e-6, atol=1e-7)
    x = _images(rows=4, size=8, channels=3)
    np.testing.assert_allclose(kd.predict(converted, x)["probabilities"], to_numpy(plain(x)), atol=2e-5)
    if form == "custom":
        with pytest.raises(ValueError, match="'sum' adds its two inputs scaled by 1 and 0.17.*'up' .Conv2D."):
            kd.convert(_inception_resnet_block(form, branch_activation="relu"), **TINY)
        with pytest.warns(UserWarning, match="2 residual sums scale a branch .first 'sum'.*InceptionResNetV2"):
            kd.convert(_inception_resnet_block(form, blocks=2), **TINY)


@pytest.mark.heavy
@pytest.mark.parametrize("family", ["resnet20", "MobileNetV2"])
def test_converted_networks_match_monte_carlo_end_to_end_at_the_default_variances(family):
    """The oracle of the whole network: a CIFAR ResNet-20 (batch normalisation, `Add`, strided
    projections) and MobileNetV2 (alpha 0.35; ReLU6, depthwise convolutions, zero padding), 32x32,
    random weights, batch normalisation calibrated on 32 images, converted with the default
    posterior variances, against 300 draws of the weights through `predict_samples` (the
    standard error of a variance ratio is 0.08). Measured (seeds 0 and 1 of the experiment
    script): the logits' variance over Monte Carlo's 0.61-1.06 (ResNet-20) and 0.74-1.32
    (MobileNetV2), means within 0.48 sd; the median over the last feature map's units 0.70
    (ResNet-20: the Gaussian and one-factor-per-channel approximations compound over 19
    convolutions) and 1.03-1.13 (MobileNetV2, whose last map is 1x1). Dropping the shared component, or scaling every
    activation's variance by 0.8 or 1.25, takes both networks out of these bands.
    `benchmarks/experiments/converted_against_monte_carlo.py` measures the other families."""
    (ratio, error), feature_map = agreements(family, seed=0)
    assert 0.5 < ratio.min() and ratio.max() < 1.8 and 0.7 < np.median(ratio) < 1.25, ratio
    assert error.max() < 0.6, error
    ratio, error = feature_map
    low, high = {"resnet20": (0.6, 1.25), "MobileNetV2": (0.9, 1.15)}[family]  # (median of the last map)
    assert low < np.median(ratio) < high and np.quantile(ratio, 0.1) > 0.3, np.quantile(ratio, [0.1, 0.5, 0.9])
    assert np.median(error) < 0.2, np.quantile(error, [0.5, 0.9])


def _transformer_classifier():
    """keras.io's Transformer text classifier, small: embedding, self-attention, layer
    normalisation, a feed-forward block with residual `+` operations, pooling, a dense head."""
    inputs = keras.Input((12,), dtype="int32")
    h = keras.layers.Embedding(50, 16)(inputs)
    h = keras.layers.LayerNormalization()(h + keras.layers.MultiHeadAttention(2, 8)(h, h))
    feed = keras.layers.Dense(16)(keras.layers.Dense(16, activation="relu")(h))
    h = keras.layers.LayerNormalization()(h + feed)
    h = keras.layers.Dropout(0.1)(keras.layers.GlobalAveragePooling1D()(h))
    h = keras.layers.Dropout(0.1)(keras.layers.Dense(20, activation="relu")(h))
    return keras.Model(inputs, keras.layers.Dense(3, activation="softmax")(h))


def test_last_layers_of_a_transformer_become_bayesian_and_the_body_stays_plain():
    """`last_layers=2`: the two head `Dense` layers become keras-dvi layers (the dropout between
    them an identity); embedding, attention, normalisation and the `+` operations stay plain,
    as copies with the plain model's weights; tiny variances compute the plain probabilities."""
    keras.utils.set_random_seed(0)
    plain = _transformer_classifier()
    x = np.random.default_rng(0).integers(0, 50, (5, 12)).astype("int32")
    converted = kd.convert(plain, last_layers=2, **TINY)
    kinds = [type(layer).__name__ for layer in converted.layers]
    assert kinds[-2:] == ["DenseDiagDVI", "DenseDVI"] and "MultiHeadAttention" in kinds and "Dropout" in kinds, kinds
    assert kd.DenseDVI not in {type(layer) for layer in converted.layers[:-2]}
    by_name = {layer.name: layer for layer in plain.layers}
    for layer in converted.layers[:-2]:
        if layer.weights:
            assert layer is not by_name[layer.name]  # a copy: training it leaves the plain model as it was
            for a, b in zip(layer.get_weights(), by_name[layer.name].get_weights()):
                np.testing.assert_array_equal(a, b)
    mean, _ = kd.unpack(converted(x))
    np.testing.assert_allclose(to_numpy(keras.ops.softmax(mean)), to_numpy(plain(x)), atol=1e-6)
    assert isinstance(converted.loss, kd.SoftmaxDeltaELL)  # ended in a softmax: compiled as a classifier
    np.testing.assert_allclose(kd.predict(converted, x)["probabilities"], to_numpy(plain(x)), atol=1e-5)


def test_last_layers_keep_a_frozen_nested_backbone_frozen(tmp_path):
    keras.utils.set_random_seed(1)
    backbone = keras.Sequential([keras.Input((8, 8, 3)), keras.layers.Conv2D(4, 3, activation="relu"),
                                 keras.layers.BatchNormalization(), keras.layers.GlobalAveragePooling2D()],
                                name="backbone")
    randomise_batch_norm(backbone)
    backbone.trainable = False
    inputs = keras.Input((8, 8, 3))
    h = keras.layers.Dense(6, activation="relu")(backbone(inputs))
    plain = keras.Model(inputs, keras.layers.Dense(3, activation="softmax")(h))
    x = _images(rows=6, size=8, channels=3)
    prior = kd.EmpiricalBayesRegularizer(6)
    converted = kd.convert(plain, regularizer=prior, last_layers=2)
    assert [type(layer).__name__ for layer in converted.layers] == ["InputLayer", "Sequential", "DenseDiagDVI",
                                                                     "DenseDVI"]
    copy = converted.layers[1]
    assert copy is not backbone and not copy.trainable and not copy.trainable_weights
    before = [w.copy() for w in copy.get_weights()]
    converted.compile(keras.optimizers.Adam(1e-2), loss=kd.SoftmaxDeltaELL())
    history = converted.fit(x, np.arange(6) % 3, epochs=2, verbose=0).history
    assert set(history) >= {"loss", "nll", "kl"} and np.isfinite(history["loss"]).all()
    for a, b in zip(copy.get_weights(), before):
        np.testing.assert_array_equal(a, b)  # frozen
    loaded = reloaded(converted, tmp_path, "last_layers")
    np.testing.assert_allclose(to_numpy(loaded(x)), to_numpy(converted(x)), rtol=1e-6, atol=1e-6)


@pytest.mark.heavy
def test_last_layer_of_convnext_becomes_bayesian():
    """ConvNeXt (a nested stem model, GELU, layer normalisation, LayerScale, depthwise
    convolutions written as grouped ones; it converts whole too) keeps its body plain under a
    keras-dvi classifier."""
    keras.utils.set_random_seed(2)
    plain = keras.applications.ConvNeXtTiny(weights=None, input_shape=(32, 32, 3), classes=5)
    converted = kd.convert(plain, last_layers=1, **TINY)
    assert type(converted.layers[-1]).__name__ == "DenseDVI"
    assert not any(isinstance(layer, kd.layers.boundary.KerasDVILayer) for layer in converted.layers[:-1])
    x = _images(rows=2, size=32, channels=3)
    mean, _ = kd.unpack(converted(x))
    np.testing.assert_allclose(to_numpy(keras.ops.softmax(mean)), to_numpy(plain(x, training=False)), atol=1e-6)


def test_sums_of_correlated_twins_warn_and_residual_sums_do_not():
    """`AddDVI` takes its inputs as independent. A sum of two branches computed without weights
    from one tensor (NASNet's pooled twins) is far from that, and `convert` says so; a residual
    sum `x + f(x)`, whose `f` has weights, is not warned about. The warned sum's variance
    against Monte Carlo over the weights shows why: about half (its exact value is four times
    a pooled branch's, the independent sum's two)."""
    inputs = keras.Input((8, 8, 2))
    h = keras.layers.Conv2D(4, 3, padding="same", activation="relu")(inputs)
    pooled = [keras.layers.AveragePooling2D(3, strides=1, padding="same")(h) for _ in range(2)]
    twins = keras.layers.Add(name="twins")(pooled)
    residual = keras.layers.Add(name="residual")([twins, keras.layers.Conv2D(4, 3, padding="same")(twins)])
    plain = keras.Model(inputs, keras.layers.Dense(3)(keras.layers.GlobalAveragePooling2D()(residual)))
    with pytest.warns(UserWarning, match=r"1 Add layers \(first 'twins'\) sum two branches computed without weights"):
        converted = kd.convert(plain, regularizer=kd.EmpiricalBayesRegularizer(100))
    probe = keras.Model(converted.inputs, converted.get_layer("twins").output)
    x = _images(rows=2, size=8, channels=2)
    _, variance = (to_numpy(t) for t in kd.unpack(probe(x)))
    samples = kd.predict_samples(probe, x, 2000, seed=0).astype("float64")
    assert 0.4 < np.median(variance / samples.var(1)) < 0.6
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        kd.convert(keras.Model(inputs, keras.layers.Add()([h, keras.layers.Conv2D(4, 3, padding="same")(h)])))
    assert not [w for w in record if "computed without weights" in str(w.message)]


def test_nested_models_convert_layer_by_layer():
    """A backbone nested under a head (the transfer-learning way of writing a model) and models
    nested two deep convert as one graph of their layers: copies with the plain weights (the
    plain model is left as it was), computing the plain function at tiny variances."""
    keras.utils.set_random_seed(4)
    backbone = keras.applications.MobileNetV2(alpha=0.35, include_top=False, pooling="avg", weights=None,
                                              input_shape=(32, 32, 3))
    randomise_batch_norm(backbone)
    plain = keras.Sequential([keras.Input((32, 32, 3)), backbone, keras.layers.Dense(5, activation="softmax")])
    before = [w.copy() for w in plain.get_weights()]
    converted = kd.convert(plain, **TINY)
    kinds = {type(layer).__name__ for layer in converted.layers}
    assert {"DepthwiseConv2DDVI", "AddDVI", "GlobalAveragePooling2DDVI", "DenseDVI"} <= kinds, kinds
    assert not any(isinstance(layer, keras.Model) for layer in converted.layers)
    assert isinstance(converted.loss, kd.SoftmaxDeltaELL)  # ended in a softmax: compiled as a classifier
    x = _images(rows=2, size=32, channels=3)
    mean, _ = kd.unpack(converted(x))
    np.testing.assert_allclose(to_numpy(keras.ops.softmax(mean)), to_numpy(plain(x, training=False)), atol=2e-5)
    for a, b in zip(plain.get_weights(), before):
        np.testing.assert_array_equal(a, b)
    # two deep: a Sequential between layers of a functional model that the input feeds, under a head
    block = keras.Sequential([keras.Input((8, 8, 4)), keras.layers.Conv2D(4, 3, padding="same", use_bias=False),
                              keras.layers.BatchNormalization(), keras.layers.ReLU()], name="block")
    randomise_batch_norm(block)
    body_inputs = keras.Input((8, 8, 3))
    h = keras.layers.Conv2D(4, 1, activation="relu")(body_inputs)
    body = keras.Model(body_inputs, keras.layers.Add()([h, block(h)]), name="body")
    inputs = keras.Input((8, 8, 3))
    plain = keras.Model(inputs, keras.layers.Dense(3)(keras.layers.GlobalAveragePooling2D()(body(inputs))))
    converted = kd.convert(plain, **TINY)
    assert [type(layer).__name__ for layer in converted.layers][1:] == [
        "Conv2DDVI", "Conv2DDVI", "AddDVI", "GlobalAveragePooling2DDVI", "DenseDVI"]  # the normalisation folded
    x = _images(rows=3, size=8, channels=3)
    mean, _ = kd.unpack(converted(x))
    np.testing.assert_allclose(to_numpy(mean), to_numpy(plain(x, training=False)), rtol=1e-4, atol=1e-5)
    # a nested functional model on an intermediate tensor: refused by name
    h = keras.layers.Conv2D(3, 1)(inputs)
    plain = keras.Model(inputs, keras.layers.Dense(3)(keras.layers.GlobalAveragePooling2D()(body(h))))
    with pytest.raises(ValueError, match="nested functional model 'body' is called on an intermediate tensor.*"
                                         "last_layers"):
        kd.convert(plain)


def test_last_layers_misuse_is_refused():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(5, activation="softplus"), keras.layers.Dense(3)])
    assert [type(layer).__name__ for layer in kd.convert(model, last_layers=1).layers] == ["Dense", "DenseDVI"]
    for bad in (0, True, 1.5):
        with pytest.raises(ValueError, match="`last_layers`"):
            kd.convert(model, last_layers=bad)
    with pytest.raises(ValueError, match="at most 2"):
        kd.convert(model, last_layers=3)
    inputs = keras.Input((4,))
    h = keras.layers.Dense(4, name="first")(inputs)
    skip = keras.Model(inputs, keras.layers.Dense(2)(keras.layers.Add()([keras.layers.Dense(4)(h), inputs])))
    with pytest.raises(ValueError, match="skip connection"):
        kd.convert(skip, last_layers=2)


def _gated_network(gate):
    """A squeeze-and-excitation block whose gate is `gate(x)` of the gate convolution's output
    (MobileNetV3's is `ReLU(6.0)(x + 3.0) * (1.0 / 6.0)`), under a small classifier; the input
    scaled by an operation (plain preprocessing)."""
    inputs = keras.Input((8, 8, 3))
    h = keras.layers.Conv2D(4, 3, padding="same", activation="relu")(inputs / 2.0)
    g = keras.layers.GlobalAveragePooling2D(keepdims=True)(h)
    g = keras.layers.Conv2D(2, 1, activation="relu")(g)
    g = gate(keras.layers.Conv2D(4, 1, name="gate_conv")(g))
    h = keras.layers.Multiply()([h, g])
    h = keras.layers.GlobalAveragePooling2D()(h)
    return keras.Model(inputs, keras.layers.Dense(3, activation="softmax")(h))


@pytest.mark.parametrize("gate, activation", [
    (lambda x: keras.layers.ReLU(6.0)(x + 3.0) * (1.0 / 6.0), "hard_sigmoid"),  # MobileNetV3's
    (lambda x: keras.ops.divide(keras.layers.ReLU(6.0)(3.0 + x), 6.0), "hard_sigmoid"),  # scalar first, a divide
    (lambda x: keras.ops.sigmoid(x), "sigmoid"),  # a keras.ops call
    (lambda x: keras.ops.tanh(x), "tanh"),
    (lambda x: keras.layers.Activation("relu")(x * 1.0), "relu"),  # an operation, then an activation layer
])
def test_operations_that_compute_an_activation_fold_into_the_layer_before_them(gate, activation):
    """A chain of operations on tensors (and activation layers) after a layer that computes a
    supported activation elementwise becomes that layer's activation; the converted model
    computes the plain function at tiny variances."""
    keras.utils.set_random_seed(3)
    plain = _gated_network(gate)
    converted = kd.convert(plain, **TINY)
    gate_layer = next(layer for layer in converted.layers if layer.name == "gate_conv")
    assert isinstance(gate_layer, kd.DenseDiagDVI) and gate_layer.activation == activation
    assert "MultiplyDVI" in {type(layer).__name__ for layer in converted.layers}
    x = _images(rows=3, size=8, channels=3)
    mean, _ = kd.unpack(converted(x))
    np.testing.assert_allclose(to_numpy(keras.ops.softmax(mean)), to_numpy(plain(x)), atol=1e-6)


def test_operations_after_a_batch_normalisation_fold_with_it():
    """keras.io's DeepLabV3+ writes its blocks `ops.nn.relu(BatchNormalization()(conv(x)))`: the
    batch normalisation folds into the convolution and the operation's activation joins it;
    after a concatenation, where nothing can take the batch normalisation, the activation goes
    to the `BatchNormalizationDVI`. The converted model computes the plain function at tiny
    variances."""
    keras.utils.set_random_seed(4)
    layers = keras.layers
    inputs = keras.Input((8, 8, 3))
    h = keras.ops.nn.relu(layers.BatchNormalization()(layers.Conv2D(4, 3, padding="same", name="first")(inputs)))
    h = layers.Concatenate()([h, layers.Conv2D(2, 1, activation="relu")(h)])
    h = keras.ops.nn.relu6(layers.BatchNormalization(name="joined")(h) * 1.0)
    h = layers.GlobalAveragePooling2D()(layers.Conv2D(4, 3)(h))
    plain = keras.Model(inputs, layers.Dense(3, activation="softmax")(h))
    randomise_batch_norm(plain)
    converted = kd.convert(plain, **TINY)
    kinds = {layer.name: layer for layer in converted.layers}
    assert isinstance(kinds["first"], kd.Conv2DDVI) and kinds["first"].activation == "relu"
    assert isinstance(kinds["joined"], kd.BatchNormalizationDVI) and kinds["joined"].activation == "relu6"
    x = _images(rows=3, size=8, channels=3)
    mean, _ = kd.unpack(converted(x))
    np.testing.assert_allclose(to_numpy(keras.ops.softmax(mean)), to_numpy(plain(x)), atol=1e-6)


def test_operations_that_compute_no_supported_activation_are_refused_by_name():
    for gate in (lambda x: x * 2.0,  # affine, no activation
                 lambda x: keras.layers.ReLU(6.0)(x + 3.0),  # relu6(x + 3): a shifted ReLU6
                 lambda x: keras.ops.softplus(x)):
        with pytest.raises(ValueError, match="operation '.*' \\(keras.ops [A-Za-z]+: an operator or keras.ops call"):
            kd.convert(_gated_network(gate))
    # a gate computed from the feature map itself, not from its layer alone, is no activation
    inputs = keras.Input((8, 8, 3))
    h = keras.layers.Conv2D(4, 3, padding="same")(inputs)
    with pytest.raises(ValueError, match="operation 'mean[_0-9]*' \\(keras.ops Mean"):
        kd.convert(keras.Model(inputs, keras.layers.Flatten()(h - keras.ops.mean(h, axis=-1, keepdims=True))))


def test_what_cannot_be_converted_is_refused_by_name():
    def refused(layers, match):
        model = keras.Sequential([keras.Input((8,))] + layers)
        with pytest.raises(ValueError, match=match):
            kd.convert(model)

    refused([keras.layers.Dense(4, activation="softplus"), keras.layers.Dense(2)], "'dense.*' has activation 'softplus'")
    refused([keras.layers.Dense(4, activation="relu"), keras.layers.Reshape((2, 2)),
             keras.layers.BatchNormalization(axis=1, name="norm"), keras.layers.Flatten(), keras.layers.Dense(2)],
            "BatchNormalization 'norm' can be folded only into a linear")  # (not on a vector's units)
    refused([keras.layers.Dense(4), keras.layers.Activation("elu", name="act"), keras.layers.Dense(2)],
            "activation layer 'act' \\(Activation 'elu'\\).*convert only the layers after it \\(`last_layers=k`\\)")
    # on a feature map that another layer also reads: an ActivationDVI, if keras-dvi has the function's rule
    inputs = keras.Input((6, 6, 2))
    h = keras.layers.Conv2D(3, 3)(inputs)
    h = keras.layers.Add()([h, keras.layers.Conv2D(3, 1)(keras.layers.Activation("softplus", name="soft")(h))])
    with pytest.raises(ValueError, match="activation layer 'soft' \\(Activation 'softplus'\\).*softplus, ELU"):
        kd.convert(keras.Model(inputs, keras.layers.Flatten()(h)))
    # an operation on a tensor (MobileNetV3's hard sigmoid is `relu6(x + 3.0) * (1 / 6)`), named as one
    inputs = keras.Input((6, 6, 2))
    h = keras.layers.Conv2D(3, 3)(inputs)
    h = keras.layers.Conv2D(3, 1)(h + 3.0)
    with pytest.raises(ValueError, match="operation 'add[_0-9]*' \\(keras.ops Add: an operator or keras.ops call"):
        kd.convert(keras.Model(inputs, keras.layers.Flatten()(h)))
    # a global pooling keeping its dimensions for anything but a channel-vector head
    inputs = keras.Input((6, 6, 2))
    h = keras.layers.Conv2D(3, 3)(inputs)
    h = keras.layers.Add()([h, keras.layers.GlobalAveragePooling2D(keepdims=True, name="keep")(h)])
    with pytest.raises(ValueError, match="'keep' keeps its dimensions"):
        kd.convert(keras.Model(inputs, keras.layers.Flatten()(h)))
    refused([keras.layers.Dense(4), keras.layers.Dense(3, activation="softmax"), keras.layers.Dense(2)],
            "applies a softmax inside the network")
    refused([keras.layers.Dense(4), keras.layers.Reshape((2, 2)), keras.layers.LSTM(2, name="lstm")],
            "Reshape 'reshape.*' must rearrange the positions of a channels-last feature map")
    already = keras.Sequential([keras.Input((8,)), kd.DenseDVI(2)])
    with pytest.raises(ValueError, match="already has keras-dvi layers"):
        kd.convert(already)
    class Subclassed(keras.Model):
        def call(self, inputs):
            return inputs

    with pytest.raises(ValueError, match="built Sequential or functional"):
        kd.convert(Subclassed())
    inner = Subclassed()
    inner(np.zeros((1, 8), "float32"))
    with pytest.raises(ValueError, match="nested model that convert cannot read here: a subclassed.*last_layers"):
        kd.convert(keras.Sequential([keras.Input((8,)), keras.layers.Dense(4), inner, keras.layers.Dense(2)]))
    # layers with no accurate Gaussian rule, named with the reason
    vectors, sequences = keras.Input((4,)), keras.Input((6, 4))
    for inputs, first, layer, reason in (
            (vectors, keras.layers.Dense(4), keras.layers.UnitNormalization(name="no_rule"),
             "divides each unit by a statistic"),
            (sequences, keras.layers.Conv1D(4, 1), keras.layers.LSTM(3, name="no_rule"), "feeds its random state back")):
        with pytest.raises(ValueError, match=f"'no_rule' \\({type(layer).__name__}\\) has no accurate Gaussian "
                                             f"moment rule \\(it {reason}.*last_layers=k"):
            kd.convert(keras.Model(inputs, keras.layers.Dense(2)(layer(first(inputs)))))
    inputs = keras.Input((2, 6, 6))
    h = keras.layers.Conv2D(3, 3, data_format="channels_first")(inputs)
    with pytest.raises(ValueError, match="Dense 'spatial' acts on the last axis of a channels-first feature map"):
        kd.convert(keras.Model(inputs, keras.layers.Dense(2, name="spatial")(h)))
    with pytest.raises(ValueError, match="hidden_covariance"):
        kd.convert(keras.Sequential([keras.Input((8,)), keras.layers.Dense(2)]), hidden_covariance="block")


# ------------------------------------------------------------------ deployment


def _mobile_block():
    """MobileNetV2's block in small: conv, batch normalisation, ReLU6, a depthwise convolution
    with batch normalisation, the residual `Add`, zero padding, max pooling, a batch
    normalisation that cannot fold (`BatchNormalizationDVI`), global pooling, a softmax head."""
    inputs = keras.Input((8, 8, 3))
    h = keras.layers.Conv2D(4, 3, padding="same", use_bias=False)(inputs)
    h = keras.layers.ReLU(6.0)(keras.layers.BatchNormalization()(h))
    branch = keras.layers.DepthwiseConv2D(3, padding="same", use_bias=False)(h)
    branch = keras.layers.BatchNormalization()(branch)
    h = keras.layers.ReLU()(keras.layers.Add()([h, branch]))
    h = keras.layers.MaxPooling2D(2)(keras.layers.ZeroPadding2D(1)(h))
    h = keras.layers.GlobalAveragePooling2D()(keras.layers.BatchNormalization()(h))
    return keras.Model(inputs, keras.layers.Dense(3, activation="softmax")(h))


def _deployable(kind):
    """`(keras-dvi model at its default variances, input)` of each kind of network."""
    from tests.test_map_layers import _squeeze_excitation_network

    if kind == "dense":  # full covariances: the paper's cross-covariances, DenseDVI's head
        model = keras.Sequential([keras.Input((3,)), kd.DenseDiagDVI(8, "relu"), kd.DenseDVI(6, "relu"), kd.DenseDVI(2)])
        return model, np.random.default_rng(0).normal(size=(5, 3)).astype("float32")
    if kind == "cnn":  # Gaussian max pooling with the ReLU on it, flatten, dense head
        model = keras.Sequential([keras.Input((10, 10, 1)), kd.Conv2DDVI(4, 3), kd.MaxPooling2DDVI(activation="relu"),
                                  kd.Conv2DDVI(4, 2, activation="relu"), kd.FlattenDVI(), kd.DenseDVI(3)])
        return model, _images(rows=5)
    plain = _mobile_block() if kind == "mobilenet" else _squeeze_excitation_network()
    randomise_batch_norm(plain)
    model = kd.convert(plain, regularizer=kd.EmpiricalBayesRegularizer(num_train=100))
    return model, _images(rows=5, size=8, channels=3)


@pytest.mark.parametrize("kind", ["dense", "cnn", "mobilenet", "squeeze_excitation"])
def test_networks_export_and_convert_to_tflite_builtins(kind, tmp_path):
    """`model.export` (a SavedModel) and TFLite with builtin operations only (no TensorFlow
    fallback, no custom operations; a dynamic batch dimension) predict what the Keras model
    predicts: full covariances, max pooling, folded batch normalisation, ReLU6, depthwise
    convolutions, `Add`, SiLU / sigmoid / GELU and `MultiplyDVI`. On TensorFlow and on JAX
    (whose export is a jax2tf SavedModel: there TFLite refused the gathers that indexing becomes
    with a dynamic batch size, and 5-D comparisons)."""
    import tensorflow as tf

    model, x = _deployable(kind)
    expected = model.predict(x, verbose=0)
    assert np.isfinite(expected).all() and np.abs(expected).max() > 0
    tolerance = {"rtol": 1e-5, "atol": 1e-6 * np.abs(expected).max()}
    model.export(str(tmp_path / "saved"), verbose=False)
    saved = tf.saved_model.load(str(tmp_path / "saved"))  # (held: its variables live as long as it does)
    np.testing.assert_allclose(saved.serve(tf.constant(x)).numpy(), expected, **tolerance)
    converter = tf.lite.TFLiteConverter.from_saved_model(str(tmp_path / "saved"))  # (the export above)
    converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (tf.lite.Interpreter's deprecation notice)
        interpreter = tf.lite.Interpreter(model_content=converter.convert())
    index = interpreter.get_input_details()[0]["index"]
    interpreter.resize_tensor_input(index, x.shape)
    interpreter.allocate_tensors()
    interpreter.set_tensor(index, x)
    interpreter.invoke()
    lite = interpreter.get_tensor(interpreter.get_output_details()[0]["index"])
    np.testing.assert_allclose(lite, expected, **tolerance)
