"""Ring attention: exact attention with the sequence axis sharded across devices.

Liu, Zaharia & Abbeel 2023, "Ring Attention with Blockwise Transformers". Each device
holds one block of queries, keys and values. In n steps every key/value block travels
once around the ring (`lax.ppermute` to the next device) while each device folds the
block it currently holds into an online softmax (running max, normalizer and weighted
sum, as in `chunked`), so no device ever holds more than two key/value blocks and the
[L, L] scores never exist anywhere. Within a step the device's queries meet the block's
keys a tile at a time (`block`, up to 1024 x 1024; the blocks of Blockwise Transformers), so
a device holds one tile's scores per batch row and head, not the step's [L/n, L/n]; with
causal attention the tiles above the diagonal are skipped. The backward pass goes around the
ring once more (a custom VJP): each key/value block travels with its dk and dv, and the
probabilities are recomputed tile by tile from the log-normalizers the forward kept, so
training holds about what the forward does. The result is exactly softmax attention.
`python tools/ring_memory.py` measures the memory per device.

Used through `ring_attention(q, k, v, mask, causal=..., mesh=..., axis="sequence", block=None)`;
`q, k, v` are global [B, L, H, D] arrays (sharded or not: shard_map lays them out by
`axis`), `mask` segment ids [B, L] (0 = padding) or None. Only `axis` is manual inside
the shard_map; the other mesh axes stay automatic, so batch stays split over `data` and
heads over `tensor` as the rules say. In models, `attention.name = "ring"` with
`mesh.sequence > 1` (sequence parallelism); with no sequence axis in the current mesh it
is `chunked` attention, exact all the same.

Shape letters: B batch, H heads, D head dim, Q local query block, K local key block.
"""

from __future__ import annotations

import functools
import math
import operator

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from hpnlp.attention.base import Attention, check_inputs, register
from hpnlp.attention.chunked import chunked_attention
from hpnlp.config import config_error

_NEG = -1e30


# A ring step's tile of scores is at most [DEFAULT_BLOCK, DEFAULT_BLOCK] per batch row and
# head (4 MiB in float32), as `chunked`'s default blocks are.
DEFAULT_BLOCK = 1024


def ring_attention(q_BLHD, k_BLHD, v_BLHD, mask_BL=None, *, causal: bool,
                   mesh: Mesh | None = None, axis: str = "sequence", block: int | None = None):
    """`mesh` None: the current mesh (`jax.set_mesh`). `block`: each ring step's tile size
    along the local query and key blocks (it must divide L / n); None: the largest
    divisor of L / n up to DEFAULT_BLOCK (the whole L / n, one tile, where it has no divisor
    of DEFAULT_BLOCK / 8 or more)."""
    check_inputs(q_BLHD, k_BLHD, v_BLHD, mask_BL)
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    if axis not in mesh.axis_names:
        raise ValueError(f"ring_attention: mesh has axes {mesh.axis_names}, not {axis!r}; "
                         "build the mesh with a sequence axis")
    n = mesh.shape[axis]
    B, L = q_BLHD.shape[:2]
    if L % n:
        raise ValueError(f"ring_attention: sequence length {L} must divide into {n} devices "
                         f"along {axis!r}; pad it to a multiple of {n}")
    if k_BLHD.shape[1] != L:  # each device's key block travels with its queries' segment ids
        raise ValueError(f"ring_attention: the key length {k_BLHD.shape[1]} must equal the "
                         f"query length {L} (self-attention over one sharded sequence)")
    local = L // n
    if not L:  # no queries: zeros, as chunked's (a review, session 118: max() of nothing)
        return jnp.zeros((B, 0, q_BLHD.shape[2], v_BLHD.shape[-1]), q_BLHD.dtype)
    if block is None:
        block = _divisor_block(local, DEFAULT_BLOCK)
    else:  # a numpy integer (computed from shapes) is an integer too (a bug hunt, session
        # 101: np.int64(4) was refused as not dividing 8)
        try:
            whole = None if isinstance(block, (bool, np.bool_)) else operator.index(block)
        except TypeError:
            whole = None
        if whole is None:
            raise ValueError(f"ring_attention: block={block!r} must be an integer dividing "
                             f"each device's {local} positions, or None")
        if not (0 < whole and local % whole == 0):
            raise ValueError(f"ring_attention: block={block!r} must divide each device's "
                             f"{local} positions (L={L} over {n} devices); pass a divisor of "
                             f"{local}, or None")
        block = whole
    seg_BL = jnp.ones((B, L), jnp.int32) if mask_BL is None else mask_BL.astype(jnp.int32)
    return _sharded(q_BLHD, k_BLHD, v_BLHD, seg_BL, causal=causal, mesh=mesh, axis=axis,
                    block=block)


