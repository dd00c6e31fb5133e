"""Checks every output layer must pass, shared by the per-method test files.

`make(**kw)` builds a layer with vocab_size=V; the helpers init it on random hidden
states [B, L, E] and check the DESIGN.md contract: normalized `log_prob`, `loss` zero
(value and gradient) on padding, out-of-vocabulary targets rejected, and, for exact
methods, loss == -log_prob[target].
"""

from __future__ import annotations

import functools

import hpnlp  # noqa: F401  (its XLA flags before RNGS below starts JAX's backend)
import jax
import jax.numpy as jnp
import numpy as np
import pytest

V, E, B, L = 37, 16, 3, 5


def inputs(seed: int = 0, vocab: int = V, width: int = E):
    h = jax.random.normal(jax.random.key(seed), (B, L, width))
    t = jax.random.randint(jax.random.key(seed + 1), (B, L), 0, vocab)
    return h, t


RNGS = {"params": jax.random.key(2), "dropout": jax.random.key(3)}


@functools.partial(jax.jit, static_argnums=0)
def _init(layer, rngs, h, t):
    return layer.init(rngs, h, t, None, method="loss", deterministic=False)


def init(layer, h, t):
    """Params created through `loss` (so every parameter a training run uses exists)."""
    # jitted: one compile instead of one per eager op (most of a tiny test's time), and one
    # per layer: the checks below each init the same layer on the same shapes
    try:
        hash(layer)
    except TypeError:  # a layer holding an array (the tree's counts): compiled per call
        return jax.jit(functools.partial(_init.__wrapped__, layer))(RNGS, h, t)
    return _init(layer, RNGS, h, t)


def check_normalized(layer, *, vocab: int = V, atol: float = 1e-5):
    h, t = inputs(vocab=vocab)
    params = init(layer, h, t)
    # the checks' passes jitted: one compile each, not one per eager op
    logp, (vals, idx) = jax.jit(lambda p, h: (layer.apply(p, h, method="log_prob"),
                                              layer.apply(p, h, 3, method="top_k")))(params, h)
    assert logp.shape == (B, L, vocab) and logp.dtype == jnp.float32
    np.testing.assert_allclose(jnp.exp(logp).sum(-1), 1.0, atol=atol)
    assert idx.shape == (B, L, 3)
    np.testing.assert_array_equal(idx[..., 0], jnp.argmax(logp, -1))
    return params, logp


def check_exact_loss(layer, *, vocab: int = V, atol: float = 1e-5):
    """Training loss is -log p(target) under `log_prob`."""
    h, t = inputs(vocab=vocab)
    params = init(layer, h, t)
    logp, loss = jax.jit(lambda p, h, t: (
        layer.apply(p, h, method="log_prob"),
        layer.apply(p, h, t, None, method="loss", rngs={"dropout": jax.random.key(4)})))(
        params, h, t)
    nll = -jnp.take_along_axis(logp, t[..., None], -1)[..., 0]
    np.testing.assert_allclose(loss, nll, atol=atol, rtol=atol)


def check_padding(layer, *, vocab: int = V, deterministic: bool = False):
    """Masked tokens: zero loss and no gradient reaching their hidden states."""
    h, t = inputs(vocab=vocab)
    params = init(layer, h, t)
    mask = jnp.asarray([[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1]], bool)

    def total(h):
        loss = layer.apply(params, h, t, mask, method="loss", deterministic=deterministic,
                           rngs={"dropout": jax.random.key(4)})
        return jnp.sum(loss), loss

    (_, loss), g = jax.jit(jax.value_and_grad(total, has_aux=True))(h)
    assert loss.shape == (B, L)
    assert float(jnp.abs(jnp.where(mask, 0.0, loss)).max()) == 0.0
    assert float(jnp.abs(jnp.where(mask[..., None], 0.0, g)).max()) == 0.0
    assert bool(jnp.all(jnp.isfinite(loss)))


def check_rejects_out_of_vocab(layer, *, vocab: int = V):
    h, t = inputs(vocab=vocab)
    params = init(layer, h, t)
    bad = t.at[0, 0].set(vocab)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        layer.apply(params, h, bad, None, method="loss", rngs={"dropout": jax.random.key(4)})
    # found by the crash hunt: targets or a mask of another shape than the hidden states'
    # failed inside a broadcast or a reshape (or a sampled layer took flat targets)
    for bad_t, mask, match in [(t[:, :2], None, r"targets have shape \(3, 2\), but hidden"),
                               (t.reshape(-1), None, r"targets have shape \(15,\)"),
                               (t, jnp.ones((B, 2), bool), r"mask has shape \(3, 2\)")]:
        with pytest.raises(ValueError, match=match):
            layer.apply(params, h, bad_t, mask, method="loss", rngs={"dropout": jax.random.key(4)})


