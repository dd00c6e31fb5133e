"""`RNNLayer` (LSTM or GRU, one or both directions) and `StackedRNN`.

    layer = RNNLayer(kind="lstm", hidden=512, bidirectional=True, zoneout=0.1)
    params = layer.init(jax.random.key(0), x_BLE, lengths_B)
    out_BL2H, (c_B2H, h_B2H) = layer.apply(params, x_BLE, lengths_B, deterministic=False,
                                           rngs={"dropout": key})

The fast idea (details in `hpnlp.rnn.cells`): the input projection is taken out of the
recurrence, one matrix product for all steps (`chunk=None`) or for each block of `chunk`
steps (default 8, for memory, not speed: a forward pass that is not differentiated holds
one block of the [L, B, K*H] projection instead of all of it; see `cells.run_layer` for the
measurements); each step does one fused [B, H] x [H, K*H] product; and the backward pass is
one reverse scan with one product per step, after which every weight and input gradient is
one product over all steps instead of one per step (or per block). Both
directions of a bidirectional layer run in the same scan. On CPU the plain LSTM runs its
recurrence as a fused C++ kernel instead (`hpnlp.rnn.fused`, field `impl`). Against
`flax.linen.RNN(OptimizedLSTMCell)` see `python -m hpnlp.bench rnn`.

Options: layer normalization (Ba et al. 2016), bidirectional with the backward direction
reversed within each row's length, a learned initial state, forget-gate bias 1 (LSTM,
Gers et al. 2000; Jozefowicz et al. 2015) and reset-gate bias -1 (GRU), length masks
(padding never changes the state; the final state is the last real step's; padded
outputs are 0), and the dropout variants of `hpnlp.rnn.dropout` through fields.

Parameters carry logical axis names ("embed" for the input width, "mlp" for the hidden
units) so a mesh rule set can shard them; gates and directions are separate axes so a
shard holds all gates of its units. Shape letters: B batch, L length, E input width, H
hidden, D directions (1 or 2), K gates (4 LSTM, 3 GRU), G = K*H.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from hpnlp import linalg
from hpnlp.config import ConfigError
from hpnlp.rnn import cells, fused
from hpnlp.rnn.dropout import (Dropout, RecurrentDropout, VariationalDropout, WeightDrop,
                               Zoneout, check_rate)

KINDS = tuple(cells.NUM_GATES)
COMBINES = ("last", "sum", "residual")
IMPLS = ("auto", "scan", "fused")


def _orthogonal_per_gate(key, shape, dtype=jnp.float32):
    """[D, H, K, H] with every [H, H] gate block orthogonal (as flax's cells do per gate)."""
    D, H, K, _ = shape
    keys = jax.random.split(key, D * K)
    # hpnlp.linalg, not nn.initializers.orthogonal: a vmapped LAPACK QR can deadlock XLA's
    # CPU thread pool (see hpnlp/linalg.py).
    blocks = jax.vmap(lambda k: linalg.orthogonal(k, (H, H), dtype))(keys)
    return blocks.reshape(D, K, H, H).transpose(0, 2, 1, 3)


def _gate_bias(kind: str):
    """LSTM gates (i, f, o, g): forget bias 1. GRU gates (r, z, n): reset bias -1."""
    gate, value = (1, 1.0) if kind == "lstm" else (0, -1.0)

    def init(key, shape, dtype=jnp.float32):
        return jnp.zeros(shape, dtype).at[:, gate, :].set(value)
    return init


def _param(module, name, init, names, shape, dtype):
    from hpnlp.compress.qlinear import param  # a packed quantized weight, where one is
    return param(module, name, nn.with_logical_partitioning(init, names), shape, dtype)


def _positive(x) -> bool:
    """A positive integer, Python's or NumPy's (a review, session 118: np.int64(256) was
    refused as "not a positive integer"); not a bool."""
    from hpnlp.kernels import is_integer
    return is_integer(x) and x > 0


def _check_fields(m) -> None:
    if m.kind not in KINDS:
        raise ConfigError(f"field `kind` = {m.kind!r} is not allowed: choose from {KINDS}")
    if not _positive(m.hidden):
        raise ConfigError(f"field `hidden` = {m.hidden!r} is not allowed: a positive integer")
    if not _positive(m.unroll):
        raise ConfigError(f"field `unroll` = {m.unroll!r} is not allowed: a positive integer")
    if m.chunk is not None and not _positive(m.chunk):
        raise ConfigError(f"field `chunk` = {m.chunk!r} is not allowed: a positive integer "
                          "(steps projected per product) or None (all steps in one product)")
    for f in ("dropout", "variational_dropout", "state_dropout", "recurrent_dropout", "zoneout",
              "weight_drop"):
        check_rate(f, getattr(m, f))
    if m.impl not in IMPLS:
        raise ConfigError(f"field `impl` = {m.impl!r} is not allowed: choose from {IMPLS}")


def _fused_blocker(m, deterministic: bool) -> str | None:
    """Why the fused kernel (`hpnlp.rnn.fused`) cannot run this layer; None if it can."""
    if m.kind != "lstm":
        return f"kind={m.kind!r} (the kernel is an LSTM)"
    if m.layer_norm:
        return "layer_norm=True"
    if m.zoneout > 0:
        return "zoneout > 0"
    if not deterministic and (m.recurrent_dropout > 0 or m.state_dropout > 0):
        return "recurrent_dropout or state_dropout in training"
    if not m.fast_backward:
        return "fast_backward=False (the autodiff twin of the scan)"
    if jnp.dtype(m.dtype) != jnp.float32:
        return f"dtype={jnp.dtype(m.dtype).name} (the kernel computes in float32)"
    if not fused.supports(m.hidden):
        return f"hidden={m.hidden} (the kernel needs a multiple of 16)"
    return fused.KERNEL.blocker()


class RNNLayer(nn.Module):
    """One LSTM/GRU layer, unidirectional or bidirectional, with length masks and dropout.

    `__call__(x_BLE, lengths_B=None, *, deterministic=True)` returns `(out_BLM, final)`
    with M = H, or 2H when bidirectional (forward features first); padded outputs are 0.
    `final` is the carry after each row's last real token: LSTM `(c, h)`, GRU `(h,)`,
    each [B, M] (bidirectional: forward state, then the backward state after it has read
    the whole row).

    Dropout fields (rates; RNG stream "dropout"; all off when deterministic):
      dropout: standard dropout of the layer's inputs, a fresh mask per element and step.
      variational_dropout: dropout of the inputs with one mask per sequence (Gal &
        Ghahramani 2016). Input masks are applied before the hoisted projection.
      state_dropout: variational dropout of h_{t-1} where it enters the recurrent product
        (Gal & Ghahramani 2016), one mask per sequence.
      recurrent_dropout: per-step dropout of the cell update (Semeniuta et al. 2016).
      zoneout: zoneout of c and h with independent masks (Krueger et al. 2017);
        evaluation uses the expectation.
      weight_drop: DropConnect of the recurrent matrix, one mask per forward pass
        (Wan et al. 2013; AWD-LSTM, Merity et al. 2018).

    `chunk`: steps whose input projection is one product (None: all L steps at once). The
    default 8 bounds a forward-only pass's projection buffer (evaluation, inference at long
    L); `chunk=None` trains at least as fast (see `cells.run_layer`).
    `fast_backward=False` runs the same scan under plain autodiff (the reference twin);
    `unroll` is passed to `lax.scan`.
    `impl`: "scan" runs the recurrence as an XLA `lax.scan` (`hpnlp.rnn.cells`); "fused"
    as one C++ kernel call per pass (`hpnlp.rnn.fused`: LSTM in float32 without layer
    norm, zoneout, or recurrent/state dropout in training, hidden a multiple of 16, one
    device; an error says which condition fails); "auto" (default) is "fused" wherever it
    can run and "scan" elsewhere. Both give the same outputs and reverse-mode gradients
    (`chunk` and `unroll` shape the scan only). Compute in `dtype` (matrix products), state
    and gate math in float32, parameters in `param_dtype`.

    Forward-mode autodiff (`jax.jvp`, `jax.jacfwd`, `jax.hessian`, JVP products) needs
    `fast_backward=False` (which also turns the fused kernel off): the hand-written
    backward and the fused kernel are `jax.custom_vjp`s, which JAX refuses to
    differentiate forward ("can't apply forward-mode autodiff (jvp) to a custom_vjp
    function"); a `custom_jvp` twin would lose the fast backward. Reverse over reverse
    (`grad` of `grad`) runs on the scan, fast backward included, but not through the
    fused kernel, whose C++ calls have no derivative of their own: use `impl="scan"`.
    """

    kind: str = "lstm"
    hidden: int = 256
    layer_norm: bool = False
    bidirectional: bool = False
    learned_init: bool = False
    dropout: float = 0.0
    variational_dropout: float = 0.0
    state_dropout: float = 0.0
    recurrent_dropout: float = 0.0
    zoneout: float = 0.0
    weight_drop: float = 0.0
    unroll: int = 1
    chunk: int | None = 8
    fast_backward: bool = True
    impl: str = "auto"
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    # config.QuantConfig (hpnlp.compress): "input" quantizes the input projection (weights
    # and the layer's inputs), "recurrent" the recurrent matrix (weights only: the state
    # h_{t-1} stays float32, which keeps the fused kernel usable).
    quant: Any = None

    @nn.compact
    def __call__(self, x_BLE, lengths_B=None, *, deterministic: bool = True):
        _check_fields(self)
        blocker = None if self.impl == "scan" else _fused_blocker(self, deterministic)
        if self.impl == "fused" and blocker is not None:
            raise ConfigError(f"field `impl` = 'fused' cannot run this layer: {blocker}. Use "
                              "impl='auto' (fused where it can run) or 'scan'")
        use_fused = self.impl != "scan" and blocker is None
        if x_BLE.ndim != 3:
            raise ValueError(f"RNNLayer expects inputs [batch, length, features], got shape "
                             f"{x_BLE.shape}")
        B, L, E = x_BLE.shape
        if lengths_B is not None:  # refused where bad, capped at L where traced
            lengths_B = cells.checked_lengths(lengths_B, B, L)
        D, K, H = (2 if self.bidirectional else 1), cells.NUM_GATES[self.kind], self.hidden
        G, pdt, dt = K * H, self.param_dtype, self.dtype

        # each direction's [E, K, H] its own fan-in E (a review (session 103): the direction axis
        # counted into it, so a bidirectional layer started sqrt(2) smaller than flax's)
        w_EDKH = _param(self, "input_kernel",
                        nn.initializers.lecun_normal(in_axis=0, out_axis=(2, 3), batch_axis=1),
                        ("embed", None, None, "mlp"), (E, D, K, H), pdt)
        w_DHKH = _param(self, "recurrent_kernel", _orthogonal_per_gate, (None, None, None, "mlp"),
                        (D, H, K, H), pdt)
        b_DKH = _param(self, "bias", _gate_bias(self.kind), (None, None, "mlp"), (D, K, H), pdt)
        pw = {}
        if self.kind == "gru":
            pw["hn_bias"] = _param(self, "hn_bias", nn.initializers.zeros, (None, "mlp"), (D, H), pdt)
        if self.layer_norm:
            ones = nn.initializers.ones
            ln_x_DG = _param(self, "ln_x_gain", ones, (None, None), (D, G), pdt)
            pw["ln_h_gain"] = _param(self, "ln_h_gain", ones, (None, None), (D, G), pdt)
            if self.kind == "lstm":
                pw["ln_c_gain"] = _param(self, "ln_c_gain", ones, (None, "mlp"), (D, H), pdt)
                pw["ln_c_bias"] = _param(self, "ln_c_bias", nn.initializers.zeros, (None, "mlp"),
                                         (D, H), pdt)
        pw = {k: v.astype(jnp.float32) for k, v in pw.items()}
        carry_names = ("init_c", "init_h") if self.kind == "lstm" else ("init_h",)
        if self.learned_init:
            init_DH = [_param(self, n, nn.initializers.zeros, (None, "mlp"), (D, H), pdt)
                       for n in carry_names]
        else:
            init_DH = [jnp.zeros((D, H), jnp.float32) for _ in carry_names]
        carry0 = tuple(jnp.broadcast_to(c.astype(jnp.float32)[:, None, :], (D, B, H))
                       for c in init_DH)

        x_BLE = Dropout(self.dropout, name="dropout")(x_BLE, deterministic=deterministic)
        x_BLE = VariationalDropout(self.variational_dropout, name="variational_dropout")(
            x_BLE, deterministic=deterministic)
        w_EDKH, w_DHKH, x_BLE = self._quantized(w_EDKH, w_DHKH, x_BLE, lengths_B)
        # Time-major, so that each scan step reads one contiguous slice; the backward
        # direction reads each row reversed within its length.
        x_LBE = jnp.swapaxes(x_BLE, 0, 1).astype(dt)
        x_DLBE = x_LBE[None] if D == 1 else jnp.stack(
            [x_LBE, cells.flip_within_length(x_LBE, lengths_B, time_major=True)])
        w_DEG = jnp.swapaxes(w_EDKH.reshape(E, D, G), 0, 1).astype(dt)
        b_DG = b_DKH.reshape(D, G).astype(jnp.float32)
        ln_x_DG = ln_x_DG.astype(jnp.float32) if self.layer_norm else jnp.zeros((D, 0))
        w_DHG = WeightDrop(self.weight_drop, name="weight_drop")(
            w_DHKH.reshape(D, H, G), deterministic=deterministic).astype(dt)

        valid_LB1 = None
        if lengths_B is not None:
            valid_LB1 = (jnp.arange(L)[:, None] < lengths_B[None, :]).astype(jnp.float32)[..., None]
        shape_DLBH = (D, L, B, H)
        zone = Zoneout(self.zoneout, name="zoneout")
        ex = cells.StepInputs(
            valid_B1=valid_LB1,
            update_BH=RecurrentDropout(self.recurrent_dropout, name="recurrent_dropout").masks(
                shape_DLBH, deterministic=deterministic),
            zone_c_BH=zone.masks(shape_DLBH, deterministic=deterministic) if self.kind == "lstm"
            else None,
            zone_h_BH=zone.masks(shape_DLBH, deterministic=deterministic))
        state_mask_DBH = None
        if not deterministic and self.state_dropout > 0:
            state_mask_DBH = VariationalDropout(self.state_dropout, time_axis=None,
                                                name="state_dropout").mask((D, B, H))
        step = functools.partial(cells.STEPS[self.kind],
                                 zoneout=self.zoneout if deterministic else 0.0)
        layer_norm = self.layer_norm

        def project(pp, x_TBE):
            # ONE product for all (or a chunk of) the steps, outside the recurrence.
            w_EG, b_G, ln_x_G = pp
            xw_TBG = jnp.einsum("tbe,eg->tbg", x_TBE, w_EG, preferred_element_type=jnp.float32)
            if layer_norm:  # Ba et al.: LN(W_x x) is per step but state-free, so hoisted
                xw_TBG = cells._layer_norm(xw_TBG.reshape(-1, G), ln_x_G).reshape(xw_TBG.shape)
            return xw_TBG + b_G[None, None]

        # The LSTM's pre-activation is xw + z unless z is layer-normalized: equal gradients.
        tied = self.kind == "lstm" and not layer_norm

        def one_direction(w_EG, b_G, ln_x_G, pw_d, w_HG, x_LBE, carry0_d, ex_d, mask_BH):
            if use_fused:  # plain LSTM: no per-step masks, pw and mask_BH are empty
                valid_LB = (jnp.ones((L, B), jnp.float32) if ex_d.valid_B1 is None
                            else ex_d.valid_B1[..., 0])
                return fused.lstm_layer(w_EG, b_G, w_HG, x_LBE, carry0_d, valid_LB)
            return cells.run_layer(step, project, (w_EG, b_G, ln_x_G), pw_d, w_HG, x_LBE,
                                   carry0_d, ex_d, mask_BH, chunk=self.chunk, unroll=self.unroll,
                                   fast_backward=self.fast_backward, tied=tied)

        args = (w_DEG, b_DG, ln_x_DG, pw, w_DHG, x_DLBE, carry0)
        if D == 1:
            ex0 = cells.StepInputs(ex.valid_B1, *(None if a is None else a[0] for a in ex[1:]))
            final, out_LBH = one_direction(
                *jax.tree_util.tree_map(lambda a: a[0], args), ex0,
                None if state_mask_DBH is None else state_mask_DBH[0])
            out_DLBH = out_LBH[None]
            final = tuple(f[None] for f in final)
        else:
            # Both directions in one scan (a batched product per step). The valid mask is
            # shared: reversal within length keeps the padding at the end.
            ex_axes = cells.StepInputs(None, *(None if a is None else 0 for a in ex[1:]))
            final, out_DLBH = jax.vmap(one_direction, in_axes=(
                0,) * len(args) + (ex_axes, None if state_mask_DBH is None else 0))(
                *args, ex, state_mask_DBH)
            out_DLBH = out_DLBH.at[1].set(cells.flip_within_length(out_DLBH[1], lengths_B,
                                                                   time_major=True))
        out_BLM = jnp.einsum("dlbh->bldh", out_DLBH).reshape(B, L, D * H).astype(dt)
        final = tuple(jnp.einsum("dbh->bdh", f).reshape(B, D * H) for f in final)
        return out_BLM, final


    def _quantized(self, w_EDKH, w_DHKH, x_BLE, lengths_B=None):
        """The input and recurrent products' operands under `quant` (hpnlp.compress); PTQ
        calibrates the input product's range over each row's first `lengths_B` steps (its
        padding left out, `qlinear.calibration_mask`)."""
        from hpnlp.compress.qlinear import (QWeight, calibration_mask, note_product, quant_act,
                                            quant_weight)
        note_product(self, "input_kernel", "input", (0,))  # [E, D, 4, H]
        note_product(self, "recurrent_kernel", "recurrent", (1,))  # [D, H, 4, H]
        q = self.quant
        if q is not None and (q.applies("input") or isinstance(w_EDKH, QWeight)):
            w_EDKH = quant_weight(w_EDKH, 1, q, self, "input_kernel")
            if q.applies("input"):
                valid_BL = (None if lengths_B is None
                            else jnp.arange(x_BLE.shape[1])[None, :] < lengths_B[:, None])
                with calibration_mask(self, valid_BL):
                    x_BLE = quant_act(self, "input", x_BLE, (-1,), q)
        if q is not None and (q.applies("recurrent") or isinstance(w_DHKH, QWeight)):
            # contraction (the H of h_{t-1}) first: [H, D, K, H], per-channel (D, K, H)
            packed = isinstance(w_DHKH, QWeight)
            w_HDKH = quant_weight(w_DHKH if packed else jnp.swapaxes(w_DHKH, 0, 1), 1, q, self,
                                  "recurrent_kernel")
            w_DHKH = jnp.swapaxes(w_HDKH, 0, 1)
        return w_EDKH, w_DHKH, x_BLE


class StackedRNN(nn.Module):
    """`num_layers` RNNLayers. `combine`: "last" returns the top layer's outputs, "sum"
    the sum of every layer's outputs, "residual" adds each layer's input to its output
    from the second layer on (the first layer's input is usually a different width).

    Every layer takes the dropout fields for its own input (so between layers); the
    stack's output is dropped once more with the same `dropout` / `variational_dropout`,
    as Gal & Ghahramani drop inputs and outputs. Returns (outputs, [final state per layer]).
    """

    num_layers: int = 2
    combine: str = "last"
    kind: str = "lstm"
    hidden: int = 256
    layer_norm: bool = False
    bidirectional: bool = False
    learned_init: bool = False
    dropout: float = 0.0
    variational_dropout: float = 0.0
    state_dropout: float = 0.0
    recurrent_dropout: float = 0.0
    zoneout: float = 0.0
    weight_drop: float = 0.0
    unroll: int = 1
    chunk: int | None = 8
    fast_backward: bool = True
    impl: str = "auto"
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    # config.QuantConfig (hpnlp.compress): "input" quantizes the input projection (weights
    # and the layer's inputs), "recurrent" the recurrent matrix (weights only: the state
    # h_{t-1} stays float32, which keeps the fused kernel usable).
    quant: Any = None

    @nn.compact
    def __call__(self, x_BLE, lengths_B=None, *, deterministic: bool = True):
        if self.combine not in COMBINES:
            raise ConfigError(f"field `combine` = {self.combine!r} is not allowed: choose from "
                              f"{COMBINES}")
        if not _positive(self.num_layers):
            raise ConfigError(f"field `num_layers` = {self.num_layers!r} is not allowed: a "
                              "positive integer")
        # Every RNNLayer setting the stack shares (all of RNNLayer's fields: it declares them).
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(RNNLayer)
                  if f.name not in ("parent", "name")}
        h, total, finals = x_BLE, None, []
        for i in range(self.num_layers):
            out, final = RNNLayer(**fields, name=f"layer_{i}")(h, lengths_B,
                                                               deterministic=deterministic)
            finals.append(final)
            if self.combine == "residual" and i > 0:
                out = out + h
            total = out if total is None else total + out
            h = out
        y = total if self.combine == "sum" else h
        y = Dropout(self.dropout, name="output_dropout")(y, deterministic=deterministic)
        y = VariationalDropout(self.variational_dropout, name="output_variational_dropout")(
            y, deterministic=deterministic)
        return y, finals


