"""`clustered`: one cluster is dense attention; many clusters match a masked dense
reference built from the routing; decoding, true causality, k-means centroid training.
The references are `masked_softmax_attention` (the core of `dense_attention`) with a
dense mask, so one jitted reference serves every test."""

import dataclasses
import functools
import os

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hpnlp.attention as A
from hpnlp import models
from hpnlp.attention.base import masked_softmax_attention, segment_mask
from hpnlp.attention.clustered import clustered_attention, route
from hpnlp.attention.base import ROUTING
from hpnlp.config import (AttentionConfig, ConfigError, ModelConfig, default_configdict,
                          from_configdict, validate)

from attention_testlib import max_abs as _max_abs, rbg_key as _key, fill_params as _fill, call_attention as _call, apply_attention as _apply  # noqa: F401
from attention_testlib import assert_compiles_once

B, L, H, D = 2, 32, 2, 8
C, W = 3, 4  # clusters and chunk size of the sparse cases

def _qkv(seed=0, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal((B, L, H, D)).astype(dtype) for _ in range(3))


def _padding(lengths):
    return (np.arange(L)[None, :] < np.asarray(lengths)[:, None]).astype(np.int32)


def _module(**opts):
    return A.get("clustered")(**{"num_clusters": C, "chunk_size": W, **opts})


def _params(attn, seed=1):
    q, k, v = _qkv()
    abstract = jax.eval_shape(lambda: attn.init(_key(0), q, k, v, None, causal=True))
    return _fill(abstract.get("params", {}), seed)




@jax.jit
def _dense(q, k, v, allowed):
    return masked_softmax_attention(q, k, v, allowed)


def _weighted(fn):
    """Gradients of sum(sin(out) * w) w.r.t. (params, q, k, v); w [B, L] picks outputs."""
    return jax.grad(lambda p, q, k, v, w: jnp.sum(jnp.sin(fn(p, q, k, v)) * w[:, :, None, None]),
                    (0, 1, 2, 3))


@functools.partial(jax.jit, static_argnums=(0, 1))
def _grads(attn, causal, params, q, k, v, mask, w):
    return _weighted(lambda p, q, k, v: _call(attn, causal, p, q, k, v, mask))(params, q, k, v, w)


@jax.jit
def _dense_grads(q, k, v, allowed, w):
    return _weighted(lambda p, q, k, v: _dense(q, k, v, allowed))({}, q, k, v, w)


ONES = np.ones((B, L), np.int32)


@pytest.mark.parametrize("causal", [False, True])
def test_one_cluster_and_one_chunk_is_dense_attention(causal):
    attn = _module(num_clusters=1, chunk_size=L)
    params = _params(attn)
    q, k, v = _qkv()
    mask = _padding([L, 19])
    allowed = segment_mask(mask, mask, causal=causal)  # what dense_attention uses
    np.testing.assert_allclose(_apply(attn, causal, params, q, k, v, mask),
                               _dense(q, k, v, allowed), atol=1e-5, rtol=1e-5)
    w = mask.astype(np.float32)
    g = _grads(attn, causal, params, q, k, v, mask, w)[1:]
    for a, b in zip(g, _dense_grads(q, k, v, allowed, w)[1:]):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


def test_one_cluster_is_dense_only_when_the_chunk_covers_the_length():
    """Review r1 (session 105): the README said "exact with 1 cluster", but a token sees
    only the tokens within `chunk_size` slots of it: with one cluster and chunk_size < L,
    causal attention is a sliding window of chunk_size, not dense. The README states the
    condition (test_one_cluster_and_one_chunk_is_dense_attention pins chunk_size = L)."""
    attn = _module(num_clusters=1)  # chunk_size W = 4 < L
    q, k, v = _qkv()
    allowed = segment_mask(ONES, ONES, causal=True)
    window = allowed & (np.arange(L)[:, None] - np.arange(L)[None, :] < W)[None, None]
    out = _apply(attn, True, _params(attn), q, k, v, ONES)
    np.testing.assert_allclose(out, _dense(q, k, v, window), atol=1e-5, rtol=1e-5)
    assert _max_abs(out - _dense(q, k, v, allowed)) > 0.1
    with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                           "README.md")) as f:
        row = next(line for line in f if line.startswith("| `clustered` |"))
    assert "exact with 1 cluster and `chunk_size` >= L" in row, row


