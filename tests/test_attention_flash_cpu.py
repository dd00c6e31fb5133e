"""The fused CPU kernel behind `chunked` (`flash_cpu`) against the `dense` oracle and its
XLA twin: outputs and dq, dk, dv in float32 to 1e-5, causal and not, with random padding
and packed segments, lengths no block divides, several tiles per pass (small blocks), one
and two threads; plus padding invariance, causality by gradients, fully masked rows,
bfloat16, vmap, no recompiles, and clear errors where it cannot run."""

import ctypes
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hpnlp.attention as A
import hpnlp.attention.chunked as C
import hpnlp.attention.flash_cpu as F
from hpnlp.attention.dense import dense_attention

from attention_testlib import apply_attention, assert_compiles_once

needs_kernel = pytest.mark.kernel(F.KERNEL)

H = 2


SMALL = ((16, 16), (16, 32))


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    """16-query x 16- or 32-key tiles in place of this CPU's tuned ones, so tiny lengths
    cross many tiles, diagonals and edges; bfloat16 products on the CPU's own instructions
    forward and widened backward (both are timed per CPU where it has its own)."""
    monkeypatch.setattr(F, "tuned_blocks", lambda bf16=False, regime="long": SMALL)
    monkeypatch.setattr(F, "tuned_widen", lambda regime="long": (False, True))


def _qkv(B, L, S, D, seed=0, dtype=jnp.float32):
    ks = jax.random.split(jax.random.key(seed), 4)
    q, k, v, w = (jax.random.normal(kk, (B, n, H, D)) for kk, n in zip(ks, (L, S, S, L)))
    return q.astype(dtype), k.astype(dtype), v.astype(dtype), w


def _segments(B, L, seed):
    """Random right padding per row (one row all padding), and packed segments in row 1."""
    rng = np.random.default_rng(seed)
    seg = np.zeros((B, L), np.int32)
    for b in range(B):
        seg[b, :rng.integers(1, L + 1)] = 1
    seg[0] = 0
    if B > 1:
        a, c = sorted(rng.choice(np.arange(2, L - 2), 2, replace=False))
        seg[1, :a], seg[1, a:c], seg[1, c:L - 1] = 1, 2, 3
        seg[1, L - 1] = 0
    return jnp.asarray(seg)


def _out_and_grads(fn, q, k, v, w):
    out, vjp = jax.vjp(fn, q, k, v)
    return out, vjp(w)


def _assert_close(got, want, tol=1e-5):
    for a, b, name in zip(jax.tree.leaves(got), jax.tree.leaves(want), ("out", "dq", "dk", "dv")):
        np.testing.assert_allclose(a, b, atol=tol, rtol=tol, err_msg=name)


@needs_kernel
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("B, L, D, threads", [(3, 37, 16, 2), (2, 70, 64, 2), (2, 33, 48, 1)])
def test_matches_dense(B, L, D, threads, masked, causal):
    q, k, v, w = _qkv(B, L, L, D, seed=L + D)
    seg = _segments(B, L, seed=L) if masked else None
    kernel = jax.jit(lambda q, k, v: F.flash_attention(q, k, v, seg, seg, causal=causal,
                                                       threads=threads))
    got = _out_and_grads(kernel, q, k, v, w)
    want = _out_and_grads(lambda q, k, v: dense_attention(q, k, v, seg, causal=causal), q, k, v, w)
    _assert_close(got, want)
    chex.assert_tree_all_finite(got)
    if masked:  # row 0 is all padding: zeros, not NaN, and no gradient
        for x in jax.tree.leaves(got):
            assert float(jnp.abs(x[0]).max()) == 0.0


@needs_kernel
@pytest.mark.parametrize("causal", [False, True])
def test_cross_attention_lengths_differ(causal):
    q, k, v, w = _qkv(2, 21, 45, 32, seed=7)
    got = _out_and_grads(lambda q, k, v: F.flash_attention(q, k, v, causal=causal), q, k, v, w)
    want = _out_and_grads(lambda q, k, v: dense_attention(q, k, v, None, causal=causal), q, k, v, w)
    _assert_close(got, want)


