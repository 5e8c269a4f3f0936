"""Layers on vectors (dense keras-dvi outputs: means and variances, or a full covariance, and
data): `AddDVI` and `ConcatenateDVI` (residual MLPs, multi-input, wide and deep networks),
`BatchNormalizationDVI` and `ActivationDVI` (a vector's units).

The oracle of the maths is Monte Carlo through Keras' own `Add`, `Concatenate`,
`BatchNormalization` and `Activation`: Gaussian vectors are drawn (deterministic, with
variances, with a full covariance; independent of each other), pushed through the Keras layer,
and the samples' means and covariances are compared with keras-dvi's within 5 standard errors.
Networks of the layers are checked against Monte Carlo over the weights, saved and loaded, and
misused.
"""

import warnings

import keras
import numpy as np
import pytest

import keras_dvi as kd
from keras_dvi import packing
from keras_dvi.maths import moments
from tests.conftest import reloaded, to_numpy

N = 20_000
BATCH = 3


def _vector(kind, features, seed):
    """`(mean, second)` of `features` Gaussian units: `second` `None`, variances or a covariance."""
    rng = np.random.default_rng(seed)
    mean = rng.normal(size=(BATCH, features))
    if kind == "deterministic":
        return mean, None
    if kind == "diagonal":
        return mean, rng.uniform(0.2, 2.0, (BATCH, features))
    factor = rng.normal(size=(BATCH, features, features))
    return mean, factor @ np.swapaxes(factor, 1, 2) / features + 0.1 * np.eye(features)


def _draw(vector, seed):
    """`(N, batch, features)` draws of a vector's Gaussian."""
    mean, second = vector
    rng = np.random.default_rng(seed)
    z = rng.normal(size=(N,) + mean.shape)
    if second is None:
        return np.broadcast_to(mean, z.shape)
    if second.ndim == 2:
        return mean + np.sqrt(second) * z
    return mean + np.einsum("bij,nbj->nbi", np.linalg.cholesky(second), z)


def _through(layer, samples):
    """A plain Keras layer on every draw of every row of a list of `(N, batch, features)` inputs
    (one input: a list of one)."""
    rows = [keras.ops.convert_to_tensor(s.reshape(N * BATCH, -1).astype("float32")) for s in samples]
    return to_numpy(layer(rows if len(rows) > 1 else rows[0])).astype("float64").reshape(N, BATCH, -1)


def _assert_matches(samples, mean, second, approximate=0.0):
    """Means, and the covariances (or variances: zero covariances), within 5 standard errors;
    with `approximate`, the covariances off the diagonal within that much more of the units'
    standard deviations' product."""
    mean, second = np.asarray(mean, "float64"), None if second is None else np.asarray(second, "float64")
    centred = samples - samples.mean(0)
    mc_cov = np.einsum("nbi,nbj->bij", centred, centred) / N
    sd = np.sqrt(np.maximum(np.diagonal(mc_cov, axis1=1, axis2=2), 1e-12))
    np.testing.assert_array_less(np.abs(mean - samples.mean(0)), 5 * sd / np.sqrt(N) + 1e-6)  # (float32 round-off)
    covariance = (np.zeros_like(mc_cov) if second is None
                  else second if second.ndim == 3 else np.eye(second.shape[-1]) * second[:, None, :])
    products = np.einsum("nbi,nbj->nbij", centred, centred)
    cov_se = np.sqrt(np.mean((products - mc_cov) ** 2, axis=0) / N)
    off = approximate * sd[:, :, None] * sd[:, None, :] * (1 - np.eye(sd.shape[-1]))
    np.testing.assert_array_less(np.abs(covariance - mc_cov), 5 * cov_se + off + 1e-6)


KINDS = ["deterministic", "diagonal", "full"]


@pytest.mark.parametrize("first", KINDS)
@pytest.mark.parametrize("second", KINDS)
def test_sums_and_concatenations_match_monte_carlo_through_keras_layers(first, second):
    a, b = _vector(first, 4, 0), _vector(second, 4, 1)
    draws = [_draw(a, 2), _draw(b, 3)]
    summed = moments.add_moments(a, b)
    _assert_matches(_through(keras.layers.Add(), draws), *summed)
    assert (summed[1] is None) == (first == second == "deterministic")
    assert summed[1] is None or summed[1].ndim == (3 if "full" in (first, second) else 2)
    c = _vector("diagonal", 2, 4)
    joined = moments.concatenate_moments([a, c, b])  # three parts: the middle block in its place
    _assert_matches(_through(keras.layers.Concatenate(), [draws[0], _draw(c, 5), draws[1]]), *joined)
    assert joined[1].ndim == (3 if "full" in (first, second) else 2)


