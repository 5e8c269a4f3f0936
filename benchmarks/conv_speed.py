"""The speed of Bayesian convolutions: where a DVI CNN's time goes, against plain Keras.

    python -m benchmarks.conv_speed                        # both backends, 1 thread, ~15 min
    python -m benchmarks.conv_speed --backends jax --rounds 5
    python -m benchmarks.conv_speed --memory               # peak memory instead (subprocesses)
    python -m benchmarks.conv_speed --source /tmp/base     # time another checkout's keras_dvi
    python -m benchmarks.conv_speed --source /tmp/base --networks mnist_convnet --parts networks,layers --label before

Two networks, each a plain Keras model and its `keras_dvi.convert` counterpart (the plain
network's weights as posterior means, `EmpiricalBayesRegularizer`, `SoftmaxDeltaELL`):

* `mnist_convnet`: keras.io's MNIST convnet (conv 32 - max pool - conv 64 - max pool - dropout -
  dense 10), prediction of 1,024 images, training steps of 128.
* `resnet20`: a CIFAR ResNet-20 (3 stages of 3 basic blocks, 16/32/64 filters, batch
  normalisation folded into the convolutions by `convert`), prediction of 256 images, training
  steps of 64.

Every number is a median over interleaved rounds (each round times every system once), in one
process per backend, with the thread count fixed (`--threads`, default 1: the ratios are what
count; another job on the machine moves the milliseconds). Tables:

1. **Networks**: a prediction (`predict_on_batch`: one keras-dvi pass gives means and
   variances) and a training step (`train_on_batch`), plain and keras-dvi, and their ratio. A
   deep ensemble's prediction is 5 plain passes, MC dropout's 30.
2. **Layers** (MNIST convnet): the prediction time of the model cut after each layer (its
   output summed per example, so no large result is copied out), cumulative, and each layer's
   increment.
3. **Operations**: the moment functions of `keras_dvi.conv_moments` alone on the MNIST
   convnet's shapes, compiled (`tf.function` / `jax.jit`), forward and forward + backward,
   against the plain operations they replace.

`--memory`: the peak resident memory a prediction and a training step add to a process that
built the model (a fresh process per system and mode: `ru_maxrss` only grows), plain against
keras-dvi.

Records are JSON per backend (and label) in `--results`; the summary is printed and written to
`summary.md` there.
"""

import argparse
import functools
import json
import os
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NETWORKS = {"mnist_convnet": {"shape": (28, 28, 1), "predict": 1024, "train": 128, "num_train": 60000},
            "resnet20": {"shape": (32, 32, 3), "predict": 256, "train": 64, "num_train": 50000}}


# ------------------------------------------------------------------------------------------
# The networks
# ------------------------------------------------------------------------------------------


def mnist_convnet():
    """keras.io's "Simple MNIST convnet"."""
    import keras

    return keras.Sequential([
        keras.Input((28, 28, 1)),
        keras.layers.Conv2D(32, 3, activation="relu"), keras.layers.MaxPooling2D(2),
        keras.layers.Conv2D(64, 3, activation="relu"), keras.layers.MaxPooling2D(2),
        keras.layers.Flatten(), keras.layers.Dropout(0.5), keras.layers.Dense(10, activation="softmax"),
    ])


