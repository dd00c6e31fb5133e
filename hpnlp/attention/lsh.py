"""`lsh`: Reformer's locality-sensitive-hashing attention (Kitaev, Kaiser & Levskaya 2020,
"Reformer: The Efficient Transformer").

The idea: softmax attention is dominated by the few keys closest to the query, and with
shared query/key vectors (keys are the length-normalized queries) "close" is "same
angular LSH bucket". Hash every token with random rotations (bucket = argmax([xR; -xR])),
sort the sequence by (bucket, position), cut it into chunks of C and let each chunk attend
to itself and the previous chunk: O(L * C) scores instead of O(L^2). Several hashing
rounds lower the chance that a near key lands in another bucket; their outputs are combined
with weights exp(lse_r - logsumexp_r lse_r), which (with Reformer's duplicate-count
correction below) is exactly the softmax over the union of the keys seen in all rounds.

What this implementation does, and where it departs from the paper/trax:

* Shared QK: the module uses `q` as both query and key (key_j = q_j / rms(q_j) / sqrt(D),
  Reformer's `length_normalized`, so score(i, j) ~ q_i . q_j / |q_j|); the passed `k` is
  only shape-checked; `v` are the values. A model using `lsh` therefore never uses the
  key third of its fused QKV projection (it gets zero gradient).
* Self-mask: score(i, i) -= 1e5 (not -inf, as in Reformer), so a token attends to itself
  only when no other key is allowed to it (across all rounds).
* Duplicates: a key seen several times by a query (in several rounds) has log(count)
  subtracted from its score at each sighting (the paper's m_ij = log N_ij; trax's
  `allow_duplicate_attention=False`), counted from the chunk each token sits in per round.
* Padding and packing: the sort key is (segment, bucket, position) with padding
  (segment 0) sorted last, so padding sits in a bucket of its own and is masked as a key.
  Sorting by segment first (our extension; Reformer has no packing) keeps a segment's
  chunk layout independent of other segments' content. A limit, for which a new run's
  `data.batching='pack'` is refused (`block_aligned`): chunks are cut from the row's sorted
  order, so in a packed row a segment's chunk boundaries (and so its outputs) depend on the
  lengths of the segments sorted before it;
  chunking each segment from its own start would need windows of 4C, twice the cost.
  `num_buckets=0` derives the buckets from the padded length, so it depends on that too.
* Chunks wrap within a round: the first chunk looks back at the round's last chunk of
  real tokens (trax sorts all rounds as one sequence, so there it looks back at the
  previous round's last chunk; same cost, rounds stay independent here). Until a bug hunt
  (session 102) it wrapped to the padded row's last chunk, padding or real tokens
  depending on the amount of padding, so a real token's output changed with the padded
  length (0.6 at L=24 against L=32 with chunk_size=8, num_buckets=4; with the default
  chunk of 32 both are one chunk); a row without padding wraps as it did. Where the real
  tokens fill one chunk, it looks back at itself and that repeat is masked.
* A length that `chunk_size` does not divide is padded automatically with padding tokens
  (segment 0) up to a multiple of the chunk; no config error.
* Same buckets in the backward pass: buckets and the sort permutation are computed from
  `stop_gradient(q)` once, in the forward pass, and enter the attention core as integer
  inputs of a `jax.checkpoint`-ed function. The backward pass recomputes scores from those
  saved permutations and never re-hashes, so it differentiates exactly the pattern the
  forward pass used (tested against a dense twin masked to that pattern). Under a model
  remat of the whole block the forward pass (hash included) is replayed from the same
  inputs by the same program, so the buckets come out the same (checked: model.remat
  'full' and 'dots_saveable' give the same gradients). Reversible blocks replay F on an
  input rebuilt from the outputs, equal to the forward's only to rounding, and in bfloat16
  one rounding moves a token across a bucket boundary (a bug hunt (session 100): the
  backward's re-hash put 155 of 4096 token-rounds elsewhere at L=512, depth 6); so the
  module keeps its sort permutation in the `ROUTING` variable collection when the caller
  makes it mutable, and reads it from there when the caller passes it (`kept_routing`):
  the reversible backward reuses the forward's buckets.
* Causal mode masks keys after the query (positions are carried through the sort), so no
  gradient reaches out[t] from tokens after t. But which past keys token t sees depends
  on every token's bucket, future ones included (they shift chunk boundaries), as in
  Reformer: out[t] is not a function of tokens <= t alone unless the chunks cover the
  sequence (num_buckets=1 and at most 2 chunks).
* Decoding: incremental decoding is full attention over the cache: exact shared-QK
  attention over cached normalized keys, equal to the `num_buckets=1` forward when its
  chunks cover the sequence (at most 2 chunks: L <= 2 * chunk_size); with more, each
  chunk sees only itself and the previous one, and decoding sees more. (Reformer's trax
  code decodes otherwise: the new query attends to the latest keys that share one of its
  buckets, which matches its forward pass no better.)

Random rotations come from the `features` RNG stream when the caller provides one
(constant between redraws), else from `jax.random.key(seed)`.

Shape letters: B batch, L length (P after padding to a multiple of C), H heads, D head
dim, R hashing rounds, N chunks per round, C chunk length, W = 2C keys a chunk sees
(itself and the previous chunk), K = num_buckets / 2 rotations, S keys, T cache length.
"""

