"""Runtime benchmark: the paper's Figure 4 on this machine, plus whole-network training steps.

    python -m benchmarks.runtime --out benchmarks/results/runtime.md

1. Forward + backward time to propagate a batch of 10 through one `d x d` ReLU layer, for `d`
   from 16 to 1024: `DenseDVI` on a full-covariance input (the paper's setting: the layer
   inside a deep network), `DenseDiagDVI` on a diagonal input, and `DenseMCVI` with `S` in
   {1, 10, 100, 300} weight samples. Times are medians over repeats of a compiled
   (`tf.function`) step; ratios are taken within the same run.
   A plain `keras.layers.Dense` ReLU layer is timed alongside as the baseline.
   (`--cnn`: only the training steps of the MNIST benchmark's CNN as a plain, Flipout, DVI and
   MCVI network, interleaved; `cnn_times`.)
2. Training-step time (one `fit` epoch, as users train) of whole in-w-w-2 ReLU networks: DVI,
   DVI (a `DenseDiagDVI` first layer, exactly DVI after data, then `DenseDVI`), dDVI (diagonal
   throughout), MCVI (S = 10) against a plain `keras.layers.Dense` network of
   the same shape, at a small, overhead-bound size (1-128-128-2, batch 50) and a larger,
   compute-bound one (256-256-256-2, batch 256).

Memory: the size of the largest per-step tensor (covariance `B d^2`, sampled kernels
`S d^2`) in MB, float32, and the process's peak resident memory at the end.
"""

import argparse
import json
import os
import resource
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.report import report  # noqa: E402
import keras_dvi as kd  # noqa: E402
from keras_dvi.packing import pack  # noqa: E402


def _median_time(fn, repeats):
    fn()  # trace and warm up
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def _step(layer, inputs):
    import tensorflow as tf

    @tf.function
    def run():
        with tf.GradientTape() as tape:
            out = layer(inputs)
            loss = tf.reduce_sum(out)
        grads = tape.gradient(loss, layer.trainable_variables)
        return loss, grads

    return lambda: [t.numpy() if hasattr(t, "numpy") else t for t in tf.nest.flatten(run())][:1]


def layer_times(d, batch, samples, repeats):
    rng = np.random.default_rng(0)
    mean = rng.standard_normal((batch, d)).astype("float32")
    a = rng.standard_normal((batch, d, d)).astype("float32") / d
    cov = np.einsum("bij,bkj->bik", a, a) + 0.1 * np.eye(d, dtype="float32")
    var = np.ascontiguousarray(np.diagonal(cov, axis1=1, axis2=2))
    row = {"d": d, "batch": batch, "repeats": repeats}
    row["dense"] = _median_time(_step(keras.layers.Dense(d, "relu"), mean), repeats)
    row["dvi"] = _median_time(_step(kd.DenseDVI(d, "relu"), pack(mean, cov)), repeats)
    row["ddvi"] = _median_time(_step(kd.DenseDiagDVI(d, "relu"), pack(mean, var)), repeats)
    for s in samples:
        if s * d * d > 4e8:  # more than 1.6 GB of sampled kernels: skip
            row[f"mcvi{s}"] = float("nan")
            continue
        row[f"mcvi{s}"] = _median_time(_step(kd.DenseMCVI(d, "relu", num_samples=s), mean), repeats)
    return row


