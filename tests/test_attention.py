"""Multi-head attention: `maths.attention.attend` against Keras' own `MultiHeadAttention`,
`maths.attention.attention_moments` against Monte Carlo over inputs drawn from the
representation and weights drawn from the posterior (exact to first order; the band at
moderate noise), `MultiHeadAttentionDVI` in networks (training, saving, sampling, misuse) and
`convert` of a Transformer classifier."""

import keras
import numpy as np
import pytest
from keras import layers, ops

import keras_dvi as kd
from keras_dvi.maths import attention
from tests.conftest import gradients, reloaded, to_numpy

TINY = {"kernel_variance": 1e-12, "bias_variance": 1e-12}


def _posteriors(rng, width, heads, size, out, scale):
    """Four `(kernel_mean, kernel_variance, bias_mean, bias_variance)` in Keras' shapes (query,
    key, value, output), He-scaled means, variances `scale * 0.03 / fan_in`."""
    def one(kernel_shape, bias_shape, fan_in):
        return (rng.normal(0.0, np.sqrt(2.0 / fan_in), kernel_shape), np.full(kernel_shape, 0.03 * scale / fan_in),
                rng.normal(0.0, 0.3, bias_shape), np.full(bias_shape, 0.003 * scale / fan_in))
    return [one((width, heads, size), (heads, size), width) for _ in range(3)] + [
        one((heads, size, out), (out,), heads * size)]


def _sequence(rng, batch, length, width, noise, share):
    """`(m, v, s)` of a sequence in keras-dvi's representation: standard normal means,
    variances `noise^2` times U(0.5, 1.5), shared components a fraction `share` of the sd (a
    random sign per unit)."""
    m = rng.normal(size=(batch, length, width))
    v = noise ** 2 * rng.uniform(0.5, 1.5, size=m.shape)
    s = share * np.sqrt(v) * rng.choice([-1.0, 1.0], size=m.shape)
    return m, v, s


def _draws(rng, moments, n):
    """`n` draws of a sequence `(m, v, s)`: one factor per example and channel."""
    m, v, s = moments
    z = rng.normal(size=(n, m.shape[0], 1, m.shape[2]))
    return m + s * z + np.sqrt(v - s ** 2) * rng.normal(size=(n,) + m.shape)


def _monte_carlo(rng, query, value, posts, n, mask=None):
    """Monte Carlo of the output through `attention.attend` (itself checked against Keras'
    layer below), inputs and weights drawn afresh per draw, float64: `(mean, variance,
    variance of the mean over positions)`."""
    x = _draws(rng, query, n)
    y = x if value is None else _draws(rng, value, n)
    weights = []
    for kernel_mean, kernel_var, bias_mean, bias_var in posts:
        draw = lambda mu, var: mu + np.sqrt(var) * rng.normal(size=(n, 1) + mu.shape)  # noqa: E731
        weights.append((draw(kernel_mean, kernel_var), draw(bias_mean, bias_var)))
    out = to_numpy(attention.attend(x, y, *weights, mask=mask)).astype("float64")
    return out.mean(0), out.var(0), out.mean(2).var(0)


def _moments(query, value, posts, mask=None):
    tensors = lambda items: tuple(ops.convert_to_tensor(t, "float64") for t in items)  # noqa: E731
    out = attention.attention_moments(tensors(query), None if value is None else tensors(value),
                                      *(tensors(p) for p in posts), mask=mask, self_attention=value is None)
    mean, variance, shared = (to_numpy(t) for t in out)
    positions = mean.shape[1]
    # the representation's variance of the mean over positions: shared parts coherent, the rest independent
    sum_variance = (np.square(shared.sum(1)) + (variance - np.square(shared)).sum(1)) / positions ** 2
    return mean, variance, sum_variance


