"""`sinkhorn`: Sparse Sinkhorn Attention (Tay et al. 2020, "Sparse Sinkhorn Attention").

The idea: cut the sequence into blocks of `block_size` tokens and let a small learned
sorting network decide, for every query block, which key block it should see besides its
own. The sorter scores block-to-block assignments from block summaries (the mean key of
each block), and Gumbel-Sinkhorn normalization (`sinkhorn_iters` alternating row and
column normalizations in log space, at `temperature`) turns the scores into a soft
permutation P, differentiable end to end. Every query block then attends to its own block
plus the P-sorted key/value block, sum_j P[i, j] * block_j (slot by slot renormalized over
the real keys, see Padding): O(L * block_size) scores instead of O(L^2), and
O((L / block_size)^2) for the sorter.

Sorting network: a bilinear score R[i, j] = s_i W s_j / sqrt(D) per head between block
summaries s (not the paper's MLP with L/block_size outputs), so any length works; a
length that is not a multiple of `block_size` is padded automatically. Gumbel noise is
added only when not deterministic, drawn from the "dropout" RNG (or "features").

Padding: padded keys are left out of the summaries and all-padding blocks are excluded
from the assignment. A sorted key slot counts with its real mass m = sum_j P[i, j] [key j
is real], i.e. its logit gets + log(m), and its key and value are the m-normalized mixes
sum_j P[i, j] [key j is real] k_j / m (and v_j), so every output is a softmax average of
real values (the paper's P K, divided by P's row sum, ~1, where nothing is padded). A hard
permutation behaves exactly like attending to the chosen block with its own mask. Padding
queries give zeros. With a single block the layer is exactly dense attention (the sorted
block is the block itself, each key counted twice, which softmax cancels).

The sorter needs summaries of whole blocks, future included, so the variant is not
causal; it sorts across segments, so it takes right padding only (mask != 0 = real).

Shape letters: B batch, L length, H heads, D head dim, N number of blocks, Q query slots
of a block, K key slots (block_size each; 2 * block_size once local and sorted are joined).
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from hpnlp.attention.base import Attention, check_inputs, register
from hpnlp.config import ConfigError

_NEG = -1e30
_TINY = 1e-30
# Sorted slots are renormalized by max(mass, _MIN_MASS): the gradient of 1 / mass goes as
# 1 / mass^2, which overflows float32 for a mass near _TINY (inf * 0 = NaN); below it the
# slot's softmax weight carries the factor mass < 1e-12, so leaving its mean shrunk is moot.
_MIN_MASS = 1e-12


def gumbel_sinkhorn(scores_BHNN, valid_BN, *, iters: int, temperature: float, noise_BHNN=None):
    """Soft permutation from assignment scores: Sinkhorn normalization in log space.

    Rows and columns of blocks that hold no real token are excluded; on the rest the
    result approaches a doubly stochastic matrix as `iters` grows, and a hard
    permutation (the best assignment) as `temperature` -> 0 (Mena et al. 2018).
    """
    ok_B1NN = (valid_BN[:, :, None] & valid_BN[:, None, :])[:, None]
    x = scores_BHNN.astype(jnp.float32)
    if noise_BHNN is not None:
        x = x + noise_BHNN
    x = jnp.where(ok_B1NN, x / temperature, _NEG)

    def normalize(_, x):
        x = jnp.where(ok_B1NN, x - jax.nn.logsumexp(x, axis=-1, keepdims=True), _NEG)
        return jnp.where(ok_B1NN, x - jax.nn.logsumexp(x, axis=-2, keepdims=True), _NEG)

    x = jax.lax.fori_loop(0, iters, normalize, x)
    return jnp.where(ok_B1NN, jnp.exp(x), 0.0)


def block_summaries(k_BLHD, valid_BL, block_size: int):
    """Mean real key of every block -> [B, H, N, D] (zeros for all-padding blocks)."""
    B, L, H, D = k_BLHD.shape
    N = L // block_size
    vf_BNQ = valid_BL.reshape(B, N, block_size).astype(jnp.float32)
    k_BNQHD = k_BLHD.reshape(B, N, block_size, H, D).astype(jnp.float32)
    total_BHND = jnp.einsum("bnq,bnqhd->bhnd", vf_BNQ, k_BNQHD)
    count_BN = jnp.sum(vf_BNQ, axis=-1)
    return total_BHND / jnp.maximum(count_BN, 1.0)[:, None, :, None]


def sinkhorn_attention(q_BLHD, k_BLHD, v_BLHD, valid_BL, perm_BHNN, block_size: int):
    """Each query block attends to its own block and to the perm-sorted block.

    `perm_BHNN[b, h, i, j]` is the weight of key block j in the sorted block of query
    block i (a soft or hard permutation); L must be a multiple of `block_size`.
    """
    B, L, H, D = q_BLHD.shape
    Dv = v_BLHD.shape[-1]  # the values' own head dim (a bug hunt (session 100): it took D)
    N, Q = L // block_size, block_size
    f32 = jnp.float32
    valid_BNQ = valid_BL.reshape(B, N, Q)
    keep_BNQ11 = valid_BNQ[:, :, :, None, None]
    q_BNQHD = q_BLHD.reshape(B, N, Q, H, D).astype(f32)
    k_BNKHD = jnp.where(keep_BNQ11, k_BLHD.reshape(B, N, Q, H, D), 0).astype(f32)
    v_BNKHD = jnp.where(keep_BNQ11, v_BLHD.reshape(B, N, Q, H, Dv), 0).astype(f32)
    perm_BHNN = perm_BHNN.astype(f32)

    mass_BHNK = jnp.einsum("bhij,bjk->bhik", perm_BHNN, valid_BNQ.astype(f32))
    # A sorted slot's key and value are the mass-weighted mean of its real keys and values:
    # sum_j P[i, j] k_j alone is mass * mean (the padded share adds zeros), which scaled them
    # by the mass on top of the + log(mass) weight below, so an output was no longer an
    # average of real values (a review (session 107)). Hard permutations: mass is 0 or 1.
    inv_BNKH1 = (1.0 / jnp.maximum(mass_BHNK, _MIN_MASS)).transpose(0, 2, 3, 1)[..., None]
    ks_BNKHD = jnp.einsum("bhij,bjkhd->bikhd", perm_BHNN, k_BNKHD) * inv_BNKH1
    vs_BNKHD = jnp.einsum("bhij,bjkhd->bikhd", perm_BHNN, v_BNKHD) * inv_BNKH1

    scale = 1.0 / jnp.sqrt(f32(D))
    local_BHNQK = jnp.einsum("bnqhd,bnkhd->bhnqk", q_BNQHD, k_BNKHD) * scale
    sorted_BHNQK = jnp.einsum("bnqhd,bnkhd->bhnqk", q_BNQHD, ks_BNKHD) * scale
    real_BHNK = mass_BHNK > _TINY
    sorted_BHNQK = sorted_BHNQK + jnp.log(jnp.where(real_BHNK, mass_BHNK, 1.0))[:, :, :, None, :]

    vq_B1NQ1 = valid_BNQ[:, None, :, :, None]
    ok_local = jnp.broadcast_to(vq_B1NQ1 & valid_BNQ[:, None, :, None, :], (B, H, N, Q, Q))
    ok_sorted = vq_B1NQ1 & real_BHNK[:, :, :, None, :]
    ok_BHNQK = jnp.concatenate([ok_local, ok_sorted], axis=-1)
    logits_BHNQK = jnp.where(ok_BHNQK, jnp.concatenate([local_BHNQK, sorted_BHNQK], -1), _NEG)
    m_BHNQ1 = jax.lax.stop_gradient(jnp.max(logits_BHNQK, axis=-1, keepdims=True))
    p_BHNQK = jnp.where(ok_BHNQK, jnp.exp(logits_BHNQK - m_BHNQ1), 0.0)
    p_BHNQK = p_BHNQK / jnp.maximum(jnp.sum(p_BHNQK, axis=-1, keepdims=True), _TINY)
    out_BNQHD = (jnp.einsum("bhnqk,bnkhd->bnqhd", p_BHNQK[..., :Q], v_BNKHD)
                 + jnp.einsum("bhnqk,bnkhd->bnqhd", p_BHNQK[..., Q:], vs_BNKHD))
    return out_BNQHD.reshape(B, L, H, Dv).astype(q_BLHD.dtype)


def _check_positive(options, cls, name, field, kind):
    value = options.get(name, getattr(cls, name))
    if (not isinstance(value, kind) or isinstance(value, bool) or value <= 0
            or not math.isfinite(value)):  # (a review, session 115: nan and inf taken)
        raise ConfigError(f"config field `{field}.{name}` = {value!r} is not allowed: "
                          f"must be a positive {'integer' if kind is int else 'finite number'}")


@register("sinkhorn")
class SinkhornAttention(Attention):
    """Sparse Sinkhorn Attention (Tay et al. 2020): a learned sorting network softly
    permutes key blocks (Gumbel-Sinkhorn), so each block attends to its own block plus one
    sorted block: O(L * block_size) instead of O(L^2).

    Options: `block_size` (default 64; other lengths are padded up to a multiple),
    `sinkhorn_iters` (default 8), `temperature` (default 0.75). Non-causal, right padding
    only.
    """

    block_size: int = 64
    sinkhorn_iters: int = 8
    temperature: float = 0.75

    supports_causal = False
    supports_segments = False

    @classmethod
    def check_config(cls, options, *, seq_len, causal, field="attention.options"):
        super().check_config(options, seq_len=seq_len, causal=causal, field=field)
        _check_positive(options, cls, "block_size", field, int)
        _check_positive(options, cls, "sinkhorn_iters", field, int)
        _check_positive(options, cls, "temperature", field, (int, float))

    @nn.compact
    def __call__(self, q, k, v, mask=None, *, causal: bool = False, deterministic: bool = True):
        check_inputs(q, k, v, mask)
        if causal:
            raise ValueError("attention variant 'sinkhorn' cannot be causal: its sorting "
                             "network summarizes whole blocks, future tokens included")
        B, L, H, D = q.shape
        if k.shape[1] != L:
            raise ValueError(f"sinkhorn is self-attention: q and k lengths differ, "
                             f"q{q.shape} k{k.shape}")
        if self.block_size <= 0 or self.sinkhorn_iters <= 0 or self.temperature <= 0:
            raise ValueError(f"sinkhorn: block_size={self.block_size}, sinkhorn_iters="
                             f"{self.sinkhorn_iters} and temperature={self.temperature} "
                             "must all be positive")
        stream = None
        if not deterministic:  # Gumbel noise: checked before any work is traced
            stream = next((s for s in ("dropout", "features") if self.has_rng(s)), None)
            if stream is None:
                raise ValueError("sinkhorn: deterministic=False draws Gumbel noise and needs a "
                                 "'dropout' (or 'features') RNG; pass rngs={'dropout': key}")
        w_HDD = self.param("sort", nn.with_logical_partitioning(
            nn.initializers.lecun_normal(in_axis=1, out_axis=2, batch_axis=0),
            ("heads", "kv", None)),
            (H, D, D), jnp.float32)
        valid_BL = jnp.ones((B, L), bool) if mask is None else mask != 0
        pad = -L % self.block_size
        if pad:  # pad to whole blocks; the padding is masked like any other
            widen = lambda x: jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
            q, k, v, valid_BL = widen(q), widen(k), widen(v), widen(valid_BL)
        N = (L + pad) // self.block_size

        s_BHND = block_summaries(k, valid_BL, self.block_size)
        scores_BHNN = jnp.einsum("bhid,hde,bhje->bhij", s_BHND, w_HDD, s_BHND) / jnp.sqrt(
            jnp.float32(D))
        noise_BHNN = None
        if not deterministic:
            u_BHNN = jax.random.uniform(self.make_rng(stream), (B, H, N, N), jnp.float32,
                                        minval=_TINY, maxval=1.0)
            noise_BHNN = -jnp.log(-jnp.log(u_BHNN))
        valid_BN = jnp.any(valid_BL.reshape(B, N, self.block_size), axis=-1)
        perm_BHNN = gumbel_sinkhorn(scores_BHNN, valid_BN, iters=self.sinkhorn_iters,
                                    temperature=self.temperature, noise_BHNN=noise_BHNN)
        out = sinkhorn_attention(q, k, v, valid_BL, perm_BHNN, self.block_size)
        return out[:, :L]
