"""`sinkhorn`: one block is dense attention; a hard permutation is dense attention over
own + chosen block; Sinkhorn gives doubly stochastic matrices and, cold, permutations."""

import dataclasses
import functools

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hpnlp.attention as A
from hpnlp import models
from hpnlp.attention.dense import dense_attention
from hpnlp.attention.sinkhorn import gumbel_sinkhorn, sinkhorn_attention
from hpnlp.config import (AttentionConfig, ConfigError, ModelConfig, default_configdict,
                          from_configdict, validate)

from attention_testlib import max_abs as _max_abs, rbg_key as _key, fill_params as _fill  # noqa: F401
from attention_testlib import assert_compiles_once

B, L, H, D = 2, 32, 2, 8

def _qkv(seed=0, dtype=jnp.float32, length=L):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal((B, length, H, D)).astype(dtype) for _ in range(3))


def _padding(lengths, length=L):
    return (np.arange(length)[None, :] < np.asarray(lengths)[:, None]).astype(np.int32)


def _module(**opts):
    return A.get("sinkhorn")(**{"block_size": 8, **opts})


def _params(attn, seed=1):
    q, k, v = _qkv()
    abstract = jax.eval_shape(lambda: attn.init(_key(0), q, k, v, None, causal=False))
    return _fill(abstract.get("params", {}), seed)


# Every test goes through these (mask always an array), so each configuration compiles once.
def _call(attn, params, q, k, v, mask):
    return attn.apply({"params": params}, q, k, v, mask, causal=False, deterministic=True)


_apply = jax.jit(_call, static_argnums=0)


def _weighted(fn):
    """Gradients of sum(sin(out) * w) w.r.t. (params, q, k, v); w [B, L] picks outputs."""
    return jax.grad(lambda p, q, k, v, w: jnp.sum(jnp.sin(fn(p, q, k, v)) * w[:, :, None, None]),
                    (0, 1, 2, 3))


@functools.partial(jax.jit, static_argnums=0)
def _grads(attn, params, q, k, v, mask, w):
    return _weighted(lambda p, q, k, v: _call(attn, p, q, k, v, mask))(params, q, k, v, w)


@jax.jit
def _dense_and_grads(q, k, v, mask, w):
    fn = lambda p, q, k, v: dense_attention(q, k, v, mask)
    return fn({}, q, k, v), _weighted(fn)({}, q, k, v, w)


def _np_attention(q, k, v, allowed_BHLS):
    """Masked softmax attention in numpy (float64) for references."""
    s = np.einsum("blhd,bshd->bhls", q, k) / np.sqrt(q.shape[-1])
    e = np.where(allowed_BHLS, np.exp(s - s.max(-1, keepdims=True)), 0.0)
    return np.einsum("bhls,bshd->blhd", e / np.maximum(e.sum(-1, keepdims=True), 1e-30), v)


def test_single_block_is_dense_attention_outputs_and_grads():
    attn = _module(block_size=L)
    params = _params(attn)
    q, k, v = _qkv()
    mask = _padding([L, 19])
    w = mask.astype(np.float32)
    ref, ref_grads = _dense_and_grads(q, k, v, mask, w)
    np.testing.assert_allclose(_apply(attn, params, q, k, v, mask), ref, atol=1e-5, rtol=1e-5)
    for a, b in zip(_grads(attn, params, q, k, v, mask, w)[1:], ref_grads[1:]):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


def test_value_head_dim_other_than_the_querys():
    """A bug hunt (session 100): v's head dim 6 beside q's 8 failed to reshape; now its own,
    dense attention with a single block."""
    attn = _module(block_size=L)
    params = _params(attn)
    q, k, _ = _qkv()
    v6 = np.random.default_rng(5).standard_normal((B, L, H, 6)).astype(np.float32)
    mask = _padding([L, 19])
    out = _apply(attn, params, q, k, v6, mask)
    assert out.shape == (B, L, H, 6)
    np.testing.assert_allclose(out, jax.jit(dense_attention)(q, k, v6, mask), atol=1e-5,
                               rtol=1e-5)


def test_hard_permutation_is_dense_attention_over_own_and_chosen_block():
    N, Q = 4, L // 4
    choice = np.array([[[2, 0, 3, 1], [1, 1, 0, 3]]] * B)  # [B, H, N]: block i sees choice[i]
    perm = np.eye(N, dtype=np.float32)[choice]
    q, k, v = _qkv()
    mask = _padding([L, 19])
    out = jax.jit(sinkhorn_attention, static_argnums=5)(q, k, v, mask != 0, perm, Q)
    blk = np.arange(L) // Q
    own = blk[:, None] == blk[None, :]
    chosen = choice[:, :, blk][..., None] == blk[None, None, None, :]  # [B, H, L, L]
    real = mask != 0
    allowed = (own[None, None] | chosen) & real[:, None, :, None] & real[:, None, None, :]
    # A block that chooses itself sees its keys twice, which the softmax cancels exactly.
    np.testing.assert_allclose(out, _np_attention(q, k, v, allowed), atol=1e-5, rtol=1e-5)


