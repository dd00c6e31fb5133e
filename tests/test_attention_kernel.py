"""Kernel-feature attention (`performer`, `linear`): fast paths against their slow twin,
FAVOR+ approximation quality, the redraw stream, decoding, and the interface contracts.

Compiles dominate the run time, so tests share a few cached jitted functions (`_forward`,
`_with_stream`, `_grads`) and always pass a mask array (all ones = no padding)."""

import dataclasses
import functools

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hpnlp.attention as A
import hpnlp.attention.kernel as K
from hpnlp import models
from hpnlp.attention.dense import dense_attention
from hpnlp.config import AttentionConfig, ConfigError, ModelConfig, default_configdict, from_configdict
from hpnlp.train.step import step_compiler_options

from attention_testlib import assert_compiles_once

B, L, H, D = 2, 40, 2, 8
CHUNK = 16  # does not divide L: the padded last chunk is always exercised
VARIANTS = {"performer": {"num_features": 32, "chunk_size": CHUNK}, "linear": {"chunk_size": CHUNK}}
NO_PAD = jnp.ones((B, L), jnp.int32)


def _qkv(seed=0, dtype=jnp.float32, scale=1.0):
    ks = jax.random.split(jax.random.key(seed), 3)
    return tuple((scale * jax.random.normal(k, (B, L, H, D))).astype(dtype) for k in ks)


def _padding(lengths):
    return jnp.asarray((np.arange(L)[None, :] < np.asarray(lengths)[:, None]).astype(np.int32))


def _module(name, **kw):
    return A.get(name)(**{**VARIANTS[name], **kw})


@functools.partial(jax.jit, static_argnums=(0, 1))
def _forward(mod, causal, q, k, v, mask):
    """Unbound call (no `features` stream: the seed key). The module is a static argument, as
    a trainer's step holds it: each configuration compiles once however often it is rebuilt
    (`test_no_recompile_across_calls`)."""
    return mod(q, k, v, mask, causal=causal, deterministic=True)


def _run(name, q, k, v, mask, causal, **kw):
    return _forward(_module(name, **kw), causal, q, k, v, mask)


def _twin(name, q, k, v, mask, causal):
    """Same features, then the explicit masked [L, L] quadratic form."""
    valid = mask != 0
    phi_q, phi_k, shift = _module(name)._features(q, k, valid, causal)
    out = K.kernel_attention_reference(phi_q, phi_k, v, shift if causal else None, causal=causal)
    return jnp.where(valid[:, :, None, None], out, 0.0)


@functools.lru_cache(maxsize=None)
def _grads(name, causal):
    """One jit: (out, d/d(q, k, v)) of sum(sin(out) * weight) for the module and its twin."""

    def value_and_grads(fn):
        def loss(q, k, v, mask, weight_BL):
            out = fn(q, k, v, mask, causal)
            return jnp.sum(jnp.sin(out) * weight_BL[:, :, None, None]), out

        grad_fn = jax.value_and_grad(loss, (0, 1, 2), has_aux=True)

        def run(*args):
            (_, out), grads = grad_fn(*args)
            return out, grads

        return run

    fast = value_and_grads(lambda q, k, v, mask, causal: _module(name)(q, k, v, mask, causal=causal))
    slow = value_and_grads(functools.partial(_twin, name))
    return jax.jit(lambda *a: (fast(*a), slow(*a)))


def _favor_from_scratch(q, k, v, w, causal):
    """FAVOR+ exactly as the paper writes it, no stabilizer, no epsilon, in float64."""
    q, k, v, w = (np.asarray(x, np.float64) for x in (q, k, v, w))
    x, y = q / D ** 0.25, k / D ** 0.25
    phi = lambda z: np.exp(np.einsum("blhd,md->blhm", z, w) - 0.5 * (z ** 2).sum(-1, keepdims=True)) \
        / np.sqrt(w.shape[0])
    a = np.einsum("blhm,bshm->bhls", phi(x), phi(y)) * (np.tril(np.ones((L, L))) if causal else 1.0)
    return np.einsum("bhls,bshd->blhd", a, v) / a.sum(-1).transpose(0, 2, 1)[..., None]


def test_registered():
    assert {"performer", "linear"} <= set(A.names())
    assert A.get("performer").supports_causal and not A.get("performer").supports_segments
    assert A.get("linear").supports_causal and not A.get("linear").supports_segments


