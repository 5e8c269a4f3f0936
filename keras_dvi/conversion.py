"""`convert(model)`: the keras-dvi counterpart of a plain Keras model, its weights as posterior
means ("train plain, convert, fine-tune")."""

import keras
import numpy as np

from keras_dvi import layers as dvi
from keras_dvi.maths import moments

#: Plain layers and their keras-dvi counterparts (layers without weights).
_POOLING = {
    keras.layers.MaxPooling1D: dvi.MaxPooling1DDVI,
    keras.layers.MaxPooling2D: dvi.MaxPooling2DDVI,
    keras.layers.AveragePooling1D: dvi.AveragePooling1DDVI,
    keras.layers.AveragePooling2D: dvi.AveragePooling2DDVI,
}
_GLOBAL_POOLING = {
    keras.layers.GlobalAveragePooling1D: dvi.GlobalAveragePooling1DDVI,
    keras.layers.GlobalAveragePooling2D: dvi.GlobalAveragePooling2DDVI,
}
_CONV = {keras.layers.Conv1D: dvi.Conv1DDVI, keras.layers.Conv2D: dvi.Conv2DDVI}
#: Layers that do nothing at inference (keras-dvi layers model the weight noise themselves).
_INFERENCE_IDENTITY = (keras.layers.Dropout, keras.layers.SpatialDropout1D, keras.layers.SpatialDropout2D,
                       keras.layers.GaussianNoise, keras.layers.GaussianDropout, keras.layers.AlphaDropout,
                       keras.layers.ActivityRegularization, keras.layers.Identity)
_ACTIVATION_LAYERS = (keras.layers.Activation, keras.layers.ReLU, keras.layers.LeakyReLU, keras.layers.Softmax)


def _activation_of(layer):
    """The activation a plain layer applies, as a keras-dvi name or `"softmax"`; `None` when it
    has none that keras-dvi can apply."""
    if isinstance(layer, keras.layers.ReLU):
        plain = layer.max_value is None and float(layer.threshold) == 0.0 and float(layer.negative_slope) == 0.0
        return "relu" if plain else None
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


class _Graph:
    """What `convert` reads of the plain model's graph, through public Keras API only
    (`model.layers`, `layer.input`, `layer.output`): each layer's producers and readers."""

    def __init__(self, model):
        self.layers = [layer for layer in model.layers if not isinstance(layer, keras.layers.InputLayer)]
        for layer in self.layers:
            if isinstance(layer, keras.Model):
                raise ValueError(f"keras_dvi.convert: layer {layer.name!r} is a nested model; convert a model "
                                 "whose layers are Keras layers (flatten the nested model into it first).")
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
        self.outputs = {id(producer_of[id(t)]) for t in keras.tree.flatten(model.outputs) if id(t) in producer_of}

    def only_reader(self, layer):
        readers = self.readers[id(layer)]
        return readers[0] if len(readers) == 1 and id(layer) not in self.outputs else None


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


def _normalises_channels(batch_norm, producer):
    """Whether a batch normalisation's axis is the channel axis of the layer feeding it."""
    rank = len(batch_norm.input.shape)
    axis = batch_norm.axis if isinstance(batch_norm.axis, int) else (list(batch_norm.axis) + [None])[0]
    axis = None if axis is None else axis % rank
    channels = 1 if getattr(producer, "data_format", "channels_last") == "channels_first" else rank - 1
    return axis == channels


def _is_weight_layer(layer):
    return isinstance(layer, (keras.layers.Dense, *_CONV))


