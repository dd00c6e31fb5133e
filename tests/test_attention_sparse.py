"""Block-sparse patterns (local, sliding_window, strided, bigbird) against their masked
dense twins, plus the interface contracts every attention variant keeps."""

import dataclasses
import functools

import chex
import flax.linen as nn
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

import hpnlp.attention as A
import hpnlp.attention.sparse as sparse
from hpnlp import models
from hpnlp.attention.dense import dense_attention
from hpnlp.config import AttentionConfig, ConfigError, ModelConfig, default_configdict, from_configdict
from hpnlp.models.transformer import positions_of

from attention_testlib import assert_compiles_once

B, H, D = 2, 2, 8
# (name, options, length): lengths that the block size (or stride) does not divide
# exercise the automatic padding.
CASES = {
    "local": ("local", {"block_size": 8}, 32),
    "local_prev": ("local", {"block_size": 8, "prev_block": True}, 37),
    "sliding_window": ("sliding_window", {"block_size": 4, "window": 11}, 37),
    "strided": ("strided", {"block_size": 4, "stride": 6}, 32),
    "fixed": ("strided", {"block_size": 8, "stride": 8, "mode": "fixed", "num_summary": 3}, 37),
    "bigbird": ("bigbird", {"block_size": 4, "num_global_blocks": 1, "num_random_blocks": 2}, 37),
}
ONE_PER_VARIANT = ["local_prev", "sliding_window", "strided", "bigbird"]
# These tests check values, not speed: skipping LLVM's optimizer cuts compile time ~3x.
_jit = functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0,
                                                    "xla_llvm_disable_expensive_passes": True})


def _module(case):
    name, opts, _ = CASES[case]
    return A.get(name)(**opts)


@functools.partial(_jit, static_argnums=(0, 1))
def _forward(attn, causal, q, k, v, mask):
    """The module a static argument, as a trainer's step holds it: one compile per
    configuration however often it is rebuilt (`test_no_recompile_across_calls`)."""
    return attn(q, k, v, mask, causal=causal)


def _qkv(length, seed=0, dtype=jnp.float32):
    ks = jax.random.split(jax.random.key(seed), 3)
    return tuple(jax.random.normal(k, (B, length, H, D), dtype) for k in ks)


def _padding(lengths, length):
    return jnp.asarray((np.arange(length)[None, :] < np.asarray(lengths)[:, None]).astype(np.int32))