@pytest.mark.parametrize("name", sorted(VARIANTS))
@pytest.mark.parametrize("causal", [False, True])
def test_fast_path_matches_quadratic_twin(name, causal):
    """Chunked prefix sums (causal) and global sums (bidirectional) == phi(Q) phi(K)^T form,
    outputs and gradients, with random right padding and a length the chunk doesn't divide."""
    q, k, v = _qkv()
    mask = _padding([L, np.random.default_rng(0).integers(1, L)])
    (out, grads), (ref, grads_ref) = _grads(name, causal)(q, k, v, mask, mask)
    np.testing.assert_allclose(out, ref, atol=1e-5, rtol=1e-5)
    for a, b in zip(grads, grads_ref):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
def test_stabilizers_cancel(causal):
    """The stabilized module equals FAVOR+ as written in the paper (no stabilizer, no
    epsilon, float64) up to float32 rounding, and `linear` equals elu+1 attention written
    out directly."""
    q, k, v = _qkv(scale=0.7)
    w = _module("performer").projection(D)
    ref = _favor_from_scratch(q, k, v, w, causal)
    np.testing.assert_allclose(_run("performer", q, k, v, NO_PAD, causal), ref, atol=2e-5, rtol=1e-4)

    phi = lambda z: np.where(z > 0, z + 1, np.exp(np.minimum(z, 0)))
    qq, kk, vv = (np.asarray(x, np.float64) for x in (q, k, v))
    a = np.einsum("blhd,bshd->bhls", phi(qq), phi(kk)) * (np.tril(np.ones((L, L))) if causal else 1.0)
    ref = np.einsum("bhls,bshd->blhd", a, vv) / a.sum(-1).transpose(0, 2, 1)[..., None]
    np.testing.assert_allclose(_run("linear", q, k, v, NO_PAD, causal), ref, atol=1e-5, rtol=1e-5)


def test_causal_key_stabilizer_does_not_leak():
    """Huge future keys would underflow every earlier key under a global max stabilizer;
    the running max keeps earlier outputs bit-for-bit unchanged."""
    q, k, v = _qkv(scale=0.5)
    t = 20
    k_big = k.at[:, t + 1:].set(8.0 * jnp.abs(k[:, t + 1:]) + 8.0)
    a, b = _run("performer", q, k, v, NO_PAD, True), _run("performer", q, k_big, v, NO_PAD, True)
    chex.assert_tree_all_finite(b)
    np.testing.assert_array_equal(a[:, : t + 1], b[:, : t + 1])
    _, (ref, _) = _grads("performer", True)(q, k_big, v, NO_PAD, NO_PAD)
    np.testing.assert_allclose(b, ref, atol=1e-5)


def test_orthogonal_random_features():
    m, d = 4096, 16
    w = np.asarray(jax.jit(K.orthogonal_random_features, static_argnums=(1, 2))(jax.random.key(3), m, d),
                   np.float64)
    assert w.shape == (m, d)
    for start in (0, d, 2 * d):  # rows inside one block are exactly orthogonal
        gram = w[start:start + d] @ w[start:start + d].T
        np.testing.assert_allclose(gram - np.diag(np.diag(gram)), 0.0, atol=1e-4)
    # Row norms are chi(d) distributed, not all sqrt(d): mean ~ sqrt(d - 1/2), some spread.
    norms = np.linalg.norm(w, axis=1)
    assert abs(norms.mean() - np.sqrt(d - 0.5)) < 0.05 and norms.std() > 0.5


def test_positive_features_are_unbiased():
    """E_w[phi(q) . phi(k)] = exp(q.k / sqrt(D)): averaged over 64 draws the kernel estimate
    is within a few percent, although single small draws are far off."""
    x = 0.4 * jax.random.normal(jax.random.key(0), (6, D))
    y = 0.4 * jax.random.normal(jax.random.key(1), (6, D))
    exact = np.exp(np.asarray(x @ y.T) / np.sqrt(D))

    def estimate(key):
        w = K.orthogonal_random_features(key, 16, D)
        def phi(z):  # exp(w.z - |z|^2 / 2) / sqrt(m), z = input / D^(1/4), m = 16
            z = z / D ** 0.25
            return jnp.exp(z @ w.T - 0.5 * jnp.sum(z * z, -1, keepdims=True)) / 4.0

        return phi(x) @ phi(y).T

    draws = np.asarray(jax.jit(jax.vmap(estimate))(jax.random.split(jax.random.key(2), 64)))
    single_err = np.abs(draws / exact - 1).mean()
    mean_err = np.abs(draws.mean(0) / exact - 1).mean()
    assert mean_err < 0.03 and mean_err < 0.3 * single_err