@pytest.mark.parametrize("cross, masked", [(False, None), (True, None), (False, "causal"), (False, "random")])
def test_attend_is_keras_multi_head_attention(cross, masked):
    """The plain function the sampling path runs (`attention.attend`) equals Keras' own
    `MultiHeadAttention` with the same weights, for self- and cross-attention, with a causal
    mask and with a random attention mask, to float32 rounding."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(2, 5, 6)).astype("float32")
    y = rng.normal(size=(2, 7, 6)).astype("float32") if cross else x
    # (value_dim = key_dim: Keras' own layer requires it on JAX)
    layer = layers.MultiHeadAttention(num_heads=3, key_dim=4, value_dim=2 if keras.backend.backend() == "tensorflow"
                                      else 4, output_shape=5)
    kwargs, mask = {}, None
    if masked == "causal":
        kwargs["use_causal_mask"] = True
        mask = np.tril(np.ones((5, 5), bool))[None]
    elif masked == "random":
        mask = rng.uniform(size=(2, 5, 7 if cross else 5)) < 0.6
        mask[..., 0] = True
        kwargs["attention_mask"] = mask
    layer(x, y, **kwargs)  # (builds it)
    qk, qb, kk, kb, vk, vb, ok, ob = (w + rng.normal(scale=0.1, size=w.shape).astype("float32")
                                      for w in (to_numpy(v) for v in layer.weights))
    layer.set_weights([qk, qb, kk, kb, vk, vb, ok, ob])
    expected = to_numpy(layer(x, y, **kwargs))
    got = to_numpy(attention.attend(x, y, (qk, qb), (kk, kb), (vk, vb), (ok, ob), mask=mask))
    np.testing.assert_allclose(got, expected, atol=2e-5)


@pytest.mark.parametrize("case", ["independent", "shared", "mostly_shared", "cross", "weights", "causal"])
def test_moments_are_exact_to_first_order(case):
    """At small noise the linearisation is exact, so every term of the rule shows: inputs with
    noise 0.03 (shared fractions 0, 0.5, 0.9; cross-attention), weights alone (deterministic
    inputs, variances a tenth of the default's), a causal mask. Against 40,000 Monte Carlo
    draws (inputs and all four projections' weights): every output unit's mean within 0.15 sd,
    its variance within 0.93-1.07 of Monte Carlo's, and each channel's mean over positions
    (what the shared components carry) within 0.93-1.2. Measured over three seeds per case:
    0.11 sd, 0.965-1.030 per unit, 0.982-1.168 over positions."""
    rng = np.random.default_rng(["independent", "shared", "mostly_shared", "cross", "weights", "causal"].index(case))
    share = {"independent": 0.0, "mostly_shared": 0.9}.get(case, 0.5)
    query = _sequence(rng, 2, 6, 8, 0.03, share)
    value = _sequence(rng, 2, 8, 8, 0.03, share) if case == "cross" else None
    posts = _posteriors(rng, 8, 2, 4, 8, 0.1 if case == "weights" else 1e-6)
    if case == "weights":
        query = (query[0], np.zeros_like(query[1]), np.zeros_like(query[2]))
    mask = np.tril(np.ones((6, 6), bool))[None] if case == "causal" else None
    mean, variance, sum_variance = _moments(query, value, posts, mask)
    mc_mean, mc_variance, mc_sum_variance = _monte_carlo(rng, query, value, posts, 40_000, mask)
    assert np.all(np.abs(mean - mc_mean) < 0.15 * np.sqrt(mc_variance))
    ratio, sum_ratio = variance / mc_variance, sum_variance / mc_sum_variance
    assert 0.93 < ratio.min() and ratio.max() < 1.07, (ratio.min(), ratio.max())
    assert 0.93 < sum_ratio.min() and sum_ratio.max() < 1.2, (sum_ratio.min(), sum_ratio.max())


@pytest.mark.parametrize("seed", [0, 1])
def test_moments_at_moderate_noise(seed):
    """Input noise 0.1 of the means' scale and the default weight variances: the softmax's
    curvature (left out by the linearisation) shows, within the band the docstring states:
    variances 0.7-1.3 of Monte Carlo's, means within 0.35 sd, the means over positions
    0.85-1.15. Measured over four seeds: 0.75-1.22, 0.28 sd, 0.96-1.04."""
    rng = np.random.default_rng(seed)
    query, posts = _sequence(rng, 2, 6, 8, 0.1, 0.5), _posteriors(rng, 8, 2, 4, 8, 1.0)
    mean, variance, sum_variance = _moments(query, None, posts)
    mc_mean, mc_variance, mc_sum_variance = _monte_carlo(rng, query, None, posts, 40_000)
    ratio, sum_ratio = variance / mc_variance, sum_variance / mc_sum_variance
    assert np.all(np.abs(mean - mc_mean) < 0.35 * np.sqrt(mc_variance))
    assert 0.7 < ratio.min() and ratio.max() < 1.3, (ratio.min(), ratio.max())
    assert 0.85 < sum_ratio.min() and sum_ratio.max() < 1.15, (sum_ratio.min(), sum_ratio.max())


def test_edges_stay_finite(floatx):
    """Saturated patterns (scores in the hundreds: one-hot attention), a fully masked row, zero
    input variances and huge ones: values and gradients finite in float32 and float64, and
    variances non-negative, shared components within the sd."""
    rng = np.random.default_rng(5)
    posts = [[ops.convert_to_tensor(t, floatx) for t in p] for p in _posteriors(rng, 4, 2, 2, 4, 1.0)]
    mask = np.ones((1, 5, 5), bool)
    mask[0, 2] = False
    for scale, noise in ((30.0, 1e-3), (1.0, 0.0), (1.0, 1e3)):
        m, v, s = _sequence(rng, 1, 5, 4, max(noise, 1e-30), 0.5)
        arrays = [(scale * m).astype(floatx), v.astype(floatx), s.astype(floatx)]

        def total(m, v, s):
            out = attention.attention_moments((m, v, s), None, *posts, mask=ops.convert_to_tensor(mask))
            return ops.sum(out[0]) + ops.sum(out[1]) + ops.sum(out[2])

        out = attention.attention_moments(tuple(ops.convert_to_tensor(a) for a in arrays), None, *posts,
                                          mask=ops.convert_to_tensor(mask))
        mean, variance, shared = (to_numpy(t) for t in out)
        assert np.isfinite(mean).all() and np.isfinite(variance).all() and np.isfinite(shared).all()
        assert (variance >= 0).all() and (np.abs(shared) <= np.sqrt(variance) * (1 + 1e-5) + 1e-30).all()
        value, grads = gradients(total, arrays)
        assert np.isfinite(value) and all(np.isfinite(g).all() for g in grads)


def _transformer(length=12, vocabulary=40, width=16, causal=False, heads=2):
    """A Transformer classifier as keras.io's text classification example builds it (token
    embedding, one encoder block: attention, dropout, residual, layer normalisation, a
    two-layer feed-forward block, residual, layer normalisation; average pooling, a dense
    head), functional."""
    inputs = keras.Input((length,), dtype="int32")
    e = layers.Embedding(vocabulary, width)(inputs)
    a = layers.Dropout(0.1)(layers.MultiHeadAttention(num_heads=heads, key_dim=width // heads)(
        e, e, use_causal_mask=causal))
    h = layers.LayerNormalization(epsilon=1e-6)(e + a)
    f = layers.Dense(width, activation="relu")(layers.Dense(2 * width, activation="relu")(h))
    h = layers.LayerNormalization(epsilon=1e-6)(layers.Add()([h, layers.Dropout(0.1)(f)]))
    h = layers.Dropout(0.1)(layers.GlobalAveragePooling1D()(h))
    outputs = layers.Dense(2, activation="softmax")(layers.Dense(8, activation="relu")(h))
    return keras.Model(inputs, outputs)


@pytest.mark.parametrize("causal", [False, True])
def test_convert_transformer_is_the_plain_function_at_tiny_variances(causal):
    """`convert` makes the attention a `MultiHeadAttentionDVI` (its causal mask carried) and
    keeps the embedding plain; at tiny variances the converted classifier's probabilities are
    the plain model's."""
    rng = np.random.default_rng(0)
    plain = _transformer(causal=causal)
    x = rng.integers(0, 40, size=(6, 12))
    converted = kd.convert(plain, **TINY)
    kinds = [type(layer).__name__ for layer in converted.layers]
    assert "MultiHeadAttentionDVI" in kinds and "Embedding" in kinds
    probabilities = kd.predict(converted, x)["probabilities"]
    np.testing.assert_allclose(probabilities, to_numpy(plain(x)), atol=2e-5)


def test_convert_pre_norm_language_model():
    """A pre-norm decoder (GPT's layout: layer normalisation before each causal attention and
    feed-forward block, residual sums, GELU, next-token logits at every position) converts
    whole (the first normalisation, on the embedding, stays plain), computes the plain logits
    at tiny variances, and comes back compiled with the per-position softmax loss."""
    tokens = keras.Input((10,), dtype="int32")
    x = layers.Embedding(30, 16)(tokens)
    for _ in range(2):  # (two blocks: the second's normalisations read moments)
        h = layers.LayerNormalization(epsilon=1e-6)(x)
        x = x + layers.MultiHeadAttention(2, 8)(h, h, use_causal_mask=True)
        h = layers.LayerNormalization(epsilon=1e-6)(x)
        x = x + layers.Dense(16)(layers.Dense(32, activation="gelu")(h))
    plain = keras.Model(tokens, layers.Dense(30)(layers.LayerNormalization(epsilon=1e-6)(x)))
    plain.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x = np.random.default_rng(6).integers(0, 30, (2, 10))
    converted = kd.convert(plain, **TINY)
    assert sum(isinstance(layer, kd.MultiHeadAttentionDVI) for layer in converted.layers) == 2
    mean = kd.unpack(converted.predict(x, verbose=0))[0]
    np.testing.assert_allclose(mean, to_numpy(plain(x)), atol=2e-5)
    assert isinstance(kd.convert(plain, regularizer=kd.EmpiricalBayesRegularizer(num_train=32)).loss,
                      kd.SoftmaxDeltaELL)  # (a per-position classifier: fit as segmentation is)


def test_convert_encoder_decoder_with_cross_attention():
    """An encoder-decoder (two inputs, each embedded; the decoder's causal self-attention, then
    its cross-attention to the encoder's output, of another width) converts whole, every
    attention a `MultiHeadAttentionDVI`, and at tiny variances computes the plain
    probabilities."""
    encoder_tokens, decoder_tokens = keras.Input((10,), dtype="int32"), keras.Input((8,), dtype="int32")
    e = layers.Embedding(30, 12)(encoder_tokens)
    e = layers.LayerNormalization()(e + layers.MultiHeadAttention(2, 8)(e, e))
    d = layers.Embedding(30, 16)(decoder_tokens)
    d = layers.LayerNormalization()(d + layers.MultiHeadAttention(2, 8)(d, d, use_causal_mask=True))
    d = layers.LayerNormalization()(d + layers.MultiHeadAttention(2, 8)(d, e))
    outputs = layers.Dense(30, activation="softmax")(layers.GlobalAveragePooling1D()(d))
    plain = keras.Model([encoder_tokens, decoder_tokens], outputs)
    rng = np.random.default_rng(4)
    x = [rng.integers(0, 30, (4, 10)), rng.integers(0, 30, (4, 8))]
    converted = kd.convert(plain, **TINY)
    assert sum(isinstance(layer, kd.MultiHeadAttentionDVI) for layer in converted.layers) == 3
    np.testing.assert_allclose(kd.predict(converted, x)["probabilities"], to_numpy(plain(x)), atol=2e-5)


def test_converted_transformer_against_monte_carlo_over_its_weights():
    """A converted Transformer classifier with the default variances (its weights trained
    briefly, so that its patterns are not uniform): the logits' variances against Monte Carlo
    over the weights (`predict_samples`, 4,000 draws) within 0.6-1.6, means within 0.25 sd.
    Measured (two backends, three seeds): see BENCHMARKS.md, "Attention"."""
    rng = np.random.default_rng(1)
    plain = _transformer()
    x = rng.integers(0, 40, size=(256, 12))
    y = (np.isin(x, np.arange(8)).sum(1) > 2).astype("int32")
    plain.compile("adam", "sparse_categorical_crossentropy")
    plain.fit(x, y, epochs=3, batch_size=32, verbose=0)
    converted = kd.convert(plain, regularizer=kd.EmpiricalBayesRegularizer(num_train=256))
    mean, covariance = (np.asarray(t) for t in kd.unpack(converted.predict(x[:8], verbose=0)))
    variance = np.diagonal(covariance, axis1=-2, axis2=-1)
    samples = np.asarray(kd.predict_samples(converted, x[:8], num_samples=4000))  # (batch, samples, logits)
    mc_mean, mc_variance = samples.mean(1), samples.var(1)
    ratio = variance / mc_variance
    assert np.all(np.abs(mean - mc_mean) < 0.25 * np.sqrt(mc_variance)), np.abs(mean - mc_mean) / np.sqrt(mc_variance)
    assert 0.6 < ratio.min() and ratio.max() < 1.6, (ratio.min(), ratio.max())


def test_layer_trains_saves_and_samples(tmp_path):
    """A network built by hand (the docstring's): `fit` lowers the objective, a `.keras` round
    trip predicts the same numbers, `predict_samples` runs the sampling path, and the layer's
    KL counts all four projections under the prior."""
    rng = np.random.default_rng(2)
    x = rng.integers(0, 30, size=(128, 10))
    y = (x[:, :3].mean(1) > 15).astype("int32")
    prior = kd.EmpiricalBayesRegularizer(num_train=128)
    tokens = keras.Input((10,), dtype="int32")
    e = layers.Embedding(30, 8)(tokens)
    attention_layer = kd.MultiHeadAttentionDVI(num_heads=2, key_dim=4, regularizer=prior)
    h = kd.LayerNormalizationDVI()(kd.AddDVI()([e, attention_layer(e, e)]))
    h = kd.MultiHeadAttentionDVI(num_heads=1, key_dim=8, value_dim=4, output_shape=6, regularizer=prior)(
        h, h, use_causal_mask=True)
    outputs = kd.DenseDiagDVI(2, regularizer=prior)(kd.GlobalAveragePooling1DDVI()(h))
    model = keras.Model(tokens, outputs)
    model.compile(keras.optimizers.Adam(1e-2), loss=kd.SoftmaxDeltaELL())
    history = model.fit(x, y, epochs=4, batch_size=32, verbose=0)
    assert history.history["nll"][-1] < history.history["nll"][0]
    assert kd.objective.prior_weight_count(attention_layer) == 4 * 64 + 3 * 8 + 8  # (kernels, biases)
    predictions = to_numpy(model.predict(x[:4], verbose=0))
    np.testing.assert_array_equal(to_numpy(reloaded(model, tmp_path, "transformer").predict(x[:4], verbose=0)), predictions)
    samples = np.asarray(kd.predict_samples(model, x[:4], num_samples=6))
    assert samples.shape == (4, 6, 2) and np.isfinite(samples).all()


def test_misuse_is_loud():
    """Separate key and value sequences, a bad head count, an unknown projection, and the
    Keras options keras-dvi's attention lacks, each refused by name."""
    x = keras.Input((5, 4))
    layer = kd.MultiHeadAttentionDVI(num_heads=2, key_dim=2)
    with pytest.raises(ValueError, match="key"):
        layer(x, x, key=keras.Input((5, 4)))
    with pytest.raises(ValueError, match="num_heads"):
        kd.MultiHeadAttentionDVI(num_heads=0, key_dim=2)
    layer = kd.MultiHeadAttentionDVI(num_heads=2, key_dim=2)
    layer(np.zeros((1, 5, 4), "float32"), np.zeros((1, 5, 4), "float32"))
    with pytest.raises(ValueError, match="projection"):
        layer.posterior("keys")
    inputs = keras.Input((5, 4))
    outputs = layers.Dense(2)(layers.GlobalAveragePooling1D()(
        layers.MultiHeadAttention(num_heads=2, key_dim=2, use_gate=True)(inputs, inputs)))
    with pytest.raises(ValueError, match="use_gate"):
        kd.convert(keras.Model(inputs, outputs))
    tokens = keras.Input((5,), dtype="int32")
    e = layers.Embedding(10, 4, mask_zero=True)(tokens)
    outputs = layers.Dense(2)(layers.GlobalAveragePooling1D()(layers.MultiHeadAttention(2, 2)(e, e)))
    with pytest.raises(ValueError, match="padding mask"):
        kd.convert(keras.Model(tokens, outputs))