def check_eval_chunks(layer, monkeypatch, *, vocab: int = V, atol: float = 1e-5,
                      params=None):
    """`softmax.nll_and_argmax` (what LM evaluation reads) walks token chunks, and equals
    -log_prob[target] and the argmax of `log_prob`: the automatic chunk is forced to 4
    tokens (1 of each of the B=3 rows a chunk: 5 chunks). A holder's `out` is the layer.
    `params`: these instead of the layer's own init (a served or factored table)."""
    import hpnlp.softmax as S
    from hpnlp.softmax import base, full
    h, t = inputs(vocab=vocab)
    params = init(layer, h, t) if params is None else params
    monkeypatch.setattr(full, "CHUNK_LOGITS_BYTES", 4 * vocab * 4)
    chunks = []

    def spy(fn, lead, chunk, *arrays, **kw):
        chunks.append(chunk)
        return real(fn, lead, chunk, *arrays, **kw)
    real = base.map_token_chunks
    monkeypatch.setattr(base, "map_token_chunks", spy)
    read = lambda m, h, t: S.nll_and_argmax(getattr(m, "out", m), h, t)  # noqa: E731
    logp, (nll, top) = jax.jit(lambda p, h, t: (layer.apply(p, h, method="log_prob"),
                                                layer.apply(p, h, t, method=read)))(params, h, t)
    assert chunks == [4], chunks
    assert nll.shape == top.shape == (B, L) and top.dtype == jnp.int32
    np.testing.assert_allclose(nll, -jnp.take_along_axis(logp, t[..., None], -1)[..., 0],
                               atol=atol, rtol=atol)
    np.testing.assert_array_equal(top, jnp.argmax(logp, -1))


def check_half_precision(layer, *, dtype=jnp.bfloat16, vocab: int = V, exact: bool = True):
    """In 16-bit compute (`dtype`, hidden states in it as a trunk hands them over), log_prob
    and loss stay float32 (DESIGN.md's dtype policy), log_prob normalized, padding without
    loss or gradient, and loss, log_prob and gradients equal the float32 layer's to `dtype`'s
    rounding (review r9: no output layer's 16-bit path but `sampled`'s bfloat16 ran).

    One compiled program runs both layers: forward and backward, float32 and `dtype`.
    `exact`: the loss is -log_prob[target] (not a sampled objective)."""
    h, t = inputs(vocab=vocab)
    params = init(layer, h, t)  # float32 parameters, as a 16-bit run keeps them
    half = layer.clone(dtype=dtype)
    mask = jnp.asarray([[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1]], bool)
    weight_BL = jnp.linspace(0.5, 1.5, B * L).reshape(B, L)  # a non-uniform cotangent

    def run(m, params, h):
        def total(p, h):
            loss = m.apply(p, h, t, mask, method="loss", rngs={"dropout": jax.random.key(4)})
            return jnp.sum(loss * weight_BL), loss
        (_, loss), grads = jax.value_and_grad(total, argnums=(0, 1), has_aux=True)(params, h)
        return m.apply(params, h, method="log_prob"), loss, grads

    (logp32, loss32, g32), (logp, loss, g) = jax.jit(lambda p, h: (
        run(layer, p, h), run(half, p, h.astype(dtype))))(params, h)
    assert logp.dtype == loss.dtype == jnp.float32, (logp.dtype, loss.dtype)
    assert g[1].dtype == dtype  # the hidden states' gradient in the dtype they came in
    np.testing.assert_allclose(jnp.exp(logp).sum(-1), 1.0, atol=1e-5)
    assert float(jnp.abs(jnp.where(mask, 0.0, loss)).max()) == 0.0
    assert float(jnp.abs(jnp.where(mask[..., None], 0.0, g[1].astype(jnp.float32))).max()) == 0.0
    if exact:
        nll = -jnp.take_along_axis(logp, t[..., None], -1)[..., 0]
        np.testing.assert_allclose(loss, jnp.where(mask, nll, 0.0), rtol=1e-4, atol=1e-4)

    def close(a, b):  # entries near zero held relative to the array's largest: every layer's
        # bfloat16 differences measured at most 5.4e-3 of it (float16 rounds 8 times finer)
        a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
        np.testing.assert_allclose(a, b, rtol=1e-2, atol=1e-2 * float(jnp.abs(b).max()))
    close(logp, logp32)
    close(loss, loss32)
    jax.tree.map(close, g, g32)
