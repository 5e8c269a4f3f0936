"""Closed-form moments of multi-head dot-product attention with factorised Gaussian
projections: the pure maths of `keras_dvi.MultiHeadAttentionDVI`.

The layer is Keras' `MultiHeadAttention` (Vaswani et al., 2017, eqs. 1-2): per head `h`, with
`d` the head size,

    q_t = x_t W_q + b_q,   k_s = y_s W_k + b_k,   v_s = y_s W_v + b_v,
    S_ts = q_t . k_s / sqrt(d),   a_ts = softmax_s(S_ts),   o_t = sum_s a_ts v_s,
    out_t = sum_h o_t^h W_o^h + b_o,

with `x` the query sequence and `y` the value (and key) sequence (`y = x`: self-attention).
Inputs are keras-dvi sequences (`keras_dvi.conv_moments`' representation: each unit a mean,
a variance and a shared component on its channel's factor), every weight an independent
Gaussian.

**The rule.** The attention pattern is a softmax of products of random quantities; no closed
form exists. It is taken at the means (`a_bar`, from the mean queries and keys) and the map
from inputs and weights to `o` linearised about the means (the delta method), which keeps
the pattern's own randomness:

    d o_t = sum_s g_ts dS_ts + sum_s a_ts dv_s,      g_ts = a_ts (v_s - o_t),
    dS_ts = (dq_t . k_s + q_t . dk_s) / sqrt(d)

(the softmax's Jacobian, `da_ts = a_ts (dS_ts - sum_u a_tu dS_tu)`, gives `g`). An input
unit `(s, c)` then reaches `o_t` with the coefficient

    J_ts[:, c] = [t = s] P_t[:, c] + g_ts w_t[c] + a_ts W_v[c, :],
    P_t = (sum_u g_tu k_u^T) W_q^T / sqrt(d),    w_t = W_k q_t / sqrt(d)

(query side, key side, value side; in cross-attention the query side reads `x` and the other
two `y`, two inputs whose noise is independent). Each unit's independent part adds
`J_ts J_ts^T (v - s^2)` to the covariance of position `t`'s head outputs, across all heads
and head units; its shared component `s` loads `sum_s J_ts s_s` on its channel's factor. The
weights' own noise adds the variances of `g`- and `a`-weighted sums: the value projection's
(`sum_c Var(W_v[c, j]) E[xhat_c^2]` with `xhat_t = sum_s a_ts y_s`), the query projection's
(`P`'s coefficients on `W_q`) and the key projection's (the key bias cancels in the softmax).
The head outputs' covariance goes through the output projection whole,
`diag(W_o^T Sigma_t W_o)`, plus the projection's own noise: head units that one input moves
together are not summed as independent (they would be wrong by up to 5x either way).

**Shared components.** The output's shared component of channel `e` is matched to the
variance of the channel's sum over positions: with `n_t = Cov(out_t, sum_t' out_t')` (every
source above: the inputs' independent parts mixed into every position, their shared
components, and the weights, the same draw at every position) and `D = sum_t n_t`,
`s_t = lambda n_t`, `lambda^2 = (D - sum_t v_t) / (D^2 - sum_t n_t^2)`, so that the
representation gives the sum its true variance (`_matched_shared`). For noise from one factor
this is a convolution's projection `n_t / sqrt(D)`; attention mixes every position's
independent noise into every output, which the projection would count twice (the sum's
variance 1.1-1.6x too large).

All of these are einsums; the largest are the covariances across pairs of heads, `O(batch
heads T S C^2)` time and `O(batch heads T C (C + S))` memory (a plain layer: `O(batch T S C)`);
no loop over positions or heads.

What the rule leaves out: the softmax's curvature (the mean is the pattern at the means, first
order; at larger noise the variance strays: 0.75-1.22 of Monte Carlo's at input noise 0.1),
and where the weights' noise moves the scores by more than their spread (inputs far larger
than a layer normalisation gives) the linearised variance over-states without bound. Tested
against Monte Carlo through the plain function (`attend`, itself tested against Keras'
`MultiHeadAttention`), inputs and weights drawn (`tests/test_attention.py`).
"""

import math

from keras import ops

from keras_dvi.maths import conv_moments, moments

#: What a masked score becomes before the softmax (Keras' `Softmax` adds `-1e9`).
_MASKED = -1e9


def _residual(variance, shared):
    """The independent part's variance `v - s^2` (zeros for a deterministic input)."""
    return None if variance is None else conv_moments.independent_variance(variance, shared)


