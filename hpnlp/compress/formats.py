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
                trick and sign symmetry want it). In float32 both divisions are products
                with a reciprocal, s = range * fl(1 / 127) and c = round(x * fl(1 / s)), as
                XLA computed them (so x / s = 6.5 exactly may still round to 7); the int8
                kernel's per-token codes (kernels.quantize_rows_int8, qgemm.cc) are these,
                code for code (a review (r5): its factor fl(127 / range) rounded apart).
  fp8           e4m3 (`jnp.float8_e4m3fn`): s = range / 448, c = float8(x / s).
  binary        sign with a per-channel scale, s = mean |x| (BinaryConnect; XNOR-Net's
                optimal scale, Rastegari et al. 2016); c in {-1, +1}.
  ternary       TWN (Li et al. 2016; TernaryBERT): threshold t = 0.7 mean |x|,
                c = sign(x) [|x| > t], s = mean of |x| over |x| > t.
  pow2          signed powers of two (Miyashita et al. 2016; a product is a shift):
                x ~ s sign(x) 2^-k, s = range, k = round(-log2(|x| / s)) clipped to
                [0, 2^(b-1) - 2]: rounded in the log domain, so a value takes the level
                nearest in log2, and values below 2^-0.5 (~0.71) of the smallest level (the
                log-domain midpoint to the next level down, as between levels) are 0; the
                code is sign * (k + 1), 0 for zero, so 4 bits hold 7 exponents and zero.

A NaN or an infinity in the values one scale covers, where the range is the values' own
(`rng` None, as PTQ and the int8 KV cache quantize), or a non-finite `rng`, makes that scale
non-finite and every value it decodes NaN, in every format (int8, int4, fp8, pow2: the
range's scale, NaN or inf, with codes 0; binary, ternary: scale NaN), as a float model would
show it and as the kernels' `quantize_rows_int8` does. Under a given finite range (a
calibrated one) a NaN value's code is 0 in the integer formats; `fake_quant` keeps it NaN.

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

from hpnlp import kernels

FP8_MAX = 448.0  # largest finite float8_e4m3fn
# A range below this quantizes its channel to 0: scale 0 and codes 0 (no 0/0). Before,
# scale 1 kept an all-zero channel's codes 0, but let a calibrated range of 0 pass values
# through as whole numbers (int8 up to 127) and decoded binary's +-1 codes to -1s.
TINY = 1e-30


def _nonzero(r):
    """Where a range quantizes to nonzero codes: r > TINY, and a NaN range (a bug hunt
    (session 99): `r > TINY` was False for NaN, so a NaN became scale 0 and codes 0, the
    values silently 0, and an int8 KV cache's attention finite where the float one is NaN)."""
    return ~(r <= TINY)


def _codes_or_zero(ok, scale, codes):
    """The codes where the scale is finite and nonzero; 0 elsewhere (so a NaN or inf scale
    decodes to NaN: 0 * inf is NaN)."""
    return jnp.where(ok & jnp.isfinite(scale), codes, 0)


def _canon(axes: Sequence[int], ndim: int) -> tuple[int, ...]:
    # a review (session 114): an axis past ndim wrapped onto another (-3 of a 2-D weight
    # read as 1: per-row scales where per-column were asked for)
    if any(isinstance(a, bool) or not -ndim <= a < ndim for a in axes):
        raise ValueError(f"axes {tuple(axes)} are not axes of a {ndim}-D array")
    out = tuple(sorted(a % ndim for a in axes))
    if len(set(out)) != len(out):
        raise ValueError(f"axes {tuple(axes)} name an axis twice")
    return out


def _grouped(x, axes: tuple[int, ...], group: int):
    """x with axes[0] split into [n_groups, group]; the reduce axes in that shape."""
    if not kernels.is_integer(group) or group < 0:
        # a review (session 114): -4 or 16.0 failed inside reshape, naming neither
        raise ValueError(f"group size {group!r}: give a whole number >= 0 (0: no groups)")
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
        if rng is None:
            r = jnp.max(jnp.abs(xg), axis=red, keepdims=True)
            # XLA:CPU's max can drop a NaN (a [141, 70] input; kernels.quantize_rows_int8)
            r = jnp.where(jnp.isnan(xg).any(axis=red, keepdims=True), jnp.nan, r)
        else:
            r = jnp.asarray(rng, jnp.float32)
        return self._codes(xg, red, jnp.maximum(r, 0.0))  # maximum keeps a NaN

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
        ok = _nonzero(r)  # a range of 0 quantizes everything to 0 (scale 0), not x / 1
        # r / qmax and x / scale as XLA computed them (it makes a division by a constant or
        # by a broadcast scale a product with the reciprocal), written out so the rule does
        # not hang on that rewrite: the int8 kernel's per-token codes are these (review r5)
        scale = jnp.where(ok, r * (1.0 / self.qmax), 0.0)
        inv = 1.0 / jnp.where(ok, scale, 1.0)
        codes = jnp.clip(jnp.round(x * inv), -self.qmax, self.qmax)
        return _codes_or_zero(ok, scale, codes).astype(jnp.int8), scale


