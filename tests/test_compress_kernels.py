"""The quantized CPU kernels (hpnlp.compress.kernels) against their XLA twins: exact on
integer accumulation, 1e-5 after rescaling, on shapes no tile divides, one and two
threads."""

import dataclasses
import functools
import itertools
import os
import subprocess
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hpnlp import kernels
from hpnlp.compress import kernels as qk
from hpnlp.compress import formats, packing

needs_kernel = pytest.mark.kernel(qk.KERNEL)

# (M, K, N): M = 1 (decoding), K = 1, odd K not a multiple of 8 or 64, N past a panel; one
# row over many panels, which two threads claim in grains from both ends until they meet.
SHAPES = [(3, 13, 5), (1, 1, 1), (1, 70, 17), (7, 129, 33), (13, 200, 40), (45, 64, 48),
          (1, 40, 700)]
BLOCKING = {"int8": {"mc": 4, "mr": 3}, "binary": {"mc": 5, "mr": 2}}  # many items, odd blocks
# int8 also at K = 1500: a panel of 48 KB (VNNI's 4 k of int8 or AVX2's 2 k of int16, 32
# columns or 16), past 2/3 of any x86 L1 up to 64 KB, so its products run in blocks of k
# with partial sums in memory (qgemm.cc k_block), the last block shorter. With AMX, from
# 16 rows, every row runs on tiles in 32-row blocks (the last one's rows past M computed and
# not written), k in whole 64-k tiles, the rest of k on vpdpbusd: (45, 64, 48) one k tile;
# (41, 1500, 37) and (40, 200, 70) a k tail, a last block of 16 rows or fewer; (41, 1500,
# 37) also k-blocks of the panel; (20, 1500, 64) and (57, 200, 64) a last block of 17 to 31
# rows (two tiles, reading rows past M), whole panels (the epilogue in registers); (100,
# 16500, 40) row chunks of 32 rows (16.5 KB rows, half of L2 a chunk: 2 MB or less) set up
# by either thread, the last one of 4, and many k-blocks.
INT8_SHAPES = SHAPES + [(41, 1500, 37), (40, 200, 70), (20, 1500, 64), (57, 200, 64),
                        (100, 16500, 40)]


@pytest.fixture(autouse=True)
def _no_tuning(monkeypatch):
    monkeypatch.setenv("HPNLP_KERNEL_TUNE", "0")


def _rng(*shape_key):
    return np.random.default_rng(zlib.crc32(repr(shape_key).encode()))


def _close(a, b, rtol=1e-5):
    a, b = np.asarray(a), np.asarray(b)
    scale = max(float(np.abs(b).max()), 1e-30)
    np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * scale)


def _int8_operands(M, K, N):
    rng = _rng("int8", M, K, N)
    x = rng.integers(-127, 128, (M, K), dtype=np.int8)
    w = rng.integers(-127, 128, (K, N), dtype=np.int8)
    scale = rng.uniform(0.001, 0.02, N).astype(np.float32)
    return jnp.asarray(x), qk.prepare_int8_weight(w, scale)


# Each shape's kernel runs (one and two threads, the default and odd blocks) and its twin go
# in one jitted program: one compile a shape, not one per run and eager op (the shape tests
# took 37 s of the suite's worker time on the Xeon model 167 that way, 2026-12-03).
RUNS = [(t, b) for t in (1, 2) for b in (False, True)]  # (threads, the odd BLOCKING)


def _runs(fn, kind, *args):
    """[fn(*args, impl="xla")] + fn(*args, impl="kernel", ...) at every RUNS, one compile."""
    return jax.jit(lambda *a: [fn(*a, impl="xla")] + [
        fn(*a, impl="kernel", threads=t, blocking=BLOCKING[kind] if b else None)
        for t, b in RUNS])(*args)


@needs_kernel
@pytest.mark.parametrize("M,K,N", INT8_SHAPES)
def test_int8_matmul_is_exact(M, K, N):
    x, w = _int8_operands(M, K, N)
    want, *got = _runs(qk.int8_matmul, "int8", x, w)
    np.testing.assert_array_equal(want, np.asarray(x, np.int64) @ np.asarray(w.q_KxN, np.int64))
    for run, y in zip(RUNS, got):
        np.testing.assert_array_equal(y, want, err_msg=f"threads, odd blocks: {run}")


@needs_kernel
@pytest.mark.parametrize("value", [127, -127])
def test_int8_extremes_do_not_saturate(value):
    """All +-127 over a long K: every int16 pair sum would saturate in vpmaddubsw (rows in
    AMX tiles and past them)."""
    M, K, N = 21, 515, 19
    x = jnp.full((M, K), value, jnp.int8)
    w = qk.prepare_int8_weight(jnp.full((K, N), 127, jnp.int8))
    out = qk.int8_matmul(x, w, impl="kernel", threads=2)
    np.testing.assert_array_equal(out, np.full((M, N), value * 127 * K, np.int32))
    mixed = jnp.asarray(np.where(np.arange(K) % 2, 127, -127).astype(np.int8))[None, :]
    np.testing.assert_array_equal(qk.int8_matmul(mixed, w, impl="kernel"),
                                  qk.int8_matmul(mixed, w, impl="xla"))


@needs_kernel
@pytest.mark.parametrize("M,K,N", INT8_SHAPES)
def test_int8_linear_matches_twin(M, K, N):
    _, w = _int8_operands(M, K, N)
    x = _rng("x", M, K).standard_normal((M, K)).astype(np.float32)
    x[0, 0] = 0.0
    if M > 2:
        x[2] = 0.0  # a row of zeros has scale 0
    x = jnp.asarray(x)
    want, *got = _runs(qk.int8_linear, "int8", x, w)
    for run, y in zip(RUNS, got):
        _close(y, want)
    # The epilogue (+ bias, GELU) in the kernel's pass equals the twin's, on outputs that
    # reach GELU's tails (|y| up to ~30: x scaled up) and its curved middle, on one and two
    # threads; and the kernel quantizes exactly as quantize_rows_int8 does. One compile.
    bias = jnp.asarray(_rng("bias", N).uniform(-2, 2, N).astype(np.float32))
    cases = [(True, None, 1.0), (False, "gelu", 1.0), (True, "gelu", 1.0), (True, "gelu", 20.0)]

    def epilogues(x, w, bias):
        q, s = qk.quantize_rows_int8(x)
        requantized = (qk.int8_matmul(q, w, impl="kernel").astype(jnp.float32) * s[:, None]
                       * w.scale_N[None, :])
        return requantized, [
            [qk.int8_linear(x * xs, w, bias=bias if b else None, activation=act, impl="xla")]
            + [qk.int8_linear(x * xs, w, bias=bias if b else None, activation=act,
                              impl="kernel", threads=t, blocking=BLOCKING["int8"])
               for t in (1, 2)] for b, act, xs in cases]

    requantized, outs = jax.jit(epilogues)(x, w, bias)
    _close(requantized, want)
    for case, (twin, *ys) in zip(cases, outs):
        for y in ys:
            _close(y, twin)


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
def test_int8_large_outputs_stream_and_equal_the_twin(threads):
    """Outputs of 8 MiB and more leave by streaming stores (qgemm.cc stream_out): whole
    panels from registers, a last panel of 8 columns (N = 2056) by plain stores beside them."""
    for M, K, N in [(1024, 64, 2048), (1024, 70, 2056)]:
        x, w = _int8_operands(M, K, N)
        np.testing.assert_array_equal(qk.int8_matmul(x, w, impl="kernel", threads=threads),
                                      qk.int8_matmul(x, w, impl="xla"))
        xf = jnp.asarray(_rng("x", M, K).standard_normal((M, K)).astype(np.float32))
        _close(qk.int8_linear(xf, w, impl="kernel", threads=threads),
               qk.int8_linear(xf, w, impl="xla"))