def _gates(blocks, axis):
    """Per-gate [X, H] blocks (in our gate order) stacked into [..., K, H] with a
    direction axis of size 1 at `axis`."""
    return jnp.expand_dims(jnp.stack([jnp.asarray(b) for b in blocks], axis=-2), axis)


def from_flax_lstm(cell_params: dict) -> dict:
    """Parameters of `RNNLayer(kind="lstm")` (unidirectional, no layer norm) holding the
    same weights as a `flax.linen.OptimizedLSTMCell` / `LSTMCell` parameter dict (the
    cell's: `variables["params"]["cell"]` of an `nn.RNN`). Flax keeps one [X, H] block per
    gate (ii/if/ig/io without bias, hi/hf/hg/ho with bias); ours fuses them in gate
    order (i, f, o, g)."""
    p, gates = cell_params, ("i", "f", "o", "g")
    return {"input_kernel": _gates([p[f"i{g}"]["kernel"] for g in gates], 1),
            "recurrent_kernel": _gates([p[f"h{g}"]["kernel"] for g in gates], 0),
            "bias": _gates([p[f"h{g}"]["bias"] for g in gates], 0)}


def from_flax_gru(cell_params: dict) -> dict:
    """Parameters of `RNNLayer(kind="gru")` (unidirectional, no layer norm) holding the
    same weights as a `flax.linen.GRUCell` parameter dict (ir/iz/in with bias, hr/hz
    without, hn with bias); gate order (r, z, n)."""
    p, gates = cell_params, ("r", "z", "n")
    return {"input_kernel": _gates([p[f"i{g}"]["kernel"] for g in gates], 1),
            "recurrent_kernel": _gates([p[f"h{g}"]["kernel"] for g in gates], 0),
            "bias": _gates([p[f"i{g}"]["bias"] for g in gates], 0),
            "hn_bias": jnp.asarray(p["hn"]["bias"])[None]}
