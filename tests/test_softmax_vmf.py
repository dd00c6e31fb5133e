"""vMF output layer: log I_v against SciPy (values, gradients), the loss against a float64
reference, the shared contract through a tied embedding, decoding by nearest embedding."""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import softmax_testlib as lib

import hpnlp.models.transformer as T
import hpnlp.softmax as S
import hpnlp.softmax.vmf as M
from hpnlp.compress.qlinear import pack_weight
from hpnlp.config import ModelConfig, QuantConfig

special = pytest.importorskip("scipy.special")
mpmath = pytest.importorskip("mpmath")

V, E = lib.V, lib.E  # 37, 16: embedding width 16, Bessel order 7 (series + recurrence)
ORDERS = [0.0, 0.5, 1.0, 15.0, 63.0, 255.0, 511.0]
XS = np.logspace(-3, 5, 33)


def reference(v, xs):
    """float64 (log I_v(x), I_{v+1}(x)/I_v(x)) from scipy's ive; mpmath where ive underflows."""
    log_iv, ratio = np.empty_like(xs), np.empty_like(xs)
    for i, x in enumerate(xs):
        a, b = special.ive(v, x), special.ive(v + 1, x)
        if a > 1e-290 and b > 1e-290:
            log_iv[i], ratio[i] = np.log(a) + x, b / a
        else:
            a, b = mpmath.besseli(v, x), mpmath.besseli(v + 1, x)
            log_iv[i], ratio[i] = float(mpmath.log(a)), float(b / a)
    return log_iv, ratio


def _ours(v, x):
    values_and_grads = jax.jit(jax.vmap(jax.value_and_grad(lambda x: M.log_bessel_iv(v, x))))
    return [np.asarray(a) for a in (*values_and_grads(x), M.bessel_ratio(v, x))]


@pytest.mark.parametrize("v", ORDERS)
def test_log_bessel_iv_matches_scipy(v):
    want, want_ratio = reference(v, XS)
    got, grad, ratio = _ours(v, jnp.asarray(XS, jnp.float32))
    np.testing.assert_allclose(got, want, rtol=1e-5)
    np.testing.assert_allclose(ratio, want_ratio, rtol=1e-5)
    np.testing.assert_allclose(grad, want_ratio + v / XS, rtol=1e-5)  # d/dx log I_v = I_{v+1}/I_v + v/x


# 2.8 s in the fast suite on the Xeon model 167 stepping 1 (2026-12-06, session 109, --durations:
# the suite read 6 min 12 s for 1775 tests in CI): CI's slow part runs it
@pytest.mark.slow
def test_log_bessel_iv_float64_is_tight():
    """In float64 the expansions themselves are checked, not float32 rounding."""
    with jax.enable_x64(True):
        for v in (0.5, 7.5, 511.0):  # series + recurrence, Debye
            want, want_ratio = reference(v, XS)
            got, grad, _ = _ours(v, jnp.asarray(XS, jnp.float64))
            np.testing.assert_allclose(got, want, rtol=1e-9)
            np.testing.assert_allclose(grad, want_ratio + v / XS, rtol=1e-9)


def test_vmf_normalizer():
    m = 64
    kappa = jnp.asarray([1e-6, 1e-3, 1.0, 30.0, 1e3, 1e5], jnp.float32)
    log_c, grad = jax.vmap(jax.value_and_grad(lambda k: M.log_vmf_normalizer(m, k)))(kappa)
    log_iv, ratio = reference(m / 2 - 1, np.asarray(kappa, np.float64))
    want = (m / 2 - 1) * np.log(np.asarray(kappa, np.float64)) - m / 2 * np.log(2 * np.pi) - log_iv
    np.testing.assert_allclose(log_c, want, rtol=1e-5)
    np.testing.assert_allclose(grad, -ratio, rtol=1e-5)
    # κ -> 0: the uniform density on the sphere, 1 / area = Γ(m/2) / (2 π^(m/2))
    np.testing.assert_allclose(log_c[0], math.lgamma(m / 2) - math.log(2) - m / 2 * math.log(math.pi),
                               rtol=1e-6)


class Tied(nn.Module):
    """An LM-like holder of the input embedding, passing it to the vMF layer (tied)."""

    width: int = E
    reg1: float = 0.0
    reg2: float = 1.0

    quant: QuantConfig = QuantConfig()

    def setup(self):
        self.embed = T.make_embed(ModelConfig(vocab_size=V, width=self.width, quant=self.quant),
                                  tied=True)
        self.out = S.get("vmf")(vocab_size=V, embed=self.embed, reg1=self.reg1, reg2=self.reg2)

    def loss(self, h, t, mask=None, *, deterministic=True):
        return self.out.loss(h, t, mask, deterministic=deterministic)

    def log_prob(self, h):
        return self.out.log_prob(h)

    def top_k(self, h, k):
        return self.out.top_k(h, k)


def test_contract(monkeypatch):
    layer = Tied(reg1=0.02, reg2=0.1)
    lib.check_normalized(layer)
    lib.check_padding(layer)
    lib.check_rejects_out_of_vocab(layer)
    lib.check_eval_chunks(layer, monkeypatch)  # review r2: evaluation read the whole [N, V]


def test_needs_tied_embedding():
    h, t = lib.inputs()
    with pytest.raises(ValueError, match="tie_embeddings=True"):
        lib.init(S.get("vmf")(vocab_size=V), h, t)


