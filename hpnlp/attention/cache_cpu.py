"""Attention of new queries over a key/value cache: a decoding step's attention.

    out_BLHD = cached_attention(q_BLHD, k_BTHD, v_BTHD, index)

Query j of the L new ones sits at cache position `index + j` and sees keys 0..index + j
(the cache already holds its own key). `index` is one position for every row, or [B], each
row's own (speculative decoding's rows). Every variant's default `decode_step` calls it.

Two implementations compute the same thing. On a CPU the default (`impl="auto"`) is one
fused kernel (`cache_cpu.cc`): XLA:CPU runs q [B, 1, H, D] against the cache [B, T, H, D]
as products batched over (b, h), which it can only do after transposing both whole caches
so those dimensions lead, every step; at batch 16 and 512 positions those copies took most
of a width-512 LM's decoding step. The kernel reads the cache where it lies, and only the
positions written so far. The XLA program (`impl="xla"`) runs everywhere else and is the
kernel's tested twin. Derivatives (decoding is not trained, but a step is differentiable),
forward and reverse mode, are the twin's.

Grouped-query attention (`model.num_kv_heads`): the cache may hold G key/value heads, G
dividing the queries' H; query head h reads cache head h // (H / G).

An int8 cache (`quant.kv_cache='int8'`, `quantize_kv`): k, v int8 codes and `scales`
(k_scale, v_scale) [B, T, G], one per position and key/value head (symmetric, absmax over
the head's D values: `compress.formats`' int8), so key t is k[t] * k_scale[t]. The kernel
widens the codes in registers and reads a quarter of a float32 cache's bytes; the twin
dequantizes the whole cache, then runs as above.

Shape letters: B batch, L query length, T cache length, H heads, G key/value heads, D head
dim.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from hpnlp import kernels
from hpnlp.attention.base import check_inputs, masked_softmax_attention

KERNEL = kernels.CpuKernel(
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "cache_cpu.cc"),
    {"hpnlp_cached_attention": "HpnlpCachedAttention",
     "hpnlp_cached_attention_bf16": "HpnlpCachedAttentionBf16",
     "hpnlp_cached_attention_i8": "HpnlpCachedAttentionI8"},
    what="cached attention")
IMPLS = ("auto", "kernel", "xla")
DTYPES = (jnp.float32, jnp.bfloat16)


def quantize_kv(x_BKGD):
    """Keys or values [B, K, G, D] -> (int8 codes [B, K, G, D], float32 scales [B, K, G]):
    one symmetric scale per position and head, absmax / 127 over its D values."""
    from hpnlp.compress import formats  # jax only; hpnlp.compress imports the models
    codes, scale = formats.get("int8").encode(x_BKGD, axes=(3,))
    return codes, scale[..., 0]


def dequantize_kv(codes_BTGD, scale_BTG):
    from hpnlp.compress import formats
    return formats.get("int8").decode(codes_BTGD, scale_BTG[..., None])


def cached_attention_xla(q_BLHD, k_BTGD, v_BTGD, index, scales=None):
    """The XLA twin: masked softmax attention over the whole cache, in float32 (grouped
    heads repeated; an int8 cache dequantized first)."""
    from hpnlp.models.transformer import repeat_kv_heads  # it imports the attention package
    if scales is not None:  # in float32, as the kernel (`_kernel_i8`): a bfloat16 query read
        # the dequantized cache rounded to bfloat16 (a review, session 116)
        k_BTGD, v_BTGD = dequantize_kv(k_BTGD, scales[0]), dequantize_kv(v_BTGD, scales[1])
        out = cached_attention_xla(q_BLHD.astype(jnp.float32), k_BTGD.astype(jnp.float32),
                                   v_BTGD.astype(jnp.float32), index)
        return out.astype(q_BLHD.dtype)
    H = q_BLHD.shape[2]
    k_BTHD, v_BTHD = repeat_kv_heads(k_BTGD, H), repeat_kv_heads(v_BTGD, H)
    L, T = q_BLHD.shape[1], k_BTHD.shape[1]
    index_B111 = jnp.reshape(index, (-1, 1, 1, 1))  # one position, or each row's
    allowed_B1LT = (jnp.arange(T)[None, None, None, :]
                    <= index_B111 + jnp.arange(L)[None, None, :, None])
    return masked_softmax_attention(q_BLHD, k_BTHD.astype(q_BLHD.dtype),
                                    v_BTHD.astype(q_BLHD.dtype), allowed_B1LT)


def blocker(q_BLHD, k_BTHD, v_BTHD, coded: bool = False) -> str | None:
    """Why the kernel cannot run on these operands here; None if it can (`coded`: an int8
    cache, whose q the caller gives the kernel in float32)."""
    dtypes = {jnp.dtype(x.dtype) for x in (q_BLHD, k_BTHD, v_BTHD)}
    if not coded and (len(dtypes) != 1 or next(iter(dtypes)) not in [jnp.dtype(d) for d in DTYPES]):
        return (f"dtypes q {q_BLHD.dtype}, k {k_BTHD.dtype}, v {v_BTHD.dtype} (the kernel takes "
                "all float32 or all bfloat16, or an int8 cache)")
    if v_BTHD.shape[-1] != q_BLHD.shape[-1]:
        return f"value head dim {v_BTHD.shape[-1]} differs from the query's {q_BLHD.shape[-1]}"
    return KERNEL.blocker()


def _kernel(q_BLHD, k_BTHD, v_BTHD, index, threads):
    """The kernel, differentiated as the twin in every mode (`kernels.with_twin_gradient`:
    found in review, a `custom_vjp` here left `jax.jvp` and `jacfwd` to impl='xla' only)."""
    options = dict(scale=np.float32(1.0 / np.sqrt(q_BLHD.shape[-1])),
                   threads=np.int64(kernels.cores() if threads is None else threads))

    def kernel(q, k, v, i):
        return jax.ffi.ffi_call(
            "hpnlp_cached_attention" + ("_bf16" if q.dtype == jnp.bfloat16 else ""),
            jax.ShapeDtypeStruct(q.shape, q.dtype), vmap_method="sequential")(q, k, v, i, **options)

    return kernels.with_twin_gradient(kernel, cached_attention_xla, q_BLHD, k_BTHD, v_BTHD, index)


def _kernel_i8(q_BLHD, k_BTGD, v_BTGD, ks_BTG, vs_BTG, index, threads):
    """`_kernel` over an int8 cache: the query's and the scales' derivatives are the twin's
    (the integer codes and index have none)."""
    options = dict(scale=np.float32(1.0 / np.sqrt(q_BLHD.shape[-1])),
                   threads=np.int64(kernels.cores() if threads is None else threads))

    def kernel(q, k, v, ks, vs, i):
        return jax.ffi.ffi_call(
            "hpnlp_cached_attention_i8", jax.ShapeDtypeStruct(q.shape, jnp.float32),
            vmap_method="sequential")(q, k, v, ks, vs, i, **options)

    def twin(q, k, v, ks, vs, i):
        return cached_attention_xla(q, k, v, i, (ks, vs))

    return kernels.with_twin_gradient(kernel, twin, q_BLHD, k_BTGD, v_BTGD, ks_BTG, vs_BTG, index)


def cached_attention(q_BLHD, k_BTHD, v_BTHD, index, *, scales=None, impl: str = "auto",
                     threads: int | None = None):
    """softmax(q k^T / sqrt(D)) v where query j sees cache positions 0..index + j (`index`
    a scalar, or [B]: row b's queries from index[b]); a query that sees none outputs zeros.
    The cache k, v [B, T, G, D] may hold fewer heads than q (G dividing H: grouped-query),
    and may be int8 codes with `scales` = (k_scale, v_scale) [B, T, G] (`quantize_kv`).
    Returned in q's dtype. `impl`: "auto" (the CPU kernel where it can run: the CPU
    backend, one device, q, k and v all float32 or all bfloat16, or an int8 cache),
    "kernel" (an error where it cannot) or "xla". `threads`: the kernel's most threads
    (None: every core; it uses fewer where the cache read so far is small)."""
    G = k_BTHD.shape[2] if k_BTHD.ndim == 4 else 0
    if G and q_BLHD.ndim == 4 and q_BLHD.shape[2] % G:
        raise ValueError(f"cached attention: the cache's {G} key/value heads must divide the "
                         f"queries' {q_BLHD.shape[2]} heads; got q{q_BLHD.shape} k{k_BTHD.shape}")
    check_inputs(q_BLHD, k_BTHD, v_BTHD, None, grouped=True)
    coded = scales is not None
    if coded != (jnp.dtype(k_BTHD.dtype) == jnp.int8) or coded != (jnp.dtype(v_BTHD.dtype) == jnp.int8):
        raise ValueError(f"cached attention: an int8 cache needs scales=(k_scale, v_scale), and "
                         f"scales need an int8 cache; got k {k_BTHD.dtype}, v {v_BTHD.dtype}, "
                         f"scales {'given' if coded else 'None'}")
    if coded:
        want = k_BTHD.shape[:3]
        if len(scales) != 2 or any(jnp.shape(s) != want for s in scales):
            raise ValueError(f"cached attention: scales must be (k_scale, v_scale), each "
                             f"{want} (the cache's [B, T, G]); got "
                             f"{[jnp.shape(s) for s in scales]}")
        scales = tuple(jnp.asarray(s, jnp.float32) for s in scales)
    if impl not in IMPLS:
        raise ValueError(f"cached attention: impl={impl!r} is not one of {IMPLS}")
    if threads is not None and (not kernels.is_integer(threads) or threads < 1):
        raise ValueError(f"cached attention: threads must be an integer >= 1; got {threads!r}")
    reason = "impl='xla'" if impl == "xla" else blocker(q_BLHD, k_BTHD, v_BTHD, coded)
    if impl == "kernel" and reason is not None:
        raise ValueError(f"cached attention: impl='kernel' cannot run here: {reason}. Use "
                         "impl='auto' (the kernel where it can run) or impl='xla'")
    index = jnp.asarray(index, jnp.int32)
    if index.shape not in ((), (q_BLHD.shape[0],)):
        raise ValueError(f"cached attention: index must be one position or one per row "
                         f"({q_BLHD.shape[0]}); got shape {index.shape}")
    if reason is not None:
        return cached_attention_xla(q_BLHD, k_BTHD, v_BTHD, index, scales)
    threads = None if threads is None else int(threads)
    if coded:
        return _kernel_i8(q_BLHD.astype(jnp.float32), k_BTHD, v_BTHD, *scales, index,
                          threads).astype(q_BLHD.dtype)
    return _kernel(q_BLHD, k_BTHD, v_BTHD, index, threads)
