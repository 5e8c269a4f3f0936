"""Factorised-to-global networks (Ober & Aitchison 2021, "fac -> gi"): `InducingInputs` before
a factorised body, a global inducing output layer over it. Sampled bodies (`DenseMCVI`) carry
the inducing inputs through the same weight draws as the data (checked by interpolation); a
DVI body feeds `GlobalInducingDenseDVI`, whose closed-form output moments and KL are checked
against Monte Carlo and NumPy."""

import math

import keras
import numpy as np
import pytest
from keras import ops

import keras_dvi as kd
from keras_dvi import inducing
from tests.conftest import reloaded
from tests.test_global_inducing import _numpy_posterior


def _fac(num_train):
    return kd.GaussianPriorRegularizer(num_train, per_fan_in=True, kl_weight=1.0)


def test_sampled_body_shares_each_draw_with_the_inducing_inputs():
    """With huge precisions the output layer's posterior interpolates its pseudo-outputs at the
    inducing points' features; feeding the inducing inputs as data reproduces `V` for every
    weight draw of the body only if the inducing rows went through the same draw."""
    x = np.linspace(-1.5, 1.5, 5)[:, None]
    pseudo = np.random.default_rng(0).standard_normal((5, 1))
    model = keras.Sequential([
        keras.Input((1,), dtype="float64"),
        kd.InducingInputs(5, dtype="float64"),
        kd.DenseMCVI(16, "relu", num_samples=3, regularizer=_fac(50), dtype="float64", seed=1),
        kd.GlobalInducingDense(1, output_layer=True, num_inducing=5, regularizer=kd.NealPrior(50),
                               initial_log_precision=30.0, dtype="float64", seed=2),
    ])
    model.layers[0].inducing_inputs.assign(x)
    model.layers[-1].pseudo_outputs.assign(pseudo)
    out = model.predict(x, verbose=0)  # (5, 3, 1)
    assert out.shape == (5, 3, 1)
    np.testing.assert_allclose(out, np.broadcast_to(pseudo[:, None], out.shape), atol=1e-4)
    other = model.predict(x + 0.3, verbose=0)  # away from the inducing inputs: no interpolation
    assert np.abs(other - pseudo[:, None]).max() > 0.1


def _moment_problem(seed, per_unit, full):
    rng = np.random.default_rng(seed)
    phi = np.concatenate([rng.standard_normal((6, 3)), np.ones((6, 1))], axis=1)
    precision = np.exp(rng.uniform(-1, 1, (6, 2) if per_unit else (6,)))
    covs, means = _numpy_posterior(phi, precision, rng.standard_normal((6, 2)), 2.0)
    m = rng.standard_normal((4, 3))
    if full:
        a = rng.standard_normal((4, 3, 3)) * 0.4
        second = a @ a.transpose(0, 2, 1) + 0.05 * np.eye(3)
    else:
        second = rng.uniform(0.05, 0.5, (4, 3))
    return covs, means, m, second


@pytest.mark.parametrize("per_unit", [False, True])
@pytest.mark.parametrize("full", [False, True])
def test_closed_form_output_moments_match_monte_carlo(per_unit, full):
    """`linear_output_moments` against draws of `W ~ N(M_w, Sigma_u)` per unit and of the input
    `x ~ N(m, C)`: means within 5 standard errors, covariances within 5 of theirs."""
    covs, means, m, second = _moment_problem(1, per_unit, full)
    chol = np.linalg.cholesky(np.linalg.inv(covs))  # factors of A per unit
    got_mean, got_cov = inducing.linear_output_moments(
        ops.convert_to_tensor(chol if per_unit else chol[0]), ops.convert_to_tensor(means),
        ops.convert_to_tensor(m), ops.convert_to_tensor(second))
    got_mean, got_cov = ops.convert_to_numpy(got_mean), ops.convert_to_numpy(got_cov)
    n = 200_000
    rng = np.random.default_rng(2)
    w = means[None] + np.stack([rng.multivariate_normal(np.zeros(4), covs[u], n) for u in range(2)], axis=-1)
    cov_x = second if full else np.stack([np.diag(v) for v in second])
    for b in range(4):
        xs = rng.multivariate_normal(m[b], cov_x[b], n)
        f = np.einsum("np,npu->nu", np.concatenate([xs, np.ones((n, 1))], axis=1), w)
        assert np.all(np.abs(f.mean(axis=0) - got_mean[b]) < 5 * f.std(axis=0) / math.sqrt(n))
        centred = f - f.mean(axis=0)
        products = centred[:, :, None] * centred[:, None, :]
        se = products.std(axis=0) / math.sqrt(n)
        assert np.all(np.abs(products.mean(axis=0) - got_cov[b]) < 5 * se + 1e-12)


def _dvi_model(num_train, m, units=1, precision="shared", head=()):
    prior = kd.EmpiricalBayesRegularizer(num_train, kl_weight=1.0)
    return keras.Sequential([
        keras.Input((2,)),
        kd.InducingInputs(m),
        kd.DenseDiagDVI(8, "relu", regularizer=prior),
        kd.GlobalInducingDenseDVI(units, num_inducing=m, regularizer=kd.NealPrior(num_train), precision=precision),
        *head,
    ])


