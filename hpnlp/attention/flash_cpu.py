"""Exact attention as one fused CPU kernel forward and one backward (`flash_cpu.cc`).

    out_BLHD = flash_attention(q_BLHD, k_BSHD, v_BSHD, qseg_BL, kseg_BS, causal=True)

computes what `chunked` computes (FlashAttention-2: online softmax over key blocks
forward, P recomputed from the logsumexp backward, O(L) memory both ways), but each
thread owns a (batch, head) or a block of its queries at a time and keeps every tile in
its core's cache from the product that makes it to the ones that read it, with the
softmax arithmetic on the hot tile: XLA's CPU backend runs each of those steps as a
separate product or fusion split over all cores. See the top of `flash_cpu.cc`.

`chunked` uses this kernel wherever it can run (`impl="auto"`): on the CPU backend, one
device, head dim a multiple of 16. Its XLA twin (`impl="xla"`) stays the reference the
tests compare it with, outputs and gradients.

Shape letters: B batch, L query length, S key length, H heads, D head dim.
"""

from __future__ import annotations

import functools
import operator
import os

import jax
import jax.numpy as jnp
import numpy as np

from hpnlp import kernels
from hpnlp.kernels import tuning
from hpnlp.attention.base import check_inputs

KERNEL = kernels.CpuKernel(
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "flash_cpu.cc"),
    {"hpnlp_flash_fwd": "HpnlpFlashFwd", "hpnlp_flash_bwd": "HpnlpFlashBwd",
     "hpnlp_flash_fwd_bf16": "HpnlpFlashFwdBf16", "hpnlp_flash_bwd_bf16": "HpnlpFlashBwdBf16"},
    what="flash attention")

# Tiles (queries x keys), multiples of 16. The defaults were tuned on a 2-core AVX-512
# Xeon at B=1, H=8, D=64, L=4096: the forward's [queries, keys] score tile of 128 x 128 and
# the backward's [keys, queries] tiles of 256 x 128 stay in L2 beside the packed operands.
# Each CPU gets its own choice among the candidates, measured on first use and cached
# (`hpnlp.kernels.tuning`); `flash_attention(fwd_blocks=..., bwd_blocks=...)` overrides.
#
# Two regimes, each tuned on its own probe: "long" (bidirectional, or causal past
# SHORT_CAUSAL keys) and "short causal" (a causal LM's training rows and prefills). The
# long probe's choice is the wrong one for short causal rows, as large tiles on the
# diagonal compute scores the mask then discards: on the short probe a Xeon (model 207)
# took 14.4 ms forward and 21.6 ms backward at its long choices (256 x 128, 128 x 256)
# against 10.1 and 17.5 ms at 64 x 64 (the timings in `python -m hpnlp.kernels`' caches).
FWD_BLOCKS = (128, 128)
BWD_BLOCKS = (128, 256)
SHORT_CAUSAL_BLOCKS = (64, 64)  # both passes' default in the short causal regime
SHORT_CAUSAL = 1024  # causal attention over at most this many keys is "short causal"
MAX_BLOCK = 2**31 - 16  # the kernel counts a block's rows in a C int
_SIZES = (64, 128, 256)
# The long probe runs at L = 4096, the attention bench's length: the backward streams every
# query's packed operands and dQ (5 MB a head there) past each key block, so few keys per
# block read them from L3 many times, which costs most when other tenants keep the L3 busy.
# On the 2-core AMD EPYC Zen 3 VM, `python tools/kernel_ab.py --rev HEAD --rev-bwd-blocks
# 64,64 --bwd-blocks 128,256` (the bench's shape, one kernel, paired rounds) read the
# backward 1.13x faster at 128 x 256 in one hour of 2026-12-01 and 1.02x in a later one.
# At L = 2048 (H = 4, the probe before then) the two timed alike (0.99x with `--length 2048
# --shape 1,4,64`), and the Zen 3's search had kept 64 x 64 over the default by noise.
PROBES = {"long": dict(B=1, L=4096, H=2, D=64, causal=0),
          "short causal": dict(B=4, L=512, H=8, D=64, causal=1)}


def regime(q_len: int, k_len: int, causal: bool) -> str:
    """The tuning regime of attention of `q_len` queries over `k_len` keys."""
    return "short causal" if causal and max(q_len, k_len) <= SHORT_CAUSAL else "long"


