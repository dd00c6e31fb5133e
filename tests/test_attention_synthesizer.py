"""`synthesizer`: each mode against an independent reference, masking and causality,
packed segments, decoding against the full causal forward pass, inside the LM (the
model-level decode path is exercised in test_attention_clustered.py)."""

import dataclasses
import functools

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hpnlp.attention as A
from hpnlp.attention.synthesizer import fixed_random_rows  # registers "synthesizer"
from hpnlp import models
from hpnlp.attention.dense import dense_attention
from hpnlp.config import (AttentionConfig, ConfigError, ModelConfig, default_configdict,
                          from_configdict, validate)

from attention_testlib import max_abs as _max_abs, rbg_key as _key, fill_params as _fill, call_attention as _call, apply_attention as _apply  # noqa: F401
from attention_testlib import assert_compiles_once

B, L, H, D, M = 2, 32, 2, 8, 48
MODES = {"dense": {"mode": "dense"}, "random": {"mode": "random"},
         "factorized": {"mode": "factorized", "rank": 4},
         "fixed": {"mode": "random", "trainable": False},
         "fixed_factorized": {"mode": "factorized", "rank": 4, "trainable": False}}

def _qkv(seed=0, dtype=jnp.float32, length=L):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal((B, length, H, D)).astype(dtype) for _ in range(3))


def _padding(lengths):
    return (np.arange(L)[None, :] < np.asarray(lengths)[:, None]).astype(np.int32)


def _module(case="dense", **opts):
    return A.get("synthesizer")(**{"max_len": M, **MODES[case], **opts})


def _params(attn, seed=1):
    q, k, v = _qkv()
    abstract = jax.eval_shape(lambda: attn.init(_key(0), q, k, v, None, causal=True))
    return _fill(abstract.get("params", {}), seed)




def _weighted(fn):
    """Gradients of sum(sin(out) * w) w.r.t. (params, q, k, v); w [B, L] picks outputs."""
    return jax.grad(lambda p, q, k, v, w: jnp.sum(jnp.sin(fn(p, q, k, v)) * w[:, :, None, None]),
                    (0, 1, 2, 3))


@functools.partial(jax.jit, static_argnums=(0, 1))
def _grads(attn, causal, params, q, k, v, mask, w):
    return _weighted(lambda p, q, k, v: _call(attn, causal, p, q, k, v, mask))(params, q, k, v, w)


@functools.partial(jax.jit, static_argnums=0)
def _dense_and_grads(causal, q, k, v, mask, w):
    fn = lambda p, q, k, v: dense_attention(q, k, v, mask, causal=causal)
    return fn({}, q, k, v), _weighted(fn)({}, q, k, v, w)


ONES = np.ones((B, L), np.int32)


