"""`chunked`: exact attention in O(L) memory (Rabe & Staats 2021, "Self-attention Does
Not Need O(n^2) Memory"; the same online softmax as FlashAttention).

The idea: softmax(QK^T)V can be accumulated over key blocks with a running max `m`,
running normalizer `l` and running weighted sum, so no [L, S] matrix ever exists. Query
blocks run one at a time under `jax.checkpoint`, so the backward pass recomputes a
block's scores instead of storing them. Key blocks that a causal mask hides entirely, or
that hold only padding, are skipped with `lax.cond` (real work saved, not just masked).

Shape letters: B batch, H heads, D head dim, Q query block, K key block,
NQ / NK number of query / key blocks.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from hpnlp.attention.base import Attention, check_inputs, register
from hpnlp.config import ConfigError

_NEG = -1e30


def _blocks(x, n):
    """[B, L, ...] -> [n, B, L/n, ...]."""
    return x.reshape((x.shape[0], n, x.shape[1] // n) + x.shape[2:]).swapaxes(0, 1)


def chunked_attention(q_BLHD, k_BSHD, v_BSHD, mask_BL=None, *, causal=False,
                      block_q=128, block_k=128):
    check_inputs(q_BLHD, k_BSHD, v_BSHD, mask_BL)
    B, L, H, D = q_BLHD.shape
    S = k_BSHD.shape[1]
    for name, block, n in (("block_q", block_q, L), ("block_k", block_k, S)):
        if n % block:
            raise ValueError(f"chunked attention: {name}={block} must divide the sequence length "
                             f"{n}; pick a divisor or pad the input")
    seg_BL = jnp.ones((B, L), jnp.int32) if mask_BL is None else mask_BL.astype(jnp.int32)
    seg_BS = jnp.ones((B, S), jnp.int32) if mask_BL is None else mask_BL.astype(jnp.int32)
    scale = 1.0 / jnp.sqrt(jnp.float32(D))
    nq, nk = L // block_q, S // block_k
    k_blocks = (_blocks(k_BSHD, nk), _blocks(v_BSHD, nk), _blocks(seg_BS, nk), jnp.arange(nk))

    @jax.checkpoint
    def one_query_block(q_BQHD, qseg_BQ, qi):
        q_start = qi * block_q

        def step(carry, xs):
            k_BKHD, v_BKHD, kseg_BK, ki = xs
            k_start = ki * block_k

            def attend(carry):
                m_BHQ, l_BHQ, acc_BQHD = carry
                s_BHQK = jnp.einsum("bqhd,bkhd->bhqk", q_BQHD, k_BKHD,
                                    preferred_element_type=jnp.float32) * scale
                ok_BQK = (qseg_BQ[:, :, None] == kseg_BK[:, None, :]) & (kseg_BK[:, None, :] != 0)
                if causal:
                    qpos = q_start + jnp.arange(block_q)
                    kpos = k_start + jnp.arange(block_k)
                    ok_BQK &= (qpos[:, None] >= kpos[None, :])[None]
                ok_B1QK = ok_BQK[:, None]
                s_BHQK = jnp.where(ok_B1QK, s_BHQK, _NEG)
                m_new = jnp.maximum(m_BHQ, s_BHQK.max(-1))
                p_BHQK = jnp.where(ok_B1QK, jnp.exp(s_BHQK - m_new[..., None]), 0.0)
                corr_BHQ = jnp.exp(m_BHQ - m_new)
                l_new = l_BHQ * corr_BHQ + p_BHQK.sum(-1)
                pv_BQHD = jnp.einsum("bhqk,bkhd->bqhd", p_BHQK, v_BKHD.astype(jnp.float32))
                acc_new = acc_BQHD * corr_BHQ.transpose(0, 2, 1)[..., None] + pv_BQHD
                return m_new, l_new, acc_new

            needed = jnp.any(kseg_BK != 0)
            if causal:
                needed &= k_start <= q_start + block_q - 1
            return jax.lax.cond(needed, attend, lambda c: c, carry), None

        init = (jnp.full((B, H, block_q), _NEG, jnp.float32), jnp.zeros((B, H, block_q), jnp.float32),
                jnp.zeros((B, block_q, H, D), jnp.float32))
        (_, l_BHQ, acc_BQHD), _ = jax.lax.scan(step, init, k_blocks)
        # Rows with no allowed key (padding queries) have l = 0: output zeros, not NaN.
        inv_BQH1 = jnp.where(l_BHQ > 0, 1.0 / jnp.maximum(l_BHQ, 1e-30), 0.0).transpose(0, 2, 1)[..., None]
        return (acc_BQHD * inv_BQH1).astype(q_BLHD.dtype)

    out_NBQHD = jax.lax.map(lambda xs: one_query_block(*xs),
                            (_blocks(q_BLHD, nq), _blocks(seg_BL, nq), jnp.arange(nq)))
    return out_NBQHD.swapaxes(0, 1).reshape(B, L, H, D)


@register("chunked")
class ChunkedAttention(Attention):
    """Exact softmax attention, O(L) memory: online softmax over key blocks (Rabe & Staats)."""

    block_q: int = 128
    block_k: int = 128

    @classmethod
    def check_config(cls, options, *, seq_len, causal, field="attention.options"):
        super().check_config(options, seq_len=seq_len, causal=causal, field=field)
        for name in ("block_q", "block_k"):
            block = options.get(name, getattr(cls, name))
            if not isinstance(block, int) or block <= 0:
                raise ConfigError(f"config field `{field}.{name}` = {block!r} is not allowed: "
                                  "must be a positive integer")
            if seq_len % block:
                divisors = [d for d in (16, 32, 64, 128, 256, 512) if seq_len % d == 0]
                raise ConfigError(
                    f"config field `{field}.{name}` = {block} is not allowed: it must divide "
                    f"data.seq_len={seq_len}; divisors of {seq_len} include {divisors}")

    def __call__(self, q, k, v, mask=None, *, causal: bool = False, deterministic: bool = True):
        return chunked_attention(q, k, v, mask, causal=causal,
                                 block_q=min(self.block_q, q.shape[1]),
                                 block_k=min(self.block_k, k.shape[1]))