def _binary_operands(M, K, N):
    rng = _rng("binary", M, K, N)
    w = rng.standard_normal((K, N))
    alpha = rng.uniform(0.1, 1.0, N).astype(np.float32)
    return qk.prepare_binary_weight(packing.pack_bits(w), alpha, k=K)


@needs_kernel
# (2, 2100, 9): K past 31 words (the AVX2 path's byte flushes); (515, 70, 4104): an 8.5 MB
# int32 output, streamed from registers (b_block_out), its last panel short (the tile);
# from AMX_MIN_ROWS rows the products run on AMX tiles where the CPU has them: (100, 129,
# 33) ends in part of a 32-row block, of a k-word and of a panel
@pytest.mark.parametrize("M,K,N", SHAPES + [(2, 2100, 9), (515, 70, 4104), (100, 129, 33),
                                   (70, 0, 9)])
def test_binary_matmul_is_exact(M, K, N):
    w = _binary_operands(M, K, N)
    x = jnp.asarray(packing.pack_bits(_rng("bx", M, K).standard_normal((M, K)), axis=1))
    want, *got = _runs(qk.binary_matmul, "binary", x, w)
    for run, y in zip(RUNS, got):
        np.testing.assert_array_equal(y, want, err_msg=f"threads, odd blocks: {run}")


@needs_kernel
def test_binary_bits_past_k_count_for_nothing(monkeypatch):
    """Set bits past K (a weight or x packed by hand, e.g. `~` of zeros) change nothing, as
    in the twin: found in review, the popcount path counted them (-7 for an all-ones
    [3 -> 1] product). At 70 rows the AMX path runs where the CPU has it; a weight prepared
    with its tiles' panels falls back to the popcounts where the process has no tiles."""
    M, K, N = 70, 13, 9
    pad = np.uint8((0xFF << K % 8) & 0xFF)
    clean = np.asarray(packing.pack_bits(_rng("pad", K, N).standard_normal((K, N))))
    xs = np.asarray(packing.pack_bits(_rng("padx", M, K).standard_normal((M, K)), axis=1))
    for w_pad, x_pad in ((True, False), (False, True)):  # set on one side only: not cancelled
        bits, x = clean.copy(), xs.copy()
        if w_pad:
            bits[-1] |= pad
        if x_pad:
            x[:, -1] |= pad
        w, x = qk.prepare_binary_weight(jnp.asarray(bits), k=K), jnp.asarray(x)
        want = qk.binary_matmul(x, w, impl="xla")
        for rows in (M, 3):
            np.testing.assert_array_equal(qk.binary_matmul(x[:rows], w, impl="kernel"),
                                          want[:rows])
    ones = qk.prepare_binary_weight(jnp.full((1, 1), 0xFF, jnp.uint8), np.ones(1, np.float32), k=3)
    np.testing.assert_allclose(qk.binary_linear(jnp.ones((1, 3)), ones, impl="kernel"), [[3.0]])
    monkeypatch.setattr(qk, "binary_products", lambda: "avx512_vpopcntdq")  # no tiles here
    np.testing.assert_array_equal(qk.binary_matmul(x, w, impl="kernel"), want)


@needs_kernel
def test_int8_at_k_zero_is_zero():
    """K = 0: the twin's per-row scale had no maximum to take, and the kernel divided by
    zero blocks of k, a floating point exception that killed the process (found in
    review)."""
    w = qk.prepare_int8_weight(jnp.zeros((0, 5), jnp.int8), jnp.ones((5,), jnp.float32))
    x = jnp.zeros((3, 0), jnp.float32)
    for impl in ("xla", "kernel"):
        np.testing.assert_array_equal(qk.int8_linear(x, w, impl=impl), np.zeros((3, 5)))


@needs_kernel
def test_int4_at_n_zero_is_empty():
    """N = 0: preparing the weight divided its size by nothing, a ZeroDivisionError (a bug
    hunt, session 97), where the int8 and binary weights take it."""
    w = qk.prepare_int4_weight(packing.pack_int4(np.zeros((8, 0), np.int8)),
                               jnp.ones((1, 0), jnp.float32), k=8)
    for impl in ("xla", "kernel"):
        assert qk.int4_linear(jnp.ones((3, 8), jnp.float32), w, impl=impl).shape == (3, 0)


def _nan_inf_rows(M, K):
    """Rows holding a NaN (in the first 64 k, the vector loops, and in the tail past them),
    a -inf, an inf and a NaN together, then rows of ones."""
    x = np.ones((M, K), np.float32)
    x[0, 3], x[1, K - 1], x[2, 5], x[3, 1], x[3, 2] = np.nan, np.nan, -np.inf, np.inf, np.nan
    return jnp.asarray(x)


# 3.0 s in the fast suite on the Xeon model 207 (2026-12-07, --durations: the suite
# read 7 min 58 s for 1838 tests): CI's slow part runs it
@pytest.mark.slow
@needs_kernel
def test_int8_linear_rows_with_nan_or_inf_are_nan():
    """A row holding a NaN has scale NaN and one holding an inf scale inf, so their outputs
    are NaN, in the kernel as in the twin (a bug hunt (session 97): the kernel's max |x|
    dropped a NaN, a row of finite outputs or -inf by the build; XLA's dropped it at some
    shapes: M = 141 here)."""
    K, N = 70, 3
    w = qk.prepare_int8_weight(np.ones((K, N), np.int8))
    for M in (5, 141):
        x = _nan_inf_rows(M, K)
        q, scale = qk.quantize_rows_int8(x)
        np.testing.assert_array_equal(scale[:4], [np.nan, np.nan, np.inf, np.nan])
        np.testing.assert_array_equal(q[:4], np.zeros((4, K)))
        ys = jax.jit(lambda x: [qk.int8_linear(x, w, impl="xla")] + [
            qk.int8_linear(x, w, impl="kernel", threads=t) for t in (1, 2)])(x)
        for y in ys:
            np.testing.assert_array_equal(y, np.where(np.arange(M)[:, None] < 4, np.nan, K)
                                          * np.ones((1, N)))


