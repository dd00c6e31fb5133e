"""Quantized CPU products (`qgemm.cc`), each beside its exact XLA twin.

    w = prepare_int8_weight(q_KxN, scale_N)       # once, at load time
    y_MxN = int8_linear(x_MxK, w)                 # w8a8: per-token int8 activations
    b = prepare_binary_weight(bits_KbxN, alpha_N, k=K)
    y_MxN = binary_linear(x_MxK, b)               # XNOR-Net: sign(x) . sign(w)
    q = prepare_int4_weight(packed_KhxN, scale_GxN, k=K)
    y_MxN = int4_linear(x_MxK, q)                 # weight-only int4, groups along K

Three XLA FFI CPU kernels, written for inference; differentiated as their twins (every
derivative, forward and reverse mode, is the twin's: `hpnlp.kernels.with_twin_gradient`),
so `impl="auto"` has the same gradient whether or not the kernel runs: int4's is x's exact
float gradient (what an adapter trained over a frozen int4 layer needs), int8's and
binary's their quantizers' (rounding and sign have none; the scales and the bias carry
one). A weight's gradient lands on the twin's leaves (`scale_N`, `alpha_N`, `scale_GxN`),
not on the kernel's panels: train the float weight and prepare it again, not a prepared
weight's leaves.

- int8 x int8 -> int32 (`int8_matmul`, exact), and `int8_linear`, which quantizes the
  activations per token inside the kernel (formats.py's int8 codes, `quantize_rows_int8`:
  scale max|row| / 127, round to nearest even, clip to [-127, 127]) and rescales the int32
  product by both scales. AVX-512 VNNI (`vpdpbusd` on x + 128 as u8, minus 128 colsum(w))
  or AVX2 (int16 `vpmaddwd`); see the top of `qgemm.cc` for why not `vpmaddubsw`. On AMX
  (`int8_products()`), `tdpbusd` tiles from 16 rows.
- binary (`binary_matmul` on packed bits, exact: K - 2 popcount(x xor w); `binary_linear`
  binarizes x by sign with XNOR-Net's per-token scale beta = mean|x|). VPOPCNTDQ or the
  AVX2 nibble-LUT popcount (Mula); on AMX (`binary_products()`), the +-1 values as int8
  on `tdpbssd` tiles from `AMX_MIN_ROWS` rows.
- int4 weight-only (`int4_linear`): nibbles unpacked and scaled in registers, float
  accumulation; for memory-bound decoding (the weight is an eighth of float32's bytes).

Each kernel's instructions are chosen at build time by the CPU's features
(`hpnlp.kernels`: `-march=native`, cached per source, jaxlib and CPU). Weights are packed
once (`prepare_*`) into the build's panel layout (`layout()`); a prepared weight keeps the
canonical packed form (`hpnlp.compress.packing`) too, which its XLA twin reads. The
wrappers take `impl="auto"|"kernel"|"xla"`: "auto" runs the kernel where it can
(`KERNEL.blocker()`: a CPU backend, a compiler, one device) and the twin elsewhere.
Prepared weights are runtime objects, not a storage format: a panel layout belongs to one
build.

`python -m hpnlp.compress.kernels` times the [2048, 1024 -> 4096] layer and int4
decoding against float32 XLA (`time_linear`), with freed buffers kept for reuse
(`hpnlp.kernels.reuse_freed_memory`; `--malloc default` shows glibc's page faults).

Shape letters: M rows (tokens), K contraction, N output channels, Kb = ceil(K/8) packed
bytes of bits, Kh = ceil(K/2) packed int4 pairs, G scale groups along K.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from hpnlp import kernels, xla_workarounds
from hpnlp.compress import formats, packing
from hpnlp.kernels import tuning

KERNEL = kernels.CpuKernel(
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "qgemm.cc"),
    {"hpnlp_int8_matmul": "HpnlpInt8Matmul", "hpnlp_int8_linear": "HpnlpInt8Linear",
     "hpnlp_binary_matmul": "HpnlpBinaryMatmul", "hpnlp_binary_linear": "HpnlpBinaryLinear",
     "hpnlp_int4_linear": "HpnlpInt4Linear"},
    what="quantized GEMM")

IMPLS = ("auto", "kernel", "xla")
# Below this many multiply-adds one thread beats two. The helpers are threads that persist
# across calls (`Pool` in qgemm.cc), spin briefly between calls and claim work dynamically,
# so a parallel call costs about a microsecond and never waits for a helper that a busy
# machine has not scheduled. `python -m hpnlp.compress.kernels --one-row` measures one row
# (decoding) on one thread against two; on a 2-core Xeon (model 207), microseconds: int4
# [1, 256 -> 256] 3.4/4.0, [1, 256 -> 512] 6.4/6.0, [1, 512 -> 2048] 48/29; int8
# [1, 256 -> 512] 2.1/2.9, [1, 512 -> 512] 3.9/3.8, [1, 512 -> 2048] 14/10 (at commit
# a490506, 2026-11-24, before the helpers inside an XLA call became its intra-op threads;
# docs/quant.md quotes this measurement). The binary kernel counts in 32-bit words of K
# (its threshold predates these measurements).
_MIN_PARALLEL_MACS = {"int8": 1 << 18, "int4": 1 << 17, "binary": 1 << 21}

# Blocking of the int8 and binary products: mc rows per work item (a thread keeps their
# activations in L2 while it walks its weight panels) and mr rows per register block.
# Chosen per CPU on first use at the probe shape (`hpnlp.kernels.tuning`); `blocking=`
# overrides. The defaults run on every build; wider register blocks only where the build
# has them (int8: 6 rows, 8 with VNNI; binary: 4, 6 with VPOPCNTDQ's 32-column panels).
DEFAULT_BLOCKING = {"int8": {"mc": 128, "mr": 6}, "binary": {"mc": 128, "mr": 4}}
_MR = {"int8": (4, 6, 8), "binary": (2, 3, 4, 6)}
PROBE = dict(M=512, K=1024, N=1024)


def _probe(kind: int):
    def run(lib, cfg):
        args = [kind, PROBE["M"], PROBE["K"], PROBE["N"], cfg["mc"], cfg["mr"], kernels.cores()]
        return tuning.run_probe(lib, "hpnlp_qgemm_probe", args,
                                "the quantized GEMM's tuning probe", cfg)
    return run


TUNINGS = {name: tuning.Tuning(
    KERNEL, name, default=DEFAULT_BLOCKING[name], probe=_probe(kind),
    candidates=[{"mc": mc, "mr": mr} for mc in (64, 128, 256, 512) for mr in _MR[name]],
    shape=" ".join(f"{k}={v}" for k, v in PROBE.items()),
    applies=lambda lib, cfg, name=name: cfg["mr"] <= layout()[f"{name}_max_mr"])
    for kind, name in enumerate(("int8", "binary"))}


def available() -> bool:
    """Whether the kernels can run here (compiles them on the first call)."""
    return KERNEL.available()


def unavailable_reason() -> str | None:
    return KERNEL.unavailable_reason()


@functools.lru_cache(maxsize=None)
def layout() -> dict[str, int | str]:
    """The build's instruction paths and panel layouts (see `hpnlp_qgemm_layout`), and
    how the int8 products run in this process (`int8_products`)."""
    lib = KERNEL.library()
    lib.hpnlp_qgemm_layout.restype = ctypes.c_int64
    v = [lib.hpnlp_qgemm_layout(ctypes.c_int64(i)) for i in range(9)]
    return {"int8_path": ("portable", "avx2", "avx512_vnni")[v[0]], "int8_kp": v[1],
            "int8_nb": v[2], "int8_max_mr": v[3],
            "binary_path": ("portable", "avx2", "avx512_vpopcntdq")[v[4]], "binary_nb": v[5],
            "binary_max_mr": v[6], "int4_nb": v[7], "binary_xw": v[8],
            "int8_products": int8_products(), "binary_products": binary_products()}


def int8_products() -> str:
    """How the int8 kernel's products run here: "amx" (AMX tiles from 16 rows: every row,
    in 32-row blocks, over whole 64-k tiles, the rest of k on vpdpbusd; under 16 rows all
    on vpdpbusd), else the build's `int8_path`. AMX needs the OS to grant the tile state
    (Linux >= 5.16); where it does not, the products stay on vpdpbusd."""
    lib = KERNEL.library()
    lib.hpnlp_qgemm_int8_products.restype = ctypes.c_int64
    return ("portable", "avx2", "avx512_vnni", "amx")[lib.hpnlp_qgemm_int8_products()]


def binary_products() -> str:
    """How the binary kernel's products run here: "amx" (the +-1 values as int8 on AMX
    tiles; `prepare_binary_weight` then packs the sign bits in the tiles' order), else the
    build's `binary_path` (xor and popcount)."""
    lib = KERNEL.library()
    lib.hpnlp_qgemm_binary_products.restype = ctypes.c_int64
    return ("portable", "avx2", "avx512_vpopcntdq", "amx")[lib.hpnlp_qgemm_binary_products()]


