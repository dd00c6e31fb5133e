"""Orthogonalization in plain XLA ops, for random orthogonal matrices inside jitted code.

Why not `jnp.linalg.qr`: on CPU it is a LAPACK custom call that splits a batch of
matrices over XLA's intra-op thread pool and then blocks a pool thread until the pieces
finish. Reached from inside a loop (a scanned or vmapped initializer, a feature redraw
in a training step), two such calls can each hold one of a 2-core machine's two pool
threads while waiting for work queued behind the other: the program deadlocks with
every thread idle. (Seen here: `jax.jit(model.init)` of a bidirectional LSTM hung
about one run in two.) Gram-Schmidt below is matrix-vector products only, so it runs
anywhere, batches under `vmap`, and never waits on the pool.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def orthonormal_columns(a_MN):
    """Q [M, N] (M >= N) of the QR decomposition a = QR with R's diagonal positive.

    Classical Gram-Schmidt applied twice per column ("twice is enough", Giraud et al.
    2005): orthogonal to float32 rounding for any matrix of full column rank, and the
    positive-diagonal convention makes Q of a Gaussian matrix Haar-distributed.
    """
    M, N = a_MN.shape
    if M < N:
        raise ValueError(f"orthonormal_columns: need rows >= columns, got a {M} x {N} matrix")
    a_MN = a_MN.astype(jnp.float32)

    def column(j, q_MN):
        v_M = jax.lax.dynamic_index_in_dim(a_MN, j, axis=1, keepdims=False)
        for _ in range(2):  # columns >= j of q are still zero, so they project out nothing
            v_M = v_M - q_MN @ (q_MN.T @ v_M)
        v_M = v_M / jnp.linalg.norm(v_M)
        return jax.lax.dynamic_update_index_in_dim(q_MN, v_M, j, axis=1)

    return jax.lax.fori_loop(0, N, column, jnp.zeros((M, N), jnp.float32))


def orthogonal(key, shape, dtype=jnp.float32, scale: float = 1.0):
    """Random orthogonal [rows, cols] matrix with the distribution of
    `flax.linen.initializers.orthogonal()` (QR of a Gaussian, signs fixed by diag R),
    computed without LAPACK (see the module docstring)."""
    rows, cols = shape
    tall = rows >= cols
    g = jax.random.normal(key, (rows, cols) if tall else (cols, rows), jnp.float32)
    q = orthonormal_columns(g)
    return (scale * (q if tall else q.T)).astype(dtype)
