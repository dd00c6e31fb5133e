"""Every attention variant against the `dense` oracle, plus the interface contracts."""

import chex
import jax
import jax.numpy as jnp
import jax.test_util
import numpy as np
import pytest

import hpnlp.attention as A
from hpnlp.attention.dense import dense_attention

from attention_testlib import apply_attention, assert_compiles_once

B, L, H, D = 2, 32, 2, 8
EXACT = {"dense": {}, "xla": {}, "chunked": {"block_q": 8, "block_k": 16}}


def _qkv(seed=0, dtype=jnp.float32, length=L):
    ks = jax.random.split(jax.random.key(seed), 3)
    return tuple(jax.random.normal(k, (B, length, H, D), dtype) for k in ks)


def _padding(lengths, length=L):
    return jnp.asarray((np.arange(length)[None, :] < np.asarray(lengths)[:, None]).astype(np.int32))


def _run(name, q, k, v, mask, causal):
    return A.get(name)(**EXACT[name])(q, k, v, mask, causal=causal, deterministic=True)


def test_registry_lists_and_rejects():
    assert {"dense", "xla", "chunked"} <= set(A.names())
    with pytest.raises(ValueError, match="choose one of .*dense"):
        A.get("no_such_attention")
    # `registered`: a variant for one `with` block, gone afterwards even on an error.
    class Tmp(A.Attention):
        pass
    with pytest.raises(RuntimeError), A.registered("tmp_variant", Tmp):
        assert A.get("tmp_variant") is Tmp and Tmp.registry_name == "tmp_variant"
        raise RuntimeError
    assert "tmp_variant" not in A.names()
    with pytest.raises(ValueError, match="registered twice"), A.registered("dense", Tmp):
        pass
    assert A.get("dense") is not Tmp


