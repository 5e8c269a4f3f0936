"""Step time of the paper's CIFAR-10 network with global inducing points (Ober & Aitchison
2021, Sec. 4.3), against the same network factorised (`Conv2DMCVI`) and plain.

CIFAR-10 cannot be downloaded here, so the network trains on random 32x32x3 images with 10
labels: the cost of a step does not depend on the pixels. The network (the paper's): conv 32
3x3, ReLU, block, average pool 2, block, average pool 2, block, global average pool, linear 10,
where a block is `x + relu(conv(relu(conv(x))))`, 32 channels everywhere; 500 inducing images;
batches of `--batch` (paper: 500), one weight draw per step (paper). Prints, per network, the
seconds per training step (median of `--steps` after one warm-up step) and the images per
second.

    python -m benchmarks.gi_resnet --batch 500 --inducing 500 --steps 3
"""

import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402

CHANNELS = 32


def build(kind, num_train, inducing):
    import keras

    import keras_dvi as kd

    td = keras.layers.TimeDistributed
    if kind == "gi":
        gi = dict(num_inducing=inducing, regularizer=kd.NealPrior(num_train))
        conv = lambda: kd.GlobalInducingConv2D(CHANNELS, 3, "relu", **gi)  # noqa: E731
        pool = lambda: td(keras.layers.AveragePooling2D(2))  # noqa: E731
        head = [td(keras.layers.GlobalAveragePooling2D()), kd.GlobalInducingDense(10, output_layer=True, **gi)]
        loss = kd.SampledSoftmaxELL()
    elif kind == "mcvi":
        prior = kd.GaussianPriorRegularizer(num_train, per_fan_in=True, kl_weight=1.0)
        conv = lambda: kd.Conv2DMCVI(CHANNELS, 3, padding="same", activation="relu", num_samples=1,  # noqa: E731
                                     regularizer=prior)
        pool = lambda: td(keras.layers.AveragePooling2D(2))  # noqa: E731
        head = [td(keras.layers.GlobalAveragePooling2D()), kd.DenseMCVI(10, regularizer=prior)]
        loss = kd.SampledSoftmaxELL()
    else:
        conv = lambda: keras.layers.Conv2D(CHANNELS, 3, padding="same", activation="relu")  # noqa: E731
        pool = lambda: keras.layers.AveragePooling2D(2)  # noqa: E731
        head = [keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(10)]
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    inputs = keras.Input((32, 32, 3))
    h = conv()(inputs)

    def block(h):
        return keras.layers.Add()([h, conv()(conv()(h))])

    h = pool()(block(h))
    h = pool()(block(h))
    h = block(h)
    for layer in head:
        h = layer(h)
    model = keras.Model(inputs, h)
    model.compile(keras.optimizers.Adam(1e-2), loss=loss)
    return model


def time_steps(kind, args):
    import keras

    import keras_dvi as kd

    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.batch * (args.steps + 1), 32, 32, 3)).astype("float32")
    y = rng.integers(0, 10, len(x))
    model = build(kind, 50_000, args.inducing)
    if kind == "gi":
        kd.initialize_from_data(model, x, y, seed=0)
    times = []

    class Clock(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            self.start = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            times.append(time.perf_counter() - self.start)

    model.fit(x, y, batch_size=args.batch, epochs=1, verbose=0, callbacks=[Clock()])
    step = float(np.median(times[1:]))
    return {"network": kind, "seconds_per_step": step, "images_per_second": args.batch / step,
            "parameters": model.count_params()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=500)
    parser.add_argument("--inducing", type=int, default=500)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--networks", nargs="+", default=["plain", "mcvi", "gi"], choices=["plain", "mcvi", "gi"])
    args = parser.parse_args(argv)
    print("| network | batch | inducing | s / step | images / s | parameters |")
    print("|---|---|---|---|---|---|")
    for kind in args.networks:
        r = time_steps(kind, args)
        print(f"| {kind} | {args.batch} | {args.inducing if kind == 'gi' else '-'} | {r['seconds_per_step']:.3g} | "
              f"{r['images_per_second']:.0f} | {r['parameters']} |", flush=True)


if __name__ == "__main__":
    main()