from __future__ import annotations

import functools
from typing import ClassVar

import jax
import jax.numpy as jnp

from hpnlp.attention.base import (Attention, cache_put, check_inputs, check_one_token,
                                  kept_routing, register, segment_mask)
from hpnlp.config import ConfigError

_NEG = -1e30  # masked-out scores (excluded entirely)
_SELF = 1e5  # Reformer's self-attention penalty: finite, so "self" is a last resort
# ----------------------------------------------------------------------------- options

def option_problem(name: str, value) -> str | None:
    """Why an option value is not allowed, or None (shared by check_config and __call__)."""
    if name in ("num_hashes", "chunk_size"):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            return "must be a positive integer"
    elif name == "num_buckets":
        if not isinstance(value, int) or isinstance(value, bool) or value < 0 or \
                (value > 1 and value % 2):
            return ("must be 0 (derive 2 * number of chunks from the length), 1 (one bucket: "
                    "exact attention when the chunks cover the sequence) or an even number >= 2 "
                    "(buckets are argmax over [xR; -xR], so they come in pairs)")
    elif name == "seed":
        if not isinstance(value, int) or isinstance(value, bool):
            return "must be an integer"
    return None


def effective_num_buckets(num_buckets: int, length: int, chunk_size: int) -> int:
    """`num_buckets`, or for 0 Reformer's rule of thumb: mean bucket = half a chunk."""
    if num_buckets:
        return num_buckets
    chunk = min(chunk_size, length)
    return max(2, 2 * (-(-length // chunk)))


# ----------------------------------------------------------------------------- shared QK

def shared_keys(q_BLHD):
    """Keys of shared-QK attention: Reformer's length_normalized(q) / sqrt(D), in float32."""
    q32 = q_BLHD.astype(jnp.float32)
    D = q32.shape[-1]
    rms = jnp.sqrt(jnp.mean(jnp.square(q32), axis=-1, keepdims=True) + 1e-6)
    return q32 / rms / jnp.sqrt(jnp.float32(D))


def _masked_softmax_parts(s, ok, v, contract):
    """Unnormalized masked softmax applied to v, its normalizer (1 where nothing is allowed,
    so those rows give zeros, not NaN) and the row logsumexp (0 there)."""
    s = jnp.where(ok, s, _NEG)
    m = jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
    p = jnp.where(ok, jnp.exp(s - m), 0.0)
    l = jnp.sum(p, axis=-1)
    out = jnp.einsum(contract, p, v.astype(jnp.float32))
    lse = jnp.where(l > 0, m[..., 0] + jnp.log(jnp.maximum(l, 1e-30)), 0.0)
    return out, jnp.where(l > 0, l, 1.0), lse


def shared_qk_attention(q_BLHD, v_BLHD, mask_BL=None, *, causal=False, allowed_BHLS=None):
    """The dense twin: exact shared-QK softmax attention with Reformer's self-mask.

    `allowed_BHLS` optionally restricts keys further (tests pass the pattern LSH attended).
    """
    B, L, H, D = q_BLHD.shape
    kn_BLHD = shared_keys(q_BLHD).astype(q_BLHD.dtype)
    s_BHLS = jnp.einsum("blhd,bshd->bhls", q_BLHD, kn_BLHD, preferred_element_type=jnp.float32)
    s_BHLS = s_BHLS - _SELF * jnp.eye(L, dtype=jnp.float32)[None, None]
    seg_BL = jnp.ones((B, L), jnp.int32) if mask_BL is None else mask_BL.astype(jnp.int32)
    ok_BHLS = jnp.broadcast_to(segment_mask(seg_BL, seg_BL, causal=causal), (B, H, L, L))
    if allowed_BHLS is not None:
        ok_BHLS = ok_BHLS & allowed_BHLS
    out_BHLD, l_BHL, _ = _masked_softmax_parts(s_BHLS, ok_BHLS, v_BLHD.transpose(0, 2, 1, 3),
                                             "bhls,bhsd->bhld")
    return (out_BHLD / l_BHL[..., None]).transpose(0, 2, 1, 3).astype(q_BLHD.dtype)


# ----------------------------------------------------------------------------- hashing

def draw_rotations(key, num_heads: int, num_hashes: int, head_dim: int, num_buckets: int):
    """Random rotations [H, R, D, K] (None for one bucket: nothing to hash)."""
    if num_buckets == 1:
        return None
    return jax.random.normal(key, (num_heads, num_hashes, head_dim, num_buckets // 2), jnp.float32)


def hash_buckets(q_BHPD, rotations_HRDK, num_hashes: int):
    """Angular LSH: bucket = argmax([xR; -xR]) per round, [B, H, R, P] int32, no gradient."""
    B, H, P, _ = q_BHPD.shape
    if rotations_HRDK is None:
        return jnp.zeros((B, H, num_hashes, P), jnp.int32)
    x_BHPD = jax.lax.stop_gradient(q_BHPD).astype(jnp.float32)
    xr_BHRPK = jnp.einsum("bhpd,hrdk->bhrpk", x_BHPD, rotations_HRDK)
    return jnp.argmax(jnp.concatenate([xr_BHRPK, -xr_BHRPK], axis=-1), axis=-1).astype(jnp.int32)


def sort_by_bucket(buckets_BHRP, seg_BP):
    """Sort permutation by (segment, bucket, position), padding last; and its inverse.

    `perm[..., i]` is the original position of the i-th sorted token, `inv` undoes it.
    """
    B, H, R, P = buckets_BHRP.shape
    big = jnp.iinfo(jnp.int32).max
    segkey_BP = jnp.where(seg_BP == 0, big, seg_BP)
    segkey_BHRP = jnp.broadcast_to(segkey_BP[:, None, None, :], (B, H, R, P))
    pos_BHRP = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, H, R, P))
    *_, perm_BHRP = jax.lax.sort((segkey_BHRP, buckets_BHRP, pos_BHRP), dimension=3, num_keys=3)
    return jax.lax.stop_gradient(perm_BHRP), _inverse(perm_BHRP)


def _inverse(perm_BHRP):
    """The permutation that undoes `perm_BHRP` (along its last axis)."""
    pos_BHRP = jnp.broadcast_to(jnp.arange(perm_BHRP.shape[-1], dtype=jnp.int32),
                                perm_BHRP.shape)
    _, inv_BHRP = jax.lax.sort((perm_BHRP, pos_BHRP), dimension=3, num_keys=1)
    return jax.lax.stop_gradient(inv_BHRP)


def _last_real_chunk(seg_BP, C):
    """[B] the last chunk of each row's real tokens (padding sorts last in every round)."""
    real_B = jnp.sum(seg_BP != 0, axis=1)
    return jnp.maximum(-(-real_B // C) - 1, 0).astype(jnp.int32)


def _look_back(x_BHRNC, last_B):
    """Each chunk followed by the previous one, chunk 0 by the row's last chunk of real tokens
    (`_last_real_chunk`): C -> W = 2C. Where that is chunk 0 itself, `_repeat` masks it."""
    B = x_BHRNC.shape[0]
    # a gather along the chunk axis keeps B a batching dimension (for batch sharding)
    first = jnp.take_along_axis(x_BHRNC, last_B.reshape((B,) + (1,) * (x_BHRNC.ndim - 1)),
                                axis=3)  # [B, H, R, 1, C, ...]
    previous = jnp.concatenate([first, x_BHRNC[:, :, :, :-1]], axis=3)
    return jnp.concatenate([x_BHRNC, previous], axis=4)


def _repeat(last_B, chunk_BHXY, C):
    """[B, H, X, Y, W]: the window slots of a query in chunk `chunk_BHXY` (any 4-d shape that
    broadcasts against [B, H, X, Y]) that repeat chunk 0, which looks back at itself in a
    row whose real tokens fit in one chunk; they are no key, so each key is seen once per
    round (a repeat of every key alike would change the outputs only by rounding)."""
    repeat_BHXY = (last_B == 0)[:, None, None, None] & (chunk_BHXY == 0)
    return repeat_BHXY[..., None] & (jnp.arange(2 * C) >= C)[None, None, None, None, :]


def _layout(q_BLHD, mask_BL, *, num_hashes, num_buckets, chunk_size, key, perm_BHRP=None):
    """Pad to a multiple of the chunk, hash, sort. Returns (q_BHPD, seg_BP, perm, inv, C).
    A given `perm_BHRP` (a forward pass's, kept for its replay) is used instead of hashing."""
    check_inputs(q_BLHD, q_BLHD, q_BLHD, mask_BL)
    for name, value in (("num_hashes", num_hashes), ("num_buckets", num_buckets),
                        ("chunk_size", chunk_size)):
        problem = option_problem(name, value)
        if problem:
            raise ValueError(f"lsh attention: {name}={value!r} {problem}")
    B, L, H, D = q_BLHD.shape
    C = min(chunk_size, L)
    P = -(-L // C) * C
    seg_BL = jnp.ones((B, L), jnp.int32) if mask_BL is None else mask_BL.astype(jnp.int32)
    seg_BP = jnp.pad(seg_BL, ((0, 0), (0, P - L)))
    q_BHPD = jnp.pad(q_BLHD, ((0, 0), (0, P - L), (0, 0), (0, 0))).transpose(0, 2, 1, 3)
    if perm_BHRP is not None:
        if tuple(perm_BHRP.shape) != (B, H, num_hashes, P):
            raise ValueError(f"lsh attention: the kept sort permutation has shape "
                             f"{tuple(perm_BHRP.shape)}, not [B, H, num_hashes, padded L] = "
                             f"{(B, H, num_hashes, P)}; pass the one this input's forward kept")
        return q_BHPD, seg_BP, perm_BHRP, _inverse(perm_BHRP), C
    nb = effective_num_buckets(num_buckets, L, chunk_size)
    rotations_HRDK = draw_rotations(key, H, num_hashes, D, nb)
    buckets_BHRP = hash_buckets(q_BHPD, rotations_HRDK, num_hashes)
    perm_BHRP, inv_BHRP = sort_by_bucket(buckets_BHRP, seg_BP)
    return q_BHPD, seg_BP, perm_BHRP, inv_BHRP, C


def lsh_permutation(q_BLHD, mask_BL=None, *, num_hashes=2, num_buckets=16, chunk_size=32,
                    key=None):
    """The hash-sort permutation [B, H, R, P] `lsh_attention` would use (P: L padded to a
    multiple of the chunk): `perm[..., i]` is the position of the i-th sorted token."""
    key = jax.random.key(0) if key is None else key
    return _layout(q_BLHD, mask_BL, num_hashes=num_hashes, num_buckets=num_buckets,
                   chunk_size=chunk_size, key=key)[2]


# ----------------------------------------------------------------------------- attention

def _attend_sorted(q_BHPD, kn_BHPD, v_BHPD, seg_BP, perm_BHRP, inv_BHRP, *, causal, chunk):
    """Chunked attention in hash-sorted order, rounds combined by their logsumexp.

    The permutations are inputs, so under `jax.checkpoint` the backward pass recomputes
    scores with the forward pass's buckets.
    """
    B, H, P, D = q_BHPD.shape
    Dv = v_BHPD.shape[-1]  # the values' own head dim (a bug hunt (session 100): it took D)
    R, C = perm_BHRP.shape[2], chunk
    N = P // C

    def sort(x, trailing):
        """[B, H, P, *trailing] -> hash-sorted chunks [B, H, R, N, C, *trailing]."""
        idx = perm_BHRP.reshape(perm_BHRP.shape + (1,) * len(trailing))
        x_sorted = jnp.take_along_axis(x[:, :, None], idx, axis=3)
        return x_sorted.reshape((B, H, R, N, C) + trailing)

    last_B = _last_real_chunk(seg_BP, C)
    q_BHRNCD = sort(q_BHPD, (D,))
    k_BHRNWD = _look_back(sort(kn_BHPD, (D,)), last_B)
    v_BHRNWD = _look_back(sort(v_BHPD, (Dv,)), last_B)
    qpos_BHRNC = perm_BHRP.reshape(B, H, R, N, C)
    kpos_BHRNW = _look_back(qpos_BHRNC, last_B)
    qseg_BHRNC = jnp.take_along_axis(seg_BP[:, None, None, :], perm_BHRP, axis=3)
    qseg_BHRNC = qseg_BHRNC.reshape(B, H, R, N, C)
    kseg_BHRNW = _look_back(qseg_BHRNC, last_B)
    kseg_BHRNW = jnp.where(_repeat(last_B, jnp.arange(N)[None, None, None, :], C), 0,
                           kseg_BHRNW)

    s_BHRNCW = jnp.einsum("bhrncd,bhrnwd->bhrncw", q_BHRNCD, k_BHRNWD,
                          preferred_element_type=jnp.float32)
    ok_BHRNCW = ((qseg_BHRNC[..., :, None] == kseg_BHRNW[..., None, :])
                 & (kseg_BHRNW != 0)[..., None, :])
    if causal:
        ok_BHRNCW &= kpos_BHRNW[..., None, :] <= qpos_BHRNC[..., :, None]
    self_BHRNCW = qpos_BHRNC[..., :, None] == kpos_BHRNW[..., None, :]
    s_BHRNCW = s_BHRNCW - _SELF * self_BHRNCW.astype(jnp.float32)
    if R > 1 and N > 1:
        # Count the sightings of key j by query i over all rounds: j is seen from the chunk
        # it sits in, from the next one (which looks back at it) and, when j is in the
        # row's last chunk of real tokens (not chunk 0), from chunk 0. With one chunk (N=1)
        # or one round the count is the same for every pair, so it changes nothing.
        loc_BHRP = inv_BHRP // C  # chunk of each token, per round
        loc_BHRNCR = sort(loc_BHRP.transpose(0, 1, 3, 2), (R,))
        kloc_BHRNWR = _look_back(loc_BHRNCR, last_B)
        qloc = loc_BHRNCR[:, :, :, :, :, None, :]
        kloc = kloc_BHRNWR[:, :, :, :, None, :, :]
        last = last_B[:, None, None, None, None, None, None]
        prev = jnp.where(qloc == 0, jnp.where(last > 0, last, -1), qloc - 1)  # looked back at
        count_BHRNCW = jnp.sum((kloc == qloc).astype(jnp.int32) +
                               (kloc == prev).astype(jnp.int32), axis=-1)
        s_BHRNCW = s_BHRNCW - jnp.log(jnp.maximum(count_BHRNCW, 1).astype(jnp.float32))

    o_BHRNCD, l_BHRNC, lse_BHRNC = _masked_softmax_parts(s_BHRNCW, ok_BHRNCW, v_BHRNWD,
                                                       "bhrncw,bhrnwd->bhrncd")
    o_BHRNCD = o_BHRNCD / l_BHRNC[..., None]
    # Back to original order, then weight round r by exp(lse_r - logsumexp_r lse_r). Padding
    # queries have lse 0 and output 0 in every round, so they stay 0 (never NaN).
    o_BHRPD = jnp.take_along_axis(o_BHRNCD.reshape(B, H, R, P, Dv), inv_BHRP[..., None], axis=3)
    lse_BHRP = jnp.take_along_axis(lse_BHRNC.reshape(B, H, R, P), inv_BHRP, axis=3)
    w_BHRP = jax.nn.softmax(lse_BHRP, axis=2)
    return jnp.einsum("bhrp,bhrpd->bhpd", w_BHRP, o_BHRPD)


def lsh_attention(q_BLHD, v_BLHD, mask_BL=None, *, causal=False, num_hashes=2, num_buckets=16,
                  chunk_size=32, key=None, perm_BHRP=None):
    """Functional form: shared-QK LSH attention of `q` (queries and keys) over values `v`.
    `perm_BHRP` (from `lsh_permutation`): sort by it instead of hashing `q` again."""
    if v_BLHD.shape[:3] != q_BLHD.shape[:3]:
        raise ValueError(f"lsh attention is self-attention: q{q_BLHD.shape} and v{v_BLHD.shape} "
                         "must agree on [batch, length, heads]")
    key = jax.random.key(0) if key is None else key
    L = q_BLHD.shape[1]
    q_BHPD, seg_BP, perm_BHRP, inv_BHRP, C = _layout(
        q_BLHD, mask_BL, num_hashes=num_hashes, num_buckets=num_buckets, chunk_size=chunk_size,
        key=key, perm_BHRP=perm_BHRP)
    P = q_BHPD.shape[2]
    kn_BHPD = shared_keys(q_BHPD).astype(q_BLHD.dtype)
    v_BHPD = jnp.pad(v_BLHD, ((0, 0), (0, P - L), (0, 0), (0, 0))).transpose(0, 2, 1, 3)
    core = jax.checkpoint(functools.partial(_attend_sorted, causal=causal, chunk=C))
    out_BHPD = core(q_BHPD, kn_BHPD, v_BHPD, seg_BP, perm_BHRP, inv_BHRP)
    return out_BHPD[:, :, :L].transpose(0, 2, 1, 3).astype(q_BLHD.dtype)


def lsh_windows(q_BLHD, mask_BL=None, *, causal=False, num_hashes=2, num_buckets=16,
                chunk_size=32, key=None):
    """Which keys each query sees, for analysis and tests (not used by the forward pass).

    Returns `keys_BHLRW` (key positions, per round, in the query's chunk and the previous
    one) and `ok_BHLRW` (the key is real, same segment, not chunk 0's repeat of itself, and
    not in the future if causal).
    """
    key = jax.random.key(0) if key is None else key
    B, L, H, _ = q_BLHD.shape
    q_BHPD, seg_BP, perm_BHRP, inv_BHRP, C = _layout(
        q_BLHD, mask_BL, num_hashes=num_hashes, num_buckets=num_buckets, chunk_size=chunk_size,
        key=key)
    R, P = perm_BHRP.shape[2], q_BHPD.shape[2]
    N = P // C
    last_B = _last_real_chunk(seg_BP, C)
    keys_BHRNW = _look_back(perm_BHRP.reshape(B, H, R, N, C), last_B)
    chunk_BHRP = (inv_BHRP // C)[..., None, None]
    keys_BHRPW = jnp.take_along_axis(keys_BHRNW[:, :, :, None], chunk_BHRP, axis=4)[:, :, :, :, 0]
    keys_BHLRW = keys_BHRPW[:, :, :, :L].transpose(0, 1, 3, 2, 4)
    qseg_BL = seg_BP[:, :L]
    kseg_BHLRW = jnp.take_along_axis(seg_BP[:, None, None, None, :],
                                     keys_BHLRW.reshape(B, H, L, 1, -1), axis=4)
    kseg_BHLRW = kseg_BHLRW.reshape(keys_BHLRW.shape)
    ok_BHLRW = (kseg_BHLRW == qseg_BL[:, None, :, None, None]) & (kseg_BHLRW != 0)
    ok_BHLRW &= ~_repeat(last_B, (inv_BHRP[:, :, :, :L] // C).transpose(0, 1, 3, 2), C)
    if causal:
        ok_BHLRW &= keys_BHLRW <= jnp.arange(L)[None, None, :, None, None]
    return keys_BHLRW, ok_BHLRW


@register("lsh")
class LSHAttention(Attention):
    """Kitaev, Kaiser & Levskaya 2020, "Reformer": shared-QK attention restricted to keys in
    the same angular-LSH bucket; sorting by bucket and chunking makes it O(L * chunk)."""

    random_features: ClassVar[bool] = True

    @classmethod
    def block_aligned(cls, options) -> bool:
        """Its chunks are cut from the row's sorted order, so a packed document's chunk
        boundaries move with the lengths of those before it (the module's "A limit"): a new
        packed run is refused, as `local`'s is (a review, session 118)."""
        return True

    num_hashes: int = 2  # hashing rounds R, combined by logsumexp weights
    num_buckets: int = 16  # even; 0 = 2 * number of chunks; 1 = no hashing (exact if N <= 2)
    chunk_size: int = 32  # C; a length it does not divide is padded with padding tokens
    seed: int = 0  # rotations when the caller gives no `features` RNG stream

    @classmethod
    def check_config(cls, options, *, seq_len, causal, field="attention.options"):
        super().check_config(options, seq_len=seq_len, causal=causal, field=field)
        for name in ("num_hashes", "num_buckets", "chunk_size", "seed"):
            value = options.get(name, getattr(cls, name))
            problem = option_problem(name, value)
            if problem:
                raise ConfigError(
                    f"config field `{field}.{name}` = {value!r} is not allowed: {problem}")
        if options.get("seed", cls.seed) != cls.seed:  # a bug hunt: taken, and never read
            raise ConfigError(f"config field `{field}.seed` = {options['seed']!r} is not "
                              "allowed: a model's rotations come from the run's `features` "
                              "stream (the config's seed, redrawn every "
                              "train.feature_redraw_every steps), so this option is never read; "
                              "drop it, or set the config's seed")

    def _rotation_key(self):
        if self.scope is not None and self.has_rng("features"):
            return self.make_rng("features")
        return jax.random.key(self.seed)

    def __call__(self, q, k, v, mask=None, *, causal: bool = False, deterministic: bool = True):
        check_inputs(q, k, v, mask)
        if k.shape != q.shape:
            raise ValueError(f"lsh attention shares queries and keys, so k must have q's shape "
                             f"(it is only checked, never used): q{q.shape} k{k.shape}")
        opts = dict(num_hashes=self.num_hashes, num_buckets=self.num_buckets,
                    chunk_size=self.chunk_size)
        perm_BHRP = kept_routing(self, "perm", lambda: lsh_permutation(
            q, mask, key=self._rotation_key(), **opts))
        return lsh_attention(q, v, mask, causal=causal, perm_BHRP=perm_BHRP, **opts)

    def decode_step(self, cache, q_B1HD, k_B1HD, v_B1HD):
        """Decodes with full attention over the cache (not Reformer's bucketed decoding: the
        module docstring): exact shared-QK attention of the new query over the cached keys
        (its own included, self-masked). The base class's
        cache layout is kept, but cache["k"] holds normalized shared keys, not `k`."""
        check_one_token(self.registry_name, cache, q_B1HD)
        check_inputs(q_B1HD, k_B1HD, v_B1HD, None)
        idx = cache["index"]
        kn_B1HD = shared_keys(q_B1HD).astype(cache["k"].dtype)
        k_BTHD, v_BTHD = cache_put(cache["k"], kn_B1HD, idx), cache_put(cache["v"], v_B1HD, idx)
        T = k_BTHD.shape[1]
        s_BH1T = jnp.einsum("blhd,bthd->bhlt", q_B1HD, k_BTHD.astype(q_B1HD.dtype),
                            preferred_element_type=jnp.float32)
        pos_T = jnp.arange(T)
        s_BH1T = s_BH1T - _SELF * (pos_T == idx).astype(jnp.float32)[None, None, None, :]
        ok_111T = (pos_T <= idx)[None, None, None, :]
        v_BHTD = v_BTHD.astype(q_B1HD.dtype).transpose(0, 2, 1, 3)
        out_BH1D, l_BH1, _ = _masked_softmax_parts(s_BH1T, ok_111T, v_BHTD, "bhlt,bhtd->bhld")
        out_B1HD = (out_BH1D / l_BH1[..., None]).transpose(0, 2, 1, 3).astype(q_B1HD.dtype)
        return out_B1HD, {"k": k_BTHD, "v": v_BTHD, "index": idx + 1}
