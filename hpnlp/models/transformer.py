"""Transformer trunk (pre-LayerNorm blocks) with attention taken from the registry.

Shape letters: B batch, L length, E width (d_model), H heads, G key/value heads
(model.num_kv_heads; H where it is 0), D head dim (E / H), F MLP width, T cache length
(model.max_len), R rotary frequencies (D / 2).

Parameters carry logical axis names (`vocab`, `embed`, `heads`, `kv`, `mlp`; `layers` on
the stacked blocks of `model.stack_layers`, which parallel/pipeline.py runs) and
activations `(batch, length, activation_embed)`, so the mesh rules in the config decide how they
are sharded; the model code never names a device axis.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from hpnlp import attention as attention_lib
from hpnlp.compress.formats import fake_quant
from hpnlp.compress.qlinear import Dense, Epilogue, calibration_mask, param, qeinsum
from hpnlp.config import REMAT_NAMES, AttentionConfig, ModelConfig

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}

REMAT_POLICIES = {
    "full": None,  # save nothing, recompute the whole block
    "dots_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def remat_policy(remat: str):
    """`model.remat` -> a `jax.checkpoint` policy. "names:qkv,mlp_in" saves only the Block
    activations tagged with those names (REMAT_NAMES, see `Block`) and recomputes the rest."""
    if remat.startswith("names:"):
        names = tuple(n.strip() for n in remat[len("names:"):].split(","))
        unknown = sorted(set(names) - set(REMAT_NAMES))
        if unknown:  # config.validate says this first; kept for models built without it
            raise ValueError(f"model.remat={remat!r}: unknown names {unknown}; choose from {REMAT_NAMES}")
        return jax.checkpoint_policies.save_only_these_names(*names)
    return REMAT_POLICIES[remat]


def remat_block(block_cls, m: ModelConfig):
    """`block_cls` under `model.remat`'s block policy, or as is for "none" and for
    "elementwise" (which recomputes inside the block: `layer_norm`, `mlp`)."""
    if m.remat in ("none", "elementwise"):
        return block_cls
    return nn.remat(block_cls, policy=remat_policy(m.remat))


def dtypes(m: ModelConfig):
    """(compute dtype, parameter dtype) of a model config."""
    return DTYPES[m.dtype], DTYPES[m.param_dtype]


def _init(init, names):
    return nn.with_logical_partitioning(init, names)


def repeat_kv_heads(x_BLGD, num_heads: int):
    """[B, L, G, D] key/value heads -> [B, L, H, D], head h holding group h // (H / G)
    (grouped-query attention); the array itself where G = H."""
    G = x_BLGD.shape[2]
    return x_BLGD if G == num_heads else jnp.repeat(x_BLGD, num_heads // G, axis=2)


ROPE_BASE = 10000.0  # RoPE's theta (Su et al. 2021)


def rotary(x_BLHD, pos_BL, *, base: float = ROPE_BASE):
    """Rotary position embedding (RoPE, Su et al. 2021): each pair of dims of each head is
    rotated by the angle pos * base^(-2r/D), r = 0..D/2-1. The one idea: a query rotated by m
    and a key rotated by n meet in the dot product as a rotation by m - n, so attention sees
    only relative positions and no table bounds the length.

    Layout "rotate-half" (GPT-NeoX; Hugging Face's LLaMA): dim r pairs with dim r + D/2 (the
    paper's interleaved layout pairs 2r with 2r + 1; the two are the same function up to a
    fixed permutation of the projections' output dims). Computed in float32, returned in x's
    dtype. `pos_BL` is each token's position: per segment under packing, the cache's
    positions when decoding."""
    D = x_BLHD.shape[-1]
    R = D // 2
    inv_R = base ** (-np.arange(R, dtype=np.float64) * 2 / D)  # frequencies, in float64
    inv_11R = jnp.asarray(inv_R, jnp.float32)[None, None]
    ang_BL1R = (pos_BL.astype(jnp.float32)[..., None] * inv_11R)[:, :, None]
    cos_BL1R, sin_BL1R = jnp.cos(ang_BL1R), jnp.sin(ang_BL1R)
    xf_BLHD = x_BLHD.astype(jnp.float32)
    x1_BLHR, x2_BLHR = xf_BLHD[..., :R], xf_BLHD[..., R:]
    out_BLHD = jnp.concatenate([x1_BLHR * cos_BL1R - x2_BLHR * sin_BL1R,
                                x2_BLHR * cos_BL1R + x1_BLHR * sin_BL1R], axis=-1)
    return out_BLHD.astype(x_BLHD.dtype)


def _need_positions(pos_BL) -> None:
    if pos_BL is None:
        raise ValueError("model.pos_emb='rope' rotates queries and keys by position; "
                         "pass the tokens' positions pos_BL to the attention block")


class MultiHeadAttention(nn.Module):
    """Fused QKV projection, a registry attention variant, output projection.

    In decode mode it keeps the variant's cache in the `cache` collection and consumes
    one token per call.

    With `model.num_kv_heads` G below H (grouped-query attention; G = 1: multi-query) the
    queries come from `q` [E, H, D] and the keys and values from `kv` [E, 2, G, D]; query head
    h reads key/value head h // (H / G). The variant sees every head's keys and values (each
    group's repeated), so every variant runs it; decoding with the exact key/value cache
    keeps only the G heads (the cache and the time each step reads it shrink H / G times),
    other variants' caches hold the repeated heads.

    With `model.pos_emb = "rope"` the queries and the G key heads are rotated (`rotary`) at
    `pos_BL` after the projection, before the heads are repeated, cached or handed to the
    variant: every variant and every decode cache then sees rotated keys (the exact cache
    stores them; decoding passes the cache's positions as `pos_BL`).

    With `model.kv_latent_dim` (multi-head latent attention) every head's keys and values
    are expanded from one latent per token, and decoding caches only the latent (`_latent`).
    """

    model: ModelConfig
    attention: AttentionConfig
    causal: bool
    deterministic: bool = True
    decode: bool = False

    @nn.compact
    def __call__(self, x_BLE, seg_BL, pos_BL=None):
        m = self.model
        dt, pdt = dtypes(m)
        H, D, G = m.num_heads, m.dims_per_head(), m.kv_heads()

        # Explicit kernels (not DenseGeneral, which flattens multi-axis kernels and so
        # loses their logical axis names), each [E, ...] with E its fan-in.
        def projection(name: str, spec: str, shape: tuple, names: tuple):
            init = nn.initializers.lecun_normal(in_axis=0, out_axis=tuple(range(1, len(shape))))
            w = param(self, name, _init(init, names), shape, pdt)
            return checkpoint_name(qeinsum(self, name, spec, x_BLE, w, m.quant, kind="qkv",
                                           dtype=dt), "qkv")

        attn = attention_lib.get(self.attention.name)(**dict(self.attention.options), name="attn")
        if m.kv_latent_dim:
            q_BLHD, k_BLGD, v_BLGD = self._latent(x_BLE, pos_BL, projection, attn)
            if k_BLGD is None:  # the absorbed decode step's output
                return self._out(q_BLHD)
        elif G == H:
            qkv_BL3HD = projection("qkv", "ble,ekhd->blkhd", (m.width, 3, H, D),
                                   ("embed", None, "heads", "kv"))
            q_BLHD, k_BLGD, v_BLGD = (qkv_BL3HD[:, :, i] for i in range(3))
        else:
            q_BLHD = projection("q", "ble,ehd->blhd", (m.width, H, D), ("embed", "heads", "kv"))
            kv_BL2GD = projection("kv", "ble,ekgd->blkgd", (m.width, 2, G, D),
                                  ("embed", None, "kv_heads", "kv"))
            k_BLGD, v_BLGD = kv_BL2GD[:, :, 0], kv_BL2GD[:, :, 1]
        if m.pos_emb == "rope" and not m.kv_latent_dim:
            _need_positions(pos_BL)
            q_BLHD, k_BLGD = rotary(q_BLHD, pos_BL), rotary(k_BLGD, pos_BL)
        if m.quant.kv_cache == "int8" and not self.decode and not m.kv_latent_dim:
            # keys and values as an int8 cache holds them (straight-through gradients), so the
            # forward pass computes what decoding through that cache computes
            k_BLGD, v_BLGD = (fake_quant(x, "int8", axes=(3,)) for x in (k_BLGD, v_BLGD))
        k_BLHD, v_BLHD = repeat_kv_heads(k_BLGD, H), repeat_kv_heads(v_BLGD, H)
        if self.decode:
            B = x_BLE.shape[0]
            # the exact cache keeps the G heads (its decode step reads each for its H / G
            # query heads); a variant's own cache, the repeated H
            grouped = attn.exact_cache()
            initialized = self.has_variable("cache", "state")
            cache = self.variable("cache", "state", attn.init_cache, B, m.max_len,
                                  G if grouped else H, D,
                                  jnp.int8 if m.quant.kv_cache == "int8" else dt)
            if initialized:
                out_BLHD, cache.value = attn.decode_step(
                    cache.value, q_BLHD, *((k_BLGD, v_BLGD) if grouped else (k_BLHD, v_BLHD)))
            else:  # shapes only, during init
                out_BLHD = attn(q_BLHD, k_BLHD, v_BLHD, None, causal=True, deterministic=True)
        else:
            out_BLHD = attn(q_BLHD, k_BLHD, v_BLHD, seg_BL, causal=self.causal,
                            deterministic=self.deterministic)
            want = (*q_BLHD.shape[:3], v_BLHD.shape[-1])  # [B, L, H, the values' D]
            if tuple(out_BLHD.shape) != want:  # a bug hunt (session 96): a registered variant
                # of another output shape failed in the output projection's dot_general
                raise ValueError(f"attention variant {self.attention.name!r} returned an "
                                 f"output of shape {tuple(out_BLHD.shape)}; it must return "
                                 f"[B, L, H, D] = {want} (the queries' and the values' D)")
        return self._out(out_BLHD)

    def _out(self, out_BLHD):
        m = self.model
        dt, pdt = dtypes(m)
        out_BLHD = checkpoint_name(out_BLHD, "context")
        H, D = m.num_heads, m.dims_per_head()
        w_HDE = param(self, "out", _init(nn.initializers.lecun_normal(in_axis=(0, 1), out_axis=2),
                                        ("heads", "kv", "embed")), (H, D, m.width), pdt)
        return checkpoint_name(qeinsum(self, "out", "blhd,hde->ble", out_BLHD, w_HDE, m.quant,
                                       kind="out", dtype=dt), "attention_out")

    def _latent(self, x_BLE, pos_BL, projection, attn):
        """Multi-head latent attention (`model.kv_latent_dim` C; DeepSeek-AI 2024): (q, k, v)
        [B, L, H, D] for the variant, or (the heads' outputs, None, None) where a decode step
        read the latent cache itself.

        Queries as multi-head's, `q` [E, H, D]. `kv_down` [E, C + R] projects each token to
        the latent c [C] (then `kv_norm`, a LayerNorm, unless `model.kv_latent_norm` is off)
        and, under RoPE, one R-dim key shared by every head (rotated at the token's
        position). Head h's key is [c k_up[:, h] (D - R dims) ; the rotary key (R)], its
        value c v_up[:, h] (D), and its query's last R dims are rotated likewise: every
        variant sees [B, L, H, D] as usual.

        Decoding through the exact key/value cache caches only the row [c ; rotary key]
        (C + R numbers per position) and reads it absorbed: q_h . k_h = (k_up[:, h] q_h) . c
        + q_rot . k_rot, so head h's query becomes [k_up[:, h] q_h ; q_rot] (C + R dims) and
        every head attends to the one cached row (a multi-query cache whose rows are keys
        and values both: `shared_kv`); its output's first C dims times v_up[:, h] are head
        h's weighted sum of values. The same numbers summed in another order: the decode
        steps equal the forward pass to float rounding (tests/test_latent_attention.py).
        Variants with caches of their own decode the expanded keys and values."""
        m = self.model
        dt, pdt = dtypes(m)
        H, D, C, R = m.num_heads, m.dims_per_head(), m.kv_latent_dim, m.latent_rope_dims()
        q_BLHD = projection("q", "ble,ehd->blhd", (m.width, H, D), ("embed", "heads", "kv"))
        down_BLX = projection("kv_down", "ble,ex->blx", (m.width, C + R), ("embed", None))
        c_BLC = down_BLX[..., :C]
        if m.kv_latent_norm:
            c_BLC = LayerNorm(dtype=dt, param_dtype=pdt, name="kv_norm",
                              scale_init=_init(nn.initializers.ones, (None,)),
                              bias_init=_init(nn.initializers.zeros, (None,)))(c_BLC)
        kr_BLR = down_BLX[..., C:]
        if R:
            _need_positions(pos_BL)
            q_BLHD = jnp.concatenate([q_BLHD[..., :D - R], rotary(q_BLHD[..., D - R:], pos_BL)],
                                     -1)
            kr_BLR = rotary(kr_BLR[:, :, None], pos_BL)[:, :, 0]
        row_BL1X = jnp.concatenate([c_BLC.astype(dt), kr_BLR.astype(dt)], -1)[:, :, None]
        if m.quant.kv_cache == "int8" and not self.decode:
            # the row as an int8 cache holds it (straight-through), as `__call__` does k, v
            row_BL1X = fake_quant(row_BL1X, "int8", axes=(3,))
        up = nn.initializers.lecun_normal(in_axis=0, out_axis=(1, 2))
        w_CHd = self.param("k_up", _init(up, (None, "heads", None)), (C, H, D - R), pdt).astype(dt)
        w_CHD = self.param("v_up", _init(up, (None, "heads", "kv")), (C, H, D), pdt).astype(dt)
        if self.decode and attn.exact_cache():
            initialized = self.has_variable("cache", "state")
            cache = self.variable("cache", "state", attn.init_cache, x_BLE.shape[0], m.max_len,
                                  1, C + R, jnp.int8 if m.quant.kv_cache == "int8" else dt,
                                  shared_kv=True)
            if initialized:
                # in float32, rounded to the compute dtype once: the cache's attention scales
                # scores by 1 / sqrt(C + R), the model's are 1 / sqrt(D)
                qa_BLHC = jnp.einsum("blhd,chd->blhc", q_BLHD[..., :D - R], w_CHd,
                                     preferred_element_type=jnp.float32)
                q_BLHX = (jnp.concatenate([qa_BLHC, q_BLHD[..., D - R:].astype(jnp.float32)], -1)
                          * np.float32(np.sqrt((C + R) / D))).astype(dt)
                o_BLHX, cache.value = attn.decode_step(cache.value, q_BLHX, row_BL1X, None)
                return jnp.einsum("blhc,chd->blhd", o_BLHX[..., :C], w_CHD,
                                  preferred_element_type=jnp.float32).astype(dt), None, None
        c_BLC, kr_BLR = row_BL1X[:, :, 0, :C], row_BL1X[:, :, 0, C:]
        k_BLHD = jnp.einsum("blc,chd->blhd", c_BLC, w_CHd)
        if R:
            k_BLHD = jnp.concatenate(
                [k_BLHD, jnp.broadcast_to(kr_BLR[:, :, None], (*kr_BLR.shape[:2], H, R))], -1)
        v_BLHD = jnp.einsum("blc,chd->blhd", c_BLC, w_CHD)
        if self.decode and attn.exact_cache():  # shapes only, during init
            return attn(q_BLHD, k_BLHD, v_BLHD, None, causal=True, deterministic=True), None, None
        return q_BLHD, k_BLHD, v_BLHD


class LayerNorm(nn.LayerNorm):
    """flax's `nn.LayerNorm` over the last axis (the same fields, parameters, statistics in
    float32 and forward values) whose backward is `_layer_norm`'s: the scale and bias
    gradients, sums over every token, are matrix-vector products, where autodiff's
    reductions ran on XLA:CPU as slow reduce-window trees. Other axes, masks or a mapped
    axis name are flax's own code."""

    @nn.compact
    def __call__(self, x, *, mask=None):
        if (mask is not None or self.axis_name is not None or self.reduction_axes != -1
                or self.feature_axes != -1 or not (self.use_bias and self.use_scale
                                                    and self.use_fast_variance)):
            return super().__call__(x, mask=mask)
        E = x.shape[-1]
        scale = self.param("scale", self.scale_init, (E,), self.param_dtype)
        bias = self.param("bias", self.bias_init, (E,), self.param_dtype)
        dtype = jax.dtypes.canonicalize_dtype(jnp.result_type(x, scale, bias)
                                              if self.dtype is None else self.dtype)
        return _layer_norm(x, scale, bias, self.epsilon, dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _layer_norm(x, scale, bias, epsilon: float, dtype):
    return _layer_norm_fwd(x, scale, bias, epsilon, dtype)[0]


def _layer_norm_fwd(x, scale, bias, epsilon, dtype):
    # flax's arithmetic, in its order: float32 statistics, E[x^2] - E[x]^2 clipped at 0
    xf = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    mu = jnp.mean(xf, -1, keepdims=True)
    var = jnp.maximum(0.0, jnp.mean(jax.lax.square(xf), -1, keepdims=True) - jax.lax.square(mu))
    rstd = jax.lax.rsqrt(var + epsilon)
    row = (1,) * (x.ndim - 1) + (-1,)  # a feature vector against [..., E]
    y = (x - mu) * (rstd * scale.reshape(row)) + bias.reshape(row)
    return jnp.asarray(y, dtype), (x, mu, rstd, scale, bias)


def _layer_norm_bwd(epsilon, dtype, res, g):
    del epsilon, dtype
    x, mu, rstd, scale, bias = res
    gf = g.astype(mu.dtype)
    xhat = (x - mu) * rstd
    gs = gf * scale.astype(mu.dtype).reshape((1,) * (x.ndim - 1) + (-1,))
    dx = rstd * (gs - jnp.mean(gs, -1, keepdims=True)
                 - xhat * jnp.mean(gs * xhat, -1, keepdims=True))
    E = x.shape[-1]
    ones = jnp.ones((x.size // E,), mu.dtype)

    def col_sums(a):  # sum over every token, as a product
        return jax.lax.dot_general(ones, a.reshape(-1, E), (((0,), (0,)), ((), ())))
    return (dx.astype(x.dtype), col_sums(gf * xhat).astype(scale.dtype),
            col_sums(gf).astype(bias.dtype))


_layer_norm.defvjp(_layer_norm_fwd, _layer_norm_bwd)


class Dropout(nn.Module):
    """flax's `nn.Dropout` (the same mask from the same key: its name too is Dropout_N), its
    kept values scaled by 1/(1-p) in float32 and rounded once each to a narrower dtype (a
    review, session 117: in bfloat16 the divisor 0.9 was 0.8984375, every kept value 1.113x
    for 1.111x, the sublayers' outputs 0.17% larger in training than at eval, as
    `hpnlp.rnn.dropout` had been). In float32 it computes flax's, bit for bit."""
    rate: float
    deterministic: bool | None = None

    def __call__(self, x, deterministic: bool | None = None):
        deterministic = nn.merge_param("deterministic", self.deterministic, deterministic)
        if self.rate == 0.0 or deterministic:
            return x
        keep = 1.0 - self.rate
        mask = jax.random.bernoulli(self.make_rng("dropout"), p=keep, shape=x.shape)
        wide = jnp.promote_types(x.dtype, jnp.float32)
        return jax.lax.select(mask, (x.astype(wide) / keep).astype(x.dtype), jnp.zeros_like(x))


def layer_norm(m: ModelConfig, name: str) -> nn.LayerNorm:
    dt, pdt = dtypes(m)
    cls = nn.remat(LayerNorm) if m.remat == "elementwise" else LayerNorm
    return cls(dtype=dt, param_dtype=pdt, name=name,
                        scale_init=_init(nn.initializers.ones, ("embed",)),
                        bias_init=_init(nn.initializers.zeros, ("embed",)))


def mlp(m: ModelConfig, h_BLE, *, width: int | None = None, name: str = "mlp"):
    """Dense -> gelu -> Dense of hidden width `width` (default model.mlp_dim). Call it inside
    a compact method: it creates the `<name>_in` and `<name>_out` layers in the caller (so
    Block, the reversible blocks and MoE's shared experts share it)."""
    dt, pdt = dtypes(m)
    # gelu after the bias: the int8 kernel applies it in its own pass (served w8a8); the
    # pre-activation is saved as "mlp_in" (gelu is cheap to recompute)
    act = Epilogue("gelu", save_as="mlp_in", remat=m.remat == "elementwise")
    h_BLF = Dense(width or m.mlp_dim, quant=m.quant, dtype=dt, param_dtype=pdt, name=f"{name}_in",
                  kernel_init=_init(nn.initializers.lecun_normal(), ("embed", "mlp")),
                  bias_init=_init(nn.initializers.zeros, ("mlp",)), epilogue=act)(h_BLE)
    h_BLF = nn.with_logical_constraint(h_BLF, ("batch", "length", "activation_mlp"))
    h_BLE = Dense(m.width, quant=m.quant, dtype=dt, param_dtype=pdt, name=f"{name}_out",
                     kernel_init=_init(nn.initializers.lecun_normal(), ("mlp", "embed")),
                     bias_init=_init(nn.initializers.zeros, ("embed",)))(h_BLF)
    return h_BLE


def feed_forward(m: ModelConfig, h_BLE, seg_BL, *, index: int, deterministic: bool,
                 decode: bool):
    """Block `index`'s feed-forward sublayer: the dense `mlp`, or in the blocks `model.moe`
    names a mixture of experts (hpnlp.moe), created in the caller as "moe"."""
    if m.moe.applies(index):
        from hpnlp.moe.layer import MoE
        return MoE(m, deterministic, decode, name="moe")(h_BLE, seg_BL)
    return mlp(m, h_BLE)


class Block(nn.Module):
    """x + Attn(LN(x)), then x + MLP(LN(x)) (pre-LN: trains without warmup tricks).

    Activations tagged for `model.remat = "names:..."` (`jax.ad_checkpoint.checkpoint_name`;
    config.REMAT_NAMES), per block:
      qkv [B, L, 3, H, D]    the fused Q/K/V projection
      context [B, L, H, D]   the attention variant's output, before the output projection
      attention_out [B, L, E] the attention sublayer's output (after the output projection)
      mlp_in [B, L, F]       the MLP's first Dense, before gelu
    e.g. "names:qkv,mlp_in" keeps the two big projections and recomputes the attention
    scores, norms and gelu in the backward pass. The block input is always saved. (The MLP's
    output has no name: the backward never needs it, only its sum with the residual.)
    `model.remat = "elementwise"` is not a block policy: the backward pass recomputes the two
    layer norms and gelu from their inputs (`layer_norm`, `mlp`), which frees their own
    residuals (the norms' statistics, gelu's temporaries); their outputs are the next
    products' inputs, which those products keep (a review, session 116: said to be freed).
    """

    model: ModelConfig
    attention: AttentionConfig
    causal: bool
    deterministic: bool = True
    decode: bool = False
    index: int = 0  # which block (model.moe picks its MoE blocks by it)

    @nn.compact
    def __call__(self, x_BLE, seg_BL, pos_BL=None):
        """`pos_BL`: the tokens' positions, which only `model.pos_emb = "rope"` reads."""
        m = self.model
        drop = functools.partial(Dropout, rate=m.dropout, deterministic=self.deterministic)
        # PTQ calibration ranges over real tokens only (padding, segment 0, left out)
        with calibration_mask(self, None if seg_BL is None else seg_BL > 0):
            h_BLE = MultiHeadAttention(m, self.attention, self.causal, self.deterministic,
                                       self.decode, name="attention")(
                layer_norm(m, "norm1")(x_BLE), seg_BL, pos_BL)
            x_BLE = x_BLE + drop()(h_BLE)
            x_BLE = x_BLE + drop()(feed_forward(m, layer_norm(m, "norm2")(x_BLE), seg_BL,
                                                index=self.index,
                                                deterministic=self.deterministic,
                                                decode=self.decode))
        return nn.with_logical_constraint(x_BLE, ("batch", "length", "activation_embed"))


def sinusoidal_table(length: int, width: int) -> np.ndarray:
    pos = np.arange(length)[:, None]
    inv = 1.0 / (10000 ** (np.arange(0, width, 2) / width))
    table = np.zeros((length, width), np.float32)
    table[:, 0::2] = np.sin(pos * inv)
    table[:, 1::2] = np.cos(pos * inv)[:, : width // 2]
    return table


class Trunk(nn.Module):
    """Token + position embeddings, `depth` blocks, final LayerNorm -> hidden [B, L, E].

    `embed` is passed in (not created here) so that a tied output layer can share it.
    `model.pos_emb`: "learned" and "sinusoidal" add a table row per position to the token
    embeddings; "rope" adds nothing and hands `pos_BL` to every block, whose attention
    rotates its queries and keys (`rotary`).
    """

    model: ModelConfig
    attention: AttentionConfig
    causal: bool
    deterministic: bool = True
    decode: bool = False

    @nn.compact
    def __call__(self, embed: nn.Module, tokens_BL, seg_BL, pos_BL):
        m = self.model
        dt, pdt = dtypes(m)
        x_BLE = (embed_tokens(embed, tokens_BL, seg_BL).astype(dt)
                 * jnp.asarray(np.sqrt(m.width), dt))
        if m.pos_emb == "learned":
            table_TE = self.param("pos_embedding", _init(nn.initializers.normal(0.02), (None, "embed")),
                                  (m.max_len, m.width), pdt)
        elif m.pos_emb == "sinusoidal":  # positions < L in a row, < max_len in a cache
            table_TE = jnp.asarray(sinusoidal_table(max(m.max_len, tokens_BL.shape[1]), m.width))
        if m.pos_emb != "rope":
            x_BLE = x_BLE + jnp.take(table_TE, pos_BL, axis=0).astype(dt)
        block_pos_BL = pos_BL if m.pos_emb == "rope" else None
        x_BLE = Dropout(m.dropout, deterministic=self.deterministic)(x_BLE)
        x_BLE = nn.with_logical_constraint(x_BLE, ("batch", "length", "activation_embed"))
        block_cls = remat_block(Block, m)
        if m.reversible:  # backward recomputes block inputs from outputs (models/reversible.py)
            from hpnlp.models.reversible import ReversibleStack  # it imports this module
            x_BLE = ReversibleStack(m, self.attention, self.causal, self.deterministic, self.decode,
                                    name="reversible")(x_BLE, seg_BL, block_pos_BL)
        elif m.stack_layers:  # one [depth, ...] tree: nn.scan, or GPipe stages over `pipeline`
            from hpnlp.parallel import pipeline
            make = functools.partial(block_cls, m, self.attention, self.causal, self.deterministic,
                                     self.decode)
            x_BLE = pipeline.stacked_blocks(self, make, x_BLE, seg_BL, depth=m.depth,
                                            decode=self.decode, pos_BL=block_pos_BL)
        else:
            for i in range(m.depth):
                x_BLE = block_cls(m, self.attention, self.causal, self.deterministic, self.decode,
                                  index=i, name=f"block_{i}")(x_BLE, seg_BL, block_pos_BL)
        return LayerNorm(dtype=dt, param_dtype=pdt, name="final_norm",
                         scale_init=_init(nn.initializers.ones, ("embed",)),
                         bias_init=_init(nn.initializers.zeros, ("embed",)))(x_BLE)


@jax.custom_vjp
def scaled_take(table_VE, ids, row_weight_V):
    """`table_VE[ids]`, whose gradient into row v is multiplied by `row_weight_V[v]` (no
    gradient flows to `row_weight_V` or `ids`)."""
    return jnp.take(table_VE, ids, axis=0)


def _scaled_take_fwd(table_VE, ids, row_weight_V):
    like = jnp.zeros((), table_VE.dtype)  # residuals must be arrays: the table's dtype
    return jnp.take(table_VE, ids, axis=0), (ids, row_weight_V, like)


def _scaled_take_bwd(res, g):
    ids, w_V, like = res
    g_NE = g.reshape(-1, g.shape[-1]).astype(jnp.float32)
    grad_VE = jnp.zeros((w_V.shape[0], g.shape[-1]), jnp.float32).at[ids.reshape(-1)].add(g_NE)
    return (grad_VE * w_V[:, None]).astype(like.dtype), None, None


scaled_take.defvjp(_scaled_take_fwd, _scaled_take_bwd)


def batch_count_weights(ids, vocab_size: int, valid=None):
    """PyTorch's `scale_grad_by_freq`: 1 / (count of each id among `ids`), 1 for absent ids.
    `valid` (ids' shape, bool): count only those slots; padding holds id 0, a real token's
    id in most vocabularies (a review, session 103: counted, the amount of padding scaled
    the gradient of id 0's row)."""
    one = jnp.ones(ids.shape, jnp.float32) if valid is None else valid.astype(jnp.float32)
    counts_V = jnp.zeros((vocab_size,), jnp.float32).at[ids.reshape(-1)].add(one.reshape(-1))
    return 1.0 / jnp.maximum(counts_V, 1.0)


@dataclasses.dataclass(frozen=True, eq=False)
class RowWeights:
    """A [V] table of per-id gradient weights, held by a Module field (hashed by identity)."""

    weights: np.ndarray


def corpus_count_weights(counts_V, tokens_per_batch: int) -> np.ndarray:
    """The fixed-table twin of `batch_count_weights`: 1 / max(1, the id's expected count in a
    batch of `tokens_per_batch` tokens drawn at the corpus frequencies `counts_V`)."""
    c = np.asarray(counts_V, np.float64)
    expected = c * tokens_per_batch / max(c.sum(), 1.0)
    return (1.0 / np.maximum(expected, 1.0)).astype(np.float32)


class Embed(nn.Embed):
    """`nn.Embed` whose table may be quantized: when it is the tied output layer's weight
    (`quant.layers` has "output"), lookups read the same quantized rows the output
    product uses (fake-quantized in training, decoded from a packed QWeight after PTQ).

    `grad_scale` ("none" | "batch" | "corpus", `model.embed_grad_scale`) scales each row's
    gradient by token frequency (`scaled_take`): "batch" divides it by the id's count among
    this call's real ids (`valid`: the slots that are not padding; all when None), PyTorch's
    `scale_grad_by_freq` with padding left out (a call sees one microbatch under
    train.grad_accum, so a new run refuses the two together: `config.checks.check_new_run`);
    "corpus" by `row_weights` (a fixed table, `corpus_count_weights`)."""

    quant_rows: bool = False  # set by make_embed for a tied, quantized table
    quant: Any = None
    grad_scale: str = "none"
    row_weights: Any = None  # RowWeights ("corpus")

    def setup(self):
        self.embedding = param(self, "embedding", self.embedding_init,
                               (self.num_embeddings, self.features), self.param_dtype)

    def __call__(self, inputs, valid=None):
        from hpnlp.compress.qlinear import (Factored, float_product, note_product, quant_rows,
                                             quantizes_rows)
        note_product(self, "embedding", "embed", (1,))  # [V, E]: a one-hot product's table
        if isinstance(self.embedding, Factored):  # model.lowrank: A [V, r] rows, then B [r, E]
            f = self.embedding
            rows = jnp.take(f.u, inputs, axis=0).astype(self.dtype)
            return float_product(rows, f.v.astype(self.dtype), None, 1)
        # a quantized table's looked-up rows are quantized after the lookup where they are
        # fewer than its rows (`quant_rows`: the same values and gradients, at their cost)
        rows_first = quantizes_rows(self.embedding, self.quant_rows, inputs.size, self)
        table_VE = self.embedding if rows_first else self.table()
        if self.grad_scale == "batch":
            out = scaled_take(table_VE, inputs,
                              batch_count_weights(inputs, self.num_embeddings, valid))
        elif self.grad_scale == "corpus":
            out = scaled_take(table_VE, inputs, jnp.asarray(self.row_weights.weights, jnp.float32))
        else:
            out = jnp.take(table_VE, inputs, axis=0)
        if rows_first:
            out = quant_rows(out, self.quant)
        return out.astype(self.dtype)

    def table(self):
        """The [V, E] table as the model uses it (quantized rows where configured)."""
        from hpnlp.compress.qlinear import Factored, QWeight, Served, quant_weight
        if isinstance(self.embedding, (QWeight, Served)):  # packed as [E, V]: contraction first
            return self.embedding.dequantize().T
        if isinstance(self.embedding, Factored):
            return self.embedding.dense()
        if self.quant_rows:
            return quant_weight(self.embedding.T, 1, self.quant, self, "embedding").T
        return self.embedding


def embed_tokens(embed, tokens_BL, seg_BL):
    """`embed`'s rows of `tokens_BL`; an `Embed` also gets the real slots (seg > 0), which
    its "batch" gradient scale counts. Any other module or callable of the tokens alone (a
    test's identity, a user's own) is called with the tokens alone."""
    if isinstance(embed, Embed):
        return embed(tokens_BL, seg_BL > 0)
    return embed(tokens_BL)


def make_embed(m: ModelConfig, name: str = "embed", *, tied: bool = False,
               grad_weights=None) -> nn.Embed:
    """The input embedding of `m`; `grad_weights` (RowWeights, made by `models.build`) is the
    fixed table of `model.embed_grad_scale = "corpus"`."""
    dt, pdt = dtypes(m)
    if m.embed_grad_scale == "corpus" and grad_weights is None:
        raise ValueError("model.embed_grad_scale='corpus' needs the task's train token counts, and "
                         "this model was built without them; pass token_counts to models.build "
                         "(a task with token_counts) or use model.embed_grad_scale='batch'")
    # std 1/sqrt(E), scaled up by sqrt(E) on input: unit-scale inputs, O(1) tied logits.
    return Embed(m.vocab_size, m.width, dtype=dt, param_dtype=pdt, name=name,
                 quant_rows=tied and m.quant.applies("output") and m.quant.weights != "none",
                 quant=m.quant, grad_scale=m.embed_grad_scale,
                 row_weights=grad_weights if m.embed_grad_scale == "corpus" else None,
                 embedding_init=_init(nn.initializers.normal(m.width ** -0.5), ("vocab", "embed")))


def positions_of(seg_BL) -> Any:
    return jnp.broadcast_to(jnp.arange(seg_BL.shape[1], dtype=jnp.int32), seg_BL.shape)
