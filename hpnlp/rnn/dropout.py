"""Dropout variants for recurrent networks, as Flax modules with inspectable masks.

All use the RNG stream "dropout", are the identity (or, for zoneout, the expectation)
when `deterministic=True` or the rate is 0, and scale kept units by 1/(1-p) ("inverted"
dropout) so that the expected value is unchanged and evaluation needs no rescaling.

- `Dropout`: standard dropout (Srivastava et al. 2014), a fresh mask for every element,
  so every time step gets its own.
- `VariationalDropout`: one mask per sequence, shared by all time steps (Gal &
  Ghahramani 2016, "A Theoretically Grounded Application of Dropout in Recurrent Neural
  Networks"); on inputs/outputs (`time_axis=1`) and on the recurrent state
  (`time_axis=None`, a mask of the state's own shape reused at every step).
- `RecurrentDropout`: dropout of the cell update g (LSTM) or candidate n (GRU), per step
  (Semeniuta et al. 2016, "Recurrent Dropout without Memory Loss"): the memory itself is
  never dropped.
- `Zoneout`: each unit keeps its previous value with probability p (Krueger et al. 2017,
  "Zoneout"); at evaluation h = p * h_prev + (1 - p) * h_new.
- `WeightDrop`: DropConnect (Wan et al. 2013) on the hidden-to-hidden matrix, one mask
  per forward pass shared by every step (Merity et al. 2018, AWD-LSTM).

The fast idea for recurrences: every mask that a step needs is drawn before the scan (one
random call for all steps) and streamed in, so the loop does no random-number work.
Shape letters: B batch, L length, E features, H hidden width.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from hpnlp.config import ConfigError


def check_rate(field: str, rate) -> float:
    """`rate` as a float, or a ConfigError naming `field` unless it is a number in [0, 1)
    (NumPy's too: a review, session 118, np.float32(0.1) was refused)."""
    import numbers
    if isinstance(rate, bool) or not isinstance(rate, numbers.Real) or not 0.0 <= rate < 1.0:
        raise ConfigError(f"field `{field}` = {rate!r} is not allowed: a dropout rate must be a "
                          "number in [0, 1)")
    return float(rate)


def _keep_mask(key, rate: float, shape, dtype):
    """Bernoulli(1 - rate) scaled by 1/(1 - rate)."""
    keep = jax.random.bernoulli(key, 1.0 - rate, shape)
    return keep.astype(dtype) / jnp.asarray(1.0 - rate, dtype)


def _drop(x, mask):
    """x * mask in float32 (or x's wider dtype), rounded to x's dtype once per element. A
    bfloat16 mask holds 1/(1-p) rounded once for every element (p = 0.1: 1.109375 for 1.1111,
    an expectation 0.16% low at every dropout site; review r9); per-element rounding has no
    shared bias."""
    wide = jnp.promote_types(x.dtype, jnp.float32)
    return (x.astype(wide) * mask.astype(wide)).astype(x.dtype)


class Dropout(nn.Module):
    """Standard inverted dropout: an independent mask for every element."""
    rate: float = 0.0

    def mask(self, shape, dtype=jnp.float32):
        """A fresh scaled mask (values 0 or 1/(1-p)) of `shape` (in bfloat16 1/(1-p) is
        rounded: `__call__` applies a float32 one)."""
        return _keep_mask(self.make_rng("dropout"), check_rate("dropout", self.rate), shape, dtype)

    def __call__(self, x, *, deterministic: bool):
        if deterministic or check_rate("dropout", self.rate) == 0.0:
            return x
        return _drop(x, self.mask(x.shape))


class VariationalDropout(nn.Module):
    """One mask per sequence (Gal & Ghahramani 2016), broadcast along `time_axis`.

    `time_axis=1` for [B, L, E] inputs/outputs; `time_axis=None` for a state [B, H]
    whose mask the caller reuses at every step.
    """
    rate: float = 0.0
    time_axis: int | None = 1

    def mask(self, shape, dtype=jnp.float32):
        """The scaled mask, size 1 along the time axis (broadcast it over time)."""
        shape = tuple(shape)
        if self.time_axis is not None:  # a negative axis counts from the end (a review,
            n, t = len(shape), self.time_axis  # session 103: -1 built a mask of rank 2n)
            if not -n <= t < n:
                raise ValueError(f"VariationalDropout time_axis={t} is outside the input's "
                                 f"{n} axes; use one of {-n}..{n - 1}")
            t = t + n if t < 0 else t
            shape = shape[:t] + (1,) + shape[t + 1:]
        return _keep_mask(self.make_rng("dropout"), check_rate("variational_dropout", self.rate),
                          shape, dtype)

    def __call__(self, x, *, deterministic: bool):
        if deterministic or check_rate("variational_dropout", self.rate) == 0.0:
            return x
        return _drop(x, jnp.broadcast_to(self.mask(x.shape), x.shape))


class RecurrentDropout(nn.Module):
    """Per-step dropout of the cell update (Semeniuta et al. 2016): c = f c + i d(g).

    Dropping only the update, never the carried memory, is what keeps long-range memory
    intact. `masks` draws the masks of all steps at once ([L, B, H] or any shape).
    """
    rate: float = 0.0

    def masks(self, shape, *, deterministic: bool):
        """Scaled per-step masks, or None when off."""
        if deterministic or check_rate("recurrent_dropout", self.rate) == 0.0:
            return None
        return _keep_mask(self.make_rng("dropout"), self.rate, shape, jnp.float32)

    def __call__(self, update, *, deterministic: bool):
        m = self.masks(update.shape, deterministic=deterministic)
        return update if m is None else _drop(update, m)


def zoneout_mix(prev, new, keep=None, rate: float = 0.0):
    """prev where keep == 1 else new; with keep=None the expectation p prev + (1-p) new."""
    if keep is not None:
        return new + keep * (prev - new)
    if rate:
        return new + rate * (prev - new)
    return new


class Zoneout(nn.Module):
    """Zoneout (Krueger et al. 2017): units keep their previous value with probability p.

    Not a rescaled dropout: `masks` are plain 0/1 "keep previous" indicators, and
    evaluation uses the expectation p * prev + (1 - p) * new.
    """
    rate: float = 0.0

    def masks(self, shape, *, deterministic: bool):
        """0/1 keep-previous indicators for all steps at once, or None when deterministic."""
        # checked in both modes: evaluation mixes by the rate too (review r3: 1.5 was refused
        # in training and extrapolated, 1.5 prev - 0.5 new, at evaluation)
        rate = check_rate("zoneout", self.rate)
        if deterministic or rate == 0.0:
            return None
        return jax.random.bernoulli(self.make_rng("dropout"), rate, shape).astype(jnp.float32)

    def __call__(self, prev, new, *, deterministic: bool):
        keep = self.masks(new.shape, deterministic=deterministic)
        return zoneout_mix(prev, new, keep, check_rate("zoneout", self.rate))


class WeightDrop(nn.Module):
    """DropConnect on a weight matrix (Wan et al. 2013), as AWD-LSTM applies it to the
    hidden-to-hidden matrix (Merity et al. 2018): one mask per call, i.e. per forward
    pass, so every time step sees the same dropped matrix, and the recurrence itself
    stays a plain fused-matmul LSTM (no per-step masks)."""
    rate: float = 0.0

    def __call__(self, w, *, deterministic: bool):
        if deterministic or check_rate("weight_drop", self.rate) == 0.0:
            return w
        return _drop(w, _keep_mask(self.make_rng("dropout"), self.rate, w.shape, jnp.float32))
