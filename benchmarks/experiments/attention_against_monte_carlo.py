"""Multi-head attention against Monte Carlo: the rule's ablations on one layer, a converted
Transformer classifier over its weights, and the cost of one pass against the plain model.

**Layer** (`--part layer`): `keras_dvi.maths.attention.attention_moments` against 40,000 draws
of inputs (keras-dvi's representation) and weights through the plain function (the tests'
protocol, `tests/test_attention.py`), at input noise 0.03 (first order) and 0.1, with the
rule as shipped and with one part of it removed (`ABLATIONS`: the source is edited in memory,
as a mutation test does): the pattern held at its mean, the heads' outputs independent of
each other, the head units independent through the output projection, shared components
projected (as a convolution's) instead of matched to the sum's variance.

**Network** (`--part network`): keras.io's Transformer text classifier (token embedding, one
encoder block, average pooling, dense head; `tests.test_attention._transformer`), trained 3
epochs on a token-counting task, converted with posterior variances `scale / fan_in` (biases a
tenth) at `scale` 0.03 (the default) and 0.3; its logits' moments against 2,000 draws of the
weights (`keras_dvi.predict_samples`) on 8 sequences. Then the time of one prediction of 256
sequences, plain and converted (median of 5, after a warm-up).

    python -m benchmarks.experiments.attention_against_monte_carlo --part layer
    python -m benchmarks.experiments.attention_against_monte_carlo --part network --seeds 0 1 2
    python -m benchmarks.experiments.attention_against_monte_carlo --part cost

**Cost** (`--part cost`): one prediction of 256 sequences and one training step, plain and
converted, for the network above and a wider one (width 64, 4 heads, 32 tokens).

**Vision Transformer** (`--part vit`): the tests' Vision Transformer
(`tests.test_vision_transformer.vision_transformer`: 2x2 patches of scikit-learn's 8x8
digits by a strided convolution, `Reshape` into 16 tokens of width 16, a custom position
embedding, one pre-norm encoder block, average pooling, a softmax head), trained 20 epochs on
the first 1,200 digits, converted with the default variances; its logits' moments on 8 held-out
digits against 4,000 draws of the weights, and (`--stages`) every layer's output, per unit
and each channel's mean over the tokens (what the pooling reads).

    python -m benchmarks.experiments.attention_against_monte_carlo --part vit --seeds 0 1 2 --stages 0

With `--class-token` the network puts a class token before the patches and its head reads
the class token (`x[:, 0]`) instead of the average over the tokens.

    python -m benchmarks.experiments.attention_against_monte_carlo --part vit --class-token --seeds 0 1 2 --stages 0
"""

import argparse
import time

import keras
import numpy as np

import keras_dvi as kd
from benchmarks.experiments.converted_against_monte_carlo import agreement
from keras_dvi.maths import attention

#: The rule with one part removed: `(name, [(source text, replacement)])`.
ABLATIONS = {
    "pattern held at its mean": [
        ('p = ops.einsum("bhtji,chi->bhtjc", k_tilde, wq)', 'p = 0.0 * ops.einsum("bhtji,chi->bhtjc", k_tilde, wq)'),
        ('w = ops.einsum("bhtd,chd->bhtc", q, wk) * scale', 'w = 0.0 * ops.einsum("bhtd,chd->bhtc", q, wk) * scale'),
        ('block = ops.einsum("bhtji,bhti,bhtli->bhtjl", k_tilde, query_noise, k_tilde)', 'block = 0.0 * k_tilde'),
        ('block = block + ops.einsum("bhtjc,bhtc,bhtlc->bhtjl", g_mean, key_noise, g_mean)', 'block = block')],
    "heads independent": [
        ('variance = variance + ops.einsum("bhgtjl,hje,gle->bte", cross, wo, wo)',
         'variance = variance + ops.einsum("bhhtjl,hje,hle->bte", cross, wo, wo)')],
    "head units independent": [
        ('variance = variance + ops.einsum("bhgtjl,hje,gle->bte", cross, wo, wo)',
         'variance = variance + ops.einsum("bhhtjj,hje->bte", cross, wo * wo)')],
    "shared components projected": [
        ('correlated = ops.logical_and(excess > 0.0, spread > 1e-6 * (ops.square(total) + squares))\n'
         '    ratio = ops.where(correlated, excess / ops.where(correlated, spread, 1.0), 0.0)',
         'ratio = 1.0 / ops.maximum(total, 1e-30)')],
}