def _reference(q, k, v, valid, perm, Q):
    """The sorted slots spelled out block by block: slot k of query block i has mass
    m = sum_j P[i, j] [key (j, k) is real], key and value the m-normalized mixes of the real
    keys and values, and softmax weight m (logit + log m). Needs m > 0 on every slot."""
    B, L, H, D = q.shape
    N = L // Q
    real_BNQ = valid.reshape(B, N, Q).astype(jnp.float32)
    k_BNQHD, v_BNQHD = k.reshape(B, N, Q, H, D), v.reshape(B, N, Q, H, -1)
    outs = []
    for i in range(N):
        mass_BHQ = jnp.einsum("bhj,bjq->bhq", perm[:, :, i], real_BNQ)
        mix_BHNQ = perm[:, :, i, :, None] * real_BNQ[:, None] / mass_BHQ[:, :, None]
        keys = jnp.concatenate([k_BNQHD[:, i], jnp.einsum("bhjq,bjqhd->bqhd", mix_BHNQ,
                                                          k_BNQHD)], axis=1)
        values = jnp.concatenate([v_BNQHD[:, i], jnp.einsum("bhjq,bjqhd->bqhd", mix_BHNQ,
                                                            v_BNQHD)], axis=1)
        own_B1Q = jnp.where(real_BNQ[:, None, i] > 0, 0.0, -jnp.inf)
        logw_BHS = jnp.concatenate([jnp.broadcast_to(own_B1Q, mass_BHQ.shape),
                                    jnp.log(mass_BHQ)], axis=-1)
        s_BHQS = jnp.einsum("bqhd,bshd->bhqs", q[:, i * Q:(i + 1) * Q], keys) / np.sqrt(D)
        p_BHQS = jax.nn.softmax(s_BHQS + logw_BHS[:, :, None, :], axis=-1)
        out = jnp.einsum("bhqs,bshd->bqhd", p_BHQS, values)
        outs.append(jnp.where(real_BNQ[:, i, :, None, None] > 0, out, 0.0))
    return jnp.concatenate(outs, axis=1)


def _soft_perm(n, seed=3, batch=B):
    scores = np.random.default_rng(seed).standard_normal((batch, H, n, n)).astype(np.float32)
    return gumbel_sinkhorn(scores, np.ones((batch, n), bool), iters=8, temperature=1.0)


def test_soft_permutation_outputs_average_real_values_only():
    """A review (session 107): a sorted slot's key and value were sum_j P[i, j] x_j over the
    real keys, i.e. scaled by the slot's real mass on top of its + log(mass) weight, so with
    a soft permutation and a partly padded block, identical values averaged to 0.93 (or,
    unpadded, to P's row sum): every real output must be the one value c."""
    c = np.random.default_rng(4).standard_normal(D).astype(np.float32)
    # the review's numbers: q = 0, half of each block sorted to each, 2 of 8 keys padded
    q1, v1 = np.zeros((1, 8, 1, D), np.float32), np.broadcast_to(c, (1, 8, 1, D))
    valid1 = np.arange(8)[None] < 6
    run = jax.jit(sinkhorn_attention, static_argnums=5)
    out = run(q1, q1, v1, valid1, np.full((1, 1, 2, 2), 0.5, np.float32), 4)
    np.testing.assert_allclose(out[:, :6], v1[:, :6], atol=1e-6, rtol=0)
    # random queries and keys, Gumbel-Sinkhorn of random scores, last block partly padded
    q, k, _ = _qkv()
    v = np.broadcast_to(c, (B, L, H, D))
    mask = _padding([29, 21])
    out = run(q, k, v, mask != 0, _soft_perm(4), 8)
    real = (mask != 0)[:, :, None, None]
    np.testing.assert_allclose(np.where(real, out, c), v, atol=1e-6, rtol=0)
    attn = _module()
    out = _apply(attn, _params(attn), q, k, v, mask)
    np.testing.assert_allclose(np.where(real, out, c), v, atol=1e-6, rtol=0)


@jax.jit
def _outputs_and_grads(q, k, v, valid, perm, w):
    fns = (lambda q, k, v, p: sinkhorn_attention(q, k, v, valid, p, 4),
           lambda q, k, v, p: _reference(q, k, v, valid, p, 4))
    loss = lambda fn: lambda *a: jnp.sum(jnp.sin(fn(*a)) * w[:, :, None, None])
    return [(fn(q, k, v, perm), jax.grad(loss(fn), (0, 1, 2, 3))(q, k, v, perm)) for fn in fns]


