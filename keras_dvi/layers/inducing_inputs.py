"""`InducingInputs`: learned inducing inputs placed before a factorised body, for
factorised-to-global networks (Ober & Aitchison 2021, "fac -> gi")."""

import keras
from keras import ops

from keras_dvi.packing import INDUCING_ROWS
from keras_dvi.layers.global_inducing_base import positive_int


@keras.saving.register_keras_serializable(package="keras_dvi")
class InducingInputs(keras.layers.Layer):
    """Prepends `num_inducing` learned inducing inputs `U0` to every batch.

    The start of a factorised-to-global network: the factorised layers after it (`DenseMCVI`,
    `Conv2DMCVI`) carry the inducing inputs and the data through the same weight draws, and a
    global inducing last layer (`GlobalInducingDense(..., output_layer=True, num_inducing=M,
    regularizer=...)`) takes the first `M` rows of its input as the inducing points' features,
    fits its weight posterior to them (eq. 11), and returns the data rows only. The factorised
    layers must draw weights, not pre-activations (`DenseMCVI`'s default
    `local_reparameterization=False`), so that the inducing points see the same network as the
    data. `keras_dvi.initialize_from_data` sets `U0` to training inputs.

    Args:
        num_inducing: positive integer, the number of inducing inputs `M`.
        initializer: initializer of `U0` (default `N(0, 1)`).
        **kwargs: base layer arguments.

    Input shape:
        `(batch, ...)`.

    Output shape:
        `(M + batch, ...)`, the inducing inputs first.

    Examples:
        >>> model = keras.Sequential([
        ...     keras.Input((8,)),
        ...     keras_dvi.InducingInputs(100),
        ...     keras_dvi.DenseMCVI(50, "relu", num_samples=10, regularizer=factorised_prior),
        ...     keras_dvi.DenseMCVI(50, "relu", regularizer=factorised_prior),
        ...     keras_dvi.GlobalInducingDense(1, output_layer=True, num_inducing=100,
        ...                                   regularizer=keras_dvi.NealPrior(num_train=len(x))),
        ...     keras_dvi.SampledHomoscedasticNoise(),
        ... ])
    """

    def __init__(self, num_inducing, initializer=None, **kwargs):
        super().__init__(**kwargs)
        self.num_inducing = positive_int("num_inducing", num_inducing)
        self.initializer = keras.initializers.get(initializer or keras.initializers.RandomNormal(stddev=1.0))

    def build(self, input_shape):
        shape = tuple(input_shape[1:])
        if any(n is None for n in shape):
            raise ValueError(f"The non-batch dimensions of the inputs to InducingInputs must be defined; "
                             f"received shape {input_shape}.")
        self.inducing_inputs = self.add_weight(name="inducing_inputs", shape=(self.num_inducing,) + shape,
                                               initializer=self.initializer)

    def call(self, inputs):
        return ops.concatenate([ops.cast(self.inducing_inputs, inputs.dtype), inputs], axis=0)

    def compute_output_spec(self, inputs):
        output = super().compute_output_spec(inputs)
        setattr(output, INDUCING_ROWS, self.num_inducing)  # read by the first keras-dvi layer's checks
        return output

    def compute_output_shape(self, input_shape):
        batch = None if input_shape[0] is None else input_shape[0] + self.num_inducing
        return (batch,) + tuple(input_shape[1:])

    def get_config(self):
        config = super().get_config()
        config.update({"num_inducing": self.num_inducing,
                       "initializer": keras.initializers.serialize(self.initializer)})
        return config
