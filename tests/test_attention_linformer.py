"""`linformer`: exact with identity projections, exact on block-constant (low-rank)
inputs with block-mean projections, padding-safe, refused as causal."""

import dataclasses
import functools

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hpnlp.attention as A
import hpnlp.attention.linformer  # noqa: F401  (registers "linformer")
from hpnlp import models
from hpnlp.attention.dense import dense_attention
from hpnlp.config import (AttentionConfig, ConfigError, ModelConfig, default_configdict,
                          from_configdict, validate)

from attention_testlib import max_abs as _max_abs, rbg_key as _key, fill_params as _fill  # noqa: F401
from attention_testlib import assert_compiles_once

B, L, H, D = 2, 32, 2, 8

def _qkv(seed=0, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal((B, L, H, D)).astype(dtype) for _ in range(3))


def _padding(lengths):
    return (np.arange(L)[None, :] < np.asarray(lengths)[:, None]).astype(np.int32)


def _module(**opts):
    return A.get("linformer")(**{"proj_len": 8, "max_len": 48, **opts})


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


ONES = np.ones((B, L), np.int32)


def test_identity_projections_equal_dense_outputs_and_grads():
    attn = A.get("linformer")(proj_len=L, max_len=L)
    params = {"E": np.eye(L, dtype=np.float32), "F": np.eye(L, dtype=np.float32)}
    q, k, v = _qkv()
    mask = _padding([L, 19])
    w = mask.astype(np.float32)
    ref, ref_grads = _dense_and_grads(q, k, v, mask, w)
    np.testing.assert_allclose(_apply(attn, params, q, k, v, mask), ref, atol=1e-5, rtol=1e-5)
    for a, b in zip(_grads(attn, params, q, k, v, mask, w)[1:], ref_grads[1:]):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


def test_low_rank_input_is_exact_with_fewer_projected_rows():
    """The paper's premise: when the sequence has rank-k structure (here: keys and values
    constant over blocks of L/k tokens), k projected rows lose nothing."""
    kp = 4
    attn = A.get("linformer")(proj_len=kp, max_len=L)
    block_mean = (np.repeat(np.eye(kp), L // kp, axis=1) / (L // kp)).astype(np.float32)
    q, k, v = _qkv()
    k = np.repeat(k[:, :kp], L // kp, axis=1)
    v = np.repeat(v[:, :kp], L // kp, axis=1)
    out = _apply(attn, {"E": block_mean, "F": block_mean}, q, k, v, ONES)
    ref, _ = _dense_and_grads(q, k, v, ONES, np.ones((B, L), np.float32))
    np.testing.assert_allclose(out, ref, atol=1e-5, rtol=1e-5)


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


def test_share_kv_has_one_projection_and_any_shorter_length_works():
    attn = _module(share_kv=True)
    params = _params(attn)
    assert set(params) == {"E"}
    q, k, v = (x[:, :20] for x in _qkv())
    out = _apply(attn, params, q, k, v, None)
    chex.assert_shape(out, (B, 20, H, D))
    chex.assert_tree_all_finite(out)


def _cfg(kind, **opts):
    cd = default_configdict()
    cd.data.task = "byte_lm" if kind == "lm" else "listops"
    cd.data.seq_len = 64
    cd.model.kind = kind
    cd.model.max_len = 64
    cd.train.batch_size = 8
    cd.attention.name = "linformer"
    cd.attention.options = opts
    return from_configdict(cd)


def test_bad_input_and_config_errors():
    with pytest.raises(ConfigError, match="`attention.name` = 'linformer' is not allowed: this variant cannot be causal"):
        validate(_cfg("lm"), num_devices=1)
    with pytest.raises(ConfigError, match=r"`attention.options.max_len` = 32 .*data.seq_len=64"):
        validate(_cfg("classifier", max_len=32), num_devices=1)
    with pytest.raises(ConfigError, match=r"`attention.options.proj_len` = 0"):
        validate(_cfg("classifier", proj_len=0), num_devices=1)
    validate(_cfg("classifier", max_len=64, proj_len=16), num_devices=1)

    q, k, v = _qkv()
    with pytest.raises(ValueError, match="max_len=16"):
        A.get("linformer")(max_len=16).init(jax.random.key(0), q, k, v, None, causal=False)
    with pytest.raises(ValueError, match="cannot be causal"):
        _module().init(jax.random.key(0), q, k, v, None, causal=True)
    with pytest.raises(ValueError, match="head dims differ"):
        _module().init(jax.random.key(0), q, k[..., :4], v, None, causal=False)


def test_inside_the_classifier():
    cfg = from_configdict(default_configdict())
    cfg = dataclasses.replace(
        cfg, model=ModelConfig(kind="classifier", vocab_size=40, num_classes=3, width=16, depth=1,
                               num_heads=2, mlp_dim=32, max_len=16, dropout=0.0),
        attention=AttentionConfig("linformer", {"proj_len": 4, "max_len": 16}))
    rng = np.random.default_rng(0)
    batch = {"inputs": rng.integers(0, 40, (B, 16)).astype(np.int32),
             "segment_ids": (np.arange(16)[None] < np.array([[16], [9]])).astype(np.int32),
             "label": np.array([0, 2], np.int32), "weight": np.ones(B, np.float32)}
    model = models.build(cfg, deterministic=True)
    params = _fill(jax.eval_shape(model.init, _key(0), batch)["params"])
    loss_fn = lambda p: model.apply({"params": p}, batch)["loss"]
    loss, grads = jax.jit(jax.value_and_grad(loss_fn))(params)
    chex.assert_tree_all_finite((loss, grads))
    assert _max_abs(grads["trunk"]["block_0"]["attention"]["attn"]["E"]) > 0.0