def _random_mask(length, seed):
    """Row 0: random right padding. Row 1: two packed segments, then padding."""
    rng = np.random.default_rng(seed)
    row0 = (np.arange(length) < rng.integers(length // 3, length + 1)).astype(np.int32)
    cut, end = sorted(rng.integers(4, length, size=2))
    row1 = np.where(np.arange(length) < cut, 1, np.where(np.arange(length) < end, 2, 0))
    return jnp.asarray(np.stack([row0, row1]).astype(np.int32))


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_masked_dense_twin(case):
    """Outputs and gradients equal the dense oracle run with the pattern's [L, L] mask,
    causal and not, with random right padding and packed segments."""
    attn = _module(case)
    length = CASES[case][2]
    q, k, v = _qkv(length)
    mask = _random_mask(length, seed=len(case))
    real = (mask != 0)[:, :, None, None]

    def loss(fn):
        return lambda q, k, v: jnp.sum(jnp.where(real, jnp.sin(fn(q, k, v)), 0.0))

    @_jit
    def all_results(q, k, v):
        res = {}
        for causal in (False, True):
            fast = lambda q, k, v, c=causal: attn(q, k, v, mask, causal=c)  # noqa: E731
            twin = lambda q, k, v, c=causal: sparse.masked_dense_twin(  # noqa: E731
                attn, q, k, v, mask, causal=c)
            res[causal] = [(fn(q, k, v), jax.grad(loss(fn), (0, 1, 2))(q, k, v)) for fn in (fast, twin)]
        return res, dense_attention(q, k, v, mask)

    res, dense = all_results(q, k, v)
    for causal, ((out, grads), (ref, ref_grads)) in res.items():
        np.testing.assert_allclose(out, ref, atol=1e-5, rtol=1e-5, err_msg=f"causal={causal}")
        for g, g_ref in zip(grads, ref_grads):
            np.testing.assert_allclose(g, g_ref, atol=1e-5, rtol=1e-5, err_msg=f"causal={causal}")
        # The pattern really is sparse (the twin is not dense attention in disguise).
        assert attn.pattern_mask(length, causal).mean() < (0.5 if causal else 0.9)
    # ...and the result differs from dense attention where the pattern hides keys.
    assert float(jnp.abs(res[False][0][0] - dense).max()) > 1e-3


def test_patterns_follow_their_definitions():
    L = 24
    i, j = np.arange(L)[:, None], np.arange(L)[None, :]
    sw = A.get("sliding_window")(block_size=4, window=3)
    np.testing.assert_array_equal(sw.pattern_mask(L, False), np.abs(i - j) <= 2)
    np.testing.assert_array_equal(sw.pattern_mask(L, True), (i - j >= 0) & (i - j <= 2))
    loc = A.get("local")(block_size=4, prev_block=True)
    assert loc.pattern_mask(L, False)[9].nonzero()[0].tolist() == list(range(4, 12))
    st = A.get("strided")(block_size=3, stride=5)
    assert st.pattern_mask(L, True)[17].nonzero()[0].tolist() == [2, 7, 12, 15, 16, 17]
    fx = A.get("strided")(block_size=4, stride=4, mode="fixed", num_summary=1)
    assert fx.pattern_mask(L, True)[13].nonzero()[0].tolist() == [3, 7, 11, 12, 13]

    bb = A.get("bigbird")(block_size=2, num_window_blocks=3, num_global_blocks=1,
                          num_random_blocks=2, seed=0)
    table = bb.block_table(12, causal=False)
    assert table[0].all() and table[:, 0].all()  # global block: sees and is seen by all
    for n in range(1, 12):  # window + global + exactly 2 random blocks elsewhere
        window = {m for m in range(n - 1, n + 2) if 0 <= m < 12} | {0}
        assert len(set(np.flatnonzero(table[n])) - window) == 2
    np.testing.assert_array_equal(table, bb.block_table(12, causal=False))  # deterministic
    other = A.get("bigbird")(block_size=2, num_global_blocks=1, num_random_blocks=2, seed=1)
    assert not np.array_equal(table, other.block_table(12, causal=False))  # the seed matters
    causal = bb.block_table(12, causal=True)
    assert not np.triu(causal[1:, 1:], 1).any()  # no future blocks below the global rows
    np.testing.assert_array_equal(bb.block_table(7, causal=True), causal[:7, :7])  # prefix-stable


def test_no_dense_length_by_length_array():
    """No intermediate of the sparse path (forward or backward) has two axes of length L."""
    L = 64
    q, k, v = _qkv(L)
    mask = _padding([L, 40], L)
    for case in ONE_PER_VARIANT + ["fixed"]:
        name, opts, _ = CASES[case]
        attn = A.get(name)(**opts)
        fn = lambda q, k, v: jnp.sum(attn(q, k, v, mask, causal=False))  # noqa: E731
        jaxpr = jax.make_jaxpr(jax.grad(fn, (0, 1, 2)))(q, k, v)

        def shapes(jpr):
            for eqn in jpr.eqns:
                for var in eqn.outvars:
                    yield getattr(var.aval, "shape", ())
                for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                    yield from shapes(sub)

        worst = max(sum(d == L for d in s) for s in shapes(jaxpr.jaxpr))
        assert worst <= 1, case


@pytest.mark.parametrize("case", ONE_PER_VARIANT)
def test_padding_invariance(case):
    """Changing what sits in padded positions never changes the real outputs."""
    attn, length = _module(case), CASES[case][2]
    q, k, v = _qkv(length)
    q2, k2, v2 = _qkv(length, seed=7)
    mask = _padding([20, 27], length)
    pad = (mask == 0)[:, :, None, None]
    mix = lambda a, b: jnp.where(pad, b, a)  # noqa: E731
    out1 = _forward(attn, False, q, k, v, mask)
    out2 = _forward(attn, False, mix(q, q2), mix(k, k2), mix(v, v2), mask)
    np.testing.assert_allclose(jnp.where(pad, 0, out1), jnp.where(pad, 0, out2), atol=1e-6)


@pytest.mark.parametrize("case", ONE_PER_VARIANT)
def test_causality_by_gradient(case):
    attn, length = _module(case), CASES[case][2]
    q, k, v = _qkv(length)
    t = 17

    def out_t(k, v):
        return jnp.sum(attn(q, k, v, None, causal=True)[:, t])

    gk, gv = _jit(jax.grad(out_t, (0, 1)))(k, v)
    assert float(jnp.abs(gk[:, t + 1:]).max()) == 0.0
    assert float(jnp.abs(gv[:, t + 1:]).max()) == 0.0
    assert float(jnp.abs(gv[:, t]).max()) > 0.0


@pytest.mark.parametrize("case", ONE_PER_VARIANT)
def test_fully_masked_rows_are_zero_not_nan(case):
    attn, length = _module(case), CASES[case][2]
    q, k, v = _qkv(length)
    mask = _padding([0, 5], length)
    f = lambda q: attn(q, k, v, mask, causal=True)  # noqa: E731
    out, g = _jit(lambda q: (f(q), jax.grad(lambda q: jnp.sum(f(q)))(q)))(q)
    chex.assert_tree_all_finite((out, g))
    assert float(jnp.abs(out[0]).max()) == 0.0
    assert float(jnp.abs(out[1, 5:]).max()) == 0.0


@pytest.mark.parametrize("case", ONE_PER_VARIANT)
def test_bfloat16_is_finite_and_close(case):
    attn, length = _module(case), CASES[case][2]
    q, k, v = _qkv(length, dtype=jnp.bfloat16)
    mask = _padding([length, 9], length)
    twin = lambda q, k, v: sparse.masked_dense_twin(  # noqa: E731
        attn, *(x.astype(jnp.float32) for x in (q, k, v)), mask, causal=True)
    out, ref = _jit(lambda q, k, v: (attn(q, k, v, mask, causal=True), twin(q, k, v)))(q, k, v)
    assert out.dtype == jnp.bfloat16
    chex.assert_tree_all_finite(out)
    np.testing.assert_allclose(out.astype(jnp.float32), ref, atol=5e-2)


@pytest.mark.parametrize("case", ONE_PER_VARIANT)
def test_no_recompile_across_calls(case):
    """A module rebuilt per call (as from a config) is a static argument equal to the last:
    one program for all three calls, the one `test_padding_invariance` compiled."""
    length = CASES[case][2]
    assert_compiles_once(_forward, ((_module(case), False, *_qkv(length, seed),
                                     _padding([length, 3 + seed], length)) for seed in range(3)))


@pytest.mark.parametrize("case", ["local", "local_prev", "sliding_window", "strided", "fixed", "bigbird"])
def test_decode_matches_full_causal_forward(case):
    attn = _module(case)
    L = 29
    q, k, v = _qkv(L)
    cache = attn.init_cache(B, 32, H, D, jnp.float32)
    if case in ("local", "local_prev", "sliding_window"):  # a ring buffer, not a full cache
        W = {"local": 8, "local_prev": 16, "sliding_window": 11}[case]
        chex.assert_shape(cache["k"], (B, W, H, D))

    @_jit
    def decode_and_full(cache, q, k, v):
        def step(cache, qkv_t):
            out, cache = attn.decode_step(cache, *(x[:, None] for x in qkv_t))
            return cache, out[:, 0]

        _, outs_LBHD = jax.lax.scan(step, cache, tuple(x.swapaxes(0, 1) for x in (q, k, v)))
        return outs_LBHD.swapaxes(0, 1), attn(q, k, v, None, causal=True)

    decoded, full = decode_and_full(cache, q, k, v)
    np.testing.assert_allclose(decoded, full, atol=1e-5)


def test_strided_value_head_dim_other_than_the_querys():
    """A bug hunt (session 100): v's head dim 6 beside q's 8 failed to reshape in the
    strided column part; now its own, equal to the masked dense twin."""
    q, k, _ = _qkv(32)
    v6 = jax.random.normal(jax.random.key(5), (B, 32, H, 6))
    mask = _random_mask(32, seed=3)
    mods = [_module("strided"), _module("fixed")]
    outs = _jit(lambda q, k, v: [(m(q, k, v, mask, causal=True),
                                  sparse.masked_dense_twin(m, q, k, v, mask, causal=True))
                                 for m in mods])(q, k, v6)
    for out, ref in outs:
        assert out.shape == (B, 32, H, 6)
        np.testing.assert_allclose(out, ref, atol=1e-5, rtol=1e-5)


def test_bad_inputs_have_clear_errors():
    q, k, v = _qkv(32)
    with pytest.raises(ValueError, match="head dims differ"):
        A.get("local")(block_size=8)(q, k[..., :4], v, None, causal=False)
    with pytest.raises(ValueError, match="self-attention"):
        A.get("sliding_window")(block_size=8)(q, k[:, :16], v[:, :16], None, causal=False)
    with pytest.raises(ValueError, match=r"block_size=0 is not allowed: must be a positive"):
        A.get("local")(block_size=0)(q, k, v, None, causal=False)
    with pytest.raises(ValueError, match=r"mode='dilated' is not allowed: choose one of"):
        A.get("strided")(mode="dilated")(q, k, v, None, causal=False)
    checks = [
        ("local", {"block_size": -4}, r"`attention.options.block_size` = -4 is not allowed"),
        ("local", {"prev_block": 1}, r"`attention.options.prev_block` = 1 is not allowed"),
        ("sliding_window", {"window": 0}, r"`attention.options.window` = 0 is not allowed"),
        ("strided", {"mode": "fixed", "stride": 8, "num_summary": 9},
         r"`attention.options.num_summary` = 9 is not allowed: must be <= stride=8"),
        ("strided", {"stride": 8, "num_summary": 2},  # session 92: taken, never read
         r"`attention.options.num_summary` = 2 is not allowed with mode='strided'"),
        # a bug hunt (session 91): padded 512 tokens to 4032 (lcm(64, 63)), silently
        ("strided", {"block_size": 64, "stride": 63},
         r"`attention.options.stride` = 63 is not allowed: .* lcm\(64, 63\) = 4032"),
        ("bigbird", {"num_window_blocks": 2}, r"`attention.options.num_window_blocks` = 2 .*odd"),
        ("bigbird", {"num_random_blocks": -1}, r"`attention.options.num_random_blocks` = -1"),
    ]
    for name, opts, msg in checks:
        with pytest.raises(ConfigError, match=msg):
            A.get(name).check_config(opts, seq_len=512, causal=True)
    # Block sizes that do not divide the length are padded inside the call, not refused.
    A.get("bigbird").check_config({"block_size": 48}, seq_len=100, causal=False)


@pytest.mark.parametrize("case", ONE_PER_VARIANT)
def test_inside_the_model(case):
    name, opts, _ = CASES[case]
    kind = "classifier" if name == "bigbird" else "lm"  # bigbird as an encoder, the rest causal
    L = 24
    cfg = from_configdict(default_configdict())
    cfg = dataclasses.replace(
        cfg, attention=AttentionConfig(name, opts),
        model=ModelConfig(kind=kind, vocab_size=40, num_classes=3, width=16, depth=1, num_heads=2,
                          mlp_dim=32, max_len=L, dropout=0.0))
    A.get(name).check_config(opts, seq_len=L, causal=kind == "lm")
    rng = np.random.default_rng(0)
    toks = rng.integers(0, 40, (B, L)).astype(np.int32)
    seg = np.asarray(_padding([L, 13], L))
    batch = {"inputs": toks, "segment_ids": seg}
    if kind == "lm":
        batch.update(targets=np.roll(toks, -1, 1), positions=np.asarray(positions_of(seg)))
    else:
        batch.update(label=np.array([0, 2], np.int32), weight=np.ones(B, np.float32))
    model = models.build(cfg, deterministic=True)

    @_jit
    def loss_and_grads(key):  # init inside the same jit: one compile
        params = nn.unbox(model.init(key, batch)["params"])
        return jax.value_and_grad(lambda p: model.apply({"params": p}, batch)["loss"])(params)

    loss, grads = loss_and_grads(jax.random.key(0))
    chex.assert_tree_all_finite((loss, grads))


def test_lm_decoding_through_the_model_matches_forward():
    """The ring-buffer cache inside the LM: token-by-token log-probs equal the full pass."""
    L = 16
    cfg = from_configdict(default_configdict())
    cfg = dataclasses.replace(
        cfg, attention=AttentionConfig("sliding_window", {"block_size": 4, "window": 6}),
        model=ModelConfig(kind="lm", vocab_size=40, width=16, depth=1, num_heads=2, mlp_dim=32,
                          max_len=L, dropout=0.0))
    toks = np.random.default_rng(0).integers(0, 40, (B, L)).astype(np.int32)
    seg = np.ones((B, L), np.int32)
    batch = {"inputs": toks, "targets": toks, "segment_ids": seg, "positions": np.asarray(positions_of(seg))}
    model = models.build(cfg, deterministic=True)
    dec = models.build(cfg, deterministic=True, decode=True)

    @_jit
    def decoded_and_full(key):  # everything in one jit: one compile
        params = nn.unbox(model.init(key, batch)["params"])
        cache = dec.init(key, jnp.zeros((B, 1), jnp.int32), method="decode_step")["cache"]
        ring_k = cache["trunk"]["block_0"]["attention"]["state"]["k"]
        chex.assert_shape(ring_k, (B, 6, H, D))  # `window` slots, not max_len

        def step(cache, tok_B):
            lp, upd = dec.apply({"params": params, "cache": cache}, tok_B[:, None],
                                method="decode_step", mutable=["cache"])
            return upd["cache"], lp

        _, lp_LBV = jax.lax.scan(step, cache, toks.T)
        return lp_LBV.swapaxes(0, 1), model.apply({"params": params}, batch, method="log_probs")

    decoded, full = decoded_and_full(jax.random.key(0))
    np.testing.assert_allclose(decoded, full, atol=2e-5)