def test_performer_error_falls_as_features_grow():
    """Mean |performer - softmax attention| over 8 draws, small-norm q, k (logits with std 0.25)."""
    q, k, v = _qkv(seed=5, scale=0.5)
    exact = dense_attention(q, k, v, None, causal=False)
    errs = []
    for m in (16, 64, 256, 1024):
        mod = A.get("performer")(num_features=m)
        f = jax.jit(jax.vmap(lambda key: mod.apply({}, q, k, v, None, causal=False, rngs={"features": key})))
        errs.append(float(jnp.abs(f(jax.random.split(jax.random.key(m), 8)) - exact[None]).mean()))
    # Each 4x in features should halve the error (the 1/sqrt(m) rate; measured ~1.75x).
    assert all(a > 1.4 * b for a, b in zip(errs, errs[1:])) and errs[0] > 4 * errs[-1], errs
    assert errs[-1] < 0.01, errs


@functools.partial(jax.jit, static_argnums=0)
def _with_stream(mod, q, k, v, mask, key):
    return mod.apply({}, q, k, v, mask, causal=True, rngs={"features": key})


def test_redraw_stream():
    q, k, v = _qkv()
    f = functools.partial(_with_stream, _module("performer"))
    a, a2, b = (f(q, k, v, NO_PAD, jax.random.key(s)) for s in (1, 1, 2))
    np.testing.assert_array_equal(a, a2)
    assert float(jnp.abs(a - b).max()) > 1e-3
    # Without the stream: the seed key. redraw=False ignores the stream and uses the seed.
    seeded = _run("performer", q, k, v, NO_PAD, True)
    assert float(jnp.abs(a - seeded).max()) > 1e-3
    fixed = functools.partial(_with_stream, _module("performer", redraw=False))
    for s in (1, 2):
        np.testing.assert_allclose(fixed(q, k, v, NO_PAD, jax.random.key(s)), seeded, atol=1e-6)
    assert float(jnp.abs(_run("performer", q, k, v, NO_PAD, True, seed=1) - seeded).max()) > 1e-3


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_recompute_keeps_gradients_and_drops_the_features(name):
    """`recompute` (the default) keeps only q, k, v and S for the backward pass. Through a
    stack of layers: the same loss and gradients as without it, and compiled temporaries
    that no longer hold every layer's phi(Q), phi(K) ([B, H, L, M] each). (Recompute's
    gradients against the quadratic twin, causal too: `test_fast_path_matches_quadratic_twin`.)"""
    Lm, M, layers = 512, 64, 4
    ks = jax.random.split(jax.random.key(3), 3)
    q, k, v = (jax.random.normal(kk, (1, Lm, H, D)) for kk in ks)
    mask = jnp.ones((1, Lm), jnp.int32)

    def grad_fn(recompute):
        mod = _module(name, recompute=recompute, **({"num_features": M} if name == "performer" else {}))

        def loss(q, k, v):
            for _ in range(layers):  # each layer's output feeds the next one's q, k and v
                out = mod(q, k, v, mask)
                q, k, v = q + out, k - out, v * jnp.cos(out)
            return jnp.sum(jnp.sin(out))

        return jax.value_and_grad(loss, (0, 1, 2))

    # As every hpnlp train step is compiled: on CPU, XLA's default pipeline would merge the
    # recomputation back into the forward pass (`train.step.step_compiler_options`). LLVM
    # effort off: these compiles are for values and buffer sizes, never speed.
    options = {**(step_compiler_options() or {}), "xla_backend_optimization_level": 0}

    def compiled(fn):
        return jax.jit(fn).lower(q, k, v).compile(compiler_options=options)

    fns = {r: compiled(grad_fn(r)) for r in (True, False)}
    (a, ga), (b, gb) = (fns[r](q, k, v) for r in (True, False))
    np.testing.assert_allclose(a, b, rtol=1e-5)
    for x, y in zip(ga, gb):
        np.testing.assert_allclose(x, y, atol=1e-5, rtol=1e-4)  # 4 layers of rounding
    temp = {r: fn.memory_analysis().temp_size_in_bytes for r, fn in fns.items()}
    features = 2 * H * Lm * (M if name == "performer" else D) * 4  # phi(Q) and phi(K), float32
    # Plain autodiff keeps every layer's; recompute holds one layer's during its backward.
    # (CPU: XLA:GPU fuses the elementwise feature maps into their consumers and keeps no
    # features to begin with, so there is nothing for recompute to drop.)
    if jax.default_backend() != "cpu":
        return
    assert temp[False] - temp[True] >= (layers - 2) * features, (temp, features)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_padding_invariance(name):
    q, k, v = _qkv()
    mask = _padding([20, 33])
    q2, k2, v2 = _qkv(seed=7, scale=3.0)
    pad = (mask == 0)[:, :, None, None]
    mix = lambda a, b: jnp.where(pad, b, a)
    for causal in (False, True):
        out1 = _run(name, q, k, v, mask, causal)
        out2 = _run(name, mix(q, q2), mix(k, k2), mix(v, v2), mask, causal)
        np.testing.assert_array_equal(jnp.where(pad, 0, out1), jnp.where(pad, 0, out2))


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_causality_by_gradient(name):
    q, k, v = _qkv()
    for t in (9, 16, 35):  # inside a chunk, at a chunk boundary, in the padded last chunk
        weight = jnp.zeros((B, L), jnp.int32).at[:, t].set(1)
        (_, (gq, gk, gv)), _ = _grads(name, True)(q, k, v, NO_PAD, weight)
        for g in (gq, gk, gv):
            assert float(jnp.abs(g[:, t + 1:]).max()) == 0.0
        assert float(jnp.abs(gk[:, :t]).max()) > 0.0 and float(jnp.abs(gv[:, :t]).max()) > 0.0


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_fully_masked_rows_are_zero_not_nan(name):
    q, k, v = _qkv()
    mask = _padding([0, 5])
    for causal in (False, True):
        (out, grads), _ = _grads(name, causal)(q, k, v, mask, NO_PAD)
        chex.assert_tree_all_finite((out, grads))
        assert float(jnp.abs(out[0]).max()) == 0.0


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_bfloat16_is_finite_and_close(name):
    q, k, v = _qkv(dtype=jnp.bfloat16)
    mask = _padding([L, 9])
    out = _run(name, q, k, v, mask, True)
    assert out.dtype == jnp.bfloat16
    chex.assert_tree_all_finite(out)
    ref = _run(name, *(x.astype(jnp.float32) for x in (q, k, v)), mask, True)
    np.testing.assert_allclose(out.astype(jnp.float32), ref, atol=5e-2)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_no_recompile_across_calls(name):
    """A module rebuilt per call (as from a config) is a static argument equal to the last:
    one program for all three calls, the one `test_padding_invariance` compiled; with a new
    `features` key each call too, the one `test_redraw_stream` compiled."""
    calls = [(*_qkv(seed), _padding([L, 3 + seed])) for seed in range(3)]
    assert_compiles_once(_forward, ((_module(name), True, *a) for a in calls))
    if name == "performer":
        assert_compiles_once(_with_stream, ((_module(name), *a, jax.random.key(seed))
                                            for seed, a in enumerate(calls)))


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_decode_matches_causal_forward(name):
    q, k, v = _qkv(scale=1.5)
    k = k.at[:, 30].multiply(4.0)  # a late jump in the Performer's running max
    attn = _module(name)
    cache = attn.init_cache(B, L, H, D, jnp.float32)
    step = jax.jit(attn.decode_step)
    outs = []
    for t in range(L):
        o, cache = step(cache, q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1])
        outs.append(o)
    assert int(cache["index"]) == L and cache["s"].shape[1:] == (H, attn._num_features(D), D)
    np.testing.assert_allclose(jnp.concatenate(outs, 1), _run(name, q, k, v, NO_PAD, True),
                               atol=1e-5, rtol=1e-5)


