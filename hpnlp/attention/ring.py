"""Ring attention: exact attention with the sequence axis sharded across devices.

Liu, Zaharia & Abbeel 2023, "Ring Attention with Blockwise Transformers". Each device
holds one block of queries, keys and values. In n steps every key/value block travels
once around the ring (`lax.ppermute` to the next device) while each device folds the
block it currently holds into an online softmax (running max, normalizer and weighted
sum, as in `chunked`), so no device ever holds more than two key/value blocks and the
[L, L] scores never exist anywhere: a device holds one step's [L/n, L/n] scores at a time.
The backward pass goes around the ring once more (a custom VJP): each key/value block
travels with its dk and dv, and the probabilities are recomputed from the log-normalizers
the forward kept, so training holds no more than the forward does per step. The result is
exactly softmax attention.

Used through `ring_attention(q, k, v, mask, causal=..., mesh=..., axis="sequence")`;
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

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from hpnlp.attention.base import Attention, check_inputs, register
from hpnlp.attention.chunked import chunked_attention
from hpnlp.config import config_error

_NEG = -1e30


def ring_attention(q_BLHD, k_BLHD, v_BLHD, mask_BL=None, *, causal: bool,
                   mesh: Mesh | None = None, axis: str = "sequence"):
    """`mesh` None: the current mesh (`jax.set_mesh`)."""
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
    seg_BL = jnp.ones((B, L), jnp.int32) if mask_BL is None else mask_BL.astype(jnp.int32)
    return _sharded(q_BLHD, k_BLHD, v_BLHD, seg_BL, causal=causal, mesh=mesh, axis=axis)


# jitted: called eagerly, a shard_map manual over `axis` alone refuses a mesh with others
# (once, at module level: review, a jit built per call compiled every eager call again)
@functools.partial(jax.jit, static_argnames=("causal", "mesh", "axis"))
def _sharded(q_BLHD, k_BLHD, v_BLHD, seg_BL, *, causal, mesh, axis):
    spec, seg_spec = P(None, axis, None, None), P(None, axis)
    local = functools.partial(_ring, causal=causal, axis=axis, n=mesh.shape[axis])
    return jax.shard_map(local, mesh=mesh, in_specs=(spec, spec, spec, seg_spec),
                         out_specs=spec, axis_names=frozenset({axis}),
                         check_vma=False)(q_BLHD, k_BLHD, v_BLHD, seg_BL)


def _scores(q_BQHD, k_BKHD, seg_BQ, kseg_BK, me, src, causal):
    """The scaled scores of this device's queries against the key block of device `src`,
    masked to _NEG, and where they are allowed [B, 1, Q, K]."""
    Q, K = q_BQHD.shape[1], k_BKHD.shape[1]
    s_BHQK = jnp.einsum("bqhd,bkhd->bhqk", q_BQHD, k_BKHD,
                        preferred_element_type=jnp.float32) / math.sqrt(q_BQHD.shape[-1])
    ok_BQK = (seg_BQ[:, :, None] == kseg_BK[:, None, :]) & (kseg_BK[:, None, :] != 0)
    if causal:
        ok_BQK &= ((me * Q + jnp.arange(Q))[:, None] >= (src * K + jnp.arange(K))[None, :])[None]
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


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _ring(q_BQHD, k_BKHD, v_BKHD, seg_BQ, causal, axis, n):
    """One device's share of ring attention (inside the shard_map)."""
    return _ring_fwd(q_BQHD, k_BKHD, v_BKHD, seg_BQ, causal, axis, n)[0]


