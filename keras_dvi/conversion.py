"""`convert(model)`: the keras-dvi counterpart of a plain Keras model, its weights as posterior
means ("train plain, convert, fine-tune")."""

import functools
import math
import warnings

import keras
import numpy as np

from keras_dvi import layers as dvi
from keras_dvi import losses, metrics, packing, validation
from keras_dvi.maths import moments

#: Plain layers and their keras-dvi counterparts (layers without weights).
_POOLING = {
    keras.layers.MaxPooling1D: dvi.MaxPooling1DDVI,
    keras.layers.MaxPooling2D: dvi.MaxPooling2DDVI,
    keras.layers.AveragePooling1D: dvi.AveragePooling1DDVI,
    keras.layers.AveragePooling2D: dvi.AveragePooling2DDVI,
    keras.layers.MaxPooling3D: dvi.MaxPooling3DDVI,
    keras.layers.AveragePooling3D: dvi.AveragePooling3DDVI,
}
_GLOBAL_POOLING = {
    keras.layers.GlobalAveragePooling1D: dvi.GlobalAveragePooling1DDVI,
    keras.layers.GlobalAveragePooling2D: dvi.GlobalAveragePooling2DDVI,
    keras.layers.GlobalMaxPooling1D: dvi.GlobalMaxPooling1DDVI,
    keras.layers.GlobalMaxPooling2D: dvi.GlobalMaxPooling2DDVI,
    keras.layers.GlobalAveragePooling3D: dvi.GlobalAveragePooling3DDVI,
    keras.layers.GlobalMaxPooling3D: dvi.GlobalMaxPooling3DDVI,
}
#: The max poolings, onto which the ReLU of a convolution moves (`_pooled_producer`).
_MAX_POOLING = (keras.layers.MaxPooling1D, keras.layers.MaxPooling2D, keras.layers.MaxPooling3D,
                keras.layers.GlobalMaxPooling1D, keras.layers.GlobalMaxPooling2D, keras.layers.GlobalMaxPooling3D)
_CONV = {keras.layers.Conv1D: dvi.Conv1DDVI, keras.layers.Conv2D: dvi.Conv2DDVI, keras.layers.Conv3D: dvi.Conv3DDVI,
         keras.layers.Conv1DTranspose: dvi.Conv1DTransposeDVI, keras.layers.Conv2DTranspose: dvi.Conv2DTransposeDVI,
         keras.layers.Conv3DTranspose: dvi.Conv3DTransposeDVI}
_TRANSPOSED = (keras.layers.Conv1DTranspose, keras.layers.Conv2DTranspose, keras.layers.Conv3DTranspose)
#: Zero padding, cropping and upsampling: `(keras-dvi class, name of the argument)`.
_RESHAPING = {
    keras.layers.ZeroPadding1D: (dvi.ZeroPadding1DDVI, "padding"),
    keras.layers.ZeroPadding2D: (dvi.ZeroPadding2DDVI, "padding"),
    keras.layers.Cropping1D: (dvi.Cropping1DDVI, "cropping"),
    keras.layers.Cropping2D: (dvi.Cropping2DDVI, "cropping"),
    keras.layers.UpSampling1D: (dvi.UpSampling1DDVI, "size"),
    keras.layers.UpSampling2D: (dvi.UpSampling2DDVI, "size"),
    keras.layers.ZeroPadding3D: (dvi.ZeroPadding3DDVI, "padding"),
    keras.layers.Cropping3D: (dvi.Cropping3DDVI, "cropping"),
    keras.layers.UpSampling3D: (dvi.UpSampling3DDVI, "size"),
}
#: Normalisations of a feature map's channels or a vector's units: `(keras-dvi class, the name of
#: its constructor from the built plain layer)`.
_NORMALISATIONS = {
    keras.layers.LayerNormalization: (dvi.LayerNormalizationDVI, "from_layer_normalization"),
    keras.layers.RMSNormalization: (dvi.RMSNormalizationDVI, "from_rms_normalization"),
    keras.layers.GroupNormalization: (dvi.GroupNormalizationDVI, "from_group_normalization"),
}
#: Layers that do nothing at inference (keras-dvi layers model the weight noise themselves).
_INFERENCE_IDENTITY = (keras.layers.Dropout, keras.layers.SpatialDropout1D, keras.layers.SpatialDropout2D,
                       keras.layers.SpatialDropout3D,
                       keras.layers.GaussianNoise, keras.layers.GaussianDropout, keras.layers.AlphaDropout,
                       keras.layers.ActivityRegularization, keras.layers.Identity)
#: Layers with no accurate Gaussian moment rule (and their subclasses: LSTM, GRU, ...), and why:
#: `convert` refuses them with the reason.
_NO_GAUSSIAN_RULE = {
    (keras.layers.UnitNormalization,):
        "it divides each unit by a statistic of a few units of the layer's own random input",
    (keras.layers.Attention, keras.layers.AdditiveAttention, keras.layers.GroupQueryAttention):
        "it multiplies random features by a softmax of products or sums of random features (keras-dvi converts "
        "keras.layers.MultiHeadAttention)",
    (keras.layers.RNN,): "it feeds its random state back through a nonlinearity at every step",
}
_ACTIVATION_LAYERS = (keras.layers.Activation, keras.layers.ReLU, keras.layers.LeakyReLU, keras.layers.Softmax)
#: The activations `convert` carries, for messages.
_SUPPORTED = ("'relu', 'relu6', 'leaky_relu' (slope 0.2), 'hard_silu' / 'hard_swish', 'hard_sigmoid', "
              "'silu' / 'swish', 'gelu' (exact), 'sigmoid', 'tanh' or 'linear'")


def _activation_of(layer):
    """The activation a plain layer applies, as a keras-dvi name or `"softmax"`; `None` when it
    has none that keras-dvi can apply."""
    if isinstance(layer, keras.layers.ReLU):
        if float(layer.threshold) != 0.0 or float(layer.negative_slope) != 0.0:
            return None
        if layer.max_value is None:
            return "relu"
        return "relu6" if float(layer.max_value) == moments.RELU6_BOUND else None
    if isinstance(layer, keras.layers.LeakyReLU):
        return "leaky_relu" if abs(float(layer.negative_slope) - moments.LEAKY_SLOPE) < 1e-9 else None
    if isinstance(layer, keras.layers.Softmax):
        return "softmax"
    name = getattr(getattr(layer, "activation", None), "__name__", "linear")
    if name == "softmax":
        return name
    try:
        return moments.canonical_activation(None if name == "linear" else name)
    except ValueError:
        return None


def _function_name(layer):
    """The name of the function an activation layer applies (for messages)."""
    if isinstance(layer, keras.layers.ReLU):
        return f"ReLU(max_value={layer.max_value}, negative_slope={layer.negative_slope}, threshold={layer.threshold})"
    if isinstance(layer, keras.layers.LeakyReLU):
        return f"LeakyReLU(negative_slope={layer.negative_slope})"
    return getattr(getattr(layer, "activation", None), "__name__", type(layer).__name__)


class _Graph:
    """What `convert` reads of the plain model's graph, through public Keras API only
    (`model.operations`, `layer.input`, `layer.output`): each layer's producers and readers.
    Its `layers` include the operations on tensors (`x + 3.0`, `keras.ops` calls)."""

    def __init__(self, model, outputs=None):
        nodes = getattr(model, "operations", model.layers)  # (a Sequential has layers only)
        self.layers = [node for node in nodes if not isinstance(node, keras.layers.InputLayer)]
        for layer in self.layers:
            if isinstance(layer, keras.Model):
                raise ValueError(f"keras_dvi.convert: layer {layer.name!r} is a nested model that convert cannot "
                                 "read here: a subclassed model has no graph of layers (a whole-model conversion "
                                 "reads nested Sequential and functional models layer by layer, `last_layers=k` "
                                 "does not inside its part); keep it plain and convert only the layers after it "
                                 "(`last_layers=k`).")
        producer_of = {}
        for layer in self.layers:
            for tensor in keras.tree.flatten(layer.output):
                producer_of[id(tensor)] = layer
        self.producers = {id(layer): [producer_of[id(t)] for t in keras.tree.flatten(layer.input) if id(t) in producer_of]
                          for layer in self.layers}
        self.readers = {id(layer): [] for layer in self.layers}
        for layer in self.layers:
            for producer in self.producers[id(layer)]:
                self.readers[id(producer)].append(layer)
        outputs = keras.tree.flatten(model.outputs if outputs is None else outputs)
        self.output_layers = [producer_of[id(t)] for t in outputs if id(t) in producer_of]  # in the outputs' order
        self.outputs = {id(layer) for layer in self.output_layers}

    def only_reader(self, layer):
        readers = self.readers[id(layer)]
        return readers[0] if len(readers) == 1 and id(layer) not in self.outputs else None

    @functools.cached_property
    def sums(self):
        """`{id: (c1, c2)}` of the nodes without weights that add their two inputs, scaled
        (`_sum_scales`: `x + y`, or InceptionResNetV2's `x + scale * r`), checked once."""
        found = {id(node): _sum_scales(node) for node in self.layers}
        return {key: scales for key, scales in found.items() if scales is not None}

    @functools.cached_property
    def scales(self):
        """`{id: weight vector}` of the layer scales (`_channel_scale`), checked once."""
        found = {id(layer): _channel_scale(layer) for layer in self.layers}
        return {key: weight for key, weight in found.items() if weight is not None}

    @functools.cached_property
    def embeddings(self):
        """`{id: embedding}` of the position embeddings (`_position_embedding`), checked once."""
        found = {id(layer): _position_embedding(layer) for layer in self.layers if id(layer) not in self.scales}
        return {key: weight for key, weight in found.items() if weight is not None}

    @functools.cached_property
    def class_tokens(self):
        """`({id: token}, ids)`: the nodes that become a `ClassTokenDVI` with their token (a layer
        putting its one weight before the tokens, or a `Concatenate` along the tokens whose first
        input is such a weight returned alone: `_class_token`), and the ids of the layers that
        returned it alone (replaced by an identity). A lone token read otherwise is left out
        (`convert` refuses it if it is to be converted)."""
        tokens, alone = {}, set()
        for layer in self.layers:
            if id(layer) in self.scales or id(layer) in self.embeddings:
                continue
            found = _class_token(layer)
            if found is None:
                continue
            token, joined = found
            if joined:
                tokens[id(layer)] = token
                continue
            reader = self.only_reader(layer)
            if (isinstance(reader, keras.layers.Concatenate) and len(self.producers[id(reader)]) == 2
                    and self.producers[id(reader)][0] is layer
                    and reader.axis in (1, -2) and len(reader.input[1].shape) == 3):
                tokens[id(reader)] = token
                alone.add(id(layer))
        return tokens, alone

    @functools.cached_property
    def selections(self):
        """`{id: index}` of the nodes that take one token of a sequence (`_selected_token`)."""
        found = {id(node): _selected_token(node) for node in self.layers
                 if id(node) not in self.scales and id(node) not in self.embeddings}
        return {key: index for key, index in found.items() if index is not None}


