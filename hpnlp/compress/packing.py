"""Packed integer storage: int4 two per byte, binary eight per byte.

The canonical layouts every quantized checkpoint and kernel agree on, for a weight
`w_KxN` (K the contraction axis, N the output channels) or activations `x_MxK`:

    int4   uint8 [ceil(K/2), N]: row 2i in the low nibble, row 2i+1 in the high nibble,
           each a 4-bit two's complement value in [-8, 7]; an odd K pads a zero row.
    binary uint8 [ceil(K/8), N] (weights) or [M, ceil(K/8)] (activations): bit j of byte
           i is element 8i+j along K, 1 for +1 and 0 for -1; the padding bits past K are
           0 in every operand, so they cancel in XNOR-popcount products.

Both pack along K, the axis a product sums over, so a kernel unpacks a K-block of a
column in registers. numpy and jax.numpy arrays both work (`xp` follows the input).
"""

from __future__ import annotations

import numpy as np


def _xp(a):
    import jax.numpy as jnp
    return np if isinstance(a, np.ndarray) else jnp


def pack_int4(q_KxN, axis: int = 0):
    """int values in [-8, 7] -> uint8 with two per byte along `axis` (default K = 0)."""
    xp = _xp(q_KxN)
    q = xp.moveaxis(xp.asarray(q_KxN), axis, 0)
    if q.shape[0] % 2:
        q = xp.concatenate([q, xp.zeros((1,) + q.shape[1:], q.dtype)], axis=0)
    u = q.astype(xp.int8).astype(xp.uint8) & 0x0F
    packed = u[0::2] | (u[1::2] << 4)
    return xp.moveaxis(packed.astype(xp.uint8), 0, axis)


def unpack_int4(p, k: int, axis: int = 0):
    """Inverse of `pack_int4`: int8 values in [-8, 7], `k` of them along `axis`."""
    xp = _xp(p)
    p = xp.moveaxis(xp.asarray(p), axis, 0).astype(xp.uint8)
    lo = (p & 0x0F).astype(xp.int8)
    hi = (p >> 4).astype(xp.int8)
    both = xp.stack([lo, hi], axis=1).reshape((2 * p.shape[0],) + p.shape[1:])[:k]
    both = xp.where(both > 7, both - 16, both).astype(xp.int8)
    return xp.moveaxis(both, 0, axis)


def pack_bits(sign, axis: int = 0):
    """Signs (any array: > 0 is +1, else -1) -> uint8, eight per byte along `axis`."""
    xp = _xp(sign)
    s = xp.moveaxis(xp.asarray(sign) > 0, axis, 0)
    pad = (-s.shape[0]) % 8
    if pad:
        s = xp.concatenate([s, xp.zeros((pad,) + s.shape[1:], bool)], axis=0)
    s = s.reshape((s.shape[0] // 8, 8) + s.shape[1:]).astype(xp.uint8)
    weights = (1 << xp.arange(8, dtype=xp.uint8)).reshape((1, 8) + (1,) * (s.ndim - 2))
    packed = xp.sum(s * weights.astype(xp.uint8), axis=1, dtype=xp.uint8)
    return xp.moveaxis(packed, 0, axis)


def unpack_bits(p, k: int, axis: int = 0, dtype=np.int8):
    """Inverse of `pack_bits`: +1 / -1 values of `dtype`, `k` of them along `axis`."""
    xp = _xp(p)
    p = xp.moveaxis(xp.asarray(p), axis, 0).astype(xp.uint8)
    shifts = xp.arange(8, dtype=xp.uint8).reshape((1, 8) + (1,) * (p.ndim - 1))
    bits = (p[:, None] >> shifts) & 1
    bits = bits.reshape((8 * p.shape[0],) + p.shape[1:])[:k]
    return xp.moveaxis((2 * bits.astype(xp.int8) - 1).astype(dtype), 0, axis)
