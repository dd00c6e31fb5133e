"""The decoding step's attention over a key/value cache (`cache_cpu`): the CPU kernel
against its XLA twin in float32 (1e-5) and bfloat16, on head dims no vector divides,
several new queries, a first query that sees no key, an index past the cache, a position per
row, one and two threads; its gradients; that every variant's default decode step runs it (and
`impl='xla'` does not); an int8 cache (`quant.kv_cache`) the same ways; and clear errors where
it cannot run."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hpnlp.attention as A
import hpnlp.attention.cache_cpu as CC

needs_kernel = pytest.mark.kernel(CC.KERNEL)

CASES = [  # B, L, T, H, D, index
    (2, 1, 37, 3, 20, 5),    # a head dim of one vector and a tail
    (1, 1, 40, 2, 64, 39),   # the whole cache
    (3, 2, 40, 2, 16, 0),    # two new queries; the first sees one key
    (1, 3, 9, 1, 7, -1),     # a head dim under one vector; the first query sees no key
    (2, 1, 17, 2, 16, 30),   # an index past the cache: every key
    (2, 1, 300, 4, 64, 299),  # 307K floats read: past 128K, the kernel splits it over two threads
    (4, 3, 21, 2, 20, (-1, 5, 20, 12)),  # each row's own position (speculative decoding)
    (1, 2, 20, 2, 176, 19),  # 11 vectors of a value row (8 + 3 accumulators; AVX2: 8 + 8 + 6)
]
# grouped-query caches: B, L, T, H, D, index, G key/value heads
GROUPED = [
    (2, 2, 33, 4, 20, 10, 2),
    (1, 1, 300, 8, 64, 299, 1),  # multi-query, two threads
    (2, 1, 40, 6, 16, (3, 39), 3),
    (1, 2, 30, 3, 16, 12, 1),  # 3 heads a group: split over 2 threads unevenly (2 + 1)
    (1, 1, 50, 4, 16, 49, 1),  # over 3 threads: 2 + 2 + an empty item
    (3, 1, 24, 2, 16, 20, 1),  # 3 groups on 2 threads
    # rows of more than 8 vectors (attend_heads_wide: a latent's row): 10 vectors, 8 heads,
    # rows past one L1 block (51 rows), each row's own position; 11 (3 + 3 + 3 + 2 output
    # vectors a pass; AVX2: 22 of 1) in 2 groups; 18, 3 heads split over the threads
    (2, 1, 70, 8, 160, (10, 69), 1),
    (2, 2, 40, 4, 176, 30, 2),
    (1, 2, 40, 3, 288, 39, 1),
]


def _qkv(B, L, T, H, D, dtype, seed=0, G=None):
    # drawn by numpy: eager jax.random ops compiled a program each, ~100 in this file's check
    rng = np.random.default_rng(seed)
    G = G or H
    return tuple(jnp.asarray(rng.standard_normal(s, np.float32), dtype)
                 for s in ((B, L, H, D), (B, T, G, D), (B, T, G, D)))


def check_kernel_equals_twin():
    """Every case, float32 and bfloat16, one and two threads, and int8 caches (also run by
    the portable build's test in test_kernel_tuning)."""
    # the twin jitted: one compile a shape, where eager calls compiled every op (0.5 s a case)
    twin = jax.jit(lambda q, k, v, i: CC.cached_attention(q, k, v, i, impl="xla"))
    check_int8_kernel_equals_twin()
    for dtype, tol in ((jnp.float32, 1e-5), (jnp.bfloat16, 2.0 ** -7)):
        for B, L, T, H, D, index, *G in CASES + GROUPED:
            q, k, v = _qkv(B, L, T, H, D, dtype, G=G[0] if G else None)
            counts = (1, 2, 3) if G else (1, 2)  # grouped: splits over 2 and 3
            both = jax.jit(lambda q, k, v, i: [  # the twin and every thread count: one compile
                CC.cached_attention(q, k, v, i, impl="xla")] + [
                CC.cached_attention(q, k, v, i, impl="kernel", threads=t) for t in counts])
            want, *gots = both(q, k, v, np.asarray(index, np.int32))
            want = np.asarray(want, np.float32)
            for b, i in enumerate(np.broadcast_to(index, (B,))):
                if np.ndim(index):  # a row's own position: that row decoded alone
                    np.testing.assert_array_equal(want[b], np.asarray(twin(
                        q[b:b + 1], k[b:b + 1], v[b:b + 1], jnp.int32(i)), np.float32)[0])
                if i < 0:
                    assert not want[b, 0].any()
            for threads, got in zip(counts, gots):
                assert got.dtype == dtype
                np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=tol, rtol=tol,
                                           err_msg=f"{dtype.__name__} {(B, L, T, H, D, index, G)} "
                                                   f"threads={threads}")