def _inlinable(layer):
    """Whether a layer is a nested `Sequential` or functional model (a graph of layers)."""
    return isinstance(layer, keras.Sequential) or isinstance(layer, keras.Model) and hasattr(layer, "operations")


def _rebuilt(layer):
    """A copy of a layer `convert` keeps plain, from its config (the plain model is left as it
    was); a layer without weights that cannot be rebuilt (a custom layer without `get_config`)
    is used as it is, since it holds no state; one with weights is refused by name."""
    try:
        return layer.__class__.from_config(layer.get_config())
    except Exception as error:  # noqa: BLE001 - whatever the layer's own constructor raises
        if not layer.weights:
            return layer
        raise ValueError(
            f"keras_dvi.convert copies the layers it keeps plain, and layer {layer.name!r} ({type(layer).__name__}) "
            f"cannot be rebuilt from its config ({type(error).__name__}: {error}). Give its `__init__` a `**kwargs` "
            "passed on to `super().__init__(**kwargs)` and a `get_config` that returns its own arguments (what "
            "Keras needs to save the model, too).") from error


def _inlined(model):
    """`model` with its nested models inlined, at any depth: a functional model on copies of
    all their layers and of the model's own, with their weights (a backbone under a head,
    `keras.Sequential([keras.applications.ResNet50(include_top=False, pooling="avg"),
    Dense(10)])`, becomes one graph of layers); `model` itself when it nests none. Nested
    `Sequential` models are read anywhere, nested functional models where the model's input
    feeds them (elsewhere Keras would build their copy on copies of the tensor, outside this
    graph: refused); nested subclassed models stay (`_Graph` refuses them)."""
    if not any(_inlinable(layer) for layer in model.layers):
        return model
    copies = []  # (layer, its copy): the weights are copied once the copies are built

    def copy(layer):
        if _inlinable(layer):
            return layer  # (inlined when called)
        if _is_operation(layer):  # (`x + 3.0`: stateless, but its `input` must be this graph's tensors)
            return type(layer).from_config(layer.get_config())
        duplicate = _rebuilt(layer)
        if duplicate is not layer:
            copies.append((layer, duplicate))
        return duplicate

    def call(layer, *args, **kwargs):
        if not _inlinable(layer):
            return layer(*args, **kwargs)
        if isinstance(layer, keras.Sequential):
            tensor = args[0]
            for inner in layer.layers:
                tensor = call(copy(inner), tensor)
            return tensor
        inner = keras.models.clone_model(layer, input_tensors=args[0], clone_function=copy, call_function=call)
        if any(a is not b for a, b in zip(keras.tree.flatten(inner.inputs), keras.tree.flatten(args[0]))):
            # (Keras built the copy on copies of an intermediate tensor: its layers are not in this graph)
            raise ValueError(
                f"keras_dvi.convert: the nested functional model {layer.name!r} is called on an intermediate tensor; "
                "convert reads nested Sequential models anywhere and nested functional models where the model's "
                "input feeds them (a backbone under a head). Build the model from the nested model's layers, or "
                "convert only the layers after it (`last_layers=k`).")
        return inner.outputs[0] if len(inner.outputs) == 1 else inner.outputs

    if isinstance(model, keras.Sequential):
        inputs = keras.Input(batch_shape=tuple(model.inputs[0].shape))
        flat = keras.Model(inputs, call(model, inputs), name=model.name)
    else:
        flat = keras.models.clone_model(model, clone_function=copy, call_function=call)
    _copy_weights(copies)
    return flat


def _copy_weights(pairs):
    """Gives each built copy its original's weights, `pairs` of `(layer, copy)` (and finalises
    its state, as Keras does after loading: a `Normalization`'s statistics)."""
    for layer, copy in pairs:
        if layer.weights:
            copy.set_weights(layer.get_weights())
            if hasattr(copy, "finalize_state"):
                copy.finalize_state()


def _through_identities(graph, layer, identity):
    """`(producer, reader)`: the layer that feeds `layer` through layers that do nothing at
    inference or were folded away, and the first layer of that chain (what the producer must
    feed alone); `(None, layer)` if there is no single producer."""
    reader = layer
    while True:
        producers = graph.producers[id(reader)]
        if len(producers) != 1:
            return None, reader
        producer = producers[0]
        if (id(producer) in identity or isinstance(producer, _INFERENCE_IDENTITY)) and graph.only_reader(producer) is reader:
            reader = producer
            continue
        return producer, reader


def _pooled_producer(graph, pool, identity):
    """`(producer, reader)` of a max pooling layer, as `_through_identities`, through zero padding
    too (ResNet's and DenseNet's stems: convolution, batch normalisation, ReLU, `ZeroPadding2D`,
    max pooling). A ReLU or leaky ReLU of the producer moves onto the pooling exactly: both
    commute with the max, and with padding zeros (`f(0) = 0`, and `f(max(x, 0)) = max(f(x), 0)`)."""
    producer, reader = _through_identities(graph, pool, identity)
    while (isinstance(producer, (keras.layers.ZeroPadding1D, keras.layers.ZeroPadding2D))
           and graph.only_reader(producer) is reader):
        producer, reader = _through_identities(graph, producer, identity)
    return producer, reader


def _on_channels(layer, axis, data_format):
    """Whether `axis` (an integer or a one-element list) of `layer`'s input is its channel axis
    under `data_format`."""
    rank = len(keras.tree.flatten(layer.input)[0].shape)
    if not isinstance(axis, int):
        if len(list(axis)) != 1:
            return False
        axis = list(axis)[0]
    return axis % rank == (1 if data_format == "channels_first" else rank - 1)


def _normalises_channels(batch_norm, producer):
    """Whether a batch normalisation's axis (a layer scale's: the last) is the channel axis of
    the layer feeding it."""
    return _on_channels(batch_norm, getattr(batch_norm, "axis", -1), getattr(producer, "data_format", "channels_last"))


def _map_format(graph):
    """The data format of the model's feature maps (its first convolution's; channels last for
    a `Dense` on sequences or images), or `None`."""
    pointwise = any(_is_pointwise(layer) for layer in graph.layers)
    return next((layer.data_format for layer in graph.layers if isinstance(layer, tuple(_CONV))),
                "channels_last" if pointwise else None)


def _is_pointwise(layer):
    """Whether `layer` is a `Dense` on a sequence or an image (`(batch, ..., features)`: the
    same weights at every position), a convolution of kernel size 1."""
    return isinstance(layer, keras.layers.Dense) and len(layer.input.shape) > 2


def _pointwise_conv(dense):
    """The `Conv1D` / `Conv2D` / `Conv3D` of kernel size 1, built with its weights, that a
    `Dense` on a sequence, an image or a volume is."""
    rank = len(dense.input.shape) - 2
    if rank > 3:
        raise ValueError(f"keras_dvi.convert: Dense {dense.name!r} acts on inputs of shape {tuple(dense.input.shape)}; "
                         "keras-dvi converts a Dense on vectors, on sequences (a Conv1D of kernel size 1), on "
                         "images (a 1x1 Conv2D) and on volumes (a 1x1x1 Conv3D).")
    kernel = keras.ops.convert_to_numpy(dense.kernel)
    conv = {1: keras.layers.Conv1D, 2: keras.layers.Conv2D, 3: keras.layers.Conv3D}[rank](
        dense.units, 1, activation=dense.activation, use_bias=dense.use_bias, name=dense.name,
        dtype=dense.dtype_policy)
    conv.build((None,) * (rank + 1) + (kernel.shape[0],))
    conv.set_weights([kernel.reshape((1,) * rank + kernel.shape)]
                     + ([keras.ops.convert_to_numpy(dense.bias)] if dense.use_bias else []))
    return conv


def _normalises_map_channels(batch_norm, graph):
    """Whether a batch normalisation reads a feature map and normalises its channels, or a
    vector and normalises its units (what `BatchNormalizationDVI` does)."""
    if len(batch_norm.input.shape) == 2:
        return _on_channels(batch_norm, batch_norm.axis, "channels_last")
    data_format = _map_format(graph)
    return data_format is not None and _on_channels(batch_norm, batch_norm.axis, data_format)


def _sums_of_twins(converted):
    """The `AddDVI` layers of a converted model two of whose inputs are computed without
    weights from the same tensor: each input traced back through one-input layers without weights
    (pooling, padding, activations) reaches the same layer. `AddDVI` takes its inputs as
    independent; these are strongly correlated (a residual connection `x + f(x)` is not such
    a sum: `f` has weights)."""
    if not any(isinstance(layer, dvi.AddDVI) for layer in converted.layers):
        return []
    graph = _Graph(converted)

    def source(layer):
        while not hasattr(layer, "kernel_mean") and len(graph.producers[id(layer)]) == 1:
            layer = graph.producers[id(layer)][0]
        return layer

    def twins(producers):
        sources = [id(source(producer)) for producer in producers]
        return len(set(sources)) < len(sources)

    return [layer for layer in graph.layers if isinstance(layer, dvi.AddDVI) and twins(graph.producers[id(layer)])]


def _is_grouped_depthwise(layer):
    """Whether `layer` is a `Conv2D` with one group per input channel: a depthwise convolution
    (each group's filters read one channel; output `c * multiplier + j`, as `DepthwiseConv2D`'s)."""
    return (isinstance(layer, keras.layers.Conv2D) and not isinstance(layer, _TRANSPOSED)
            and getattr(layer, "groups", 1) > 1 and int(layer.kernel.shape[-2]) == 1)


def _one_weight_map(layer, function):
    """For a layer that is not Keras' own and has one weight `w`: `w` (float64) if the layer
    computes `function(x, w)` on a random input `x` (`function` returns `None` where `w`'s
    shape cannot fit; the result may have another shape than `x`), else `None` (any other
    layer, or one that cannot run on the probe)."""
    if (not isinstance(layer, keras.layers.Layer) or _is_keras_layer(layer)
            or isinstance(layer, (keras.Model, keras.layers.InputLayer))
            or len(layer.weights) != 1 or not isinstance(layer.input, keras.KerasTensor)):
        return None
    shape = tuple(layer.input.shape)
    weight = keras.ops.convert_to_numpy(layer.weights[0]).astype("float64")
    if any(size is None for size in shape[1:]):
        return None
    probe = np.random.default_rng(0).normal(size=(2,) + shape[1:]).astype(layer.input.dtype)
    expected = function(probe, weight)
    if expected is None:
        return None
    try:
        out = keras.ops.convert_to_numpy(layer(probe, training=False))
    except Exception:  # noqa: BLE001 - any layer that cannot run on the probe computes no such map
        return None
    return weight if out.shape == expected.shape and np.allclose(out, expected, rtol=1e-5, atol=1e-6) else None


def _channel_scale(layer):
    """The weight vector of a layer that multiplies its input's last axis by its only weight
    (ConvNeXt's `LayerScale`, whose class `keras.applications` keeps private), checked on a
    random input; `None` for any other layer."""
    return _one_weight_map(layer, lambda x, w: x * w if w.shape == x.shape[-1:] else None)