def _register(cls, data, meta):
    cls = dataclasses.dataclass(frozen=True)(cls)
    jax.tree_util.register_dataclass(cls, data_fields=data, meta_fields=meta)
    return cls


class Int8Weight:
    """An int8 weight for `int8_matmul` / `int8_linear`: q_KxN (the twin's operand),
    scale_N, and the kernel's panels [P, ceil(K/kp), nb, kp] (int16 on AVX2, int8 with
    VNNI) with colsum_N (None where the kernel cannot run)."""
    q_KxN: jax.Array
    scale_N: jax.Array
    panels: jax.Array | None
    colsum: jax.Array | None


class BinaryWeight:
    """A binary weight for `binary_matmul` / `binary_linear`: bits_KbxN (packing.pack_bits
    along K, the twin's operand), alpha_N, and the kernel's panels [P, ceil(K/64), xw,
    nb, 8] (each column's 64-bit words along K, as bytes; xw = 2 on AVX2: the words'
    low and high nibbles, for the vpshufb popcount). Where the products run on AMX
    (`binary_products`), amx_panels holds the same bits in the tiles' order, for products
    of at least `AMX_MIN_ROWS` rows (None elsewhere)."""
    bits_KbxN: jax.Array
    alpha_N: jax.Array
    panels: jax.Array | None
    k: int
    amx_panels: jax.Array | None = None


class Int4Weight:
    """An int4 weight for `int4_linear`: packed_KhxN (packing.pack_int4 along K, the twin's
    operand), scale_GxN (group g = K / G along K), and the kernel's panels
    [P, Kh, nb] uint8 with panel_scales [P, G, nb]."""
    packed_KhxN: jax.Array
    scale_GxN: jax.Array
    panels: jax.Array | None
    panel_scales: jax.Array | None
    k: int


Int8Weight = _register(Int8Weight, ["q_KxN", "scale_N", "panels", "colsum"], [])
BinaryWeight = _register(BinaryWeight, ["bits_KbxN", "alpha_N", "panels", "amx_panels"], ["k"])
Int4Weight = _register(Int4Weight, ["packed_KhxN", "scale_GxN", "panels", "panel_scales"], ["k"])


# ------------------------------------------------------------------------------ checks