def _probe(backward: bool, bf16: bool, shape: dict):
    def run(lib, cfg):
        args = [shape["B"], shape["L"], shape["H"], shape["D"], cfg["bq"], cfg["bk"],
                int(backward), kernels.cores(), int(bf16), shape["causal"], cfg.get("widen", 0)]
        return tuning.run_probe(lib, "hpnlp_flash_probe", args,
                                "flash attention's tuning probe", cfg)
    return run


def _native_bf16(lib, cfg) -> bool:
    """Whether a candidate applies to this build: `widen=1` only where the CPU has bfloat16
    products of its own to widen instead of (elsewhere both are the same code)."""
    return not cfg.get("widen") or lib.hpnlp_flash_bf16_products() > 0


def _tuning(name, default, backward, bf16, regime_name):
    shape = PROBES[regime_name]
    suffix = "" if regime_name == "long" else "_" + regime_name.replace(" ", "_")
    # bfloat16 passes also choose their products: the CPU's own (widen=0: AMX, vdpbf16ps)
    # or widened to float32 (widen=1), which some CPUs run faster (see flash_cpu.cc).
    widens = ({"widen": 0}, {"widen": 1}) if bf16 else ({},)
    candidates = [dict(bq=q, bk=k, **w) for q in _SIZES for k in _SIZES for w in widens]
    return tuning.Tuning(KERNEL, name + suffix,
                         default=dict(bq=default[0], bk=default[1], **widens[0]),
                         candidates=candidates, probe=_probe(backward, bf16, shape),
                         shape=" ".join(f"{k}={v}" for k, v in shape.items()),
                         applies=_native_bf16 if bf16 else None)


# {(pass, bfloat16, regime): its tuning}; each is tuned on its first use.
TUNINGS = {(p, bf16, r): _tuning(p + ("_bf16" if bf16 else ""),
                                 (FWD_BLOCKS if p == "fwd" else BWD_BLOCKS) if r == "long"
                                 else SHORT_CAUSAL_BLOCKS, p == "bwd", bf16, r)
           for r in PROBES for bf16 in (False, True) for p in ("fwd", "bwd")}


def tuned_block(pass_: str, bf16: bool = False, regime: str = "long") -> tuple[int, int]:
    """One pass's ("fwd" or "bwd") (queries, keys) blocks for this CPU, dtype and `regime`
    (see `regime()`): measured once, cached."""
    cfg = TUNINGS[pass_, bf16, regime].config()
    return cfg["bq"], cfg["bk"]


def tuned_blocks(bf16: bool = False, regime: str = "long") -> tuple[tuple[int, int], tuple[int, int]]:
    """(forward, backward) (queries, keys) blocks for this CPU, dtype and `regime`."""
    return tuned_block("fwd", bf16, regime), tuned_block("bwd", bf16, regime)


def tuned_widen(regime: str = "long", passes: tuple[str, ...] = ("fwd", "bwd")
                ) -> tuple[bool, ...]:
    """Per pass of `passes` (default: forward, backward): whether the bfloat16 kernel's
    products run widened to float32 rather than on the CPU's own bfloat16 instructions, for
    this CPU and `regime`: measured once with the blocks, cached."""
    return tuple(bool(TUNINGS[p, True, regime].config()["widen"]) for p in passes)


def bf16_products() -> str:
    """How the bfloat16 kernel's products run here: "amx" (AMX tiles), "avx512_bf16"
    (vdpbf16ps) or "float32" (bfloat16 widened, the portable path). AMX needs the OS to
    grant the tile state (Linux >= 5.16; it may refuse a process whose alternate signal
    stacks are too small for the state): where it does not, the kernel uses vdpbf16ps.
    A pass whose tuning chose `widen=1` (`tuned_widen`) widens instead, on any CPU."""
    return ("float32", "avx512_bf16", "amx")[KERNEL.library().hpnlp_flash_bf16_products()]


def shape_blocker(head_dim: int, value_dim: int | None = None) -> str | None:
    """Why the kernel cannot run attention with these head dims on any CPU; None if the
    shapes are its own (what a config check can say before anything is built)."""
    if head_dim <= 0 or head_dim % 16:
        return f"head dim {head_dim} (the kernel needs a positive multiple of 16)"
    if value_dim is not None and value_dim != head_dim:
        return f"value head dim {value_dim} differs from the query's {head_dim}"
    return None