def _position_embedding(layer):
    """The embedding `(*spatial, channels)` of a layer that adds its only weight to its input,
    one value per position and channel (a Vision Transformer's learned position embedding:
    `x + E`, `E` of shape `(1, tokens, channels)` or `(tokens, channels)`, or an `Embedding` of
    the positions inside the layer), checked on a random input; `None` for any other layer."""

    def added(x, w):
        return x + w.reshape(x.shape[1:]) if len(x.shape) >= 3 and w.size == math.prod(x.shape[1:]) else None

    weight = _one_weight_map(layer, added)
    return None if weight is None else weight.reshape(tuple(layer.input.shape)[1:])


def _class_token(layer):
    """`(token, joined)` for a layer that puts its only weight, one value per channel, before
    the tokens of its input (`joined`: `concatenate([broadcast(w), x], axis=1)`, a Vision
    Transformer's class token) or returns it alone, `broadcast(w)` of shape
    `(batch, 1, channels)`, for a `Concatenate(axis=1)` to put first (not `joined`); checked on
    a random input. `None` for any other layer."""

    def token(x, w):
        return np.broadcast_to(w.reshape(1, 1, -1), (x.shape[0], 1, x.shape[-1]))

    for joined, function in ((True, lambda x, w: np.concatenate([token(x, w), x], axis=1)), (False, token)):
        weight = _one_weight_map(layer, lambda x, w: function(x, w) if x.ndim == 3 and w.size == x.shape[-1] else None)
        if weight is not None:
            return weight.reshape(-1), joined
    return None


def _selected_token(node):
    """The index (from 0) of the token that an operation, `Lambda` or custom layer without
    weights takes from a sequence `(batch, tokens, channels)` as a vector: `x[:, i]` (the
    class token a Vision Transformer's or BERT's head reads), `keras.ops.take(x, i, axis=1)`.
    Checked through public API only (the node as a `keras.Model` of its input) on a probe
    whose entries are all different; `None` for any other node."""
    if not _is_custom(node):
        return None
    inputs = [t for t in keras.tree.flatten(node.input) if isinstance(t, keras.KerasTensor)]
    outputs = keras.tree.flatten(node.output)
    if (len(inputs) != 1 or len(outputs) != 1 or len(inputs[0].shape) != 3 or len(outputs[0].shape) != 2
            or any(d is None for d in inputs[0].shape[1:]) or outputs[0].shape[-1] != inputs[0].shape[-1]):
        return None
    tokens, channels = inputs[0].shape[1:]
    probe = np.arange(1, 1 + 2 * tokens * channels, dtype=inputs[0].dtype).reshape(2, tokens, channels)
    try:
        out = keras.ops.convert_to_numpy(keras.Model(inputs[0], outputs[0])(probe))
    except Exception:  # noqa: BLE001 (a node that does not run on the probe selects no token)
        return None
    if out.shape != (2, channels):
        return None
    return next((i for i in range(tokens) if np.array_equal(out, probe[:, i])), None)


def _is_weight_layer(layer):
    return isinstance(layer, (keras.layers.Dense, keras.layers.DepthwiseConv2D, keras.layers.SeparableConv2D, *_CONV))


def _starts_bayesian(layer):
    """Whether `layer` has weights `convert` makes Bayesian (the layers before the first one
    stay plain preprocessing: an embedding, a rescaling)."""
    return _is_weight_layer(layer) or isinstance(layer, keras.layers.MultiHeadAttention)


def _check_attention(layer, graph):
    """Refuses, by name, the `MultiHeadAttention` options keras-dvi's attention lacks, and a
    padding mask reaching it (from an `Embedding(mask_zero=True)` or a `Masking` layer up the
    graph: Keras passes it implicitly, keras-dvi's layers would drop it)."""
    seen, todo = set(), list(graph.producers[id(layer)])
    while todo:
        producer = todo.pop()
        if id(producer) in seen:
            continue
        seen.add(id(producer))
        if isinstance(producer, keras.layers.Masking) or getattr(producer, "mask_zero", False):
            raise ValueError(f"keras_dvi.convert: MultiHeadAttention {layer.name!r} receives a padding mask (from "
                             f"{producer.name!r}: mask_zero=True or a Masking layer); keras-dvi's attention takes an "
                             "explicit `attention_mask`. Build the plain model without the implicit mask and pass "
                             "it as `attention_mask`.")
        todo.extend(graph.producers[id(producer)])
    config = layer.get_config()
    options = [name for name in ("use_gate", "sliding_window") if config.get(name) not in (None, False)]
    if len(layer.query_dense.kernel.shape) != 3:
        options.append("attention_axes")
    if options:
        raise ValueError(f"keras_dvi.convert: MultiHeadAttention {layer.name!r} uses {', '.join(options)}; "
                         "keras_dvi.MultiHeadAttentionDVI attends over the sequence axis of (batch, T, C) inputs, "
                         "without a gate or a sliding window. To keep the layers up to it plain, convert only the "
                         "layers after it (`last_layers=k`).")


def _attention_arguments(layer, kwargs):
    """The call arguments of a converted attention: the attention mask and the causal mask are
    carried; padding masks (`query_mask`, `value_mask`, `key_mask`: an `Embedding` with
    `mask_zero=True`) and returned scores are refused by name."""
    kwargs = dict(kwargs)
    for name in ("query_mask", "value_mask", "key_mask"):
        if kwargs.pop(name, None) is not None:
            raise ValueError(f"keras_dvi.convert: MultiHeadAttention {layer.name!r} receives a padding mask "
                             f"(`{name}`, from a layer with mask_zero=True or a Masking layer); keras-dvi's attention "
                             "takes an explicit `attention_mask`. Pass the mask as `attention_mask` in the plain "
                             "model.")
    if kwargs.pop("return_attention_scores", False):
        raise ValueError(f"keras_dvi.convert: MultiHeadAttention {layer.name!r} returns its attention scores; "
                         "keras_dvi.MultiHeadAttentionDVI returns the output's moments alone.")
    kwargs.pop("training", None)
    return kwargs


