"""The LSTM recurrence as one fused CPU kernel per direction of the pass (`fused_lstm.cc`).

    final, out_LBH = lstm_layer(w_EG, b_G, w_HG, x_LBE, (c0_BH, h0_BH), valid_LB)

is `hpnlp.rnn.cells.run_layer` for the LSTM without layer norm or per-step masks, but the
L recurrent steps run inside one XLA FFI call forward and one backward instead of an XLA
`while` loop with several kernel launches per step. The forward computes the input
projection x_t W_x itself, for blocks of steps (about 256 rows a block, k over E), whose
sums start each step's recurrent product h_{t-1} W_h (k over H), and the backward the input
gradient dz W_x^T by the same blocks of steps, so neither [L, B, 4H]-sized product runs in
XLA (a review, session 118: this said one product of [x_t | h_{t-1}] [W_x; W_h] a step, the
kernel's form until 2026-11-30); the two weight gradients are one product over all steps,
one call of the kernel's packed product (`lstm_weight_grads`). Each of the kernel's threads
owns a share of the hidden units, in tiles of one vector (16 with AVX-512, 8 with AVX2), and
computes a tile's four gates in registers, with the gate arithmetic applied straight to
the accumulators (see the top of `fused_lstm.cc`).

The kernel is C++ compiled on first use (`hpnlp.kernels`: the machine's `g++`, cached per
source, compiler, jaxlib (its version and FFI headers) and CPU). Where there is no compiler
or the platform is not a CPU, `available()` is False with the reason in
`unavailable_reason()`, and `RNNLayer(impl="auto")` uses the XLA scan.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

from hpnlp import kernels
from hpnlp.kernels import tuning

# Below this many multiply-adds per step one thread is faster than several meeting at a
# barrier every step.
_MIN_PARALLEL_MACS = 1 << 20

KERNEL = kernels.CpuKernel(
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "fused_lstm.cc"),
    {"hpnlp_lstm_fwd": "HpnlpLstmFwd", "hpnlp_lstm_bwd": "HpnlpLstmBwd",
     "hpnlp_lstm_dw": "HpnlpLstmDw"}, what="the fused LSTM")


# The products' blocking, per pass: kc (k per cache block of each product: a kc x 64 panel
# block in L1 at kc = 128 with AVX-512, in L2 at the larger ones; the forward's two products
# run k over E (the input projection) and over H (the recurrent one), the backward's over
# 4H) and mr (rows per register block, <= 6). Defaults tuned on a 2-core
# AVX-512 Xeon; each CPU gets its own choice, measured on first use at the probe shape
# (the forward's input width E = H) and cached (`hpnlp.kernels.tuning`); `blocking=`
# overrides.
DEFAULT_BLOCKING = {"kc": 128, "mr": 6}
PROBE = dict(B=32, H=512, L=16)


def _probe(backward: bool):
    def run(lib, cfg):
        args = [PROBE["B"], PROBE["H"], PROBE["L"], cfg["kc"], cfg["mr"], int(backward),
                default_threads(PROBE["B"], PROBE["H"])]
        return tuning.run_probe(lib, "hpnlp_lstm_probe", args, "the fused LSTM's tuning probe",
                                cfg)
    return run


TUNINGS = {name: tuning.Tuning(
    KERNEL, name, default=DEFAULT_BLOCKING, probe=_probe(name == "bwd"),
    candidates=[{"kc": kc, "mr": mr} for kc in (64, 128, 256, 512, 1024)
                for mr in (4, 5, 6)],
    shape=" ".join(f"{k}={v}" for k, v in PROBE.items())) for name in ("fwd", "bwd")}


# The weight gradients' blocking (`lstm_weight_grads`): kc rows of dz per packed block, mc
# rows of the result per packed block of hp or x. Tuned per CPU like the scans', at a probe
# of N = L*B = 1024 rows, H = E = 512.
DEFAULT_DW_BLOCKING = {"kc": 256, "mc": 144}
DW_PROBE = dict(N=1024, H=512, E=512)


def _probe_dw(lib, cfg):
    args = [DW_PROBE["N"], DW_PROBE["H"], DW_PROBE["E"], cfg["kc"], cfg["mc"], kernels.cores()]
    return tuning.run_probe(lib, "hpnlp_lstm_dw_probe", args,
                            "the fused LSTM's weight-gradient probe", cfg)


TUNINGS["dw"] = tuning.Tuning(
    KERNEL, "dw", default=DEFAULT_DW_BLOCKING, probe=_probe_dw,
    candidates=[{"kc": kc, "mc": mc} for kc in (128, 256, 512) for mc in (48, 96, 144, 240)],
    shape=" ".join(f"{k}={v}" for k, v in DW_PROBE.items()))


def _check_threads(threads) -> None:
    """Found in review: threads=0, -4 or 2.7 ran on one or two threads without a word (the
    kernel clamps and the attribute truncates them); refused as the other kernels' wrappers
    do, before anything is built or tuned."""
    if threads is not None and (not kernels.is_integer(threads) or threads < 1):
        raise ValueError(f"fused LSTM: threads must be an integer >= 1 (None: chosen by the "
                         f"problem's size); got {threads!r}")


def _blocking(name: str, given: dict | None) -> dict:
    cfg = dict(given) if given is not None else TUNINGS[name].config()
    # found in review: a float block ({"kc": 100.7}) ran truncated to 100 without a word
    if (not all(kernels.is_integer(v) for v in cfg.values())
            or any(v >= 2 ** 31 for v in cfg.values())):
        raise ValueError(f"fused LSTM: block sizes must be integers that fit int32; got {given}")
    if name == "dw":
        if set(cfg) != {"kc", "mc"} or cfg["kc"] <= 0 or cfg["mc"] <= 0:
            raise ValueError(f"fused LSTM: weight-gradient blocking must be {{'kc': > 0, "
                             f"'mc': > 0}}; got {given}")
    elif set(cfg) != {"kc", "mr"} or cfg["kc"] <= 0 or not 1 <= cfg["mr"] <= 6:
        raise ValueError(f"fused LSTM: blocking must be {{'kc': > 0, 'mr': 1..6}}; got {given}")
    return {k: np.int64(v) for k, v in cfg.items()}


def available() -> bool:
    """Whether the fused kernel can run here (compiles it on the first call)."""
    return KERNEL.available()


def unavailable_reason() -> str | None:
    return KERNEL.unavailable_reason()


def supports(hidden: int) -> bool:
    """The kernel takes hidden sizes in multiples of 16 (its tiles are 16 or 8 units), and
    not 0 (a review, session 117: its backward wrote no x-gradient there)."""
    return hidden > 0 and hidden % 16 == 0


def default_threads(B: int, H: int) -> int:
    if B * H * 4 * H < _MIN_PARALLEL_MACS:
        return 1
    return max(1, min(kernels.cores(), H // 16))


def _call(target: str, out_shapes, *args, B: int, H: int, threads: int | None, **attrs):
    """The FFI call on float32 operands; `threads` None: `default_threads(B, H)`."""
    reason = KERNEL.unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"the fused LSTM kernel is unavailable: {reason}. Use "
                           "impl='scan' (the XLA recurrence) instead.")
    if not supports(H):  # (a review, session 117: H = 0's backward wrote no x-gradient)
        raise ValueError(f"the fused LSTM kernel takes a hidden size that is a positive "
                         f"multiple of 16, not {H}; use impl='scan' (the XLA recurrence)")
    threads = default_threads(B, H) if threads is None else threads
    out_types = [jax.ShapeDtypeStruct(s, jnp.float32) for s in out_shapes]
    return jax.ffi.ffi_call(target, out_types, vmap_method="sequential")(
        *(a.astype(jnp.float32) for a in args), threads=np.int64(threads), **attrs)


def lstm_forward(x_LBE, w_EG, b_G, w_HG, c0_BH, h0_BH, valid_LB, *, save: bool = True,
                 threads: int | None = None, blocking: dict | None = None):
    """The LSTM forward over a time-major x, its input projection (x W_x + b) included:
    (out_BLH, (c_BH, h_BH) final state, hp_LBH, cc_LBH, act_LBG) with, when `save`, what
    the backward pass reads: h entering every step, c after it, and the activated gates
    (i, f, o, g); without `save` those three are empty (a forward pass only)."""
    _check_threads(threads)
    L, B, _ = x_LBE.shape
    H, G = w_HG.shape
    n = L if save else 0
    out, c, h, hp, cc, act = _call(
        "hpnlp_lstm_fwd", [(B, L, H), (B, H), (B, H), (n, B, H), (n, B, H), (n, B, G)],
        x_LBE, w_EG, b_G, w_HG, c0_BH, h0_BH, valid_LB, B=B, H=H, threads=threads, save=save,
        **_blocking("fwd", blocking))
    return out, (c, h), hp, cc, act


def lstm_backward(act_LBG, cc_LBH, c0_BH, w_HG, w_EG, valid_LB, d_out_BLH, d_h_BH, d_c_BH, *,
                  threads: int | None = None, blocking: dict | None = None):
    """The recurrence backward: (dz_LBG, db_G, d_h0_BH, d_c0_BH, d_x_LBE), dz the gradient
    of the gate pre-activations (equal to that of the input projection), db its sum over
    steps and rows (the bias gradient) and d_x = dz W_x^T the input's gradient."""
    _check_threads(threads)
    L, B, G = act_LBG.shape
    H, E = G // 4, w_EG.shape[0]
    return _call("hpnlp_lstm_bwd", [(L, B, G), (G,), (B, H), (B, H), (L, B, E)], act_LBG,
                 cc_LBH, c0_BH, w_HG, w_EG, valid_LB, d_out_BLH, d_h_BH, d_c_BH, B=B, H=H,
                 threads=threads, **_blocking("bwd", blocking))