def blocker(head_dim: int, value_dim: int | None = None) -> str | None:
    """Why the kernel cannot run attention with these head dims here; None if it can."""
    return shape_blocker(head_dim, value_dim) or KERNEL.blocker()


def _segments(segs):
    if segs is None:
        empty = jnp.zeros((0, 0), jnp.int32)
        return empty, empty
    qseg_BL, kseg_BS = segs
    return qseg_BL.astype(jnp.int32), kseg_BS.astype(jnp.int32)


def _attrs(segs, causal, scale, blocks, threads):
    """The kernel's attributes; blocks: one pass's (queries, keys, widen)."""
    return dict(segments=segs is not None, causal=bool(causal), scale=np.float32(scale),
                block_q=np.int64(blocks[0]), block_k=np.int64(blocks[1]),
                threads=np.int64(kernels.cores() if threads is None else threads),
                widen=bool(blocks[2]))


def _target(name: str, dtype) -> str:
    return f"{name}_bf16" if dtype == jnp.bfloat16 else name


def _forward(q_BLHD, k_BSHD, v_BSHD, segs, causal, scale, threads, blocks):
    B, L, H, _ = q_BLHD.shape
    qseg, kseg = _segments(segs)
    return jax.ffi.ffi_call(
        _target("hpnlp_flash_fwd", q_BLHD.dtype),
        [jax.ShapeDtypeStruct(q_BLHD.shape, q_BLHD.dtype), jax.ShapeDtypeStruct((B, H, L), jnp.float32)],
        vmap_method="sequential")(q_BLHD, k_BSHD, v_BSHD, qseg, kseg,
                                  **_attrs(segs, causal, scale, blocks[0], threads))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _flash(q_BLHD, k_BSHD, v_BSHD, segs, causal, scale, threads, blocks):
    return _forward(q_BLHD, k_BSHD, v_BSHD, segs, causal, scale, threads, blocks)[0]


def _flash_fwd(q_BLHD, k_BSHD, v_BSHD, segs, causal, scale, threads, blocks):
    o_BLHD, lse_BHL = _forward(q_BLHD, k_BSHD, v_BSHD, segs, causal, scale, threads, blocks)
    return o_BLHD, (q_BLHD, k_BSHD, v_BSHD, segs, o_BLHD, lse_BHL)