def _ablated(name):
    """A copy of `keras_dvi.maths.attention`'s namespace with ablation `name` applied."""
    source = open(attention.__file__).read()
    for old, new in ABLATIONS[name]:
        if source.count(old) != 1:
            raise RuntimeError(f"ablation {name!r}: the source no longer reads {old!r}")
        source = source.replace(old, new)
    namespace = dict(vars(attention))
    exec(compile(source, f"<{name}>", "exec"), namespace)
    return namespace["attention_moments"]


def layer_table(seeds=(0, 1, 2)):
    from tests import test_attention as protocol

    rules = {"as shipped": attention.attention_moments, **{name: _ablated(name) for name in ABLATIONS}}
    print("| rule | noise | output variance / Monte Carlo: median, min-max | channel means over positions: min-max |")
    print("|---|---|---|---|")
    for noise, share in ((0.03, 0.5), (0.03, 0.0), (0.1, 0.5)):
        for name, rule in rules.items():
            ratios, sums = [], []
            for seed in seeds:
                rng = np.random.default_rng(seed)
                query, posts = protocol._sequence(rng, 2, 6, 8, noise, share), protocol._posteriors(
                    rng, 8, 2, 4, 8, 1e-6 if noise == 0.03 else 1.0)
                attention.attention_moments, saved = rule, attention.attention_moments
                try:
                    _, variance, sum_variance = protocol._moments(query, None, posts)
                finally:
                    attention.attention_moments = saved
                _, mc_variance, mc_sum_variance = protocol._monte_carlo(rng, query, None, posts, 40_000)
                ratios.append(variance / mc_variance)
                sums.append(sum_variance / mc_sum_variance)
            ratio, summed = np.concatenate([r.ravel() for r in ratios]), np.concatenate([s.ravel() for s in sums])
            print(f"| {name} | {noise} (shared {share}) | {np.median(ratio):.2f}, {ratio.min():.2f}-{ratio.max():.2f} | "
                  f"{summed.min():.2f}-{summed.max():.2f} |", flush=True)


def _task(seed, n=256):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 40, size=(n, 12))
    return x, (np.isin(x, np.arange(8)).sum(1) > 2).astype("int32")


def network_row(seed, scale, draws=2000):
    from tests.test_attention import _transformer

    keras.utils.set_random_seed(seed)
    x, y = _task(seed)
    plain = _transformer()
    plain.compile("adam", "sparse_categorical_crossentropy")
    plain.fit(x, y, epochs=3, batch_size=32, verbose=0)
    converted = kd.convert(plain, regularizer=kd.EmpiricalBayesRegularizer(num_train=len(x)))
    if scale != 0.03:
        for layer in converted.layers:
            if isinstance(layer, kd.MultiHeadAttentionDVI):
                for name in ("query", "key", "value", "output"):
                    kernel_mean, kernel_variance, _, bias_variance = layer.posterior(name)
                    layer.set_posterior(None, kernel_variance * scale / 0.03, None, bias_variance * scale / 0.03,
                                        projection=name)
            elif isinstance(layer, kd.layers.BayesianLayer):
                layer.set_posterior(None, layer.kernel_variance * scale / 0.03, None,
                                    None if layer.bias_variance is None else layer.bias_variance * scale / 0.03)
    mean, covariance = (np.asarray(t) for t in kd.unpack(converted.predict(x[:8], verbose=0)))
    samples = np.asarray(kd.predict_samples(converted, x[:8], num_samples=draws))
    ratio, error = agreement(mean, np.diagonal(covariance, axis1=-2, axis2=-1), samples)
    # the attention's own output (per position and channel), against the same draws' kind
    attention_layer = next(layer for layer in converted.layers if isinstance(layer, kd.MultiHeadAttentionDVI))
    own = keras.Model(converted.input, attention_layer.output)
    packed = np.asarray(own.predict(x[:8], verbose=0))
    own_ratio, _ = agreement(packed[:, 0], packed[:, 1], np.asarray(kd.predict_samples(own, x[:8], num_samples=draws)))
    return ratio, error, own_ratio, plain, converted, x