def check_int8_kernel_equals_twin():
    """An int8 cache: the kernel against the twin (which dequantizes the whole cache) on every
    case, float32 and bfloat16 queries."""
    quantize = jax.jit(CC.quantize_kv)  # jitted: eager ops compile one by one
    for B, L, T, H, D, index, *G in CASES + GROUPED:
        q, k, v = _qkv(B, L, T, H, D, jnp.float32, seed=1, G=G[0] if G else None)
        (kc, ks), (vc, vs) = quantize(k), quantize(v)
        assert kc.dtype == jnp.int8 and ks.shape == k.shape[:3]
        both = jax.jit(lambda q, kc, vc, s, i: [  # the twin and both thread counts: one compile
            CC.cached_attention(q, kc, vc, i, scales=s, impl="xla")] + [
            CC.cached_attention(q, kc, vc, i, scales=s, impl="kernel", threads=t) for t in (1, 2)])
        want, *gots = both(q, kc, vc, (ks, vs), np.asarray(index, np.int32))
        for threads, got in zip((1, 2), gots):
            np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5,
                                       err_msg=f"int8 {(B, L, T, H, D, index, G)} {threads}")
        got = CC.cached_attention(q.astype(jnp.bfloat16), kc, vc, jnp.array(index),
                                  scales=(ks, vs), impl="kernel")
        assert got.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), atol=2 ** -6,
                                   rtol=2 ** -6)


@needs_kernel
def test_rows_read_as_keys_and_values_both():
    """One buffer as k and v (multi-head latent attention's cache, `shared_kv`): the kernel
    reads it as the twin does, float32 and int8, wide rows and one-vector rows."""
    twin = jax.jit(lambda q, kv, i, s: CC.cached_attention(q, kv, kv, i, impl="xla",
                                                           scales=None if s is None else (s, s)))
    for B, L, T, H, D, index, G in (GROUPED[-3], GROUPED[1]):
        q, kv, _ = _qkv(B, L, T, H, D, jnp.float32, seed=2, G=G)
        np.testing.assert_allclose(
            CC.cached_attention(q, kv, kv, jnp.array(index), impl="kernel"),
            twin(q, kv, jnp.array(index), None), atol=1e-5, rtol=1e-5)
        codes, scale = CC.quantize_kv(kv)
        np.testing.assert_allclose(
            CC.cached_attention(q, codes, codes, jnp.array(index), scales=(scale, scale),
                                impl="kernel"),
            twin(q, codes, jnp.array(index), scale), atol=1e-5, rtol=1e-5)


def test_int8_codes_are_each_rows_absmax_scaled():
    x = jax.random.normal(jax.random.key(0), (2, 5, 3, 20)).at[0, 1, 2].set(0.0)
    codes, scale = CC.quantize_kv(x)
    assert codes.dtype == jnp.int8 and scale.shape == (2, 5, 3)
    amax = jnp.max(jnp.abs(x), -1)
    np.testing.assert_allclose(scale, amax / 127, rtol=1e-6)  # a zero row's: 0
    assert int(jnp.max(jnp.abs(codes))) == 127 and not codes[0, 1, 2].any()  # a zero row: 0s
    back = CC.dequantize_kv(codes, scale)
    assert float(jnp.max(jnp.abs(back - x) - scale[..., None] / 2)) <= 1e-7  # half a step