class Fp8(Format):
    def _codes(self, x, red, r):
        ok = _nonzero(r)
        scale = jnp.where(ok, r / FP8_MAX, 0.0)
        codes = jnp.clip(x / jnp.where(ok, scale, 1.0), -FP8_MAX, FP8_MAX)
        return _codes_or_zero(ok, scale, codes).astype(jnp.float8_e4m3fn), scale


class Binary(Format):
    def _codes(self, x, red, r):
        del r
        mean = jnp.mean(jnp.abs(x), axis=red, keepdims=True)
        # scale 0 for an all-zero group: its codes are +-1, so a scale of 1 decoded it to -1s;
        # NaN for a NaN or an inf (+-inf would decode an inf as +-inf, the rest too)
        scale = jnp.where(jnp.isfinite(mean), jnp.where(mean > TINY, mean, 0.0), jnp.nan)
        return jnp.where(x > 0, 1, -1).astype(jnp.int8), scale


class Ternary(Format):
    THRESHOLD = 0.7  # t = 0.7 E|x|: TWN's approximation of the optimal threshold for N(0, s)

    def _codes(self, x, red, r):
        del r
        mean = jnp.mean(jnp.abs(x), axis=red, keepdims=True)
        keep = jnp.abs(x) > self.THRESHOLD * mean
        n = jnp.sum(keep, axis=red, keepdims=True)
        s = jnp.sum(jnp.where(keep, jnp.abs(x), 0.0), axis=red, keepdims=True) / jnp.maximum(n, 1)
        codes = (jnp.sign(x) * keep).astype(jnp.int8)
        # scale NaN for a NaN or an inf: it had scale 1 and, its threshold NaN or inf
        # keeping nothing, codes 0 (an inf zeroed its whole group); scale 0 for a group of
        # values <= TINY, as every format's (a review, r7: scale 1 decoded its +-1 codes
        # to +-1, a channel of 1e-31s to 1s)
        return codes, jnp.where(jnp.isfinite(mean), jnp.where(s > TINY, s, 0.0), jnp.nan)


class Pow2(Format):
    @property
    def kmax(self) -> int:
        return 2 ** (self.bits - 1) - 2

    def _codes(self, x, red, r):
        ok = _nonzero(r)
        scale = jnp.where(ok, r, 0.0)
        u = jnp.abs(x) / jnp.where(ok, r, 1.0)
        k = jnp.clip(jnp.round(-jnp.log2(jnp.maximum(u, 1e-30))), 0, self.kmax)
        # below 2^-0.5 of the smallest level, the log-domain midpoint to the next level
        # down, as k rounds between levels (the module doc said half the smallest level; a
        # bug hunt (session 103) corrected the words, not the rule QAT runs were trained by)
        zero = u < 2.0 ** (-self.kmax - 0.5)
        codes = jnp.where(zero, 0, jnp.sign(x) * (k + 1))
        return _codes_or_zero(ok, scale, codes).astype(jnp.int8), scale

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
    # x_hat + (x - sg(x)) is x_hat forward, exactly (x - x is 0), and x's gradient (a bug
    # hunt (session 99): x + sg(x_hat - x) rounds off x_hat where x and x_hat are more than
    # a factor 2 apart, in float32 too: a binary weight took three magnitudes, not one)
    x32 = x.astype(jnp.float32)
    ste = (x_hat.astype(jnp.float32) + (x32 - jax.lax.stop_gradient(x32))).astype(x.dtype)
    if rng is None or not get(fmt).uses_range:
        return ste
    xg, _ = _grouped(x32, _canon(axes, x.ndim), group)
    inside = (jnp.abs(xg) <= jax.lax.stop_gradient(jnp.asarray(rng, jnp.float32))).reshape(x.shape)
    # NaN is never inside a range: it stays NaN (its code would be 0, hiding what the float
    # model shows), as without a range (there its whole group is NaN)
    return jnp.where(inside | jnp.isnan(x), ste, x_hat)