@needs_kernel
def test_tuned_tiles_several_column_blocks_and_threads():
    """The default production tiles (not the small ones of the other tests), a head dim of
    128 (two 64-column register blocks), lengths no tile divides, padding, both directions."""
    B, L, D = 1, 300, 128
    q, k, v, w = _qkv(B, L, L, D, seed=21)
    seg = _segments(2, L, seed=4)[1:]  # packed segments and a padded tail
    for causal in (False, True):
        got = _out_and_grads(lambda q, k, v: F.flash_attention(
            q, k, v, seg, seg, causal=causal, threads=2, fwd_blocks=F.FWD_BLOCKS,
            bwd_blocks=F.BWD_BLOCKS), q, k, v, w)
        want = _out_and_grads(lambda q, k, v: dense_attention(q, k, v, seg, causal=causal),
                              q, k, v, w)
        _assert_close(got, want)


@needs_kernel
def test_gradients_hold_float32_accuracy_at_large_scores():
    """Scores near 1e4: dV against a float64 reference, as a fraction of its largest entry,
    median over 4 draws at most 7e-4. With the logsumexp saved in base e and converted
    back to the softmax's base 2 in the backward pass, each probability took two more
    roundings of a number that size: 1.09e-3 to 1.58e-3 over 8 draws (median 1.30e-3),
    against 6.6e-8 to 5.9e-4 (median 1.5e-4) saved in base 2 (found in review)."""
    errors = []
    for seed in range(4):
        rng = np.random.default_rng(seed)
        q, k = (rng.standard_normal((1, 256, H, 64)) * 100 for _ in range(2))
        v, w = (rng.standard_normal((1, 256, H, 64)) for _ in range(2))
        _, vjp = jax.vjp(lambda q, k, v: F.flash_attention(
            q, k, v, fwd_blocks=(64, 64), bwd_blocks=(64, 64), threads=1),
            *(jnp.asarray(x, jnp.float32) for x in (q, k, v)))
        dv = np.asarray(vjp(jnp.asarray(w, jnp.float32))[2])
        q, k, v, w = (np.float64(np.float32(x)) for x in (q, k, v, w))
        s = np.einsum("blhd,bshd->bhls", q, k) / 8.0  # D = 64
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        want = np.einsum("bhls,blhd->bshd", p, w)
        errors.append(np.abs(dv - want).max() / np.abs(want).max())
    assert np.median(errors) <= 7e-4, errors


@needs_kernel
def test_value_head_dim_other_than_the_query_s_is_refused():
    q, k, _, _ = _qkv(1, 16, 16, 16)
    v = jnp.ones((1, 16, H, 32))
    assert "value head dim 32" in C.kernel_blocker(16, 32, "auto", None, None)
    with pytest.raises(RuntimeError, match="value head dim 32"):
        F.flash_attention(q, k, v)


@needs_kernel
def test_empty_lengths():
    """No keys: every query sees nothing (zeros, no gradient); no queries: empty output."""
    q, k, v, w = _qkv(1, 20, 20, 16, seed=9)
    out, (dq, dk, dv) = _out_and_grads(lambda q, k, v: F.flash_attention(q, k, v),
                                       q, k[:, :0], v[:, :0], w)
    assert out.shape == q.shape and float(jnp.abs(out).max()) == 0.0
    assert float(jnp.abs(dq).max()) == 0.0 and dk.shape == (1, 0, H, 16)
    out, grads = _out_and_grads(lambda q, k, v: F.flash_attention(q, k, v), q[:, :0], k, v, w[:, :0])
    assert out.shape == (1, 0, H, 16) and float(jnp.abs(grads[1]).max()) == 0.0
    seg = jnp.ones((1, 20), jnp.int32)  # segment ids with no queries at all
    out, grads = _out_and_grads(lambda q, k, v: F.flash_attention(q, k, v, seg[:, :0], seg),
                                q[:, :0], k, v, w[:, :0])
    assert out.shape == (1, 0, H, 16) and float(jnp.abs(grads[2]).max()) == 0.0
    with pytest.raises(ValueError, match="segment ids must be"):
        F.flash_attention(q, k, v, seg[:, :5], seg)