def _seconds(model, x, repeats=5):
    model.predict(x, verbose=0, batch_size=len(x))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        model.predict(x, verbose=0, batch_size=len(x))
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def network_table(seeds):
    print(f"backend {keras.backend.backend()}")
    print("| variance scale | logits' variance / Monte Carlo: min-max over seeds (medians) | means, max error (sd) | "
          "the attention's output: min-max (medians) |")
    print("|---|---|---|---|")
    timing = []
    for scale in (0.03, 0.3):
        ratios, errors, medians, owns = [], [], [], []
        for seed in seeds:
            ratio, error, own, plain, converted, x = network_row(seed, scale)
            ratios.append(ratio), errors.append(error), medians.append(np.median(ratio)), owns.append(own)
            if scale == 0.03 and not timing:
                timing = [_seconds(plain, x), _seconds(converted, x)]
        ratio = np.concatenate(ratios)
        print(f"| {scale} | {ratio.min():.2f}-{ratio.max():.2f} ({', '.join(f'{m:.2f}' for m in medians)}) | "
              f"{max(e.max() for e in errors):.2f} | {min(o.min() for o in owns):.2f}-{max(o.max() for o in owns):.2f} "
              f"({', '.join(f'{np.median(o):.2f}' for o in owns)}) |", flush=True)
    print(f"one prediction of 256 sequences: plain {timing[0] * 1e3:.1f} ms, keras-dvi {timing[1] * 1e3:.1f} ms "
          f"({timing[1] / timing[0]:.1f}x)")