def network_times(width, batch, in_dim, steps, kinds=None, jit=False):
    """Seconds per training step of in-width-width-2 ReLU networks, timed over one `fit`
    epoch of `steps` batches (after a warm-up epoch), as users train. `kinds` restricts the
    networks by name; `jit` adds XLA-compiled (`jit_compile=True`) runs of the plain Dense and
    dDVI networks among them."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch * steps, in_dim)).astype("float32")
    y = rng.standard_normal((batch * steps, 1)).astype("float32")
    prior = kd.EmpiricalBayesRegularizer(batch * steps)
    shapes = {
        "plain Dense": (lambda: [keras.layers.Dense(width, "relu"), keras.layers.Dense(width, "relu"), keras.layers.Dense(2)],
                        lambda t, p: keras.ops.mean(keras.ops.square(t - p[:, :1]))),
        "DVI": (lambda: [kd.DenseDiagDVI(width, "relu", regularizer=prior), kd.DenseDVI(width, "relu", regularizer=prior),
                         kd.DenseDVI(2, regularizer=prior)], kd.HeteroscedasticELL()),
        "dDVI": (lambda: [kd.DenseDiagDVI(width, "relu", regularizer=prior), kd.DenseDiagDVI(width, "relu", regularizer=prior),
                          kd.DenseDiagDVI(2, regularizer=prior)], kd.HeteroscedasticELL()),
        "MCVI S=10": (lambda: [kd.DenseMCVI(width, "relu", num_samples=10, regularizer=prior),
                               kd.DenseMCVI(width, "relu", regularizer=prior), kd.DenseMCVI(2, regularizer=prior)],
                      kd.SampledHeteroscedasticELL()),
    }
    runs = [(name, name, False) for name in shapes if kinds is None or name in kinds]
    if jit:
        runs += [(f"{name}, XLA", name, True) for name in ("plain Dense", "dDVI") if kinds is None or name in kinds]
    times = {}
    for label, name, xla in runs:
        layers, loss = shapes[name]
        model = keras.Sequential([keras.Input((in_dim,))] + layers())
        model.compile(keras.optimizers.Adam(1e-3), loss=loss, jit_compile=xla)
        model.fit(x[: batch * 5], y[: batch * 5], batch_size=batch, epochs=1, verbose=0)
        start = time.perf_counter()
        model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
        times[label] = (time.perf_counter() - start) / steps
    return times


def cnn_times(rounds, steps, batch):
    """Training-step times (`train_on_batch`, compiled) of the MNIST benchmark's CNN
    (`benchmarks/images.py`: conv 32 - pool - conv 64 - pool - dense 128 - 10) as a plain
    Keras CNN, keras-proba's Flipout CNN (when installed), keras-dvi's DVI CNN (ReLU on the
    pooling layers, as advised, and on the conv layers), the MCVI CNN (2 kernel draws) and a
    plain network doing only the DVI CNN's convolutions (the floor of its cost), in
    interleaved rounds: each round times `steps` steps of every network; the median over rounds
    is reported, in seconds per step."""
    from benchmarks import images

    import keras_dvi as kd

    rng = np.random.default_rng(0)
    x = rng.uniform(0, 1, (batch, 28, 28, 1)).astype("float32")
    y = rng.integers(0, 10, batch).astype("int32")
    builders = {"plain CNN": lambda: images.plain_cnn(10)}
    try:
        import keras_proba  # noqa: F401

        builders["Flipout CNN (keras-proba)"] = lambda: images.flipout_cnn(10, 60000, 0)
    except ImportError:
        print("keras-proba is not installed (pip install -e '.[benchmarks]'): no Flipout row")
    builders["DVI CNN (ReLU on pooling)"] = lambda: images.keras_dvi_cnn("dvi", 10, 60000)

    def post_form():
        prior = kd.EmpiricalBayesRegularizer(60000)
        model = keras.Sequential([
            keras.Input((28, 28, 1)), kd.Conv2DDVI(32, 3, activation="relu", regularizer=prior), kd.MaxPooling2DDVI(2),
            kd.Conv2DDVI(64, 3, activation="relu", regularizer=prior), kd.MaxPooling2DDVI(2), kd.FlattenDVI(),
            kd.DenseDiagDVI(128, "relu", regularizer=prior), kd.DenseDVI(10, regularizer=prior)])
        model.compile(keras.optimizers.Adam(1e-3), loss=kd.SoftmaxDeltaELL())
        return model

    builders["DVI CNN (ReLU on conv)"] = post_form

    def convolutions_only():
        # A plain network with the convolutions a DVI CNN computes and nothing else: the first
        # conv layer's three (mean, variance, shared component; its input is data) and the
        # second's four (the input variances through the squared kernel means as well), each
        # with its gradient; plain pooling, flatten and dense layers after them.
        x = keras.Input((28, 28, 1))
        first = [keras.layers.MaxPooling2D(2)(keras.layers.Conv2D(32, 3, activation="relu")(x)) for _ in range(3)]
        second = [keras.layers.Conv2D(64, 3)(h) for h in first + [first[0]]]
        h = keras.layers.MaxPooling2D(2)(keras.layers.Activation("relu")(keras.layers.Add()(second)))
        h = keras.layers.Dense(128, activation="relu")(keras.layers.Flatten()(h))
        model = keras.Model(x, keras.layers.Dense(10)(h))
        model.compile(keras.optimizers.Adam(1e-3), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    builders["plain CNN with the DVI CNN's 7 convolutions"] = convolutions_only
    builders["MCVI CNN (2 draws)"] = lambda: images.keras_dvi_cnn("mcvi", 10, 60000)
    import warnings

    models = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, build in builders.items():
            models[name] = build()
            for _ in range(3):  # trace and warm up
                models[name].train_on_batch(x, y)
    times = {name: [] for name in models}
    for _ in range(rounds):
        for name, model in models.items():
            start = time.perf_counter()
            for _ in range(steps):
                model.train_on_batch(x, y)
            times[name].append((time.perf_counter() - start) / steps)
    return {name: float(np.median(t)) for name, t in times.items()}


def _tf_threads():
    import tensorflow as tf

    return tf.config.threading.get_intra_op_parallelism_threads()


def cnn_main(args):
    times = cnn_times(args.rounds, args.steps, args.cnn_batch)
    base = times["plain CNN"]
    backend = keras.backend.backend()
    threads = _tf_threads() if backend == "tensorflow" else None
    lines = [f"Training step of the MNIST benchmark's CNN (conv 32 - pool - conv 64 - pool - dense 128 - 10), "
             f"batch {args.cnn_batch}, `train_on_batch`, median over {args.rounds} interleaved rounds of "
             f"{args.steps} steps, {backend}, "
             + (f"{threads or 'default'} thread(s):" if backend == "tensorflow" else "its default threads:"), "",
             "| network | ms / step | ratio to plain CNN |", "|---|---|---|"]
    for name, t in times.items():
        lines.append(f"| {name} | {1e3 * t:.1f} | {t / base:.2f} |")
    report("\n".join(lines), args.out, "benchmarks.runtime")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cnn", action="store_true", help="only the CNN training steps (issue 25)")
    parser.add_argument("--cnn-batch", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5, help="--cnn: interleaved rounds")
    parser.add_argument("--threads", type=int, default=0, help="intra-op threads (0: TensorFlow's default)")
    parser.add_argument("--dims", type=int, nargs="+", default=[16, 32, 64, 128, 256, 512, 1024])
    parser.add_argument("--samples", type=int, nargs="+", default=[1, 10, 100, 300])
    parser.add_argument("--batch", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--networks", type=lambda v: tuple(int(t) for t in v.split(",")), nargs="+",
                        default=[(128, 50, 1), (256, 256, 256)], help="width,batch,inputs of whole networks")
    parser.add_argument("--steps", type=int, default=100, help="timed training steps per network")
    parser.add_argument("--network-kinds", nargs="+", default=None,
                        choices=["plain Dense", "DVI", "dDVI", "MCVI S=10"], help="default: all")
    parser.add_argument("--jit", action="store_true", help="also time plain Dense and dDVI under XLA")
    parser.add_argument("--cache", default=None, help="JSON file keeping the layer rows between runs")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.threads:
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(args.threads)
        tf.config.threading.set_inter_op_parallelism_threads(1)
    if args.cnn:
        return cnn_main(args)
    cached = {}
    if args.cache and os.path.exists(args.cache):
        with open(args.cache) as f:
            cached = {row["d"]: row for row in json.load(f)}
    rows = []
    for d in args.dims:
        row = cached.get(d)
        wanted = ["dense", "dvi", "ddvi"] + [f"mcvi{s}" for s in args.samples]
        if row is None or row.get("batch", 10) != args.batch or any(c not in row for c in wanted):
            row = layer_times(d, args.batch, args.samples, args.repeats)
        rows.append(row)
        print(rows[-1], flush=True)
        if args.cache:  # layer rows are kept, so a rerun only measures what is missing
            cached[d] = row
            with open(args.cache, "w") as f:
                json.dump(sorted(cached.values(), key=lambda r: r["d"]), f, indent=1)
    nets = {(w, b, i): network_times(w, b, i, args.steps, args.network_kinds, args.jit) for w, b, i in args.networks}
    cols = ["dense", "dvi", "ddvi"] + [f"mcvi{s}" for s in args.samples]
    lines = [
        f"One `d x d` ReLU layer, batch {args.batch}, forward + backward, median ms "
        "(ratio to DVI in brackets):",
        "",
        "| d | plain Dense | DVI (full cov.) | dDVI | " + " | ".join(f"MCVI S={s}" for s in args.samples)
        + " | DVI cov. MB | MCVI S=300 kernels MB |",
        "|---|" + "---|" * (len(cols) + 2),
    ]
    for r in rows:
        cells = []
        for c in cols:
            v = r[c]
            cells.append("skipped" if np.isnan(v) else f"{1e3 * v:.2f} ({v / r['dvi']:.2f})")
        cov_mb = args.batch * r["d"] ** 2 * 4 / 1e6
        ker_mb = 300 * r["d"] ** 2 * 4 / 1e6
        lines.append(f"| {r['d']} | " + " | ".join(cells) + f" | {cov_mb:.1f} | {ker_mb:.0f} |")
    dims = np.array([r["d"] for r in rows], dtype=float)
    lines += ["", "Growth exponent of time with d (least squares on log-log, d >= 128):", ""]
    big = dims >= 128
    for c in cols:
        t = np.array([r[c] for r in rows])
        ok = big & np.isfinite(t)
        if ok.sum() >= 2:
            slope = np.polyfit(np.log(dims[ok]), np.log(t[ok]), 1)[0]
            lines.append(f"- {c}: d^{slope:.2f}")
    for (width, batch, in_dim), net in nets.items():
        base = net.get("plain Dense", float("nan"))
        lines += ["", f"Training step of {in_dim}-{width}-{width}-2 ReLU networks, batch {batch} (one `fit` epoch of "
                  f"{args.steps} steps), ms:", "", "| network | ms / step | ratio to plain Dense |", "|---|---|---|"]
        for name, t in net.items():
            lines.append(f"| {name} | {1e3 * t:.2f} | {t / base:.1f} |")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    lines += ["", f"Peak resident memory of the benchmark process: {peak:.0f} MB."]
    report("\n".join(lines), args.out, "benchmarks.runtime", argv)


if __name__ == "__main__":
    main()