def _plan(graph):
    """`(activation of each converted layer, layers replaced by an identity, batch
    normalisations folded into each layer, layers kept as plain preprocessing)`."""
    activation, identity, folded, plain = {}, set(), {}, set()
    started = set()  # layers at or after the first layer with weights
    for layer in graph.layers:
        after = _is_weight_layer(layer) or any(id(p) in started for p in graph.producers[id(layer)])
        if after:
            started.add(id(layer))
        else:
            plain.add(id(layer))
    for layer in graph.layers:
        if id(layer) in plain:
            continue
        if _is_weight_layer(layer) or isinstance(layer, (keras.layers.MaxPooling1D, keras.layers.MaxPooling2D,
                                                         keras.layers.Add)):
            activation.setdefault(id(layer), _activation_of(layer) if _is_weight_layer(layer) else "linear")
        if isinstance(layer, (keras.layers.BatchNormalization, *_ACTIVATION_LAYERS)):
            batch_norm = isinstance(layer, keras.layers.BatchNormalization)
            name = None if batch_norm else _activation_of(layer)
            if name == "softmax" and id(layer) in graph.outputs:
                identity.add(id(layer))  # keras-dvi outputs logits; SoftmaxDeltaELL applies the softmax
                continue
            producer, reader = _through_identities(graph, layer, identity)
            foldable = (producer is not None and activation.get(id(producer)) == "linear"
                        and graph.only_reader(producer) is reader
                        and (_is_weight_layer(producer) and _normalises_channels(layer, producer) if batch_norm
                             else name not in (None, "softmax")))
            if not foldable:
                raise ValueError(
                    f"keras_dvi.convert: BatchNormalization {layer.name!r} can be folded only into a linear Dense "
                    "or convolution that feeds it alone, normalising its channels (its inference-time scale and "
                    "shift then become that layer's weights); put the activation after it." if batch_norm else
                    f"keras_dvi.convert: activation layer {layer.name!r} ({type(layer).__name__}) can be folded "
                    "only into the Dense, convolution, max pooling or Add layer that feeds it alone, with "
                    "activation 'relu', 'leaky_relu' (slope 0.2) or 'linear' (a softmax only at the output).")
            if batch_norm:
                folded[id(producer)] = layer
            else:
                activation[id(producer)] = name
            identity.add(id(layer))
    for layer in graph.layers:  # the ReLU of a convolution moves to the max pooling it feeds
        reader = graph.only_reader(layer) if isinstance(layer, tuple(_CONV)) else None
        if (isinstance(reader, (keras.layers.MaxPooling1D, keras.layers.MaxPooling2D))
                and activation.get(id(layer)) in ("relu", "leaky_relu") and activation.get(id(reader)) == "linear"):
            activation[id(reader)], activation[id(layer)] = activation[id(layer)], "linear"
    for layer in graph.layers:
        if _is_weight_layer(layer) and activation.get(id(layer)) == "softmax":
            if id(layer) not in graph.outputs:
                raise ValueError(f"keras_dvi.convert: layer {layer.name!r} applies a softmax inside the network; "
                                 "keras-dvi layers apply 'relu', 'leaky_relu', 'heaviside' or no activation.")
            activation[id(layer)] = "linear"  # the logits
        if _is_weight_layer(layer) and activation.get(id(layer)) is None:
            raise ValueError(
                f"keras_dvi.convert: layer {layer.name!r} has activation "
                f"{getattr(layer.activation, '__name__', layer.activation)!r}, which has no closed-form Gaussian "
                "moments here; keras-dvi layers apply 'relu', 'leaky_relu', 'heaviside' or none.")
    return activation, identity, folded, plain


def _folded_weights(layer, batch_norm):
    """The kernel and bias of `layer` with the inference-time batch normalisation after it folded in."""
    kernel = keras.ops.convert_to_numpy(layer.kernel).astype("float64")
    bias = keras.ops.convert_to_numpy(layer.bias).astype("float64") if layer.use_bias else 0.0
    if batch_norm is None:
        return kernel, (bias if layer.use_bias else None)
    get = lambda v, default: default if v is None else keras.ops.convert_to_numpy(v).astype("float64")  # noqa: E731
    channels = kernel.shape[-1]
    gamma = get(batch_norm.gamma, np.ones(channels))
    beta = get(batch_norm.beta, np.zeros(channels))
    mean, variance = get(batch_norm.moving_mean, None), get(batch_norm.moving_variance, None)
    scale = gamma / np.sqrt(variance + batch_norm.epsilon)
    return kernel * scale, (bias - mean) * scale + beta