def _np_attention(q, k, v, lengths, causal):
    """softmax(q k^T / sqrt(D)) v in float64 NumPy, keys and queries past each row's length
    left out (their rows zeros): the oracle's own oracle."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    n = q.shape[1]
    ok = np.arange(n)[None, :] < np.asarray(lengths)[:, None]
    allowed = ok[:, None, :, None] & ok[:, None, None, :]
    if causal:
        allowed = allowed & np.tril(np.ones((n, n), bool))
    s = np.where(allowed, np.einsum("blhd,bshd->bhls", q, k) / np.sqrt(q.shape[-1]), -np.inf)
    with np.errstate(invalid="ignore"):
        p = np.exp(s - s.max(-1, keepdims=True))
        p = np.nan_to_num(p / p.sum(-1, keepdims=True))
    return np.einsum("bhls,bshd->blhd", p, v)


@pytest.mark.parametrize("causal", [False, True])
def test_dense_matches_numpy_in_float64(causal):
    """`dense` itself (the other variants' oracle, which the test below holds them to)
    against float64 NumPy, and its gradients against finite differences (review r9: the
    `dense` case of that test compared dense_attention with itself)."""
    q, k, v = _qkv()
    mask = _padding([L, 19])
    np.testing.assert_allclose(dense_attention(q, k, v, mask, causal=causal),
                               _np_attention(q, k, v, [L, 19], causal), atol=1e-5, rtol=1e-5)
    jax.test_util.check_grads(lambda q, k, v: dense_attention(q, k, v, mask, causal=causal),
                              (q, k, v), order=1, modes=["rev"], atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("name", sorted(set(EXACT) - {"dense"}))
@pytest.mark.parametrize("causal", [False, True])
def test_exact_variants_match_dense(name, causal):
    q, k, v = _qkv()
    mask = _padding([L, 19])
    ref = dense_attention(q, k, v, mask, causal=causal)
    out = _run(name, q, k, v, mask, causal)
    np.testing.assert_allclose(out, ref, atol=1e-5, rtol=1e-5)

    def loss(fn):
        return lambda q, k, v: jnp.sum(jnp.sin(fn(q, k, v)) * _padding([L, 19])[:, :, None, None])

    g_ref = jax.grad(loss(lambda q, k, v: dense_attention(q, k, v, mask, causal=causal)), (0, 1, 2))(q, k, v)
    g = jax.grad(loss(lambda q, k, v: _run(name, q, k, v, mask, causal)), (0, 1, 2))(q, k, v)
    for a, b in zip(g, g_ref):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


def test_packed_segments_do_not_mix():
    q, k, v = _qkv()
    seg = jnp.asarray(np.repeat([[1] * 12 + [2] * 12 + [0] * 8], B, axis=0))
    for name in ("dense", "chunked"):
        out = _run(name, q, k, v, seg, causal=True)
        # Segment 2 alone, positions 12..23, must give the same result as inside the pack.
        alone = dense_attention(q[:, 12:24], k[:, 12:24], v[:, 12:24], None, causal=True)
        np.testing.assert_allclose(out[:, 12:24], alone, atol=1e-5)


@pytest.mark.parametrize("name", sorted(EXACT))
def test_padding_invariance(name):
    """Changing what sits in padded positions never changes the real outputs."""
    q, k, v = _qkv()
    mask = _padding([20, 27])
    q2, k2, v2 = _qkv(seed=7)
    pad = (mask == 0)[:, :, None, None]
    mix = lambda a, b: jnp.where(pad, b, a)
    # Jitted as trained; the recompile test below calls this same program.
    attn = A.get(name)(**EXACT[name])
    out1 = apply_attention(attn, False, {}, q, k, v, mask)
    out2 = apply_attention(attn, False, {}, mix(q, q2), mix(k, k2), mix(v, v2), mask)
    np.testing.assert_allclose(jnp.where(pad, 0, out1), jnp.where(pad, 0, out2), atol=1e-6)


@pytest.mark.parametrize("name", sorted(EXACT))
def test_causality_by_gradient(name):
    q, k, v = _qkv()
    t = 10

    def out_t(k, v):
        return jnp.sum(_run(name, q, k, v, None, True)[:, t])

    gk, gv = jax.grad(out_t, (0, 1))(k, v)
    assert float(jnp.abs(gk[:, t + 1:]).max()) == 0.0
    assert float(jnp.abs(gv[:, t + 1:]).max()) == 0.0
    assert float(jnp.abs(gv[:, : t + 1]).max()) > 0.0


@pytest.mark.parametrize("name", sorted(EXACT))
def test_fully_masked_rows_are_zero_not_nan(name):
    q, k, v = _qkv()
    mask = _padding([0, 5])
    out = _run(name, q, k, v, mask, True)
    chex.assert_tree_all_finite(out)
    assert float(jnp.abs(out[0]).max()) == 0.0
    g = jax.grad(lambda q: jnp.sum(_run(name, q, k, v, mask, True)))(q)
    chex.assert_tree_all_finite(g)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("name", sorted(EXACT))
def test_half_precision_is_finite_and_close(name, dtype):
    """bfloat16 and float16 inputs (model.dtype): finite, close to float32, in their dtype;
    their gradients too (XLA:CPU has no float16 x float16 -> float32 product, which `xla`'s
    call asks for: it runs on float32 copies there), compared with float32's (a review,
    session 118: only their dtype and finiteness were checked, bfloat16's not at all)."""
    q, k, v = _qkv(dtype=dtype)
    run = jax.jit(lambda q, k, v: _run(name, q, k, v, _padding([L, 9]), True))  # as trained
    out = run(q, k, v)
    assert out.dtype == dtype
    chex.assert_tree_all_finite(out)
    ref = dense_attention(*(x.astype(jnp.float32) for x in (q, k, v)), _padding([L, 9]), causal=True)
    np.testing.assert_allclose(out.astype(jnp.float32), ref, atol=5e-2)
    g = jax.jit(jax.grad(lambda q: jnp.sum(run(q, k, v).astype(jnp.float32))))(q)
    assert g.dtype == dtype
    chex.assert_tree_all_finite(g)
    g_ref = jax.grad(lambda q: jnp.sum(dense_attention(
        q, k.astype(jnp.float32), v.astype(jnp.float32), _padding([L, 9]), causal=True)))(
        q.astype(jnp.float32))
    np.testing.assert_allclose(g.astype(jnp.float32), g_ref,
                               atol=5e-2 * float(jnp.abs(g_ref).max()))


@pytest.mark.parametrize("name", sorted(EXACT))
def test_no_recompile_across_calls(name):
    """A module rebuilt per call (as from a config) is a static argument equal to the last:
    one program for all three calls, the one `test_padding_invariance` compiled."""
    assert_compiles_once(apply_attention, (
        (A.get(name)(**EXACT[name]), False, {}, *_qkv(seed), _padding([L, 3 + seed]))
        for seed in range(3)))


# 4.0 s in the fast suite on the Xeon model 207 (2026-12-07, --durations: the suite
# read 7 min 58 s for 1838 tests): CI's slow part runs it
@pytest.mark.slow
def test_decode_cache_matches_full_forward():
    q, k, v = _qkv()
    attn = A.get("dense")()
    cache = attn.init_cache(B, L, H, D, jnp.float32)
    outs = []
    for t in range(L):
        o, cache = attn.decode_step(cache, q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1])
        outs.append(o)
    np.testing.assert_allclose(jnp.concatenate(outs, 1), dense_attention(q, k, v, causal=True), atol=1e-5)