def _identity_params(layer, h, t):
    """Params with W = I, so that ê = h."""
    params = nn.unbox(jax.jit(lambda: lib.init(layer, h, t))())
    params["params"]["out"]["proj"]["kernel"] = jnp.eye(layer.width)
    return params


@pytest.mark.parametrize("width,reg1,reg2", [(E, 0.0, 1.0), (E, 0.02, 0.1), (64, 0.02, 1.0)])
def test_loss_matches_float64_reference(width, reg1, reg2):
    layer = Tied(width=width, reg1=reg1, reg2=reg2)
    h, t = lib.inputs(width=width)
    h = h * jnp.asarray([0.01, 1.0, 30.0])[:, None, None]  # κ over three scales
    params = nn.unbox(jax.jit(lambda: lib.init(layer, h, t))())

    def loss_fn(h):
        return layer.apply(params, h, t, None, method="loss")

    loss, vjp = jax.vjp(loss_fn, h)
    (grad,) = vjp(jnp.ones_like(loss))

    w = np.asarray(params["params"]["out"]["proj"]["kernel"], np.float64)
    table = np.asarray(params["params"]["embed"]["embedding"], np.float64)
    pred = np.asarray(h, np.float64) @ w
    target = table[np.asarray(t)]
    target /= np.linalg.norm(target, axis=-1, keepdims=True)
    kappa = np.linalg.norm(pred, axis=-1)
    v = width / 2 - 1
    log_iv, ratio = reference(v, kappa.ravel())
    log_c = v * np.log(kappa) - width / 2 * np.log(2 * np.pi) - log_iv.reshape(kappa.shape)
    want = -log_c - reg2 * np.sum(pred * target, -1) + reg1 * kappa
    np.testing.assert_allclose(loss, want, rtol=1e-5)
    # dloss/dê = (I_{v+1}/I_v + reg1) ê/κ - reg2 e(w), then through W
    d_pred = (ratio.reshape(kappa.shape) + reg1)[..., None] * pred / kappa[..., None] - reg2 * target
    np.testing.assert_allclose(grad, d_pred @ w.T, rtol=1e-4, atol=1e-5)


def test_targets_read_the_table_as_the_model_uses_it():
    """A bug hunt (session 102): vmf read the tied table's raw parameter, so QAT's targets
    were the float rows while the lookups read int8 ones, and an int8 export (packed [E, V])
    was refused as a table of E rows. Its targets are now `Embed.table()`'s rows."""
    layer = Tied(quant=QuantConfig(weights="int8", layers="output"))
    h, t = lib.inputs()
    params = nn.unbox(jax.jit(lambda: lib.init(layer, h, t))())
    table = params["params"]["embed"]["embedding"]
    quantized = layer.apply(params, method=lambda m: m.embed.table())
    assert float(jnp.abs(quantized - table).max()) > 0  # int8 rows differ from the floats
    np.testing.assert_array_equal(layer.apply(params, method=lambda m: m.out._table()),
                                  quantized)
    # the int8 export (ptq's packing: [E, V], contraction first) gives the QAT loss
    exported = jax.tree.map(lambda x: x, params)
    exported["params"]["embed"]["embedding"] = pack_weight(table.T, layer.quant, 1)
    np.testing.assert_allclose(layer.apply(exported, h, t, None, method="loss"),
                               layer.apply(params, h, t, None, method="loss"), rtol=1e-6)


def test_targets_are_stop_gradient_and_scale_free():
    layer = Tied()
    h, t = lib.inputs()
    params = nn.unbox(jax.jit(lambda: lib.init(layer, h, t))())
    grads = jax.grad(lambda p: layer.apply(p, h, t, None, method="loss").sum())(params)
    assert float(jnp.abs(grads["params"]["embed"]["embedding"]).max()) == 0.0
    assert float(jnp.abs(grads["params"]["out"]["proj"]["kernel"]).max()) > 0.0
    scaled = jax.tree.map(lambda x: x, params)
    scaled["params"]["embed"]["embedding"] = 3.0 * params["params"]["embed"]["embedding"]
    np.testing.assert_allclose(layer.apply(scaled, h, t, None, method="loss"),
                               layer.apply(params, h, t, None, method="loss"), rtol=1e-6)


def test_loss_falls_as_prediction_turns_to_target():
    layer = Tied()
    h, t = lib.inputs()
    params = _identity_params(layer, h, t)
    target = M.unit_rows(params["params"]["embed"]["embedding"][t])
    other = M.unit_rows(jax.random.normal(jax.random.key(5), target.shape))
    alphas = jnp.linspace(0.0, 1.0, 6)

    @jax.jit
    def loss_at(alpha):  # same κ = 5, direction from `other` to the target
        return layer.apply(params, 5.0 * M.unit_rows((1 - alpha) * other + alpha * target), t, None,
                           method="loss")

    losses = jnp.stack([loss_at(a) for a in alphas])
    assert bool(jnp.all(jnp.diff(losses, axis=0) < 0))


def test_decoding_returns_target_at_its_embedding():
    layer = Tied()
    h, t = lib.inputs()
    params = _identity_params(layer, h, t)
    ids = jnp.arange(V)
    unit = M.unit_rows(params["params"]["embed"]["embedding"])
    for kappa in (0.5, 20.0):
        _, top = layer.apply(params, kappa * unit, 3, method="top_k")
        np.testing.assert_array_equal(top[:, 0], ids)
        logp = layer.apply(params, kappa * unit, method="log_prob")
        np.testing.assert_allclose(jnp.exp(logp).sum(-1), 1.0, atol=1e-5)