def cost_table(repeats=5):
    """The time of one prediction of 256 sequences and of one training step (batch 32), plain
    and converted (the Transformer above, and one with width 64, 4 heads, 32 tokens), medians
    of `repeats` after a warm-up."""
    from tests.test_attention import _transformer

    print(f"backend {keras.backend.backend()}")
    print("| network | prediction, 256 sequences: plain, keras-dvi (ratio) | training step, batch 32: plain, keras-dvi (ratio) |")
    print("|---|---|---|")
    for length, width, heads in ((12, 16, 2), (32, 64, 4)):
        keras.utils.set_random_seed(0)
        rng = np.random.default_rng(0)
        x = rng.integers(0, 40, size=(256, length))
        y = (np.isin(x, np.arange(8)).sum(1) > 2).astype("int32")
        plain = _transformer(length=length, width=width, heads=heads)
        plain.compile("adam", "sparse_categorical_crossentropy")
        converted = kd.convert(plain, regularizer=kd.EmpiricalBayesRegularizer(num_train=len(x)))
        row = []
        for model in (plain, converted):
            predict = _seconds(model, x, repeats)
            model.fit(x[:32], y[:32], epochs=1, batch_size=32, verbose=0)  # (compiles the step)
            steps = []
            for _ in range(repeats):
                start = time.perf_counter()
                model.fit(x, y, epochs=1, batch_size=32, verbose=0)
                steps.append((time.perf_counter() - start) / (len(x) // 32))
            row.append((predict, float(np.median(steps))))
        (p0, s0), (p1, s1) = row
        print(f"| T {length}, C {width}, {heads} heads | {p0 * 1e3:.1f}, {p1 * 1e3:.1f} ms ({p1 / p0:.1f}x) | "
              f"{s0 * 1e3:.1f}, {s1 * 1e3:.1f} ms ({s1 / s0:.1f}x) |", flush=True)


def _vit(seed, epochs=20, class_token=False):
    from sklearn.datasets import load_digits

    from tests.test_vision_transformer import vision_transformer

    digits = load_digits()
    x, y = (digits.images[..., None] / 16.0).astype("float32"), digits.target
    keras.utils.set_random_seed(seed)
    plain = (vision_transformer(class_token="joined", read=lambda tokens: tokens[:, 0]) if class_token
             else vision_transformer())
    plain.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"])
    plain.fit(x[:1200], y[:1200], epochs=epochs, batch_size=32, verbose=0)
    accuracy = plain.evaluate(x[1200:], y[1200:], verbose=0)[1]
    return plain, kd.convert(plain, regularizer=kd.EmpiricalBayesRegularizer(num_train=1200)), x[1200:1208], accuracy


def vit_table(seeds, stages, draws=4000, class_token=False):
    print(f"backend {keras.backend.backend()}; {'the class token' if class_token else 'the average over the tokens'}")
    print("| seed | plain accuracy | logits' variance / Monte Carlo: min-max (median) | means, max error (sd) |")
    print("|---|---|---|---|")
    for seed in seeds:
        _, converted, x, accuracy = _vit(seed, class_token=class_token)
        mean, covariance = (np.asarray(t) for t in kd.unpack(converted.predict(x, verbose=0)))
        samples = np.asarray(kd.predict_samples(converted, x, num_samples=draws))
        ratio, error = agreement(mean, np.diagonal(covariance, axis1=-2, axis2=-1), samples)
        print(f"| {seed} | {accuracy:.3f} | {ratio.min():.2f}-{ratio.max():.2f} ({np.median(ratio):.2f}) | "
              f"{error.max():.2f} |", flush=True)
    for seed in stages:
        _, converted, x, _ = _vit(seed, class_token=class_token)
        print(f"\nseed {seed}, layer by layer (variance / Monte Carlo's: median [5%, 95%])")
        print("| layer | per unit | each channel's mean over the tokens |")
        print("|---|---|---|")
        for layer in converted.layers[1:]:
            part = keras.Model(converted.input, layer.output)
            out = np.asarray(part.predict(x, verbose=0))
            samples = np.asarray(kd.predict_samples(part, x, num_samples=draws))
            random = np.ptp(samples, axis=1) > 0  # (a class token is the same number in every draw: exact, tested)
            if out.ndim < 4:  # (a vector: the pooled tokens, the logits)
                variance = np.asarray(kd.unpack(out)[1])
                variance = variance if variance.ndim == 2 else np.diagonal(variance, axis1=-2, axis2=-1)
                ratio = variance[random] / samples.var(1)[random]
                print(f"| {layer.name} | {np.median(ratio):.2f} [{np.percentile(ratio, 5):.2f}, "
                      f"{np.percentile(ratio, 95):.2f}] | |", flush=True)
                continue
            variance, shared = out[:, 1], out[:, 2]
            ratio = variance[random] / samples.var(1)[random]
            axes, count = tuple(range(1, variance.ndim - 1)), np.prod(variance.shape[1:-1])
            # the mean over positions: independent parts / count^2 plus the shared components' mean squared
            pooled = np.maximum(variance - shared ** 2, 0).sum(axes) / count ** 2 + (shared.sum(axes) / count) ** 2
            pooled_ratio = pooled / samples.mean(axis=tuple(range(2, samples.ndim - 1))).var(1)
            print(f"| {layer.name} | {np.median(ratio):.2f} [{np.percentile(ratio, 5):.2f}, "
                  f"{np.percentile(ratio, 95):.2f}] | {np.median(pooled_ratio):.2f} [{np.percentile(pooled_ratio, 5):.2f}, "
                  f"{np.percentile(pooled_ratio, 95):.2f}] |", flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("layer", "network", "cost", "vit"), default="network")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--stages", nargs="*", type=int, default=[], help="(--part vit) seeds to trace layer by layer")
    parser.add_argument("--class-token", action="store_true", help="(--part vit) a class token read by the head")
    args = parser.parse_args(argv)
    if args.part == "vit":
        vit_table(args.seeds, args.stages, class_token=args.class_token)
    elif args.part == "layer":
        layer_table(tuple(args.seeds))
    elif args.part == "cost":
        cost_table()
    else:
        network_table(args.seeds)


if __name__ == "__main__":
    main()