def resnet20(input_shape=(32, 32, 3), dropout=0.0, dropout_layer=None):
    """A CIFAR ResNet-20 (He et al. 2016, section 4.2): conv 16, three stages of three basic
    blocks (16, 32, 64 filters; the first block of stages 2 and 3 strides 2 with a 1x1
    projection shortcut), global average pooling, dense 10. `dropout > 0` (MC dropout): a
    dropout layer of that rate (`dropout_layer`, default `keras.layers.Dropout`) after every
    block and before the dense layer."""
    import keras

    dropout_layer = dropout_layer or keras.layers.Dropout

    def conv(h, filters, strides=1, relu=True, kernel=3):
        h = keras.layers.Conv2D(filters, kernel, strides=strides, padding="same", use_bias=False)(h)
        h = keras.layers.BatchNormalization()(h)
        return keras.layers.ReLU()(h) if relu else h

    inputs = keras.Input(input_shape)
    x = conv(inputs, 16)
    for stage, filters in enumerate((16, 32, 64)):
        for block in range(3):
            strides = 2 if stage and not block else 1
            branch = conv(conv(x, filters, strides), filters, relu=False)
            if strides != 1:
                x = conv(x, filters, strides, relu=False, kernel=1)
            x = keras.layers.ReLU()(keras.layers.Add()([x, branch]))
            if dropout:
                x = dropout_layer(dropout)(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    if dropout:
        x = dropout_layer(dropout)(x)
    return keras.Model(inputs, keras.layers.Dense(10)(x))


def build(network, system):
    """The compiled plain model or its keras-dvi conversion."""
    import keras

    import keras_dvi as kd

    plain = {"mnist_convnet": mnist_convnet, "resnet20": resnet20}[network]()
    if system == "plain":
        from_logits = network != "mnist_convnet"
        plain.compile(keras.optimizers.Adam(1e-3), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=from_logits))
        return plain
    model = kd.convert(plain, regularizer=kd.EmpiricalBayesRegularizer(NETWORKS[network]["num_train"]))
    model.compile(keras.optimizers.Adam(1e-3), loss=kd.SoftmaxDeltaELL())
    return model


def data(network, rows, seed=0):
    import numpy as np

    rng = np.random.default_rng(seed)
    x = rng.uniform(0.0, 1.0, (rows,) + NETWORKS[network]["shape"]).astype("float32")
    return x, rng.integers(0, 10, rows).astype("int32")


# ------------------------------------------------------------------------------------------
# Timing
# ------------------------------------------------------------------------------------------


def _block(value):
    """Waits for a backend result (JAX dispatches asynchronously; TensorFlow's are ready),
    without copying it."""
    import keras

    if keras.backend.backend() == "jax":
        import jax

        jax.block_until_ready(value)
    return value


def interleaved(functions, rounds, warmup=2):
    """Median seconds of each of `functions` (a dict of thunks), over `rounds` rounds that
    call every function once, in turn."""
    import numpy as np

    for fn in functions.values():
        for _ in range(warmup):
            _block(fn())
    times = {name: [] for name in functions}
    for _ in range(rounds):
        for name, fn in functions.items():
            start = time.perf_counter()
            _block(fn())
            times[name].append(time.perf_counter() - start)
    return {name: float(np.median(t)) for name, t in times.items()}


def compiled(fn):
    """`fn` compiled as Keras compiles a step on the current backend."""
    import keras

    if keras.backend.backend() == "jax":
        import jax

        return jax.jit(fn)
    import tensorflow as tf

    return tf.function(fn)


