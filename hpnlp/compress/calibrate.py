"""Choosing a clipping range: absmax, percentile, or the MSE-optimal range.

    r = choose_range(x_BLE, "int8", axes=(0, 1, 2), method="mse")   # one range, per tensor

`absmax` keeps every value (no clipping; outliers stretch the step), `percentile` clips
the top (100 - p)% of |x| (robust to rare outliers; absmax where that percentile is 0),
`mse` searches fractions of absmax
for the range whose quantize-dequantize error sum((x - q(x))^2) is least (the
clipping-vs-rounding trade-off, as TensorRT and PyTorch's HistogramObserver do). Ranges
keep dims, so they broadcast like the format's scale. PTQ calibration (hpnlp.compress.ptq)
runs this per batch and combines batches with `combine`.

`valid` (a bool mask broadcastable to x) leaves entries out of every method: calibration
passes a product input's real tokens (qlinear.calibration_mask), so padding (segment 0)
moves no range and the ranges do not depend on how examples were batched (a review, r7:
padding rows stretched absmax and moved the percentile). An all-true mask gives the
ranges no mask gives, bit for bit.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp

from hpnlp.compress import formats

METHODS = ("absmax", "percentile", "mse")
MSE_GRID = 48  # candidate ranges absmax * (i / MSE_GRID), i = MSE_GRID/4 .. MSE_GRID


def choose_range(x, fmt: str, axes: Sequence[int], method: str = "absmax", *,
                 percentile: float = 99.99, group: int = 0, valid=None):
    """The clipping range of `x` over `axes` (keepdims) by `method`, over the entries where
    `valid` (None: all; module doc)."""
    if method not in METHODS:
        raise ValueError(f"unknown calibration method {method!r}; choose one of {list(METHODS)}")
    if method == "percentile" and not 0 < percentile <= 100:  # a review (session 114)
        raise ValueError(f"percentile={percentile!r}: give a percentage in (0, 100], e.g. 99.99")
    axes = formats._canon(axes, x.ndim)
    if valid is not None:
        valid = jnp.broadcast_to(jnp.asarray(valid, bool), x.shape)
    # left-out entries as 0: |x| >= 0, so the max is the valid entries' (0 where none)
    amax = formats.absmax(x if valid is None else jnp.where(valid, x, 0), axes, group)
    if method == "absmax" or not formats.get(fmt).uses_range:
        return amax
    xg, red = formats._grouped(x.astype(jnp.float32), axes, group)
    vg = None if valid is None else formats._grouped(valid, axes, group)[0]
    if method == "percentile":
        if vg is None:
            r = jnp.percentile(jnp.abs(xg), percentile, axis=red, keepdims=True)
        else:
            r = _masked_percentile(jnp.abs(xg), vg, percentile, red)
        r = r.astype(jnp.float32)
        # a mostly-zero channel (a pruned weight's column) has a percentile of 0, a range
        # that would clip its nonzeros to 0 (found in review): it keeps its absmax
        return jnp.where(r > formats.TINY, r, amax)
    f = formats.get(fmt)

    def err(frac):
        codes, scale = f.encode(xg, red, rng=amax * frac)
        e = jnp.square(f.decode(codes, scale) - xg)
        # a left-out entry weighs 0 (where, not a product: its error may be inf)
        return jnp.sum(e if vg is None else jnp.where(vg, e, 0.0), axis=red, keepdims=True)

    fracs = jnp.arange(MSE_GRID // 4, MSE_GRID + 1, dtype=jnp.float32) / MSE_GRID
    errs = jax.lax.map(err, fracs)  # [n_candidates, *range shape]
    best = jnp.argmin(errs, axis=0)  # the first (smallest) range on ties
    return (amax * fracs[best]).astype(jnp.float32)


def _masked_percentile(a, valid, percentile: float, red: tuple[int, ...]):
    """`jnp.percentile(a, percentile, axis=red, keepdims=True)` (linear interpolation) over
    the entries where `valid` only, n of them per slice, in jnp's own arithmetic (index
    q (n - 1), weights from its fraction): an all-true mask gives jnp's value bit for bit. A
    NaN among the valid entries makes the slice NaN, as in jnp; a slice with none, 0."""
    keep = [i for i in range(a.ndim) if i not in red]
    perm = keep + list(red)
    lead = tuple(a.shape[i] for i in keep)
    a_SN = jnp.transpose(a, perm).reshape(lead + (-1,))
    v_SN = jnp.transpose(valid, perm).reshape(lead + (-1,))
    # left-out entries sort after every valid one (an inf among the valid is inf either way)
    sorted_SN = jnp.sort(jnp.where(v_SN, a_SN, jnp.inf), axis=-1)
    count_S1 = jnp.sum(v_SN, axis=-1, keepdims=True, dtype=jnp.int32)
    n_S1 = count_S1.astype(jnp.float32)
    q = jnp.asarray(percentile, jnp.float32) / 100.0
    m_S1 = q * (n_S1 - 1.0)
    low_S1, high_S1 = jnp.floor(m_S1), jnp.ceil(m_S1)
    high_w = m_S1 - low_S1
    low_w = 1.0 - high_w
    top = jnp.maximum(n_S1 - 1.0, 0.0)
    at = lambda i: jnp.take_along_axis(  # noqa: E731
        sorted_SN, jnp.clip(i, 0.0, top).astype(jnp.int32), axis=-1)
    r_S1 = at(low_S1) * low_w + at(high_S1) * high_w
    r_S1 = jnp.where(jnp.any(jnp.isnan(a_SN) & v_SN, axis=-1, keepdims=True), jnp.nan, r_S1)
    r_S1 = jnp.where(count_S1 > 0, r_S1, 0.0)
    shape = [1 if i in red else a.shape[i] for i in range(a.ndim)]
    return r_S1.reshape(shape)


def combine(per_batch, method: str):
    """One range from a batch-major stack [n_batches, ...]: absmax takes the max over
    batches (nothing seen is clipped), percentile and mse the mean (a typical batch)."""
    if method not in METHODS:  # a review (session 114): anything else was averaged
        raise ValueError(f"unknown calibration method {method!r}; choose one of {list(METHODS)}")
    return jnp.max(per_batch, axis=0) if method == "absmax" else jnp.mean(per_batch, axis=0)