def _check(what: str, name: str, a, *, ndim: int, dtype, shape=None):
    if not hasattr(a, "shape") or not hasattr(a, "dtype"):
        raise ValueError(f"{what}: {name} must be an array; got {type(a).__name__}")
    if a.ndim != ndim:
        raise ValueError(f"{what}: {name} must have {ndim} dims; got shape {tuple(a.shape)}")
    if jnp.dtype(a.dtype) != jnp.dtype(dtype):
        raise ValueError(f"{what}: {name} must be {jnp.dtype(dtype).name}; got {a.dtype}")
    if shape is not None and tuple(a.shape) != tuple(shape):
        raise ValueError(f"{what}: {name} must have shape {tuple(shape)}; got {tuple(a.shape)}")


def _check_impl(what: str, impl: str):
    if impl not in IMPLS:
        raise ValueError(f"{what}: impl must be one of {IMPLS}; got {impl!r}")


def _use_kernel(what: str, impl: str, panels) -> bool:
    _check_impl(what, impl)
    if impl == "xla":
        return False
    reason = KERNEL.blocker()
    if reason is None and panels is None:
        reason = "the weight was prepared without the kernel's panels"
    if reason is not None and impl == "kernel":
        raise RuntimeError(f"{what}: the quantized GEMM kernel cannot run here: {reason}. Use "
                           "impl='xla' (the XLA twin) instead.")
    return reason is None


def _check_options(what: str, threads, blocking=None) -> None:
    """`threads` and `blocking` checked whichever path runs, before any compile (found in
    review: with impl="xla", or "auto" where the kernel cannot run, threads=0 passed)."""
    if threads is not None and (not kernels.is_integer(threads) or threads < 1):
        raise ValueError(f"{what}: threads must be an integer >= 1; got {threads!r}")
    # a review (r12): {"mc": 64.5, "mr": 2.7} ran as 64 and 2, and {"mc": "64"} was a bare
    # TypeError
    if blocking is not None and (
            not isinstance(blocking, dict) or set(blocking) != {"mc", "mr"}
            or not all(kernels.is_integer(v) for v in blocking.values())
            or not 1 <= blocking["mc"] <= 2**30 or blocking["mr"] < 1):
        raise ValueError(f"{what}: blocking must be {{'mc': an integer 1..2**30, 'mr': an "
                         f"integer >= 1}}; got {blocking!r}")


def _threads(threads: int | None, M: int, K: int, N: int, kind: str) -> np.int64:
    """The kernel's thread count (`threads` already checked by `_check_options`)."""
    if threads is None:
        threads = 1 if M * K * N < _MIN_PARALLEL_MACS[kind] else kernels.cores()
    return np.int64(threads)


def _blocking(name: str, given: dict | None) -> dict:
    cfg = dict(given) if given is not None else TUNINGS[name].config()
    top = layout()[f"{name}_max_mr"]
    # mc at most 2**30: the kernel counts row chunks in a C int ((M + mc - 1) / mc)
    if set(cfg) != {"mc", "mr"} or not 1 <= cfg["mc"] <= 2**30 or not 1 <= cfg["mr"] <= top:
        raise ValueError(f"{name} kernel: blocking must be {{'mc': 1..2**30, 'mr': 1..{top}}}; "
                         f"got {cfg}" + ("" if given is not None else " (the tuned blocks)"))
    return {k: np.int64(v) for k, v in cfg.items()}


def _pad_to(a, rows: int, cols: int):
    return jnp.pad(a, ((0, rows - a.shape[0]), (0, cols - a.shape[1])))


def _can_pack() -> bool:
    return KERNEL.available()


# -------------------------------------------------------------------------------- int8

