"""hpnlp.compress.spmm: the sparse (CSC) weight product against float64 and its XLA twin,
at every row block, on shapes that leave partial tiles; its checks of bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hpnlp.compress import spmm

needs_kernel = pytest.mark.skipif(not spmm.available(), reason="no C++ compiler / CPU backend")


def _weight(rng, K, N, sparsity):
    w = rng.standard_normal((K, N)).astype(np.float32)
    w[rng.random((K, N)) < sparsity] = 0.0
    return w


# (M, K, N, sparsity): whole 16 x 16 tiles and partial ones (M, K, N not multiples of 8
# or 16), one row (decoding), an empty weight, a dense one, empty columns at 99%.
SHAPES = [(40, 48, 32, 0.9), (37, 13, 21, 0.5), (1, 70, 33, 0.8), (19, 16, 16, 1.0),
          (33, 50, 37, 0.0), (64, 128, 40, 0.99)]


def test_prepare_keeps_exactly_the_nonzeros():
    w = _weight(np.random.default_rng(0), 30, 20, 0.7)
    w[:, 3] = 0.0  # an empty column
    sw = spmm.prepare_sparse_weight(w)
    assert sw.shape == (30, 20) and sw.nnz == np.count_nonzero(w)
    assert abs(sw.density - np.count_nonzero(w) / w.size) < 1e-12
    assert sw.nbytes == 4 * (21 + 2 * sw.nnz)
    np.testing.assert_array_equal(np.asarray(sw.dense()), w)
    cp, row = np.asarray(sw.col_ptr), np.asarray(sw.row)
    assert cp[3] == cp[4]  # the empty column has no entries
    for n in range(20):  # rows ascending within a column
        assert np.all(np.diff(row[cp[n]:cp[n + 1]]) > 0)


@needs_kernel
def test_kernel_matches_float64_at_every_row_block():
    rng = np.random.default_rng(1)
    for M, K, N, q in SHAPES:
        w, x = _weight(rng, K, N, q), rng.standard_normal((M, K)).astype(np.float32)
        sw = spmm.prepare_sparse_weight(w)
        want = x.astype(np.float64) @ w.astype(np.float64)
        scale = max(1.0, np.abs(want).max())
        twin = np.asarray(spmm.sparse_matmul_xla(jnp.asarray(x), sw))
        assert np.abs(twin - want).max() <= 1e-5 * scale
        for v in spmm.VECTORS:
            for threads in (1, 3):  # more threads than row blocks, for the small ones
                got = np.asarray(spmm.sparse_matmul(jnp.asarray(x), sw, impl="kernel",
                                                    vectors=v, threads=threads))
                assert np.abs(got - want).max() <= 1e-5 * scale, (M, K, N, q, v, threads)


@needs_kernel
def test_auto_runs_the_kernel_under_jit_and_vmap():
    rng = np.random.default_rng(2)
    w, x = _weight(rng, 24, 16, 0.8), rng.standard_normal((3, 5, 24)).astype(np.float32)
    sw = spmm.prepare_sparse_weight(w)
    f = jax.jit(jax.vmap(lambda a: spmm.sparse_matmul(a, sw)))
    assert "hpnlp_csc_matmul" in f.lower(jnp.asarray(x)).as_text()
    np.testing.assert_allclose(np.asarray(f(jnp.asarray(x))), x @ w, rtol=1e-5, atol=1e-5)


def test_bad_input_says_what_and_how():
    sw = spmm.prepare_sparse_weight(np.eye(4, dtype=np.float32))
    with pytest.raises(ValueError, match="has K = 3 but the weight has K = 4"):
        spmm.sparse_matmul(jnp.ones((2, 3)), sw)
    with pytest.raises(ValueError, match="float32"):
        spmm.sparse_matmul(jnp.ones((2, 4), jnp.int32), sw)
    with pytest.raises(ValueError, match="impl must be one of"):
        spmm.sparse_matmul(jnp.ones((2, 4)), sw, impl="gpu")
    with pytest.raises(ValueError, match="SparseWeight"):
        spmm.sparse_matmul(jnp.ones((2, 4)), jnp.eye(4))
    with pytest.raises(ValueError, match=r"must be \[K, N\]"):
        spmm.prepare_sparse_weight(np.ones(4, np.float32))
    if spmm.available():
        with pytest.raises(ValueError, match="vectors must be one of"):
            spmm.sparse_matmul(jnp.ones((2, 4)), sw, vectors=3)
        # arrays that do not describe a K x N matrix are refused by the kernel, not read
        bad = spmm.SparseWeight(sw.col_ptr, sw.row.at[2].set(7), sw.val, k=4)
        with pytest.raises(Exception, match=r"row index is outside \[0, K\)"):
            jax.block_until_ready(spmm.sparse_matmul(jnp.ones((2, 4)), bad, impl="kernel"))