def _divisor_block(n: int, target: int) -> int:
    """The largest divisor of `n` up to `target`; `n` itself where that is under
    target / 8 (a length with no useful divisor, e.g. a prime: one tile, as before)."""
    best = max(b for b in range(1, min(n, target) + 1) if n % b == 0)
    return n if best * 8 < min(n, target) else best


# jitted: called eagerly, a shard_map manual over `axis` alone refuses a mesh with others
# (once, at module level: review, a jit built per call compiled every eager call again)
@functools.partial(jax.jit, static_argnames=("causal", "mesh", "axis", "block"))
def _sharded(q_BLHD, k_BLHD, v_BLHD, seg_BL, *, causal, mesh, axis, block):
    spec, seg_spec = P(None, axis, None, None), P(None, axis)
    if AxisType.Explicit in tuple(getattr(mesh, "axis_types", ())):
        # jax.make_mesh's default: shard_map then takes inputs only as its in_specs lay
        # them out (a bug hunt, session 100: a ValueError, sharded inputs or not)
        q_BLHD, k_BLHD, v_BLHD, seg_BL = (
            jax.sharding.reshard(x, NamedSharding(mesh, s))
            for x, s in ((q_BLHD, spec), (k_BLHD, spec), (v_BLHD, spec), (seg_BL, seg_spec)))
    local = functools.partial(_ring, causal=causal, axis=axis, n=mesh.shape[axis], bq=block,
                              bk=block)
    return jax.shard_map(local, mesh=mesh, in_specs=(spec, spec, spec, seg_spec),
                         out_specs=spec, axis_names=frozenset({axis}),
                         check_vma=False)(q_BLHD, k_BLHD, v_BLHD, seg_BL)


def _scores(q_BQHD, k_BKHD, seg_BQ, kseg_BK, qpos0, kpos0, causal):
    """The scaled scores of a block of queries (the first at sequence position `qpos0`)
    against a block of keys (the first at `kpos0`), masked to _NEG, and where they are
    allowed [B, 1, Q, K]."""
    Q, K = q_BQHD.shape[1], k_BKHD.shape[1]
    s_BHQK = jnp.einsum("bqhd,bkhd->bhqk", q_BQHD, k_BKHD,
                        preferred_element_type=jnp.float32) / math.sqrt(q_BQHD.shape[-1])
    ok_BQK = (seg_BQ[:, :, None] == kseg_BK[:, None, :]) & (kseg_BK[:, None, :] != 0)
    if causal:
        ok_BQK &= ((qpos0 + jnp.arange(Q))[:, None] >= (kpos0 + jnp.arange(K))[None, :])[None]
    ok_B1QK = ok_BQK[:, None]
    return jnp.where(ok_B1QK, s_BHQK, _NEG), ok_B1QK


def _around(n, axis, causal, fold, carry, travelling):
    """`n` steps of `fold(me, src, carry, travelling)` -> (carry, travelling), where
    `travelling` (a key/value block and what goes with it) is that of device `src` and moves
    on to the next device after each step; after the n-th move each device holds its own
    again. Causal: a block wholly in this device's future is skipped, not masked."""
    me = jax.lax.axis_index(axis)
    ring = [(j, (j + 1) % n) for j in range(n)]

    def step(i, state):
        src = (me - i) % n  # the device whose key block we hold at step i
        needed = (src <= me) if causal else jnp.bool_(True)
        carry, travelling = jax.lax.cond(needed, lambda s: fold(me, src, *s), lambda s: s, state)
        return carry, jax.lax.ppermute(travelling, axis, ring)

    return jax.lax.fori_loop(0, n, step, (carry, travelling))


def _tiles(me, src, Q, K, bq, bk, causal, tile, carry):
    """`tile(i, j, qpos0, kpos0, carry)` -> carry for each (query sub-block i, key sub-block
    j) of one ring step, queries outside, keys inside; with `causal`, a tile wholly in its
    queries' future is skipped. This is what bounds a device's scores at [bq, bk] (not
    [Q, K]) per batch row and head: the blocks of Blockwise Transformers."""
    def row(i, carry):
        qpos0 = me * Q + i * bq

        def col(j, carry):
            kpos0 = src * K + j * bk
            if not causal:
                return tile(i, j, qpos0, kpos0, carry)
            return jax.lax.cond(qpos0 + bq - 1 >= kpos0,
                                lambda c: tile(i, j, qpos0, kpos0, c), lambda c: c, carry)

        return jax.lax.fori_loop(0, K // bk, col, carry)

    return jax.lax.fori_loop(0, Q // bq, row, carry)


def _cut(x, i, size, axis):
    return jax.lax.dynamic_slice_in_dim(x, i * size, size, axis)


def _put(x, i, part, axis):
    return jax.lax.dynamic_update_slice_in_dim(x, part, i * part.shape[axis], axis)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8))