@needs_kernel
@pytest.mark.parametrize("causal", [False, True])
def test_kernel_matches_its_xla_twin(causal):
    """`chunked` impl='kernel' against impl='xla' on one tile size the XLA path also uses."""
    q, k, v, w = _qkv(2, 64, 64, 32, seed=3)
    seg = _segments(2, 64, seed=5)
    run = lambda impl: _out_and_grads(  # noqa: E731
        lambda q, k, v: C.chunked_attention(q, k, v, seg, causal=causal, impl=impl), q, k, v, w)
    _assert_close(run("kernel"), run("xla"))


@needs_kernel
def test_a_score_that_is_not_a_number_reaches_the_output_as_the_twins_does():
    """A review (session 116): a row whose softmax sum was NaN (an inf query entry against a
    zero key entry) counted as one that saw no key, and the kernel wrote zeros where its
    XLA twin wrote NaN, hiding a divergence. NaN rows stay NaN; the others are the twin's."""
    q, k, v, _ = _qkv(1, 16, 16, 16, seed=4)
    q = q.at[0, 3, 0, 0].set(jnp.inf)
    k = k.at[0, 5, 0, 0].set(0.0)
    seg = jnp.ones((1, 16), jnp.int32)
    got, want = (C.chunked_attention(q, k, v, seg, causal=False, impl=impl)
                 for impl in ("kernel", "xla"))
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    assert bool(jnp.isnan(want[0, 3, 0]).all())
    np.testing.assert_allclose(jnp.nan_to_num(got), jnp.nan_to_num(want), atol=1e-5)


@needs_kernel
def test_auto_uses_the_kernel_where_it_can():
    q, k, v, _ = _qkv(1, 16, 16, 16)
    hlo = jax.jit(lambda q, k, v: C.chunked_attention(q, k, v)).lower(q, k, v).as_text()
    assert "hpnlp_flash_fwd" in hlo
    for kwargs in ({"impl": "xla"}, {"block_q": 16, "block_k": 16}):
        hlo = jax.jit(lambda q, k, v: C.chunked_attention(q, k, v, **kwargs)).lower(q, k, v).as_text()
        assert "hpnlp_flash" not in hlo, kwargs
    q8, k8, v8, _ = _qkv(1, 16, 16, 8)  # head dim 8: not a multiple of 16, so XLA
    hlo = jax.jit(lambda q, k, v: C.chunked_attention(q, k, v)).lower(q8, k8, v8).as_text()
    assert "hpnlp_flash" not in hlo


@needs_kernel
def test_padding_invariance_and_causality_by_gradient():
    B, L, D = 2, 40, 16
    q, k, v, _ = _qkv(B, L, L, D, seed=11)
    seg = jnp.asarray(np.r_[np.ones(25), np.zeros(15)][None].repeat(B, 0).astype(np.int32))
    attn = A.get("chunked")()
    # Jitted as trained; `test_no_recompile_across_calls` calls this same program.
    out = apply_attention(attn, False, {}, q, k, v, seg)
    noise = jax.random.normal(jax.random.key(1), q.shape) * (seg == 0)[:, :, None, None]
    out2 = apply_attention(attn, False, {}, q + noise, k + noise, v + noise, seg)
    np.testing.assert_allclose(out[:, :25], out2[:, :25], atol=1e-6)
    # Causal: output t depends on no input after t.
    t = 17
    g = jax.grad(lambda q, k, v: jnp.sum(attn(q, k, v, None, causal=True)[:, t]), (0, 1, 2))(q, k, v)
    for x in g:
        assert float(jnp.abs(x[:, t + 1:]).max()) == 0.0
        assert float(jnp.abs(x[:, :t + 1]).max()) > 0.0