def test_soft_permutation_matches_the_spelled_out_reference_outputs_and_grads():
    """Forward and gradients (q, k, v and the permutation, through which the sorter trains)
    against `_reference`: soft permutation, a partly padded last block, v's own head dim."""
    rng = np.random.default_rng(6)
    q, k = (rng.standard_normal((B, 12, H, D)).astype(np.float32) for _ in range(2))
    v = rng.standard_normal((B, 12, H, 6)).astype(np.float32)
    valid = _padding([10, 12], 12) != 0
    (out, grads), (ref, ref_grads) = _outputs_and_grads(q, k, v, valid, _soft_perm(3), valid)
    np.testing.assert_allclose(out, ref, atol=1e-5, rtol=1e-5)
    for a, b in zip(grads, ref_grads):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


def test_grads_stay_finite_when_a_slot_has_almost_no_real_mass():
    """The renormalization divides by the slot mass: a near-hard permutation onto the padded
    slots leaves masses of 1e-20, whose 1 / mass^2 overflowed float32 into NaN gradients."""
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((1, 8, 1, D)).astype(np.float32) for _ in range(3))
    valid = np.arange(8)[None] < 6
    perm = np.array([[[[1e-20, 1.0], [1.0, 1e-20]]]], np.float32)
    grads = jax.jit(jax.grad(lambda *a: jnp.sum(jnp.sin(sinkhorn_attention(*a, valid, perm, 4))),
                             (0, 1, 2)))(q, k, v)
    chex.assert_tree_all_finite(grads)
    perm_grad = jax.jit(jax.grad(lambda p: jnp.sum(jnp.sin(sinkhorn_attention(q, k, v, valid,
                                                                               p, 4)))))(perm)
    chex.assert_tree_all_finite(perm_grad)


def test_sinkhorn_is_doubly_stochastic_and_cold_sinkhorn_is_the_best_permutation():
    rng = np.random.default_rng(0)
    sinkhorn = jax.jit(functools.partial(gumbel_sinkhorn, iters=100))
    scores = rng.standard_normal((B, H, 5, 5)).astype(np.float32)
    valid = np.array([[True] * 5, [True] * 4 + [False]])
    p = np.asarray(sinkhorn(scores, valid, temperature=1.0))
    np.testing.assert_allclose(p[0].sum(-1), 1.0, atol=1e-4)
    np.testing.assert_allclose(p[0].sum(-2), 1.0, atol=1e-4)
    np.testing.assert_allclose(p[1, :, :4].sum(-1), 1.0, atol=1e-4)
    np.testing.assert_allclose(p[1, :, :, :4].sum(-2), 1.0, atol=1e-4)
    assert _max_abs(p[1, :, 4]) == 0.0 and _max_abs(p[1, :, :, 4]) == 0.0

    target = rng.permutation(5)
    strong = (np.eye(5)[target] * 3.0 + 0.3 * rng.standard_normal((B, H, 5, 5))).astype(np.float32)
    cold = sinkhorn(strong, np.ones((B, 5), bool), temperature=0.05)
    np.testing.assert_allclose(cold, np.broadcast_to(np.eye(5)[target], (B, H, 5, 5)), atol=1e-3)


def test_length_not_a_multiple_of_the_block_is_padded():
    attn = _module()
    params = _params(attn)
    q, k, v = _qkv()
    mask = _padding([27, 21])
    short = _apply(attn, params, q[:, :28], k[:, :28], v[:, :28], mask[:, :28])
    np.testing.assert_allclose(short, _apply(attn, params, q, k, v, mask)[:, :28], atol=1e-6)


def test_padding_invariance_and_zero_padding_rows():
    attn = _module()
    params = _params(attn)
    q, k, v = _qkv()
    mask = _padding([20, 27])
    q2, k2, v2 = _qkv(seed=7)
    pad = (mask == 0)[:, :, None, None]
    mix = lambda a, b: np.where(pad, b, a)
    out1 = _apply(attn, params, q, k, v, mask)
    out2 = _apply(attn, params, mix(q, q2), mix(k, k2), mix(v, v2), mask)
    np.testing.assert_allclose(np.where(pad, 0, out1), np.where(pad, 0, out2), atol=1e-6)
    assert _max_abs(np.where(pad, out1, 0)) == 0.0


def test_fully_masked_rows_are_zero_not_nan():
    attn = _module()
    params = _params(attn)
    q, k, v = _qkv()
    mask = _padding([0, 5])
    out = _apply(attn, params, q, k, v, mask)
    chex.assert_tree_all_finite(out)
    assert _max_abs(out[0]) == 0.0
    chex.assert_tree_all_finite(_grads(attn, params, q, k, v, mask, np.ones((B, L), np.float32)))