def pattern(query, key, mask=None):
    """The attention pattern `softmax_s(q_t . k_s / sqrt(d))` of queries `(..., heads, T, d)`
    and keys `(..., heads, S, d)`, `(..., heads, T, S)`; `mask` `(batch, T, S)` (true:
    attend) sets the other scores to `-1e9`, as Keras does."""
    scores = ops.einsum("...htd,...hsd->...hts", query, key) / math.sqrt(int(query.shape[-1]))
    if mask is not None:
        scores = ops.where(ops.expand_dims(ops.cast(mask, "bool"), -3), scores, ops.cast(_MASKED, scores.dtype))
    return ops.softmax(scores, axis=-1)


def _project(x, kernel, bias):
    """`x W + b` per head: `x` `(..., T, C)`, `W` `(..., C, heads, d)` -> `(..., heads, T, d)`."""
    out = ops.einsum("...tc,...chd->...htd", x, kernel)
    return out if bias is None else out + ops.expand_dims(bias, -2)


def attend(query, value, query_weights, key_weights, value_weights, output_weights, mask=None):
    """The plain layer's function (`keras.layers.MultiHeadAttention` without dropout) for
    given weights, with any leading axes before `(T, C)`: `query` `(..., T, C)`, `value`
    `(..., S, C)`; each `*_weights` a pair `(kernel, bias)` (bias `None`: none), kernels
    `(C, heads, d)` and the output's `(heads, d, C_out)`, each with the inputs' leading axes
    before them if they differ per sample. What `keras_dvi.predict_samples` runs with drawn
    weights."""
    q, k, v = (_project(x, *weights) for x, weights in
               ((query, query_weights), (value, key_weights), (value, value_weights)))
    heads = ops.einsum("...hts,...hsd->...htd", pattern(q, k, mask), v)
    kernel, bias = output_weights
    out = ops.einsum("...htd,...hde->...te", heads, kernel)
    return out if bias is None else out + ops.expand_dims(bias, -2)


def _matched_shared(variance, numerator, axis=1):
    """Shared components `s_t = lambda n_t` along `axis` (the positions) from each unit's
    covariance `n_t` with its channel's sum over positions, scaled so that the representation
    gives that sum its true variance `D = sum_t n_t`: `(sum_t s_t)^2 + sum_t (v_t - s_t^2) = D`,
    `lambda^2 = (D - sum_t v_t) / (D^2 - sum_t n_t^2)` (0 where the positions are not positively
    correlated). For noise from one factor (`v_t = n_t^2 / D`) it is the projection
    `n_t / sqrt(D)` of `conv_moments.conv_moments`; attention mixes every position's
    independent noise into every output, which the projection would count twice."""
    total = ops.sum(numerator, axis=axis, keepdims=True)
    squares = ops.sum(ops.square(numerator), axis=axis, keepdims=True)
    excess = total - ops.sum(variance, axis=axis, keepdims=True)
    spread = ops.square(total) - squares
    # (lambda = 0 where either is not positive; the unused branch kept finite for the gradient,
    # and the square root floored)
    correlated = ops.logical_and(excess > 0.0, spread > 1e-6 * (ops.square(total) + squares))
    ratio = ops.where(correlated, excess / ops.where(correlated, spread, 1.0), 0.0)
    return conv_moments.clip_shared(numerator * ops.sqrt(ops.maximum(ratio, moments.VARIANCE_FLOOR)), variance)


def _value_weighted(a, v, x):
    """`sum_s a_ts v_s[j] x_s[c]`, `(batch, heads, T, d, C)` (in two einsums: TensorFlow's
    three-operand einsum runs this one 3x slower; each contraction order here was timed)."""
    return ops.einsum("bhts,bhsjc->bhtjc", a, ops.einsum("bhsj,bsc->bhsjc", v, x))


def _through_both(cov, kernel):
    """`sum_{j, l} cov[..., j, l] W[h, j, e] W[h, l, e]` over heads: a head's covariance
    `(batch, heads, T, d, d)` through the output projection `(heads, d, C_out)`."""
    return ops.einsum("bhtjl,hje,hle->bte", cov, kernel, kernel)


def _swap(cov):
    """`cov[b, g, h, t, l, j]` as `[b, h, g, t, j, l]`: the transpose of a cross-head block."""
    return ops.transpose(cov, (0, 2, 1, 3, 5, 4))