@needs_kernel
def test_no_recompile_across_calls():
    """`chunked` on the kernel, its module rebuilt per call (as from a config): a static
    argument equal to the last, so one program for all three calls, the one
    `test_padding_invariance_and_causality_by_gradient` compiled."""
    B, L, D = 2, 40, 16
    seg = jnp.asarray(np.r_[np.ones(25), np.zeros(15)][None].repeat(B, 0).astype(np.int32))
    outs = assert_compiles_once(apply_attention, (
        (A.get("chunked")(), False, {}, *_qkv(B, L, L, D, seed=s)[:3], seg) for s in range(3)))
    chex.assert_tree_all_finite(outs)


@needs_kernel
def test_bfloat16_and_vmap():
    q, k, v, _ = _qkv(2, 24, 24, 16, seed=2, dtype=jnp.bfloat16)
    out = F.flash_attention(q, k, v, causal=True)
    assert out.dtype == jnp.bfloat16
    ref = dense_attention(*(x.astype(jnp.float32) for x in (q, k, v)), None, causal=True)
    np.testing.assert_allclose(out.astype(jnp.float32), ref, atol=5e-2)
    # vmap over a leading axis (ensembles): the kernel runs once per member.
    qs = jnp.stack([q, q * 2]).astype(jnp.float32)
    got = jax.vmap(lambda q: F.flash_attention(q, k, v))(qs)
    for i in range(2):
        np.testing.assert_allclose(got[i], F.flash_attention(qs[i], k, v), atol=1e-6)


@needs_kernel
def test_errors_say_what_and_how():
    q, k, v, _ = _qkv(1, 16, 16, 8)
    with pytest.raises(ValueError, match=r"impl='kernel' cannot run here: head dim 8 .* impl='xla'"):
        C.chunked_attention(q, k, v, impl="kernel")
    with pytest.raises(ValueError, match="impl='fast' is not one of"):
        C.chunked_attention(q, k, v, impl="fast")
    with pytest.raises(RuntimeError, match="head dim 8"):
        F.flash_attention(q, k, v)
    q, k, v, _ = _qkv(1, 16, 16, 16)
    with pytest.raises(ValueError, match="both qseg_BL and kseg_BS"):
        F.flash_attention(q, k, v, jnp.ones((1, 16), jnp.int32))
    # found in review: a block past a C int overflowed in the kernel (wrong outputs, NaN
    # gradients); refused before anything is tuned or compiled
    with pytest.raises(ValueError, match=r"fwd_blocks must be .* at most"):
        F.flash_attention(q, k, v, fwd_blocks=(2**31, 16), bwd_blocks=(16, 16))
    z = jnp.zeros((1, 8, 1, 0))  # head dim 0: the XLA twin's empty output, not 1 / sqrt(0)
    assert C.chunked_attention(z, z, z).shape == (1, 8, 1, 0)
    with pytest.raises(RuntimeError, match="head dim 0"):
        F.flash_attention(z, z, z)


@pytest.mark.parametrize("kwargs, message", [
    (dict(threads=0), "threads must be an integer >= 1"),
    (dict(threads=-4), "threads must be an integer >= 1"),
    (dict(threads=2.7), "threads must be an integer >= 1"),
    (dict(threads=True), "threads must be an integer >= 1"),
    (dict(fwd_blocks=64), "fwd_blocks must be two positive multiples of 16 .*; got 64"),
    (dict(bwd_blocks=(16.5, 16)), "bwd_blocks must be two positive multiples of 16"),
    (dict(bwd_blocks=(32.0, 16)), "bwd_blocks must be two positive multiples of 16")])