def _assert_moments_match(samples, layer, vector):
    """`layer`'s moments of the packed `vector` against Monte Carlo `samples`; a full covariance
    through a ReLU (Wu et al.'s approximation off the diagonal) with covariances within 0.02 of
    the units' standard deviations' product (measured: within 0.01, Monte Carlo error included)."""
    packed = packing.pack(*(keras.ops.convert_to_tensor(t.astype("float32")) for t in vector))
    out_mean, out_second = (to_numpy(t) for t in kd.unpack(layer(packed)))
    _assert_matches(samples, out_mean, out_second,
                    approximate=0.02 if out_second.ndim == 3 and layer.activation != "linear" else 0.0)


@pytest.mark.parametrize("kind", ["diagonal", "full"])
@pytest.mark.parametrize("activation", [None, "relu"])
def test_batch_normalisation_and_activations_of_vectors_match_monte_carlo_through_keras_layers(kind, activation):
    vector = _vector(kind, 4, 9)
    samples = _draw(vector, 10)
    rng = np.random.default_rng(11)
    weights = [np.array([-1.5, 0.7, 2.0, 1.1]), rng.normal(size=4), rng.normal(size=4), rng.uniform(0.3, 3, 4)]
    norm = keras.layers.BatchNormalization(epsilon=1e-2)
    norm.build((None, 4))
    norm.set_weights(weights)  # gamma (one negative scale), beta, statistics
    layer = kd.BatchNormalizationDVI(epsilon=1e-2, activation=activation)
    layer.build((None, 5 if kind == "full" else 2, 4))
    layer.set_weights(weights)
    normalised = _through(norm, [samples])
    if activation == "relu":
        normalised = _through(keras.layers.ReLU(), [normalised])
    _assert_moments_match(normalised, layer, vector)
    if activation == "relu":
        _assert_moments_match(_through(keras.layers.Activation("relu"), [samples]), kd.ActivationDVI("relu"), vector)


def test_a_sum_of_three_vectors_matches_monte_carlo_through_keras_add():
    """`AddDVI` on three inputs (variances, a full covariance, data): the three summed."""
    parts = [_vector("diagonal", 4, 12), _vector("full", 4, 13), _vector("deterministic", 4, 14)]
    samples = _through(keras.layers.Add(), [_draw(part, 15 + i) for i, part in enumerate(parts)])
    packed = [keras.ops.convert_to_tensor(part[0].astype("float32")) if part[1] is None
              else packing.pack(*(keras.ops.convert_to_tensor(t.astype("float32")) for t in part)) for part in parts]
    mean, covariance = (to_numpy(t) for t in kd.unpack(kd.AddDVI()(packed)))
    _assert_matches(samples, mean, covariance)


def _independent_branches(full):
    """Two inputs, a Bayesian branch on each (linear), their sum normalised (fixed statistics),
    joined with the second input and a third branch, and a linear head: every moment exact
    within the representation (linear layers of independent inputs), so Monte Carlo over the
    weights must agree."""
    prior = kd.EmpiricalBayesRegularizer(100)
    dense = kd.DenseDVI if full else kd.DenseDiagDVI
    first, second = keras.Input((5,)), keras.Input((3,))
    summed = kd.AddDVI()([dense(4, regularizer=prior)(first), dense(4, regularizer=prior)(second)])
    norm = kd.BatchNormalizationDVI()
    joined = kd.ConcatenateDVI()([norm(summed), second, kd.DenseDiagDVI(2, regularizer=prior)(first)])
    model = keras.Model([first, second], kd.DenseDVI(2, regularizer=prior)(joined))
    for layer in model.layers:
        if isinstance(layer, (kd.DenseDVI, kd.DenseDiagDVI)):
            layer.set_posterior(layer.kernel_mean, 0.2, layer.bias_mean)
    rng = np.random.default_rng(16)
    norm.set_weights([np.array([-1.5, 0.7, 2.0, 1.1]), rng.normal(size=4), rng.normal(size=4), rng.uniform(0.3, 3, 4)])
    return model