def attention_moments(query, value, query_posterior, key_posterior, value_posterior, output_posterior, mask=None,
                      self_attention=True):
    """Moments of multi-head attention's output (see the module docstring).

    Args:
        query: `(mean, variance, shared)` of the query sequence, each `(batch, T, C)`;
            `variance` and `shared` may be `None` (deterministic inputs; no shared components).
        value: the same for the value (and key) sequence `(batch, S, C)`; ignored when
            `self_attention`.
        query_posterior, key_posterior, value_posterior: `(kernel_mean, kernel_variance,
            bias_mean, bias_variance)`, kernels `(C, heads, d)`, biases `(heads, d)` (or
            `None`: no bias), as Keras' `MultiHeadAttention` holds them.
        output_posterior: the same for the output projection: kernel `(heads, d, C_out)`, bias
            `(C_out,)`.
        mask: `(batch, T, S)` booleans (true: attend) or `None`.
        self_attention: whether the value sequence is the query sequence (its noise then
            reaches `o_t` through the query, key and value sides at once).

    Returns:
        `(mean, variance, shared)`, each `(batch, T, C_out)`.
    """
    mean_x, var_x, shared_x = query
    mean_y, var_y, shared_y = query if self_attention else value
    wq, vq, bq, vbq = query_posterior
    wk, vk, bk, _ = key_posterior  # (the key bias adds the same score to every key: no effect)
    wv, vv, bv, vbv = value_posterior
    wo, vo, bo, vbo = output_posterior
    scale = 1.0 / math.sqrt(int(wq.shape[-1]))
    q, k, v = _project(mean_x, wq, bq), _project(mean_y, wk, bk), _project(mean_y, wv, bv)
    a = pattern(q, k, mask)
    o = ops.einsum("bhts,bhsd->bhtd", a, v)
    positions = ops.cast(ops.shape(a)[2], a.dtype)
    r_x, r_y = _residual(var_x, shared_x), _residual(var_y, shared_y)
    through = lambda t, spec: ops.einsum(spec, t, wo)  # noqa: E731  (head units -> outputs)

    # The pattern's Jacobian: g_ts = a_ts (v_s - o_t); the query side's K_t = sum_s g_ts k_s^T /
    # sqrt(d) and coefficients P_t = K_t W_q^T, the key side's w_t = W_k q_t / sqrt(d).
    k_hat = ops.einsum("bhts,bhsi->bhti", a, k)
    k_tilde = (ops.einsum("bhts,bhsji->bhtji", a, ops.einsum("bhsj,bhsi->bhsji", v, k))
               - ops.expand_dims(o, -1) * ops.expand_dims(k_hat, -2)) * scale  # (b, h, t, d, d)
    p = ops.einsum("bhtji,chi->bhtjc", k_tilde, wq)  # (b, h, t, d, C)
    w = ops.einsum("bhtd,chd->bhtc", q, wk) * scale  # (b, h, t, C)
    m_hat = ops.einsum("bhts,bsc->bhtc", a, mean_y)  # sum_s a_ts y_s at the means
    s_hat = None if shared_y is None else ops.einsum("bhts,bsc->bhtc", a, shared_y)

    # Covariance of the head units at each position: `cross[b, h, g, t, j, l]` across heads,
    # `block[b, h, t, j, l]` within a head, `diagonal[b, h, t, j]` unit by unit.
    cross, numerator = None, 0.0

    def add(total, term):
        return term if total is None else total + term

    # The value weights' own noise (independent units; the same draw at every position).
    second_hat = ops.square(m_hat)
    if r_y is not None:
        second_hat = second_hat + ops.einsum("bhts,bsc->bhtc", ops.square(a), r_y)
    coupled = m_hat * ops.sum(m_hat, axis=2, keepdims=True)
    if s_hat is not None:
        second_hat = second_hat + ops.square(s_hat)
        coupled = coupled + s_hat * ops.sum(s_hat, axis=2, keepdims=True)
    diagonal = ops.einsum("bhtc,chj->bhtj", second_hat, vv)
    value_numerator = ops.einsum("bhtc,chj->bhtj", coupled, vv)
    if vbv is not None:
        diagonal = diagonal + vbv[:, None, :]
        value_numerator = value_numerator + positions * vbv[:, None, :]
    numerator = numerator + ops.einsum("bhtj,hje->bte", value_numerator, ops.square(wo))

    # The query weights' noise: o_t moves by K_t dq_t, dq_t = x_t dW_q + db_q.
    second_x = ops.square(mean_x) if var_x is None else ops.square(mean_x) + var_x
    query_noise = ops.einsum("btc,chi->bhti", second_x, vq)
    if vbq is not None:
        query_noise = query_noise + vbq[:, None, :]
    block = ops.einsum("bhtji,bhtli->bhtjl", k_tilde * ops.expand_dims(query_noise, -2), k_tilde)
    # (the same draw at every position: the head units' covariance with their sums over
    # positions, `coupled[b, h, t, j, l] = Cov(o_t[j], sum_t' o_t'[l])`, read out below)
    k_total = ops.einsum("bhtli,btc->bhlic", k_tilde, mean_x) * ops.expand_dims(ops.transpose(vq, (1, 2, 0)), 1)
    coupled = ops.einsum("bhtji,bhtli->bhtjl", k_tilde, ops.einsum("btc,bhlic->bhtli", mean_x, k_total))
    if vbq is not None:
        coupled = coupled + ops.einsum("bhtji,bhli->bhtjl", k_tilde, ops.sum(k_tilde, axis=2) * vbq[:, None, :])

    # The key weights' noise: o_t moves by sum_s g_ts q_t . (y_s dW_k) / sqrt(d).
    g_mean = _value_weighted(a, v, mean_y) - ops.expand_dims(o, -1) * ops.expand_dims(m_hat, -2)
    key_noise = ops.einsum("chi,bhti->bhtc", vk, ops.square(q)) * scale ** 2
    block = block + ops.einsum("bhtjc,bhtlc->bhtjl", g_mean * ops.expand_dims(key_noise, -2), g_mean)
    g_total = ops.einsum("bhti,bhtlc->bhlci", q, g_mean) * ops.expand_dims(ops.transpose(vk, (1, 0, 2)), 1)
    coupled = coupled + ops.einsum("bhtjc,bhtlc->bhtjl", g_mean,
                                   ops.einsum("bhti,bhlci->bhtlc", q, g_total)) * scale ** 2
    numerator = numerator + _through_both(coupled, wo)

    # The inputs' independent parts: unit (s, c) reaches o_t with J_ts = [t = s] P_t + E_ts,
    # E_ts[j, c] = a_ts ((v_s[j] - o_t[j]) w_t[c] + W_v[c, j]).
    if r_y is not None:
        # (einsums, not broadcasting products: TensorFlow broadcasts at most five axes)
        aa = ops.einsum("bhts,bgts->bhgts", a, a)
        weighted = aa * ops.einsum("bhgtc,bsc->bhgts", ops.einsum("bhtc,bgtc->bhgtc", w, w), r_y)
        v_h = ops.einsum("bhgts,bhsj->bhgtj", weighted, v)
        v_g = ops.einsum("bhgts,bgsl->bhgtl", weighted, v)
        cross = add(cross, ops.einsum("bhgts,bhgsjl->bhgtjl", weighted, ops.einsum("bhsj,bgsl->bhgsjl", v, v))
                    - ops.einsum("bhtj,bhgtl->bhgtjl", o, v_g) - ops.einsum("bhgtj,bgtl->bhgtjl", v_h, o)
                    + ops.einsum("bhtj,bgtl,bhgt->bhgtjl", o, o, ops.sum(weighted, axis=-1)))
        # the key side meets the value side: sum_s aa_ts (v_s - o_t)[j] X_ts[l], with
        # X_ts[l] = sum_c w_t[c] r_s[c] W_v[c, l] (contracted in this order: 5x faster)
        x_kv = ops.einsum("bhtsc,cgl->bhgtsl", ops.einsum("bhtc,bsc->bhtsc", w, r_y), wv)
        u = ops.einsum("bhgts,bhsj->bhgtsj", aa, v) - ops.einsum("bhgts,bhtj->bhgtsj", aa, o)
        mixed = ops.einsum("bhgtsj,bhgtsl->bhgtjl", u, x_kv)
        z = ops.einsum("bhgts,bsc->bhgtc", aa, r_y)
        cross = cross + mixed + _swap(mixed) + ops.einsum("bhgtc,hgjlc->bhgtjl", z, ops.einsum("chj,cgl->hgjlc", wv, wv))
    if r_x is not None:
        cross = add(cross, ops.einsum("bhtjc,bgtlc->bhgtjl", p * r_x[:, None, :, None, :], p))
    if self_attention and r_x is not None:  # the query side meets the others at s = t
        a_tt = ops.diagonal(a, axis1=-2, axis2=-1)[..., None, None]  # (b, h, t, 1, 1)
        e_tt = a_tt * (ops.expand_dims(v - o, -1) * ops.expand_dims(w, -2)
                       + ops.transpose(wv, (1, 2, 0))[None, :, None])
        mixed = ops.einsum("bhtjc,bgtlc->bhgtjl", p * r_x[:, None, :, None, :], e_tt)
        cross = cross + mixed + _swap(mixed)

    # ... their sums over the query positions, for the outputs' shared components:
    # Cov(out_t, sum_t' out_t') = sum_{s, c} G_ts G_bar_s r_s, G = W_o^T J, G_bar_s = sum_t G_ts.
    v_out, o_out = through(v, "bhsj,hje->bhse"), through(o, "bhtj,hje->bhte")
    p_out = None if r_x is None else through(p, "bhtjc,hje->btec")
    if r_y is not None:
        a_sum = ops.sum(a, axis=2)
        j_bar = (ops.expand_dims(v, -1) * ops.expand_dims(ops.einsum("bhts,bhtc->bhsc", a, w), -2)
                 - ops.einsum("bhts,bhtjc->bhsjc", a, ops.einsum("bhtj,bhtc->bhtjc", o, w))
                 + ops.einsum("bhs,chj->bhsjc", a_sum, wv))
        g_bar = through(j_bar, "bhsjc,hje->bsec")
        if self_attention and r_x is not None:
            g_bar = g_bar + p_out
        weighted_bar = g_bar * r_y[:, :, None, :]  # (b, s, C_out, C)
        z_bar = ops.einsum("bhtc,bsec->bhtse", w, weighted_bar)
        g_out = ops.expand_dims(a, -1) * (ops.expand_dims(v_out, 2) - ops.expand_dims(o_out, 3))  # (b, h, t, s, e)
        numerator = numerator + (ops.sum(g_out * z_bar, axis=(1, 3))
                                 + ops.einsum("bhts,bhse->bte", a, ops.einsum(
                                     "hce,bsec->bhse", ops.einsum("chj,hje->hce", wv, wo), weighted_bar)))
        if self_attention and r_x is not None:
            numerator = numerator + ops.sum(p_out * weighted_bar, axis=-1)
    if r_x is not None and not (self_attention and r_y is not None):
        numerator = numerator + ops.einsum("btec,btc->bte", ops.square(p_out), r_x)

    # The inputs' shared components: loads L_t[j, c] on each input channel's factor.
    loads = []
    if shared_x is not None:
        loads.append(p * shared_x[:, None, :, None, :])
    if shared_y is not None:
        g_shared = (_value_weighted(a, v, shared_y)
                    - ops.expand_dims(o, -1) * ops.expand_dims(s_hat, -2))
        kv = ops.expand_dims(w, -2) * g_shared + ops.einsum("chj,bhtc->bhtjc", wv, s_hat)
        if self_attention and loads:
            loads[0] = loads[0] + kv
        else:
            loads.append(kv)
    for load in loads:
        cross = add(cross, ops.einsum("bhtjc,bgtlc->bhgtjl", load, load))
        load_out = through(load, "bhtjc,hje->btec")
        numerator = numerator + ops.sum(load_out * ops.sum(load_out, axis=1, keepdims=True), axis=-1)

    # The output projection: out_t = o_t W_o + b_o, its own noise included.
    variance = (_through_both(block, wo)
                + ops.einsum("bhtj,hje->bte", diagonal, ops.square(wo)))
    variance_o = diagonal + ops.diagonal(block, axis1=-2, axis2=-1)
    if cross is not None:
        variance = variance + ops.einsum("bhgtjl,hje,gle->bte", cross, wo, wo)
        variance_o = variance_o + ops.transpose(
            ops.diagonal(ops.diagonal(cross, axis1=1, axis2=2), axis1=2, axis2=3), (0, 2, 1, 3))
    mean = ops.sum(o_out, axis=1)
    variance = variance + ops.einsum("bhtj,hje->bte", ops.square(o) + variance_o, vo)
    o_sum = ops.sum(o, axis=2, keepdims=True)
    numerator = numerator + ops.einsum("bhtj,hje->bte", o * o_sum, vo)
    if bo is not None:
        mean = mean + bo
    if vbo is not None:
        variance = variance + vbo
        numerator = numerator + positions * vbo
    return mean, variance, _matched_shared(variance, numerator)