def network_times(rounds, layers=True, networks=tuple(NETWORKS)):
    """Prediction and training-step times, plain and keras-dvi, of each of `networks`, and with
    `layers` the MNIST convnet's layer by layer."""
    import warnings

    import keras

    rows = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for network in networks:
            spec = NETWORKS[network]
            x, _ = data(network, spec["predict"])
            xt, yt = data(network, spec["train"], seed=1)
            models = {system: build(network, system) for system in ("plain", "dvi")}
            functions = {}
            for system, model in models.items():
                functions[f"{system} predict"] = lambda m=model, x=x: m.predict_on_batch(x)
                functions[f"{system} train"] = lambda m=model, xt=xt, yt=yt: m.train_on_batch(xt, yt)
            times = interleaved(functions, rounds)
            rows.append({"network": network, "predict_rows": spec["predict"], "train_rows": spec["train"], **times})
            if not layers or network != "mnist_convnet":  # (ResNet-20's 60 cuts: minutes of tracing)
                continue
            # Layer by layer (prediction, cumulative).
            cut_rows = []
            for system, model in models.items():
                cuts = [layer for layer in model.layers if not isinstance(layer, keras.layers.InputLayer)]
                heads = {f"{system} {i:02d} {layer.name}": _cut(model, layer) for i, layer in enumerate(cuts)}
                cut_times = interleaved({name: (lambda f=f, x=x: f(x)) for name, f in heads.items()}, max(3, rounds // 2))
                cut_rows += [{"system": system, "layer": name.split(" ", 2)[2],
                              "type": type(layer).__name__, "seconds": cut_times[name]}
                             for name, layer in zip(heads, cuts)]
            rows[-1]["layers"] = cut_rows
    return rows


def _cut(model, layer):
    """A compiled prediction of `model` up to `layer`, its output summed: the time to compute
    the layer's output without the copy of a large result to NumPy that `predict_on_batch`
    makes (the sum is outside the model: keras-dvi refuses a plain layer on its outputs)."""
    import keras
    from keras import ops

    head = keras.Model(model.inputs, layer.output)
    if keras.backend.backend() == "jax":
        import jax

        def total(trainable, non_trainable, x):
            return ops.sum(head.stateless_call(trainable, non_trainable, x, training=False)[0])

        step = jax.jit(total)
        return lambda x: step([v.value for v in head.trainable_variables],
                              [v.value for v in head.non_trainable_variables], x)
    return compiled(lambda x: ops.sum(head(x, training=False)))


def operation_times(rounds):
    """The moment functions alone on the MNIST convnet's shapes (batch 1,024)."""
    import keras
    import numpy as np
    from keras import ops

    import keras_dvi as kd
    from keras_dvi import conv_moments

    rng = np.random.default_rng(0)
    batch = 1024

    def tensor(*shape, low=0.0):
        return ops.convert_to_tensor(rng.uniform(low, 1.0, shape).astype("float32"))

    x = tensor(batch, 28, 28, 1)
    k1, v1 = tensor(3, 3, 1, 32, low=-1.0), tensor(3, 3, 1, 32) * 0.01
    b1, bv1 = tensor(32), tensor(32) * 0.001
    m1, s1 = tensor(batch, 26, 26, 32, low=-1.0), tensor(batch, 26, 26, 32) * 0.1
    v1a = s1 * s1 + tensor(batch, 26, 26, 32) * 0.1
    m2, s2 = tensor(batch, 13, 13, 32, low=-1.0), tensor(batch, 13, 13, 32) * 0.1
    v2a = s2 * s2 + tensor(batch, 13, 13, 32) * 0.1
    k2, v2 = tensor(3, 3, 32, 64, low=-1.0), tensor(3, 3, 32, 64) * 0.01
    b2, bv2 = tensor(64), tensor(64) * 0.001
    pool = {"pool_size": (2, 2), "strides": (2, 2), "padding": "valid"}
    forward = {
        "plain conv 1->32 (data)": (lambda d: ops.conv(d, k1), (x,)),
        "conv_moments 1->32 (data)": (lambda d: conv_moments.conv_moments(d, k1, v1, b1, bv1), (x,)),
        "one element-wise pass 26x26x32 (2 * x)": (lambda m: 2.0 * m, (m1,)),
        "plain relu 26x26x32": (lambda m: ops.relu(m), (m1,)),
        "activation_moments relu 26x26x32": (lambda m, v, s: conv_moments.activation_moments(m, v, s, "relu"),
                                             (m1, v1a, s1)),
        "plain max pool 26x26x32": (lambda m: ops.max_pool(m, 2, 2), (m1,)),
        "max_pool_moments 26x26x32": (lambda m, v, s: conv_moments.max_pool_moments(m, v, s, **pool), (m1, v1a, s1)),
        "activation_moments relu 13x13x32": (lambda m, v, s: conv_moments.activation_moments(m, v, s, "relu"),
                                             (m2, v2a, s2)),
        "plain conv 32->64": (lambda m: ops.conv(m, k2), (m2,)),
        "conv_moments 32->64": (lambda m, v, s: conv_moments.conv_moments(m, k2, v2, b2, bv2, v, s), (m2, v2a, s2)),
        "pack_map + split_map 26x26x32": (lambda m, v, s: kd.packing.split_map(kd.packing.pack_map(m, v, s), 2)[:3],
                                          (m1, v1a, s1)),
    }

    def call(function, args):
        return lambda: function(*args)

    functions = {}
    for name, (fn, args) in forward.items():  # (inputs as arguments: a compiler folds constants)
        functions[name] = call(compiled(fn), args)

        def total(*a, fn=fn):
            return sum(ops.sum(t) for t in keras.tree.flatten(fn(*a)))

        functions[name + ", with gradient"] = call(compiled(_value_and_grad(total)), args)
    return interleaved(functions, rounds)


def _value_and_grad(fn):
    """`fn`'s value and gradient with respect to all its arguments, on the current backend."""
    import keras

    if keras.backend.backend() == "jax":
        import jax

        return lambda *a: jax.value_and_grad(fn, argnums=tuple(range(len(a))))(*a)
    import tensorflow as tf

    def run(*a):
        with tf.GradientTape() as tape:
            for t in a:
                tape.watch(t)
            value = fn(*a)
        return value, tape.gradient(value, list(a))

    return run


def memory_worker(network, system, mode):
    """Peak resident memory (MB) a prediction or training step adds to a process holding the
    built model."""
    import resource
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build(network, system)
    spec = NETWORKS[network]
    x, y = data(network, spec["predict" if mode == "predict" else "train"])
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    for _ in range(3):
        _block(model.predict_on_batch(x) if mode == "predict" else model.train_on_batch(x, y))
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    return {"network": network, "system": system, "mode": mode, "mb_before": before, "mb_added": after - before}


# ------------------------------------------------------------------------------------------
# Driver
# ------------------------------------------------------------------------------------------


def set_threads(threads):
    """Fixes TensorFlow's thread pools (JAX's are fixed by `XLA_FLAGS` before it starts)."""
    import keras

    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(threads)
        tf.config.threading.set_inter_op_parallelism_threads(threads)


def _environment(backend, threads):
    env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="3")
    env["PYTHONPATH"] = ROOT
    if backend == "jax" and threads:
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false "
                            f"intra_op_parallelism_threads={threads}").strip()
    return env