def _ring(q_BQHD, k_BKHD, v_BKHD, seg_BQ, causal, axis, n, bq, bk):
    """One device's share of ring attention (inside the shard_map)."""
    return _ring_fwd(q_BQHD, k_BKHD, v_BKHD, seg_BQ, causal, axis, n, bq, bk)[0]


def _ring_fwd(q_BQHD, k_BKHD, v_BKHD, seg_BQ, causal, axis, n, bq, bk):
    """The online softmax over the blocks as they pass; keeps for the backward pass only
    the inputs, the output and each query's log-normalizer (a bug hunt, session 99: the
    autodiff of the loop kept every step's [Q, K] scores, O(L^2 / n) per device)."""
    B, Q, H = q_BQHD.shape[:3]
    K = k_BKHD.shape[1]

    def fold(me, src, c, kv):
        k_BKHD, v_BKHD, kseg_BK = kv

        def tile(i, j, qpos0, kpos0, c):
            m_BHQ, l_BHQ, acc_BQHD = c
            m_BHq, l_BHq, acc_BqHD = _cut(m_BHQ, i, bq, 2), _cut(l_BHQ, i, bq, 2), \
                _cut(acc_BQHD, i, bq, 1)
            v_BkHD = _cut(v_BKHD, j, bk, 1)
            s_BHqk, ok_B1qk = _scores(_cut(q_BQHD, i, bq, 1), _cut(k_BKHD, j, bk, 1),
                                      _cut(seg_BQ, i, bq, 1), _cut(kseg_BK, j, bk, 1),
                                      qpos0, kpos0, causal)
            m_new = jnp.maximum(m_BHq, s_BHqk.max(-1))
            p_BHqk = jnp.where(ok_B1qk, jnp.exp(s_BHqk - m_new[..., None]), 0.0)
            corr_BHq = jnp.exp(m_BHq - m_new)
            acc_new = (acc_BqHD * corr_BHq.transpose(0, 2, 1)[..., None]
                       + jnp.einsum("bhqk,bkhd->bqhd", p_BHqk, v_BkHD.astype(jnp.float32)))
            return (_put(m_BHQ, i, m_new, 2), _put(l_BHQ, i, l_BHq * corr_BHq +
                                                   p_BHqk.sum(-1), 2),
                    _put(acc_BQHD, i, acc_new, 1))

        return _tiles(me, src, Q, K, bq, bk, causal, tile, c), kv

    init = (jnp.full((B, H, Q), _NEG, jnp.float32), jnp.zeros((B, H, Q), jnp.float32),
            jnp.zeros((B, Q, H, v_BKHD.shape[-1]), jnp.float32))
    (m_BHQ, l_BHQ, acc_BQHD), _ = _around(n, axis, causal, fold, init,
                                          (k_BKHD, v_BKHD, seg_BQ))
    inv = jnp.where(l_BHQ > 0, 1.0 / jnp.maximum(l_BHQ, 1e-30), 0.0)
    out_BQHD = (acc_BQHD * inv.transpose(0, 2, 1)[..., None]).astype(q_BQHD.dtype)
    lse_BHQ = jnp.where(l_BHQ > 0, m_BHQ + jnp.log(jnp.maximum(l_BHQ, 1e-30)), 0.0)
    return out_BQHD, (q_BQHD, k_BKHD, v_BKHD, seg_BQ, out_BQHD, lse_BHQ)


