"""Fixed block-sparse attention patterns: `local`, `sliding_window`, `strided`, `bigbird`.

The idea they share: cut the sequence into blocks of `block_size` tokens and let each
query block see only a few key blocks, chosen by a pattern that is fixed in advance
(it never looks at the data). The key blocks a query block may see are gathered into
one small [K = M * block_size] key set (slices for banded patterns, a static index
table for random blocks, no copy at all for a key set every block shares), the scores
are one batched einsum over [B, H, N, Q, D] x [B, H, N, K, D] (heads-major, so the
batch axes lead and XLA needs no transposes inside the dot), and the softmax runs in
float32 over that gathered set with the token-level mask (segment ids, causality, the
pattern's exact edges) applied inside the blocks. Cost is O(L * K) instead of O(L^2);
no [L, L] array ever exists.

Lengths that `block_size` (and for `strided`, `stride`) does not divide are padded
inside the call to the next multiple with segment id 0 (so padding is never attended
to) and the result is sliced back: any length works, and `check_config` refuses only a
length whose padding to lcm(block_size, stride) more than doubles it (`strided`'s
mode='strided': a review, session 118, read "does not refuse one").

Each pattern also has its "masked dense twin" beside it (`pattern_mask` +
`masked_dense_twin`): the same pattern written as a boolean [L, L] matrix straight from
its definition and run through the dense oracle. Tests hold the fast path to it.

Shape letters: B batch, L length (padded inside the call), H heads, D head dim,
N number of query blocks, Q query block length (= block_size), M key blocks gathered per
query block, K = M * Q gathered keys, T cache length, W ring-buffer slots,
R rows and C columns of the stride grid (C = stride), P keys in a strided column or in
the summary set.
"""

from __future__ import annotations

import math
from typing import Any, Callable, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from hpnlp.attention.base import (Attention, cache_put, check_inputs, check_one_token,
                                  masked_softmax_attention, register, segment_mask)
from hpnlp.config import ConfigError

_NEG = -1e30


# ----------------------------------------------------------------------------- engine

def _prepare(q_BLHD, k_BLHD, v_BLHD, mask_BL, multiple: int, variant: str):
    """Checks; segment ids (ones if None); right padding to a multiple of `multiple` with
    segment 0; heads-major layout, so every block einsum has its batch axes leading.
    Returns q, k, v as [B, H, L, D] and segment ids [B, L] (L padded)."""
    check_inputs(q_BLHD, k_BLHD, v_BLHD, mask_BL)
    if k_BLHD.shape[1] != q_BLHD.shape[1]:
        raise ValueError(f"{variant} attention is self-attention: query length {q_BLHD.shape[1]} "
                         f"and key length {k_BLHD.shape[1]} must be equal")
    B, L = q_BLHD.shape[:2]
    seg_BL = jnp.ones((B, L), jnp.int32) if mask_BL is None else mask_BL.astype(jnp.int32)
    pad = -L % multiple
    widths = ((0, 0), (0, 0), (0, pad), (0, 0))
    q_BHLD, k_BHLD, v_BHLD = (jnp.pad(x.transpose(0, 2, 1, 3), widths) for x in (q_BLHD, k_BLHD, v_BLHD))
    return q_BHLD, k_BHLD, v_BHLD, jnp.pad(seg_BL, ((0, 0), (0, pad)))


def _finish(out_BHNQD, L, dtype):
    """[B, H, N, Q, D] (padded length) -> [B, L, H, D] in the input dtype."""
    B, H, N, Q, D = out_BHNQD.shape
    return out_BHNQD.reshape(B, H, N * Q, D)[:, :, :L].transpose(0, 2, 1, 3).astype(dtype)