def test_dvi_head_is_regression_on_the_body_mean_features():
    """The head's outputs and KL against NumPy: its posterior from the body's means at the
    inducing rows (eq. 11), the data rows' moments by the law of total covariance, the KL in
    closed form."""
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")
    rng = np.random.default_rng(3)
    model = _dvi_model(40, 5, units=2, precision="per_unit")
    head = model.layers[-1]
    model.layers[0].inducing_inputs.assign(rng.standard_normal((5, 2)))
    head.pseudo_outputs.assign(rng.standard_normal((5, 2)))
    head.scaled_log_precision.assign(rng.uniform(-1, 1, (5, 2)))
    x = rng.standard_normal((7, 2))
    body = keras.Model(model.inputs[0], model.layers[1].output)
    moments = ops.convert_to_numpy(body(x))  # (5 + 7, 2, 8): inducing rows first
    mean, var = moments[:, 0], moments[:, 1]
    phi = np.concatenate([mean[:5], np.ones((5, 1))], axis=1)
    precision = np.exp(ops.convert_to_numpy(head.log_precision))
    covs, means = _numpy_posterior(phi, precision, ops.convert_to_numpy(head.pseudo_outputs), 8.0)
    out = ops.convert_to_numpy(model(x))  # (7, 3, 2)
    m_tilde = np.concatenate([mean[5:], np.ones((7, 1))], axis=1)
    np.testing.assert_allclose(out[:, 0], m_tilde @ means, rtol=1e-9, atol=1e-12)
    c_tilde = np.zeros((7, 9, 9))
    c_tilde[:, np.arange(8), np.arange(8)] = var[5:]
    expected = np.einsum("iu,bij,jv->buv", means, c_tilde, means)
    for u in range(2):
        expected[:, u, u] += np.einsum("bi,ij,bj->b", m_tilde, covs[u], m_tilde) + np.einsum("ij,bji->b", covs[u], c_tilde)
    np.testing.assert_allclose(out[:, 1:], expected, rtol=1e-9, atol=1e-12)
    kl = sum(0.5 * (8.0 * (np.trace(covs[u]) + means[:, u] @ means[:, u]) - 9 - 9 * math.log(8.0)
                    - np.linalg.slogdet(covs[u])[1]) for u in range(2))
    np.testing.assert_allclose(float(ops.convert_to_numpy(head.losses[-1])), kl / 40, rtol=1e-9)


def test_both_networks_train_initialise_save_and_load(tmp_path):
    rng = np.random.default_rng(4)
    x = rng.standard_normal((64, 2)).astype("float32")
    y = np.sin(x[:, :1]).astype("float32")
    keras.utils.set_random_seed(0)
    fac = keras.Sequential([
        keras.Input((2,)), kd.InducingInputs(16),
        kd.DenseMCVI(8, "relu", num_samples=2, regularizer=_fac(64), seed=1),
        kd.GlobalInducingDense(1, output_layer=True, num_inducing=16, regularizer=kd.NealPrior(64), seed=2),
        kd.SampledHomoscedasticNoise(),
    ])
    fac.compile(keras.optimizers.Adam(1e-2), loss=kd.SampledHeteroscedasticELL())
    dvi = _dvi_model(64, 16, head=[kd.HomoscedasticNoise()])
    dvi.compile(keras.optimizers.Adam(1e-2), loss=kd.HeteroscedasticELL())
    for model in (fac, dvi):
        kd.initialize_from_data(model, x, y, seed=0)
        u0 = ops.convert_to_numpy(model.layers[0].inducing_inputs)
        rows = [int(np.flatnonzero((x == row).all(axis=1))[0]) for row in u0]  # U0 are training inputs
        np.testing.assert_allclose(ops.convert_to_numpy(model.layers[-2].pseudo_outputs), y[rows])
        history = model.fit(x, y, epochs=60, batch_size=64, verbose=0).history  # full batches: M + N rows
        assert np.isfinite(history["loss"]).all()
        assert np.mean(history["nll"][-5:]) < np.mean(history["nll"][:5])  # (the loss rises as the KL warms up)
        loaded = reloaded(model, tmp_path, model.layers[2].name)
        for a, b in zip(model.weights, loaded.weights):
            np.testing.assert_array_equal(ops.convert_to_numpy(a), ops.convert_to_numpy(b))
        for m in (model, loaded):
            kd.set_sampling_seed(m, 5)
        np.testing.assert_array_equal(model.predict(x, verbose=0), loaded.predict(x, verbose=0))
    out = kd.predict(dvi, x)  # the closed-form output moments of one pass (no weight samples)
    expected = kd.predictive.regression_moments(dvi.predict(x, verbose=0))
    for key in ("mean", "epistemic", "aleatoric"):
        np.testing.assert_allclose(out[key], ops.convert_to_numpy(expected[key]), rtol=1e-5)
    assert out["mean"].shape == (64, 1) and out["epistemic"].min() > 0


def test_misuse_is_refused():
    with pytest.raises(ValueError, match="local_reparameterization"):
        h = kd.DenseMCVI(4, num_samples=2, local_reparameterization=True, regularizer=_fac(10))(
            kd.InducingInputs(3)(keras.Input((2,))))
        kd.GlobalInducingDense(1, output_layer=True, num_inducing=3, regularizer=kd.NealPrior(10))(h)
    with pytest.raises(ValueError, match="activation"):
        kd.GlobalInducingDenseDVI(1, activation="relu")
    with pytest.raises(ValueError, match="closed form"):
        kd.GlobalInducingDenseDVI(1, num_inducing=3, regularizer=kd.ScalePrior(10))
    h = kd.DenseDiagDVI(4, regularizer=_fac(10))(kd.InducingInputs(3)(keras.Input((2,))))
    with pytest.raises(ValueError, match="num_inducing"):
        kd.GlobalInducingDenseDVI(1, regularizer=kd.NealPrior(10))(h)
    with pytest.raises(ValueError, match="num_inducing"):
        kd.InducingInputs(0)
