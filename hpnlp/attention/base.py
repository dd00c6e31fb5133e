"""Registry, shared checks and the default key/value cache for attention variants.

Shape letters: B batch, L query length, S key length, T cache length, H heads, G key/value
heads of a grouped cache (dividing H), D head dim.
"""

from __future__ import annotations

from typing import Any, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp

from hpnlp.config import config_error
from hpnlp.registry import Registry

_REGISTRY = Registry("attention variant")
register = _REGISTRY.register  # class decorator: make a variant available as `get(name)`
registered = _REGISTRY.registered  # context manager: a variant for one `with` block
names = _REGISTRY.names
get = _REGISTRY.get


def draws_features(name: str, options, *, decoding: bool = False) -> bool:
    """Whether variant `name` with `options` draws from the run's `features` stream, so a
    pass outside training needs the draw its parameters trained with: a variant of
    `random_features` unless its `redraw` option is off (Performer: its `redraw`, True by
    default); one without that option (LSH) draws its rotations in a whole pass, and decodes
    by full attention over its cache (`decoding`: no draw)."""
    cls = get(name)
    return bool(cls.random_features
                and dict(options).get("redraw", getattr(cls, "redraw", not decoding)))


# Variable collection of discrete routing (integer arrays a variant chooses from its input)
# that a replay of the forward must reuse: `kept_routing`.
ROUTING = "routing"


def kept_routing(module, name: str, compute):
    """A variant's discrete routing `name` (integer arrays chosen from its inputs): read
    from the `ROUTING` collection when the caller passes one, else `compute()`d and, when
    the caller made the collection mutable, stored there. Reversible blocks use it: their
    backward recomputes attention on an input rebuilt from the outputs, equal to the
    forward's only to rounding, which can flip a bucket or cluster (`lsh`, `clustered`)."""
    if module.scope is None:  # unbound: no collections
        return compute()
    if module.has_variable(ROUTING, name):
        return module.get_variable(ROUTING, name)
    value = compute()
    if module.is_mutable_collection(ROUTING) and not module.is_initializing():
        module.put_variable(ROUTING, name, value)
    return value


