"""`MultiHeadAttentionDVI`: Bayesian multi-head attention on keras-dvi sequences."""

import keras
from keras import ops

from keras_dvi import packing, sampling, validation
from keras_dvi.layers.base import BayesianLayer, variance_of
from keras_dvi.maths import attention

#: The four projections, in the order of Keras' `MultiHeadAttention.weights`.
PROJECTIONS = ("query", "key", "value", "output")


@keras.saving.register_keras_serializable(package="keras_dvi")
class MultiHeadAttentionDVI(BayesianLayer):
    """Multi-head dot-product attention (`keras.layers.MultiHeadAttention`; Vaswani et al.,
    2017, eqs. 1-2) with factorised Gaussian query, key, value and output projections, on
    keras-dvi sequences: the attention of Transformer encoders and decoders, as `convert`
    makes it from a plain model's layer.

    The moments (`keras_dvi.maths.attention.attention_moments`): the attention pattern is
    taken at the mean queries and keys and the layer linearised about the means (the delta
    method), so the output's variance carries the noise of the inputs and of all four
    projections through the values *and* through the pattern (a pattern held at its mean
    under-states it by half); each position's head outputs keep their full covariance, across
    heads, through the output projection, and the shared components are matched to the
    variance of each channel's sum over positions (attention mixes every position into every
    output). With the posterior variances at zero it is the plain layer's function; against
    Monte Carlo through the plain function the variances are exact to first order (0.97-1.03
    of Monte Carlo's at input noise 0.03 of the means' scale), 0.75-1.22 with means within 0.28
    standard deviations at noise 0.1, where the softmax's curvature, left out, shows; in a
    converted Transformer its output is within 0.91-1.10 of Monte Carlo over the weights. The
    cost is `O(batch heads T S C^2)` time and `O(batch heads T C (C + S))` memory (the
    covariances across pairs of heads): for sequences and widths of tens, not for long
    contexts (BENCHMARKS.md, "Attention", measures it against the plain layer).

    Args:
        num_heads: number of attention heads.
        key_dim: size of each head's queries and keys.
        value_dim: size of each head's values (`None`: `key_dim`).
        use_bias: whether the four projections have (Bayesian) biases.
        output_shape: width of the output (`None`: the query's width), an integer.
        kernel_mean_initializer: initializer of the kernels' posterior means (default
            `"glorot_uniform"`, Keras' default for attention).
        **kwargs: `bias_mean_initializer`, `kernel_variance_init`, `bias_variance_init`,
            `regularizer`, `validate` and base layer arguments, as in `keras_dvi.DenseDVI`.
            The default variances are `0.03 / fan_in` for each projection.

    Call arguments:
        query: a packed sequence `(batch, 3, T, C)` (or data `(batch, T, C)`: the network's
            first keras-dvi layer, after an embedding).
        value: the sequence attended to, `(batch, 3, S, C_v)` or data (`None` or the query
            itself: self-attention). Its noise is taken as independent of the query's when it
            is another tensor.
        key: `None` or the value itself (keys and values from one sequence).
        attention_mask: `(batch, T, S)` booleans (true: attend), or `None`.
        use_causal_mask: whether position `t` attends only to positions up to `t` (decoders).
        training: as in Keras.

    Output shape:
        A packed sequence `(batch, 3, T, output_shape)`.

    Examples:
        >>> prior = keras_dvi.EmpiricalBayesRegularizer(num_train=len(x_train))
        >>> tokens = keras.Input((32,), dtype="int32")
        >>> x = keras.layers.Embedding(1000, 32)(tokens)
        >>> h = keras_dvi.MultiHeadAttentionDVI(num_heads=2, key_dim=16, regularizer=prior)(x, x)
        >>> h = keras_dvi.LayerNormalizationDVI()(keras_dvi.AddDVI()([x, h]))
        >>> h = keras_dvi.GlobalAveragePooling1DDVI()(h)
        >>> outputs = keras_dvi.DenseDiagDVI(2, regularizer=prior)(h)
    """

    def __init__(self, num_heads, key_dim, value_dim=None, use_bias=True, output_shape=None,
                 kernel_mean_initializer="glorot_uniform", **kwargs):
        kwargs.pop("activation", None)
        super().__init__(activation=None, use_bias=use_bias, kernel_mean_initializer=kernel_mean_initializer,
                         **kwargs)
        self.num_heads = validation.positive_integer("num_heads", num_heads)
        self.key_dim = validation.positive_integer("key_dim", key_dim)
        self.value_dim = self.key_dim if value_dim is None else validation.positive_integer("value_dim", value_dim)
        self.output_width = None if output_shape is None else validation.positive_integer("output_shape", output_shape)

    # ---------------------------------------------------------------- variables

    def takes_packed(self, shape):
        return len(shape) == 4

    def _reads_data(self, input_shape):
        return len(input_shape) == 3

    def _width(self, shape, name):
        kind, _, channels = packing.structure_of_map(tuple(shape), 1, name)
        if channels is None:
            raise ValueError(f"{type(self).__name__} {self.name!r} needs a known width; argument `{name}` has "
                             f"shape {tuple(shape)}.")
        return kind, channels

    def build(self, query_shape, value_shape=None, key_shape=None):
        kind, width = self._width(query_shape, "query")
        value_width = width if value_shape is None else self._width(value_shape, "value")[1]
        heads, out = self.num_heads, self.output_width or width
        shapes = {"query": ((width, heads, self.key_dim), (heads, self.key_dim)),
                  "key": ((value_width, heads, self.key_dim), (heads, self.key_dim)),
                  "value": ((value_width, heads, self.value_dim), (heads, self.value_dim)),
                  "output": ((heads, self.value_dim, out), (out,))}
        self._fan_ins = {"query": width, "key": value_width, "value": value_width, "output": heads * self.value_dim}
        self._projections = {}
        for name in PROJECTIONS:
            kernel_var, bias_var = self._initial_variances(self._fan_ins[name])
            kernel_shape, bias_shape = shapes[name]
            kernel = self._gaussian_weights(f"{name}_kernel", kernel_shape, self.kernel_mean_initializer, kernel_var)
            bias = (self._gaussian_weights(f"{name}_bias", bias_shape, self.bias_mean_initializer, bias_var)
                    if self.use_bias else (None, None))
            self._projections[name] = kernel + bias
        self._fan_in = width
        self.kl_term.build(kind == packing.DETERMINISTIC)

    def posterior(self, projection):
        """`(kernel_mean, kernel_variance, bias_mean, bias_variance)` of one projection
        (`"query"`, `"key"`, `"value"` or `"output"`), in the moment dtype; Keras'
        `MultiHeadAttention` shapes: kernels `(C, heads, d)` (output: `(heads, d, C_out)`),
        biases `(heads, d)` (output: `(C_out,)`); `None` for biases without `use_bias`."""
        if projection not in PROJECTIONS:
            raise ValueError(f"Argument `projection` must be one of {PROJECTIONS}; received {projection!r}.")
        dtype = self.moment_dtype
        kernel_mean, kernel_log_std, bias_mean, bias_log_std = self._projections[projection]
        mean = lambda v: None if v is None else ops.cast(ops.convert_to_tensor(v), dtype)  # noqa: E731
        return mean(kernel_mean), variance_of(mean(kernel_log_std)), mean(bias_mean), variance_of(mean(bias_log_std))

    def weight_sets(self):
        """The four projections' kernels and biases, each `(mean, log_std, fan_in)` with its
        projection's own fan-in (`kl_divergence` sums over them)."""
        sets = []
        for name in PROJECTIONS:
            kernel_mean, kernel_log_std, bias_mean, bias_log_std = self._projections[name]
            sets.append((kernel_mean, kernel_log_std, self._fan_ins[name]))
            if bias_mean is not None:
                sets.append((bias_mean, bias_log_std, self._fan_ins[name]))
        return sets

    def set_posterior(self, kernel_mean, kernel_variance, bias_mean=None, bias_variance=None, projection="query"):
        """Sets one projection's posterior moments (the layer must be built); shapes as in
        `posterior`, variances positive (broadcast)."""
        if not self.built:
            raise ValueError(f"Layer {self.name!r} must be built before `set_posterior`.")
        self.posterior(projection)  # (checks the name)
        variables = self._projections[projection]
        for arg, value, variable, is_variance in zip(
                ("kernel_mean", "kernel_variance", "bias_mean", "bias_variance"),
                (kernel_mean, kernel_variance, bias_mean, bias_variance), variables, (False, True, False, True)):
            self._assign(arg, value, variable, is_variance)

    # ---------------------------------------------------------------- calling

    def compute_output_shape(self, query_shape, value_shape=None, key_shape=None):
        _, width = self._width(query_shape, "query")
        return (query_shape[0], packing.MAP_ROWS, query_shape[-2], self.output_width or width)

    def _mask(self, attention_mask, use_causal_mask, query_length, value_length):
        mask = None if attention_mask is None else ops.cast(attention_mask, "bool")
        if use_causal_mask:
            causal = ops.tril(ops.ones((query_length, value_length), "int32")) > 0  # (s <= t, as Keras)
            mask = causal[None] if mask is None else ops.logical_and(mask, causal)
        return mask

    def _check_key(self, value, key):
        if key is not None and key is not value:
            raise ValueError(
                f"{type(self).__name__} {self.name!r} reads keys and values from one sequence: argument `key` must "
                "be None or the value tensor itself. Attention with separate key and value sequences is not "
                "supported.")

    def compute_output_spec(self, query, value=None, key=None, **kwargs):
        self._check_key(value, key)
        return super().compute_output_spec(query, value, key, **kwargs)

    def call(self, query, value=None, key=None, attention_mask=None, use_causal_mask=False, training=None):
        same = value is None or value is query
        self._check_key(value, key)
        value = query if same else value
        context = sampling.current_context(self)
        if context is not None:
            return self._sample_attention(query, value, context, attention_mask, use_causal_mask)
        inputs = []
        for name, tensor in (("query", query), ("value", value)):
            mean, variance, shared, kind = packing.split_map(tensor, 1, name)
            cast = lambda t: None if t is None else ops.cast(t, self.moment_dtype)  # noqa: E731
            mean, variance, shared = cast(mean), cast(variance), cast(shared)
            mean, variance = validation.check_moments(mean, variance, kind, name, self.validate,
                                                      where=f"{type(self).__name__} {self.name!r}")
            inputs.append((mean, variance, shared, kind))
        (mean, variance, shared, kind), value_moments = inputs
        self._report_kl(training, mean if kind == packing.DETERMINISTIC else None)
        mask = self._mask(attention_mask, use_causal_mask, ops.shape(mean)[1], ops.shape(value_moments[0])[1])
        out = attention.attention_moments((mean, variance, shared), value_moments[:3],
                                          *(self.posterior(name) for name in PROJECTIONS), mask=mask,
                                          self_attention=same)
        return packing.pack_map(*out)

    def _sample_attention(self, query, value, context, attention_mask, use_causal_mask):
        """The plain layer's function with weights drawn from the posterior, one draw per sample:
        `(samples, batch, T, C)` samples (or data, repeated) in and out."""
        def samples(x):
            if len(x.shape) not in (3, 4):
                raise ValueError("While sampling, MultiHeadAttentionDVI takes deterministic (batch, T, C) inputs or "
                                 "(samples, batch, T, C) samples from another keras-dvi layer.")
            x = ops.cast(x, self.moment_dtype)
            return x if len(x.shape) == 4 else ops.broadcast_to(x[None], (context.num_samples,) + tuple(ops.shape(x)))

        def draw(mean, variance):  # (samples, 1, ...): one draw per sample, shared by the batch
            if mean is None:
                return None
            noise = keras.random.normal((context.num_samples,) + tuple(mean.shape), dtype=mean.dtype,
                                        seed=context.seed_generator)
            return ops.expand_dims(mean + ops.sqrt(variance) * noise, 1)

        weights = []
        for name in PROJECTIONS:
            kernel_mean, kernel_var, bias_mean, bias_var = self.posterior(name)
            weights.append((draw(kernel_mean, kernel_var), draw(bias_mean, bias_var)))
        query = samples(query)
        value = query if value is query or value is None else samples(value)
        mask = self._mask(attention_mask, use_causal_mask, ops.shape(query)[2], ops.shape(value)[2])
        return attention.attend(query, value, *weights, mask=mask)

    # ---------------------------------------------------------------- conversion and config

    @classmethod
    def from_multi_head_attention(cls, layer, kernel_variance=None, bias_variance=None, **kwargs):
        """The keras-dvi counterpart of a built `keras.layers.MultiHeadAttention` on sequences
        (attention over the sequence axis, no gate or sliding window), its weights as the
        posterior means (what `keras_dvi.convert` uses; the layer's dropout is not carried)."""
        if not isinstance(layer, keras.layers.MultiHeadAttention) or not layer.built:
            raise ValueError("Argument `layer` must be a built keras.layers.MultiHeadAttention layer.")
        query_kernel, output_kernel = layer.query_dense.kernel, layer.output_dense.kernel
        if len(query_kernel.shape) != 3 or len(output_kernel.shape) != 3:
            raise ValueError(f"keras_dvi converts a MultiHeadAttention on sequences (batch, T, C); layer {layer.name!r} "
                             f"attends over other axes (query kernel {tuple(query_kernel.shape)}).")
        converted = cls(layer.num_heads, layer.key_dim, layer.value_dim, use_bias=layer.query_dense.bias is not None,
                        output_shape=int(output_kernel.shape[-1]), kernel_variance_init=kernel_variance,
                        bias_variance_init=bias_variance, name=kwargs.pop("name", layer.name), **kwargs)
        width, value_width = int(query_kernel.shape[0]), int(layer.value_dense.kernel.shape[0])
        converted.kl_term.unplaced = True  # (`build_unplaced` with the value's shape too)
        converted.build((None, None, width), (None, None, value_width))
        for name, dense in zip(PROJECTIONS, (layer.query_dense, layer.key_dense, layer.value_dense,
                                             layer.output_dense)):
            current = converted.posterior(name)
            converted.set_posterior(dense.kernel, current[1], dense.bias, None, projection=name)
        return converted

    def get_config(self):
        config = super().get_config()
        config.pop("activation", None)
        config.update(num_heads=self.num_heads, key_dim=self.key_dim, value_dim=self.value_dim,
                      output_shape=self.output_width)
        return config