@pytest.mark.parametrize("full", [False, True], ids=["diagonal", "full"])
def test_networks_of_independent_branches_match_monte_carlo_over_the_weights(full):
    model = _independent_branches(full)
    rng = np.random.default_rng(6)
    x = [rng.normal(size=(4, 5)).astype("float32"), rng.normal(size=(4, 3)).astype("float32")]
    mean, covariance = (to_numpy(t).astype("float64") for t in kd.unpack(model.predict(x, verbose=0), "full"))
    samples = kd.predict_samples(model, x, num_samples=N, seed=7).astype("float64")
    _assert_matches(np.swapaxes(samples, 0, 1), mean, covariance)
    batched = kd.predict_samples(model, x, num_samples=10, batch_size=3, seed=7)  # rows of both inputs
    assert batched.shape == (4, 10, 2)


def test_a_residual_sum_with_an_activation_and_data_inputs():
    """`relu(x + F(x))` in a dense network, and data added to moments: the layer's moments are
    the activation's of the summed moments (`moments.add_moments`, `activation_moments` or
    `activation_covariance`); sampling broadcasts the data over the draws."""
    prior = kd.EmpiricalBayesRegularizer(100)
    inputs = keras.Input((4,))
    h = kd.DenseDiagDVI(4, activation="relu", regularizer=prior)(inputs)
    diagonal = kd.AddDVI("relu")([h, inputs])
    full = kd.AddDVI("relu")([kd.DenseDVI(4, regularizer=prior)(inputs), inputs])
    model = keras.Model(inputs, [diagonal, full, h])
    x = np.random.default_rng(8).normal(size=(5, 4)).astype("float32")
    diagonal, full, h = model(x)
    assert tuple(diagonal.shape) == (5, 2, 4) and tuple(full.shape) == (5, 5, 4)
    mean, variance = kd.unpack(h)
    expected = moments.activation_moments(mean + x, variance, "relu")
    for got, want in zip(kd.unpack(diagonal), expected):
        np.testing.assert_allclose(to_numpy(got), to_numpy(want), rtol=1e-6, atol=1e-7)
    samples = kd.predict_samples(keras.Model(inputs, model.outputs[0]), x, num_samples=3, seed=0)
    assert samples.shape == (5, 3, 4) and (samples >= 0).all()


def test_merging_vectors_saves_and_loads(tmp_path):
    model = _independent_branches(full=False)
    x = [np.ones((2, 5), "float32"), np.ones((2, 3), "float32")]
    loaded = reloaded(model, tmp_path, "merged")
    np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0), rtol=1e-6)


@pytest.mark.filterwarnings("ignore:.*that no keras-dvi layer produced")
def test_misuse_is_refused_by_name():
    prior = kd.EmpiricalBayesRegularizer(100)
    inputs = keras.Input((4,))
    h = kd.DenseDiagDVI(4, regularizer=prior)(inputs)
    with pytest.raises(ValueError, match="adds vectors of the same width; received 4 and 3"):
        kd.AddDVI(name="sum")([h, kd.DenseDiagDVI(3, regularizer=prior)(inputs)])
    with pytest.raises(ValueError, match="'sum' received data only.*keras.layers.Add"):
        kd.AddDVI(name="sum")([inputs, inputs])
    with pytest.raises(ValueError, match="'join' received data only.*keras.layers.Concatenate"):
        kd.ConcatenateDVI(name="join")([inputs, inputs])
    with pytest.raises(ValueError, match="joins vectors .* or feature maps .*, not one with the other"):
        kd.ConcatenateDVI()([h, keras.Input((3, 5, 5, 2))])
    full = kd.DenseDVI(4, regularizer=prior)(inputs)
    with pytest.raises(ValueError, match="full covariance, and activation 'silu' has no pairwise covariance"):
        kd.AddDVI("silu")([full, h])
    with pytest.raises(ValueError, match="'norm' received data only.*keras.layers.BatchNormalization"):
        kd.BatchNormalizationDVI(name="norm")(inputs)
    with pytest.raises(ValueError, match="'act' received data only.*keras.layers.Activation"):
        kd.ActivationDVI("relu", name="act")(inputs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match="must be a deterministic tensor of shape \\(batch, features\\)"):
            kd.AddDVI()([keras.Input((7, 4)), h])  # a sequence of data is not a vector
        with pytest.raises(ValueError, match="'norm' takes a packed keras-dvi feature map .* or a dense keras-dvi "
                                             "output .*received shape \\(None, 7, 4\\).*keras.layers.BatchNorm"):
            kd.BatchNormalizationDVI(name="norm")(keras.Input((7, 4)))
