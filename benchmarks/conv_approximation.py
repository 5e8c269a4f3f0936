"""How close the conv layers' moments are to Monte Carlo of the network the user built (issue 25).

    python -m benchmarks.conv_approximation --out benchmarks/results/conv_approximation.md

For each network, input size and posterior variance scale (`scale / fan_in` for every kernel,
a tenth of that for biases), the output means and variances of the keras-dvi network are
compared with `keras_dvi.predict_samples` (one kernel drawn per sample and shared by every
position): the median over outputs and inputs of |mean error| / predictive sd, and of the
ratio of variances. Each network is run twice: as the library computes it (per-position
moments plus the per-channel shared component) and as a per-position diagonal (the shared
components forced to 0), to show what the shared component buys.

Networks: the issue's (conv 3x3 (8), ReLU, max pool 2, conv 3x3 (8), ReLU, global average
pool, dense 3) on the digits zoomed to 8x8, 16x16 and 28x28, with the ReLU on the conv layer
("post") and on the pooling layer ("pre", the same function); the MNIST benchmark's CNN
(conv 32 - pool - conv 64 - pool - flatten - dense 128 - dense 10) on 28x28 digits; a residual
block (`AddDVI`); and a 1D network on smooth signals.
"""

import argparse
import contextlib
import os
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from keras_dvi import conv_moments  # noqa: E402
from tests.test_conv import (  # noqa: E402 - the networks the tests check
    _benchmark_cnn, _compare, _images, _issue_cnn, _residual_cnn, _set_variances, _signal_cnn, _signals)


@contextlib.contextmanager
def diagonal():
    """Forces every shared component to 0: the per-position diagonal."""
    original = conv_moments.clip_shared  # noqa: SLF001 - a measurement of the alternative
    conv_moments.clip_shared = lambda shared, variance: keras.ops.zeros_like(shared)
    try:
        yield
    finally:
        conv_moments.clip_shared = original


def cases():
    for size in (8, 16, 28):
        for form in ("post", "pre"):
            yield f"issue's CNN, {form}-pool ReLU, {size}x{size}", lambda s=size, f=form: _issue_cnn(s, f), \
                lambda s=size: _images(s, rows=6), size, 4000
    yield "benchmark CNN (ReLU on pooling), 28x28", _benchmark_cnn, lambda: _images(28, rows=4), 3, 1500
    yield "residual block (AddDVI), average pool, 12x12", _residual_cnn, lambda: _images(12, rows=4), 12, 3000
    yield "1D network, smooth signals of 32 steps", _signal_cnn, _signals, 32, 3000


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scales", type=float, nargs="+", default=[0.03, 0.3])
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    lines = ["| network | variance scale | shared: mean error | shared: variance ratio | diagonal: mean error "
             "| diagonal: variance ratio |", "|---|---|---|---|---|---|"]
    for name, build, inputs, seed, samples in cases():
        for scale in args.scales:
            cells = []
            for mode in ("shared", "diagonal"):
                keras.utils.set_random_seed(seed)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    model = build()
                _set_variances(model, scale)
                with diagonal() if mode == "diagonal" else contextlib.nullcontext():
                    mean_error, ratio = _compare(model, inputs(), samples, seed=1)
                cells += [f"{np.median(np.abs(mean_error)):.3f}", f"{np.median(ratio):.2f}"]
            lines.append(f"| {name} | {scale} | " + " | ".join(cells) + " |")
            print(lines[-1], flush=True)
    text = "\n".join(lines)
    if args.out:
        with open(args.out, "w") as f:
            f.write("`python -m benchmarks.conv_approximation`: medians over outputs and inputs; mean error in "
                    "predictive standard deviations (Monte Carlo), variance ratio keras-dvi / Monte Carlo.\n\n"
                    + text + "\n")


if __name__ == "__main__":
    main()