def test_bad_inputs_have_clear_errors():
    q, k, v = _qkv()
    for name in VARIANTS:
        mod = _module(name)
        with pytest.raises(ValueError, match="head dims differ"):
            mod(q, k[..., :4], v, None, causal=False)
        with pytest.raises(ValueError, match=r"\[batch, length, heads, head_dim\]"):
            mod(q[0], k[0], v[0], None, causal=False)
        with pytest.raises(ValueError, match="segment ids of shape"):
            mod(q, k, v, jnp.ones((B, L, L)), causal=False)
        with pytest.raises(ValueError, match="q and k lengths differ"):
            mod(q, k[:, :8], v[:, :8], None, causal=False)
        with pytest.raises(ValueError, match="chunk_size=0 must be a positive integer"):
            _module(name, chunk_size=0)(q, k, v, None, causal=True)
    with pytest.raises(ValueError, match="num_features=0 must be a positive integer"):
        _module("performer", num_features=0)(q, k, v, None, causal=False)
    cls = A.get("performer")
    for opts, field in (({"num_features": -1}, "num_features"), ({"chunk_size": 0}, "chunk_size"),
                        ({"redraw": "yes"}, "redraw"), ({"seed": 1.5}, "seed"),
                        ({"recompute": 1}, "recompute")):
        with pytest.raises(ConfigError, match=f"`attention.options.{field}` = .* is not allowed"):
            cls.check_config(opts, seq_len=64, causal=True)
    cls.check_config({"num_features": 64, "chunk_size": 48}, seq_len=100, causal=True)  # pads


