"""`synthesizer`: attention weights synthesized without query-key dot products
(Tay et al. 2021, "Synthesizer: Rethinking Self-Attention for Transformer Models").

The idea: the [L, L] attention weights need not come from token-token interactions. Each
head's logits are either
  * `mode="dense"`: an MLP on each token alone, W2 relu(W1 x + b1) + b2, mapping one token
    to `max_len` logits, one per key position (no pairwise dot product at all);
  * `mode="random"`: a learned [H, max_len, max_len] logit matrix, the same for every input
    (`trainable=False`: a fixed random matrix drawn from `seed`, stored nowhere, never
    trained, as the paper's fixed Random Synthesizer);
  * `mode="factorized"`: the random matrix as two low-rank factors, A B^T with A, B of
    shape [H, max_len, rank].
Values are then mixed with softmax(logits) as usual. It is O(L^2) in its weights like dense
attention (the saving is the dot products and, for random modes, input-independence), so
building a [B, 1, L, L] mask here is fine.

Inputs: the variant is called with (q, k, v). The dense MLP reads `q` as the per-token
representation (it already is a learned per-head projection of the token), `v` are the
values, and `k` is not used (its shape is still checked).

Positions are counted within each segment (0 at a segment's first token), so a packed
sequence is treated exactly as if it were alone, and decoding indexes the same rows.
Padding keys are masked, causal masks future keys, softmax in float32; padding queries
give zeros. Decoding keeps only values (the weights come from positions and the query).

Shape letters: B batch, L length, H heads, D head dim, M `max_len`, F MLP width, R rank,
T cache length.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from hpnlp.attention.base import (Attention, attend, cache_put, check_inputs, check_one_token,
                                  register, segment_mask)
from hpnlp.config import ConfigError

MODES = ("dense", "random", "factorized")
_NEG = -1e30


def segment_positions(seg_BL):
    """Position of every token within its segment (0 at each segment's first token)."""
    L = seg_BL.shape[1]
    idx_L = jnp.arange(L)
    starts_BL = jnp.concatenate(
        [jnp.ones_like(seg_BL[:, :1], bool), seg_BL[:, 1:] != seg_BL[:, :-1]], axis=1)
    start_BL = jax.lax.cummax(jnp.where(starts_BL, idx_L[None, :], 0), axis=1)
    return idx_L[None, :] - start_BL


def at_key_positions(simple_fn, general_fn, pos_BL, seg_BL):
    """Logits at every key's in-segment position: `general_fn()` gathers them (for packed
    rows, where a key's position restarts in each segment); `simple_fn()` slices them, which
    is the same on every allowed (query, key) pair when each row's real tokens form one
    segment from index 0 (padding only, the usual case). `lax.cond` picks one at run time.
    The gather of B*H*L^2 logits and its scatter-add in the backward pass dominated the
    step: the LRA encoder's training step at L=4096 (`python -m hpnlp.bench train`) took
    90 s with them, 34 s without (`dense`: 27 s)."""
    L = pos_BL.shape[1]
    one_segment = jnp.all((pos_BL == jnp.arange(L)[None, :]) | (seg_BL == 0))
    return jax.lax.cond(one_segment, simple_fn, general_fn)


def fixed_random_rows(seed: int, rows_R, num_heads: int, max_len: int):
    """Rows `rows_R` of the fixed random logit matrix -> [H, R, M]; row i is drawn from
    fold_in(seed, i) alone, so a decode step can draw one row without the rest."""
    key = jax.random.key(seed)
    draw = lambda i: jax.random.normal(jax.random.fold_in(key, i), (num_heads, max_len))
    return jax.vmap(draw, out_axes=1)(rows_R)


def softmax_mix(logits_BHLS, allowed_B1LS, v_BSHD, out_dtype):
    """softmax(logits) @ v in float32 over allowed keys; rows with none give zeros."""
    logits_BHLS = jnp.where(allowed_B1LS, logits_BHLS.astype(jnp.float32), _NEG)
    m_BHL1 = jax.lax.stop_gradient(jnp.max(logits_BHLS, axis=-1, keepdims=True))
    p_BHLS = jnp.where(allowed_B1LS, jnp.exp(logits_BHLS - m_BHL1), 0.0)
    p_BHLS = p_BHLS / jnp.maximum(jnp.sum(p_BHLS, axis=-1, keepdims=True), 1e-30)
    return attend(p_BHLS, v_BSHD, out_dtype)


def _positive_int(options, cls, name, field):
    value = options.get(name, getattr(cls, name))
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"config field `{field}.{name}` = {value!r} is not allowed: "
                          "must be a positive integer")
    return value