def _ring_bwd(causal, axis, n, bq, bk, res, dout_BQHD):
    """A second trip around the ring: each key/value block travels with its own dk and dv,
    which every device adds its queries' share to, and is home after n steps; the
    probabilities are recomputed a tile at a time from the log-normalizers."""
    q_BQHD, k_BKHD, v_BKHD, seg_BQ, out_BQHD, lse_BHQ = res
    Q, K = q_BQHD.shape[1], k_BKHD.shape[1]
    f32 = lambda x: x.astype(jnp.float32)
    do_BQHD = f32(dout_BQHD)
    delta_BHQ = jnp.einsum("bqhd,bqhd->bhq", do_BQHD, f32(out_BQHD))
    scale = 1.0 / math.sqrt(q_BQHD.shape[-1])

    def fold(me, src, dq_BQHD, kv):
        k_BKHD, v_BKHD, kseg_BK, dk_BKHD, dv_BKHD = kv

        def tile(i, j, qpos0, kpos0, c):
            dq_BQHD, dk_BKHD, dv_BKHD = c
            q_BqHD, do_BqHD = _cut(q_BQHD, i, bq, 1), _cut(do_BQHD, i, bq, 1)
            k_BkHD, v_BkHD = _cut(k_BKHD, j, bk, 1), f32(_cut(v_BKHD, j, bk, 1))
            s_BHqk, ok_B1qk = _scores(q_BqHD, k_BkHD, _cut(seg_BQ, i, bq, 1),
                                      _cut(kseg_BK, j, bk, 1), qpos0, kpos0, causal)
            p_BHqk = jnp.where(ok_B1qk, jnp.exp(s_BHqk - _cut(lse_BHQ, i, bq, 2)[..., None]),
                               0.0)
            dp_BHqk = jnp.einsum("bqhd,bkhd->bhqk", do_BqHD, v_BkHD)
            ds_BHqk = p_BHqk * (dp_BHqk - _cut(delta_BHQ, i, bq, 2)[..., None]) * scale
            return (_put(dq_BQHD, i, _cut(dq_BQHD, i, bq, 1)
                         + jnp.einsum("bhqk,bkhd->bqhd", ds_BHqk, f32(k_BkHD)), 1),
                    _put(dk_BKHD, j, _cut(dk_BKHD, j, bk, 1)
                         + jnp.einsum("bhqk,bqhd->bkhd", ds_BHqk, f32(q_BqHD)), 1),
                    _put(dv_BKHD, j, _cut(dv_BKHD, j, bk, 1)
                         + jnp.einsum("bhqk,bqhd->bkhd", p_BHqk, do_BqHD), 1))

        dq_BQHD, dk_BKHD, dv_BKHD = _tiles(me, src, Q, K, bq, bk, causal, tile,
                                           (dq_BQHD, dk_BKHD, dv_BKHD))
        return dq_BQHD, (k_BKHD, v_BKHD, kseg_BK, dk_BKHD, dv_BKHD)

    zeros = functools.partial(jnp.zeros_like, dtype=jnp.float32)
    dq_BQHD, (*_, dk_BKHD, dv_BKHD) = _around(
        n, axis, causal, fold, zeros(q_BQHD),
        (k_BKHD, v_BKHD, seg_BQ, zeros(k_BKHD), zeros(v_BKHD)))
    return (dq_BQHD.astype(q_BQHD.dtype), dk_BKHD.astype(k_BKHD.dtype),
            dv_BKHD.astype(v_BKHD.dtype), None)


_ring.defvjp(_ring_fwd, _ring_bwd)


@register("ring")
class RingAttention(Attention):
    """Exact attention, sequence-parallel: each device holds L / n queries and passes its
    key/value block around the ring (Liu et al. 2023). Set `mesh.sequence` > 1 to use it;
    without a sequence axis in the mesh it runs as `chunked` (same result, one device)."""

    heads_independent = True

    axis: str = "sequence"
    # each ring step's tile; None: up to DEFAULT_BLOCK (see above); without a sequence axis
    # (the layer runs as `chunked`, which chooses its own blocks) it is not used
    block: int | None = None

    @classmethod
    def check_config(cls, options, *, seq_len, causal, field="attention.options"):
        super().check_config(options, seq_len=seq_len, causal=causal, field=field)
        from hpnlp.config.fields import MESH_AXES
        block = options.get("block", cls.block)
        if block is not None and (not isinstance(block, int) or isinstance(block, bool)
                                  or block <= 0 or seq_len % block):
            raise config_error(f"{field}.block", block, "each ring step's tile size must be a "
                               "positive integer dividing data.seq_len / mesh.sequence (the "
                               "positions each device holds), or None to choose it")
        axis = options.get("axis", cls.axis)
        if axis not in MESH_AXES:  # a bug hunt: 'seq' ran as chunked on one device, silently
            raise config_error(f"{field}.axis", axis, f"the ring passes key/value blocks around "
                               f"this mesh axis; choose one of {list(MESH_AXES)} (the "
                               "sequence is split over 'sequence')")

    def __call__(self, q, k, v, mask=None, *, causal: bool = False, deterministic: bool = True):
        mesh = jax.sharding.get_abstract_mesh()
        if mesh.empty or self.axis not in mesh.axis_names or mesh.shape[self.axis] == 1:
            return chunked_attention(q, k, v, mask, causal=causal)
        return ring_attention(q, k, v, mask, causal=causal, mesh=mesh, axis=self.axis,
                              block=self.block)