def _blocks(x, size: int, axis: int):
    """Split the length axis into [L / size, size]: [B, H, L, D] (axis 2) -> [B, H, N, Q, D],
    segment ids [B, L] (axis 1) -> [B, N, Q]."""
    return x.reshape(x.shape[:axis] + (x.shape[axis] // size, size) + x.shape[axis + 1:])


def _band(x, offsets, axis: int):
    """Banded gather by slices: block n (on `axis`) sees blocks n + offsets, concatenated
    into one key axis: [B, H, N, Q, D] -> [B, H, N, M * Q, D] (segments [B, N, M * Q]).

    Blocks off either end are zeros, and segment id 0 means padding, so they are masked
    like any padding.
    """
    lo, hi = max(0, -min(offsets)), max(0, max(offsets))
    N = x.shape[axis]
    widths = [(0, 0)] * x.ndim
    widths[axis] = (lo, hi)
    xp = jnp.pad(x, widths)
    return jnp.concatenate([jax.lax.slice_in_dim(xp, lo + o, lo + o + N, axis=axis) for o in offsets],
                           axis=axis + 1)


def _table(x, table_NM, axis: int):
    """Gather blocks by a static table of block ids: [B, H, N, Q, D] -> [B, H, N', M * Q, D]
    (segments [B, N, Q] -> [B, N', M * Q]). Id N (one past the last block) picks an
    all-zero block: segment 0, so masked."""
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, 1)
    g = jnp.take(jnp.pad(x, widths), jnp.asarray(table_NM), axis=axis)  # [..., N', M, Q, ...]
    return g.reshape(g.shape[:axis + 1] + (-1,) + g.shape[axis + 3:])


def _block_positions(table_NM, size):
    """Token positions of the gathered key blocks: [N', M * Q] int32 (numpy, static)."""
    pos = np.asarray(table_NM)[:, :, None] * size + np.arange(size)[None, None, :]
    return pos.reshape(pos.shape[0], -1).astype(np.int32)


def _segment_ok(qseg_BNQ, kseg_BNK):
    """Same segment and not padding: [B, 1, N, Q, K] (N may be 1 for a shared key set)."""
    return ((qseg_BNQ[:, :, :, None] == kseg_BNK[:, :, None, :])
            & (kseg_BNK[:, :, None, :] != 0))[:, None]


def _gathered_part(q_BHNQD, qseg_BNQ, qpos_NQ, k_BHNKD, v_BHNKD, kseg_BNK, kpos_NK, allow):
    """Scores of query blocks against their gathered keys, with the token-level mask.

    Keys come per query block ([B, H, N, K, D], segments [B, N, K], positions [N, K]) or,
    for one key set every block shares, without the N axis ([B, H, K, D], [B, K], [K]).
    `allow(i, j)` is the pattern's token rule on position arrays (None: no rule, and then
    positions may be None); it runs in jnp on small position constants, so XLA fuses it
    into the select.
    Returns (scores_BHNQK, ok_B1NQK, values_fn) for `_softmax_parts`.
    """
    shared = k_BHNKD.ndim == 4
    D = q_BHNQD.shape[-1]
    spec = "bhnqd,bhkd->bhnqk" if shared else "bhnqd,bhnkd->bhnqk"
    s_BHNQK = jnp.einsum(spec, q_BHNQD, k_BHNKD,
                         preferred_element_type=jnp.float32) / jnp.sqrt(jnp.float32(D))
    if shared:  # a unit block axis for the masks; broadcasting does the rest
        kseg_BNK = kseg_BNK[:, None]
        kpos_NK = None if kpos_NK is None else np.asarray(kpos_NK)[None]
    ok_B1NQK = _segment_ok(qseg_BNQ, kseg_BNK)
    if allow is not None:
        ok_B1NQK &= allow(jnp.asarray(qpos_NQ)[:, :, None], jnp.asarray(kpos_NK)[:, None, :])[None, None]

    def values(p_BHNQK):
        spec = "bhnqk,bhkd->bhnqd" if shared else "bhnqk,bhnkd->bhnqd"
        return jnp.einsum(spec, p_BHNQK, v_BHNKD.astype(jnp.float32))

    return s_BHNQK, ok_B1NQK, values


def _band_part(q_BHLD, k_BHLD, v_BHLD, seg_BL, size, offsets, allow, first=0):
    """Query blocks n = first.. against key blocks n + offsets (slices, no index gather)."""
    N = q_BHLD.shape[2] // size
    n_N1 = np.arange(first, N)[:, None]
    k_BHNKD, v_BHNKD = (_band(_blocks(x, size, 2), offsets, 2)[:, :, first:] for x in (k_BHLD, v_BHLD))
    kseg_BNK = _band(_blocks(seg_BL, size, 1), offsets, 1)[:, first:]
    return _gathered_part(_blocks(q_BHLD, size, 2)[:, :, first:], _blocks(seg_BL, size, 1)[:, first:],
                          _block_positions(n_N1, size), k_BHNKD, v_BHNKD, kseg_BNK,
                          _block_positions(n_N1 + np.asarray(offsets)[None, :], size), allow)


def _softmax_parts(parts):
    """One float32 softmax over the union of several key sets that share a query layout
    [B, H, N, Q, *]; each part's unnormalized weights go through its own values function
    and the sum is divided by the joint normalizer once, on [B, H, N, Q, D].

    Rows with no allowed key (padding queries) give zeros and zero gradients, not NaN.
    The key sets must be disjoint (each key counted once); the callers make them so.
    """
    masked = [jnp.where(ok, s, _NEG) for s, ok, _ in parts]
    m_BHNQ1 = masked[0].max(-1, keepdims=True)
    for s in masked[1:]:
        m_BHNQ1 = jnp.maximum(m_BHNQ1, s.max(-1, keepdims=True))
    m_BHNQ1 = jax.lax.stop_gradient(m_BHNQ1)
    exps = [jnp.where(ok, jnp.exp(s - m_BHNQ1), 0.0) for s, (_, ok, _) in zip(masked, parts)]
    denom_BHNQ1 = sum(e.sum(-1, keepdims=True) for e in exps)
    return sum(values(e) for e, (_, _, values) in zip(exps, parts)) / jnp.maximum(denom_BHNQ1, 1e-30)


# ------------------------------------------------------------------------ dense twins

def masked_dense_twin(module: "BlockSparseAttention", q_BLHD, k_BLHD, v_BLHD, mask_BL=None, *,
                      causal: bool):
    """The pattern as a dense boolean [L, L] mask through the dense oracle (tests only)."""
    check_inputs(q_BLHD, k_BLHD, v_BLHD, mask_BL)
    B, L = q_BLHD.shape[:2]
    seg_BL = jnp.ones((B, L), jnp.int32) if mask_BL is None else mask_BL.astype(jnp.int32)
    allowed_B1LL = (segment_mask(seg_BL, seg_BL, causal=False)
                    & jnp.asarray(module.pattern_mask(L, causal))[None, None])
    return masked_softmax_attention(q_BLHD, k_BLHD, v_BLHD, allowed_B1LL)


# -------------------------------------------------------------------------- variants

class BlockSparseAttention(Attention):
    """Shared option checks and the pattern-masked full cache; not registered.

    Subclasses list their positive-int options in `_positive`, add other checks in
    `_problems`, and define `pattern_mask(length, causal) -> bool [L, L]` (numpy), the
    pattern written from its definition for the dense twin.
    """

    _positive: ClassVar[tuple[str, ...]] = ("block_size",)
    block_size: int = 64

    @classmethod
    def _problems(cls, options: dict[str, Any], causal: bool) -> list[tuple[str, Any, str]]:
        out = []
        for name in cls._positive:
            val = options.get(name, getattr(cls, name))
            if isinstance(val, bool) or not isinstance(val, int) or val <= 0:
                out.append((name, val, "must be a positive integer"))
        return out

    @classmethod
    def check_config(cls, options, *, seq_len, causal, field="attention.options"):
        super().check_config(options, seq_len=seq_len, causal=causal, field=field)
        for name, val, why in cls._problems(dict(options), causal):
            raise ConfigError(f"config field `{field}.{name}` = {val!r} is not allowed: {why}")

    def _validate(self, causal: bool):
        opts = {f: getattr(self, f) for f in self.__dataclass_fields__ if f not in ("parent", "name")}
        for name, val, why in self._problems(opts, causal):
            raise ValueError(f"{self.registry_name} attention: option {name}={val!r} is not "
                             f"allowed: {why}")

    def _full_cache_step(self, cache, q_B1HD, k_B1HD, v_B1HD, allow_T: Callable):
        """The base class's exact KV cache, with the pattern applied to the cached keys."""
        check_one_token(self.registry_name, cache, q_B1HD)
        idx = cache["index"]
        k_BTHD, v_BTHD = cache_put(cache["k"], k_B1HD, idx), cache_put(cache["v"], v_B1HD, idx)
        j_T = jnp.arange(k_BTHD.shape[1])
        allowed_T = (j_T <= idx) & allow_T(idx, j_T)
        out = masked_softmax_attention(q_B1HD, k_BTHD.astype(q_B1HD.dtype),
                                       v_BTHD.astype(q_B1HD.dtype), allowed_T[None, None, None, :])
        return out, {"k": k_BTHD, "v": v_BTHD, "index": idx + 1}


class _RingBufferDecode:
    """Decoding with a ring buffer of the last W keys/values and their positions, for
    patterns where a query never looks further back than W - 1 tokens. Subclasses give
    `_ring_slots()` and `_ring_allow(i, j)` (j <= i is applied here)."""

    def init_cache(self, batch: int, max_len: int, num_heads: int, head_dim: int, dtype):
        W = min(self._ring_slots(), max_len)
        zeros = jnp.zeros((batch, W, num_heads, head_dim), dtype)
        return {"k": zeros, "v": zeros, "pos": jnp.full((W,), -1, jnp.int32),
                "index": jnp.zeros((), jnp.int32)}

    def decode_step(self, cache, q_B1HD, k_B1HD, v_B1HD):
        check_one_token(self.registry_name, cache, q_B1HD)
        idx = cache["index"]
        W = cache["pos"].shape[0]
        slot = idx % W
        k_BWHD, v_BWHD = cache_put(cache["k"], k_B1HD, slot), cache_put(cache["v"], v_B1HD, slot)
        pos_W = cache["pos"].at[slot].set(idx)
        allowed_W = (pos_W >= 0) & (pos_W <= idx) & self._ring_allow(idx, pos_W)
        out = masked_softmax_attention(q_B1HD, k_BWHD.astype(q_B1HD.dtype),
                                       v_BWHD.astype(q_B1HD.dtype), allowed_W[None, None, None, :])
        return out, {"k": k_BWHD, "v": v_BWHD, "pos": pos_W, "index": idx + 1}


@register("local")
class LocalAttention(_RingBufferDecode, BlockSparseAttention):
    """Blockwise local attention (Parmar et al. 2018, "Image Transformer"; the "local
    attention" baseline of Tay et al. 2021, Long Range Arena).

    Fast because each query block attends only to its own block (and, with
    `prev_block=True`, also the block before it): no gather at all, cost O(L * block_size).
    Causal mode adds the token-level j <= i inside the block. Decoding keeps a ring buffer
    of block_size (or 2 * block_size) keys.
    """

    @classmethod
    def block_aligned(cls, options) -> bool:
        return True

    heads_independent = True

    block_size: int = 64
    prev_block: bool = False  # also attend to the previous block (both causal and not)

    @classmethod
    def _problems(cls, options, causal):
        out = super()._problems(options, causal)
        val = options.get("prev_block", cls.prev_block)
        if not isinstance(val, bool):
            out.append(("prev_block", val, "must be True or False"))
        return out

    def _offsets(self):
        return (-1, 0) if self.prev_block else (0,)

    def __call__(self, q, k, v, mask=None, *, causal: bool = False, deterministic: bool = True):
        self._validate(causal)
        L, Q = q.shape[1], self.block_size
        q, k, v, seg = _prepare(q, k, v, mask, Q, "local")
        allow = (lambda i, j: j <= i) if causal else None
        part = _band_part(q, k, v, seg, Q, self._offsets(), allow)
        return _finish(_softmax_parts([part]), L, q.dtype)

    def pattern_mask(self, length, causal):
        i, j = np.arange(length)[:, None], np.arange(length)[None, :]
        lo = (i // self.block_size - (1 if self.prev_block else 0)) * self.block_size
        ok = (j >= lo) & (j // self.block_size <= i // self.block_size)
        return ok & (j <= i) if causal else ok

    def _ring_slots(self):
        return self.block_size * len(self._offsets())

    def _ring_allow(self, i, j):
        return j // self.block_size >= i // self.block_size - (1 if self.prev_block else 0)


@register("sliding_window")
class SlidingWindowAttention(_RingBufferDecode, BlockSparseAttention):
    """Sliding-window attention (Beltagy et al. 2020, "Longformer").

    Token i attends to key j when |i - j| < window (non-causal: 2 * window - 1 keys
    centred on i) or 0 <= i - j < window (causal: the last `window` tokens, i included).
    Fast because it is computed by blocks: each query block gathers only the
    ceil((window - 1) / block_size) neighbouring blocks on each side (past side only when
    causal) that cover its window, cost O(L * (window + block_size)), and the exact
    window edge is a token-level mask inside them. Decoding keeps a ring buffer of
    `window` keys with their positions.
    """

    heads_independent = True

    _positive = ("block_size", "window")
    block_size: int = 64
    window: int = 128

    def _offsets(self, causal):
        reach = -(-(self.window - 1) // self.block_size)
        return tuple(range(-reach, 1 if causal else reach + 1))

    def _allow(self, causal):
        w = self.window
        if causal:
            return lambda i, j: (j <= i) & (i - j < w)
        return lambda i, j: (i - j < w) & (j - i < w)

    def __call__(self, q, k, v, mask=None, *, causal: bool = False, deterministic: bool = True):
        self._validate(causal)
        L, Q = q.shape[1], self.block_size
        q, k, v, seg = _prepare(q, k, v, mask, Q, "sliding_window")
        part = _band_part(q, k, v, seg, Q, self._offsets(causal), self._allow(causal))
        return _finish(_softmax_parts([part]), L, q.dtype)

    def pattern_mask(self, length, causal):
        d = np.arange(length)[:, None] - np.arange(length)[None, :]  # i - j
        return (d >= 0) & (d < self.window) if causal else np.abs(d) < self.window

    def _ring_slots(self):
        return self.window

    def _ring_allow(self, i, j):
        return i - j < self.window


@register("strided")
class StridedAttention(BlockSparseAttention):
    """Strided and fixed sparse attention (Child et al. 2019, "Generating Long Sequences
    with Sparse Transformers").

    With b = block_size, s = stride, c = num_summary, token i attends to key j when
      mode="strided": |i - j| < b (causal: 0 <= i - j < b)  or  (i - j) % s == 0
      mode="fixed":   j // b == i // b                      or  j % s >= s - c
    (and j <= i when causal). The paper's setting is b = s = l.

    Fast because neither half needs the [L, L] matrix: the local half gathers the one or
    two neighbouring blocks of each query block, and the strided half is a transpose: lay
    the sequence out as an [L / s, s] grid and every query attends down its own column
    (L / s keys). In "fixed" mode the summary columns are one static
    set of L * c / s keys gathered once for every query. Both halves share one float32
    softmax; keys in both are counted once (the second half excludes the local ones).
    Cost O(L * (b + L / s)) for "strided", O(L * (b + L * c / s)) for "fixed".
    Decoding uses the exact full cache with this mask applied.
    """

    @classmethod
    def block_aligned(cls, options) -> bool:
        return options.get("mode", cls.mode) == "fixed"

    heads_independent = True

    _positive = ("block_size", "stride", "num_summary")
    block_size: int = 64
    stride: int = 64
    mode: str = "strided"  # "strided" | "fixed"
    num_summary: int = 8  # c: summary positions per stride period ("fixed" mode only)

    @classmethod
    def _problems(cls, options, causal):
        out = super()._problems(options, causal)
        mode = options.get("mode", cls.mode)
        if mode not in ("strided", "fixed"):
            out.append(("mode", mode, "choose one of ['strided', 'fixed']"))
        c, s = options.get("num_summary", cls.num_summary), options.get("stride", cls.stride)
        if mode == "fixed" and isinstance(c, int) and isinstance(s, int) and c > s:
            out.append(("num_summary", c, f"must be <= stride={s}"))
        return out

    @classmethod
    def check_config(cls, options, *, seq_len, causal, field="attention.options"):
        super().check_config(options, seq_len=seq_len, causal=causal, field=field)
        b, s = options.get("block_size", cls.block_size), options.get("stride", cls.stride)
        if options.get("mode", cls.mode) == "strided" and "num_summary" in options:
            raise ConfigError(  # a bug hunt: taken, and never read
                f"config field `{field}.num_summary` = {options['num_summary']!r} is not "
                "allowed with mode='strided': only mode='fixed' reads it; drop it")
        if options.get("mode", cls.mode) == "strided":
            # "strided" pads each sequence to a multiple of lcm(b, s) (a bug hunt: b=64, s=63
            # padded 128 tokens to 4032, silently)
            lcm, width = math.lcm(b, s), max(b, s)
            padded, plain = -(-seq_len // lcm) * lcm, -(-seq_len // width) * width
            if padded > 2 * plain:
                raise ConfigError(
                    f"config field `{field}.stride` = {s} is not allowed: with block_size={b} "
                    f"each sequence is padded to a multiple of lcm({b}, {s}) = {lcm}, here "
                    f"{padded} tokens for data.seq_len={seq_len}; choose a stride that divides "
                    "block_size or is a multiple of it (the paper's setting: stride = "
                    "block_size)")

    def _allow(self, causal):
        b, s, c = self.block_size, self.stride, self.num_summary
        if self.mode == "strided":
            ok = lambda i, j: (jnp.abs(i - j) < b) | ((i - j) % s == 0)  # noqa: E731
        else:
            ok = lambda i, j: (j // b == i // b) | (j % s >= s - c)  # noqa: E731
        return (lambda i, j: ok(i, j) & (j <= i)) if causal else ok

    def __call__(self, q, k, v, mask=None, *, causal: bool = False, deterministic: bool = True):
        self._validate(causal)
        L, Q, s = q.shape[1], self.block_size, self.stride
        multiple = math.lcm(Q, s) if self.mode == "strided" else Q
        q, k, v, seg = _prepare(q, k, v, mask, multiple, "strided")
        # Local half: the window |i - j| < b, or the query's own block in "fixed" mode.
        if self.mode == "strided":
            offsets = (-1, 0) if causal else (-1, 0, 1)
            local = lambda i, j: (i - j < Q) & (j - i < Q)  # noqa: E731
        else:
            offsets, local = (0,), None
        if causal:
            local = (lambda i, j: j <= i) if local is None else (
                lambda i, j, f=local: f(i, j) & (j <= i))
        parts = [_band_part(q, k, v, seg, Q, offsets, local)]
        if self.mode == "strided":
            parts.append(self._column_part(q, k, v, seg, causal))
        else:
            summary = self._summary_part(q, k, v, seg, causal)
            parts += [summary] if summary is not None else []
        return _finish(_softmax_parts(parts), L, q.dtype)

    def _column_part(self, q_BHLD, k_BHLD, v_BHLD, seg_BL, causal):
        """Keys j = i - t * s outside the local window: lay the sequence out as an [R, C]
        grid (C = stride) and attend down each column, a batched [R, R] attention per
        column; scores come back to the query-block layout for the joint softmax."""
        B, H, Lp, D = q_BHLD.shape
        Q, C = self.block_size, self.stride
        R, N = Lp // C, Lp // Q
        # v by its own head dim Dv (a bug hunt (session 100): it took q's D and failed to
        # reshape when they differ, which check_inputs allows)
        Dv = v_BHLD.shape[-1]
        q_BHCRD, k_BHCPD, v_BHCPD = (x.reshape(B, H, R, C, x.shape[-1]).swapaxes(2, 3)
                                     for x in (q_BHLD, k_BHLD, v_BHLD))
        s_BHCRP = jnp.einsum("bhcrd,bhcpd->bhcrp", q_BHCRD, k_BHCPD,
                             preferred_element_type=jnp.float32) / jnp.sqrt(jnp.float32(D))
        seg_BCR = seg_BL.reshape(B, R, C).swapaxes(1, 2)
        ok_BCRP = (seg_BCR[:, :, :, None] == seg_BCR[:, :, None, :]) & (seg_BCR[:, :, None, :] != 0)
        dist_RP = (np.arange(R)[:, None] - np.arange(R)[None, :]) * C  # i - j
        outside_RP = dist_RP >= Q if causal else np.abs(dist_RP) >= Q
        ok_BCRP &= jnp.asarray(outside_RP)[None, None]
        s_BHNQP = s_BHCRP.swapaxes(2, 3).reshape(B, H, N, Q, R)
        ok_B1NQP = ok_BCRP.swapaxes(1, 2).reshape(B, 1, N, Q, R)

        def values(p_BHNQP):
            p_BHCRP = p_BHNQP.reshape(B, H, R, C, R).swapaxes(2, 3)
            out_BHCRD = jnp.einsum("bhcrp,bhcpd->bhcrd", p_BHCRP, v_BHCPD.astype(jnp.float32))
            return out_BHCRD.swapaxes(2, 3).reshape(B, H, N, Q, Dv)

        return s_BHNQP, ok_B1NQP, values

    def _summary_part(self, q_BHLD, k_BHLD, v_BHLD, seg_BL, causal):
        """"Fixed" mode: the summary columns j % s >= s - c outside the query's own block,
        one static key set shared by every query block (None if the length has none)."""
        Lp, Q, s, c = q_BHLD.shape[2], self.block_size, self.stride, self.num_summary
        idx_P = np.flatnonzero(np.arange(Lp) % s >= s - c)
        if idx_P.size == 0:
            return None
        N = Lp // Q
        qpos_NQ = _block_positions(np.arange(N)[:, None], Q)
        outside = lambda i, j: j // Q != i // Q  # noqa: E731  (own block: local half)
        allow = (lambda i, j: outside(i, j) & (j <= i)) if causal else outside
        return _gathered_part(_blocks(q_BHLD, Q, 2), _blocks(seg_BL, Q, 1), qpos_NQ,
                              k_BHLD[:, :, idx_P], v_BHLD[:, :, idx_P], seg_BL[:, idx_P],
                              idx_P.astype(np.int32), allow)

    def pattern_mask(self, length, causal):
        i, j = np.arange(length)[:, None], np.arange(length)[None, :]
        b, s, c = self.block_size, self.stride, self.num_summary
        if self.mode == "strided":
            ok = (np.abs(i - j) < b) | ((i - j) % s == 0)
        else:
            ok = (j // b == i // b) | (j % s >= s - c)
        return ok & (j <= i) if causal else ok

    def decode_step(self, cache, q_B1HD, k_B1HD, v_B1HD):
        return self._full_cache_step(cache, q_B1HD, k_B1HD, v_B1HD, self._allow(causal=True))


def bigbird_random_blocks(n: int, num_blocks: int, *, num_window_blocks: int, num_global_blocks: int,
                          num_random_blocks: int, seed: int, causal: bool) -> np.ndarray:
    """The random key blocks of query block n: drawn without replacement from the blocks
    that are neither window nor global (causal: only earlier ones), by a generator seeded
    with (seed, n): the same for every head and layer (BigBird's reference draws per head).
    Causal draws do not depend on `num_blocks`, so the pattern of a prefix
    is the prefix of the pattern (decoding sees what the full pass sees). Non-causal draws
    do: their candidates run to the padded block count, so a real token's output changes
    with the padding after it (bucketing; draws landing on all-padding blocks are lost). Kept
    as is, since recorded runs depend on the pattern (a bug hunt (session 103))."""
    h, g = num_window_blocks // 2, num_global_blocks
    if causal:
        cands = np.arange(g, max(g, n - h))
    else:
        cands = np.array([m for m in range(g, num_blocks) if abs(m - n) > h], np.int64)
    take = min(num_random_blocks, len(cands))
    if take == 0:
        return np.zeros((0,), np.int64)
    return np.sort(np.random.default_rng((seed, n)).choice(cands, size=take, replace=False))


@register("bigbird")
class BigBirdAttention(BlockSparseAttention):
    """BigBird block-sparse attention (Zaheer et al. 2020, "Big Bird: Transformers for
    Longer Sequences"), the ITC form.

    Query block n sees key block m when |n - m| <= num_window_blocks // 2 (window; causal:
    0 <= n - m <= that), or m < num_global_blocks (global keys, seen by all), or
    n < num_global_blocks (global queries see everything), or m is one of the
    `num_random_blocks` random blocks of n (`bigbird_random_blocks`, drawn once from
    `seed`, never from the data). Causal mode also masks j > i inside blocks. Non-causal
    random blocks are drawn from the padded length's blocks, so outputs depend on the
    padding (bucket) length; causal ones do not.

    Fast because every non-global query block gathers only its M = window + global +
    random key blocks through a static index table, so the cost is O(L * M * block_size);
    only the few global query blocks run dense rows. Decoding uses the exact full cache
    with the block pattern applied.
    """

    @classmethod
    def block_aligned(cls, options) -> bool:
        return True

    heads_independent = True  # the random blocks are every head's (a review, session 117)
    _positive = ("block_size", "num_window_blocks")
    block_size: int = 64
    num_window_blocks: int = 3  # odd: the query's own block and (w - 1) / 2 on each side
    num_global_blocks: int = 2
    num_random_blocks: int = 3
    seed: int = 0

    @classmethod
    def _problems(cls, options, causal):
        out = super()._problems(options, causal)
        w = options.get("num_window_blocks", cls.num_window_blocks)
        if isinstance(w, int) and w > 0 and w % 2 == 0:
            out.append(("num_window_blocks", w, "must be odd (own block plus equal sides)"))
        for name in ("num_global_blocks", "num_random_blocks", "seed"):
            val = options.get(name, getattr(cls, name))
            if isinstance(val, bool) or not isinstance(val, int) or val < 0:
                out.append((name, val, "must be a non-negative integer"))
        return out

    def _random(self, n, num_blocks, causal):
        return bigbird_random_blocks(
            n, num_blocks, num_window_blocks=self.num_window_blocks,
            num_global_blocks=self.num_global_blocks, num_random_blocks=self.num_random_blocks,
            seed=self.seed, causal=causal)

    def block_table(self, num_blocks: int, causal: bool) -> np.ndarray:
        """Block-level pattern [N, N] bool, straight from the definition."""
        n, m = np.arange(num_blocks)[:, None], np.arange(num_blocks)[None, :]
        h, g = self.num_window_blocks // 2, self.num_global_blocks
        window = (n - m <= h) & (m - n <= h)
        if causal:
            window &= m <= n
        ok = window | (m < g) | (n < g)
        for row in range(num_blocks):
            ok[row, self._random(row, num_blocks, causal)] = True
        return ok

    def _random_table(self, num_blocks, causal):
        """[N - g, r] random key block ids per non-global query block; id N: empty slot."""
        g, r = self.num_global_blocks, self.num_random_blocks
        rows = [self._random(n, num_blocks, causal).tolist() for n in range(g, num_blocks)]
        return np.asarray([ids + [num_blocks] * (r - len(ids)) for ids in rows], np.int64).reshape(-1, r)

    def __call__(self, q, k, v, mask=None, *, causal: bool = False, deterministic: bool = True):
        self._validate(causal)
        L, Q = q.shape[1], self.block_size
        q, k, v, seg = _prepare(q, k, v, mask, Q, "bigbird")
        N = q.shape[2] // Q
        g = min(self.num_global_blocks, N)
        q_BHNQD, qseg_BNQ = _blocks(q, Q, 2), _blocks(seg, Q, 1)
        outs = []
        if g:
            # Global query blocks: dense rows over every key (causal: the first g blocks).
            S = g * Q if causal else q.shape[2]
            part = _gathered_part(q_BHNQD[:, :, :g], qseg_BNQ[:, :g],
                                  _block_positions(np.arange(g)[:, None], Q),
                                  k[:, :, :S], v[:, :, :S], seg[:, :S], np.arange(S, dtype=np.int32),
                                  (lambda i, j: j <= i) if causal else None)
            outs.append(_softmax_parts([part]))
        if N > g:
            # The other query blocks: three disjoint key sets under one softmax.
            h = self.num_window_blocks // 2
            offsets = tuple(range(-h, 1 if causal else h + 1))
            window = ((lambda i, j: (j >= g * Q) & (j <= i)) if causal else  # globals: own part
                      (lambda i, j: j >= g * Q))
            parts = [_band_part(q, k, v, seg, Q, offsets, window, first=g)]
            if g:  # global key blocks: one shared key set, no copy
                parts.append(_gathered_part(q_BHNQD[:, :, g:], qseg_BNQ[:, g:], None, k[:, :, :g * Q],
                                            v[:, :, :g * Q], seg[:, :g * Q], None, None))
            if self.num_random_blocks:  # random blocks, by a static index table
                table_NM = self._random_table(N, causal)
                k_BHNKD, v_BHNKD = (_table(_blocks(x, Q, 2), table_NM, 2) for x in (k, v))
                parts.append(_gathered_part(q_BHNQD[:, :, g:], qseg_BNQ[:, g:], None, k_BHNKD, v_BHNKD,
                                            _table(_blocks(seg, Q, 1), table_NM, 1), None, None))
            outs.append(_softmax_parts(parts))
        return _finish(jnp.concatenate(outs, axis=2), L, q.dtype)

    def pattern_mask(self, length, causal):
        Q = self.block_size
        blocks = np.arange(length) // Q
        ok = self.block_table(-(-length // Q), causal)[blocks[:, None], blocks[None, :]]
        return ok & (np.arange(length)[None, :] <= np.arange(length)[:, None]) if causal else ok

    def decode_step(self, cache, q_B1HD, k_B1HD, v_B1HD):
        T, Q = cache["k"].shape[1], self.block_size
        table = jnp.asarray(self.block_table(-(-T // Q), causal=True))
        return self._full_cache_step(cache, q_B1HD, k_B1HD, v_B1HD,
                                     lambda i, j_T: table[i // Q][j_T // Q])
