"""LSTM and GRU recurrences as pure functions: the fast scan and its autodiff twin.

The speed tricks, all by construction (the layer in `hpnlp.rnn.layers` feeds these):

1. The input projection is taken out of the recurrence: ONE matrix product for all steps
   ([L*B, E] x [E, K*H]), or one per block of T steps (`run_layer(chunk=T)`, [T*B, E] x
   [E, K*H], which bounds the memory of a forward-only pass; not faster: see
   `run_layer`), so a step only does the recurrent product.
2. The K gates come from one fused product per step, [B, H] x [H, K*H] (K = 4 for the
   LSTM, 3 for the GRU), laid out so that one `sigmoid` covers all sigmoid gates.
3. Time-major inside the scan ([L, B, ...]) so each step reads one contiguous slice.
4. A hand-written backward pass (`run_layer` -> `_fast_layer`, a `jax.custom_vjp`).
   Autodiff of a scan accumulates the recurrent weight gradient step by step, an
   [H, B] x [B, K*H] product and a [H, K*H] add per step, and of the chunked projection
   one input-weight gradient per chunk. Here ONE reverse scan over all L steps only
   emits each step's gate gradient dz_BG (one [B, K*H] x [K*H, H] product per step), and
   every weight and input gradient is one product over all L*B rows afterwards:
   dW_h = h_prev^T dz, dW_x = x^T dxw, dx = dxw W_x^T (the same trick as step 1 run
   backwards). For the LSTM without layer norm dxw = dz (pre = xw + z), stored once.
   The pointwise part of a step is recomputed in the backward scan (cheap elementwise
   work) instead of storing every gate.

Everything else that is fixed for a sequence (dropout and zoneout masks, the weight-dropped
recurrent matrix, the variational mask on the state) is made before the scan and streamed
in; nothing is drawn or recomputed per step.

Cells: the LSTM of Hochreiter & Schmidhuber (1997) with a forget gate (Gers et al. 2000),
gates ordered (i, f, o, g); the GRU of Cho et al. (2014), gates (r, z, n) with
n = tanh(W_in x + b_in + r * (W_hn h + b_hn)) as in cuDNN and `flax.linen.GRUCell`; both
optionally layer-normalized (Ba et al. 2016, "Layer Normalization": LN of the recurrent
pre-activation and, for the LSTM, of the cell before its output tanh; the LN of the input
pre-activation is per step but does not depend on the state, so it is hoisted too).
Recurrent dropout on the cell update (Semeniuta et al. 2016), zoneout (Krueger et al.
2017) and length masking happen inside the step, from streamed masks.

Shape letters: B batch, L length (time), E input width, H hidden width, K gates (4 LSTM,
3 GRU), G = K*H. Carries are tuples: LSTM (c_BH, h_BH), GRU (h_BH,); h is always last.
State and pointwise math are float32; matrix products take the compute dtype of their
operands and accumulate in float32.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from hpnlp.rnn.dropout import zoneout_mix

LN_EPS = 1e-5
NUM_GATES = {"lstm": 4, "gru": 3}


class StepInputs(NamedTuple):
    """What one time step reads besides its input projection; None where unused.

    valid_B1: 1.0 on real tokens, 0.0 on padding (padding keeps the state).
    update_BH: recurrent-dropout mask on the cell update (already scaled by 1/(1-p)).
    zone_c_BH, zone_h_BH: zoneout indicators, 1.0 = keep the previous value.
    """
    valid_B1: Any = None
    update_BH: Any = None
    zone_c_BH: Any = None
    zone_h_BH: Any = None


def _layer_norm(x, gain, bias=None):
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    y = (x - mean) * jax.lax.rsqrt(var + LN_EPS) * gain[None, :]
    return y if bias is None else y + bias[None, :]


def _mask_padding(new_carry, carry, out_BH, valid_B1):
    if valid_B1 is None:
        return new_carry, out_BH
    keep = valid_B1 > 0
    new_carry = tuple(jnp.where(keep, n, o) for n, o in zip(new_carry, carry))
    return new_carry, jnp.where(keep, out_BH, 0.0)


def lstm_step(pw: dict, xw_BG, z_BG, carry, ex: StepInputs, *, zoneout: float = 0.0):
    """One LSTM step from its input projection xw_BG (bias included) and the recurrent
    product z_BG = h_prev @ W_h. Gates (i, f, o, g): one sigmoid over the first 3H."""
    c_BH, h_BH = carry
    H = c_BH.shape[-1]
    if "ln_h_gain" in pw:
        z_BG = _layer_norm(z_BG, pw["ln_h_gain"])
    pre_BG = xw_BG + z_BG
    ifo_BG = jax.nn.sigmoid(pre_BG[:, :3 * H])
    i_BH, f_BH, o_BH = ifo_BG[:, :H], ifo_BG[:, H:2 * H], ifo_BG[:, 2 * H:]
    g_BH = jnp.tanh(pre_BG[:, 3 * H:])
    if ex.update_BH is not None:
        g_BH = g_BH * ex.update_BH
    new_c = f_BH * c_BH + i_BH * g_BH
    shown = _layer_norm(new_c, pw["ln_c_gain"], pw["ln_c_bias"]) if "ln_c_gain" in pw else new_c
    new_h = o_BH * jnp.tanh(shown)
    new_c = zoneout_mix(c_BH, new_c, ex.zone_c_BH, zoneout)
    new_h = zoneout_mix(h_BH, new_h, ex.zone_h_BH, zoneout)
    return _mask_padding((new_c, new_h), carry, new_h, ex.valid_B1)


def gru_step(pw: dict, xw_BG, z_BG, carry, ex: StepInputs, *, zoneout: float = 0.0):
    """One GRU step. Gates (r, z, n); the recurrent bias of n sits inside r * (...), so it
    cannot be folded into the hoisted input projection and lives here."""
    (h_BH,) = carry
    H = h_BH.shape[-1]
    if "ln_h_gain" in pw:
        z_BG = _layer_norm(z_BG, pw["ln_h_gain"])
    rz_BG = jax.nn.sigmoid(xw_BG[:, :2 * H] + z_BG[:, :2 * H])
    r_BH, u_BH = rz_BG[:, :H], rz_BG[:, H:]
    n_BH = jnp.tanh(xw_BG[:, 2 * H:] + r_BH * (z_BG[:, 2 * H:] + pw["hn_bias"][None, :]))
    if ex.update_BH is not None:
        n_BH = n_BH * ex.update_BH
    new_h = n_BH + u_BH * (h_BH - n_BH)  # (1 - u) n + u h
    new_h = zoneout_mix(h_BH, new_h, ex.zone_h_BH, zoneout)
    return _mask_padding((new_h,), carry, new_h, ex.valid_B1)


STEPS = {"lstm": lstm_step, "gru": gru_step}


def _matmul(a, w):
    return jnp.dot(a.astype(w.dtype), w, preferred_element_type=jnp.float32)


def _hin(h_BH, state_mask_BH):
    return h_BH if state_mask_BH is None else h_BH * state_mask_BH


def _split(a, n: int, T: int):
    """[n*T, ...] -> [n, T, ...] (None stays None)."""
    return None if a is None else a.reshape((n, T) + a.shape[1:])


def _scan_chunks(step: Callable, project: Callable, pp, pw, w_HG, x_LBE, carry0,
                 ex_L: StepInputs, state_mask_BH, T: int, unroll: int, save: bool):
    """The forward pass: an outer scan over the L / T chunks projects each chunk's T steps
    with ONE product, then an inner scan runs their recurrence (one fused [B, H] x [H, G]
    product per step). Returns (final carry, outputs h_LBH); with `save`, also what the
    hand-written backward pass needs: the carry entering every step, its recurrent
    product z_LBG and the projection xw_LBG."""
    L = x_LBE.shape[0]
    n = L // T

    def chunk(carry, xs):
        x_TBE, ex_T = xs
        xw_TBG = project(pp, x_TBE)

        def body(c, s):
            xw_BG, ex = s
            z_BG = _matmul(_hin(c[-1], state_mask_BH), w_HG)
            new_c, out_BH = step(pw, xw_BG, z_BG, c, ex)
            return new_c, ((out_BH, c, z_BG) if save else out_BH)

        c, ys = jax.lax.scan(body, carry, (xw_TBG, ex_T), unroll=unroll)
        return c, ((ys, xw_TBG) if save else ys)

    final, ys = jax.lax.scan(chunk, carry0, (_split(x_LBE, n, T),
                                             StepInputs(*(_split(a, n, T) for a in ex_L))))
    return final, jax.tree_util.tree_map(lambda a: a.reshape((L,) + a.shape[2:]), ys)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 9, 10, 11))
def _fast_layer(step, project, pp, pw, w_HG, x_LBE, carry0, ex_L, state_mask_BH, T, unroll, tied):
    """`_scan_chunks` with the hand-written backward pass (see the top of this module).
    `tied`: the step's gradients for xw and z are equal (LSTM without layer norm:
    pre = xw + z), so the backward scan emits one of them."""
    return _scan_chunks(step, project, pp, pw, w_HG, x_LBE, carry0, ex_L, state_mask_BH, T,
                        unroll, save=False)


def _fast_layer_fwd(step, project, pp, pw, w_HG, x_LBE, carry0, ex_L, state_mask_BH, T,
                    unroll, tied):
    final, ((out_LBH, carry_prev_L, z_LBG), xw_LBG) = _scan_chunks(
        step, project, pp, pw, w_HG, x_LBE, carry0, ex_L, state_mask_BH, T, unroll, save=True)
    # The gates are not stored: the backward scan recomputes them from xw, z and the carry.
    res = (pp, pw, w_HG, x_LBE, ex_L, state_mask_BH, carry_prev_L, z_LBG, xw_LBG)
    return (final, out_LBH), res


def _fast_layer_bwd(step, project, T, unroll, tied, res, cts):
    pp, pw, w_HG, x_LBE, ex_L, state_mask_BH, carry_prev_L, z_LBG, xw_LBG = res
    d_final, d_out_LBH = cts
    w_GH = w_HG.T  # transposed once, not per step

    def body(acc, xs):
        d_carry, d_pw = acc
        xw_BG, z_BG, carry, ex, d_out_BH = xs
        _, vjp = jax.vjp(lambda p, xw, z, c: step(p, xw, z, c, ex), pw, xw_BG, z_BG, carry)
        dp, d_xw_BG, d_z_BG, d_prev = vjp((d_carry, d_out_BH))
        d_hin_BH = _matmul(d_z_BG, w_GH)  # the only product left inside the loop
        if state_mask_BH is not None:
            d_hin_BH = d_hin_BH * state_mask_BH
        d_prev = d_prev[:-1] + (d_prev[-1] + d_hin_BH,)
        d_pw = jax.tree_util.tree_map(jnp.add, d_pw, dp)
        return (d_prev, d_pw), (d_xw_BG if tied else (d_xw_BG, d_z_BG))

    d_carry = jax.tree_util.tree_map(lambda x: x.astype(jnp.float32), d_final)
    zeros_pw = jax.tree_util.tree_map(jnp.zeros_like, pw)
    # One reverse scan over all L steps (the chunks are a forward-pass device only).
    (d_carry0, d_pw), ys = jax.lax.scan(
        body, (d_carry, zeros_pw), (xw_LBG, z_LBG, carry_prev_L, ex_L, d_out_LBH),
        reverse=True, unroll=unroll)
    d_xw_LBG, d_z_LBG = (ys, ys) if tied else ys
    # The hoisted weight gradients: one product over all L*B rows each.
    hin_LBH = carry_prev_L[-1]
    if state_mask_BH is not None:
        hin_LBH = hin_LBH * state_mask_BH[None]
    d_w_HG = jnp.einsum("lbh,lbg->hg", hin_LBH.astype(w_HG.dtype), d_z_LBG.astype(w_HG.dtype),
                        preferred_element_type=jnp.float32).astype(w_HG.dtype)
    # The projection's own backward (dx = dxw W^T, dW = x^T dxw, db; its forward product is
    # dead code here and dropped by XLA unless a layer norm needs it).
    _, project_vjp = jax.vjp(project, pp, x_LBE)
    d_pp, d_x_LBE = project_vjp(d_xw_LBG.astype(xw_LBG.dtype))
    d_carry0 = tuple(d.astype(c.dtype) for d, c in zip(d_carry0, carry_prev_L))
    return (d_pp, d_pw, d_w_HG, d_x_LBE, d_carry0, None, None)


_fast_layer.defvjp(_fast_layer_fwd, _fast_layer_bwd)


def checked_lengths(lengths_B, B: int, L: int):
    """`lengths_B` (an array or a list) as int32 lengths capped to 0..L. A ValueError where
    they are not B integers, or (where concrete, not traced) not in 0..L: past the inputs
    the backward direction read outside them (NaN), and float lengths failed inside its
    gather. A traced length past L caps at L, as the forward direction reads it (in int32:
    a review (session 103) found uint8 lengths clipped at L = 300 wrap L)."""
    lengths_B = jnp.asarray(lengths_B)
    if tuple(lengths_B.shape) != (B,):
        raise ValueError(f"`lengths_B` must have shape ({B},) (one length per row), got "
                         f"{tuple(lengths_B.shape)}")
    if not jnp.issubdtype(lengths_B.dtype, jnp.integer):
        raise ValueError(f"`lengths_B` must be integer lengths; got dtype {lengths_B.dtype}")
    if not isinstance(lengths_B, jax.core.Tracer) and lengths_B.size:
        lens = np.asarray(lengths_B)
        if int(lens.min()) < 0 or int(lens.max()) > L:
            raise ValueError(f"`lengths_B` must be in 0..{L} (the inputs' length); got "
                             f"{lens.tolist()}")
    return jnp.clip(lengths_B.astype(jnp.int32), 0, L)


def flip_within_length(x, lengths_B=None, *, time_major: bool = False):
    """Reverse each row's first `lengths_B[b]` steps; padding stays at the end, so the
    backward direction starts at each row's last real token. `x` is [B, L, ...], or
    [L, B, ...] with `time_major=True`. Lengths are checked as the layer checks them
    (`checked_lengths`; review r9: a length past L read NaN here)."""
    t_ax = 0 if time_major else 1
    if lengths_B is None:
        return jnp.flip(x, axis=t_ax)
    L = x.shape[t_ax]
    lengths_B = checked_lengths(lengths_B, x.shape[1 - t_ax], L)
    t_L = jnp.arange(L)
    idx_BL = jnp.where(t_L[None, :] < lengths_B[:, None], lengths_B[:, None] - 1 - t_L[None, :],
                       t_L[None, :])
    idx = idx_BL.T if time_major else idx_BL
    idx = idx.reshape(idx.shape + (1,) * (x.ndim - 2))
    return jnp.take_along_axis(x, idx, axis=t_ax)


def run_layer(step: Callable, project: Callable, pp, pw, w_HG, x_LBE, carry0,
              ex_L: StepInputs, state_mask_BH=None, *, chunk: int | None = None,
              unroll: int = 1, fast_backward: bool = True, tied: bool = False):
    """Input projection + recurrence over a time-major sequence x_LBE.

    `project(pp, x_TBE) -> xw_TBG` is the input projection (bias, and layer norm,
    included) with its parameters `pp`. With `chunk=None` it runs once for all L steps,
    one [L*B, E] x [E, G] product. With `chunk=T` the forward pass projects T steps at a
    time ([T*B, E] x [E, G]) and runs their recurrence before the next chunk, so a pass
    that is not differentiated holds one block of the [L, B, G] projection, not all of it
    (an LSTM at B=32, L=256, E=H=512: XLA's temporary buffers 21 MiB with T = 8 against
    144 MiB in one product, the forward compiled for CPU by jax 0.10.2); a differentiated
    pass stores every step's projection for the backward either way. It is not faster: the
    recorded `python -m hpnlp.bench rnn` runs on six CPUs (docs/benchmarks/rnn*/results.json,
    rows `hpnlp LSTM (scan)`, T = 8, and `hpnlp LSTM (scan, one product)`) read one product
    at least as fast in forward+backward on 5 of 6 (T = 8 took 1.01x-1.20x its time there,
    the most on the AMD EPYC Zen 3; 0.99x on the Zen 5) and forward 0.90x-1.19x. The
    backward pass (`fast_backward`) is one reverse scan over all L steps followed by
    whole-sequence products for every weight and input gradient; `fast_backward=False`
    differentiates the same forward pass with JAX's autodiff (the reference twin, the one
    that takes forward mode: `_fast_layer` is a custom_vjp). `tied`: see `_fast_layer`.
    Returns (final carry, outputs h_LBH); gradients flow to `pp`, `pw`, `w_HG`, `x_LBE`
    and `carry0` (the masks in `ex_L` and `state_mask_BH` are constants).
    """
    L, B = x_LBE.shape[:2]
    T = max(L, 1) if chunk is None or chunk >= L else chunk  # L = 0: no chunk, no steps
    n = -(-L // T)
    pad = n * T - L
    if pad:  # padded steps are invalid: they keep the state and output zeros
        if ex_L.valid_B1 is None:
            ex_L = ex_L._replace(valid_B1=jnp.ones((L, B, 1), jnp.float32))
        pad_t = lambda a: None if a is None else jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1))
        ex_L = StepInputs(*(pad_t(a) for a in ex_L))
        x_LBE = pad_t(x_LBE)
    if fast_backward:
        final, out_LBH = _fast_layer(step, project, pp, pw, w_HG, x_LBE, carry0, ex_L,
                                     state_mask_BH, T, unroll, tied)
    else:
        final, out_LBH = _scan_chunks(step, project, pp, pw, w_HG, x_LBE, carry0, ex_L,
                                      state_mask_BH, T, unroll, save=False)
    return final, out_LBH[:L]