def lstm_weight_grads(hp_LBH, x_LBE, dz_LBG, *, threads: int | None = None,
                      blocking: dict | None = None):
    """(dW_h, dW_x) = (hp^T dz, x^T dz) summed over all L*B rows, as one kernel call that
    packs dz once for both (XLA:CPU runs these products, which contract both operands'
    leading axis, in Eigen; see fused_lstm.cc). `threads` None: every core, or one for a
    small product; `lstm_layer`'s `threads` sets it too."""
    _check_threads(threads)
    L, B, G = dz_LBG.shape
    H, E = G // 4, x_LBE.shape[-1]
    if threads is None:
        threads = 1 if L * B * (H + E) * G < _MIN_PARALLEL_MACS else kernels.cores()
    return _call("hpnlp_lstm_dw", [(H, G), (E, G)], hp_LBH, x_LBE, dz_LBG, B=B, H=H,
                 threads=threads, **_blocking("dw", blocking))


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def lstm_layer(w_EG, b_G, w_HG, x_LBE, carry0, valid_LB, threads=None):
    """Input projection (x W_x + b) and LSTM recurrence over a time-major x_LBE; returns
    ((c_BH, h_BH) final carry, out_LBH). `valid_LB` is 1.0 on real tokens and 0.0 on
    padding (padding keeps the state and outputs 0)."""
    return _forward(w_EG, b_G, w_HG, x_LBE, carry0, valid_LB, threads, save=False)[0]