def _plain_parts(layer, on_vector):
    """The plain layers a layer with weights converts as, built with its weights: a
    `SeparableConv2D` is a `DepthwiseConv2D` (linear, no bias) and a 1x1 `Conv2D` (its bias and
    activation); a 1x1 convolution on a channel vector (`_vectors`) is a `Dense`, a `Dense` on
    a sequence or an image a convolution of kernel size 1; any other layer is itself."""
    if isinstance(layer, keras.layers.Dense):
        return [_pointwise_conv(layer)] if _is_pointwise(layer) and not on_vector else [layer]
    if on_vector:
        kernel = keras.ops.convert_to_numpy(layer.kernel)
        dense = keras.layers.Dense(layer.filters, activation=layer.activation, use_bias=layer.use_bias,
                                   name=layer.name, dtype=layer.dtype_policy)
        dense.build((None, kernel.shape[-2]))
        dense.set_weights([kernel.reshape(kernel.shape[-2:])] + ([keras.ops.convert_to_numpy(layer.bias)]
                                                                 if layer.use_bias else []))
        return [dense]
    if _is_grouped_depthwise(layer):  # Conv2D(groups=channels): ConvNeXt's depthwise convolution
        kernel = keras.ops.convert_to_numpy(layer.kernel)  # (*kernel_size, 1, channels * multiplier)
        channels = layer.groups
        depthwise = keras.layers.DepthwiseConv2D(
            layer.kernel_size, strides=layer.strides, padding=layer.padding,
            depth_multiplier=layer.filters // channels, data_format=layer.data_format,
            dilation_rate=layer.dilation_rate, activation=layer.activation, use_bias=layer.use_bias,
            name=layer.name, dtype=layer.dtype_policy)
        depthwise.build((None, channels, None, None) if layer.data_format == "channels_first"
                        else (None, None, None, channels))
        depthwise.set_weights([kernel.reshape(kernel.shape[:2] + (channels, layer.filters // channels))]
                              + ([keras.ops.convert_to_numpy(layer.bias)] if layer.use_bias else []))
        return [depthwise]
    if not isinstance(layer, keras.layers.SeparableConv2D):
        return [layer]
    channels = int(layer.depthwise_kernel.shape[-2])
    spatial = (None, None)
    shape = (None, channels, *spatial) if layer.data_format == "channels_first" else (None, *spatial, channels)
    depthwise = keras.layers.DepthwiseConv2D(
        layer.kernel_size, strides=layer.strides, padding=layer.padding, depth_multiplier=layer.depth_multiplier,
        data_format=layer.data_format, dilation_rate=layer.dilation_rate, use_bias=False,
        name=f"{layer.name}_depthwise", dtype=layer.dtype_policy)
    depthwise.build(shape)
    depthwise.set_weights([keras.ops.convert_to_numpy(layer.depthwise_kernel)])
    pointwise = keras.layers.Conv2D(layer.filters, 1, data_format=layer.data_format, activation=layer.activation,
                                    use_bias=layer.use_bias, name=layer.name, dtype=layer.dtype_policy)
    middle = channels * layer.depth_multiplier
    pointwise.build((None, middle, *spatial) if layer.data_format == "channels_first" else (None, *spatial, middle))
    pointwise.set_weights([keras.ops.convert_to_numpy(layer.pointwise_kernel)]
                          + ([keras.ops.convert_to_numpy(layer.bias)] if layer.use_bias else []))
    return [depthwise, pointwise]


def _vectors(graph):
    """The layers whose outputs are channel vectors: a global average pooling (with
    `keepdims=True` a 1x1 map) or a token taken from a sequence (`x[:, 0]`), and the 1x1
    convolutions, `Reshape`s, `Flatten`s, activations and inference-time no-ops that follow it
    (MobileNets' heads, squeeze-and-excitation gates). keras-dvi carries them in the dense form: the pooling returns it, each convolution
    becomes a `Dense`, each reshape an identity."""
    vectors = set()
    for layer in graph.layers:
        producers = graph.producers[id(layer)]
        if isinstance(layer, tuple(_GLOBAL_POOLING)) or id(layer) in graph.selections:
            vectors.add(id(layer))
            continue
        if len(producers) != 1 or id(producers[0]) not in vectors:
            continue
        if isinstance(layer, tuple(_CONV)):
            if all(int(k) == 1 for k in layer.kernel_size) and getattr(layer, "groups", 1) == 1:
                vectors.add(id(layer))
        elif isinstance(layer, keras.layers.Dense):
            vectors.add(id(layer))
        elif _is_operation(layer) or isinstance(layer, (keras.layers.Reshape, keras.layers.Flatten,
                                                         *_INFERENCE_IDENTITY, *_ACTIVATION_LAYERS)):
            vectors.add(id(layer))
    return vectors


def _is_operation(node):
    """Whether a node of the graph is an operation on tensors (`x + 3.0`, `x * (1 / 6)`, a
    `keras.ops` call) rather than a layer."""
    return not isinstance(node, keras.layers.Layer)


def _is_keras_layer(layer):
    """Whether `layer` is one of Keras' own layers (a `Lambda` is the user's code)."""
    return type(layer).__module__.startswith("keras.src.layers") and not isinstance(layer, keras.layers.Lambda)


def _is_custom(node):
    """Whether a node of the graph is code `convert` can only probe: an operation on tensors, a
    `Lambda`, or a layer without weights that is not Keras' own (nor a model)."""
    if _is_operation(node):
        return True
    return not (node.weights or isinstance(node, keras.Model) or _is_keras_layer(node))


def _sum_scales(node):
    """`(c1, c2)`, both nonzero, for a node without weights that computes `c1 a + c2 b` of its
    two inputs of one shape: a residual sum written `x + y` (ConvNeXt's), or a `Lambda` or
    custom layer adding a scaled residual (InceptionResNetV2's `x + scale * r`). Checked
    numerically, through public API only (the node as a `keras.Model` of its two inputs), on
    random inputs; `None` for any other node."""
    if not _is_custom(node):
        return None
    inputs = keras.tree.flatten(node.input)
    if (len(inputs) != 2 or not all(isinstance(t, keras.KerasTensor) for t in inputs)
            or tuple(inputs[0].shape) != tuple(inputs[1].shape) or any(d is None for d in inputs[0].shape[1:])):
        return None
    try:
        part = keras.Model(inputs, node.output)
    except (ValueError, TypeError, AttributeError):
        return None
    rng = np.random.default_rng(0)
    a, b = (rng.normal(size=(2,) + tuple(inputs[0].shape[1:])).astype(inputs[0].dtype) for _ in range(2))
    try:
        out, first, second = (keras.ops.convert_to_numpy(part([u, v])).astype("float64")
                              for u, v in ((a, b), (a, 0 * b), (0 * a, b)))
    except Exception:  # noqa: BLE001 (a node that does not run on the probe computes no sum)
        return None
    if out.shape != a.shape:
        return None
    scales = float(np.sum(first * a) / np.sum(a * a)), float(np.sum(second * b) / np.sum(b * b))
    if min(abs(c) for c in scales) < 1e-6 or not np.allclose(out, scales[0] * a + scales[1] * b, rtol=1e-5,
                                                             atol=1e-5):
        return None
    return tuple(1.0 if np.isclose(c, 1.0, rtol=1e-6, atol=0.0) else c for c in scales)


def _operation_refused(operation):
    """The `ValueError` of an operation on tensors that `convert` cannot carry."""
    return ValueError(
        f"keras_dvi.convert: operation {operation.name!r} (keras.ops {type(operation).__name__}: an operator or "
        "keras.ops call on a tensor, such as `x + 3.0`, not a layer) has no keras-dvi counterpart. Operations "
        "convert only as a chain (with activation layers) that a Dense, convolution, max pooling, Add or batch "
        f"normalisation feeds alone and that computes one of the activations {_SUPPORTED} elementwise, such as MobileNetV3's hard "
        "sigmoid `ReLU(6.0)(x + 3.0) * (1.0 / 6.0)`; that activation then folds into the layer. To keep the "
        "layers up to it plain, convert only the layers after it (`last_layers=k`).")


def _elementwise_activation(start, end):
    """The supported activation that the part of the model from tensor `start` to tensor `end`
    computes elementwise, or `None`. Identified numerically, through public API only (the
    part as a `keras.Model`): on a tensor whose entries cover -8 to 8 (every kink of the
    supported activations) in a fixed shuffle, the part must agree with one activation entry
    by entry, to float32 round-off."""
    try:
        part = keras.Model(start, end)
    except (ValueError, TypeError, AttributeError):
        return None
    grid = np.concatenate([np.linspace(-8.0, 8.0, 161), [-3.0, 0.0, 3.0, 6.0]])
    row = [1 if d is None else int(d) for d in start.shape[1:]]
    rows = -(-len(grid) // int(np.prod(row))) + 1  # (every grid value at least once)
    x = np.resize(np.random.default_rng(0).permutation(grid), rows * int(np.prod(row)))
    x = x.reshape((rows, *row)).astype(start.dtype)
    try:
        y = keras.ops.convert_to_numpy(part(x)).astype("float64")
    except Exception:  # noqa: BLE001 (a part that does not run on this tensor computes no activation)
        return None
    if y.shape != x.shape:
        return None
    for name in moments.ACTIVATIONS:
        expected = keras.ops.convert_to_numpy(moments.get_activation(name).apply(keras.ops.convert_to_tensor(x)))
        if np.allclose(y, expected, rtol=1e-5, atol=1e-5):
            return name
    return None


def _takes_activation(layer, graph):
    """Whether an activation after `layer` (of `graph`) folds into it: a `Dense`, a
    convolution, a max pooling, an `Add` (or a sum written `x + y`) or a layer, RMS or group
    normalisation (keras-dvi's counterparts apply their own `activation`)."""
    return (_is_weight_layer(layer) or id(layer) in graph.sums
            or isinstance(layer, (*_MAX_POOLING, keras.layers.Add, *_NORMALISATIONS)))


def _operation_activations(graph, plain):
    """`{id(layer): (activation, chain)}`: a layer (a linear `Dense` or convolution, a max
    pooling, an `Add`, or a batch normalisation or layer scale, which `_plan` folds and whose
    activation then goes to the layer it folds into) read only by a chain of operations on
    tensors and activation layers, each the only reader of the one before, that computes a
    supported activation elementwise: MobileNetV3's hard sigmoid gates,
    `ReLU(6.0)(x + 3.0) * (1.0 / 6.0)`, or keras.io's DeepLabV3+ `ops.nn.relu` after batch
    normalisation. The activation folds into the layer; the chain becomes identities. The
    longest such chain that contains an operation counts (chains of layers alone fold one by
    one in `_plan`)."""
    found = {}
    for layer in graph.layers:
        if id(layer) in plain or _activation_of(layer) != "linear" or not (
                _takes_activation(layer, graph) or isinstance(layer, keras.layers.BatchNormalization)
                or id(layer) in graph.scales):
            continue
        chain, node = [], layer
        while True:
            reader = graph.only_reader(node)
            if (reader is None or len(graph.producers[id(reader)]) != 1
                    or not (_is_operation(reader) or isinstance(reader, _ACTIVATION_LAYERS))):
                break
            chain.append(reader)
            node = reader
        for end in range(len(chain), 0, -1):
            if not any(_is_operation(node) for node in chain[:end]):
                break
            name = _elementwise_activation(layer.output, chain[end - 1].output)
            if name is not None:
                found[id(layer)] = (name, chain[:end])
                break
    return found


def _plan(graph):
    """`(activation of each converted layer, layers replaced by an identity, the per-channel
    map `(scale, offset)` folded into each layer (a batch normalisation or layer scale after it,
    `_channel_affine`), layers kept as plain preprocessing, vectors)`. A batch
    normalisation that cannot be folded becomes a `BatchNormalizationDVI` (an entry in the
    activations: the activation after it folds into it)."""
    activation, identity, folded, plain = {}, set(), {}, set()
    vectors = _vectors(graph)
    identity |= {id(layer) for layer in graph.layers
                 if id(layer) in vectors and isinstance(layer, (keras.layers.Reshape, keras.layers.Flatten))}
    identity |= graph.class_tokens[1]  # (a class token returned alone: its Concatenate becomes the ClassTokenDVI)
    started = set()  # layers at or after the first layer with weights
    for layer in graph.layers:
        after = _starts_bayesian(layer) or any(id(p) in started for p in graph.producers[id(layer)])
        if after:
            started.add(id(layer))
        else:
            plain.add(id(layer))
    for node in graph.layers:  # a scaled sum `c1 a + c2 b`: each scale folds into the layer feeding it
        scales = graph.sums.get(id(node), (1.0, 1.0))
        if id(node) in plain or scales == (1.0, 1.0):
            continue
        producers = graph.producers[id(node)]
        for producer, scale in zip(producers, scales):
            if scale == 1.0:
                continue
            if (len(producers) != 2 or not _is_weight_layer(producer) or _activation_of(producer) != "linear"
                    or graph.only_reader(producer) is not node):
                raise ValueError(
                    f"keras_dvi.convert: {type(node).__name__} {node.name!r} adds its two inputs scaled by "
                    f"{scales[0]:.6g} and {scales[1]:.6g} (as InceptionResNetV2's `x + scale * r`); keras-dvi folds a "
                    "scale into the linear Dense or convolution that feeds the sum alone, and the input scaled by "
                    f"{scale:.6g} comes from {producer.name!r} ({type(producer).__name__}), which is not one. To keep "
                    "the layers up to it plain, convert only the layers after it (`last_layers=k`).")
            axis = 1 if getattr(producer, "data_format", "channels_last") == "channels_first" else -1
            folded[id(producer)] = (np.full(int(producer.output.shape[axis]), scale), 0.0)
    for key, (name, chain) in _operation_activations(graph, plain).items():
        activation[key] = name
        identity |= {id(node) for node in chain}
    for layer in graph.layers:
        if id(layer) in plain or id(layer) in identity:
            continue
        if _takes_activation(layer, graph):
            activation.setdefault(id(layer), _activation_of(layer) if _is_weight_layer(layer) else "linear")
        if isinstance(layer, (keras.layers.BatchNormalization, *_ACTIVATION_LAYERS)) or id(layer) in graph.scales:
            per_channel = not isinstance(layer, _ACTIVATION_LAYERS)  # (a batch normalisation or layer scale)
            name = None if per_channel else _activation_of(layer)
            if name == "softmax" and id(layer) in graph.outputs:
                identity.add(id(layer))  # keras-dvi outputs logits; SoftmaxDeltaELL applies the softmax
                continue
            producer, reader = _through_identities(graph, layer, identity)
            foldable = (producer is not None and activation.get(id(producer)) == "linear"
                        and graph.only_reader(producer) is reader
                        and (_is_weight_layer(producer) and _normalises_channels(layer, producer) if per_channel
                             else name not in (None, "softmax")))
            if id(layer) in graph.scales and not foldable:
                raise ValueError(
                    f"keras_dvi.convert: layer {layer.name!r} ({type(layer).__name__}) multiplies each channel by a "
                    "weight (a layer scale); it can be folded only into a linear Dense or channels-last "
                    "convolution that feeds it alone. To keep the layers up to it plain, convert only the layers "
                    "after it (`last_layers=k`).")
            if per_channel and not foldable and _normalises_map_channels(layer, graph):
                activation.setdefault(id(layer), "linear")  # a BatchNormalizationDVI (its own activation)
                continue
            if (not per_channel and not foldable and name not in (None, "softmax")
                    and (_map_format(graph) is not None or len(layer.input.shape) == 2)):
                activation[id(layer)] = name  # an ActivationDVI (on a map or a vector): its input has other readers
                continue
            if not foldable and producer is not None and _is_operation(producer):
                raise _operation_refused(producer)
            if not foldable:
                raise ValueError(
                    f"keras_dvi.convert: BatchNormalization {layer.name!r} can be folded only into a linear Dense "
                    "or convolution that feeds it alone, normalising its channels (its inference-time scale and "
                    "shift then become that layer's weights), or normalise the channels of a feature map or the "
                    "units of a vector (keras_dvi.BatchNormalizationDVI)." if per_channel else
                    f"keras_dvi.convert: activation layer {layer.name!r} ({type(layer).__name__}"
                    f"{'' if name else ' ' + repr(_function_name(layer))}) can be folded only into the Dense, convolution, max pooling, Add or batch normalisation layer that feeds it "
                    f"alone, or stand on a feature map, with activation {_SUPPORTED} (a softmax only at the "
                    "output); other functions (softplus, ELU, ReLU with other bounds or thresholds, ...) have no "
                    "Gaussian moment rule in keras-dvi. To keep the layers up to it plain, convert only the "
                    "layers after it (`last_layers=k`).")
            if per_channel:
                folded[id(producer)] = _channel_affine(layer, graph)
                if id(layer) in activation:  # (a chain of operations after it: `_operation_activations`)
                    activation[id(producer)] = activation.pop(id(layer))
            else:
                activation[id(producer)] = name
            identity.add(id(layer))
    for layer in graph.layers:  # the ReLU of a convolution moves to the max pooling it feeds
        if not isinstance(layer, _MAX_POOLING):
            continue
        producer, reader = _pooled_producer(graph, layer, identity)
        if (isinstance(producer, tuple(_CONV)) and graph.only_reader(producer) is reader
                and activation.get(id(producer)) in ("relu", "leaky_relu") and activation.get(id(layer)) == "linear"):
            activation[id(layer)], activation[id(producer)] = activation[id(producer)], "linear"
    for layer in graph.layers:
        if _is_weight_layer(layer) and activation.get(id(layer)) == "softmax":
            if id(layer) not in graph.outputs:
                raise ValueError(f"keras_dvi.convert: layer {layer.name!r} applies a softmax inside the network; "
                                 f"keras-dvi layers apply {_SUPPORTED}, 'heaviside' or none.")
            activation[id(layer)] = "linear"  # the logits
        if _is_weight_layer(layer) and activation.get(id(layer)) is None:
            raise ValueError(
                f"keras_dvi.convert: layer {layer.name!r} has activation "
                f"{getattr(layer.activation, '__name__', layer.activation)!r}, which has no closed-form Gaussian "
                f"moments here; keras-dvi layers apply {_SUPPORTED}, 'heaviside' or none.")
    return activation, identity, folded, plain, vectors


def _head(model, last_layers):
    """The part of `model` from the input of its `last_layers`-th last layer with weights (a
    `Dense` or convolution among its top-level layers) to its outputs, as a functional model on
    the same layers (Keras gives it copies of the cut tensor and of the outputs); `ValueError`
    if the model does not pass through that one tensor."""
    last_layers = validation.positive_integer("last_layers", last_layers)
    weighted = [layer for layer in model.layers if _is_weight_layer(layer)]
    if last_layers > len(weighted):
        raise ValueError(f"Argument `last_layers` of keras_dvi.convert must be at most {len(weighted)}, the number of "
                         f"Dense and convolution layers of the model; received last_layers={last_layers}.")
    first = weighted[-last_layers]
    try:
        return keras.Model(first.input, model.outputs)
    except (ValueError, AttributeError) as error:
        raise ValueError(
            f"keras_dvi.convert: with last_layers={last_layers} the keras-dvi part starts at layer {first.name!r}, "
            "but the model's outputs do not depend on the rest of the model through its input alone (a skip "
            "connection passes it, or the layer is called more than once); choose another `last_layers`."
        ) from error


#: Keras losses of a plain model that make it a classifier over its output units.
_CLASSIFICATION_LOSSES = (keras.losses.SparseCategoricalCrossentropy, keras.losses.CategoricalCrossentropy)
_CLASSIFICATION_LOSS_NAMES = ("sparse_categorical_crossentropy", "categorical_crossentropy")
#: Keras losses of a plain model that make it a binary classifier over its one output unit.
_BINARY_LOSSES = (keras.losses.BinaryCrossentropy, keras.losses.BinaryFocalCrossentropy)
_BINARY_LOSS_NAMES = ("binary_crossentropy",)


#: Keras losses of a plain model that make it a regression of the mean of Gaussian targets.
_MEAN_SQUARED_LOSS_NAMES = ("mse", "mean_squared_error", "MeanSquaredError")


def _is_loss(loss, kinds, names):
    """Whether a plain model's compiled `loss` is one of the Keras losses `kinds` (instances) or
    `names` (a string, or a loss function of that name)."""
    return isinstance(loss, kinds) or (loss if isinstance(loss, str) else getattr(loss, "__name__", None)) in names


def _output_keys(model):
    """The keys of a model's outputs in the order of its flattened outputs: a dict's sorted
    keys, else `model.output_names`."""
    structure = model.output
    return [str(key) for key in sorted(structure)] if isinstance(structure, dict) else list(model.output_names)


def _output_losses(model, count):
    """The plain model's compiled loss of each of its `count` outputs (in `model.outputs`'
    order; `None` where it has none): one loss for every output, or a list or dict of them."""
    loss = getattr(model, "loss", None)
    if isinstance(loss, dict):
        keys = _output_keys(model)
        return [loss.get(key) for key in keys] + [None] * (count - len(keys))
    if isinstance(loss, (list, tuple)):
        return list(loss)[:count] + [None] * (count - len(loss))
    return [loss] * count


#: What each output of a plain model is to `convert`: `_output_tasks`.
BINARY, CLASSIFIER, REGRESSION = "binary", "classifier", "regression"


def _output_tasks(model, graph, heads):
    """Per output of the plain model (`graph.output_layers`, computed by `heads`): `BINARY` (one
    unit under a sigmoid or a binary cross-entropy), `CLASSIFIER` (a softmax, or a categorical
    cross-entropy), `REGRESSION` (the mean squared error: a Gaussian likelihood of fixed
    variance, whose keras-dvi counterpart learns the variance) or `None`; and the plain losses."""
    plain_losses = _output_losses(model, len(graph.output_layers))
    tasks = []
    for layer, head, loss in zip(graph.output_layers, heads, plain_losses):
        units = keras.tree.flatten(layer.output)[0].shape[-1]  # (channels-first dense predictions are refused)
        activations = {_activation_of(layer), _activation_of(head) if _is_weight_layer(head) else None}
        if units == 1 and ("sigmoid" in activations or _is_loss(loss, _BINARY_LOSSES, _BINARY_LOSS_NAMES)):
            tasks.append(BINARY)
        elif "softmax" in activations or _is_loss(loss, _CLASSIFICATION_LOSSES, _CLASSIFICATION_LOSS_NAMES):
            tasks.append(CLASSIFIER)
        elif _is_loss(loss, keras.losses.MeanSquaredError, _MEAN_SQUARED_LOSS_NAMES):
            tasks.append(REGRESSION)
        else:
            tasks.append(None)
    return tasks, plain_losses


def _output_layers(graph, identity):
    """The layers that compute the model's outputs: each output layer, or the layer it reads
    through folded ones and inference-time no-ops (a `Dense` under a `Softmax` layer or an
    `Activation("sigmoid")`), so that a head written either way converts alike."""
    found = []
    for layer in graph.output_layers:
        if id(layer) in identity or isinstance(layer, _INFERENCE_IDENTITY):
            layer = _through_identities(graph, layer, identity)[0] or layer
        found.append(layer)
    return found


def _binary_logits(layer, kernel, bias):
    """A built two-unit copy of a one-unit `Dense` or convolution (a binary segmentation's
    output) computing `z` (with `kernel`, `bias`), that computes the logits `(0, z)`: its softmax
    is `(1 - sigmoid(z), sigmoid(z))`, the binary classifier's."""
    transposed = isinstance(layer, _TRANSPOSED)
    config = {**layer.get_config(), "activation": "linear", "use_bias": True}
    config["units" if isinstance(layer, keras.layers.Dense) else "filters"] = 2
    two = type(layer).from_config(config)
    channels = int(kernel.shape[-1 if transposed else -2])
    rank = len(kernel.shape) - 2
    spatial = (None,) * rank
    two.build((None, channels) + spatial if getattr(layer, "data_format", None) == "channels_first" and rank
              else (None,) + spatial + (channels,))
    axis = -2 if transposed else -1  # (a transposed kernel is (*kernel_size, filters, in))
    two.set_weights([np.concatenate([np.zeros_like(kernel), kernel], axis=axis),
                     np.array([0.0, 0.0 if bias is None else float(np.ravel(bias)[0])])])
    return two


def _channel_affine(layer, graph):
    """`(scale, offset)` of the per-channel map `y = scale x + offset` that a batch normalisation
    of `graph` computes at inference, or a layer scale (`graph.scales`; offset 0)."""
    if not isinstance(layer, keras.layers.BatchNormalization):
        return graph.scales[id(layer)], 0.0
    get = lambda v, default: default if v is None else keras.ops.convert_to_numpy(v).astype("float64")  # noqa: E731
    channels = int(layer.moving_mean.shape[0])
    gamma = get(layer.gamma, np.ones(channels))
    beta = get(layer.beta, np.zeros(channels))
    mean, variance = get(layer.moving_mean, None), get(layer.moving_variance, None)
    scale = gamma / np.sqrt(variance + layer.epsilon)
    return scale, beta - mean * scale


def _folded_weights(layer, affine):
    """The kernel and bias of `layer` with the per-channel map `affine` after it folded in
    (`(scale, offset)`, `_channel_affine`: an inference-time batch normalisation or a layer
    scale), or as they are (`None`)."""
    kernel = keras.ops.convert_to_numpy(layer.kernel).astype("float64")
    bias = keras.ops.convert_to_numpy(layer.bias).astype("float64") if layer.use_bias else 0.0
    if affine is None:
        return kernel, (bias if layer.use_bias else None)
    scale, offset = affine
    shift = np.broadcast_to(bias * scale + offset, np.shape(scale)).copy()
    if isinstance(layer, keras.layers.DepthwiseConv2D):  # output channel c * multiplier + j
        scale = scale.reshape(kernel.shape[-2:])
    elif isinstance(layer, _TRANSPOSED):  # kernel (*kernel_size, filters, in)
        scale = scale[:, None]
    return kernel * scale, shift


def _unbounded(activation):
    """Whether `activation` is nonlinear and unbounded (its `moments.Activation` entry)."""
    entry = moments.get_activation(activation)
    return not (entry.bounded or entry.identity)


def convert(model, regularizer=None, kernel_variance=None, bias_variance=None, hidden_covariance="diagonal",
            last_layers=None):
    """The keras-dvi counterpart of a built plain Keras model, its weights as posterior means.

    Every layer with weights becomes its keras-dvi counterpart, with a factorised Gaussian
    posterior whose means are the layer's weights (`DenseDiagDVI.from_dense`,
    `Conv2DDVI.from_conv`), and the layers between them follow: the conversion bayesian-torch's
    `dnn_to_bnn` and MOPED offer, for Keras. Train a plain network, convert it, and fine-tune
    the Bayesian network with a keras-dvi loss and the priors' defaults: a classifier under the
    KL weight rule of `kl_weight="auto"` (under the full ELBO, `kl_weight=1`, a small data set
    walks it back to the prior), a regression network under the ELBO.

    | plain layer | keras-dvi layer |
    |---|---|
    | `Dense` | `DenseDiagDVI` (hidden layers; `hidden_covariance="full"`: `DenseDVI`), `DenseDVI` (model outputs) |
    | `Dense` on a sequence, an image or a volume | `Conv1DDVI` of kernel size 1, 1x1 `Conv2DDVI`, 1x1x1 `Conv3DDVI` (the same function) |
    | `Conv1D`, `Conv2D`, `Conv3D` | `Conv1DDVI`, `Conv2DDVI`, `Conv3DDVI` (strides, padding, dilation, data format kept) |
    | `DepthwiseConv2D`, a `Conv2D` with one group per input channel (ConvNeXt's) | `DepthwiseConv2DDVI` |
    | `SeparableConv2D` | `DepthwiseConv2DDVI`, then a 1x1 `Conv2DDVI` |
    | `MaxPooling*D`, `AveragePooling*D`, `GlobalAveragePooling*D`, `GlobalMaxPooling*D`, `Flatten`, `Add` | their keras-dvi counterparts |
    | `Conv1DTranspose`, `Conv2DTranspose`, `Conv3DTranspose` | `Conv1DTransposeDVI`, `Conv2DTransposeDVI`, `Conv3DTransposeDVI` |
    | `ZeroPadding*D`, `Cropping*D`, `UpSampling*D` (any interpolation), `Concatenate` (channels) | `ZeroPadding*DDVI`, `Cropping*DDVI`, `UpSampling*DDVI`, `ConcatenateDVI` |
    | `Add` of vectors (residual MLPs), `Concatenate` of vectors and inputs (wide and deep) | `AddDVI`, `ConcatenateDVI` |
    | a sum of two tensors written `x + y` (ConvNeXt's residual sums) | `AddDVI` |
    | a scaled sum `c1 x + c2 y` (InceptionResNetV2's `x + scale * r`; a `Lambda`; `x - y`) | `AddDVI`, each scale folded into the linear `Dense` or convolution that feeds it alone |
    | `Multiply` of a feature map and a gate from its global average (squeeze-and-excitation) | `MultiplyDVI` |
    | `Activation`, `ReLU`, `LeakyReLU` after a layer that feeds it alone | folded into that layer |
    | operations on tensors after a layer that feeds them alone, computing a supported activation elementwise (MobileNetV3's hard sigmoid `ReLU(6.0)(x + 3.0) * (1.0 / 6.0)`) | folded into that layer |
    | the same on a feature map or vector that other layers also read | `ActivationDVI` |
    | `GlobalAveragePooling2D`, then 1x1 `Conv2D`, `Reshape` (a channel-vector head or gate) | `GlobalAveragePooling2DDVI`, `Dense*DVI`, identities |
    | `BatchNormalization` after a linear `Dense` or convolution that feeds it alone | folded into its weights (inference statistics) |
    | any other `BatchNormalization` on a feature map's channels or a vector's units | `BatchNormalizationDVI` (inference statistics, fixed) |
    | a layer that multiplies each channel by its one weight (ConvNeXt's `LayerScale`) after a linear `Dense` or convolution that feeds it alone | folded into its weights |
    | `LayerNormalization` of a feature map's channels or a vector's units | `LayerNormalizationDVI` |
    | `GroupNormalization` (instance normalisation: `groups=-1`) of a feature map's channels or a vector's units | `GroupNormalizationDVI` |
    | `RMSNormalization` of a feature map's channels or a vector's units | `RMSNormalizationDVI` |
    | `MultiHeadAttention` on sequences (self-, cross- or causal attention, an `attention_mask`) | `MultiHeadAttentionDVI` |
    | `Reshape` of a map's positions, channels kept (a Vision Transformer's patches into tokens); `Reshape` to one axis | `ReshapeDVI`; `FlattenDVI` |
    | a layer that adds its one weight, one value per position and channel (a Vision Transformer's position embedding), after the first layer with weights | `PositionEmbeddingDVI` (a point estimate) |
    | a layer that puts its one weight, one value per channel, before the tokens (a class token), or returns it for a `Concatenate(axis=1)` to put first | `ClassTokenDVI` (a point estimate) |
    | `x[:, i]`, `keras.ops.take(x, i, axis=1)` or a `Lambda` doing either: one token of a sequence (the class token a head reads) | `SelectTokenDVI(i)` |
    | `Dropout` and other inference-time no-ops | removed (an identity) |
    | a nested `Sequential` model, or a nested functional model that the input feeds (a backbone) | its layers, converted as above |
    | a softmax on the output | removed: keras-dvi outputs logits, `SoftmaxDeltaELL` applies it |
    | a sigmoid on a one-unit output, or a binary cross-entropy on it | a two-class `DenseDVI` with the logits `(0, z)` (softmax: `1 - sigmoid(z)`, `sigmoid(z)`) |

    A ReLU on a convolution that feeds a max pooling (directly, through batch normalisation, a
    ReLU layer or zero padding) moves to the pooling layer, the same function in the form whose
    moments are accurate. Layers without weights before the first
    layer with weights (`Rescaling`, `Normalization`, `Reshape`, an `Embedding`, operations such
    as `x / 255.0`, ...) stay as they are; their outputs are data to the next layer (a residual
    sum adds an embedding as data). Unit normalisation, `Attention`, `AdditiveAttention` and
    recurrent layers have no accurate Gaussian rule here and are refused with the reason. Anything
    else is refused with an error that names the layer. A converted layer keeps the plain
    layer's `trainable` setting (a warning says when one is frozen: its variances are then not
    fitted).

    **Only the last layers** (`last_layers=k`): the last `k` `Dense` or convolution layers
    become keras-dvi layers, and everything before the first of them stays a plain Keras
    network: copies of the plain model's layers with their weights and `trainable` settings
    (a frozen backbone stays frozen), nested models and attention included. This serves any
    model whose head is a stack of dense or conv layers (a Transformer classifier, a
    `keras.applications` or KerasHub backbone under a dense head), the "Bayesian last layers"
    of the Laplace and variational last-layer literature.

    **A classifier comes back compiled**, ready for `fit` and `keras_dvi.predict`: when the
    plain model ends in a softmax (or a binary classifier's sigmoid) or is compiled with a
    categorical (or binary) cross-entropy, the
    converted model is compiled with `SoftmaxDeltaELL` (with the plain loss's `label_smoothing`)
    and a fresh copy of the plain model's optimizer (`Adam(1e-3)` if it had none); compile it
    again to change either. An accuracy metric carries over as `MeanLogitAccuracy`, the mean
    squared error of a regression as `PredictiveMSE` (a warning names the others). **A regression
    model compiled with the mean squared error** comes back with a learned noise variance,
    `keras_dvi.HomoscedasticNoise(log_variance_scale=10.0)` after its output (the paper's
    homoscedastic DVI; the scale lets the variance, which starts at 1, move ten times faster),
    compiled with `HeteroscedasticELL` and the optimizer's copy. **A model with several
    outputs** is compiled output by output, each as above (its losses a dict or list as the
    outputs are), if convert can tell what each output predicts; otherwise it comes back
    uncompiled with a warning naming the outputs. Any other regression model comes back
    uncompiled: append a noise model (`HomoscedasticNoise`, or give the output a second unit of
    log noise variances per target) and compile with `HeteroscedasticELL`.

    Args:
        model: a built `Sequential` or functional Keras model.
        regularizer: the prior of every converted layer (e.g.
            `keras_dvi.EmpiricalBayesRegularizer(num_train=len(x_train))`), or `None`.
        kernel_variance: initial posterior variance of every kernel weight (`None`: the layers'
            default, `0.03 / fan_in`).
        bias_variance: initial posterior variance of every bias (`None`: a tenth of the kernel's).
        hidden_covariance: `"diagonal"` (default: `DenseDiagDVI` hidden layers) or `"full"`
            (`DenseDVI`).
        last_layers: `None` (default: every layer from the first with weights) or a positive
            integer `k`: only the last `k` `Dense` or convolution layers, and the layers after
            the first of them, become keras-dvi layers.

    Returns:
        A new, built Keras model of keras-dvi layers (the plain model is left as it is),
        compiled with `SoftmaxDeltaELL` if the plain model is a classifier, with a learned noise
        variance and `HeteroscedasticELL` if it is compiled with the mean squared error.

    Examples:
        >>> plain.fit(x_train, y_train, epochs=20)
        >>> prior = keras_dvi.EmpiricalBayesRegularizer(len(x_train))
        >>> bayesian = keras_dvi.convert(plain, regularizer=prior)  # compiled: plain ends in a softmax
        >>> bayesian.fit(x_train, y_train, epochs=20)
        >>> keras_dvi.predict(bayesian, x_test)["probabilities"]
        >>> head = keras_dvi.convert(transformer, regularizer=prior, last_layers=2)  # a plain body
    """
    if not isinstance(model, keras.Model) or isinstance(model, keras.Sequential) and not model.built:
        raise ValueError("Argument `model` of keras_dvi.convert must be a built Keras model (Sequential or functional).")
    if hidden_covariance not in ("diagonal", "full"):
        raise ValueError(f"Argument `hidden_covariance` must be 'diagonal' or 'full'; received {hidden_covariance!r}.")
    try:
        source = _inlined(model) if last_layers is None else model  # (the head's nested models stay plain)
        graph = _Graph(source) if last_layers is None else _Graph(_head(model, last_layers), model.outputs)
    except (AttributeError, ValueError) as error:
        if "keras_dvi.convert" in str(error) or "last_layers" in str(error):
            raise
        raise ValueError("Argument `model` of keras_dvi.convert must be a built Sequential or functional model "
                         "(a subclassed model has no graph to convert).") from error
    if any(isinstance(layer, dvi.boundary.KerasDVILayer) for layer in graph.layers):
        raise ValueError("Argument `model` of keras_dvi.convert already has keras-dvi layers.")
    activation, identity, folded, plain, vectors = _plan(graph)
    heads = _output_layers(graph, identity)
    tasks, plain_losses = _output_tasks(model, graph, heads)
    binary_heads = {id(head) for head, task in zip(heads, tasks) if task == BINARY
                    and isinstance(head, (keras.layers.Dense, *_CONV))}
    if last_layers is not None:  # every layer outside the head stays plain
        head = {id(layer) for layer in graph.layers}
        plain |= {id(operation) for operation in getattr(model, "operations", model.layers) if id(operation) not in head}
    first_format = _map_format(graph)
    kept = []  # (plain layer, its clone): their weights (a Normalization's statistics) are copied
    dropped = set()  # clones that stand for a removed layer (never called)

    def clone(layer):
        key = id(layer)
        common = {"regularizer": regularizer, "name": layer.name}
        if key in folded:
            common["use_bias"] = True  # the batch normalisation's shift becomes the bias
        if key in plain and not isinstance(layer, keras.layers.Layer):
            return layer  # an operation such as `x + y`: stateless, nothing to copy
        if key in plain or isinstance(layer, keras.layers.InputLayer):
            copy = (keras.models.clone_model(layer) if isinstance(layer, keras.Model)
                    else layer.__class__.from_config(layer.get_config()) if isinstance(layer, keras.layers.InputLayer)
                    else _rebuilt(layer))
            if copy is not layer:
                kept.append((layer, copy))
            return copy
        if key in identity or isinstance(layer, _INFERENCE_IDENTITY):
            placeholder = keras.layers.Identity(name=layer.name)
            dropped.add(id(placeholder))
            return placeholder
        act = activation.get(key)
        if _is_weight_layer(layer):
            if _is_pointwise(layer) and key not in vectors and first_format == "channels_first":
                raise ValueError(f"keras_dvi.convert: Dense {layer.name!r} acts on the last axis of a channels-first "
                                 "feature map, a spatial axis; keras-dvi converts a Dense on the channels of a map "
                                 "(channels last) as a 1x1 convolution.")
            parts = _plain_parts(layer, key in vectors)
            converted = [convert_weights(part, "linear", {"regularizer": regularizer, "name": part.name}, False, None)
                         for part in parts[:-1]]  # (a separable convolution's depthwise part)
            converted.append(convert_weights(parts[-1], act, common, any(layer is head for head in heads), folded.get(key)))
            return converted[0] if len(converted) == 1 else tuple(converted)
        if isinstance(layer, _ACTIVATION_LAYERS):
            converted = dvi.ActivationDVI(act, data_format=first_format, name=layer.name)
        elif type(layer) in _POOLING:
            extra = {"activation": act} if act not in (None, "linear") else {}
            converted = _POOLING[type(layer)](layer.pool_size, layer.strides, layer.padding, layer.data_format,
                                              name=layer.name, **extra)
        elif type(layer) in _GLOBAL_POOLING:
            if getattr(layer, "keepdims", False) and not all(id(r) in vectors for r in graph.readers[key]):
                raise ValueError(f"keras_dvi.convert: {layer.name!r} keeps its dimensions for a layer other than a 1x1 "
                                 "convolution, Reshape, Flatten or Dropout; keras-dvi's global pooling returns the "
                                 "dense form (keepdims=False).")
            extra = {"activation": act} if act not in (None, "linear") else {}
            converted = _GLOBAL_POOLING[type(layer)](data_format=layer.data_format, name=layer.name, **extra)
        elif isinstance(layer, keras.layers.Flatten) or (isinstance(layer, keras.layers.Reshape)
                                                          and len(layer.target_shape) == 1
                                                          and len(layer.input.shape) >= 3):
            converted = dvi.FlattenDVI(data_format=getattr(layer, "data_format", "channels_last"), name=layer.name)
        elif isinstance(layer, keras.layers.Reshape):
            channels = tuple(layer.input.shape)[-1]
            if (first_format == "channels_first" or len(layer.input.shape) < 3
                    or layer.target_shape[-1] not in (channels, -1)
                    or tuple(layer.output.shape)[-1] != channels):
                raise ValueError(
                    f"keras_dvi.convert: Reshape {layer.name!r} must rearrange the positions of a channels-last "
                    "feature map or sequence and keep its channels (a Vision Transformer's patches into tokens, "
                    f"keras_dvi.ReshapeDVI), or flatten it; it reshapes {tuple(layer.input.shape)} to "
                    f"{tuple(layer.output.shape)}. To keep the layers up to it plain, convert only the layers after it "
                    "(`last_layers=k`).")
            converted = dvi.ReshapeDVI(layer.target_shape, name=layer.name)
        elif key in graph.embeddings:
            converted = dvi.PositionEmbeddingDVI.from_embeddings(graph.embeddings[key], name=layer.name)
        elif key in graph.class_tokens[0]:
            converted = dvi.ClassTokenDVI.from_token(graph.class_tokens[0][key], name=layer.name)
        elif key in graph.selections:
            converted = dvi.SelectTokenDVI(graph.selections[key], name=layer.name)
        elif type(layer) in _RESHAPING:
            kind, argument = _RESHAPING[type(layer)]
            extra = {"interpolation": layer.interpolation} if isinstance(layer, keras.layers.UpSampling2D) else {}
            converted = kind(getattr(layer, argument), data_format=getattr(layer, "data_format", first_format),
                             name=layer.name, **extra)
        elif isinstance(layer, keras.layers.Concatenate):
            if not _on_channels(layer, layer.axis, first_format if len(layer.input[0].shape) > 2 else "channels_last"):
                raise ValueError(f"keras_dvi.convert: Concatenate {layer.name!r} must join vectors, or feature maps "
                                 "along their channels (keras_dvi.ConcatenateDVI).")
            converted = dvi.ConcatenateDVI(data_format=first_format, name=layer.name)
        elif isinstance(layer, tuple(_NORMALISATIONS)):
            counterpart, constructor = next(v for k, v in _NORMALISATIONS.items() if isinstance(layer, k))
            vector = len(layer.input.shape) == 2 or key in vectors
            if getattr(layer, "rms_scaling", False) or not _on_channels(
                    layer, layer.axis, "channels_last" if vector else first_format):
                raise ValueError(
                    f"keras_dvi.convert: {type(layer).__name__} {layer.name!r} must normalise the channels of a "
                    f"feature map or the units of a vector (keras_dvi.{counterpart.__name__})"
                    f"{', without `rms_scaling`' if hasattr(layer, 'rms_scaling') else ''}; it has "
                    f"axis={layer.axis!r} on inputs of shape {tuple(layer.input.shape)}. To keep the layers up to it "
                    "plain, convert only the layers after it (`last_layers=k`).")
            converted = getattr(counterpart, constructor)(layer, activation=None if act == "linear" else act,
                                                          data_format=first_format)
        elif isinstance(layer, keras.layers.BatchNormalization):
            converted = dvi.BatchNormalizationDVI.from_batch_normalization(
                layer, activation=None if act == "linear" else act, data_format=first_format)
        elif isinstance(layer, keras.layers.Multiply):
            inputs = layer.input
            maps = [len(t.shape) >= 3 and id(p) not in vectors for t, p in zip(inputs, graph.producers[key])]
            if len(inputs) != 2 or len(graph.producers[key]) != 2 or sorted(maps) != [False, True]:
                raise ValueError(f"keras_dvi.convert: Multiply {layer.name!r} must multiply a feature map by a "
                                 "per-channel gate computed from a global average pooling (squeeze-and-excitation, "
                                 "keras_dvi.MultiplyDVI).")
            converted = dvi.MultiplyDVI(data_format=first_format, name=layer.name)
        elif isinstance(layer, keras.layers.Add) or key in graph.sums:
            converted = dvi.AddDVI(activation=None if act == "linear" else act, data_format=first_format,
                                   name=layer.name)
        elif isinstance(layer, keras.layers.MultiHeadAttention):
            _check_attention(layer, graph)
            converted = dvi.MultiHeadAttentionDVI.from_multi_head_attention(
                layer, kernel_variance, bias_variance, regularizer=regularizer)
        elif _is_operation(layer):
            raise _operation_refused(layer)
        elif _class_token(layer) is not None:  # (returned alone, not put first by a Concatenate)
            raise ValueError(
                f"keras_dvi.convert: layer {layer.name!r} ({type(layer).__name__}) returns its one weight as a "
                "class token, (batch, 1, channels); keras-dvi puts a class token first in a sequence of tokens "
                "(keras_dvi.ClassTokenDVI), so its only reader must be a Concatenate(axis=1) with it as the first "
                "input and the tokens (batch, tokens, channels) second.")
        elif any(isinstance(layer, kinds) for kinds in _NO_GAUSSIAN_RULE):
            reason = next(why for kinds, why in _NO_GAUSSIAN_RULE.items() if isinstance(layer, kinds))
            raise ValueError(
                f"keras_dvi.convert: layer {layer.name!r} ({type(layer).__name__}) has no accurate Gaussian moment "
                f"rule ({reason}), so keras-dvi does not propagate moments through it. To keep the layers up to it "
                "plain and make the layers after it Bayesian, convert with `last_layers=k`.")
        else:
            raise ValueError(
                f"keras_dvi.convert: layer {layer.name!r} ({type(layer).__name__}) has no keras-dvi counterpart. "
                "Supported: Dense, Conv1D, Conv2D, Conv3D (and their transposed forms), pooling, global average pooling, "
                "Flatten, Add, Multiply (squeeze-and-excitation), Concatenate "
                "(vectors, or channels), ZeroPadding, Cropping, UpSampling, batch normalisation (folded, or on feature maps and "
                "vectors), layer, RMS and group normalisation (of channels or units), layer scales (folded), folded "
                "activations (layers, or operations that compute one), MultiHeadAttention, Reshape (of a map's "
                "positions), position embeddings (a layer adding its one weight), class tokens (a layer putting its one weight "
                "first) and taking one token (`x[:, 0]`), inference-time no-ops (Dropout), "
                "and layers before the first layer with weights (an Embedding). To keep the layers up to it plain, convert only the layers after it "
                "(`last_layers=k`).")
        return converted

    def convert_weights(layer, act, common, output, affine):
        """The keras-dvi layer of a plain `Dense`, convolution or depthwise convolution."""
        trainable = layer.trainable  # (a frozen layer stays frozen, as in the plain part)
        if id(layer) in binary_heads:  # the logits (0, z), whose softmax SoftmaxDeltaELL takes
            layer, act, affine = _binary_logits(layer, *_folded_weights(layer, affine)), "linear", None
        if isinstance(layer, keras.layers.Dense):
            full = output or hidden_covariance == "full"
            converted = (dvi.DenseDVI if full else dvi.DenseDiagDVI).from_dense(
                layer, kernel_variance, bias_variance, activation=act, **common)
        elif isinstance(layer, keras.layers.DepthwiseConv2D):
            if layer.padding not in ("valid", "same"):
                raise ValueError(f"keras_dvi.convert: depthwise convolution {layer.name!r} must use 'valid' or 'same' "
                                 "padding.")
            converted = dvi.DepthwiseConv2DDVI.from_depthwise_conv(layer, kernel_variance, bias_variance,
                                                                    activation=act, **common)
        else:
            if getattr(layer, "groups", 1) != 1 or layer.padding not in ("valid", "same"):
                raise ValueError(f"keras_dvi.convert: convolution {layer.name!r} has groups or causal padding; "
                                 "keras-dvi convolutions take groups=1 (or, in 2D, one group per input channel: a "
                                 "depthwise convolution) and 'valid' or 'same' padding.")
            converted = _CONV[type(layer)].from_conv(layer, kernel_variance, bias_variance, activation=act, **common)
        if affine is not None:
            kernel, bias = _folded_weights(layer, affine)
            converted.set_posterior(kernel, converted.kernel_variance, bias)
        converted.trainable = trainable
        return converted

    if isinstance(source, keras.Sequential):
        clones = [part for layer in source.layers for part in keras.tree.flatten(clone(layer))]
        converted = keras.Sequential([keras.Input(batch_shape=tuple(source.inputs[0].shape))]
                                     + [c for c in clones if id(c) not in dropped], name=source.name)
    else:

        def call(layer, *args, **kwargs):
            if id(layer) in dropped:  # (an operation such as `x * (1.0 / 6.0)` or `3.0 + x`: its tensor)
                return next(a for a in keras.tree.flatten(args) if isinstance(a, keras.KerasTensor))
            kwargs.pop("mask", None)  # (Keras records it for the plain layers that take one)
            if isinstance(layer, dvi.MultiHeadAttentionDVI):
                kwargs = _attention_arguments(layer, kwargs)
            if isinstance(layer, tuple):  # a separable convolution: depthwise, then pointwise
                return layer[1](layer[0](*args, **kwargs))
            if isinstance(layer, dvi.AddDVI) and len(args) == 2:  # (a sum written `x + y`)
                return layer(list(args), **kwargs)
            if isinstance(layer, (dvi.ClassTokenDVI, dvi.SelectTokenDVI)):
                # (the tokens alone: a Concatenate's second input; `x[:, 0]` without its key)
                return layer(args[0][-1] if isinstance(args[0], (list, tuple)) else args[0])
            return layer(*args, **kwargs)

        converted = keras.models.clone_model(source, clone_function=clone, call_function=call)
        if converted.compiled:  # (Keras compiles a clone as the source: with the plain model's loss)
            converted = keras.Model(converted.input, converted.output, name=converted.name)
    stacked = [layer for layer in converted.layers
               if isinstance(layer, dvi.DepthwiseConv2DDVI) and _unbounded(layer.activation)]
    if len(stacked) > 1:  # measured: the guide's "The whole network against Monte Carlo"
        activations = ", ".join(sorted({layer.activation for layer in stacked}))
        warnings.warn(
            f"keras_dvi.convert: {len(stacked)} depthwise convolutions (first {stacked[0].name!r}) apply an "
            f"unbounded activation ({activations}), block after block. On such networks, EfficientNets and "
            "MobileNetV3s, the moments stray far from Monte Carlo over the weights: a converted EfficientNetB0 "
            "(default variances, 32x32) had output variances 0.01-0.42 of Monte Carlo's, its SiLU blocks each "
            "losing about 8%; MobileNetV3Small 0.05-2.2 and MobileNetV3Large 0.19-0.82 (the same with its ReLU "
            "blocks alone, no gates or hard SiLU). Built alike with ReLU6, MobileNetV2's bounded activation, "
            "agrees within 0.74-1.32. The means and, at tiny variances, the function are right. Check the "
            "spread with keras_dvi.predict_samples, or convert with last_layers=k to make only the head "
            "Bayesian.",
            stacklevel=2)
    scaled = [node for node in graph.layers if id(node) not in plain and graph.sums.get(id(node), (1.0, 1.0)) != (1.0, 1.0)]
    if len(scaled) > 1:  # measured: the guide's "The whole network against Monte Carlo"
        warnings.warn(
            f"keras_dvi.convert: {len(scaled)} residual sums scale a branch (first {scaled[0].name!r}: "
            "`x + scale * r`, InceptionResNetV2's blocks), block after block. keras-dvi adds a block's input and "
            "its branch as independent although the branch is computed from the input, and here the shortfall "
            "compounds: a converted InceptionResNetV2 (default variances, 75x75) had output variances "
            "0.27-0.49 of Monte Carlo's over the weights, its last feature map 0.31-0.33 (medians). The means "
            "and, at tiny variances, the function are right. Check the spread with keras_dvi.predict_samples, or "
            "convert with last_layers=k to make only the head Bayesian.",
            stacklevel=2)
    twins = _sums_of_twins(converted)
    if twins:  # measured: the guide's "The whole network against Monte Carlo"
        warnings.warn(
            f"keras_dvi.convert: {len(twins)} Add layers (first {twins[0].name!r}) sum two branches computed "
            "without weights from one tensor (NASNet's `AveragePooling2D(p) + AveragePooling2D(p)`). keras-dvi "
            "adds branches as independent, so where they are this correlated the sum's variance is under-stated, "
            "by up to half: a converted NASNetMobile (default variances, 32x32) had output variances 0.44-0.70 of "
            "Monte Carlo's over the weights, the sums of its cells' pooled twins 0.25-0.31. The means and, at tiny "
            "variances, the function are right. Check the spread with keras_dvi.predict_samples, or convert with "
            "last_layers=k to make only the head Bayesian.",
            stacklevel=2)
    bayesian = [layer for layer in converted.layers if isinstance(layer, dvi.BayesianLayer)]
    frozen = [layer for layer in bayesian if not layer.trainable]
    if frozen:
        warnings.warn(
            f"keras_dvi.convert: {len(frozen)} of the {len(bayesian)} layers made Bayesian (first "
            f"{frozen[0].name!r}) were frozen in the plain model (`trainable=False`) and stay frozen: their "
            "posterior means are the plain weights and their variances stay at their initial values "
            "(`kernel_variance`), not fitted to the data. For a Bayesian head over a frozen backbone, convert "
            "with last_layers=k (the backbone then stays plain); to fit every posterior, set "
            "`trainable = True` on the converted model.",
            stacklevel=2)
    if first_format == "channels_first" and any(packing.is_map(tuple(t.shape)) for t in keras.tree.flatten(converted.outputs)):
        raise ValueError(
            "keras_dvi.convert: the model predicts a channels-first feature map (a dense prediction: segmentation, "
            "per-pixel regression). keras-dvi's losses and predictions read a dense prediction's classes or targets "
            "on the last axis: build the plain model channels last (data_format='channels_last'), or convert only "
            "a head that ends in vectors (`last_layers=k`).")
    _copy_weights(kept)
    return _compiled(converted, model, tasks, plain_losses)


def _keras_dvi_loss(task, plain_loss):
    """The keras-dvi loss of an output of `task` (`_output_tasks`) whose plain loss was
    `plain_loss`: `SoftmaxDeltaELL` with its label smoothing for a classifier, `HeteroscedasticELL`
    for a regression, `None` otherwise."""
    if task == REGRESSION:
        return losses.HeteroscedasticELL()
    if task is None:
        return None
    if isinstance(plain_loss, (keras.losses.BinaryFocalCrossentropy, keras.losses.CategoricalFocalCrossentropy)):
        warnings.warn(
            f"keras_dvi.convert: the plain model's {type(plain_loss).__name__} is not carried over: the "
            "converted model is compiled with SoftmaxDeltaELL, the expected log-likelihood, which the focal "
            "loss's down-weighting of easy examples is not. To balance classes, pass `class_weight` to fit.",
            stacklevel=3)
    return losses.SoftmaxDeltaELL(label_smoothing=float(getattr(plain_loss, "label_smoothing", 0.0) or 0.0))


def _compiled(converted, model, tasks, plain_losses):
    """`converted`, compiled with the keras-dvi loss of every output (`_keras_dvi_loss`), a
    learned noise variance after each regression output (as hoDVI: `HomoscedasticNoise`, its
    scale measured in BENCHMARKS.md), and a copy of the plain optimizer; uncompiled if an
    output's task is unknown (a warning names it if others are known)."""
    if any(task is None for task in tasks):
        known = [task for task in tasks if task is not None]
        if known:
            names = [name for name, task in zip(_output_names(converted, len(tasks)), tasks) if task is None]
            warnings.warn(
                f"keras_dvi.convert: the model comes back uncompiled: convert cannot tell what output"
                f"{'s' * (len(names) > 1)} {', '.join(map(repr, names))} predict{'s' * (len(names) == 1)} (no softmax or "
                "sigmoid, no cross-entropy or mean squared error compiled for it). Compile it with a keras-dvi loss "
                "per output: SoftmaxDeltaELL for a classifier, HeteroscedasticELL after a noise model "
                "(keras_dvi.HomoscedasticNoise) for a regression.",
                stacklevel=3)
        return converted
    several = len(tasks) > 1
    noisy = [dvi.HomoscedasticNoise(log_variance_scale=10.0, name=f"{name}_noise") if task == REGRESSION else None
             for name, task in zip(_output_names(converted, len(tasks)), tasks)]
    if isinstance(converted, keras.Sequential):  # (one output)
        if noisy[0] is not None:
            converted.add(noisy[0])
    elif any(noise is not None for noise in noisy):
        outputs = converted.output
        flat = [t if noise is None else noise(t) for t, noise in zip(keras.tree.flatten(outputs), noisy)]
        converted = keras.Model(converted.inputs, keras.tree.pack_sequence_as(outputs, flat) if several else flat[0],
                                name=converted.name)
    loss = [_keras_dvi_loss(task, plain) for task, plain in zip(tasks, plain_losses)]
    optimizer = getattr(model, "optimizer", None)
    optimizer = (keras.optimizers.Adam(1e-3) if optimizer is None
                 else type(optimizer).from_config(optimizer.get_config()))
    converted.compile(optimizer=optimizer, loss=keras.tree.pack_sequence_as(converted.output, loss) if several else loss[0],
                      metrics=_carried_metrics(model, None if several else tasks[0] != REGRESSION))
    return converted


def _output_names(converted, count):
    """A name for each of the `count` outputs of a converted model, in its outputs' order (a
    regression's noise layer takes it)."""
    return [converted.name] if count == 1 else _output_keys(converted)


#: The plain model's metrics that `convert` carries, by name (`compile(metrics=[...])`): their
#: keras-dvi counterparts, which read packed moments.
_CARRIED_METRICS = {
    **dict.fromkeys(("accuracy", "acc", "sparse_categorical_accuracy", "categorical_accuracy", "binary_accuracy",
                     "SparseCategoricalAccuracy", "CategoricalAccuracy", "BinaryAccuracy"), metrics.MeanLogitAccuracy),
    **dict.fromkeys(_MEAN_SQUARED_LOSS_NAMES, metrics.PredictiveMSE),
}


def _metric_entries(metrics_config):
    """The metrics of a compile config's `metrics` (a list, a dict per output, nested): names,
    and metric objects as their serialised dicts (`{"class_name": ..., "config": ...}`), which
    are entries themselves, not structures to flatten."""
    if isinstance(metrics_config, dict) and "class_name" in metrics_config:
        return [metrics_config]
    if isinstance(metrics_config, dict):
        metrics_config = list(metrics_config.values())
    if isinstance(metrics_config, (list, tuple)):
        return [entry for item in metrics_config for entry in _metric_entries(item)]
    return [] if metrics_config is None else [metrics_config]


def _carried_metrics(model, classifier):
    """The keras-dvi counterparts of the plain model's compiled metrics (`_CARRIED_METRICS`:
    accuracy for a classifier, the squared error for a regression; for a model with several
    outputs, `classifier=None`, none); a warning names those without one."""
    config = model.get_compile_config() if getattr(model, "compiled", False) else None
    names = [entry.get("class_name") if isinstance(entry, dict) else entry if isinstance(entry, str) else repr(entry)
             for entry in _metric_entries((config or {}).get("metrics"))]
    wanted = None if classifier is None else metrics.MeanLogitAccuracy if classifier else metrics.PredictiveMSE
    carried = [name for name in names if wanted is not None and _CARRIED_METRICS.get(name) is wanted]
    dropped = [name for name in names if _CARRIED_METRICS.get(name) is not wanted]
    if dropped:
        warnings.warn(
            f"keras_dvi.convert: the plain model's metric{'s' * (len(dropped) > 1)} {', '.join(map(repr, dropped))} "
            f"{'are' if len(dropped) > 1 else 'is'} not carried over: "
            "as Keras' metrics they would read the packed means and variances as predictions. keras_dvi.metrics "
            "has MeanLogitAccuracy, PredictiveMSE and PredictiveLogLikelihood (compile the converted model again "
            "to add them), and keras_dvi.predict gives the predictions to score.",
            stacklevel=3)
    return [wanted()] if carried else None
