"""A Vision Transformer's tokens: `ReshapeDVI` (a map's positions rearranged, channels kept),
`PositionEmbeddingDVI` (a learned embedding added per position), `ClassTokenDVI` (a learned
token put first) and `SelectTokenDVI` (one token as a vector) against Monte Carlo over the
weights, in networks (training, saving, sampling), and `convert` of a Vision Transformer
(patches by a strided convolution, a `Reshape` into tokens, a class token and a position
embedding written as custom layers, encoder blocks, average pooling or `x[:, 0]`)."""

import keras
import numpy as np
import pytest
from keras import layers

import keras_dvi as kd
from tests.conftest import reloaded, to_numpy
from tests.test_conv import _assert_moments_match_samples

TINY = {"kernel_variance": 1e-12, "bias_variance": 1e-12}


@keras.saving.register_keras_serializable(package="tests")
class AddPositionEmbedding(layers.Layer):
    """A position embedding as Vision Transformer code writes it: `x + E`, `E` one weight of
    shape `(1, tokens, channels)`."""

    def build(self, input_shape):
        self.embedding = self.add_weight(shape=(1, *input_shape[1:]), name="embedding",
                                         initializer=keras.initializers.RandomNormal(stddev=0.5))

    def call(self, x):
        return x + self.embedding


@keras.saving.register_keras_serializable(package="tests")
class PositionalEncoder(layers.Layer):
    """keras.io's Video Vision Transformer's encoder: an `Embedding` of the positions added to
    the tokens (one weight, `(tokens, channels)`, held by a sub-layer)."""

    def build(self, input_shape):
        self.tokens = input_shape[1]
        self.position_embedding = layers.Embedding(input_dim=self.tokens, output_dim=input_shape[-1],
                                                   embeddings_initializer=keras.initializers.RandomNormal(stddev=0.5))
        self.position_embedding.build((self.tokens,))

    def call(self, x):
        return x + self.position_embedding(keras.ops.arange(self.tokens))


class ClassToken(layers.Layer):
    """A class token as Vision Transformer code writes it: one learned token put before the
    patches, `(batch, tokens + 1, channels)`."""

    def build(self, input_shape):
        self.token = self.add_weight(shape=(1, 1, input_shape[-1]), name="token", initializer="random_normal")

    def call(self, x):
        token = keras.ops.broadcast_to(self.token, (keras.ops.shape(x)[0], 1, x.shape[-1]))
        return keras.ops.concatenate([token, x], axis=1)


class LoneClassToken(layers.Layer):
    """The other way tutorials write it: the layer returns the token alone, `(batch, 1,
    channels)`, and a `Concatenate(axis=1)` puts it first."""

    def build(self, input_shape):
        self.token = self.add_weight(shape=(input_shape[-1],), name="token", initializer="random_normal")

    def call(self, x):
        return keras.ops.broadcast_to(self.token[None, None], (keras.ops.shape(x)[0], 1, x.shape[-1]))


class Gate(layers.Layer):
    """A custom layer of no kind `convert` knows: one scalar weight times the tokens."""

    def __init__(self, **kwargs):
        super().__init__(name="gate", **kwargs)

    def build(self, input_shape):
        self.gate = self.add_weight(shape=(1,), name="gate", initializer="ones")

    def call(self, x):
        return x * self.gate