@register("synthesizer")
class SynthesizerAttention(Attention):
    """Synthesizer (Tay et al. 2021): attention weights from a per-token MLP or from a
    learned (optionally low-rank) position-by-position matrix, with no query-key dot
    products.

    Options: `mode` ("dense" | "random" | "factorized", default "dense"), `max_len`
    (longest sequence, default 512), `hidden_dim` (dense MLP width, 0 = head dim),
    `rank` (factorized, default 8), `trainable` (random modes; False = fixed random matrix
    drawn from `seed`, default True), `seed` (default 0). Causal and packed segments are
    supported; decoding keeps a value cache.
    """

    mode: str = "dense"
    max_len: int = 512
    hidden_dim: int = 0
    rank: int = 8
    trainable: bool = True
    seed: int = 0

    @classmethod
    def check_config(cls, options, *, seq_len, causal, field="attention.options"):
        super().check_config(options, seq_len=seq_len, causal=causal, field=field)
        mode = options.get("mode", cls.mode)
        if mode not in MODES:
            raise ConfigError(f"config field `{field}.mode` = {mode!r} is not allowed: "
                              f"choose one of {list(MODES)}")
        max_len = _positive_int(options, cls, "max_len", field)
        if seq_len > max_len:
            raise ConfigError(
                f"config field `{field}.max_len` = {max_len} is not allowed: it must be >= "
                f"data.seq_len={seq_len} (the synthesized weights have max_len key positions)")
        _positive_int(options, cls, "rank", field)
        hidden = options.get("hidden_dim", cls.hidden_dim)
        if not isinstance(hidden, int) or isinstance(hidden, bool) or hidden < 0:
            raise ConfigError(f"config field `{field}.hidden_dim` = {hidden!r} is not allowed: "
                              "must be an integer >= 0 (0 = head dim)")
        if not isinstance(options.get("trainable", cls.trainable), bool):
            raise ConfigError(f"config field `{field}.trainable` = "
                              f"{options['trainable']!r} is not allowed: must be True or False")
        # options the chosen mode never reads are refused, not ignored (a bug hunt)
        trainable = options.get("trainable", cls.trainable)
        unused = {"rank": (mode != "factorized", "mode='factorized'"),
                  "hidden_dim": (mode != "dense", "mode='dense'"),
                  "trainable": (mode == "dense", "mode='random' or 'factorized'"),
                  "seed": (mode == "dense" or trainable,
                           "trainable=False (mode='random' or 'factorized')")}
        for name, (ignored, uses) in unused.items():
            if name in options and ignored:
                given = f"mode={mode!r}" + (", trainable=True" if uses.startswith("train")
                                              and mode != "dense" else "")
                raise ConfigError(f"config field `{field}.{name}` = {options[name]!r} is not "
                                  f"allowed with {given}: only {uses} reads it; drop it")

    # -- parameters (created in __call__; decode_step reads the same ones) ---------------

    def _check_mode(self):
        if self.mode not in MODES:
            raise ValueError(f"synthesizer: mode={self.mode!r}; choose one of {list(MODES)}")

    def _make_params(self, H: int, D: int):
        """Create (under @compact) every parameter this mode uses."""
        M, F = self.max_len, self.hidden_dim or D
        box = nn.with_logical_partitioning
        if self.mode == "dense":
            self.param("w1", box(nn.initializers.lecun_normal(in_axis=1, out_axis=2, batch_axis=0),
                                 ("heads", "kv", None)), (H, D, F), jnp.float32)
            self.param("b1", box(nn.initializers.zeros, ("heads", None)), (H, F), jnp.float32)
            self.param("w2", box(nn.initializers.lecun_normal(in_axis=1, out_axis=2, batch_axis=0),
                                 ("heads", None, None)), (H, F, M), jnp.float32)
            self.param("b2", box(nn.initializers.zeros, ("heads", None)), (H, M), jnp.float32)
        elif self.mode == "random" and self.trainable:
            self.param("logits", box(nn.initializers.normal(1.0), ("heads", None, None)),
                       (H, M, M), jnp.float32)
        elif self.mode == "factorized" and self.trainable:
            # Each factor N(0, rank^-1/2)^(1/2): the product starts with unit-variance logits.
            init = box(nn.initializers.normal(self.rank ** -0.25), ("heads", None, None))
            self.param("a", init, (H, M, self.rank), jnp.float32)
            self.param("b", init, (H, M, self.rank), jnp.float32)

    def _p(self, name):
        return nn.unbox(self.get_variable("params", name))

    def _factors(self, H):
        """(a [H, M, R], b [H, M, R]) of the factorized mode, trained or fixed."""
        if self.trainable:
            return self._p("a"), self._p("b")
        key_a, key_b = jax.random.split(jax.random.key(self.seed))
        shape = (H, self.max_len, self.rank)
        scale = self.rank ** -0.25
        return jax.random.normal(key_a, shape) * scale, jax.random.normal(key_b, shape) * scale

    def _dense_logits(self, x_BLHD):
        """Per-token MLP: [B, L, H, D] -> logits over key positions [B, L, H, M]."""
        x = x_BLHD.astype(jnp.float32)
        h_BLHF = jnp.einsum("blhd,hdf->blhf", x, self._p("w1")) + self._p("b1")[None, None]
        h_BLHF = jax.nn.relu(h_BLHF)
        return jnp.einsum("blhf,hfm->blhm", h_BLHF, self._p("w2")) + self._p("b2")[None, None]

    # -- full sequence --------------------------------------------------------------------

    @nn.compact
    def __call__(self, q, k, v, mask=None, *, causal: bool = False, deterministic: bool = True):
        check_inputs(q, k, v, mask)
        self._check_mode()
        B, L, H, D = q.shape
        if k.shape[1] != L:
            raise ValueError(f"synthesizer is self-attention: q and k lengths differ, "
                             f"q{q.shape} k{k.shape}")
        if L > self.max_len:
            raise ValueError(f"synthesizer: sequence length {L} exceeds the option "
                             f"max_len={self.max_len}; raise attention.options.max_len")
        self._make_params(H, D)
        seg_BL = jnp.ones((B, L), jnp.int32) if mask is None else mask.astype(jnp.int32)
        pos_BL = segment_positions(seg_BL)
        if self.mode == "dense":
            logits_BLHM = self._dense_logits(q)
            logits_BLHL = at_key_positions(
                lambda: logits_BLHM[..., :L],
                lambda: jnp.take_along_axis(logits_BLHM, pos_BL[:, None, None, :], axis=3),
                pos_BL, seg_BL)
            logits_BHLL = logits_BLHL.transpose(0, 2, 1, 3)
        elif self.mode == "random":
            table_HMM = (self._p("logits") if self.trainable else
                         fixed_random_rows(self.seed, jnp.arange(L), H, self.max_len))
            logits_BHLL = at_key_positions(
                lambda: jnp.broadcast_to(table_HMM[None, :, :L, :L], (B, H, L, L)),
                lambda: jnp.take_along_axis(table_HMM[:, pos_BL].transpose(1, 0, 2, 3),
                                            pos_BL[:, None, None, :], axis=3),
                pos_BL, seg_BL)
        else:
            a_HMR, b_HMR = self._factors(H)
            a_BLHR = a_HMR[:, pos_BL].transpose(1, 2, 0, 3)
            b_BLHR = b_HMR[:, pos_BL].transpose(1, 2, 0, 3)
            logits_BHLL = jnp.einsum("blhr,bshr->bhls", a_BLHR, b_BLHR)
        allowed_B1LL = segment_mask(seg_BL, seg_BL, causal=causal)
        return softmax_mix(logits_BHLL, allowed_B1LL, v, q.dtype)

    # -- decoding -------------------------------------------------------------------------

    def init_cache(self, batch: int, max_len: int, num_heads: int, head_dim: int, dtype):
        if max_len > self.max_len:
            raise ValueError(f"synthesizer: a decode cache of {max_len} tokens exceeds the "
                             f"option max_len={self.max_len}; raise attention.options.max_len")
        zeros = jnp.zeros((batch, max_len, num_heads, head_dim), dtype)
        return {"v": zeros, "index": jnp.zeros((), jnp.int32)}

    def decode_step(self, cache, q_B1HD, k_B1HD, v_B1HD):
        """Token at cache['index']: its row of synthesized logits over the cached values."""
        check_one_token(self.registry_name, cache, q_B1HD)
        check_inputs(q_B1HD, k_B1HD, v_B1HD, None)
        self._check_mode()
        idx = cache["index"]
        v_BTHD = cache_put(cache["v"], v_B1HD, idx)
        T, H = v_BTHD.shape[1], v_BTHD.shape[2]
        if self.mode == "dense":
            logits_B1HT = self._dense_logits(q_B1HD)[..., :T]
            logits_BH1T = logits_B1HT.transpose(0, 2, 1, 3)
        elif self.mode == "random":
            if self.trainable:
                row_H1M = jax.lax.dynamic_slice_in_dim(self._p("logits"), idx, 1, axis=1)
            else:
                row_H1M = fixed_random_rows(self.seed, idx[None], H, self.max_len)
            logits_BH1T = jnp.broadcast_to(row_H1M[None, :, :, :T], (q_B1HD.shape[0], H, 1, T))
        else:
            a_HMR, b_HMR = self._factors(H)
            a_H1R = jax.lax.dynamic_slice_in_dim(a_HMR, idx, 1, axis=1)
            logits_H1T = jnp.einsum("hir,htr->hit", a_H1R, b_HMR[:, :T])
            logits_BH1T = jnp.broadcast_to(logits_H1T[None], (q_B1HD.shape[0], H, 1, T))
        allowed_111T = (jnp.arange(T) <= idx)[None, None, None, :]
        out = softmax_mix(logits_BH1T, allowed_111T, v_BTHD, q_B1HD.dtype)
        return out, {"v": v_BTHD, "index": idx + 1}