@pytest.mark.parametrize("causal", [False, True])
def test_random_mode_holding_qk_scores_is_dense_attention(causal):
    """A random synthesizer whose matrix holds one example's QK^T/sqrt(D) must reproduce
    dense attention on that example: masking, causality and the softmax, outputs and grads."""
    q, k, v = _qkv()
    q, k = np.repeat(q[:1], B, 0), np.repeat(k[:1], B, 0)
    table = np.random.default_rng(3).standard_normal((H, M, M)).astype(np.float32)
    table[:, :L, :L] = np.einsum("lhd,shd->hls", q[0], k[0]) / np.sqrt(D)
    attn, params = _module("random"), {"logits": table}
    mask = _padding([L, 19])
    w = mask.astype(np.float32)
    ref, ref_grads = _dense_and_grads(causal, q, k, v, mask, w)
    out = _apply(attn, causal, params, q, k, v, mask)
    np.testing.assert_allclose(out, ref, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(_grads(attn, causal, params, q, k, v, mask, w)[3], ref_grads[3],
                               atol=1e-5, rtol=1e-5)


def test_factorized_mode_is_random_mode_of_the_product():
    table = np.random.default_rng(3).standard_normal((H, M, M)).astype(np.float32)
    q, k, v = _qkv()
    mask = _padding([L, 19])
    eye = np.broadcast_to(np.eye(M, dtype=np.float32), (H, M, M))
    fact = _apply(_module("factorized", rank=M), True, {"a": table, "b": eye}, q, k, v, mask)
    rand = _apply(_module("random"), True, {"logits": table}, q, k, v, mask)
    np.testing.assert_allclose(fact, rand, atol=1e-5, rtol=1e-5)


def test_dense_mode_is_the_per_token_mlp():
    attn = _module("dense")
    p = _params(attn)
    q, k, v = _qkv()
    mask = _padding([L, 19])
    # Reference in numpy: logits = W2 relu(W1 q + b1) + b2, first L positions, masked softmax.
    h = np.maximum(np.einsum("blhd,hdf->blhf", q, p["w1"]) + p["b1"], 0)
    logits = (np.einsum("blhf,hfm->bhlm", h, p["w2"]) + p["b2"][None, :, None, :])[..., :L]
    real = mask != 0
    allowed = (real[:, None, :, None] & real[:, None, None, :] & np.tril(np.ones((L, L), bool)))
    e = np.where(allowed, np.exp(logits - logits.max(-1, keepdims=True)), 0)
    probs = e / np.maximum(e.sum(-1, keepdims=True), 1e-30)
    ref = np.einsum("bhls,bshd->blhd", probs, v)
    out = _apply(attn, True, p, q, k, v, mask)
    np.testing.assert_allclose(out, ref, atol=1e-5, rtol=1e-5)
    # No token-token interaction in the weights: keys are never read.
    np.testing.assert_array_equal(out, _apply(attn, True, p, q, -k, v, mask))


@pytest.mark.parametrize("case", ["dense", "random"])
def test_packed_segment_equals_the_segment_alone(case):
    attn = _module(case)
    p = _params(attn)
    q, k, v = _qkv()
    seg = np.repeat([[1] * 12 + [2] * 12 + [0] * 8], B, axis=0).astype(np.int32)
    packed = _apply(attn, True, p, q, k, v, seg)
    alone = _apply(attn, True, p, q[:, 12:24], k[:, 12:24], v[:, 12:24], ONES[:, :12])
    np.testing.assert_allclose(packed[:, 12:24], alone, atol=1e-6)


@pytest.mark.parametrize("case", ["dense", "random"])
@pytest.mark.parametrize("causal", [False, True])
def test_slice_path_matches_gather_path(case, causal, monkeypatch):
    """Rows of one segment from index 0 take the slice (`at_key_positions`); forcing the
    gather on the same padded batch must give the same outputs and gradients."""
    from hpnlp.attention import synthesizer
    attn = _module(case)
    p = _params(attn)
    q, k, v = _qkv()
    mask = _padding([L, 19])
    w = mask.astype(np.float32)
    run = lambda: (_call(attn, causal, p, q, k, v, mask),  # noqa: E731 (not jitted: no cache)
                   _weighted(lambda p, q, k, v: attn.apply({"params": p}, q, k, v, mask,
                                                           causal=causal))(p, q, k, v, w))
    pos = np.asarray(synthesizer.segment_positions(jnp.asarray(mask)))
    assert np.all((pos == np.arange(L)[None]) | (mask == 0))  # so the slice is taken
    out, grads = run()
    monkeypatch.setattr(synthesizer, "at_key_positions", lambda simple, general, pos, seg: general())
    out_g, grads_g = run()
    np.testing.assert_allclose(out, out_g, atol=1e-6)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_g)):
        np.testing.assert_allclose(a, b, atol=1e-6)


@pytest.mark.parametrize("case", ["dense", "factorized"])
def test_padding_invariance(case):
    attn = _module(case)
    p = _params(attn)
    q, k, v = _qkv()
    mask = _padding([20, 27])
    q2, k2, v2 = _qkv(seed=7)
    pad = (mask == 0)[:, :, None, None]
    mix = lambda a, b: np.where(pad, b, a)
    out1 = _apply(attn, True, p, q, k, v, mask)
    out2 = _apply(attn, True, p, mix(q, q2), mix(k, k2), mix(v, v2), mask)
    np.testing.assert_allclose(np.where(pad, 0, out1), np.where(pad, 0, out2), atol=1e-6)


def test_causality_by_gradient():
    attn = _module("dense")
    p = _params(attn)
    q, k, v = _qkv()
    t = 10
    _, gq, gk, gv = _grads(attn, True, p, q, k, v, ONES, np.eye(L, dtype=np.float32)[[t] * B])
    assert _max_abs(gq[:, t + 1:]) == 0.0
    assert _max_abs(gv[:, t + 1:]) == 0.0
    assert _max_abs(gv[:, : t + 1]) > 0.0
    assert _max_abs(gk) == 0.0  # keys are not read


def test_fully_masked_rows_are_zero_not_nan():
    attn = _module("dense")
    p = _params(attn)
    q, k, v = _qkv()
    mask = _padding([0, 5])
    out = _apply(attn, True, p, q, k, v, mask)
    chex.assert_tree_all_finite(out)
    assert _max_abs(out[0]) == 0.0
    chex.assert_tree_all_finite(_grads(attn, True, p, q, k, v, mask, np.ones((B, L), np.float32)))


def test_bfloat16_is_finite_and_close():
    attn = _module("dense")
    p = _params(attn)
    q, k, v = _qkv(dtype=jnp.bfloat16)
    mask = _padding([L, 9])
    out = _apply(attn, True, p, q, k, v, mask)
    assert out.dtype == jnp.bfloat16
    chex.assert_tree_all_finite(out)
    ref = _apply(attn, True, p, *(x.astype(np.float32) for x in (q, k, v)), mask)
    np.testing.assert_allclose(np.asarray(out, np.float32), ref, atol=5e-2)


def test_no_recompile_across_calls():
    """A module rebuilt per call (as from a config) is a static argument equal to the last:
    one program for all three calls, the one `test_padding_invariance[factorized]` compiled."""
    p = _params(_module("factorized"))
    assert_compiles_once(_apply, ((_module("factorized"), True, p, *_qkv(seed),
                                   _padding([L, 3 + seed])) for seed in range(3)))