def test_bfloat16_is_finite_and_close():
    attn = _module()
    params = _params(attn)
    q, k, v = _qkv(dtype=jnp.bfloat16)
    mask = _padding([L, 9])
    out = _apply(attn, params, q, k, v, mask)
    assert out.dtype == jnp.bfloat16
    chex.assert_tree_all_finite(out)
    ref = _apply(attn, params, *(x.astype(jnp.float32) for x in (q, k, v)), mask)
    np.testing.assert_allclose(np.asarray(out, np.float32), ref, atol=5e-2)


def test_no_recompile_across_calls():
    """A module rebuilt per call (as from a config) is a static argument equal to the last:
    one program for all three calls, the one `test_padding_invariance_and_zero_padding_rows`
    compiled."""
    params = _params(_module())
    assert_compiles_once(_apply, ((_module(), params, *_qkv(seed), _padding([L, 3 + seed]))
                                  for seed in range(3)))


def test_gumbel_noise_only_when_not_deterministic():
    attn = _module(temperature=0.5)
    params = _params(attn)
    q, k, v = _qkv()

    @jax.jit
    def noisy(params, key):
        return attn.apply({"params": params}, q, k, v, None, causal=False, deterministic=False,
                          rngs={"dropout": key})

    a, b = noisy(params, _key(0)), noisy(params, _key(1))
    np.testing.assert_array_equal(a, noisy(params, _key(0)))
    assert _max_abs(a - b) > 1e-4
    with pytest.raises(ValueError, match="needs a 'dropout'"):
        attn.apply({"params": params}, q, k, v, None, causal=False, deterministic=False)


def _cfg(kind, **opts):
    cd = default_configdict()
    cd.data.task = "byte_lm" if kind == "lm" else "listops"
    cd.data.seq_len = 64
    cd.model.kind, cd.model.max_len = kind, 64
    cd.train.batch_size = 8
    cd.attention.name, cd.attention.options = "sinkhorn", opts
    return from_configdict(cd)


def test_bad_input_and_config_errors():
    with pytest.raises(ConfigError, match="`attention.name` = 'sinkhorn' is not allowed: this variant cannot be causal"):
        validate(_cfg("lm"), num_devices=1)
    with pytest.raises(ConfigError, match=r"`attention.options.temperature` = 0"):
        validate(_cfg("classifier", temperature=0), num_devices=1)
    with pytest.raises(ConfigError, match=r"`attention.options.block_size` = -8"):
        validate(_cfg("classifier", block_size=-8), num_devices=1)
    validate(_cfg("classifier", block_size=24), num_devices=1)  # 64 is padded to 72
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="cannot be causal"):
        _module().init(_key(0), q, k, v, None, causal=True)
    with pytest.raises(ValueError, match="head dims differ"):
        _module().init(_key(0), q, k[..., :4], v, None, causal=False)


def test_inside_the_classifier_training_mode():
    cfg = from_configdict(default_configdict())
    cfg = dataclasses.replace(
        cfg, model=ModelConfig(kind="classifier", vocab_size=40, num_classes=3, width=16, depth=1,
                               num_heads=2, mlp_dim=32, max_len=16, dropout=0.0),
        attention=AttentionConfig("sinkhorn", {"block_size": 4}))
    rng = np.random.default_rng(0)
    batch = {"inputs": rng.integers(0, 40, (B, 16)).astype(np.int32),
             "segment_ids": (np.arange(16)[None] < np.array([[16], [9]])).astype(np.int32),
             "label": np.array([0, 2], np.int32), "weight": np.ones(B, np.float32)}
    model = models.build(cfg, deterministic=False)
    keys = {"params": _key(0), "dropout": _key(1)}
    params = _fill(jax.eval_shape(model.init, keys, batch)["params"])
    loss_fn = lambda p: model.apply({"params": p}, batch, rngs={"dropout": _key(2)})["loss"]
    loss, grads = jax.jit(jax.value_and_grad(loss_fn))(params)
    chex.assert_tree_all_finite((loss, grads))
    assert _max_abs(grads["trunk"]["block_0"]["attention"]["attn"]["sort"]) > 0.0


def test_sort_weights_start_at_each_head_s_own_fan_in():
    """A review (session 103): the heads axis counted into lecun_normal's fan-in, so each
    head's sorting projection [D, D] started sqrt(H) smaller than a linear layer's."""
    q = jnp.ones((1, 16, 4, 64))
    attn = _module()
    p = nn.unbox(jax.jit(lambda: attn.init(_key(0), q, q, q, None, causal=False))()["params"])
    np.testing.assert_allclose(float(jnp.std(p["sort"])), 64 ** -0.5, rtol=0.05)