def convert(model, regularizer=None, kernel_variance=None, bias_variance=None, hidden_covariance="diagonal"):
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
    | `Conv1D`, `Conv2D` | `Conv1DDVI`, `Conv2DDVI` (strides, padding, dilation, data format kept) |
    | `MaxPooling*D`, `AveragePooling*D`, `GlobalAveragePooling*D`, `Flatten`, `Add` | their keras-dvi counterparts |
    | `Activation`, `ReLU`, `LeakyReLU` after a layer that feeds it alone | folded into that layer |
    | `BatchNormalization` after a linear `Dense` or convolution | folded into its weights (inference statistics) |
    | `Dropout` and other inference-time no-ops | removed (an identity) |
    | a softmax on the output | removed: keras-dvi outputs logits, `SoftmaxDeltaELL` applies it |

    A ReLU on a convolution that feeds a max pooling moves to the pooling layer, the same
    function in the form whose moments are accurate. Layers without weights before the first
    layer with weights (`Rescaling`, `Normalization`, `Reshape`, ...) stay as they are. Anything
    else is refused with an error that names the layer. A regression model whose head predicts
    a mean only needs a noise model before training: append `keras_dvi.HomoscedasticNoise()`.

    Args:
        model: a built `Sequential` or functional Keras model.
        regularizer: the prior of every converted layer (e.g.
            `keras_dvi.EmpiricalBayesRegularizer(num_train=len(x_train))`), or `None`.
        kernel_variance: initial posterior variance of every kernel weight (`None`: the layers'
            default, `0.03 / fan_in`).
        bias_variance: initial posterior variance of every bias (`None`: a tenth of the kernel's).
        hidden_covariance: `"diagonal"` (default: `DenseDiagDVI` hidden layers) or `"full"`
            (`DenseDVI`).

    Returns:
        A new, built Keras model of keras-dvi layers (the plain model is left as it is).

    Examples:
        >>> plain.fit(x_train, y_train, epochs=20)
        >>> prior = keras_dvi.EmpiricalBayesRegularizer(len(x_train))
        >>> bayesian = keras_dvi.convert(plain, regularizer=prior)
        >>> bayesian.compile(keras.optimizers.Adam(1e-3), loss=keras_dvi.SoftmaxDeltaELL())
        >>> bayesian.fit(x_train, y_train, epochs=20)
    """
    if not isinstance(model, keras.Model) or isinstance(model, keras.Sequential) and not model.built:
        raise ValueError("Argument `model` of keras_dvi.convert must be a built Keras model (Sequential or functional).")
    if hidden_covariance not in ("diagonal", "full"):
        raise ValueError(f"Argument `hidden_covariance` must be 'diagonal' or 'full'; received {hidden_covariance!r}.")
    try:
        graph = _Graph(model)
    except (AttributeError, ValueError) as error:
        if "nested model" in str(error):
            raise
        raise ValueError("Argument `model` of keras_dvi.convert must be a built Sequential or functional model "
                         "(a subclassed model has no graph to convert).") from error
    if any(isinstance(layer, dvi.boundary.KerasDVILayer) for layer in graph.layers):
        raise ValueError("Argument `model` of keras_dvi.convert already has keras-dvi layers.")
    activation, identity, folded, plain = _plan(graph)
    first_format = next((layer.data_format for layer in graph.layers if isinstance(layer, tuple(_CONV))), None)
    kept = []  # (plain layer, its clone): their weights (a Normalization's statistics) are copied
    dropped = set()  # clones that stand for a removed layer (never called)

    def clone(layer):
        key = id(layer)
        common = {"regularizer": regularizer, "name": layer.name}
        if key in folded:
            common["use_bias"] = True  # the batch normalisation's shift becomes the bias
        if key in plain or isinstance(layer, keras.layers.InputLayer):
            copy = layer.__class__.from_config(layer.get_config())
            kept.append((layer, copy))
            return copy
        if key in identity or isinstance(layer, _INFERENCE_IDENTITY):
            placeholder = keras.layers.Identity(name=layer.name)
            dropped.add(id(placeholder))
            return placeholder
        act = activation.get(key)
        if isinstance(layer, keras.layers.Dense):
            full = key in graph.outputs or hidden_covariance == "full"
            converted = (dvi.DenseDVI if full else dvi.DenseDiagDVI).from_dense(
                layer, kernel_variance, bias_variance, activation=act, **common)
        elif isinstance(layer, tuple(_CONV)):
            if getattr(layer, "groups", 1) != 1 or layer.padding not in ("valid", "same"):
                raise ValueError(f"keras_dvi.convert: convolution {layer.name!r} has groups or causal padding; "
                                 "keras-dvi convolutions take groups=1 and 'valid' or 'same' padding.")
            converted = _CONV[type(layer)].from_conv(layer, kernel_variance, bias_variance, activation=act, **common)
        elif type(layer) in _POOLING:
            extra = {"activation": act} if act not in (None, "linear") else {}
            converted = _POOLING[type(layer)](layer.pool_size, layer.strides, layer.padding, layer.data_format,
                                              name=layer.name, **extra)
        elif type(layer) in _GLOBAL_POOLING:
            if getattr(layer, "keepdims", False):
                raise ValueError(f"keras_dvi.convert: {layer.name!r} keeps its dimensions; keras-dvi's global "
                                 "pooling returns the dense form (keepdims=False).")
            converted = _GLOBAL_POOLING[type(layer)](data_format=layer.data_format, name=layer.name)
        elif isinstance(layer, keras.layers.Flatten):
            converted = dvi.FlattenDVI(data_format=layer.data_format, name=layer.name)
        elif isinstance(layer, keras.layers.Add):
            if len(layer.input) != 2 or len(layer.input[0].shape) < 4:
                raise ValueError(f"keras_dvi.convert: Add {layer.name!r} must add two feature maps (keras_dvi.AddDVI).")
            converted = dvi.AddDVI(activation=None if act == "linear" else act, data_format=first_format,
                                   name=layer.name)
        else:
            raise ValueError(
                f"keras_dvi.convert: layer {layer.name!r} ({type(layer).__name__}) has no keras-dvi counterpart. "
                "Supported: Dense, Conv1D, Conv2D, pooling, global average pooling, Flatten, Add, folded "
                "activations and batch normalisation, inference-time no-ops (Dropout), and layers without "
                "weights before the first layer with weights.")
        if key in folded:
            kernel, bias = _folded_weights(layer, folded[key])
            converted.set_posterior(kernel, converted.kernel_variance, bias)
        return converted

    if isinstance(model, keras.Sequential):
        clones = [clone(layer) for layer in graph.layers]
        converted = keras.Sequential([keras.Input(batch_shape=tuple(model.inputs[0].shape))]
                                     + [c for c in clones if id(c) not in dropped], name=model.name)
    else:

        def call(layer, *args, **kwargs):
            if id(layer) in dropped:
                return args[0]
            kwargs.pop("mask", None)  # (Keras records it for the plain layers that take one)
            return layer(*args, **kwargs)

        converted = keras.models.clone_model(model, clone_function=clone, call_function=call)
    for layer, copy in kept:
        if layer.weights:
            copy.set_weights(layer.get_weights())
            copy.finalize_state()  # (what Keras calls after loading a layer's variables)
    return converted