def worker(args):
    if args.source:  # ahead of this checkout (the working directory) and an installed keras_dvi
        sys.path.insert(0, os.path.abspath(args.source))
    import keras

    import keras_dvi

    set_threads(args.threads)
    if args.memory_case:
        record = memory_worker(*args.memory_case.split(","))
    else:
        parts = args.parts.split(",")
        record = {"backend": keras.backend.backend(), "threads": args.threads, "rounds": args.rounds,
                  "networks": network_times(args.rounds, "layers" in parts, args.networks.split(","))
                  if "networks" in parts else [],
                  "operations": operation_times(args.rounds) if "operations" in parts else {}}
    record["keras_dvi"] = os.path.dirname(os.path.abspath(keras_dvi.__file__))
    print("RECORD " + json.dumps(record), flush=True)


def _run_worker(backend, args, extra=()):
    command = [sys.executable, "-m", "benchmarks.conv_speed", "--worker", "--threads", str(args.threads),
               "--rounds", str(args.rounds), "--parts", args.parts, "--networks", args.networks, *extra]
    if args.source:
        command += ["--source", args.source]
    run = subprocess.run(command, cwd=ROOT, env=_environment(backend, args.threads),
                         capture_output=True, text=True, check=False)
    lines = [line for line in run.stdout.splitlines() if line.startswith("RECORD ")]
    if run.returncode or not lines:
        raise RuntimeError(f"the {backend} worker failed:\n{run.stderr[-4000:]}")
    return json.loads(lines[-1][len("RECORD "):])


def _times(backend, args):
    return dict(_run_worker(backend, args), label=args.label)


