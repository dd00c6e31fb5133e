"""Reversible residual blocks: activation memory that does not grow with depth.

RevNet (Gomez et al. 2017), as the Reformer uses it (Kitaev et al. 2020). The residual
stream is two halves, and block i maps (x1, x2) -> (y1, y2):

    y1 = x1 + F(x2)        F = dropout(attention(LN(.)))   (the same sublayers as `Block`)
    y2 = x2 + G(y1)        G = dropout(MLP(LN(.)))

The one idea: the map inverts exactly, x2 = y2 - G(y1) and x1 = y1 - F(x2), so the backward
pass recomputes each block's inputs from its outputs instead of storing them. A
`jax.custom_vjp` over the whole stack keeps only the last block's outputs; the backward
walks the blocks in reverse and rebuilds one block's activations at a time, so activation
memory is one block's, not `depth` blocks'. The price: F and G run once more per block
(the forward work done inside each inversion doubles as the recompute for its gradient).

Choices (Trax's Reformer does the first; we differ on the second):
- The input is duplicated, x1 = x2 = embeddings (Trax `tl.Dup`).
- The output is the mean (y1 + y2) / 2. Trax concatenates [y1, y2] (width 2E) before the
  final norm; the mean keeps width E, so tied embeddings and every output layer work as is.
- The two streams stay in float32 whatever model.dtype; F and G compute in model.dtype. The
  inversion subtracts what the forward added, so its error is the stream's rounding (a
  bfloat16 stream would lose ~3 significant digits per block).
- Dropout and random features: every F and G gets its own `dropout` / `features` keys,
  passed in explicitly, so the recompute in the backward draws the same masks and features.
- Padding and causality: F calls the same attention with the same segment ids (and, for
  model.pos_emb = "rope", the same positions: the halves' `seg` argument is the pair).
- Discrete routing: x2 = y2 - G(y1) equals the forward's x2 only to rounding, and a variant
  that chooses from its input (`lsh` buckets, `clustered` clusters) may choose otherwise on
  it (a bug hunt (session 100): in bfloat16, 155 of 4096 LSH buckets moved at L=512, depth
  6). The forward applies F with the variant's
  `routing` collection mutable and keeps what it stores (small integer arrays, e.g. the LSH
  sort permutation [B, H, R, L]) as residuals; the backward passes them back, so F is
  replayed with the forward's buckets (Trax keeps them in its layers' state likewise).

Shape letters as in `transformer.py`.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from hpnlp.attention.base import ROUTING
from hpnlp.config import AttentionConfig, ModelConfig
from hpnlp.models.transformer import Dropout, MultiHeadAttention, layer_norm, mlp

# Random streams a block may draw from (dropout; attention variants' random features).
RNG_STREAMS = ("dropout", "features")


class AttentionHalf(nn.Module):
    """F(x) = dropout(attention(LN(x))): the first half of a reversible block."""

    model: ModelConfig
    attention: AttentionConfig
    causal: bool
    deterministic: bool = True
    decode: bool = False

    @nn.compact
    def __call__(self, x_BLE, seg_BL, pos_BL=None):
        m = self.model
        h_BLE = MultiHeadAttention(m, self.attention, self.causal, self.deterministic, self.decode,
                                   name="attention")(layer_norm(m, "norm")(x_BLE), seg_BL, pos_BL)
        h_BLE = Dropout(m.dropout, deterministic=self.deterministic)(h_BLE)
        return nn.with_logical_constraint(h_BLE.astype(jnp.float32),
                                          ("batch", "length", "activation_embed"))


class MlpHalf(nn.Module):
    """G(x) = dropout(MLP(LN(x))): the second half of a reversible block."""

    model: ModelConfig
    deterministic: bool = True

    @nn.compact
    def __call__(self, x_BLE):
        m = self.model
        h_BLE = mlp(m, layer_norm(m, "norm")(x_BLE))
        h_BLE = Dropout(m.dropout, deterministic=self.deterministic)(h_BLE)
        return nn.with_logical_constraint(h_BLE.astype(jnp.float32),
                                          ("batch", "length", "activation_embed"))


# A half as a pure function: (its params, input [B, L, E], (segment ids, positions) [B, L] each,
# rngs) -> output [B, L, E] float32. They go in as an argument, not a closure, so `custom_vjp`
# sees them (positions are None but for model.pos_emb = "rope"). An F half takes one more
# argument, its routing (None: choose it) and returns (output, the routing it used).
HalfFn = Callable[..., Any]


def _forward(fs: list[HalfFn], gs: list[HalfFn], params, x1_BLE, x2_BLE, seg_BL, rngs):
    """`plain_stack`, and every F's routing (for `reversible_stack`'s backward)."""
    routings = []
    for f, g, (pf, pg), (rf, rg) in zip(fs, gs, params, rngs):
        f_BLE, routing = f(pf, x2_BLE, seg_BL, rf, None)
        routings.append(routing)
        x1_BLE = x1_BLE + f_BLE
        x2_BLE = x2_BLE + g(pg, x1_BLE, seg_BL, rg)
    return x1_BLE, x2_BLE, routings


def plain_stack(fs: list[HalfFn], gs: list[HalfFn], params, x1_BLE, x2_BLE, seg_BL, rngs):
    """The reversible forward; differentiated by plain autodiff it is the exact twin of
    `reversible_stack` (same outputs, same gradients, but every block's activations kept).
    params[i] = (F params, G params); rngs[i] = (F rngs, G rngs)."""
    return _forward(fs, gs, params, x1_BLE, x2_BLE, seg_BL, rngs)[:2]


def reversible_stack(fs: list[HalfFn], gs: list[HalfFn]):
    """`plain_stack` with a backward pass that inverts the blocks instead of storing them."""

    @jax.custom_vjp
    def stack(params, x1_BLE, x2_BLE, seg_BL, rngs):
        return plain_stack(fs, gs, params, x1_BLE, x2_BLE, seg_BL, rngs)

    def fwd(params, x1_BLE, x2_BLE, seg_BL, rngs):
        y1_BLE, y2_BLE, routings = _forward(fs, gs, params, x1_BLE, x2_BLE, seg_BL, rngs)
        # Only the outputs (and F's integer routing): every earlier activation is rebuilt
        # from them in `bwd`.
        return (y1_BLE, y2_BLE), (params, y1_BLE, y2_BLE, seg_BL, rngs, routings)

    def bwd(res, cotangents):
        params, y1_BLE, y2_BLE, seg_BL, rngs, routings = res
        dy1_BLE, dy2_BLE = cotangents
        dparams = [None] * len(params)
        for i in reversed(range(len(params))):
            (pf, pg), (rf, rg) = params[i], rngs[i]
            # G: y2 = x2 + G(y1). One forward of G both inverts it and linearizes it.
            g_BLE, g_vjp = jax.vjp(lambda p, h: gs[i](p, h, seg_BL, rg), pg, y1_BLE)
            x2_BLE = y2_BLE - g_BLE
            dpg, dh_BLE = g_vjp(dy2_BLE)
            dy1_BLE = dy1_BLE + dh_BLE  # the total cotangent of y1 (direct + through G)
            # F: y1 = x1 + F(x2), routed as in the forward (x2 is the forward's to rounding).
            f_BLE, f_vjp = jax.vjp(lambda p, h: fs[i](p, h, seg_BL, rf, routings[i])[0], pf,
                                   x2_BLE)
            x1_BLE = y1_BLE - f_BLE
            dpf, dh_BLE = f_vjp(dy1_BLE)
            dy2_BLE = dy2_BLE + dh_BLE  # x1's cotangent is y1's; x2's adds the path through F
            dparams[i] = (dpf, dpg)
            y1_BLE, y2_BLE = x1_BLE, x2_BLE
        return dparams, dy1_BLE, dy2_BLE, None, None

    stack.defvjp(fwd, bwd)
    return stack


class RevBlock(nn.Module):
    """One reversible block, bound (for init and for decoding, where no gradient is taken)."""

    model: ModelConfig
    attention: AttentionConfig
    causal: bool
    deterministic: bool = True
    decode: bool = False

    def setup(self):
        self.f = AttentionHalf(self.model, self.attention, self.causal, self.deterministic,
                               self.decode)
        self.g = MlpHalf(self.model, self.deterministic)

    def __call__(self, x1_BLE, x2_BLE, seg_BL, pos_BL=None):
        x1_BLE = x1_BLE + self.f(x2_BLE, seg_BL, pos_BL)
        return x1_BLE, x2_BLE + self.g(x1_BLE)


class ReversibleStack(nn.Module):
    """`model.depth` reversible blocks on a duplicated stream: [B, L, E] -> [B, L, E].

    Parameters live at `block_{i}/f/...` (norm, attention) and `block_{i}/g/...` (norm,
    mlp_in, mlp_out). `recompute=False` is the plain-autodiff twin (same function, same
    gradients, activations of every block kept), for tests and memory comparisons.
    """

    model: ModelConfig
    attention: AttentionConfig
    causal: bool
    deterministic: bool = True
    decode: bool = False
    recompute: bool = True

    @nn.compact
    def __call__(self, x_BLE, seg_BL, pos_BL=None):
        m = self.model
        x1_BLE = x2_BLE = x_BLE.astype(jnp.float32)
        if self.is_initializing() or self.decode:
            # Creating params, or decoding with a mutable cache: run the blocks bound.
            for i in range(m.depth):
                x1_BLE, x2_BLE = RevBlock(m, self.attention, self.causal, self.deterministic,
                                          self.decode, name=f"block_{i}")(x1_BLE, x2_BLE, seg_BL,
                                                                          pos_BL)
        else:
            # Pure functions of explicit params and keys, so the backward can replay them.
            f_mod = AttentionHalf(m, self.attention, self.causal, self.deterministic, parent=None)
            g_mod = MlpHalf(m, self.deterministic, parent=None)
            def f(p, h, seg_pos, r, routing):
                if routing is None:  # choose it, and return what the variant kept
                    return f_mod.apply({"params": p}, h, *seg_pos, rngs=r, mutable=[ROUTING])
                return f_mod.apply({"params": p, **routing}, h, *seg_pos, rngs=r), routing

            g = lambda p, h, seg, r: g_mod.apply({"params": p}, h, rngs=r)
            variables = nn.meta.unbox(self.variables["params"])
            params = [(variables[f"block_{i}"]["f"], variables[f"block_{i}"]["g"])
                      for i in range(m.depth)]
            streams = [s for s in RNG_STREAMS if self.has_rng(s)]
            rngs = [tuple({s: self.make_rng(s) for s in streams} for _ in range(2))
                    for _ in range(m.depth)]
            run = reversible_stack([f] * m.depth, [g] * m.depth) if self.recompute else \
                functools.partial(plain_stack, [f] * m.depth, [g] * m.depth)
            x1_BLE, x2_BLE = run(params, x1_BLE, x2_BLE, (seg_BL, pos_BL), rngs)
        out_BLE = ((x1_BLE + x2_BLE) * 0.5).astype(x_BLE.dtype)
        return nn.with_logical_constraint(out_BLE, ("batch", "length", "activation_embed"))
