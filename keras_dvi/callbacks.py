"""Keras callbacks for keras-dvi training."""


import keras

from keras_dvi import network


_FORWARDED = (
    "on_train_begin", "on_train_end", "on_epoch_begin", "on_train_batch_begin", "on_train_batch_end",
    "on_test_begin", "on_test_end", "on_test_batch_begin", "on_test_batch_end",
    "on_predict_begin", "on_predict_end", "on_predict_batch_begin", "on_predict_batch_end",
)


class AfterKLWarmup(keras.callbacks.Callback):
    """Runs a Keras callback's end-of-epoch rule only once the KL warm-up is over.

    While the KL weight rises (`kl_warmup_steps` of the prior), the network trains a tempered
    objective, and the full objective that `val_loss` reports need not improve: an
    `EarlyStopping` or `ReduceLROnPlateau` counting those epochs would stop the run or cut the
    learning rate inside the warm-up or just after it, and `restore_best_weights` could go back
    to a network trained on a fraction of the KL. Wrapped in `AfterKLWarmup`, the callback sees
    its first epoch at the end of the first epoch after which every keras-dvi layer of the model
    trains with the full `kl_weight`; its patience and best value start there. Every other
    event (`on_train_begin`, batches, evaluation, ...) reaches it as usual.

    Args:
        callback: the `keras.callbacks.Callback` to run after the warm-up, e.g.
            `keras.callbacks.EarlyStopping(...)`, `ReduceLROnPlateau(...)` or
            `ModelCheckpoint(..., save_best_only=True)`.

    Examples:
        >>> model.fit(x, y, epochs=1000, validation_split=0.1, callbacks=[
        ...     keras_dvi.AfterKLWarmup(keras.callbacks.EarlyStopping(patience=10, restore_best_weights=True)),
        ... ])
    """

    def __init__(self, callback):
        super().__init__()
        if not isinstance(callback, keras.callbacks.Callback):
            raise ValueError(
                "Argument `callback` of AfterKLWarmup must be a keras.callbacks.Callback such as "
                f"keras.callbacks.EarlyStopping(...); received {callback!r}."
            )
        self.callback = callback
        for name in _FORWARDED:
            setattr(self, name, getattr(callback, name))

    def set_params(self, params):
        super().set_params(params)
        self.callback.set_params(params)

    def set_model(self, model):
        super().set_model(model)
        self.callback.set_model(model)

    def warmup_done(self):
        """Whether every keras-dvi layer of the model has finished its KL warm-up."""
        return all(layer.kl_term.warmup_done() for layer in network.layers_of(self.model)
                   if getattr(layer, "kl_term", None) is not None and layer.built and layer.regularizer is not None)

    def on_epoch_end(self, epoch, logs=None):
        if self.warmup_done():
            self.callback.on_epoch_end(epoch, logs)