def _forward(w_EG, b_G, w_HG, x_LBE, carry0, valid_LB, threads, *, save):
    c0_BH, h0_BH = carry0
    # The input projection runs inside the kernel, step by step, in the recurrent product.
    out_BLH, (c, h), *res = lstm_forward(x_LBE, w_EG, b_G, w_HG, c0_BH, h0_BH, valid_LB,
                                         save=save, threads=threads)
    final = (c.astype(c0_BH.dtype), h.astype(h0_BH.dtype))
    return (final, jnp.swapaxes(out_BLH, 0, 1)), res


def _lstm_layer_fwd(w_EG, b_G, w_HG, x_LBE, carry0, valid_LB, threads):
    out, res = _forward(w_EG, b_G, w_HG, x_LBE, carry0, valid_LB, threads, save=True)
    return out, (w_EG, b_G, w_HG, x_LBE, carry0, valid_LB, *res)


def _lstm_layer_bwd(threads, res, cts):
    w_EG, b_G, w_HG, x_LBE, (c0_BH, h0_BH), valid_LB, hp_LBH, cc_LBH, act_LBG = res
    (d_c_BH, d_h_BH), d_out_LBH = cts
    dz_LBG, db_G, d_h0_BH, d_c0_BH, d_x_LBE = lstm_backward(
        act_LBG, cc_LBH, c0_BH, w_HG, w_EG, valid_LB, jnp.swapaxes(d_out_LBH, 0, 1), d_h_BH,
        d_c_BH, threads=threads)
    # As in cells._fast_layer_bwd, every weight gradient is one product over all N = L*B
    # rows: dW_h = h_prev^T dz and dW_x = x^T dz (one kernel call); dx came from the scan.
    d_w_HG, d_w_EG = lstm_weight_grads(hp_LBH, x_LBE, dz_LBG, threads=threads)
    return (d_w_EG.astype(w_EG.dtype), db_G.astype(b_G.dtype), d_w_HG.astype(w_HG.dtype),
            d_x_LBE.astype(x_LBE.dtype),
            (d_c0_BH.astype(c0_BH.dtype), d_h0_BH.astype(h0_BH.dtype)), jnp.zeros_like(valid_LB))


lstm_layer.defvjp(_lstm_layer_fwd, _lstm_layer_bwd)
