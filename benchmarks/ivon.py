"""IVON (Shen et al., "Variational Learning is Effective for Large Deep Networks", ICML 2024,
Algorithm 1) for a plain Keras network: a mean-field Gaussian posterior over its weights,
learned by a natural-gradient variational step instead of Adam. A comparator for the
classifier ablation (`classification.py --methods ivon`), not part of the library.

One step, for weights `m`, Hessian estimate `h`, momentum `g`, posterior standard deviations
`sigma = 1 / sqrt(lambda (h + delta))`:

    eps ~ N(0, sigma^2),  g_hat = grad l(m + eps),  h_hat = g_hat * eps / sigma^2
    g <- beta1 g + (1 - beta1) g_hat
    h <- beta2 h + (1 - beta2) h_hat + (1 - beta2)^2 (h - h_hat)^2 / (2 (h + delta))
    m <- m - lr (g / (1 - beta1^t) + delta m) / (h + delta)

with `l` the mini-batch mean negative log-likelihood, `lambda = N` (the effective sample size
of the ELBO: the posterior of a Gaussian prior of precision `lambda delta`), the paper's
`beta1 = 0.9` and `beta2 = 0.99999`, and one weight sample per step. The weight decay is
`delta = 1 / (N prior_variance)`, a fixed `N(0, prior_variance)` prior (default 1, the prior
of TFP's and keras.io's examples): the paper's `delta = 1e-4` was set for 50,000 rows, and on a
few hundred rows it is a prior of variance near 100, whose draws swamp the predictions.
The learning rate and the initial Hessian `h0` follow the paper's recommendations for small
networks (`lr` 0.1-0.2, `h0` 0.1-1). With `beta2 = 0.99999` the Hessian estimate moves by 2%
of its distance in 2,000 steps, so on the classifier ablation's budget the posterior standard
deviations stay near their start, `1 / sqrt(N h0)`; `beta2=0.999` lets them adapt. Predictions average the softmax
over `TEST_SAMPLES` weight draws. TensorFlow backend (a custom training loop).
"""

import time

import numpy as np

BETA1, BETA2, TEST_SAMPLES = 0.9, 0.99999, 64


def train_ivon(model, x, y, epochs, batch, seed, learning_rate=0.2, hess_init=0.3, prior_variance=1.0, beta2=BETA2):
    """Trains the plain `model` (logits out) by IVON; returns `(predict, seconds)`."""
    import tensorflow as tf

    weights = model.trainable_variables
    n = len(x)
    ess = float(n)
    weight_decay = 1.0 / (ess * prior_variance)  # the paper's delta
    rng = tf.random.Generator.from_seed(seed)
    h = [tf.Variable(tf.fill(w.shape, hess_init)) for w in weights]
    g = [tf.Variable(tf.zeros(w.shape)) for w in weights]
    means = [tf.Variable(w) for w in weights]
    step = tf.Variable(0.0)
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def train_step(xb, yb):
        step.assign_add(1.0)
        sigmas = [tf.math.rsqrt(ess * (hi + weight_decay)) for hi in h]
        noises = [rng.normal(m.shape) * s for m, s in zip(means, sigmas)]
        for w, m, e in zip(weights, means, noises):
            w.assign(m + e)
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        grads = tape.gradient(loss, weights)
        for gi, hi, m, e, s, grad in zip(g, h, means, noises, sigmas, grads):
            h_hat = grad * e / tf.square(s)
            gi.assign(BETA1 * gi + (1.0 - BETA1) * grad)
            hi.assign(beta2 * hi + (1.0 - beta2) * h_hat
                      + 0.5 * (1.0 - beta2) ** 2 * tf.square(hi - h_hat) / (hi + weight_decay))
            g_bar = gi / (1.0 - BETA1 ** step)
            m.assign_sub(learning_rate * (g_bar + weight_decay * m) / (hi + weight_decay))
        return loss

    order_rng = np.random.default_rng(seed)
    start = time.time()
    for _ in range(epochs):
        order = order_rng.permutation(n)
        for i in range(0, n, batch):
            rows = order[i:i + batch]
            train_step(tf.constant(x[rows]), tf.constant(y[rows]))
    seconds = time.time() - start

    sample_rng = tf.random.Generator.from_seed(seed + 1)
    final_sigmas = [tf.math.rsqrt(ess * (hi + weight_decay)) for hi in h]
    # The objective reached: E_q[nll] on the training rows (TEST_SAMPLES draws) and KL(q || p) / N
    # to the fixed N(0, prior_variance) prior, so that -ELBO / N = nll + kl.
    train_nll = 0.0
    for _ in range(TEST_SAMPLES):
        for w, m, s in zip(weights, means, final_sigmas):
            w.assign(m + sample_rng.normal(m.shape) * s)
        train_nll += float(loss_fn(y, model(x, training=False))) / TEST_SAMPLES
    kl = sum(float(tf.reduce_sum(0.5 * (tf.math.log(prior_variance / tf.square(s))
                                        + (tf.square(s) + tf.square(m)) / prior_variance - 1.0)))
             for m, s in zip(means, final_sigmas))

    def predict(inputs):
        sigmas = [tf.math.rsqrt(ess * (hi + weight_decay)) for hi in h]
        probs = 0.0
        for _ in range(TEST_SAMPLES):
            for w, m, s in zip(weights, means, sigmas):
                w.assign(m + sample_rng.normal(m.shape) * s)
            probs += tf.nn.softmax(model(inputs, training=False)).numpy()
        return probs / TEST_SAMPLES

    predict.train_nll, predict.train_kl = train_nll, kl / n
    return predict, seconds