# 2.6 s in the fast suite on the Xeon model 207 (2026-12-07, --durations: the suite
# read 7 min 58 s for 1838 tests): CI's slow part runs it
@pytest.mark.slow
@needs_kernel
def test_int8_linear_rows_too_small_to_scale_quantize_to_zeros():
    """A row with 0 < max|x| < 127 / FLT_MAX (about 3.7e-37) quantizes to q = 0, as a row of
    zeros, in the kernel as in the twin (review r5: 127 / max|x| overflowed to inf, x * inf
    was NaN at the row's zeros, and the kernel converted that NaN by the column: 0 in the
    16-wide loop, -128 or -32768 in the 8-wide one; the twin's q was 127 at the max). K = 24:
    the 16- and 8-wide loops; 27: a tail too; 91: a 64-k tile too, so that from 16 rows
    AMX's tiles run where the CPU has them. PORTABLE runs it on the AVX2 build."""
    for K in (24, 27, 91):
        x = np.ones((4, K), np.float32)
        x[:3] = 0.0  # row 2: zeros
        x[0, 0], x[1, K - 1] = 1e-37, -3e-37
        q, _ = qk.quantize_rows_int8(jnp.asarray(x))
        np.testing.assert_array_equal(q, np.where(np.arange(4)[:, None] < 3, 0, 127)
                                      * np.ones((1, K)))
        w = qk.prepare_int8_weight(np.ones((K, 5), np.int8))
        for M in (4, 20):
            xm = jnp.asarray(np.tile(x, (5, 1))[:M])
            ys = jax.jit(lambda x: [qk.int8_linear(x, w, impl="xla")] + [
                qk.int8_linear(x, w, impl="kernel", threads=t) for t in (1, 2)])(xm)
            for y in ys:
                np.testing.assert_array_equal(y, ys[0])
                np.testing.assert_array_equal(np.asarray(y)[np.arange(M) % 4 < 3], 0.0)
                # +0: the scale (max|x| / 127, subnormal) is flushed to 0 here, so only the
                # sign of the codes' sum told (-0 from the 8-wide loop's -128s)
                assert not np.signbit(y).any()


def _old_factor(x):
    """The per-row factor the kernel quantized by before review r5: fl(127 / max|x|)."""
    amax = np.abs(x).max(axis=1, keepdims=True)
    return np.float32(127) / np.where(amax > 0, amax, np.float32(1))


def _tie_rows(M, K):
    """Rows [M, K] of half-steps (x * fl(1 / s) = n + 0.5 exactly, s = max|x| * fl(1 /
    127): formats' rule as XLA computes it) and of values a last bit from one, where the
    old factor fl(127 / max|x|) differs from fl(1 / s) and rounds apart, in every part of a
    row: AVX-512's 16-wide loop, AVX2's 8-wide one and the tail (K = 27). Row 0 is the
    review's (r5), max 6.9453125 and +-0.35546875 (x / s = 6.5; code 7 by either factor,
    both fl(128 / 7)); row 1 has max|x| = 5e-31, at most formats.TINY: codes 0."""
    rng = _rng("ties", M, K)
    x = np.zeros((M, K), np.float32)
    m = 2
    while m < M:
        amax = np.float32(rng.uniform(0.5, 50))
        s = amax * np.float32(1 / 127)
        new, old = np.float32(1) / s, np.float32(127) / amax
        if new == old and m % 2:  # odd rows: factors that differ
            continue
        for k in range(K):
            h = np.float32(rng.integers(-126, 126) + 0.5)
            near = [np.float32(h / new)]  # and the two floats either side of it
            up = down = near[0]
            for _ in range(2):
                up, down = (np.nextafter(up, np.float32(np.inf)),
                            np.nextafter(down, np.float32(-np.inf)))
                near += [up, down]
            ties = [v for v in near if v * new == h]  # a half-step, or two factors apart
            apart = [v for v in near if np.rint(v * new) != np.rint(v * old)]
            x[m, k] = (ties + apart + near)[0] if rng.random() < 0.5 else (apart + ties + near)[0]
        x[m, rng.integers(K)] = amax * rng.choice([-1, 1])
        m += 1
    x[0] = 0.35546875 * np.where(np.arange(K) % 2, 1, -1)
    x[0, 0] = 6.9453125
    x[1, 5] = 5e-31
    return x


@needs_kernel
def test_int8_per_token_codes_are_formats_codes_at_half_steps():
    """A review (r5): the kernel and its twin quantized a token by x * fl(127 / max|x|),
    and formats.py's int8 (QAT, the packed model decoded in XLA) by x / s, which XLA
    computes as x * fl(1 / s), s = max|x| * fl(1 / 127): the two factors differ in their
    last bit at some rows, and a value near a half-step rounded apart, so a served w8a8
    product was not its QAT model's. Now the kernel takes formats' factor: the twin's codes
    are formats', and the kernel's (an identity weight returns q * s, on the vector path
    and from 16 rows AMX's where the CPU has it, one and two threads) too. PORTABLE checks
    the portable, AVX2 and AVX-512 builds."""
    K = 27
    x = _tie_rows(24, K)
    encode = lambda x: formats.get("int8").encode(x, (1,))  # noqa: E731
    codes, scale = (np.asarray(a) for a in jax.jit(encode)(jnp.asarray(x)))
    scale = scale.reshape(-1)
    # formats' rule, in float32 products (row 1: scale 0, codes 0)
    inv = np.float32(1) / np.where(scale > 0, scale, np.float32(1))[:, None]
    np.testing.assert_array_equal(codes, np.where(scale[:, None] > 0, np.rint(x * inv), 0))
    assert scale[0] == 7 / 128 and (codes[0, 1:] == np.where(np.arange(1, K) % 2, 7, -7)).all()
    assert (x[2:] * inv[2:] == np.trunc(x[2:] * inv[2:]) + np.copysign(0.5, x[2:])).sum() > 50
    # what tells the old factor apart: codes it rounds the other way
    old = np.clip(np.rint(x * _old_factor(x)), -127, 127)
    assert (old[2:] != codes[2:]).sum() > 20
    for got in (encode(jnp.asarray(x)), qk.quantize_rows_int8(jnp.asarray(x)),
                jax.jit(qk.quantize_rows_int8)(jnp.asarray(x))):  # the twin's scale: 5e-31 / 127
        np.testing.assert_array_equal(np.asarray(got[0]), codes)
        np.testing.assert_array_equal(np.asarray(got[1]).reshape(-1)[scale > 0], scale[scale > 0])
    w = qk.prepare_int8_weight(np.eye(K, dtype=np.int8))
    want = codes.astype(np.float32) * scale[:, None]
    for M in (5, 24):
        ys = jax.jit(lambda x: [qk.int8_linear(x, w, impl="kernel", threads=t)
                                for t in (1, 2)])(jnp.asarray(x[:M]))
        for y in ys:
            np.testing.assert_array_equal(y, want[:M])


