"""`linformer`: softmax attention over a learned low-rank projection of the sequence
(Wang et al. 2020, "Linformer: Self-Attention with Linear Complexity").

The idea: the [L, L] attention matrix is approximately low rank, so keys and values are
first projected along the *length* axis to `proj_len` = k rows, K' = E K and V' = F V with
learned E, F of shape [k, max_len]; each query then attends to k projected keys, which
costs O(L k) instead of O(L^2). E and F are shared across heads (the paper's headwise
sharing); `share_kv=True` also makes F = E (its key-value sharing). Inputs shorter than
`max_len` use the first L columns of E and F.

Padding: padded keys and values are zeroed before projecting, so they never reach a real
output. A projected slot whose projection row has no weight on any real token (possible
only when E has exact zeros, e.g. the identity) holds nothing and is masked out of the
softmax; with proj_len = L and E = F = I this makes the layer exactly dense attention
(the test pins that down). Padding queries output zeros.

Length projection mixes every position of a row, so the layer cannot be causal (a query
would see projected future tokens) and cannot keep packed segments apart: only right
padding (mask != 0 marks the real tokens).

Shape letters: B batch, L length, H heads, D head dim, K projected length (`proj_len`),
M `max_len`.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from hpnlp.attention.base import Attention, check_inputs, register
from hpnlp.config import ConfigError

_NEG = -1e30


def _positive_int(options, cls, name, field):
    value = options.get(name, getattr(cls, name))
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"config field `{field}.{name}` = {value!r} is not allowed: "
                          "must be a positive integer")
    return value


def linformer_attention(q_BLHD, k_BLHD, v_BLHD, e_KL, f_KL, valid_BL=None):
    """Softmax attention of every query over the projected keys E k and values F v.

    `e_KL`, `f_KL` are the projections already cut to the input length; `valid_BL` is a
    boolean padding mask (None: no padding). Float32 softmax; padding queries give zeros.
    """
    B, L, H, D = q_BLHD.shape
    if valid_BL is None:
        valid_BL = jnp.ones((B, L), bool)
    keep_BL11 = valid_BL[:, :, None, None]
    k_BLHD = jnp.where(keep_BL11, k_BLHD, 0).astype(jnp.float32)
    v_BLHD = jnp.where(keep_BL11, v_BLHD, 0).astype(jnp.float32)
    e_KL = e_KL.astype(jnp.float32)
    f_KL = f_KL.astype(jnp.float32)
    kp_BKHD = jnp.einsum("kl,blhd->bkhd", e_KL, k_BLHD)
    vp_BKHD = jnp.einsum("kl,blhd->bkhd", f_KL, v_BLHD)
    # A projected slot that weighs no real token in either projection is empty: mask it.
    vf_BL = valid_BL.astype(jnp.float32)
    reach_BK = (jnp.einsum("kl,bl->bk", jnp.abs(e_KL) + jnp.abs(f_KL), vf_BL) > 0)
    logits_BHLK = jnp.einsum("blhd,bkhd->bhlk", q_BLHD.astype(jnp.float32), kp_BKHD)
    logits_BHLK = logits_BHLK / jnp.sqrt(jnp.float32(D))
    ok_B1LK = (valid_BL[:, :, None] & reach_BK[:, None, :])[:, None]
    logits_BHLK = jnp.where(ok_B1LK, logits_BHLK, _NEG)
    m_BHL1 = jax.lax.stop_gradient(jnp.max(logits_BHLK, axis=-1, keepdims=True))
    p_BHLK = jnp.where(ok_B1LK, jnp.exp(logits_BHLK - m_BHL1), 0.0)
    denom_BHL1 = jnp.sum(p_BHLK, axis=-1, keepdims=True)
    p_BHLK = p_BHLK / jnp.maximum(denom_BHL1, 1e-30)
    out_BLHD = jnp.einsum("bhlk,bkhd->blhd", p_BHLK, vp_BKHD)
    return out_BLHD.astype(q_BLHD.dtype)


@register("linformer")
class LinformerAttention(Attention):
    """Linformer (Wang et al. 2020): project keys and values along the length axis to
    `proj_len` rows with learned E, F, so attention costs O(L * proj_len), not O(L^2).

    Options: `proj_len` (k, default 64), `max_len` (longest input, default 512),
    `share_kv` (F = E, default False). Non-causal, right padding only.
    """

    proj_len: int = 64
    max_len: int = 512
    share_kv: bool = False

    supports_causal = False
    supports_segments = False

    @classmethod
    def check_config(cls, options, *, seq_len, causal, field="attention.options"):
        super().check_config(options, seq_len=seq_len, causal=causal, field=field)
        _positive_int(options, cls, "proj_len", field)
        max_len = _positive_int(options, cls, "max_len", field)
        if seq_len > max_len:
            raise ConfigError(
                f"config field `{field}.max_len` = {max_len} is not allowed: it must be >= "
                f"data.seq_len={seq_len} (the length projections have max_len columns)")
        share = options.get("share_kv", cls.share_kv)
        if not isinstance(share, bool):
            raise ConfigError(f"config field `{field}.share_kv` = {share!r} is not allowed: "
                              "must be True or False")

    @nn.compact
    def __call__(self, q, k, v, mask=None, *, causal: bool = False, deterministic: bool = True):
        check_inputs(q, k, v, mask)
        if causal:
            raise ValueError("attention variant 'linformer' cannot be causal: its length "
                             "projection mixes future tokens into every key")
        L = q.shape[1]
        if k.shape[1] != L:
            raise ValueError(f"linformer is self-attention: q and k lengths differ, "
                             f"q{q.shape} k{k.shape}")
        if L > self.max_len:
            raise ValueError(f"linformer: sequence length {L} exceeds the option "
                             f"max_len={self.max_len} (columns of the length projections); "
                             "raise attention.options.max_len")
        # Normal(1/sqrt(k)) as in the reference implementation: each projected row starts
        # as a random mixture of the sequence.
        init = nn.with_logical_partitioning(nn.initializers.normal(self.proj_len ** -0.5),
                                            (None, None))
        e_KM = self.param("E", init, (self.proj_len, self.max_len), jnp.float32)
        f_KM = e_KM if self.share_kv else self.param("F", init, (self.proj_len, self.max_len),
                                                       jnp.float32)
        valid_BL = None if mask is None else mask != 0
        return linformer_attention(q, k, v, e_KM[:, :L], f_KM[:, :L], valid_BL)