def test_bad_inputs_have_clear_errors():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="head dims differ"):
        A.get("dense")()(q, k[..., :4], v, None, causal=False)
    with pytest.raises(ValueError, match=r"\[batch, length, heads, head_dim\]"):
        A.get("dense")()(q[0], k[0], v[0], None, causal=False)
    with pytest.raises(ValueError, match="segment ids of shape"):
        A.get("dense")()(q, k, v, jnp.ones((B, L, L)), causal=False)
    with pytest.raises(ValueError, match="block_q=12 must be an integer dividing"):
        A.get("chunked")(block_q=12)(q, k, v, None, causal=False)
    # a float or bool block (a review, session 118: 8.0 failed in jnp.pad, True ran as 1)
    for bad in (8.0, True):
        with pytest.raises(ValueError, match=rf"block_k={bad!r} must be an integer dividing"):
            A.get("chunked")(block_k=bad)(q, k, v, None, causal=False)
    # found by the crash hunt: dense (and xla, kernel...) failed inside a broadcast, or
    # read the query's lengths as the keys'
    for name in ("dense", "xla", "chunked"):
        with pytest.raises(ValueError, match=f"query length 3 must equal the key length {L}"):
            A.get(name)()(q[:, :3], k, v, jnp.ones((B, 3), jnp.int32), causal=False)


def test_xla_refuses_a_value_head_dim_other_than_the_keys():
    """A review (session 107): `jax.nn.dot_product_attention` needs v shaped like k, and its
    own error named neither the variant nor a way out."""
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"'xla' .*head dim equal to k's.*use 'dense'"):
        A.get("xla")()(q, k, v[..., :6], None, causal=False)


def test_no_queries_or_no_keys_give_zeros():
    """Found by the crash hunt: dense (the reference) failed on a max over no keys, and
    chunked's XLA path divided by zero choosing blocks for an empty length."""
    q, k, v = _qkv()
    for name, impl in (("dense", {}), ("chunked", {"impl": "xla"}), ("chunked", {})):
        for Lq, S in ((0, 0), (3, 0), (0, 3)):
            out = A.get(name)(**impl)(q[:, :Lq], k[:, :S], v[:, :S], None, causal=False)
            assert out.shape == (B, Lq, H, D) and float(jnp.abs(out).sum()) == 0.0


# Variants whose decode cache is their own (not `Attention.exact_cache`), tiny options.
OWN_CACHE = {
    "local": {"block_size": 4}, "sliding_window": {"block_size": 4, "window": 6},
    "strided": {"block_size": 4, "stride": 4},
    "bigbird": {"block_size": 4, "num_global_blocks": 1, "num_random_blocks": 1},
    "lsh": {"chunk_size": 4, "num_buckets": 4}, "synthesizer": {"max_len": 16},
    "clustered": {"chunk_size": 4}, "performer": {"num_features": 8, "chunk_size": 4},
    "linear": {"chunk_size": 4},
}


def test_own_cache_list_names_every_variant_with_a_cache_of_its_own():
    """So a new such variant gets the refusal test below (and the check it tests)."""
    assert set(OWN_CACHE) == {n for n in A.names() if not A.get(n).exact_cache()}


@pytest.mark.parametrize("name", sorted(OWN_CACHE))
def test_own_cache_decode_refuses_several_tokens_or_per_row_index(name):
    """A review (r9 F1): these steps write one token at one slot and move the index by one,
    so K = 2 tokens or an index per row computed a wrong result silently (a ring buffer
    overwrote slots, a recurrent state dropped tokens 2..K) or failed deep in a broadcast
    (`clustered`). Traced only (eval_shape): the refusal happens before any compute."""
    n = 16
    attn = A.get(name)(**OWN_CACHE[name])
    assert not type(attn).exact_cache()
    q, k, v = _qkv(length=n)
    variables = jax.eval_shape(lambda q, k, v: attn.init(jax.random.key(0), q, k, v,
                                                         causal=True), q, k, v)
    step = lambda w, c, q, k, v: attn.apply(w, c, q, k, v, method="decode_step")  # noqa: E731
    cache = attn.init_cache(B, n, H, D, jnp.float32)
    per_row = dict(cache, index=jnp.zeros((B,), jnp.int32))
    for c, K, why in ((cache, 2, r"2 tokens and an index of shape \(\)"),
                      (per_row, 1, rf"1 tokens and an index of shape \({B},\)")):
        with pytest.raises(ValueError, match=f"{name} attention decodes one token a call with "
                                             f"one index for every row .*{why}.*exact-cache"):
            jax.eval_shape(step, variables, c, q[:, :K], k[:, :K], v[:, :K])
    jax.eval_shape(step, variables, cache, q[:, :1], k[:, :1], v[:, :1])  # one token: fine