def _reference_mask(cluster_BLH, seg_BL, causal):
    """Dense [B, H, L, L] mask of the routing rule, built the slow way."""
    cl = np.asarray(cluster_BLH).transpose(0, 2, 1)[:, :, :, None]  # [B, H, L, 1]
    seg = np.asarray(seg_BL)[:, None, :, None]
    mates = (cl == cl.swapaxes(-1, -2)) & (seg == seg.swapaxes(-1, -2)) & (seg != 0)
    rank = np.sum(mates & np.tril(np.ones((L, L), bool)), axis=-1)  # mates up to and at i
    gap = rank[..., :, None] - rank[..., None, :]  # cluster-mates between query and key
    near = (gap >= 0) & (gap < W) if causal else np.abs(gap) < W
    return (mates & near).astype(bool)


@pytest.mark.parametrize("causal", [False, True])
def test_matches_masked_dense_reference_with_packing_and_padding(causal):
    attn = _module()
    params = _params(attn)
    q, k, v = _qkv()
    seg = np.asarray([[1] * 12 + [2] * 14 + [0] * 6, [1] * 19 + [0] * 13], np.int32)
    allowed = _reference_mask(jax.jit(route)(q, k, params["centroids"]), seg, causal)
    frac = allowed.sum() / ((seg != 0).sum(1) ** 2).sum() / H
    assert 0.05 < frac < 0.5  # routing and the window really drop keys
    np.testing.assert_allclose(_apply(attn, causal, params, q, k, v, seg),
                               _dense(q, k, v, allowed), atol=1e-5, rtol=1e-5)
    # Gradients with the routing held fixed (it is piecewise constant).
    w = (seg != 0).astype(np.float32)
    g = _grads(attn, causal, params, q, k, v, seg, w)[1:]
    for a, b in zip(g, _dense_grads(q, k, v, allowed, w)[1:]):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


def test_decode_matches_full_causal_forward():
    attn = _module()
    params = _params(attn)
    q, k, v = _qkv()

    @jax.jit
    def decode_all(p, q, k, v):
        def step(cache, qkv_t):
            q_t, k_t, v_t = (x[:, None] for x in qkv_t)
            out, cache = attn.apply({"params": p}, cache, q_t, k_t, v_t, method="decode_step")
            return cache, out[:, 0]
        cache = attn.init_cache(B, L, H, D, jnp.float32)
        _, outs = jax.lax.scan(step, cache, tuple(x.swapaxes(0, 1) for x in (q, k, v)))
        return outs.swapaxes(0, 1)

    full = _apply(attn, True, params, q, k, v, ONES)
    np.testing.assert_allclose(decode_all(params, q, k, v), full, atol=1e-5, rtol=1e-5)


def test_causal_outputs_ignore_the_future_values_and_gradients():
    """Stronger than gradients: routing of future tokens must not change what t sees."""
    attn = _module()
    params = _params(attn)
    q, k, v = _qkv()
    q2, k2, v2 = _qkv(seed=5)
    t = 10
    future = (np.arange(L) > t)[None, :, None, None]
    mix = lambda a, b: np.where(future, b, a)
    a = _apply(attn, True, params, q, k, v, ONES)
    b = _apply(attn, True, params, mix(q, q2), mix(k, k2), mix(v, v2), ONES)
    # Same keys, same weights; only the summation order inside a chunk may move (1 ulp).
    np.testing.assert_allclose(a[:, : t + 1], b[:, : t + 1], atol=1e-6, rtol=0)
    _, _, gk, gv = _grads(attn, True, params, q, k, v, ONES, np.eye(L, dtype=np.float32)[[t] * B])
    assert _max_abs(gk[:, t + 1:]) == 0.0
    assert _max_abs(gv[:, t + 1:]) == 0.0
    assert _max_abs(gv[:, : t + 1]) > 0.0


def test_padding_invariance_and_fully_masked_rows():
    attn = _module()
    params = _params(attn)
    q, k, v = _qkv()
    mask = _padding([0, 27])
    q2, k2, v2 = _qkv(seed=7)
    pad = (mask == 0)[:, :, None, None]
    mix = lambda a, b: np.where(pad, b, a)
    out1 = _apply(attn, True, params, q, k, v, mask)
    out2 = _apply(attn, True, params, mix(q, q2), mix(k, k2), mix(v, v2), mask)
    np.testing.assert_allclose(np.where(pad, 0, out1), np.where(pad, 0, out2), atol=1e-6)
    chex.assert_tree_all_finite(out1)
    assert _max_abs(out1[0]) == 0.0  # row 0 is all padding
    w = np.ones((B, L), np.float32)
    chex.assert_tree_all_finite(_grads(attn, True, params, q, k, v, mask, w))


