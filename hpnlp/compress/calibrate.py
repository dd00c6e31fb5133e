"""Choosing a clipping range: absmax, percentile, or the MSE-optimal range.

    r = choose_range(x_BLE, "int8", axes=(0, 1, 2), method="mse")   # one range, per tensor

`absmax` keeps every value (no clipping; outliers stretch the step), `percentile` clips
the top (100 - p)% of |x| (robust to rare outliers; absmax where that percentile is 0),
`mse` searches fractions of absmax
for the range whose quantize-dequantize error sum((x - q(x))^2) is least (the
clipping-vs-rounding trade-off, as TensorRT and PyTorch's HistogramObserver do). Ranges
keep dims, so they broadcast like the format's scale. PTQ calibration (hpnlp.compress.ptq)
runs this per batch and combines batches with `combine`.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp

from hpnlp.compress import formats

METHODS = ("absmax", "percentile", "mse")
MSE_GRID = 48  # candidate ranges absmax * (i / MSE_GRID), i = MSE_GRID/4 .. MSE_GRID


def choose_range(x, fmt: str, axes: Sequence[int], method: str = "absmax", *,
                 percentile: float = 99.99, group: int = 0):
    """The clipping range of `x` over `axes` (keepdims) by `method` (module doc)."""
    if method not in METHODS:
        raise ValueError(f"unknown calibration method {method!r}; choose one of {list(METHODS)}")
    axes = formats._canon(axes, x.ndim)
    amax = formats.absmax(x, axes, group)
    if method == "absmax" or not formats.get(fmt).uses_range:
        return amax
    xg, red = formats._grouped(x.astype(jnp.float32), axes, group)
    if method == "percentile":
        r = jnp.percentile(jnp.abs(xg), percentile, axis=red, keepdims=True).astype(jnp.float32)
        # a mostly-zero channel (a pruned weight's column) has a percentile of 0, a range
        # that would clip its nonzeros to 0 (found in review): it keeps its absmax
        return jnp.where(r > formats.TINY, r, amax)
    f = formats.get(fmt)

    def err(frac):
        codes, scale = f.encode(xg, red, rng=amax * frac)
        return jnp.sum(jnp.square(f.decode(codes, scale) - xg), axis=red, keepdims=True)

    fracs = jnp.arange(MSE_GRID // 4, MSE_GRID + 1, dtype=jnp.float32) / MSE_GRID
    errs = jax.lax.map(err, fracs)  # [n_candidates, *range shape]
    best = jnp.argmin(errs, axis=0)  # the first (smallest) range on ties
    return (amax * fracs[best]).astype(jnp.float32)


def combine(per_batch, method: str):
    """One range from a batch-major stack [n_batches, ...]: absmax takes the max over
    batches (nothing seen is clipped), percentile and mse the mean (a typical batch)."""
    return jnp.max(per_batch, axis=0) if method == "absmax" else jnp.mean(per_batch, axis=0)