@pytest.mark.parametrize("case", sorted(MODES))
def test_decode_matches_full_causal_forward(case):
    attn = _module(case)
    p = _params(attn)
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

    np.testing.assert_allclose(decode_all(p, q, k, v), _apply(attn, True, p, q, k, v, ONES),
                               atol=1e-5, rtol=1e-5)


def test_fixed_random_mode_is_the_seeded_draw_without_parameters():
    q, k, v = _qkv()
    attn = _module("fixed")
    assert _params(attn) == {}
    draw = jax.jit(fixed_random_rows, static_argnums=(0, 2, 3))
    table = draw(0, np.arange(M), H, M)  # [H, M, M], row i from fold_in(key(seed), i)
    np.testing.assert_allclose(_apply(attn, True, {}, q, k, v, ONES),
                               _apply(_module("random"), True, {"logits": table}, q, k, v, ONES),
                               atol=1e-6)


def _cfg(**opts):
    cd = default_configdict()
    cd.data.task, cd.data.seq_len = "byte_lm", 64
    cd.model.kind, cd.model.max_len = "lm", 64
    cd.train.batch_size = 8
    cd.attention.name, cd.attention.options = "synthesizer", opts
    return from_configdict(cd)


def test_bad_input_and_config_errors():
    validate(_cfg(mode="factorized", max_len=64), num_devices=1)  # causal LM is allowed
    with pytest.raises(ConfigError, match=r"`attention.options.mode` = 'sparse' .*dense"):
        validate(_cfg(mode="sparse", max_len=64), num_devices=1)
    with pytest.raises(ConfigError, match=r"`attention.options.max_len` = 32 .*data.seq_len=64"):
        validate(_cfg(max_len=32), num_devices=1)
    with pytest.raises(ConfigError, match=r"`attention.options.rank` = 0"):
        validate(_cfg(max_len=64, rank=0), num_devices=1)
    # options the mode never reads are refused, not ignored (a bug hunt, session 92)
    validate(_cfg(mode="factorized", max_len=64, rank=4, trainable=False, seed=3), num_devices=1)
    for opts, msg in [({"mode": "dense", "rank": 4}, r"`attention.options.rank` = 4 .*'dense'"),
                      ({"mode": "random", "hidden_dim": 8}, r"options.hidden_dim` = 8 .*'random'"),
                      ({"mode": "dense", "trainable": False},
                       r"options.trainable` = False .*'dense'"),
                      ({"mode": "random", "seed": 3}, r"options.seed` = 3 .*trainable=True: only")]:
        with pytest.raises(ConfigError, match=msg):
            validate(_cfg(max_len=64, **opts), num_devices=1)
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="max_len=16"):
        A.get("synthesizer")(max_len=16).init(jax.random.key(0), q, k, v, None, causal=True)
    with pytest.raises(ValueError, match="head dims differ"):
        _module().init(jax.random.key(0), q, k[..., :4], v, None, causal=True)
    with pytest.raises(ValueError, match="max_len=48"):
        _module().init_cache(B, 64, H, D, jnp.float32)


def test_inside_the_lm():
    V, T = 40, 16
    cfg = from_configdict(default_configdict())
    cfg = dataclasses.replace(
        cfg, model=ModelConfig(kind="lm", vocab_size=V, width=16, depth=1, num_heads=2,
                               mlp_dim=32, max_len=T, dropout=0.0),
        attention=AttentionConfig("synthesizer", {"mode": "dense", "max_len": T}))
    toks = np.random.default_rng(0).integers(0, V, (B, T)).astype(np.int32)
    seg = np.asarray([[1] * 7 + [2] * 9, [1] * 11 + [0] * 5], np.int32)  # packed and padded
    pos = np.asarray([list(range(7)) + list(range(9)), list(range(11)) + [0] * 5], np.int32)
    batch = {"inputs": toks, "targets": np.roll(toks, -1, 1), "segment_ids": seg, "positions": pos}
    model = models.build(cfg, deterministic=True)
    params = _fill(jax.eval_shape(model.init, _key(0), batch)["params"])
    loss_fn = lambda p: model.apply({"params": p}, batch)["loss"]
    loss, grads = jax.jit(jax.value_and_grad(loss_fn))(params)
    chex.assert_tree_all_finite((loss, grads))
    assert _max_abs(grads["trunk"]["block_0"]["attention"]["attn"]["w2"]) > 0.0


def test_dense_mode_weights_start_at_each_head_s_own_fan_in():
    """A review (session 103): the heads axis counted into lecun_normal's fan-in, so each
    head's w1 [D, F] and w2 [F, M] started sqrt(H) smaller than a linear layer's."""
    q = jnp.ones((1, 16, 4, 64))
    attn = A.get("synthesizer")(max_len=16, mode="dense")
    p = nn.unbox(jax.jit(lambda: attn.init(_key(0), q, q, q, None, causal=False))()["params"])
    np.testing.assert_allclose(float(jnp.std(p["w1"])), 64 ** -0.5, rtol=0.05)  # fan-in D
    np.testing.assert_allclose(float(jnp.std(p["w2"])), 64 ** -0.5, rtol=0.1)  # fan-in F = D
