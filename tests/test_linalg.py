"""Orthogonalization without LAPACK (hpnlp/linalg.py) equals QR, and the initializers and
feature draws that need it compile to programs with no LAPACK call (which can deadlock
XLA's CPU thread pool when reached from inside a loop)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hpnlp import linalg
from hpnlp.attention import kernel
from hpnlp.rnn import layers


def _qr_positive(a):
    q, r = np.linalg.qr(np.asarray(a, np.float64))
    return q * np.sign(np.diag(r))[None, :]


@pytest.mark.parametrize("shape", [(16, 16), (24, 8), (64, 64)])
def test_orthonormal_columns_is_q_of_qr_with_positive_diagonal(shape):
    a = jax.random.normal(jax.random.key(0), (3,) + shape)
    q = np.asarray(jax.jit(jax.vmap(linalg.orthonormal_columns))(a), np.float64)
    for i in range(3):
        np.testing.assert_allclose(q[i], _qr_positive(a[i]), atol=2e-5)
        np.testing.assert_allclose(q[i].T @ q[i], np.eye(shape[1]), atol=2e-6)


def test_orthogonal_matches_flax_shapes_and_is_orthogonal():
    for shape in [(8, 8), (12, 5), (5, 12)]:
        w = np.asarray(jax.jit(linalg.orthogonal, static_argnums=1)(jax.random.key(1), shape),
                       np.float64)
        assert w.shape == shape
        small = min(shape)
        gram = w.T @ w if shape[0] >= shape[1] else w @ w.T
        np.testing.assert_allclose(gram, np.eye(small), atol=2e-6)
    with pytest.raises(ValueError, match="rows >= columns"):
        linalg.orthonormal_columns(jnp.ones((2, 3)))


def test_no_lapack_call_in_rnn_init_or_feature_redraw():
    hlo_rnn = jax.jit(lambda k: layers._orthogonal_per_gate(k, (2, 8, 4, 8))).lower(
        jax.random.key(0)).as_text()
    hlo_features = jax.jit(lambda k: kernel.orthogonal_random_features(k, 32, 8)).lower(
        jax.random.key(0)).as_text()
    for hlo in (hlo_rnn, hlo_features):
        assert "custom_call" not in hlo and "lapack" not in hlo.lower()