def _flash_bwd(causal, scale, threads, blocks, res, do_BLHD):
    q_BLHD, k_BSHD, v_BSHD, segs, o_BLHD, lse_BHL = res
    qseg, kseg = _segments(segs)
    like = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)  # noqa: E731
    dq, dk, dv = jax.ffi.ffi_call(
        _target("hpnlp_flash_bwd", q_BLHD.dtype), [like(q_BLHD), like(k_BSHD), like(v_BSHD)],
        vmap_method="sequential")(
        q_BLHD, k_BSHD, v_BSHD, qseg, kseg, o_BLHD, lse_BHL, do_BLHD.astype(q_BLHD.dtype),
        **_attrs(segs, causal, scale, blocks[1], threads))
    return dq, dk, dv, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def flash_attention(q_BLHD, k_BSHD, v_BSHD, qseg_BL=None, kseg_BS=None, *, causal=False,
                    threads: int | None = None, fwd_blocks: tuple[int, int] | None = None,
                    bwd_blocks: tuple[int, int] | None = None, widen: bool | None = None):
    """softmax(q k^T / sqrt(D)) v over [B, L, H, D] arrays, returned in q's dtype. When q,
    k and v are all bfloat16 the bfloat16 kernel runs (bfloat16 products, float32
    accumulation and softmax statistics; gradients in bfloat16); otherwise everything is
    float32. Segment ids (0 = padding; both or neither): a query sees keys of its own
    nonzero segment. Causal: query i sees keys <= i. A query that sees no key outputs 0.
    `threads` None: every core this process may use. `fwd_blocks`, `bwd_blocks`: the
    (queries, keys) tile of each pass, multiples of 16; None: this CPU's tuned choice for
    the call's regime (`regime()`: short causal rows tune apart from long ones). `widen`
    (bfloat16 only): True runs the products widened to float32, False on the CPU's own
    bfloat16 instructions where it has them; None: each pass's tuned choice, where its
    blocks are tuned (a pass given its blocks runs the CPU's own, and tunes nothing)."""
    check_inputs(q_BLHD, k_BSHD, v_BSHD, None)
    # The options are checked before the kernel is built or tuned, as the other kernels'
    # wrappers do (found in review: threads=0, -4 or 2.7 ran on one or two threads without
    # a word, as the kernel clamps and truncates them; fwd_blocks=64 was a bare TypeError).
    if threads is not None and (not kernels.is_integer(threads) or threads < 1):
        raise ValueError(f"flash attention: threads must be an integer >= 1 (None: every "
                         f"core); got {threads!r}")
    threads = None if threads is None else operator.index(threads)
    if widen is not None and not isinstance(widen, (bool, np.bool_)):
        raise ValueError(f"flash attention: widen must be True, False or None (tuned); got "
                         f"{widen!r}")
    given = {"fwd_blocks": fwd_blocks, "bwd_blocks": bwd_blocks}
    for name, blk in given.items():
        if blk is None:
            continue
        try:
            pair = len(blk) == 2 and all(kernels.is_integer(x) for x in blk)
        except TypeError:  # not a sequence
            pair = False
        if not pair or any(x <= 0 or x % 16 or x > MAX_BLOCK for x in blk):
            raise ValueError(f"flash attention: {name} must be two positive multiples of 16 "
                             f"(queries, keys), at most {MAX_BLOCK}; got {blk!r}")
        given[name] = tuple(operator.index(x) for x in blk)
    reason = blocker(q_BLHD.shape[-1], v_BSHD.shape[-1])
    if reason is not None:
        raise RuntimeError(f"the flash attention kernel cannot run here: {reason}. Use "
                           "chunked attention with impl='xla' (the XLA twin) instead.")
    if (qseg_BL is None) != (kseg_BS is None):
        raise ValueError("flash attention: give both qseg_BL and kseg_BS, or neither")
    if qseg_BL is not None and (qseg_BL.shape != q_BLHD.shape[:2] or
                                kseg_BS.shape != k_BSHD.shape[:2]):
        raise ValueError(f"flash attention: segment ids must be [B, L] = {q_BLHD.shape[:2]} and "
                         f"[B, S] = {k_BSHD.shape[:2]}; got {qseg_BL.shape} and {kseg_BS.shape}")
    bf16 = all(x.dtype == jnp.bfloat16 for x in (q_BLHD, k_BSHD, v_BSHD))
    rg = regime(q_BLHD.shape[1], k_BSHD.shape[1], causal)
    if fwd_blocks is None and bwd_blocks is None:
        blocks = tuned_blocks(bf16, rg)
    else:  # only the pass not given is tuned
        blocks = tuple(tuned_block(p, bf16, rg) if blk is None else blk
                       for p, blk in zip(("fwd", "bwd"), given.values()))
    if not bf16:
        wides = (False, False)  # float32 products either way
    elif widen is not None:
        wides = (bool(widen),) * 2
    elif fwd_blocks is None and bwd_blocks is None:
        wides = tuned_widen(rg)
    else:  # a pass given its blocks runs its tuning's default products, the CPU's own:
        # the tuned widen was chosen with the tuned blocks (review r5: given both passes'
        # blocks, a fresh cache searched every bfloat16 block and widen, 20 s a pass, for them)
        wides = tuple(tuned_widen(rg, (p,))[0] if blk is None
                      else bool(TUNINGS[p, True, rg].default["widen"])
                      for p, blk in zip(("fwd", "bwd"), given.values()))
    blocks = tuple((*blk, w) for blk, w in zip(blocks, wides))
    segs = None if qseg_BL is None else (qseg_BL, kseg_BS)
    scale = 1.0 / float(np.sqrt(q_BLHD.shape[-1]))
    cast = lambda x: x.astype(jnp.bfloat16 if bf16 else jnp.float32)  # noqa: E731
    out = _flash(cast(q_BLHD), cast(k_BSHD), cast(v_BSHD), segs, causal, scale, threads, blocks)
    return out.astype(q_BLHD.dtype)
