"""Quantization formats: each maps a float tensor to integer codes and a scale, and back.

    codes, scale = FORMATS["int8"].encode(w, axes=(0,))   # per channel: reduce over axis 0
    w_hat = FORMATS["int8"].decode(codes, scale)
    w_q = fake_quant(w, "int4", axes=(0,), group=32)      # forward: w_hat; backward: STE

`axes` are the axes one scale covers (a product's contraction axes: per-channel scales
for weights, per-token for activations); every other axis gets its own scale. `group`
splits the first of those axes into groups of that many with a scale each (int4 group
scales). `rng` is the clipping range (a calibrated |x| bound broadcastable to the scale's
shape); None means the tensor's own absmax over `axes`.

Formats (b bits, s the scale, c the integer code):
  int8 / int4   symmetric uniform: s = range / (2^(b-1) - 1), c = clip(round(x / s)),
                so c is in [-127, 127] / [-7, 7] (never -128: the kernels' VNNI offset
                trick and sign symmetry want it).
  fp8           e4m3 (`jnp.float8_e4m3fn`): s = range / 448, c = float8(x / s).
  binary        sign with a per-channel scale, s = mean |x| (BinaryConnect; XNOR-Net's
                optimal scale, Rastegari et al. 2016); c in {-1, +1}.
  ternary       TWN (Li et al. 2016; TernaryBERT): threshold t = 0.7 mean |x|,
                c = sign(x) [|x| > t], s = mean of |x| over |x| > t.
  pow2          signed powers of two (Miyashita et al. 2016; a product is a shift):
                x ~ s sign(x) 2^-k, s = range, k = round(-log2(|x| / s)) clipped to
                [0, 2^(b-1) - 2], values below half the smallest level are 0; the code
                is sign * (k + 1), 0 for zero, so 4 bits hold 7 exponents and zero.

The straight-through estimator (Bengio et al. 2013): `fake_quant`'s gradient is the
identity where |x| <= range and zero outside (the clipped values do not move the loss).
Scales are constants to the gradient.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp

FP8_MAX = 448.0  # largest finite float8_e4m3fn
# A range below this is an all-zero channel: scale 1 keeps codes 0 and avoids 0/0.
TINY = 1e-30


def _canon(axes: Sequence[int], ndim: int) -> tuple[int, ...]:
    return tuple(sorted(a % ndim for a in axes))


def _grouped(x, axes: tuple[int, ...], group: int):
    """x with axes[0] split into [n_groups, group]; the reduce axes in that shape."""
    if not group:
        return x, axes
    a = axes[0]
    k = x.shape[a]
    if k % group:
        raise ValueError(f"group size {group} does not divide the axis of size {k}")
    x = x.reshape(x.shape[:a] + (k // group, group) + x.shape[a + 1:])
    shifted = tuple(b + 1 if b > a else b for b in axes[1:])
    return x, (a + 1,) + shifted


def absmax(x, axes: Sequence[int], group: int = 0):
    """max |x| over `axes` (keepdims; `group` as in the module doc), in float32."""
    axes = _canon(axes, x.ndim)
    xg, red = _grouped(x.astype(jnp.float32), axes, group)
    return jnp.max(jnp.abs(xg), axis=red, keepdims=True)


@dataclasses.dataclass(frozen=True)
class Format(abc.ABC):
    """One quantization format (see the module doc). Subclasses define `_codes`."""

    name: str
    bits: int  # storage bits per value (packed: int4 two per byte, binary eight)
    uses_range: bool = True  # False: the scale comes from the tensor's statistics alone

    def encode(self, x, axes: Sequence[int], *, group: int = 0, rng=None):
        """x -> (codes, scale); codes have x's shape (the grouped shape when `group`),
        scale keeps dims. Codes are int8 (fp8: float8_e4m3fn)."""
        axes = _canon(axes, x.ndim)
        xg, red = _grouped(x.astype(jnp.float32), axes, group)
        r = jnp.max(jnp.abs(xg), axis=red, keepdims=True) if rng is None else \
            jnp.asarray(rng, jnp.float32)
        return self._codes(xg, red, jnp.maximum(r, 0.0))

    def decode(self, codes, scale):
        return codes.astype(jnp.float32) * scale

    @abc.abstractmethod
    def _codes(self, x, red, r):
        """(codes, scale) of x (grouped shape) reduced over `red`, given the range r."""


class Uniform(Format):
    """int8, int4: symmetric uniform with qmax = 2^(bits-1) - 1."""

    @property
    def qmax(self) -> int:
        return 2 ** (self.bits - 1) - 1

    def _codes(self, x, red, r):
        scale = jnp.where(r > TINY, r / self.qmax, 1.0)
        codes = jnp.clip(jnp.round(x / scale), -self.qmax, self.qmax).astype(jnp.int8)
        return codes, scale


class Fp8(Format):
    def _codes(self, x, red, r):
        scale = jnp.where(r > TINY, r / FP8_MAX, 1.0)
        return jnp.clip(x / scale, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn), scale


class Binary(Format):
    def _codes(self, x, red, r):
        del r
        mean = jnp.mean(jnp.abs(x), axis=red, keepdims=True)
        return jnp.where(x > 0, 1, -1).astype(jnp.int8), jnp.where(mean > TINY, mean, 1.0)


class Ternary(Format):
    THRESHOLD = 0.7  # t = 0.7 E|x|: TWN's approximation of the optimal threshold for N(0, s)

    def _codes(self, x, red, r):
        del r
        t = self.THRESHOLD * jnp.mean(jnp.abs(x), axis=red, keepdims=True)
        keep = jnp.abs(x) > t
        n = jnp.sum(keep, axis=red, keepdims=True)
        s = jnp.sum(jnp.where(keep, jnp.abs(x), 0.0), axis=red, keepdims=True) / jnp.maximum(n, 1)
        codes = (jnp.sign(x) * keep).astype(jnp.int8)
        return codes, jnp.where(s > TINY, s, 1.0)


class Pow2(Format):
    @property
    def kmax(self) -> int:
        return 2 ** (self.bits - 1) - 2

    def _codes(self, x, red, r):
        scale = jnp.where(r > TINY, r, 1.0)
        u = jnp.abs(x) / scale
        k = jnp.clip(jnp.round(-jnp.log2(jnp.maximum(u, 1e-30))), 0, self.kmax)
        zero = u < 2.0 ** (-self.kmax - 0.5)  # nearer 0 than the smallest level (geometric)
        codes = jnp.where(zero, 0, jnp.sign(x) * (k + 1)).astype(jnp.int8)
        return codes, scale

    def decode(self, codes, scale):
        c = codes.astype(jnp.float32)
        return jnp.sign(c) * jnp.exp2(1.0 - jnp.abs(c)) * scale


FORMATS: dict[str, Format] = {f.name: f for f in (
    Uniform("int8", 8), Uniform("int4", 4), Fp8("fp8", 8),
    Binary("binary", 1, uses_range=False), Ternary("ternary", 2, uses_range=False),
    Pow2("pow2", 4))}
# Formats activations may take (binary activations: XNOR-Net, with binary weights).
ACTIVATION_FORMATS = ("int8", "fp8", "binary")


def get(name: str) -> Format:
    if name not in FORMATS:
        raise ValueError(f"unknown quantization format {name!r}; choose one of {sorted(FORMATS)}")
    return FORMATS[name]


def quantize_dequantize(x, fmt: str, axes: Sequence[int], *, group: int = 0, rng=None):
    """decode(encode(x)) in x's shape and dtype: the forward value of `fake_quant`."""
    f = get(fmt)
    codes, scale = f.encode(x, axes, group=group, rng=rng)
    return f.decode(codes, scale).reshape(x.shape).astype(x.dtype)


def fake_quant(x, fmt: str, axes: Sequence[int], *, group: int = 0, rng=None):
    """Quantize-dequantize with the straight-through estimator (module doc): the gradient
    passes unchanged where |x| <= the range (absmax over `axes` when `rng` is None, so
    everywhere) and is zero where x was clipped."""
    x_hat = jax.lax.stop_gradient(quantize_dequantize(x, fmt, axes, group=group, rng=rng))
    if rng is None or not get(fmt).uses_range:
        return x + jax.lax.stop_gradient(x_hat - x)
    xg, _ = _grouped(x.astype(jnp.float32), _canon(axes, x.ndim), group)
    inside = (jnp.abs(xg) <= jax.lax.stop_gradient(jnp.asarray(rng, jnp.float32))).reshape(x.shape)
    return jnp.where(inside, x + jax.lax.stop_gradient(x_hat - x), x_hat)