@needs_kernel
def test_binary_linear_rows_with_nan_or_inf_are_nan():
    """A row holding a NaN or an inf has beta NaN, so its outputs are NaN, in the kernel (the
    popcounts' path, and from AMX_MIN_ROWS rows the tiles' where the CPU has them) as in the
    twin and in formats.py's binary scale, which the packed model decoded in XLA follows (a
    bug hunt (session 103): beta = inf gave +-inf, the -inf row's outputs too)."""
    K, N = 70, 3
    w = qk.prepare_binary_weight(packing.pack_bits(np.ones((K, N))), k=K)
    for M in (5, qk.AMX_MIN_ROWS):
        x = _nan_inf_rows(M, K)
        assert np.isnan(formats.quantize_dequantize(x, "binary", axes=(1,))[:4]).all()
        ys = jax.jit(lambda x: [qk.binary_linear(x, w, impl="xla")] + [
            qk.binary_linear(x, w, impl="kernel", threads=t) for t in (1, 2)])(x)
        for y in ys:
            np.testing.assert_array_equal(y, np.where(np.arange(M)[:, None] < 4, np.nan, K)
                                          * np.ones((1, N)))


@needs_kernel
def test_binary_linear_rows_too_small_to_scale_are_zeros():
    """A row with mean|x| at most formats.TINY (1e-31 here, and zeros) has beta 0, so its
    outputs are 0, in the kernel (popcounts; from AMX_MIN_ROWS rows the tiles where the CPU
    has them) as in the twin and formats.py's binary scale, which QAT and the packed model
    decoded in XLA follow (review r8: beta kept 1e-31, outputs of about K * 1e-31)."""
    K, N = 70, 3
    rng = _rng("binary tiny", K, N)
    w_KxN = np.where(rng.standard_normal((K, N)) > 0, 1.0, -1.0).astype(np.float32)
    w = qk.prepare_binary_weight(packing.pack_bits(w_KxN), k=K)
    for M in (5, qk.AMX_MIN_ROWS):
        x = rng.standard_normal((M, K)).astype(np.float32)
        x[0] = 1e-31 * np.where(np.arange(K) % 3 == 0, 1.0, -1.0)  # K - 2 count != 0
        x[1] = 0.0
        want = np.asarray(formats.quantize_dequantize(jnp.asarray(x), "binary", axes=(1,))) @ w_KxN
        assert (want[:2] == 0).all()
        ys = jax.jit(lambda x: [qk.binary_linear(x, w, impl="xla")] + [
            qk.binary_linear(x, w, impl="kernel", threads=t) for t in (1, 2)])(jnp.asarray(x))
        for y in ys:
            np.testing.assert_array_equal(np.asarray(y)[:2], 0.0)
            _close(y, want)


# GELU's tails: past the kernel's exponent clip (y < -10.4) -0 as in the twin, -inf NaN as
# in the twin, inf and +1e30 themselves, NaN NaN; 72 columns: whole vectors and a tail
GELU_TAILS = np.tile(np.float32([-11.0, -1e3, -1e20, -1e36, -np.inf, np.inf, np.nan, 1e30]), 9)


@needs_kernel
def test_int8_linear_gelu_tails_equal_the_twin():
    """A bug hunt (session 99): where the kernel's GELU clipped its exponent at 80 it gave
    y / (1 + e^80), not -0: -18 at y = -1e36 and -inf at -inf, where the twin gives -0 and
    NaN. The same check runs on the AVX2 and portable builds (PORTABLE)."""
    w = qk.prepare_int8_weight(np.ones((3, GELU_TAILS.size), np.int8))
    x = jnp.zeros((2, 3), jnp.float32)  # y = the bias
    ys = jax.jit(lambda x, b: [qk.int8_linear(x, w, bias=b, activation="gelu", impl="xla")] + [
        qk.int8_linear(x, w, bias=b, activation="gelu", impl="kernel", threads=t)
        for t in (1, 2)])(x, jnp.asarray(GELU_TAILS))
    want = np.where(GELU_TAILS == -np.inf, np.nan, np.where(GELU_TAILS < -10, -0.0, GELU_TAILS))
    for y in ys:
        np.testing.assert_array_equal(y, np.broadcast_to(want, y.shape))
        assert np.signbit(y)[:, GELU_TAILS < -10].all()


@needs_kernel
@pytest.mark.parametrize("xbit,wbit", [(1, 1), (0, 0), (1, 0), (0, 1)])
def test_binary_all_ones_and_minus_ones(xbit, wbit):
    M, K, N = 3, 1000, 11
    x = jnp.asarray(packing.pack_bits(np.full((M, K), 2 * xbit - 1), axis=1))
    w = qk.prepare_binary_weight(packing.pack_bits(np.full((K, N), 2 * wbit - 1)), k=K)
    want = K if xbit == wbit else -K
    np.testing.assert_array_equal(qk.binary_matmul(x, w, impl="kernel", threads=2),
                                  np.full((M, N), want, np.int32))


@needs_kernel
# (515, 70, 4104): an 8.5 MB output, written with streaming stores (qgemm.cc stream_out),
# its last panel short (plain stores)
# (100, 33000, 40): on AMX, row chunks of 32 rows (a chunk's int8 rows fill half of L2), set
# up by either thread, the last one short, each panel in k-blocks (sums kept between them)
@pytest.mark.parametrize("M,K,N", SHAPES + [(515, 70, 4104), (100, 129, 33), (100, 33000, 40)])
def test_binary_linear_matches_twin(M, K, N):
    w = _binary_operands(M, K, N)
    x = _rng("blx", M, K).standard_normal((M, K)).astype(np.float32)
    x[0, 0] = 0.0  # zero binarizes to -1
    x = jnp.asarray(x)
    want, *got = _runs(qk.binary_linear, "binary", x, w)
    for run, y in zip(RUNS, got):
        _close(y, want)
    assert (w.amx_panels is not None) == (qk.layout()["binary_products"] == "amx")
    # both AMX paths, or neither (a path that stopped running would pass every test above)
    assert (qk.layout()["binary_products"] == "amx") == (qk.layout()["int8_products"] == "amx")
    if w.amx_panels is not None:  # the tiles' path and the popcounts' agree exactly
        pop = dataclasses.replace(w, amx_panels=None)
        amx, popcounts = jax.jit(lambda x, w, pop: [
            [qk.binary_linear(x, v, impl="kernel", threads=t) for t in (1, 2)]
            for v in (w, pop)])(x, w, pop)
        np.testing.assert_array_equal(amx, popcounts)