class Patches(layers.Layer):
    """keras.io's Vision Transformer's patches, as written there (no `**kwargs`, no
    `get_config`: Keras cannot rebuild it from its config)."""

    def __init__(self, patch_size):
        super().__init__()
        self.patch_size = patch_size

    def call(self, images):
        shape = keras.ops.shape(images)
        patches = keras.ops.image.extract_patches(images, size=self.patch_size)
        return keras.ops.reshape(patches, (shape[0], (shape[1] // self.patch_size) * (shape[2] // self.patch_size),
                                           self.patch_size * self.patch_size * shape[3]))


class PatchEncoder(layers.Layer):
    """keras.io's patch encoder (a projection plus an `Embedding` of the positions), as
    written there (no `**kwargs`)."""

    def __init__(self, num_patches, projection_dim):
        super().__init__()
        self._parts(num_patches, projection_dim)

    def _parts(self, num_patches, projection_dim):
        self.num_patches = num_patches
        self.projection = layers.Dense(units=projection_dim)
        self.position_embedding = layers.Embedding(input_dim=num_patches, output_dim=projection_dim)

    def call(self, patch):
        positions = keras.ops.expand_dims(keras.ops.arange(start=0, stop=self.num_patches, step=1), axis=0)
        return self.projection(patch) + self.position_embedding(positions)


class KeywordPatchEncoder(PatchEncoder):
    """The same with the one change Keras asks of a custom layer: `**kwargs` passed on."""

    def __init__(self, num_patches, projection_dim, **kwargs):
        layers.Layer.__init__(self, **kwargs)
        self._parts(num_patches, projection_dim)


def kerasio_vision_transformer(keyword_arguments=True, image=16, patch=4, width=8, heads=2):
    """keras.io's "Image classification with Vision Transformer", small: augmentation (the
    normalisation's statistics given, not adapted),
    `Patches`, `PatchEncoder`, a pre-norm block (dropout in the attention, a GELU MLP), layer
    normalisation, flatten, an MLP head, logits."""
    inputs = keras.Input((image, image, 1))
    augmented = keras.Sequential([layers.Normalization(mean=0.5, variance=0.08), layers.Resizing(image, image),
                                  layers.RandomFlip("horizontal")], name="data_augmentation")(inputs)
    encoder = KeywordPatchEncoder if keyword_arguments else PatchEncoder
    encoded = encoder((image // patch) ** 2, width)(Patches(patch)(augmented))
    x1 = layers.LayerNormalization(epsilon=1e-6)(encoded)
    x2 = layers.Add()([layers.MultiHeadAttention(num_heads=heads, key_dim=width, dropout=0.1)(x1, x1), encoded])
    x3 = layers.LayerNormalization(epsilon=1e-6)(x2)
    x3 = layers.Dense(width, activation=keras.activations.gelu)(layers.Dense(2 * width, activation=keras.activations.gelu)(x3))
    representation = layers.Flatten()(layers.LayerNormalization(epsilon=1e-6)(layers.Add()([x3, x2])))
    features = layers.Dense(16, activation=keras.activations.gelu)(layers.Dropout(0.5)(representation))
    return keras.Model(inputs, layers.Dense(10)(features))


def vision_transformer(embedding=AddPositionEmbedding, size=8, patch=2, width=16, heads=2, classes=10,
                       class_token=None, read=None):
    """A small Vision Transformer as Keras users write one functionally: patches by a strided
    convolution, a `Reshape` into tokens, a position embedding, one pre-norm encoder block
    (attention, residual, GELU feed-forward block, residual), layer normalisation, average
    pooling, a softmax head. With `class_token` (`"joined"`: `ClassToken`; `"alone"`:
    `LoneClassToken` and a `Concatenate`) a class token goes before the patches, and the head
    reads `read(tokens)` (the class token: `x[:, 0]`) instead of the average."""
    images = keras.Input((size, size, 1))
    x = layers.Reshape((-1, width))(layers.Conv2D(width, patch, strides=patch)(images))
    if class_token == "joined":
        x = ClassToken()(x)
    elif class_token == "alone":
        x = layers.Concatenate(axis=1)([LoneClassToken()(x), x])
    x = embedding()(x)
    h = layers.LayerNormalization(epsilon=1e-6)(x)
    x = layers.Add()([x, layers.MultiHeadAttention(heads, width // heads)(h, h)])
    h = layers.LayerNormalization(epsilon=1e-6)(x)
    x = layers.Add()([x, layers.Dense(width)(layers.Dense(2 * width, activation="gelu")(h))])
    x = layers.LayerNormalization(epsilon=1e-6)(x)
    x = layers.GlobalAveragePooling1D()(x) if read is None else read(x)
    return keras.Model(images, layers.Dense(classes, activation="softmax")(x))


def _first_layer_tokens():
    """`(images, patches, tokens, x)`: a first convolution's 2x2 patches of 6x6 images with 2
    channels (ReLU, variances far from zero), as 9 tokens of width 5, and 3 images."""
    prior = kd.EmpiricalBayesRegularizer(num_train=100)
    images = keras.Input((6, 6, 2))
    patches = kd.Conv2DDVI(5, 2, strides=2, activation="relu", kernel_variance_init=0.3, regularizer=prior)(images)
    x = np.random.default_rng(0).normal(size=(3, 6, 6, 2)).astype("float32")
    return images, patches, kd.ReshapeDVI((-1, 5))(patches), x


def test_tokens_keep_each_units_moments_and_each_channels_shared_component():
    """A first convolution's map reshaped into tokens, a position embedding added: against
    20,000 draws of the weights, every token's mean and variance within 5 and 6 standard errors
    (`tests.test_conv`'s check: a first layer's units are exact). The reshape keeps the moments exactly: the tokens are the
    map's units in Keras' order, each channel keeps its shared component (the average over the
    tokens is the map's global average), and the embedding moves the means alone."""
    images, patches, tokens, x = _first_layer_tokens()
    embedded = kd.PositionEmbeddingDVI(embeddings_initializer="random_normal")(tokens)
    pooled = kd.GlobalAveragePooling1DDVI()(tokens)
    map_pooled = kd.GlobalAveragePooling2DDVI()(patches)
    model = keras.Model(images, [patches, tokens, embedded, pooled, map_pooled])
    patches, tokens, embedded, pooled, map_pooled = (to_numpy(t) for t in model.predict(x, verbose=0))
    assert tokens.shape == (3, 3, 9, 5)
    np.testing.assert_array_equal(tokens, patches.reshape(3, 3, 9, 5))
    embedding = to_numpy(model.layers[3].embeddings)
    np.testing.assert_allclose(embedded[:, 0], tokens[:, 0] + embedding, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(embedded[:, 1:], tokens[:, 1:])
    embedded_model = keras.Model(model.input, model.outputs[2])
    samples = to_numpy(kd.predict_samples(embedded_model, x, num_samples=20000))  # (batch, S, tokens, channels)
    assert samples.shape == (3, 20000, 9, 5)
    _assert_moments_match_samples(embedded[:, 0], embedded[:, 1], samples.astype("float64"))
    np.testing.assert_allclose(pooled, map_pooled, rtol=1e-6, atol=1e-7)
    assert np.all(tokens[:, 2] != 0)  # (shared components to keep)


def test_class_token_enters_with_its_value_and_a_token_is_taken_exactly():
    """`ClassTokenDVI` puts its token first with no variance and no shared component and
    keeps every patch token; `SelectTokenDVI` takes one token's means and variances exactly,
    counting from either end. Against 20,000 draws of the weights (`predict_samples` runs both
    layers on each draw): the class token after the position embedding is the same number in
    every draw, and the last patch token within 5 and 6 standard errors (a first layer's units
    are exact)."""
    images, _, tokens, x = _first_layer_tokens()
    with_class = kd.ClassTokenDVI(token_initializer="random_normal")(tokens)
    embedded = kd.PositionEmbeddingDVI(embeddings_initializer="random_normal")(with_class)
    first, last = kd.SelectTokenDVI(0)(embedded), kd.SelectTokenDVI(-1)(embedded)
    model = keras.Model(images, [tokens, with_class, embedded, first, last])
    tokens, with_class, embedded, first, last = (to_numpy(t) for t in model.predict(x, verbose=0))
    token, embedding = to_numpy(model.layers[3].token), to_numpy(model.layers[4].embeddings)
    assert with_class.shape == (3, 3, 10, 5) and first.shape == last.shape == (3, 2, 5)
    np.testing.assert_array_equal(with_class[:, 0, 0], np.broadcast_to(token, (3, 5)))
    np.testing.assert_array_equal(with_class[:, 1:, 0], 0.0)  # (no variance, no shared component)
    np.testing.assert_array_equal(with_class[:, :, 1:], tokens)
    np.testing.assert_array_equal(first, embedded[:, :2, 0])
    np.testing.assert_array_equal(last, embedded[:, :2, -1])
    for index, moments in ((0, first), (-1, last)):
        samples = to_numpy(kd.predict_samples(keras.Model(images, model.outputs[3 if index == 0 else 4]), x,
                                              num_samples=20000))
        assert samples.shape == (3, 20000, 5)
        _assert_moments_match_samples(moments[:, 0], moments[:, 1], samples.astype("float64"))
    np.testing.assert_allclose(first[:, 0], np.broadcast_to(token + embedding[0], (3, 5)), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("embedding", [AddPositionEmbedding, PositionalEncoder])
def test_convert_vision_transformer_is_the_plain_function_at_tiny_variances(embedding):
    """`convert` maps the `Reshape` into tokens to `ReshapeDVI` and the custom position
    embedding (its one weight, recognised on a random input) to `PositionEmbeddingDVI`, makes
    the patch convolution and every later layer Bayesian, and at tiny variances computes the
    plain probabilities."""
    keras.utils.set_random_seed(0)
    plain = vision_transformer(embedding)
    x = np.random.default_rng(1).uniform(size=(4, 8, 8, 1)).astype("float32")
    converted = kd.convert(plain, **TINY)
    kinds = [type(layer).__name__ for layer in converted.layers]
    assert kinds[1:4] == ["Conv2DDVI", "ReshapeDVI", "PositionEmbeddingDVI"], kinds
    assert "MultiHeadAttentionDVI" in kinds
    np.testing.assert_allclose(kd.predict(converted, x)["probabilities"], to_numpy(plain(x)), atol=2e-5)


@pytest.mark.parametrize("class_token, read, index", [
    ("joined", lambda x: x[:, 0], 0),
    ("alone", lambda x: keras.ops.take(x, 0, axis=1), 0),
    ("joined", layers.Lambda(lambda x: x[:, -1]), 16),
], ids=["getitem", "concatenate-take", "lambda-last"])
def test_convert_vision_transformer_with_a_class_token(class_token, read, index):
    """A class token written either way (a custom layer that puts its one weight first, or
    one that returns it for a `Concatenate(axis=1)`) becomes `ClassTokenDVI` with the same
    token, and the head's `x[:, i]` (`GetItem`, `keras.ops.take` or a `Lambda`, found on a
    probe) becomes `SelectTokenDVI(i)` read by a `DenseDVI`; at tiny variances the converted
    model computes the plain probabilities."""
    keras.utils.set_random_seed(1)
    plain = vision_transformer(class_token=class_token, read=read)
    converted = kd.convert(plain, **TINY)
    kinds = [type(layer).__name__ for layer in converted.layers]
    assert kinds[1:5] == ["Conv2DDVI", "ReshapeDVI", "ClassTokenDVI", "PositionEmbeddingDVI"], kinds
    assert kinds[-2:] == ["SelectTokenDVI", "DenseDVI"] and converted.layers[-2].index == index
    if class_token == "joined":
        np.testing.assert_array_equal(to_numpy(converted.layers[3].token),
                                      to_numpy(plain.get_layer(converted.layers[3].name).token).reshape(-1))
    x = np.random.default_rng(2).uniform(size=(4, 8, 8, 1)).astype("float32")
    np.testing.assert_allclose(kd.predict(converted, x)["probabilities"], to_numpy(plain(x)), atol=2e-5)


def test_kerasio_vision_transformer_converts_with_its_patch_layers_plain():
    """keras.io's Vision Transformer: its `Patches` and `PatchEncoder` come before the first
    Keras layer with weights and stay plain, as an embedding does (`Patches`, which Keras
    cannot rebuild from its config, is used as it is: it holds no state); the attention block
    and the head become Bayesian, and at tiny variances the converted model's logits are the
    plain model's (`predict`: `RandomFlip` flips when the model is called directly). Without
    `**kwargs`, `PatchEncoder` (which has weights) is refused by name, with the fix."""
    keras.utils.set_random_seed(4)
    plain = kerasio_vision_transformer()
    converted = kd.convert(plain, **TINY)
    kinds = [type(layer).__name__ for layer in converted.layers]
    assert kinds[4:8] == ["Patches", "KeywordPatchEncoder", "LayerNormalization", "MultiHeadAttentionDVI"], kinds
    x = np.random.default_rng(5).uniform(size=(3, 16, 16, 1)).astype("float32")
    np.testing.assert_allclose(kd.unpack(converted.predict(x, verbose=0))[0], plain.predict(x, verbose=0), atol=2e-5)
    with pytest.raises(ValueError, match="(?s)'patch_encoder.*' .PatchEncoder. cannot be rebuilt from its config.*\\*\\*kwargs"):
        kd.convert(kerasio_vision_transformer(keyword_arguments=False), **TINY)


def test_convert_reshape_to_one_axis_is_flatten():
    """A `Reshape((-1,))` that flattens a map (as `Flatten` would) becomes `FlattenDVI`, and
    the converted CNN computes the plain probabilities at tiny variances."""
    keras.utils.set_random_seed(3)
    images = keras.Input((6, 6, 1))
    x = layers.Reshape((-1,))(layers.Conv2D(4, 3, activation="relu")(images))
    plain = keras.Model(images, layers.Dense(3, activation="softmax")(x))
    converted = kd.convert(plain, **TINY)
    assert [type(layer).__name__ for layer in converted.layers][1:] == ["Conv2DDVI", "FlattenDVI", "DenseDVI"]
    x = np.random.default_rng(3).uniform(size=(4, 6, 6, 1)).astype("float32")
    np.testing.assert_allclose(kd.predict(converted, x)["probabilities"], to_numpy(plain(x)), atol=2e-5)


def test_tokens_train_save_and_sample(tmp_path):
    """A network on tokens (patches by a strided convolution, `ReshapeDVI`, `ClassTokenDVI`,
    `PositionEmbeddingDVI`, layer normalisation of a class token with no variance, a
    convolution along the tokens that mixes it with the patches, `SelectTokenDVI(0)`, a dense
    head) fits 8x8 digits: finite losses, the negative log-likelihood falls, and the class
    token and the embedding move (point estimates); a `.keras` round trip predicts the same
    numbers and `predict_samples` draws finite logits. A converted Vision Transformer's
    moments against Monte Carlo over its weights: BENCHMARKS.md, "Attention"."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x, y = (digits.images[:256, ..., None] / 16.0).astype("float32"), digits.target[:256]
    keras.utils.set_random_seed(2)
    prior = kd.EmpiricalBayesRegularizer(num_train=len(x))
    images = keras.Input((8, 8, 1))
    tokens = kd.ReshapeDVI((16, 16))(kd.Conv2DDVI(16, 2, strides=2, regularizer=prior)(images))
    class_token, embedding = kd.ClassTokenDVI(), kd.PositionEmbeddingDVI()
    h = kd.LayerNormalizationDVI()(embedding(class_token(tokens)))
    h = kd.Conv1DDVI(16, 5, padding="same", activation="gelu", regularizer=prior)(h)
    model = keras.Model(images, kd.DenseDVI(10, regularizer=prior)(kd.SelectTokenDVI(0)(h)))
    model.compile(keras.optimizers.Adam(1e-2), loss=kd.SoftmaxDeltaELL())
    start = to_numpy(embedding.embeddings).copy()
    history = model.fit(x, y, epochs=6, batch_size=32, verbose=0).history
    assert np.isfinite(history["loss"]).all() and history["nll"][-1] < history["nll"][0]
    assert np.abs(to_numpy(embedding.embeddings) - start).max() > 1e-3
    assert np.abs(to_numpy(class_token.token)).max() > 1e-3  # (from zeros)
    predictions = to_numpy(model.predict(x[:4], verbose=0))
    np.testing.assert_array_equal(to_numpy(reloaded(model, tmp_path, "tokens").predict(x[:4], verbose=0)), predictions)
    samples = np.asarray(kd.predict_samples(model, x[:4], num_samples=5))
    assert samples.shape == (4, 5, 10) and np.isfinite(samples).all()


@pytest.mark.filterwarnings("ignore:.*that no keras-dvi layer produced")
def test_misuse_is_loud():
    """A target shape that changes the channels or the number of units, a malformed one, data
    instead of moments, channels-first maps, a token index that is no integer or out of range,
    and, in `convert`, a `Reshape` that splits the channels, a class token returned alone but
    not put first by a `Concatenate`, and a custom layer of no known kind, each refused by
    name."""
    packed = keras.Input((3, 4, 6, 5))  # (a packed map: batch, 3, rows, cols, channels)
    with pytest.raises(ValueError, match="target_shape"):
        kd.ReshapeDVI((24, 4))(packed)
    with pytest.raises(ValueError, match="target_shape"):
        kd.ReshapeDVI((23, 5))(packed)
    for bad in ((24,), (0, 5), (-1, -1), "24, 5"):
        with pytest.raises(ValueError, match="target_shape"):
            kd.ReshapeDVI(bad)
    with pytest.raises(ValueError, match="data"):
        kd.ReshapeDVI((24, 5))(keras.Input((4, 6, 5)))
    with pytest.raises(ValueError, match="data_format"):
        kd.ReshapeDVI((24, 5), data_format="channels_first")
    with pytest.raises(ValueError, match="data_format"):
        kd.PositionEmbeddingDVI(data_format="channels_first")
    with pytest.raises(ValueError, match="data"):
        kd.ClassTokenDVI()(keras.Input((24, 5)))
    sequence = keras.Input((3, 24, 5))
    for bad in (0.0, "0", True, None):
        with pytest.raises(ValueError, match="index"):
            kd.SelectTokenDVI(bad)
    with pytest.raises(ValueError, match="index`=24 of a sequence of 24 tokens"):
        kd.SelectTokenDVI(24)(sequence)
    with pytest.raises(ValueError, match="index`=-25"):
        kd.SelectTokenDVI(-25)(sequence)
    images = keras.Input((8, 8, 1))
    x = layers.Reshape((16, 2, 8))(layers.Conv2D(16, 2, strides=2)(images))  # (the channels split into heads)
    plain = keras.Model(images, layers.Dense(3, activation="softmax")(layers.Flatten()(x)))
    with pytest.raises(ValueError, match="Reshape"):
        kd.convert(plain, **TINY)
    tokens = layers.Reshape((16, 16))(layers.Conv2D(16, 2, strides=2)(images))
    lone = LoneClassToken(name="lone")(tokens)
    pooled = layers.GlobalAveragePooling1D()(layers.Concatenate(axis=1)([tokens, lone]))  # (put last)
    plain = keras.Model(images, layers.Dense(3, activation="softmax")(pooled))
    with pytest.raises(ValueError, match="'lone' .LoneClassToken. returns its one weight as a class token"):
        kd.convert(plain, **TINY)
    pooled = layers.GlobalAveragePooling1D()(Gate()(tokens))
    plain = keras.Model(images, layers.Dense(3, activation="softmax")(pooled))
    with pytest.raises(ValueError, match="'gate' .Gate. has no keras-dvi counterpart"):
        kd.convert(plain, **TINY)


def test_config_round_trip():
    """`get_config` / `from_config` rebuild the four layers (their `.keras` round trips: the
    training tests)."""
    layer = kd.ReshapeDVI((-1, 5), name="tokens")
    clone = kd.ReshapeDVI.from_config(layer.get_config())
    assert clone.target_shape == (-1, 5) and clone.name == "tokens"
    embedding = kd.PositionEmbeddingDVI(embeddings_initializer="zeros")
    assert isinstance(kd.PositionEmbeddingDVI.from_config(embedding.get_config()).embeddings_initializer,
                      keras.initializers.Zeros)
    token = kd.ClassTokenDVI(token_initializer="ones", name="cls")
    clone = kd.ClassTokenDVI.from_config(token.get_config())
    assert isinstance(clone.token_initializer, keras.initializers.Ones) and clone.name == "cls"
    assert kd.SelectTokenDVI.from_config(kd.SelectTokenDVI(-1).get_config()).index == -1