def test_grouped_twin_is_each_group_repeated():
    # the twin's grouped cache against the same attention over H heads, each group repeated
    B, L, T, H, D, index, G = GROUPED[0]
    q, k, v = _qkv(B, L, T, H, D, jnp.float32, G=G)
    rep = lambda x: jnp.repeat(x, H // G, axis=2)  # noqa: E731
    np.testing.assert_array_equal(CC.cached_attention(q, k, v, index, impl="xla"),
                                  CC.cached_attention(q, rep(k), rep(v), index, impl="xla"))
    with pytest.raises(ValueError, match="the cache's 3 key/value heads must divide the queries' 4"):
        CC.cached_attention(q, k[:, :, :1].repeat(3, 2), v[:, :, :1].repeat(3, 2), index)


@pytest.mark.slow  # 8.7 s in the suite on the 2-core Zen 3 (2026-12-01): CI's slow part runs it
@needs_kernel
def test_kernel_equals_its_xla_twin():
    check_kernel_equals_twin()


def _oracle(q, k, v, index):
    """Cached attention written out, independent of the twin (whose gradient the kernel's
    backward is, so the twin alone could not show a wrong one: a review, session 118): head h
    reads key/value head h // (H / G); query j at position index + j sees keys 0..index + j."""
    B, L, H, D = q.shape
    T, G = k.shape[1], k.shape[2]
    k, v = jnp.repeat(k, H // G, axis=2), jnp.repeat(v, H // G, axis=2)
    s = jnp.einsum("blhd,bthd->bhlt", q, k) / np.sqrt(D)
    seen = jnp.arange(T)[None, :] <= index + jnp.arange(L)[:, None]
    p = jax.nn.softmax(jnp.where(seen, s, -jnp.inf), axis=-1)
    return jnp.einsum("bhlt,bthd->blhd", p, v)


@needs_kernel
@pytest.mark.parametrize("G", [None, 1])  # multi-head; multi-query (a grouped cache)
def test_gradients_equal_the_twins(G):
    q, k, v = _qkv(2, 2, 24, 2, 16, jnp.float32, G=G)
    w = jax.random.normal(jax.random.key(3), q.shape)

    def loss(impl):
        return lambda q, k, v, i: jnp.sum(CC.cached_attention(q, k, v, i, impl=impl) * w)

    got = jax.jit(jax.grad(loss("kernel"), argnums=(0, 1, 2)))(q, k, v, jnp.int32(9))
    want = jax.grad(loss("xla"), argnums=(0, 1, 2))(q, k, v, 9)
    oracle = jax.grad(lambda q, k, v: jnp.sum(_oracle(q, k, v, 9) * w), argnums=(0, 1, 2))(
        q, k, v)
    for a, b, c in zip(got, want, oracle):
        assert a.shape == b.shape
        np.testing.assert_allclose(a, b, atol=1e-5)
        np.testing.assert_allclose(a, c, rtol=1e-5, atol=1e-5)  # (another order of sums)
    assert float(jnp.abs(got[1][:, 11:]).max()) == 0.0  # keys past the last query's: none
    # forward mode too, as impl='xla' (found in review: a custom_vjp refused jax.jvp)
    dirs = tuple(jax.random.normal(jax.random.key(4 + i), x.shape)
                 for i, x in enumerate((q, k, v)))
    got, want = (jax.jvp(lambda q, k, v: loss(impl)(q, k, v, jnp.int32(9)), (q, k, v), dirs)
                 for impl in ("kernel", "xla"))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


# 2.5 s in the fast suite on the Xeon model 207 (2026-12-07, --durations: the suite
# read 7 min 58 s for 1838 tests): CI's slow part runs it
@pytest.mark.slow
@needs_kernel
def test_int8_gradients_equal_the_twins():
    """Through an int8 cache: the query's and the scales' gradients (the codes take none)."""
    q, k, v = _qkv(2, 2, 24, 4, 16, jnp.float32, G=2)
    (kc, ks), (vc, vs) = CC.quantize_kv(k), CC.quantize_kv(v)
    w = jax.random.normal(jax.random.key(3), q.shape)

    def loss(impl):
        return lambda q, ks, vs: jnp.sum(CC.cached_attention(q, kc, vc, jnp.int32(9),
                                                             scales=(ks, vs), impl=impl) * w)

    got = jax.jit(jax.grad(loss("kernel"), argnums=(0, 1, 2)))(q, ks, vs)
    want = jax.grad(loss("xla"), argnums=(0, 1, 2))(q, ks, vs)
    # and the oracle's through the codes x scales (a review, session 118: the twin's alone)
    oracle = jax.grad(lambda q, ks, vs: jnp.sum(_oracle(
        q, CC.dequantize_kv(kc, ks), CC.dequantize_kv(vc, vs), 9) * w), argnums=(0, 1, 2))(
        q, ks, vs)
    for a, b, c in zip(got, want, oracle):
        np.testing.assert_allclose(a, b, atol=1e-5)
        np.testing.assert_allclose(a, c, rtol=1e-5, atol=1e-5)  # (another order of sums)
    assert float(jnp.abs(got[1]).max()) > 0
    dirs = tuple(jax.random.normal(jax.random.key(4 + i), x.shape)
                 for i, x in enumerate((q, ks, vs)))
    got, want = (jax.jvp(loss(impl), (q, ks, vs), dirs) for impl in ("kernel", "xla"))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_the_int8_twin_of_a_bfloat16_query_reads_the_cache_in_float32():
    """A review (session 116): the kernel scores a bfloat16 query against the int8 cache's
    codes x scales in float32, and the twin (impl='xla', other backends, several devices)
    rounded the dequantized keys and values to bfloat16 first: not the kernel's function.
    The twin now computes in float32 and casts its output, as the kernel does."""
    q, k, v = _qkv(2, 2, 24, 4, 16, jnp.float32, G=2)
    (kc, ks), (vc, vs) = CC.quantize_kv(k), CC.quantize_kv(v)
    twin = jax.jit(lambda q: CC.cached_attention(q, kc, vc, jnp.int32(9), scales=(ks, vs),
                                                 impl="xla"))
    got = twin(q.astype(jnp.bfloat16))
    assert got.dtype == jnp.bfloat16
    want = twin(q.astype(jnp.bfloat16).astype(jnp.float32)).astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@needs_kernel
@pytest.mark.parametrize("impl,runs", [("auto", True), ("xla", False)])
def test_the_default_decode_step_runs_the_kernel(impl, runs):
    """`chunked` keeps the default cache: its decode step takes the kernel unless the
    variant's `impl` says "xla"; either way it matches attention over the whole prefix."""
    B, T, H, D = 2, 8, 2, 16
    q, k, v = _qkv(B, T, T, H, D, jnp.float32)
    attn = A.get("chunked")(impl=impl)
    cache = attn.init_cache(B, T, H, D, jnp.float32)
    step = jax.jit(attn.decode_step)
    assert ("hpnlp_cached_attention" in str(jax.make_jaxpr(step)(cache, q[:, :1], k[:, :1], v[:, :1]))) == runs
    outs = []
    for t in range(T):
        o, cache = step(cache, q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1])
        outs.append(o)
    full = A.get("dense")()(q, k, v, None, causal=True)
    np.testing.assert_allclose(jnp.concatenate(outs, 1), full, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("G", [2, 1])
def test_an_int8_cache_decodes_what_attention_over_its_codes_computes(G):
    """The default decode step with an int8 cache (`init_cache` of int8), one token a step
    and then three in one call, equals dense attention over the keys and values quantized
    per position and head: each position's codes do not depend on the others'."""
    B, T, H, D = 2, 9, 4, 16
    q, k, v = _qkv(B, T, T, H, D, jnp.float32, G=G)
    attn = A.get("chunked")()
    cache = attn.init_cache(B, T, G, D, jnp.int8)
    assert cache["k"].dtype == jnp.int8 and cache["k_scale"].shape == (B, T, G)
    step = jax.jit(attn.decode_step)
    assert "hpnlp_cached_attention_i8" in str(jax.make_jaxpr(step)(cache, q[:, :1], k[:, :1],
                                                                    v[:, :1]))
    outs = []
    for t in range(T - 3):
        o, cache = step(cache, q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1])
        outs.append(o)
    o, cache = step(cache, q[:, T - 3:], k[:, T - 3:], v[:, T - 3:])
    assert int(cache["index"]) == T
    dq = lambda x: jnp.repeat(CC.dequantize_kv(*CC.quantize_kv(x)), H // G, 2)  # noqa: E731
    full = A.get("dense")()(q, dq(k), dq(v), None, causal=True)
    np.testing.assert_allclose(jnp.concatenate(outs + [o], 1), full, atol=1e-5)


@needs_kernel
def test_errors_say_what_cannot_run():
    q, k, v = _qkv(1, 1, 8, 2, 16, jnp.float32)
    with pytest.raises(ValueError, match="impl='kernel' cannot run here: dtypes"):
        CC.cached_attention(q, k.astype(jnp.bfloat16), v, 3, impl="kernel")
    with pytest.raises(ValueError, match="is not one of"):
        CC.cached_attention(q, k, v, 3, impl="fast")
    with pytest.raises(ValueError, match=r"index must be one position or one per row \(1\)"):
        CC.cached_attention(q, k, v, jnp.array([3, 4]))
    for threads in (0, 2.5):  # 2.5 ran on two threads, unsaid
        with pytest.raises(ValueError, match="threads must be an integer >= 1"):
            CC.cached_attention(q, k, v, 3, threads=threads)
    kc, ks = CC.quantize_kv(k)
    with pytest.raises(ValueError, match=r"an int8 cache needs scales=\(k_scale, v_scale\)"):
        CC.cached_attention(q, kc, kc, 3)
    with pytest.raises(ValueError, match="scales need an int8 cache"):
        CC.cached_attention(q, k, v, 3, scales=(ks, ks))
    with pytest.raises(ValueError, match=r"scales must be \(k_scale, v_scale\), each \(1, 8, 2\)"):
        CC.cached_attention(q, kc, kc, 3, scales=(ks, ks[:, :4]))
    # mixed dtypes under "auto": the twin runs
    np.testing.assert_allclose(CC.cached_attention(q, k.astype(jnp.bfloat16), v, 3),
                               CC.cached_attention(q, k.astype(jnp.bfloat16), v, 3, impl="xla"))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_cache_put_writes_in_place_what_a_dynamic_update_slice_writes(dtype):
    """16-bit caches go through a uint16 view: the same bits as the plain update, and no
    float32 copy of the whole cache in the compiled step (XLA:CPU's bfloat16 update)."""
    from hpnlp.attention.base import cache_put
    buf = jax.random.normal(jax.random.key(0), (2, 9, 3, 8)).astype(dtype)
    x = jax.random.normal(jax.random.key(1), (2, 1, 3, 8))  # float32: cast to the cache's dtype
    for index in (0, 4, 8, 11):  # 11: past the end, clamped like the plain update
        want = jax.lax.dynamic_update_slice_in_dim(buf, x.astype(dtype), index, 1)
        got = jax.jit(cache_put)(buf, x, index)
        assert got.dtype == dtype
        np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)),
                                      np.asarray(want.astype(jnp.float32)))
    # each row at its own position: row b as the plain update at index[b]
    index = jnp.array([7, 2])
    got = jax.jit(cache_put)(buf, x, index)
    for b in range(2):
        want = jax.lax.dynamic_update_slice_in_dim(buf[b:b + 1], x[b:b + 1].astype(dtype),
                                                   int(index[b]), 1)
        np.testing.assert_array_equal(np.asarray(got[b:b + 1].astype(jnp.float32)),
                                      np.asarray(want.astype(jnp.float32)))
    for i in (3, index):
        hlo = jax.jit(cache_put, donate_argnums=0).lower(buf, x, i).compile().as_text()
        assert "f32[2,9,3,8]" not in hlo or dtype == jnp.float32