def test_amx_bit_order():
    """The AMX path's weight bits (qgemm.cc b_amx_expand): word [p, j, 16 h + q] holds bit
    4 c + i = the sign of column 32 p + 16 h + c at k = 64 j + 4 q + i. Checked on any CPU
    against the definition, bit by bit."""
    K, N = 128, 64
    signs = _rng("amx_order").standard_normal((K, N))
    words = np.asarray(qk._amx_bit_order(jnp.asarray(packing.pack_bits(signs)), K // 64, N // 32))
    assert words.shape == (N // 32, K // 64, 1, 32, 8)
    bits = np.unpackbits(words, axis=-1, bitorder="little")  # [P, kw, 1, 32, 64]
    for p, j, h, q, c, i in itertools.product(range(2), range(2), range(2), range(16),
                                              range(16), range(4)):
        assert bits[p, j, 0, 16 * h + q, 4 * c + i] == (signs[64 * j + 4 * q + i,
                                                              32 * p + 16 * h + c] > 0)


def _int4_operands(M, K, N, groups):
    rng = _rng("int4", M, K, N, groups)
    q = rng.integers(-8, 8, (K, N), dtype=np.int8)
    scale = rng.uniform(0.01, 0.1, (groups, N)).astype(np.float32)
    return qk.prepare_int4_weight(packing.pack_int4(q), scale, k=K)


@needs_kernel
# (16, 129, 33, 3): groups of 43 rows (odd: i4_block, not the grouped path) in register blocks
# of 8 rows (AVX-512)
@pytest.mark.parametrize("M,K,N,groups", [(3, 13, 5, 1), (1, 1, 1, 1), (1, 70, 17, 5),
                                          (7, 129, 33, 3), (16, 129, 33, 3), (1, 64, 40, 64),
                                          (9, 96, 20, 3), (70, 256, 50, 2), (5, 131, 9, 1),
                                          (1, 40, 700, 5)])
def test_int4_linear_matches_twin(M, K, N, groups):
    w = _int4_operands(M, K, N, groups)
    x = jnp.asarray(_rng("x4", M, K).standard_normal((M, K)).astype(np.float32))
    want, *got = jax.jit(lambda x, w: [qk.int4_linear(x, w, impl="xla")] + [
        qk.int4_linear(x, w, impl="kernel", threads=t) for t in (1, 2)])(x, w)
    for y in got:
        _close(y, want)
    ref = np.asarray(x, np.float64) @ np.asarray(qk.dequantize_int4(w), np.float64)
    _close(want, ref)


@needs_kernel
def test_concurrent_calls_share_the_thread_pool():
    """Kernels called from several threads at once (XLA runs independent ops so): every
    call schedules its helpers on XLA's intra-op pool, where the calls' tasks interleave and
    a late one must find its call closed; every result still equals its twin. (Outside XLA,
    the tuning probes' path, a caller that finds the kernels' own pool busy runs alone.)"""
    import concurrent.futures
    x8, w8 = _int8_operands(37, 300, 70)
    w4 = _int4_operands(37, 256, 70, 2)
    xf = jnp.asarray(_rng("pool", 37, 300).standard_normal((37, 300)).astype(np.float32))
    want8, want4 = qk.int8_matmul(x8, w8, impl="xla"), qk.int4_linear(xf[:, :256], w4, impl="xla")
    f8 = jax.jit(functools.partial(qk.int8_matmul, impl="kernel", threads=2))
    f4 = jax.jit(functools.partial(qk.int4_linear, impl="kernel", threads=2))

    def run(i):
        for _ in range(20):
            if i % 2:
                np.testing.assert_array_equal(f8(x8, w8), want8)
            else:
                _close(f4(xf[:, :256], w4), want4)

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        list(pool.map(run, range(4)))


# run_items outside an XLA call (the tuning probes): 3 row chunks of 4 panels on 2 threads,
# items claimed one at a time. "setup": chunk 2's setup throws on the helper (which starts
# from the back) while the caller is held in its first item, so the caller meets chunk 2
# later; "pool": no helper of the kernels' pool can start.
QGEMM_CASES = r"""
int run_case(const std::string& name) {
  const int M = 12, P = 4, mc = 4;
  std::atomic<int> setups{0}, items{0};
  if (name == "pool") {
    starts_left = 0;
    run_items(M, P, mc, P, 2, [&](int, int) { ++setups; }, [&](int, int, int) { ++items; });
    CHECK(setups == 3 && items == 12);
    return 0;
  }
  std::atomic<bool> failed{false};
  try {
    run_items(M, P, mc, P, 2, [&](int r0, int) {
      if (r0 == 8) failed = true, throw std::bad_alloc();
    }, [&](int m0, int, int) {
      const auto t0 = std::chrono::steady_clock::now();
      while (m0 == 0 && !failed && std::chrono::steady_clock::now() - t0 < std::chrono::seconds(5))
        std::this_thread::yield();
      ++items;
    });
  } catch (const std::bad_alloc&) {
    return 0;
  }
  CHECK(!"the setup's exception");
}
"""


@pytest.fixture(scope="module")
def qgemm_harness(tmp_path_factory):
    from test_rnn_fused import build_harness
    return build_harness(tmp_path_factory.mktemp("qgemm_harness"), qk.KERNEL.source,
                         QGEMM_CASES)


@needs_kernel
@pytest.mark.slow  # the harness's build: 3-6 s
@pytest.mark.parametrize("case", ["setup", "pool"])
def test_a_failed_setup_or_helper_start_is_no_hang_or_abort(qgemm_harness, case):
    """Found in review: a row chunk whose setup threw (an AMX int8 row's scratch) stayed
    "being set up", and every other thread that reached it spun forever, where the handler's
    "out of memory" error was meant; and a helper of the kernels' own pool that could not
    start (EAGAIN at a limit on threads) failed the call, where the caller can claim all the
    work itself."""
    proc = qgemm_harness(case)
    assert proc.returncode == 0 and f"ok {case}" in proc.stdout, proc.stdout + proc.stderr


@needs_kernel
def test_one_row_timing_runs():
    """`python -m hpnlp.compress.kernels --one-row`'s measurement (tiny, a few calls)."""
    secs = qk.time_one_row(40, 70, threads=2, calls=3, repeats=1)
    assert set(secs) == {"int8_kernel", "int4_kernel"} and all(t > 0 for t in secs.values())


def test_timing_cli_without_the_kernel_says_why(monkeypatch):
    """Found by the crash hunt: with the kernel unavailable, `--one-row` ended in a
    RuntimeError; now one line with the reason, before any timing."""
    monkeypatch.setattr(qk, "available", lambda: False)
    monkeypatch.setattr(qk, "unavailable_reason", lambda: "no compiler here")
    with pytest.raises(SystemExit, match=r"kernel is unavailable \(no compiler here\)"):
        qk.main(["--one-row"])


@needs_kernel
def test_auto_is_the_kernel_and_jit_works():
    x, w8 = _int8_operands(4, 33, 18)
    xf = jnp.asarray(_rng("auto", 4, 33).standard_normal((4, 33)).astype(np.float32))
    for fn, args, target in [
            (qk.int8_matmul, (x, w8), "hpnlp_int8_matmul"),
            (qk.int8_linear, (xf, w8), "hpnlp_int8_linear"),
            (qk.binary_linear, (xf, _binary_operands(4, 33, 18)), "hpnlp_binary_linear"),
            (qk.int4_linear, (xf, _int4_operands(4, 33, 18, 3)), "hpnlp_int4_linear")]:
        got = jax.jit(fn)(*args)
        # the kernel's call in auto's program (a review, session 118: its twin gives the same
        # values, so the values alone could not tell)
        assert target in jax.jit(fn).lower(*args).as_text(), target
        np.testing.assert_array_equal(got, fn(*args, impl="kernel"))
        _close(fn(*args, impl="xla"), got)
    # int4 over many rows (a prefill): auto is the twin, XLA's GEMM on the dequantized weight
    M = qk.INT4_KERNEL_MAX_ROWS + 1
    xm = jnp.asarray(_rng("auto", M, 33).standard_normal((M, 33)).astype(np.float32))
    w4 = _int4_operands(M, 33, 18, 3)
    np.testing.assert_array_equal(qk.int4_linear(xm, w4), qk.int4_linear(xm, w4, impl="xla"))
    assert "hpnlp_int4_linear" not in jax.jit(qk.int4_linear).lower(xm, w4).as_text()


@needs_kernel
def test_gradients_through_the_kernels_are_the_twins():
    """An FFI call has no derivative (JAX: "cannot be differentiated"), so each float
    product's backward pass is its twin's: jax.grad through impl="kernel", jitted, equals
    it through impl="xla" in every differentiable argument. int4 (weight-only): x's and the
    scales' exact float gradients, what an adapter over a frozen int4 layer trains by;
    int8 and binary: their quantizers' (rounding and sign have none; only the scales and,
    for int8, the bias carry one). Since the kernel's gradient is the twin's by
    construction, each is also checked against a float64 reference written out by hand
    (a review: comparing the twin with itself could not catch a wrong twin gradient)."""
    M, K, N = 5, 70, 18
    xf = jnp.asarray(_rng("grad", M, K).standard_normal((M, K)).astype(np.float32))
    bias = jnp.asarray(_rng("grad bias", N).standard_normal(N).astype(np.float32))
    w8 = _int8_operands(M, K, N)[1]
    cot = jnp.asarray(_rng("grad cot", M, N).standard_normal((M, N)).astype(np.float32))
    cases = {
        "int8": (lambda x, w, b, impl: qk.int8_linear(x, w, bias=b, activation="gelu",
                                                      impl=impl), (xf, w8, bias)),
        "binary": (lambda x, w, impl: qk.binary_linear(x, w, impl=impl),
                   (xf, _binary_operands(M, K, N))),
        "int4": (lambda x, w, impl: qk.int4_linear(x, w, impl=impl),
                 (xf, _int4_operands(M, K, N, 5))),
    }

    def floats(tree):  # the float leaves of each argument: what has a gradient
        return [a for a in jax.tree.leaves(tree) if jnp.issubdtype(a.dtype, jnp.floating)]

    grads = {}
    for name, (fn, args) in cases.items():
        def loss(*a, impl):
            return jnp.vdot(fn(*a, impl=impl), cot)
        # allow_int: the weights' integer codes and panels (their cotangents are float0)
        grad = functools.partial(jax.grad, argnums=tuple(range(len(args))), allow_int=True)
        got, want = jax.jit(lambda *a: [grad(functools.partial(loss, impl=impl))(*a)
                                        for impl in ("kernel", "xla")])(*args)
        assert "ffi_call" in str(jax.make_jaxpr(grad(functools.partial(loss, impl="kernel")))(
            *args)), name
        for g, h in zip(floats(got), floats(want), strict=True):
            _close(g, h, rtol=1e-4)
        assert any(float(jnp.abs(g).max()) > 0 for g in floats(got)), name
        grads[name] = got
    # The references, in float64 from the forward codes (no autodiff): y = acc * s_M * w_N
    # (+ b, then GELU), s_M = max|x_row| / 127 (int8) or beta_M = mean|x_row| (binary); the
    # codes (round, sign) pass no gradient, so x's flows through the row scale alone.
    x64, cot64 = np.asarray(xf, np.float64), np.asarray(cot, np.float64)
    # int8: the bias gets cot * gelu'(pre), the weight scales cot * gelu' * acc * s_M, and x
    # only each row's absmax element: sign(x) / 127 * sum_n cot * gelu' * acc * w_N
    q_MxK, s_M = (np.asarray(a, np.float64) for a in qk.quantize_rows_int8(xf))
    acc_MxN = q_MxK @ np.asarray(w8.q_KxN, np.float64)  # exact: integers below 2^53
    w_N = np.asarray(w8.scale_N, np.float64)
    pre_MxN = acc_MxN * s_M[:, None] * w_N[None, :] + np.asarray(bias, np.float64)[None, :]
    c = np.sqrt(2 / np.pi)
    t_MxN = np.tanh(c * (pre_MxN + 0.044715 * pre_MxN ** 3))
    dgelu_MxN = 0.5 * (1 + t_MxN) + 0.5 * pre_MxN * (1 - t_MxN ** 2) * c * (
        1 + 3 * 0.044715 * pre_MxN ** 2)  # the tanh form's derivative
    d_MxN = cot64 * dgelu_MxN
    g_x, g_w, g_b = grads["int8"]
    _close(g_b, d_MxN.sum(0), rtol=1e-4)
    _close(g_w.scale_N, (d_MxN * acc_MxN * s_M[:, None]).sum(0), rtol=1e-4)
    top_M = np.argmax(np.abs(x64), axis=1)
    at_top = np.zeros_like(x64, bool)
    at_top[np.arange(M), top_M] = True
    np.testing.assert_array_equal(np.asarray(g_x)[~at_top], 0)
    _close(np.asarray(g_x)[at_top], np.sign(x64[at_top]) / 127 * (d_MxN * acc_MxN * w_N).sum(1),
           rtol=1e-4)
    # binary: alpha gets sum_m cot * acc * beta_M, and x everywhere sign(x) / K * sum_n cot *
    # acc * alpha_N (beta is a mean)
    wb = cases["binary"][1][1]
    acc_MxN = np.where(x64 > 0, 1.0, -1.0) @ packing.unpack_bits(
        np.asarray(wb.bits_KbxN), K, axis=0, dtype=np.int8).astype(np.float64)
    beta_M, alpha_N = np.abs(x64).mean(1), np.asarray(wb.alpha_N, np.float64)
    g_x, g_w = grads["binary"]
    _close(g_w.alpha_N, (cot64 * acc_MxN * beta_M[:, None]).sum(0), rtol=1e-4)
    _close(g_x, np.sign(x64) / K * (cot64 * acc_MxN * alpha_N).sum(1)[:, None], rtol=1e-4)
    # int4: x's gradient is the cotangent times the dequantized weight's transpose
    g_x = jax.jit(jax.grad(lambda x, w: jnp.vdot(qk.int4_linear(x, w, impl="kernel"), cot)))(
        xf, cases["int4"][1][1])
    _close(g_x, np.asarray(cot, np.float64) @ np.asarray(
        qk.dequantize_int4(cases["int4"][1][1]), np.float64).T)
    # forward mode and second order too (found in review: a custom_vjp took neither)
    w4 = cases["int4"][1][1]

    def higher(impl):
        f = lambda x: jnp.sum(jnp.sin(qk.int4_linear(x, w4, impl=impl)))  # noqa: E731
        return (jax.jvp(f, (xf,), (xf[::-1],))[1],
                jax.grad(lambda x: jnp.sum(jax.grad(f)(x) ** 2))(xf))

    got, want = jax.jit(lambda: [higher(impl) for impl in ("kernel", "xla")])()
    for g, h in zip(got, want, strict=True):
        _close(g, h, rtol=1e-4)


def _cpu_flags() -> list[str]:
    with open("/proc/cpuinfo") as f:
        return next((line.split() for line in f if line.startswith("flags")), [])


@needs_kernel
def test_int8_products_run_on_the_cpus_widest_path():
    """The native build's int8 products: AMX tiles where the CPU has them (the OS grants
    them on Linux >= 5.16), else the build's vector path."""
    path = qk.layout()["int8_path"]
    flags = _cpu_flags()
    if kernels.march() == "native" and "amx_int8" in flags:  # unless the OS refuses the tiles
        assert qk.int8_products() in ("amx", path)
    else:
        assert qk.int8_products() == path
    if kernels.march() == "native" and "avx512_vnni" in flags:
        assert path == "avx512_vnni"


def test_xla_fallback_without_kernel(monkeypatch):
    """Where the kernel cannot run (here: as if on a mesh), auto is the twin and "kernel"
    says why."""
    x, w = _int8_operands(3, 13, 5)
    # the product is exact on both paths, so only the program tells them apart (review r17)
    program = lambda: str(jax.make_jaxpr(lambda x: qk.int8_matmul(x, w))(x))  # noqa: E731
    if qk.available():  # the name below is the one auto calls where the kernel can run
        assert "hpnlp_int8_matmul" in program()
    monkeypatch.setattr(qk.KERNEL, "blocker", lambda: "a mesh of 2 devices")
    np.testing.assert_array_equal(qk.int8_matmul(x, w), qk.int8_matmul(x, w, impl="xla"))
    assert "hpnlp_int8_matmul" not in program() and "ffi_call" not in program()
    with pytest.raises(RuntimeError, match="a mesh of 2 devices.*impl='xla'"):
        qk.int8_matmul(x, w, impl="kernel")


def test_bad_inputs_name_the_argument():
    x, w = _int8_operands(3, 13, 5)
    with pytest.raises(ValueError, match="x_MxK must be int8"):
        qk.int8_matmul(x.astype(jnp.int32), w)
    with pytest.raises(ValueError, match="x_MxK has K = 12 but the weight has K = 13"):
        qk.int8_matmul(x[:, :12], w)
    with pytest.raises(ValueError, match="x_MxK must have 2 dims"):
        qk.int8_linear(jnp.zeros((2, 3, 13), jnp.float32), w)
    with pytest.raises(ValueError, match="unknown activation 'relu6'"):
        qk.int8_linear(jnp.zeros((2, 13), jnp.float32), w, activation="relu6")
    with pytest.raises(ValueError, match="bias has 4 entries but the weight has N = 5"):
        qk.int8_linear(jnp.zeros((2, 13), jnp.float32), w, bias=jnp.zeros((4,), jnp.float32))
    with pytest.raises(ValueError, match="impl must be one of"):
        qk.int8_matmul(x, w, impl="fast")
    with pytest.raises(ValueError, match="scale_N must have shape"):
        qk.prepare_int8_weight(w.q_KxN, jnp.ones((4,), jnp.float32))
    with pytest.raises(ValueError, match="bits_KbxN must have ceil"):
        qk.prepare_binary_weight(jnp.zeros((3, 4), jnp.uint8), k=13)
    with pytest.raises(ValueError, match="x_bits_MxKb must have"):
        qk.binary_matmul(jnp.zeros((2, 3), jnp.uint8), _binary_operands(2, 13, 4))
    with pytest.raises(ValueError, match="G dividing"):
        qk.prepare_int4_weight(jnp.zeros((7, 4), jnp.uint8), jnp.ones((2, 4), jnp.float32), k=13)
    with pytest.raises(ValueError, match="weight must be an Int4Weight"):
        qk.int4_linear(jnp.zeros((2, 13), jnp.float32), w)
    # whichever path runs (found in review: the twin's path let them pass)
    for threads in (0, 2.5):
        with pytest.raises(ValueError, match="int8_linear: threads must be an integer >= 1"):
            qk.int8_linear(jnp.zeros((2, 13), jnp.float32), w, impl="xla", threads=threads)
    for bad in ({"mc": 0, "mr": 2}, {"mc": 64.5, "mr": 2}, {"mc": 64, "mr": 2.5},
                {"mc": True, "mr": 2}, {"mc": "64", "mr": 2}, ["mc", "mr"]):
        with pytest.raises(ValueError, match="int8_matmul: blocking must be"):
            qk.int8_matmul(x, w, impl="xla", blocking=bad)
    with pytest.raises(ValueError, match="k must be an integer"):  # 13.5 built K = 13
        qk.prepare_binary_weight(jnp.zeros((2, 4), jnp.uint8), k=13.5)
    with pytest.raises(ValueError, match="k must be an integer"):
        qk.prepare_int4_weight(jnp.zeros((4, 4), jnp.uint8), jnp.ones((1, 4), jnp.float32), k=7.9)
    if qk.available():
        with pytest.raises(ValueError, match="blocking must be"):
            qk.int8_matmul(x, w, impl="kernel", blocking={"mc": 8, "mr": 99})
        # found in review: mc of 2**31 - 1 overflowed the kernel's int row-chunk count and
        # computed no rows, silently
        with pytest.raises(ValueError, match=r"'mc': an integer 1\.\.2\*\*30"):
            qk.int8_matmul(x, w, impl="kernel", blocking={"mc": 2**31 - 1, "mr": 4})
        with pytest.raises(ValueError, match="threads must be an integer >= 1"):
            qk.int8_matmul(x, w, impl="kernel", threads=0)


@needs_kernel
def test_tuning_probes_run():
    for name, t in qk.TUNINGS.items():
        assert t.probe(qk.KERNEL.library(), t.default) > 0, name


@needs_kernel
def test_outputs_fault_in_only_their_missing_pages():
    """The kernels fault in an output's pages before writing it (MADV_POPULATE_WRITE), but
    only the pages not resident yet (with freed memory reused, usually none): exactly the
    untouched whole pages, in pieces of at most 1 MB."""
    import ctypes
    import mmap

    page, pages = 4096, 800
    buf = mmap.mmap(-1, pages * page)
    for i in [*range(0, 100), 300, *range(600, 800)]:
        buf[i * page] = 1
    base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    fn = qk.KERNEL.library().hpnlp_missing_pages
    fn.restype = ctypes.c_int64
    out = (ctypes.c_int64 * 16)()

    def missing(offset, nbytes):
        n = fn(ctypes.c_void_p(base + offset), ctypes.c_int64(nbytes), out, ctypes.c_int64(8))
        return [(out[2 * i] + offset, out[2 * i + 1] + offset) for i in range(n)]

    assert missing(0, pages * page) == [(100 * page, 300 * page), (301 * page, 557 * page),
                                        (557 * page, 600 * page)]
    # Only whole pages inside the buffer: a partial first or last page is left to the kernel.
    assert missing(100 * page + 8, 3 * page) == [(101 * page, 103 * page)]
    for i in range(pages):
        buf[i * page] = 2
    assert missing(0, pages * page) == []
    del fn
    buf.close()


@pytest.mark.slow
@pytest.mark.parametrize("march", ["sapphirerapids", "skylake-avx512", "x86-64-v3", "x86-64"])
def test_every_instruction_path_compiles(march, tmp_path):
    """The AVX-512 VNNI / VPOPCNTDQ paths (not run on a CPU without them), AVX-512 without
    VNNI (Skylake-X: the int16 products, AVX-512's epilogue), the AVX2 and the portable
    paths all compile."""
    cmd = [*kernels.compiler(), *kernels.FLAGS, f"-march={march}", "-c", "-I",
           jax.ffi.include_dir(), "-I", kernels.HEADER_DIR, qk.KERNEL.source, "-o",
           str(tmp_path / "qgemm.o")]
    cmd.remove("-shared")
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]


PORTABLE = """
import numpy as np, jax.numpy as jnp
from hpnlp.compress import kernels as qk, packing
import sys
int8, binary = sys.argv[1:3]
assert qk.layout()["int8_path"] == int8 and qk.layout()["binary_path"] == binary, qk.layout()
assert qk.int8_products() == int8, qk.int8_products()
rng = np.random.default_rng(0)
for M, K, N in [(3, 13, 5), (7, 129, 33), (9, 200, 64), (41, 1500, 37)]:
    x8 = jnp.asarray(rng.integers(-127, 128, (M, K), dtype=np.int8))
    w8 = qk.prepare_int8_weight(rng.integers(-127, 128, (K, N), dtype=np.int8))
    xf = jnp.asarray(rng.standard_normal((M, K)).astype(np.float32))
    wb = qk.prepare_binary_weight(packing.pack_bits(rng.standard_normal((K, N))), k=K)
    w4 = qk.prepare_int4_weight(packing.pack_int4(rng.integers(-8, 8, (K, N), dtype=np.int8)),
                                jnp.ones((1, N), jnp.float32), k=K)
    # packed activations (binary_matmul's own unpacking, review r5: untested here), the last
    # byte's bits past K set, which the kernel masks off as the twin drops them
    xb = packing.pack_bits(rng.standard_normal((M, K)), axis=1)
    xb[:, -1] |= np.uint8(0xFF & (0xFF << K % 8)) if K % 8 else np.uint8(0)
    for fn, args, exact in [(qk.int8_matmul, (x8, w8), True), (qk.int8_linear, (xf, w8), False),
                            (qk.binary_linear, (xf, wb), False), (qk.int4_linear, (xf, w4), False),
                            (qk.binary_matmul, (jnp.asarray(xb), wb), True)]:
        a, b = np.asarray(fn(*args, impl="kernel", threads=2)), np.asarray(fn(*args, impl="xla"))
        assert np.array_equal(a, b) if exact else np.allclose(a, b, rtol=1e-5, atol=1e-5 * abs(b).max())
    bias = jnp.asarray(rng.standard_normal(N).astype(np.float32))
    a, b = (np.asarray(qk.int8_linear(xf, w8, bias=bias, activation="gelu", impl=i)) for i in ("kernel", "xla"))
    assert np.allclose(a, b, rtol=1e-5, atol=1e-5 * abs(b).max())
xn = np.ones((5, 70), np.float32)  # NaN rows (in the vector loops, past them), -inf, inf
xn[0, 3], xn[1, 69], xn[2, 5], xn[3, 1] = np.nan, np.nan, -np.inf, np.inf
a = np.asarray(qk.int8_linear(jnp.asarray(xn), qk.prepare_int8_weight(np.ones((70, 3), np.int8)),
                              impl="kernel"))
assert np.isnan(a[:4]).all() and (a[4] == 70).all(), a
xt = np.zeros((2, 27), np.float32)  # 127 / max|x| = inf: q = 0 (-32768 by AVX2's loop)
xt[0, 0], xt[1, 26] = 1e-37, -3e-37
a = np.asarray(qk.int8_linear(jnp.asarray(xt), qk.prepare_int8_weight(np.ones((27, 3), np.int8)),
                              impl="kernel"))
assert (a == 0).all() and not np.signbit(a).any(), a  # -0: codes summed below 0
tails = np.tile(np.float32([-11.0, -1e3, -1e20, -1e36, -np.inf, np.inf, np.nan, 1e30]), 9)
a, b = (np.asarray(qk.int8_linear(jnp.zeros((2, 3), jnp.float32), qk.prepare_int8_weight(
    np.ones((3, 72), np.int8)), bias=jnp.asarray(tails), activation="gelu", impl=i))
    for i in ("kernel", "xla"))
assert np.array_equal(a, b, equal_nan=True), (a, b)  # GELU's tails: -0, NaN at -inf
# formats.py's int8 codes at half-steps and values the old factor rounded apart, in every
# loop of a row (_tie_rows), and max|x| <= formats.TINY: codes 0 (an identity weight: q * s)
from hpnlp.compress import formats
xh = np.load(sys.argv[3])
c, s = (np.asarray(v) for v in formats.get("int8").encode(jnp.asarray(xh), (1,)))
a = np.asarray(qk.int8_linear(jnp.asarray(xh), qk.prepare_int8_weight(
    np.eye(xh.shape[1], dtype=np.int8)), impl="kernel"))
assert np.array_equal(a, c.astype(np.float32) * s), (a, c)
print(int8, "ok")
"""


@pytest.mark.slow
@pytest.mark.parametrize("march,path", [("x86-64", "portable"), ("x86-64-v3", "avx2"),
                                        ("skylake-avx512", "avx2"),
                                        ("icelake-server", "avx512_vnni")])
def test_portable_build_computes_the_same(march, path, tmp_path):
    """Built for plain x86-64 (no AVX2), for AVX2 without AVX-512 (whatever CPU runs the
    test), for AVX-512 without VNNI (Skylake-X: the int16 panels' AVX-512 quantization and
    epilogue, a review, session 117: compiled, never run), or for AVX-512 VNNI without AMX
    (a CPU with VNNI: the vector path of an AMX machine): those paths equal the twins."""
    import sys
    if march == "icelake-server" and not {"avx512_vnni", "avx512_vpopcntdq"} <= set(_cpu_flags()):
        pytest.skip("this CPU has no AVX-512 VNNI / VPOPCNTDQ")
    if march == "skylake-avx512" and not {"avx512f", "avx512bw"} <= set(_cpu_flags()):
        pytest.skip("this CPU has no AVX-512 BW")
    binary = "avx512_vpopcntdq" if path == "avx512_vnni" else path
    # JAX_PLATFORMS=cpu: the kernel is a CPU one, and on a GPU machine the suite's cuda,cpu
    # would make the GPU the backend it refuses
    env = dict(os.environ, HPNLP_KERNEL_MARCH=march, HPNLP_KERNEL_TUNE="0",
               HPNLP_KERNEL_CACHE=str(tmp_path), JAX_PLATFORMS="cpu")
    np.save(tmp_path / "ties.npy", _tie_rows(24, 27))
    proc = subprocess.run([sys.executable, "-c", PORTABLE, path, binary,
                           str(tmp_path / "ties.npy")], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and f"{path} ok" in proc.stdout, proc.stderr[-3000:]