def summary(records):
    lines = []
    for record in records:
        if "networks" not in record:
            continue
        lines += [f"### {record['backend']}, {record['threads']} thread(s), {record.get('label', '')}", "",
                  "| network | plain predict ms | keras-dvi predict ms | ratio | plain step ms | keras-dvi step ms | ratio |",
                  "|---|---|---|---|---|---|---|"]
        for row in record["networks"]:
            p, d = row["plain predict"], row["dvi predict"]
            tp, td = row["plain train"], row["dvi train"]
            lines.append(f"| {row['network']} ({row['predict_rows']} / {row['train_rows']} rows) | {1e3 * p:.1f} | "
                         f"{1e3 * d:.1f} | {d / p:.2f}x | {1e3 * tp:.1f} | {1e3 * td:.1f} | {td / tp:.2f}x |")
        for row in [r for r in record["networks"] if "layers" in r]:
            lines += ["", f"Layers of {row['network']} (prediction, cumulative ms, increment):", "",
                      "| system | layer | type | cumulative | increment |", "|---|---|---|---|---|"]
            previous = {}
            for layer in row["layers"]:
                last = previous.get(layer["system"], 0.0)
                lines.append(f"| {layer['system']} | {layer['layer']} | {layer['type']} | {1e3 * layer['seconds']:.1f} | "
                             f"{1e3 * (layer['seconds'] - last):+.1f} |")
                previous[layer["system"]] = layer["seconds"]
        lines += ["", "Operations (MNIST convnet shapes, batch 1,024, compiled, ms):", "", "| operation | ms |", "|---|---|"]
        lines += [f"| {name} | {1e3 * t:.1f} |" for name, t in record["operations"].items()]
        lines.append("")
    memory = [r for record in records for r in record.get("memory", [])]
    if memory:
        lines += ["| backend | network | mode | plain MB | keras-dvi MB | ratio |", "|---|---|---|---|---|---|"]
        keyed = {(r["backend"], r["network"], r["mode"], r["system"]): r["mb_added"] for r in memory}
        for backend, network, mode, system in sorted(keyed):
            if system == "plain":
                p, d = keyed[(backend, network, mode, "plain")], keyed.get((backend, network, mode, "dvi"), float("nan"))
                lines.append(f"| {backend} | {network} | {mode} | {p:.0f} | {d:.0f} | {d / max(p, 1.0):.2f}x |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", default="tensorflow,jax")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--parts", default="networks,layers,operations",
                        help="what to time: networks, layers (each layer of the networks), operations")
    parser.add_argument("--networks", default=",".join(NETWORKS), help="comma-separated, of " + ", ".join(NETWORKS))
    parser.add_argument("--memory", action="store_true")
    parser.add_argument("--source", default=None, help="a checkout whose keras_dvi to time (default: this one)")
    parser.add_argument("--label", default="this checkout")
    parser.add_argument("--results", default=os.path.join(ROOT, "benchmarks", "results", "conv_speed"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--memory-case", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    unknown = set(args.networks.split(",")) - set(NETWORKS)
    if unknown:
        parser.error(f"--networks: unknown {', '.join(sorted(unknown))}; choose from {', '.join(NETWORKS)}")
    if args.worker:
        return worker(args)
    from benchmarks import cache

    slug = args.label.replace(" ", "_")
    cases = [f"{n},{s},{m}" for n in NETWORKS for s in ("plain", "dvi") for m in ("predict", "train")]

    def memory(backend):
        return {"backend": backend, "label": args.label, "memory": [
            dict(_run_worker(backend, args, ("--memory-case", case)), backend=backend) for case in cases]}

    records = []
    for backend in args.backends.split(","):
        if args.memory:
            path = os.path.join(args.results, f"memory_{backend}_{slug}.json")
            record = cache.cached(path, functools.partial(memory, backend))
        else:
            path = os.path.join(args.results, f"{backend}_{args.threads}threads_{slug}.json")
            record = cache.cached(path, functools.partial(_times, backend, args))
        records.append(record)
    text = summary(records)
    os.makedirs(args.results, exist_ok=True)
    with open(os.path.join(args.results, f"summary_{slug}{'_memory' if args.memory else ''}.md"), "w") as f:
        f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
