"""`dense`: exact softmax attention, the oracle every other variant is tested against.

It materializes the [B, H, L, S] score matrix (O(L^2) memory) and computes the softmax
in float32 whatever the input dtype. Fully masked rows (padding queries) give zeros.
"""

from __future__ import annotations

import jax.numpy as jnp

from hpnlp.attention.base import (Attention, attend, check_inputs, masked_softmax_attention,
                                  register, segment_mask, softmax_probabilities)


def _allowed(q_BLHD, k_BSHD, mask_BL, causal: bool):
    if mask_BL is None and not causal:
        return None
    B, L = q_BLHD.shape[:2]
    S = k_BSHD.shape[1]
    seg_q = jnp.ones((B, L), jnp.int32) if mask_BL is None else mask_BL
    seg_k = jnp.ones((B, S), jnp.int32) if mask_BL is None else mask_BL
    return segment_mask(seg_q, seg_k, causal=causal)


def dense_attention(q_BLHD, k_BSHD, v_BSHD, mask_BL=None, *, causal: bool = False):
    """Functional form of the reference (self-attention: q, k share `mask_BL`)."""
    check_inputs(q_BLHD, k_BSHD, v_BSHD, mask_BL)
    return masked_softmax_attention(q_BLHD, k_BSHD, v_BSHD, _allowed(q_BLHD, k_BSHD, mask_BL, causal))


@register("dense")
class DenseAttention(Attention):
    """Vaswani et al. 2017, "Attention Is All You Need": softmax(QK^T / sqrt(D)) V, exactly."""

    heads_independent = True
    returns_probabilities = True

    def __call__(self, q, k, v, mask=None, *, causal: bool = False, deterministic: bool = True):
        if self.scope is not None and self.is_mutable_collection("attention_probs"):  # distillation
            check_inputs(q, k, v, mask)
            p_BHLS = softmax_probabilities(q, k, _allowed(q, k, mask, causal))
            self.sow("attention_probs", "probs", p_BHLS)
            return attend(p_BHLS, v, q.dtype)
        return dense_attention(q, k, v, mask, causal=causal)
