"""Alternatives to today's Bayesian convolution maths that were measured and not taken
(BENCHMARKS.md, "The cost of one Bayesian CNN pass").

    python -m benchmarks.experiments.conv_speed_alternatives      # TensorFlow, 1 thread, ~5 min

1. TensorFlow runs each element-wise operation of the moments as its own pass over memory; XLA
   fuses them. The MNIST convnet (`benchmarks/conv_speed.py`) as it is, with the element-wise
   moment functions (`activation_moments`, `max_pool_moments`) compiled by XLA inside Keras'
   step (`tf.function(jit_compile=True)`), and with `conv_moments` compiled too.
2. Max pooling by Clark's recursion along one axis, then the other (two pair steps on 2x2
   windows, the first on twice as many elements), against the recursion over the window's four
   elements (three pair steps): the same number of element evaluations, fewer tap copies.

Prints medians over interleaved rounds; nothing is cached.
"""

import os
import subprocess
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

VARIANTS = ("graph", "xla elementwise", "xla elementwise and convolutions")


def network(variant, rounds):
    import tensorflow as tf

    from benchmarks import conv_speed
    from keras_dvi import conv_moments

    conv_speed.set_threads(1)
    names = {"graph": (), "xla elementwise": ("activation_moments", "max_pool_moments"),
             "xla elementwise and convolutions": ("activation_moments", "max_pool_moments", "conv_moments")}[variant]
    for name in names:  # (the layers look these functions up in the module at call time)
        setattr(conv_moments, name, tf.function(getattr(conv_moments, name), jit_compile=True, autograph=False))
    (times,) = conv_speed.network_times(rounds, layers=False, networks=("mnist_convnet",))
    print(f"| {variant} | {times['dvi predict'] / times['plain predict']:.1f}x | "
          f"{times['dvi train'] / times['plain train']:.1f}x |", flush=True)


def separable(rounds):
    import numpy as np
    import tensorflow as tf
    from keras import ops

    from benchmarks import conv_speed
    from keras_dvi import conv_moments

    conv_speed.set_threads(1)
    rng = np.random.default_rng(0)
    shape = (1024, 26, 26, 32)
    m = tf.constant(rng.uniform(-1, 1, shape).astype("float32"))
    s = tf.constant(rng.uniform(0, 0.1, shape).astype("float32"))
    v = s * s + 0.1

    def pairs(tensors, axis):
        halves = [ops.unstack(ops.reshape(t, t.shape[:axis] + (t.shape[axis] // 2, 2) + t.shape[axis + 1:]),
                              2, axis=axis + 1) for t in tensors]
        return conv_moments.max_pair_moments(*(h[0] for h in halves), *(h[1] for h in halves))

    by_axis = tf.function(lambda m, v, s: pairs(pairs((m, v, s), 2), 1))
    window = tf.function(lambda m, v, s: conv_moments.max_pool_moments(m, v, s, (2, 2), (2, 2)))
    times = conv_speed.interleaved({"window": lambda: window(m, v, s), "by axis": lambda: by_axis(m, v, s)}, rounds)
    difference = max(float(np.max(np.abs(a - b))) for a, b in zip(window(m, v, s), by_axis(m, v, s)))
    print(f"max pooling 2x2 of a 1024x26x26x32 map: over the window {1e3 * times['window']:.0f} ms, "
          f"by axis {1e3 * times['by axis']:.0f} ms (largest difference {difference:.4f})")


if __name__ == "__main__":
    if len(sys.argv) == 1:
        print("| MNIST convnet, TensorFlow, 1 thread | prediction / plain | training step / plain |\n|---|---|---|",
              flush=True)
        for variant in VARIANTS + ("separable",):  # a process each: a patched module stays patched
            subprocess.run([sys.executable, "-m", "benchmarks.experiments.conv_speed_alternatives", variant],
                           check=True)
    elif sys.argv[1] == "separable":
        separable(5)
    else:
        network(sys.argv[1], 5)