def test_bfloat16_is_finite_and_close():
    attn = _module()  # routing runs in float32 on the (exactly widened) bf16 inputs
    params = _params(attn)
    q, k, v = _qkv(dtype=jnp.bfloat16)
    mask = _padding([L, 9])
    out = _apply(attn, True, params, q, k, v, mask)
    assert out.dtype == jnp.bfloat16
    chex.assert_tree_all_finite(out)
    ref = _apply(attn, True, params, *(x.astype(jnp.float32) for x in (q, k, v)), mask)
    np.testing.assert_allclose(out.astype(jnp.float32), ref, atol=5e-2)


def test_a_kept_routing_is_reused_not_routed_again():
    """A bug hunt (session 100): reversible blocks replay attention on an input rebuilt from
    the outputs (equal to rounding; in bfloat16 an argmax flipped). With the `routing`
    collection mutable the module keeps its clusters; given them, it attends by them."""
    attn = _module()
    params = _params(attn)
    (q, k, v), (q2, k2, _) = _qkv(3), _qkv(4)
    mask = _padding([L, 19])

    @jax.jit
    def run(q, k, q2, k2, v):
        _, kept = attn.apply({"params": params}, q, k, v, mask, causal=True, mutable=[ROUTING])
        cluster = kept[ROUTING]["cluster"]
        return (cluster, route(q, k, params["centroids"]),
                attn.apply({"params": params, **kept}, q2, k2, v, mask, causal=True),
                clustered_attention(q2, k2, v, cluster, mask, causal=True, chunk_size=W),
                _call(attn, True, params, q2, k2, v, mask))

    cluster, want, replay, by_cluster, rerouted = run(q, k, q2, k2, v)
    np.testing.assert_array_equal(cluster, want)
    np.testing.assert_allclose(replay, by_cluster, atol=1e-6)
    assert float(jnp.abs(replay - rerouted).max()) > 1e-2  # q2, k2 alone route elsewhere
    assert ROUTING not in jax.eval_shape(lambda: attn.init(_key(0), q, k, v, mask, causal=True))


def test_value_head_dim_other_than_the_querys():
    """A bug hunt (session 100): v's head dim 6 beside q's 8 failed to reshape; now its own,
    dense attention at one cluster and one chunk."""
    attn = _module(num_clusters=1, chunk_size=L)
    params = _params(attn)
    q, k, _ = _qkv()
    v6 = np.random.default_rng(5).standard_normal((B, L, H, 6)).astype(np.float32)
    mask = _padding([L, 19])
    out = _apply(attn, True, params, q, k, v6, mask)
    assert out.shape == (B, L, H, 6)
    np.testing.assert_allclose(out, _dense(q, k, v6, segment_mask(mask, mask, causal=True)),
                               atol=1e-5, rtol=1e-5)


def test_no_recompile_across_calls():
    """A module rebuilt per call (as from a config) is a static argument equal to the last:
    one program for all three calls, the one `test_padding_invariance_and_fully_masked_rows`
    compiled."""
    params = _params(_module())
    assert_compiles_once(_apply, ((_module(), True, params, *_qkv(seed), _padding([L, 3 + seed]))
                                  for seed in range(3)))