def prepare_int8_weight(q_KxN, scale_N=None) -> Int8Weight:
    """Pack an int8 weight (values in [-127, 127]) and its per-output-channel scales
    (default ones) once, for `int8_matmul` / `int8_linear`."""
    q_KxN = jnp.asarray(q_KxN)
    _check("prepare_int8_weight", "q_KxN", q_KxN, ndim=2, dtype=jnp.int8)
    K, N = q_KxN.shape
    scale_N = jnp.ones((N,), jnp.float32) if scale_N is None else jnp.asarray(scale_N)
    _check("prepare_int8_weight", "scale_N", scale_N, ndim=1, dtype=jnp.float32, shape=(N,))
    panels = colsum = None
    if _can_pack():
        lay = layout()
        kp, nb = lay["int8_kp"], lay["int8_nb"]
        P, kq = -(-N // nb), -(-K // kp)
        w = _pad_to(q_KxN, kq * kp, P * nb).reshape(kq, kp, P, nb).transpose(2, 0, 3, 1)
        panels = w.astype(jnp.int8 if lay["int8_path"] == "avx512_vnni" else jnp.int16)
        colsum = jnp.pad(jnp.sum(q_KxN, axis=0, dtype=jnp.int32), (0, P * nb - N))
    return Int8Weight(q_KxN, scale_N, panels, colsum)


def _as_int8_weight(w) -> Int8Weight:
    return w if isinstance(w, Int8Weight) else prepare_int8_weight(w)


def quantize_rows_int8(x_MxK):
    """Per-row (per-token) symmetric int8: (q_MxK int8, scale_M) with scale s = max|row| *
    fl(1 / 127) and q = clip(round(x * fl(1 / s)), -127, 127) (round half to even):
    formats.py's int8 rule as XLA computes it, which QAT and the packed model decoded in XLA
    run, code for code (a review (r5): the factor was fl(127 / max|row|), which differs from
    fl(1 / s) in its last bit at some rows and rounded a value near a half-step the other
    way). A row of zeros has scale 0; a row holding a NaN has scale NaN, one holding an inf
    scale inf, and both q = 0 (so their outputs are NaN); a row with 0 < max|row| <=
    formats.TINY (1e-30) has q = 0, as formats codes it (its scale max|row| * fl(1 / 127),
    its outputs 0; this takes in the rows where 127 / max|row| overflowed to inf, review
    r5). The int8 kernel computes exactly this."""
    amax_M1 = jnp.max(jnp.abs(x_MxK), axis=1, keepdims=True, initial=0.0)  # K = 0: 0
    # a bug hunt (session 97): XLA:CPU's row max dropped a NaN at some shapes (a [141, 70]
    # input, jax 0.10.2; a [3, 40] one kept it), and NaN * 0 was cast to int8 as it fell
    amax_M1 = jnp.where(jnp.isnan(x_MxK).any(axis=1, keepdims=True), jnp.nan, amax_M1)
    scale_M1 = amax_M1 * (1.0 / 127)  # formats.Uniform's scale and factor, written alike
    ok_M1 = (amax_M1 > formats.TINY) & jnp.isfinite(amax_M1)  # else every code is 0
    inv_M1 = 1.0 / jnp.where(ok_M1, scale_M1, 1.0)
    x_MxK = jnp.where(ok_M1, x_MxK * inv_M1, 0.0)
    q_MxK = jnp.clip(jnp.round(x_MxK), -127, 127).astype(jnp.int8)
    return q_MxK, scale_M1[:, 0]


def int8_matmul_xla(x_MxK, q_KxN):
    """The XLA twin of `int8_matmul`: an exact int32 product."""
    return jax.lax.dot_general(x_MxK, q_KxN, (((1,), (0,)), ((), ())),
                               preferred_element_type=jnp.int32)


# The activations `int8_linear` can apply in its epilogue: {name: (the kernel's code, the
# XLA function its twin applies)}. "gelu" is flax's nn.gelu, the tanh form.
ACTIVATIONS = {"gelu": (1, functools.partial(jax.nn.gelu, approximate=True))}


def _activation_code(what: str, activation: str | None) -> int:
    if activation is None:
        return 0
    if activation not in ACTIVATIONS:
        raise ValueError(f"{what}: unknown activation {activation!r}; the kernel applies "
                         f"{sorted(ACTIVATIONS)} or None")
    return ACTIVATIONS[activation][0]


def _check_bias(what: str, bias, n: int):
    if bias is not None:
        _check(what, "bias", bias, ndim=1, dtype=jnp.float32)
        if bias.shape[0] != n:
            raise ValueError(f"{what}: bias has {bias.shape[0]} entries but the weight has N = {n}")


def int8_linear_xla(x_MxK, weight: Int8Weight, *, bias=None, activation: str | None = None):
    """The XLA twin of `int8_linear`, operation for operation."""
    _activation_code("int8_linear_xla", activation)
    q_MxK, scale_M = quantize_rows_int8(x_MxK.astype(jnp.float32))
    acc_MxN = int8_matmul_xla(q_MxK, weight.q_KxN)
    y_MxN = acc_MxN.astype(jnp.float32) * scale_M[:, None] * weight.scale_N[None, :]
    if bias is not None:
        y_MxN = y_MxN + bias[None, :]
    return y_MxN if activation is None else ACTIVATIONS[activation][1](y_MxN)


def _check_x(what: str, x_MxK, k: int, dtype):
    """The activations: [M, K] of `dtype`, K the weight's."""
    _check(what, "x_MxK", x_MxK, ndim=2, dtype=dtype)
    if x_MxK.shape[1] != k:
        raise ValueError(f"{what}: x_MxK has K = {x_MxK.shape[1]} but the weight has K = {k}")


def int8_matmul(x_MxK, w, *, impl: str = "auto", threads: int | None = None,
                blocking: dict | None = None):
    """x_MxK int8 @ w int8 [K, N] -> int32 [M, N], exact (values in [-127, 127]). `w` is an
    `Int8Weight` (pack once with `prepare_int8_weight`) or a raw int8 [K, N] array (packed
    on every call). `threads` None: every core (one for tiny products)."""
    _check_options("int8_matmul", threads, blocking)
    w = _as_int8_weight(w)
    _check_x("int8_matmul", x_MxK, w.q_KxN.shape[0], jnp.int8)
    if not _use_kernel("int8_matmul", impl, w.panels):
        return int8_matmul_xla(x_MxK, w.q_KxN)
    (M, K), N = x_MxK.shape, w.q_KxN.shape[1]
    return jax.ffi.ffi_call("hpnlp_int8_matmul", jax.ShapeDtypeStruct((M, N), jnp.int32),
                            vmap_method="sequential")(
        x_MxK, w.panels, w.colsum, threads=_threads(threads, M, K, N, "int8"),
        **_blocking("int8", blocking))


def int8_linear(x_MxK, weight: Int8Weight, *, bias=None, activation: str | None = None,
                impl: str = "auto", threads: int | None = None, blocking: dict | None = None):
    """w8a8 linear layer: float32 x_MxK, quantized per token to int8 inside the kernel,
    times the prepared int8 weight, rescaled to float32: acc * x_scale[m] * w_scale[n];
    then, in the same pass over each output tile, + bias [N] (float32) and `activation`
    (`ACTIVATIONS`: "gelu"), where given: a layer's epilogue without another pass over
    its output."""
    if not isinstance(weight, Int8Weight):
        raise ValueError("int8_linear: weight must be an Int8Weight (prepare_int8_weight); got "
                         f"{type(weight).__name__}")
    _check_options("int8_linear", threads, blocking)
    _check_x("int8_linear", x_MxK, weight.q_KxN.shape[0], jnp.float32)
    (M, K), N = x_MxK.shape, weight.q_KxN.shape[1]
    _check_bias("int8_linear", bias, N)
    code = _activation_code("int8_linear", activation)
    if not _use_kernel("int8_linear", impl, weight.panels):
        return int8_linear_xla(x_MxK, weight, bias=bias, activation=activation)
    options = dict(threads=_threads(threads, M, K, N, "int8"), activation=np.int64(code),
                   **_blocking("int8", blocking))

    def kernel(x, w, b):
        return jax.ffi.ffi_call("hpnlp_int8_linear", jax.ShapeDtypeStruct((M, N), jnp.float32),
                                vmap_method="sequential")(
            x, w.panels, w.colsum, w.scale_N, jnp.zeros((0,), jnp.float32) if b is None else b,
            **options)

    return kernels.with_twin_gradient(
        kernel, lambda x, w, b: int8_linear_xla(x, w, bias=b, activation=activation),
        x_MxK, weight, bias)


# ------------------------------------------------------------------------------ binary

def prepare_binary_weight(bits_KbxN, alpha_N=None, *, k: int) -> BinaryWeight:
    """Re-lay packed sign bits ([ceil(k/8), N] uint8, `packing.pack_bits` along K) and the
    per-output-channel scales (default ones) once, for `binary_matmul` / `binary_linear`."""
    bits_KbxN = jnp.asarray(bits_KbxN)
    if not kernels.is_integer(k) or k < 0:  # a review (r12): k=13.5 built a K=13 weight
        raise ValueError(f"prepare_binary_weight: k must be an integer >= 0; got {k!r}")
    k = int(k)
    _check("prepare_binary_weight", "bits_KbxN", bits_KbxN, ndim=2, dtype=jnp.uint8)
    if bits_KbxN.shape[0] != -(-k // 8):
        raise ValueError(f"prepare_binary_weight: bits_KbxN must have ceil(k/8) = {-(-k // 8)} "
                         f"rows for k = {k}; got shape {tuple(bits_KbxN.shape)}")
    N = bits_KbxN.shape[1]
    if k % 8:  # bits past k count for nothing (as in the twin), set or not
        bits_KbxN = bits_KbxN.at[-1].set(bits_KbxN[-1] & np.uint8((1 << k % 8) - 1))
    alpha_N = jnp.ones((N,), jnp.float32) if alpha_N is None else jnp.asarray(alpha_N)
    _check("prepare_binary_weight", "alpha_N", alpha_N, ndim=1, dtype=jnp.float32, shape=(N,))
    panels = amx = None
    if _can_pack():
        nb = layout()["binary_nb"]
        P, kw = -(-N // nb), -(-k // 64)
        w = _pad_to(bits_KbxN, kw * 8, P * nb)  # zero bytes: padding bits stay 0
        panels = w.reshape(kw, 8, P, nb).transpose(2, 0, 3, 1)[:, :, None]  # [P, kw, 1, nb, 8]
        if layout()["binary_xw"] == 2:  # AVX2: the popcount LUT's nibbles, split once here
            panels = jnp.concatenate([panels & 0x0F, panels >> 4], axis=2)
        if layout()["binary_products"] == "amx":  # the same bytes in the tiles' bit order
            amx = _amx_bit_order(w, kw, P)
    return BinaryWeight(bits_KbxN, alpha_N, panels, k, amx)


# Rows from which the binary products take the AMX tiles: each work item expands its
# panel's bits to int8 first (32 KB at K = 1024), which fewer rows do not repay. On a Xeon
# model 167 (python -m hpnlp.compress.kernels), [1, 2048 -> 2048] ran 0.178 ms on the
# tiles against 0.014 by popcounts, [16, 2048 -> 2048] 0.116 against 0.045.
AMX_MIN_ROWS = 64


def _binary_panels(weight, M: int):
    """(panels, 1) in the AMX bit order for M >= AMX_MIN_ROWS rows where there are some
    and this process has the tiles (a weight prepared where Linux granted them may be used
    where it does not), else (the popcount panels, 0)."""
    if (weight.amx_panels is not None and M >= AMX_MIN_ROWS and weight.k > 0
            and binary_products() == "amx"):
        return weight.amx_panels, 1
    return weight.panels, 0


def _amx_bit_order(w_bits, kw: int, P: int):
    """Sign bits [8 kw, 32 P] (K packed 8 a byte) as the AMX path's panels [P, kw, 1, 32, 8]
    (`b_amx_expand` in qgemm.cc): for k-word j, half h and k-group q, the 64-bit word
    [j, 16 h + q] holds bit 4 c + i = the sign of column 32 p + 16 h + c at k = 64 j + 4 q + i."""
    shifts = jnp.arange(8, dtype=jnp.uint8)
    bits = (w_bits[:, None, :] >> shifts[None, :, None]) & 1  # [Kb, 8, N]
    bits = bits.reshape(kw, 16, 4, P, 2, 16)  # k = 64 j + 4 q + i; n = 32 p + 16 h + c
    bits = bits.transpose(3, 0, 4, 1, 5, 2).reshape(P, kw, 32, 8, 8)  # [p, j, hq, byte, bit]
    return jnp.sum(bits << shifts[None, None, None, None, :], axis=-1,
                   dtype=jnp.uint8)[:, :, None]


def binary_matmul_xla(x_bits_MxKb, w_bits_KbxN, k: int):
    """The XLA twin of `binary_matmul`: bits unpacked to +-1 and an exact int32 product."""
    x_MxK = packing.unpack_bits(x_bits_MxKb, k, axis=1, dtype=jnp.int8)
    w_KxN = packing.unpack_bits(w_bits_KbxN, k, axis=0, dtype=jnp.int8)
    return int8_matmul_xla(x_MxK, w_KxN)


def binary_linear_xla(x_MxK, weight: BinaryWeight):
    """The XLA twin of `binary_linear`."""
    x_MxK = x_MxK.astype(jnp.float32)
    s_MxK = jnp.where(x_MxK > 0, 1, -1).astype(jnp.int8)
    w_KxN = packing.unpack_bits(weight.bits_KbxN, weight.k, axis=0, dtype=jnp.int8)
    beta_M = jnp.mean(jnp.abs(x_MxK), axis=1)
    # formats.py's binary scale: NaN for a row holding a NaN or an inf (a bug hunt (session
    # 103): beta = inf gave +-inf outputs where the packed model decoded in XLA, and the
    # int8 kernel's rows, give NaN), and 0 for a mean of at most formats.TINY (review r8:
    # beta was kept there, outputs of K * 1e-30 where the decoded model's are 0)
    beta_M = jnp.where(jnp.isfinite(beta_M), jnp.where(beta_M > formats.TINY, beta_M, 0.0),
                       jnp.nan)
    acc_MxN = int8_matmul_xla(s_MxK, w_KxN)
    return acc_MxN.astype(jnp.float32) * beta_M[:, None] * weight.alpha_N[None, :]


def _check_binary_weight(what: str, weight):
    if not isinstance(weight, BinaryWeight):
        raise ValueError(f"{what}: weight must be a BinaryWeight (prepare_binary_weight); got "
                         f"{type(weight).__name__}")


def binary_matmul(x_bits_MxKb, weight: BinaryWeight, *, impl: str = "auto",
                  threads: int | None = None, blocking: dict | None = None):
    """Packed sign bits x [M, ceil(K/8)] (`packing.pack_bits` along axis 1) times a
    prepared binary weight: int32 [M, N] = sum_k x_k w_k over +-1 values, exactly
    K - 2 popcount(x xor w). `blocking` is the popcount path's; the AMX path (from
    `AMX_MIN_ROWS` rows where the CPU has it) sizes its row chunks by the cache."""
    _check_options("binary_matmul", threads, blocking)
    _check_binary_weight("binary_matmul", weight)
    k = weight.k
    _check("binary_matmul", "x_bits_MxKb", x_bits_MxKb, ndim=2, dtype=jnp.uint8)
    if x_bits_MxKb.shape[1] != -(-k // 8):
        raise ValueError(f"binary_matmul: x_bits_MxKb must have ceil(K/8) = {-(-k // 8)} "
                         f"columns for the weight's K = {k}; got {tuple(x_bits_MxKb.shape)}")
    if not _use_kernel("binary_matmul", impl, weight.panels):
        return binary_matmul_xla(x_bits_MxKb, weight.bits_KbxN, k)
    M, N = x_bits_MxKb.shape[0], weight.bits_KbxN.shape[1]
    panels, amx = _binary_panels(weight, M)
    return jax.ffi.ffi_call("hpnlp_binary_matmul", jax.ShapeDtypeStruct((M, N), jnp.int32),
                            vmap_method="sequential")(
        x_bits_MxKb, panels, threads=_threads(threads, M, k // 32, N, "binary"),
        k=np.int64(k), amx=np.int64(amx), **_blocking("binary", blocking))


def binary_linear(x_MxK, weight: BinaryWeight, *, impl: str = "auto",
                  threads: int | None = None, blocking: dict | None = None):
    """XNOR-Net linear layer: sign(x) (x > 0: +1, else -1) with per-token scale beta =
    mean|x_row|, times the prepared binary weight: popcount product * beta[m] * alpha[n].
    A row holding a NaN or an inf has beta NaN, so its outputs are NaN, and a row with mean|x|
    at most formats.TINY has beta 0, so its outputs are 0 (formats.py's rule)."""
    _check_options("binary_linear", threads, blocking)
    _check_binary_weight("binary_linear", weight)
    _check_x("binary_linear", x_MxK, weight.k, jnp.float32)
    if not _use_kernel("binary_linear", impl, weight.panels):
        return binary_linear_xla(x_MxK, weight)
    (M, K), N = x_MxK.shape, weight.bits_KbxN.shape[1]
    options = dict(threads=_threads(threads, M, K // 32, N, "binary"),
                   **_blocking("binary", blocking))

    def kernel(x, w):
        panels, amx = _binary_panels(w, M)
        return jax.ffi.ffi_call("hpnlp_binary_linear", jax.ShapeDtypeStruct((M, N), jnp.float32),
                                vmap_method="sequential")(
            x, panels, w.alpha_N, amx=np.int64(amx), **options)

    return kernels.with_twin_gradient(kernel, binary_linear_xla, x_MxK, weight)


# -------------------------------------------------------------------------------- int4

def prepare_int4_weight(packed_KhxN, scale_GxN, *, k: int) -> Int4Weight:
    """Re-lay a packed int4 weight ([ceil(k/2), N] uint8, `packing.pack_int4` along K) and
    its group scales [G, N] (group g = k / G rows of K each) once, for `int4_linear`."""
    packed_KhxN, scale_GxN = jnp.asarray(packed_KhxN), jnp.asarray(scale_GxN)
    if not kernels.is_integer(k):  # a review (r12): k=7.9 dropped the weight's 8th row
        raise ValueError(f"prepare_int4_weight: k must be an integer >= 1; got {k!r}")
    k = int(k)
    _check("prepare_int4_weight", "packed_KhxN", packed_KhxN, ndim=2, dtype=jnp.uint8)
    if k < 1 or packed_KhxN.shape[0] != -(-k // 2):
        raise ValueError(f"prepare_int4_weight: packed_KhxN must have ceil(k/2) rows for k = "
                         f"{k} >= 1; got shape {tuple(packed_KhxN.shape)}")
    N = packed_KhxN.shape[1]
    _check("prepare_int4_weight", "scale_GxN", scale_GxN, ndim=2, dtype=jnp.float32)
    G = scale_GxN.shape[0]
    if scale_GxN.shape[1] != N or G < 1 or k % G:
        raise ValueError(f"prepare_int4_weight: scale_GxN must be [G, N = {N}] with G dividing "
                         f"k = {k} (group size k / G); got shape {tuple(scale_GxN.shape)}")
    panels = panel_scales = None
    if _can_pack():
        nb = layout()["int4_nb"]
        P = -(-N // nb)
        Kh = packed_KhxN.shape[0]  # not -1: N = 0 has no size to divide (a bug hunt,
        # session 97: a ZeroDivisionError)
        panels = _pad_to(packed_KhxN, Kh, P * nb).reshape(Kh, P, nb)
        panels = panels.transpose(1, 0, 2)  # [P, Kh, nb]
        panel_scales = _pad_to(scale_GxN, G, P * nb).reshape(G, P, nb).transpose(1, 0, 2)
    return Int4Weight(packed_KhxN, scale_GxN, panels, panel_scales, k)


def dequantize_int4(weight: Int4Weight):
    """The float32 weight [K, N] = int4 value * its group's scale (what the twin multiplies
    by; the kernel never stores it)."""
    q_KxN = packing.unpack_int4(weight.packed_KhxN, weight.k, axis=0).astype(jnp.float32)
    g = weight.k // weight.scale_GxN.shape[0]
    return q_KxN * jnp.repeat(weight.scale_GxN, g, axis=0)


def int4_linear_xla(x_MxK, weight: Int4Weight):
    """The XLA twin of `int4_linear`: dequantize, then a float32 product."""
    return jnp.dot(x_MxK.astype(jnp.float32), dequantize_int4(weight),
                   precision=jax.lax.Precision.HIGHEST)


# `int4_linear(impl="auto")` runs the kernel on fewer rows than this, its XLA twin
# (dequantize once, then XLA's float32 product) on more. The kernel is for decoding, where
# the weight's bytes bound the product; over many rows the product is compute-bound and
# XLA's GEMM runs it faster. Measured on a 2-core Xeon (model 207; kernel against twin, ms):
# [M, 512 -> 2048] at M=32 0.53/0.98, M=64 1.13/1.29, M=128 1.90/1.39, M=512 7.9/4.4;
# [M, 1024 -> 4096] at M=32 1.9/2.7, M=64 3.7/3.3, M=512 28.7/17.7.
INT4_KERNEL_MAX_ROWS = 63


def int4_linear(x_MxK, weight: Int4Weight, *, impl: str = "auto", threads: int | None = None):
    """Weight-only int4 linear layer: float32 x_MxK @ (int4 weight * group scales), the
    nibbles unpacked in registers (never a float weight in memory). `impl="auto"` runs the
    kernel up to `INT4_KERNEL_MAX_ROWS` rows (decoding) and the XLA twin past them (a
    prefill: the dequantized weight through XLA's GEMM).

    With one group or groups of an even number of rows (every usual int4 layer) the kernel
    sums x * n over a group before its scale (`i4_block_grouped` in qgemm.cc), so it matches
    the twin, up to float32 rounding, for nonzero |x| in [2^-98, FLT_MAX / (8 g)] (g the
    group's rows, K for one group: about [3.2e-30, 3.3e35] at g = 128); below, the kernel's
    pre-scaled x is subnormal (rounded, or flushed to 0), above, its sums overflow to inf or
    NaN where the twin's need not. A model's activations lie far inside."""
    if not isinstance(weight, Int4Weight):
        raise ValueError("int4_linear: weight must be an Int4Weight (prepare_int4_weight); got "
                         f"{type(weight).__name__}")
    _check_options("int4_linear", threads)
    _check_x("int4_linear", x_MxK, weight.k, jnp.float32)
    if impl == "auto" and x_MxK.shape[0] > INT4_KERNEL_MAX_ROWS:
        return int4_linear_xla(x_MxK, weight)
    if not _use_kernel("int4_linear", impl, weight.panels):
        return int4_linear_xla(x_MxK, weight)
    (M, K), N = x_MxK.shape, weight.packed_KhxN.shape[1]
    n_threads = _threads(threads, M, K, N, "int4")

    def kernel(x, w):
        return jax.ffi.ffi_call("hpnlp_int4_linear", jax.ShapeDtypeStruct((M, N), jnp.float32),
                                vmap_method="sequential")(
            x, w.panels, w.panel_scales, threads=n_threads)

    return kernels.with_twin_gradient(kernel, int4_linear_xla, x_MxK, weight)


# ------------------------------------------------------------------------------ timing

def _best_time(fn, args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))  # compile and warm up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - start)
    return best


def _timing_weights(rng, K: int, N: int, group: int) -> tuple[Int8Weight, Int4Weight]:
    """Random prepared int8 and int4 weights [K, N] for the timings (int4 group scales of
    `group` rows where it divides K, else one group)."""
    q8 = prepare_int8_weight(rng.integers(-127, 128, (K, N), dtype=np.int8),
                             jnp.full((N,), 0.01, jnp.float32))
    g = group if K % group == 0 else K
    q4 = prepare_int4_weight(packing.pack_int4(rng.integers(-8, 8, (K, N), dtype=np.int8)),
                             jnp.full((K // g, N), 0.01, jnp.float32), k=K)
    return q8, q4


def time_linear(M: int, K: int, N: int, *, repeats: int = 5, group: int = 128,
                impls: tuple[str, ...] | None = None) -> dict[str, float]:
    """Seconds (best of `repeats`) of one linear layer [M, K] x [K, N] per implementation:
    "f32_xla" (jnp.dot), "int8_xla" / "int8_kernel" (w8a8 with per-token activation
    quantization), "binary_xla" / "binary_kernel" (XNOR-Net), "int4_xla" / "int4_kernel"
    (weight-only, group scales of `group` rows). Kernels missing here are left out."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((M, K), np.float32))
    w = rng.standard_normal((K, N), np.float32)
    qb = prepare_binary_weight(packing.pack_bits(w), jnp.full((N,), 0.01, jnp.float32), k=K)
    q8, q4 = _timing_weights(rng, K, N, group)
    cases = {
        "f32_xla": (jax.jit(jnp.dot), (x, jnp.asarray(w))),
        "int8_xla": (jax.jit(functools.partial(int8_linear, impl="xla")), (x, q8)),
        "int8_kernel": (jax.jit(functools.partial(int8_linear, impl="kernel")), (x, q8)),
        "binary_xla": (jax.jit(functools.partial(binary_linear, impl="xla")), (x, qb)),
        "binary_kernel": (jax.jit(functools.partial(binary_linear, impl="kernel")), (x, qb)),
        "int4_xla": (jax.jit(functools.partial(int4_linear, impl="xla")), (x, q4)),
        "int4_kernel": (jax.jit(functools.partial(int4_linear, impl="kernel")), (x, q4)),
    }
    out = {}
    for name, (fn, args) in cases.items():
        if impls is not None and name not in impls:
            continue
        if name.endswith("_kernel") and KERNEL.blocker() is not None:
            continue
        out[name] = _best_time(fn, args, repeats)
    return out


def time_one_row(K: int, N: int, *, threads: int, calls: int = 200, repeats: int = 5,
                 group: int = 128) -> dict[str, float]:
    """Seconds per call (best of `repeats`) of one-row products [1, K] x [K, N], a decoding
    step's, on `threads` threads: `calls` of them in one jitted loop (each feeding the next,
    so none is skipped), so the time is the kernel's, not Python's dispatch. "int8_kernel"
    (w8a8) and "int4_kernel" (weight-only, group scales of `group` rows)."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((1, K), np.float32))
    q8, q4 = _timing_weights(rng, K, N, group)
    out = {}
    for name, fn, w in (("int8_kernel", int8_linear, q8), ("int4_kernel", int4_linear, q4)):
        def loop(x, w, fn=fn):
            def body(_, acc_11):
                return acc_11 + fn(x + acc_11 * 1e-30, w, impl="kernel", threads=threads)[:, :1]
            return jax.lax.fori_loop(0, calls, body, jnp.zeros((1, 1), jnp.float32))
        out[name] = _best_time(jax.jit(loop), (x, w), repeats) / calls
    return out


def main(argv=None) -> None:
    """Print the layer times, GOP/s and ratios against float32 XLA; with --one-row, the
    one-row (decoding) products on one thread and on every core."""
    import argparse
    p = argparse.ArgumentParser(prog="python -m hpnlp.compress.kernels")
    p.add_argument("--malloc", choices=("reuse", "default"), default="reuse",
                   help="reuse: freed large buffers stay mapped (hpnlp.kernels.reuse_freed_memory, "
                        "as the benchmarks run); default: glibc's own (every large output "
                        "page-faults in again each call)")
    p.add_argument("--one-row", action="store_true",
                   help="time one-row products (a decoding step's) inside a jitted loop, one "
                        "thread against every core, on the quant benchmark LM's shapes")
    args = p.parse_args(argv)
    if not available():  # every timing below runs the kernel beside XLA
        raise SystemExit(f"python -m hpnlp.compress.kernels: the kernel is unavailable "
                         f"({unavailable_reason()}); nothing to time")
    if args.malloc == "reuse":
        kernels.reuse_freed_memory()
    elif xla_workarounds.malloc_reused():
        # Importing hpnlp set malloc already; glibc's defaults need a process without it.
        import sys
        if argv is not None:
            raise SystemExit("--malloc default: run `HPNLP_MALLOC_WORKAROUND=0 python -m "
                             "hpnlp.compress.kernels --malloc default` (this process's malloc "
                             "was set when hpnlp was imported)")
        sys.stdout.flush()
        os.execve(sys.executable, sys.orig_argv, {**os.environ, "HPNLP_MALLOC_WORKAROUND": "0"})
    print(f"paths: {layout()}; malloc: {args.malloc}")
    if args.one_row:
        cores = kernels.cores()
        for K, N in ((256, 256), (256, 512), (512, 512), (512, 1536), (512, 2048), (2048, 512)):
            one, all_ = time_one_row(K, N, threads=1), time_one_row(K, N, threads=cores)
            print(f"[1 x {K} -> {N}] " + "  ".join(
                f"{k}: {one[k] * 1e6:.1f} us on 1 thread, {all_[k] * 1e6:.1f} on {cores}" for k in one))
        return
    for M, K, N in ((2048, 1024, 4096), (1, 512, 512), (1, 1024, 1024), (1, 2048, 2048),
                    (16, 2048, 2048)):
        secs = time_linear(M, K, N, repeats=5 if M > 1 else 50)
        base = secs["f32_xla"]
        print(f"[{M} x {K} -> {N}]")
        for name, s in secs.items():
            print(f"  {name:14s} {s * 1e3:9.3f} ms {2 * M * K * N / s / 1e9:8.1f} GOP/s "
                  f"{base / s:6.2f}x f32")


if __name__ == "__main__":
    main()