def check_inputs(q, k, v, mask, *, grouped: bool = False) -> None:
    """Shape checks that run at trace time, so a mistake fails before compiling. `grouped`:
    k and v may have G heads dividing q's H (a grouped-query cache; the caller checked G)."""
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(
            f"attention wants [batch, length, heads, head_dim] arrays; got q{q.shape} "
            f"k{k.shape} v{v.shape}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"query and key head dims differ: q{q.shape} vs k{k.shape}")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"key and value disagree on [batch, length, heads]: k{k.shape} v{v.shape}")
    if q.shape[0] != k.shape[0] or (q.shape[2] != k.shape[2] and not grouped):
        raise ValueError(f"query and key disagree on batch or heads: q{q.shape} k{k.shape}")
    if mask is not None and mask.shape != q.shape[:2]:
        raise ValueError(
            f"mask must be segment ids of shape [batch, length] = {q.shape[:2]}; got {mask.shape}")
    if mask is not None and q.shape[1] != k.shape[1]:
        raise ValueError(f"segment ids [B, L] serve queries and keys alike, so the query length "
                         f"{q.shape[1]} must equal the key length {k.shape[1]}; pass mask=None")


def check_one_token(name: str, cache, q_BKHD) -> None:
    """Refuses what a variant's own decode cache (ring buffer, recurrent state, routed or
    pattern-masked cache) cannot take: K > 1 tokens in one call, or an index of one position
    per row ([B]). Its step writes one token at one slot and moves the index by one, so either
    would compute a wrong result silently (or fail deep in a broadcast)."""
    K, index_shape = q_BKHD.shape[1], jnp.shape(cache["index"])
    if K != 1 or index_shape:
        raise ValueError(f"{name} attention decodes one token a call with one index for every "
                         f"row (its decode cache is its own); got {K} tokens and an index of "
                         f"shape {index_shape}; use an exact-cache variant (dense, chunked) for "
                         "prefill or per-row positions")


def segment_mask(q_seg_BL, k_seg_BS, *, causal: bool, q_pos_BL=None, k_pos_BS=None):
    """Boolean [B, 1, L, S] mask from segment ids (0 = padding) and, if causal, positions."""
    B, L = q_seg_BL.shape
    S = k_seg_BS.shape[1]
    allowed = (q_seg_BL[:, :, None] == k_seg_BS[:, None, :]) & (k_seg_BS[:, None, :] != 0)
    if causal:
        qp = jnp.arange(L)[None, :] if q_pos_BL is None else q_pos_BL
        kp = jnp.arange(S)[None, :] if k_pos_BS is None else k_pos_BS
        allowed &= qp[:, :, None] >= kp[:, None, :]
    return allowed[:, None, :, :]


def cache_put(buf_BT__, x_B1__, index):
    """`buf` with `x` (cast to its dtype) written at position `index` of axis 1: a cache's
    update. `index` is one position for every row, or [B], each row's own (speculative
    decoding, whose rows accept different numbers of drafts). 16-bit floats are written
    through a uint16 view (a free bitcast): XLA:CPU runs a bfloat16 dynamic-update-slice in
    float32, converting the whole cache and back every step (at batch 16 that copy was 8 MB
    per cache per token, most of a bfloat16 LM's decoding step), while an integer one
    updates the buffer in place."""
    x_B1__ = x_B1__.astype(buf_BT__.dtype)
    if jnp.ndim(index) == 1:  # a row's own position: the same update, batched over rows
        put = jax.vmap(lambda b, x, i: jax.lax.dynamic_update_slice_in_dim(b, x, i, 0))
    else:
        put = lambda b, x, i: jax.lax.dynamic_update_slice_in_dim(b, x, i, 1)  # noqa: E731
    if jnp.dtype(buf_BT__.dtype).itemsize == 2 and jnp.issubdtype(buf_BT__.dtype, jnp.floating):
        as_u16 = lambda a: jax.lax.bitcast_convert_type(a, jnp.uint16)  # noqa: E731
        return jax.lax.bitcast_convert_type(put(as_u16(buf_BT__), as_u16(x_B1__), index),
                                            buf_BT__.dtype)
    return put(buf_BT__, x_B1__, index)


def masked_softmax_attention(q_BLHD, k_BSHD, v_BSHD, allowed_B1LS=None):
    """Exact softmax attention in float32; rows with no allowed key output zeros, not NaN."""
    return attend(softmax_probabilities(q_BLHD, k_BSHD, allowed_B1LS), v_BSHD, q_BLHD.dtype)


def attend(p_BHLS, v_BSHD, dtype):
    """The values weighted by attention distributions [B, H, L, S], in float32, as `dtype`.

    Written with the batch axes leading in both operands and the result ([B, H, S, D]
    values in, [B, H, L, D] out, each transposed explicitly), which XLA:CPU ran faster
    than the one einsum straight into [B, L, H, D]: at the byte LM's shape on a 2-core
    Zen 3 that einsum took 1.8x as long as this, and dense attention 1.25-1.32x slower forward,
    1.09-1.13x forward+backward (`python tools/attention_layout_ab.py`, 2026-11-26)."""
    v_BHSD = jnp.swapaxes(v_BSHD.astype(jnp.float32), 1, 2)
    out_BHLD = jnp.einsum("bhls,bhsd->bhld", p_BHLS, v_BHSD)
    return jnp.swapaxes(out_BHLD, 1, 2).astype(dtype)


def softmax_probabilities(q_BLHD, k_BSHD, allowed_B1LS=None):
    """The attention distributions [B, H, L, S] of `masked_softmax_attention`, in float32
    (rows with no allowed key are all zeros)."""
    D = q_BLHD.shape[-1]
    logits_BHLS = jnp.einsum("blhd,bshd->bhls", q_BLHD, k_BSHD,
                             preferred_element_type=jnp.float32) / jnp.sqrt(D).astype(jnp.float32)
    if allowed_B1LS is not None:
        logits_BHLS = jnp.where(allowed_B1LS, logits_BHLS, -1e30)
    m_BHL1 = jnp.max(logits_BHLS, axis=-1, keepdims=True, initial=-jnp.inf)  # S = 0: no keys
    p_BHLS = jnp.exp(logits_BHLS - jax.lax.stop_gradient(m_BHL1))
    if allowed_B1LS is not None:
        p_BHLS = jnp.where(allowed_B1LS, p_BHLS, 0.0)
    denom_BHL1 = jnp.sum(p_BHLS, axis=-1, keepdims=True)
    return p_BHLS / jnp.maximum(denom_BHL1, 1e-30)


class Attention(nn.Module):
    """Base class of every variant.

    Class attributes say what a variant can do, so configs are checked before compiling:
    `supports_causal` (False: causal use is a config error) and `supports_segments`
    (False: only right padding, i.e. one segment per row, so `data.batching='pack'` is
    refused).

    The default decode path is an exact key/value cache: `init_cache` makes zeros of
    `[B, T, H, D]` and `decode_step` writes one token at `index` and attends to keys
    `0..index` (`cache_cpu.cached_attention`, a CPU kernel where it can run; `cache_impl`).
    Windowed and recurrent variants override both.
    """

    supports_causal: ClassVar[bool] = True
    supports_segments: ClassVar[bool] = True
    # True: when an apply makes the `attention_probs` collection mutable, the variant sows
    # its [B, H, L, S] distributions there as "probs" (attention-map distillation)
    returns_probabilities: ClassVar[bool] = False
    # True: each head attends on its own, with no parameters or random draws that depend on
    # the number of heads, so structured pruning may remove heads (hpnlp.compress.prune)
    heads_independent: ClassVar[bool] = False
    # True: draws random features or rotations from the `features` stream (make_rng)
    random_features: ClassVar[bool] = False
    # The options that set only how the function is computed (memory, recomputation, the
    # prefix sums' chunks): a resume may change them (hpnlp.train.checkpoint), as an output
    # layer's `layout_options`
    layout_options: ClassVar[frozenset] = frozenset()

    @classmethod
    def block_aligned(cls, options) -> bool:
        """Whether, under `options`, what a token sees depends on where its row's blocks start
        (blocks from column 0), not on its distances alone: a document packed mid-row would
        attend otherwise than alone or decoded, so `data.batching='pack'` is refused (a
        review, session 115: `local`, `bigbird` and `strided` mode='fixed' were taken)."""
        return False
    registry_name: ClassVar[str] = ""

    @classmethod
    def check_config(cls, options: dict[str, Any], *, seq_len: int, causal: bool,
                     field: str = "attention.options") -> None:
        if causal and not cls.supports_causal:
            raise config_error("attention.name", cls.registry_name, "this variant cannot be "
                               "causal, but the model is causal (model.kind='lm', or a "
                               "classifier with model.causal=true); choose a causal-capable "
                               "variant, or leave the classifier's model.causal false")

    @classmethod
    def exact_cache(cls) -> bool:
        """Whether the variant decodes through the default exact key/value cache
        (`init_cache`, `decode_step` not overridden): the one that takes several tokens a
        call (prefill, speculative decoding's verification) and that resetting its `index`
        rewinds. Windowed, recurrent and feature variants keep caches of their own and
        decode one token a call."""
        return cls.decode_step is Attention.decode_step and cls.init_cache is Attention.init_cache

    def cache_impl(self) -> str:
        """The default decode step's `cache_cpu.cached_attention(impl=)`: "auto" (its CPU
        kernel where it runs); a variant with an `impl` option of its own passes it on."""
        return "auto"

    def init_cache(self, batch: int, max_len: int, num_heads: int, head_dim: int, dtype, *,
                   shared_kv: bool = False):
        """Zeros of [B, T, H, D] for keys and values; `dtype` int8 (`quant.kv_cache='int8'`):
        int8 codes with float32 scales [B, T, H], one per position and head. `shared_kv`:
        one buffer "k" whose rows are both keys and values (multi-head latent attention's
        cached latent; `decode_step` with v None)."""
        zeros = jnp.zeros((batch, max_len, num_heads, head_dim), dtype)
        cache = {"k": zeros, "index": jnp.zeros((), jnp.int32)}
        if not shared_kv:
            cache["v"] = zeros
        if jnp.dtype(dtype) == jnp.int8:
            for name in ("k",) if shared_kv else ("k", "v"):
                cache[f"{name}_scale"] = jnp.zeros((batch, max_len, num_heads), jnp.float32)
        return cache

    def decode_step(self, cache, q_BKHD, k_BKHD, v_BKHD):
        """K tokens (usually one): append k, v at cache['index'], each query attending to
        the cached keys and the new ones up to its own. The index is one position for every
        row (`init_cache`'s), or [B], each row's own (set by the caller: speculative
        decoding's rewind). The caller keeps index + K within the cache (a dynamic update
        past its end would be clamped, overwriting earlier entries). An int8 cache stores
        the new keys and values quantized (`cache_cpu.quantize_kv`), and they are read back
        as stored. A `shared_kv` cache (no "v") takes v None: each cached row is both key and
        value."""
        from hpnlp.attention.cache_cpu import cached_attention, quantize_kv  # it imports this

        idx = cache["index"]
        new = {"index": idx + q_BKHD.shape[1]}
        shared = "v" not in cache
        if shared != (v_BKHD is None):
            raise ValueError("decode_step: a cache of shared key/value rows takes v None, and "
                             "only it does")
        names = (("k", k_BKHD),) if shared else (("k", k_BKHD), ("v", v_BKHD))
        scales = None
        for name, x_BKHD in names:
            if "k_scale" in cache:
                codes_BKHD, scale_BKH = quantize_kv(x_BKHD)
                new[name] = cache_put(cache[name], codes_BKHD, idx)
                new[f"{name}_scale"] = cache_put(cache[f"{name}_scale"], scale_BKH, idx)
            else:
                new[name] = cache_put(cache[name], x_BKHD, idx)
        k_BTHD = new["k"]
        v_BTHD = k_BTHD if shared else new["v"]
        if "k_scale" in cache:
            scales = (new["k_scale"], new["k_scale" if shared else "v_scale"])
        else:
            k_BTHD, v_BTHD = k_BTHD.astype(q_BKHD.dtype), v_BTHD.astype(q_BKHD.dtype)
        out = cached_attention(q_BKHD, k_BTHD, v_BTHD, idx, scales=scales, impl=self.cache_impl())
        return out, new