def test_centroids_get_the_kmeans_gradient_and_descend_to_the_cluster_means():
    attn = _module(num_clusters=2)
    mask = _padding([L, 19])
    task_loss = lambda c, q, k, v: jnp.sum(_call(attn, False, {"centroids": c}, q, k, v, mask) ** 2)
    centroid_grad = jax.jit(jax.grad(task_loss))

    def unit(x):
        return x / np.linalg.norm(x, axis=-1, keepdims=True)

    # The task gradient cannot reach the centroids (routing is discrete); what arrives is
    # the k-means gradient sum_{t in c} (2 mu_c - u(q_t) - u(k_t)), computed here independently.
    q, k, v = _qkv()
    c = np.random.default_rng(2).standard_normal((H, 2, D)).astype(np.float32)
    x = unit(q) + unit(k)  # [B, L, H, D]
    cluster = np.argmax(np.einsum("blhd,hcd->blhc", x, unit(c)), axis=-1)
    onehot = np.eye(2)[cluster] * (mask != 0)[:, :, None, None]  # [B, L, H, C]
    expected = (2 * onehot.sum((0, 1))[:, :, None] * c - np.einsum("blhc,blhd->hcd", onehot, x))
    np.testing.assert_allclose(centroid_grad(c, q, k, v), expected, rtol=1e-5, atol=1e-5)

    # Tokens whose unit q and k lie near +u or -u (per head): gradient descent on the
    # centroids (lr 1/(2 n) would be Lloyd's step) must find the two directions.
    rng = np.random.default_rng(3)
    u = unit(rng.standard_normal((H, D)))
    side = rng.choice([-1.0, 1.0], (B, L, 1, 1))
    q, k = ((side * u + 0.1 * rng.standard_normal((B, L, H, D))).astype(np.float32)
            for _ in range(2))
    c = np.random.default_rng(4).standard_normal((H, 2, D)).astype(np.float32)
    for _ in range(30):
        c = c - 0.005 * np.asarray(centroid_grad(c, q, k, v))
    cos = np.einsum("hcd,hd->hc", unit(c), u)
    np.testing.assert_allclose(np.sort(cos, axis=-1), [[-1.0, 1.0]] * H, atol=0.02)


def _cfg(**opts):
    cd = default_configdict()
    cd.data.task, cd.data.seq_len = "byte_lm", 64
    cd.model.kind, cd.model.max_len = "lm", 64
    cd.train.batch_size = 8
    cd.attention.name, cd.attention.options = "clustered", opts
    return from_configdict(cd)


def test_bad_input_and_config_errors():
    validate(_cfg(num_clusters=4, chunk_size=24), num_devices=1)  # causal; 64 padded to 72
    with pytest.raises(ConfigError, match=r"`attention.options.num_clusters` = 0"):
        validate(_cfg(num_clusters=0), num_devices=1)
    with pytest.raises(ConfigError, match=r"`attention.options.chunk_size` = 2.5"):
        validate(_cfg(chunk_size=2.5), num_devices=1)
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="head dims differ"):
        _module().init(_key(0), q, k[..., :4], v, None, causal=True)
    with pytest.raises(ValueError, match="segment ids of shape"):
        _module().init(_key(0), q, k, v, jnp.ones((B, L, L), jnp.int32), causal=True)


def test_inside_the_lm_with_decoding():
    V, T = 40, 16
    cfg = from_configdict(default_configdict())
    cfg = dataclasses.replace(
        cfg, model=ModelConfig(kind="lm", vocab_size=V, width=16, depth=1, num_heads=2,
                               mlp_dim=32, max_len=T, dropout=0.0),
        attention=AttentionConfig("clustered", {"num_clusters": 2, "chunk_size": 4}))
    toks = np.random.default_rng(0).integers(0, V, (B, T)).astype(np.int32)
    batch = {"inputs": toks, "targets": np.roll(toks, -1, 1),
             "segment_ids": (np.arange(T)[None] < np.array([[T], [11]])).astype(np.int32),
             "positions": np.tile(np.arange(T, dtype=np.int32), (B, 1))}
    model = models.build(cfg, deterministic=True)
    params = _fill(jax.eval_shape(model.init, _key(0), batch)["params"])
    loss_fn = lambda p: model.apply({"params": p}, batch)["loss"]
    loss, grads = jax.jit(jax.value_and_grad(loss_fn))(params)
    chex.assert_tree_all_finite((loss, grads))
    assert _max_abs(grads["trunk"]["block_0"]["attention"]["attn"]["centroids"]) > 0.0

    full = jax.jit(lambda p, b: model.apply({"params": p}, b, method="log_probs"))(
        params, dict(batch, segment_ids=np.ones((B, T), np.int32)))
    dec = models.build(cfg, deterministic=True, decode=True)
    cache = jax.jit(lambda key: dec.init(key, jnp.zeros((B, 1), jnp.int32),
                                         method="decode_step")["cache"])(_key(0))

    @jax.jit
    def decode_all(params, cache, toks):
        def step(cache, tok_B):
            lp, upd = dec.apply({"params": params, "cache": cache}, tok_B[:, None],
                                method="decode_step", mutable=["cache"])
            return upd["cache"], lp
        return jax.lax.scan(step, cache, toks.T)[1].swapaxes(0, 1)

    np.testing.assert_allclose(decode_all(params, cache, toks), full, atol=2e-5)
