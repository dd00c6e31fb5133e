"""Ring attention: exact attention with the sequence axis sharded across devices.

Liu, Zaharia & Abbeel 2023, "Ring Attention with Blockwise Transformers". Each device
holds one block of queries, keys and values. In n steps every key/value block travels
once around the ring (`lax.ppermute` to the next device) while each device folds the
block it currently holds into an online softmax (running max, normalizer and weighted
sum, as in `chunked`), so no device ever holds more than two key/value blocks and the
[L, L] scores never exist anywhere. The result is exactly softmax attention.

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
    B, L, H, D = q_BLHD.shape
    if L % n:
        raise ValueError(f"ring_attention: sequence length {L} must divide into {n} devices "
                         f"along {axis!r}; pad it to a multiple of {n}")
    seg_BL = jnp.ones((B, L), jnp.int32) if mask_BL is None else mask_BL.astype(jnp.int32)
    scale = 1.0 / jnp.sqrt(jnp.float32(D))
    ring = [(j, (j + 1) % n) for j in range(n)]
    spec, seg_spec = P(None, axis, None, None), P(None, axis)

    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(spec, spec, spec, seg_spec),
                       out_specs=spec, axis_names=frozenset({axis}), check_vma=False)
    def local(q_BQHD, k_BKHD, v_BKHD, seg_BQ):
        me = jax.lax.axis_index(axis)
        Q = q_BQHD.shape[1]
        q_pos = me * Q + jnp.arange(Q)

        def step(i, carry):
            m_BHQ, l_BHQ, acc_BQHD, k_BKHD, v_BKHD, kseg_BK = carry
            src = (me - i) % n  # the device whose key block we hold at step i
            k_pos = src * Q + jnp.arange(Q)

            def fold(c):
                m_BHQ, l_BHQ, acc_BQHD = c
                s_BHQK = jnp.einsum("bqhd,bkhd->bhqk", q_BQHD, k_BKHD,
                                    preferred_element_type=jnp.float32) * scale
                ok_BQK = (seg_BQ[:, :, None] == kseg_BK[:, None, :]) & (kseg_BK[:, None, :] != 0)
                if causal:
                    ok_BQK &= (q_pos[:, None] >= k_pos[None, :])[None]
                ok_B1QK = ok_BQK[:, None]
                s_BHQK = jnp.where(ok_B1QK, s_BHQK, _NEG)
                m_new = jnp.maximum(m_BHQ, s_BHQK.max(-1))
                p_BHQK = jnp.where(ok_B1QK, jnp.exp(s_BHQK - m_new[..., None]), 0.0)
                corr_BHQ = jnp.exp(m_BHQ - m_new)
                acc_new = (acc_BQHD * corr_BHQ.transpose(0, 2, 1)[..., None]
                           + jnp.einsum("bhqk,bkhd->bqhd", p_BHQK, v_BKHD.astype(jnp.float32)))
                return m_new, l_BHQ * corr_BHQ + p_BHQK.sum(-1), acc_new

            # Causal: a key block wholly in this block's future is skipped, not masked.
            needed = (src <= me) if causal else jnp.bool_(True)
            m_BHQ, l_BHQ, acc_BQHD = jax.lax.cond(needed, fold, lambda c: c,
                                                  (m_BHQ, l_BHQ, acc_BQHD))
            k_BKHD, v_BKHD, kseg_BK = jax.lax.ppermute((k_BKHD, v_BKHD, kseg_BK), axis, ring)
            return m_BHQ, l_BHQ, acc_BQHD, k_BKHD, v_BKHD, kseg_BK

        init = (jnp.full((B, H, Q), _NEG, jnp.float32), jnp.zeros((B, H, Q), jnp.float32),
                jnp.zeros((B, Q, H, D), jnp.float32), k_BKHD, v_BKHD, seg_BQ)
        _, l_BHQ, acc_BQHD, *_ = jax.lax.fori_loop(0, n, step, init)
        inv = jnp.where(l_BHQ > 0, 1.0 / jnp.maximum(l_BHQ, 1e-30), 0.0)
        return (acc_BQHD * inv.transpose(0, 2, 1)[..., None]).astype(q_BQHD.dtype)

    return local(q_BLHD, k_BLHD, v_BLHD, seg_BL)


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