def _cfg(kind, name, length):
    cfg = from_configdict(default_configdict())
    model = dict(kind=kind, vocab_size=40, num_classes=3, width=32, depth=1, num_heads=4,
                 mlp_dim=64, max_len=length, dropout=0.0)
    opts = {"chunk_size": 8, **({"num_features": 16} if name == "performer" else {})}
    return dataclasses.replace(cfg, model=ModelConfig(**model), attention=AttentionConfig(name, opts))


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_inside_the_model(name):
    """The causal LM builds with the variant, gives a finite loss and gradients (the
    `features` stream reaching the Performer), and decoding matches its forward pass."""
    n, length = 2, 12
    toks = np.random.default_rng(0).integers(0, 40, (n, length)).astype(np.int32)
    seg = (np.arange(length)[None] < np.array([[length], [7]])).astype(np.int32)
    batch = {"inputs": toks, "targets": np.roll(toks, -1, 1), "segment_ids": seg,
             "positions": np.broadcast_to(np.arange(length, dtype=np.int32), (n, length))}
    cfg = _cfg("lm", name, length)
    model = models.build(cfg, deterministic=True)
    # Parameters of the right shapes from numpy (compiling the random initializers would
    # take longer than the rest of this test).
    shapes = nn.unbox(jax.eval_shape(model.init, jax.random.key(0), batch)["params"])
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda s: jnp.asarray(0.2 * rng.standard_normal(s.shape), s.dtype), shapes)

    @jax.jit  # one compile: loss and grads with a `features` key, teacher-forced log-probs
    def run(params, key):
        loss = lambda p: model.apply({"params": p}, batch, rngs={"features": key})["loss"]
        return jax.value_and_grad(loss)(params), model.apply({"params": params}, batch, method="log_probs",
                                                             rngs={"features": key})

    (value, grads), full = run(params, jax.random.key(1))
    chex.assert_tree_all_finite((value, grads, full))
    (other, _), _ = run(params, jax.random.key(2))
    assert (float(value) != float(other)) == (name == "performer")

    # Decoding with the same `features` key draws the same projection as the forward pass.
    dec = models.build(cfg, deterministic=True, decode=True)

    @jax.jit
    def decode(params, key):
        cache = dec.init(jax.random.key(0), jnp.zeros((n, 1), jnp.int32), method="decode_step")["cache"]

        def step(cache, tok_B):
            lp, upd = dec.apply({"params": params, "cache": cache}, tok_B[:, None],
                                method="decode_step", mutable=["cache"], rngs={"features": key})
            return upd["cache"], lp

        return jax.lax.scan(step, cache, toks.T)[1].swapaxes(0, 1)

    steps = decode(params, jax.random.key(1))
    np.testing.assert_allclose(steps[0], full[0], atol=2e-5)
    np.testing.assert_allclose(steps[1, :7], full[1, :7], atol=2e-5)  # row 1 is padding from 7 on