def _ring_fwd(q_BQHD, k_BKHD, v_BKHD, seg_BQ, causal, axis, n):
    """The online softmax over the blocks as they pass; keeps for the backward pass only
    the inputs, the output and each query's log-normalizer (a bug hunt, session 99: the
    autodiff of the loop kept every step's [Q, K] scores, O(L^2 / n) per device)."""
    B, Q, H = q_BQHD.shape[:3]

    def fold(me, src, c, kv):
        m_BHQ, l_BHQ, acc_BQHD = c
        k_BKHD, v_BKHD, kseg_BK = kv
        s_BHQK, ok_B1QK = _scores(q_BQHD, k_BKHD, seg_BQ, kseg_BK, me, src, causal)
        m_new = jnp.maximum(m_BHQ, s_BHQK.max(-1))
        p_BHQK = jnp.where(ok_B1QK, jnp.exp(s_BHQK - m_new[..., None]), 0.0)
        corr_BHQ = jnp.exp(m_BHQ - m_new)
        acc_new = (acc_BQHD * corr_BHQ.transpose(0, 2, 1)[..., None]
                   + jnp.einsum("bhqk,bkhd->bqhd", p_BHQK, v_BKHD.astype(jnp.float32)))
        return (m_new, l_BHQ * corr_BHQ + p_BHQK.sum(-1), acc_new), kv

    init = (jnp.full((B, H, Q), _NEG, jnp.float32), jnp.zeros((B, H, Q), jnp.float32),
            jnp.zeros((B, Q, H, v_BKHD.shape[-1]), jnp.float32))
    (m_BHQ, l_BHQ, acc_BQHD), _ = _around(n, axis, causal, fold, init,
                                          (k_BKHD, v_BKHD, seg_BQ))
    inv = jnp.where(l_BHQ > 0, 1.0 / jnp.maximum(l_BHQ, 1e-30), 0.0)
    out_BQHD = (acc_BQHD * inv.transpose(0, 2, 1)[..., None]).astype(q_BQHD.dtype)
    lse_BHQ = jnp.where(l_BHQ > 0, m_BHQ + jnp.log(jnp.maximum(l_BHQ, 1e-30)), 0.0)
    return out_BQHD, (q_BQHD, k_BKHD, v_BKHD, seg_BQ, out_BQHD, lse_BHQ)


def _ring_bwd(causal, axis, n, res, dout_BQHD):
    """A second trip around the ring: each key/value block travels with its own dk and dv,
    which every device adds its queries' share to, and is home after n steps; the
    probabilities are recomputed a block at a time from the log-normalizers."""
    q_BQHD, k_BKHD, v_BKHD, seg_BQ, out_BQHD, lse_BHQ = res
    f32 = lambda x: x.astype(jnp.float32)
    do_BQHD = f32(dout_BQHD)
    delta_BHQ = jnp.einsum("bqhd,bqhd->bhq", do_BQHD, f32(out_BQHD))
    scale = 1.0 / math.sqrt(q_BQHD.shape[-1])

    def fold(me, src, dq_BQHD, kv):
        k_BKHD, v_BKHD, kseg_BK, dk_BKHD, dv_BKHD = kv
        s_BHQK, ok_B1QK = _scores(q_BQHD, k_BKHD, seg_BQ, kseg_BK, me, src, causal)
        p_BHQK = jnp.where(ok_B1QK, jnp.exp(s_BHQK - lse_BHQ[..., None]), 0.0)
        dp_BHQK = jnp.einsum("bqhd,bkhd->bhqk", do_BQHD, f32(v_BKHD))
        ds_BHQK = p_BHQK * (dp_BHQK - delta_BHQ[..., None]) * scale
        return (dq_BQHD + jnp.einsum("bhqk,bkhd->bqhd", ds_BHQK, f32(k_BKHD)),
                (k_BKHD, v_BKHD, kseg_BK,
                 dk_BKHD + jnp.einsum("bhqk,bqhd->bkhd", ds_BHQK, f32(q_BQHD)),
                 dv_BKHD + jnp.einsum("bhqk,bqhd->bkhd", p_BHQK, do_BQHD)))

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

    @classmethod
    def check_config(cls, options, *, seq_len, causal, field="attention.options"):
        super().check_config(options, seq_len=seq_len, causal=causal, field=field)
        from hpnlp.config.fields import MESH_AXES
        axis = options.get("axis", cls.axis)
        if axis not in MESH_AXES:  # a bug hunt: 'seq' ran as chunked on one device, silently
            raise config_error(f"{field}.axis", axis, f"the ring passes key/value blocks around "
                               f"this mesh axis; choose one of {list(MESH_AXES)} (the "
                               "sequence is split over 'sequence')")

    def __call__(self, q, k, v, mask=None, *, causal: bool = False, deterministic: bool = True):
        mesh = jax.sharding.get_abstract_mesh()
        if mesh.empty or self.axis not in mesh.axis_names or mesh.shape[self.axis] == 1:
            return chunked_attention(q, k, v, mask, causal=causal)
        return ring_attention(q, k, v, mask, causal=causal, mesh=mesh, axis=self.axis)