def test_bad_threads_and_blocks_are_refused_before_any_build(kwargs, message, monkeypatch):
    """Found in review: threads=0, -4 or 2.7 ran on one or two threads without a word (the
    kernel clamps and truncates them), fwd_blocks=64 was a bare TypeError and a block of
    16.5 ran as 16. Refused as cached attention and sparse_matmul refuse them, before the
    kernel is built or tuned (so this test needs no compiler)."""
    monkeypatch.setattr(F.KERNEL, "load", lambda: pytest.fail("the kernel was asked for"))
    q = jnp.zeros((1, 16, 1, 16))
    with pytest.raises(ValueError, match=f"flash attention: {message}"):
        F.flash_attention(q, q, q, **kwargs)


@needs_kernel
def test_one_pass_given_tunes_only_the_other(monkeypatch):
    """Blocks given for one pass (any sequence of two ints, a NumPy array too; NumPy's
    integer threads too): only the other pass's tuning is asked for."""
    asked = []
    monkeypatch.setattr(F, "tuned_block", lambda p, bf16=False, regime="long": (
        asked.append(p), (16, 16))[1])
    q, k, v, w = _qkv(1, 40, 40, 16, seed=3)
    got = _out_and_grads(lambda q, k, v: F.flash_attention(
        q, k, v, fwd_blocks=np.array([16, 32]), threads=np.int64(2)), q, k, v, w)
    assert asked == ["bwd"]
    _assert_close(got, _out_and_grads(lambda q, k, v: dense_attention(q, k, v, None), q, k, v, w))


@functools.lru_cache(None)
def _compiled_grad(length):
    q = jnp.zeros((1, length, 1, 16), jnp.float32)
    loss = lambda q, k, v: jnp.sum(F.flash_attention(q, k, v, causal=True))  # noqa: E731
    return jax.jit(jax.grad(loss, (0, 1, 2))).lower(q, q, q).compile()


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def _peak_growth_bytes(length) -> int | None:
    """How far the process's resident memory peaks above where it starts during one
    gradient call (after a warm one). malloc's free memory is handed back to the OS first
    (`malloc_trim`), so all the call takes, fresh or reused, is counted: XLA's buffers and
    the kernel's scratch from the C++ heap alike (Linux's resettable high-water mark,
    VmHWM). None where the C library or Linux cannot say."""
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "malloc_trim"):  # not glibc
        return None
    compiled = _compiled_grad(length)
    q = jnp.zeros((1, length, 1, 16), jnp.float32)
    jax.block_until_ready(compiled(q, q, q))  # threads, first-call allocations
    libc.malloc_trim(0)
    try:
        start = _status_bytes("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS (Linux >= 4.0)
    except (OSError, StopIteration):
        return None
    jax.block_until_ready(compiled(q, q, q))
    return _status_bytes("VmHWM") - start


@needs_kernel
def test_forward_backward_memory_is_linear_in_length():
    """Flash attention holds O(L) memory forward and backward, at 4x the length: XLA's
    buffers (the compiled program's temporaries: the FFI calls' declared outputs), and the
    peak of the whole call, the kernel's own scratch included. Found in review: the test
    read XLA's buffers alone, which cannot see what the kernel allocates (its all-heads K^T/V
    copy, each thread's scratch, the backward's dQ shares); an [L, S] float scratch is 256 MiB
    at L = 8192, and the call's peak there is about 7 MB (2 MB at 2048, on the Xeon)."""
    small, big = (_compiled_grad(n).memory_analysis().temp_size_in_bytes for n in (2048, 8192))
    assert big / small < 5.0, (small, big)
    assert big < 8192 * 8192 * 4 / 16, big
    peak = [_peak_growth_bytes(n) for n in (2048, 8192)]
    if None in peak:
        pytest.skip("the process's peak memory cannot be read here (glibc and Linux >= 4.0)")
    assert peak[1] < 4 * peak[0] + (4 << 20) and peak[1] < 8192 * 8192 * 4 / 16, peak
