"""`chunked`: exact attention in O(L) memory, forward and backward (Rabe & Staats 2021,
"Self-attention Does Not Need O(n^2) Memory"; Dao 2023, "FlashAttention-2").

The idea: softmax(QK^T)V can be accumulated over key blocks with a running max `m`, a
running normalizer `l` and a running weighted sum, so no [L, S] matrix ever exists. The
forward pass keeps only the output and one logsumexp per row; a custom VJP recomputes
each [Q, K] score block from them (P = exp(S - lse)) and accumulates dQ, dK, dV block by
block, so the backward pass is O(L) too and needs no stored probabilities.

What makes it fast on a CPU: big blocks (1024 x 1024 by default), one (batch, head) at a
time so the [Q, K] tile stays in cache between the matmul that makes it and the ones that
use it, the `[B, H, L, D]` layout made once outside the loops and key-major tiles in the
backward pass so no matmul has a transposed left operand, softmax math in float32 with
the query pre-scaled by 1/sqrt(D), and no wasted blocks. Causal attention loops only over
the key blocks on or below the diagonal and masks only the blocks the diagonal crosses;
with segment ids (0 = padding) the [Q, K] mask of a block is built from two slices of the
ids, and a block in which no query may see any key (all padding, or different packed
segments) is skipped by `lax.cond`. Rows with no visible key (padding queries) output
zeros, not NaN.

Three implementations compute the same thing. On a CPU the default (`impl="auto"`) is one
fused C++ kernel forward and one backward (`flash_cpu.py`: the same algorithm, with every
tile kept in its core's cache and the softmax done on the hot tile), wherever it can run:
the CPU backend, one device, head dim a multiple of 16, no explicit block sizes. On a GPU it
is three Pallas (Triton) kernels (`flash_gpu.py`: one program per block of each head, all at
once), on one device of compute capability 8.0 or newer, at head dims up to 128 in bfloat16
and float16; in float32 only at the head dims whose blocks were measured on that GPU model
(`flash_gpu_blocks.json`: the H200's `float32_d64`, head dims 33-64), since at the rule's
blocks float32 ran slower than XLA (`flash_gpu.blocker`). `impl="kernel"` runs float32 up to
64 on any such GPU, at the rule's blocks where none were measured. The XLA program below
(`impl="xla"`) runs everywhere else and is both kernels' tested twin.

Block sizes (XLA path) given explicitly must divide the lengths. Left at `None`, they are
chosen here (the tuned size, shrunk so blocks split the length evenly) and a length they
do not divide is padded inside the call with masked keys, then sliced back.

Shape letters: B batch, L query length, S key length, H heads, D head dim,
Q query block, K key block.
"""

from __future__ import annotations

import functools
import operator

import jax
import jax.numpy as jnp

from hpnlp.attention import flash_cpu, flash_gpu
from hpnlp.kernels import is_integer
from hpnlp.attention.base import Attention, check_inputs, register
from hpnlp.config import ConfigError

IMPLS = ("auto", "kernel", "xla")

# Tuned on an idle 2-core AVX-512 Xeon at B=1, H=8, D=64, L=4096, forward+backward
# (`harness.time_jax` of the gradient, median):
# 256 x 512: 826 ms, 512 x 512: 715 ms, 1024 x 1024: 624 ms, 2048 x 2048: 597 ms. Larger
# blocks amortize the per-block loop and parallel-region overhead; 1024 keeps most of the
# gain with a 4 MiB [Q, K] tile (memory stays O(L * block)).
DEFAULT_BLOCK_Q = 1024
DEFAULT_BLOCK_K = 1024


def auto_block(n: int, target: int) -> int:
    """Block size near `target` for length `n`: `n / blocks` when that splits `n` exactly,
    else rounded up to a multiple of 8 (the call then pads by less than 8 per block)."""
    blocks = -(-n // target)
    if n % blocks == 0:
        return n // blocks
    return -(-(-(-n // blocks)) // 8) * 8


def _slice(x, start, size, axis=0):
    return jax.lax.dynamic_slice_in_dim(x, start, size, axis)


def _block_ok(qseg_L, kseg_S, i, j, bq, bk, causal):
    """[Q, K] bool: which (query, key) pairs of block (i, j) may attend (from id slices)."""
    qs_Q = _slice(qseg_L, i * bq, bq)
    ks_K = _slice(kseg_S, j * bk, bk)
    ok_QK = (qs_Q[:, None] == ks_K[None, :]) & (ks_K[None, :] != 0)
    if causal:
        ok_QK &= _causal_ok(i, j, bq, bk)
    return ok_QK


def _causal_ok(i, j, bq, bk):
    """[Q, K] bool: query position >= key position inside block (i, j)."""
    qpos = i * bq + jnp.arange(bq)
    kpos = j * bk + jnp.arange(bk)
    return qpos[:, None] >= kpos[None, :]


def _causal_ranges(nq, nk, bq, bk):
    """For causal attention: per query block i, key blocks [0, full(i)) are wholly visible and
    [full(i), need(i)) are cut by the diagonal; per key block j, query blocks [lo(j), full(j))
    are cut and [full(j), nq) see it wholly. Everything else is skipped, never computed."""
    def k_full(i):
        return jnp.minimum((i * bq + 1) // bk, nk)

    def k_need(i):
        return jnp.minimum(((i + 1) * bq - 1) // bk + 1, nk)

    def q_lo(j):
        return jnp.minimum((j * bk) // bq, nq)

    def q_full(j):
        return jnp.minimum(((j + 1) * bk + bq - 2) // bq, nq)

    return k_full, k_need, q_lo, q_full


def _forward_head(q_LD, k_SD, v_SD, segs, causal, bq, bk):
    """One head: output [L, D] and logsumexp [L] (+inf where a row sees no key)."""
    L, D = q_LD.shape
    Dv = v_SD.shape[1]  # the values' head dim may differ from the queries' and keys'
    nq, nk = L // bq, k_SD.shape[0] // bk
    k_full, k_need, _, _ = _causal_ranges(nq, nk, bq, bk)

    def q_block(i, out):
        o_LD, lse_L = out
        q_QD = _slice(q_LD, i * bq, bq)

        def attend(j, carry, ok_QK):
            m_Q, l_Q, acc_QD = carry
            s_QK = jnp.einsum("qd,kd->qk", q_QD, _slice(k_SD, j * bk, bk))
            if ok_QK is not None:
                s_QK = jnp.where(ok_QK, s_QK, -jnp.inf)
            m_new = jnp.maximum(m_Q, s_QK.max(-1))
            # A row may have seen nothing yet (exp(-inf - -inf) is NaN): shift it by 0, but
            # carry its max as -inf (a bug hunt (session 103): a carried 0 underflowed a later
            # block's scores below about -87 to l = 0, zeroing the row), as flash_gpu does.
            m_use = m_new if ok_QK is None else jnp.where(m_new == -jnp.inf, 0.0, m_new)
            p_QK = jnp.exp(s_QK - m_use[:, None])
            corr_Q = jnp.exp(m_Q - m_use)
            l_new = l_Q * corr_Q + p_QK.sum(-1)
            acc_new = acc_QD * corr_Q[:, None] + p_QK @ _slice(v_SD, j * bk, bk)
            return m_new, l_new, acc_new

        def plain(j, carry):
            return attend(j, carry, None)

        def diagonal(j, carry):
            return attend(j, carry, _causal_ok(i, j, bq, bk))

        def segmented(j, carry):
            ok_QK = _block_ok(segs[0], segs[1], i, j, bq, bk, causal)
            return jax.lax.cond(jnp.any(ok_QK), lambda c: attend(j, c, ok_QK), lambda c: c, carry)

        carry = (jnp.full((bq,), -jnp.inf, jnp.float32), jnp.zeros((bq,), jnp.float32),
                 jnp.zeros((bq, Dv), jnp.float32))
        if segs is not None:
            carry = jax.lax.fori_loop(0, k_need(i) if causal else nk, segmented, carry)
        elif causal:
            carry = jax.lax.fori_loop(0, k_full(i), plain, carry)
            carry = jax.lax.fori_loop(k_full(i), k_need(i), diagonal, carry)
        else:
            carry = jax.lax.fori_loop(0, nk, plain, carry)
        m_Q, l_Q, acc_QD = carry
        seen_Q = l_Q > 0
        l_safe = jnp.where(seen_Q, l_Q, 1.0)
        o_QD = acc_QD * jnp.where(seen_Q, 1.0 / l_safe, 0.0)[:, None]
        lse_Q = jnp.where(seen_Q, m_Q + jnp.log(l_safe), jnp.inf)  # +inf: P = exp(s - lse) = 0
        return (jax.lax.dynamic_update_slice_in_dim(o_LD, o_QD, i * bq, 0),
                jax.lax.dynamic_update_slice_in_dim(lse_L, lse_Q, i * bq, 0))

    init = (jnp.zeros((L, Dv), jnp.float32), jnp.zeros((L,), jnp.float32))
    return jax.lax.fori_loop(0, nq, q_block, init)


def _backward_head(q_LD, k_SD, v_SD, segs, o_LD, lse_L, do_LD, causal, bq, bk):
    """One head: dQ, dK, dV by FlashAttention-2's loop: key blocks outside (dK, dV live in
    the loop carry), query blocks inside (dQ accumulated in place), P recomputed from lse.

    Tiles are key-major ([K, Q], the transpose of the forward's) and dQ is accumulated
    transposed against a K^T made once, so each of the five matmuls contracts the last
    axis of its left operand: a transposed left operand runs ~2x slower on this CPU."""
    L, D = q_LD.shape
    S = k_SD.shape[0]
    nq, nk = L // bq, S // bk
    _, _, q_lo, q_full = _causal_ranges(nq, nk, bq, bk)
    delta_L = jnp.sum(do_LD * o_LD, axis=-1)  # rowsum(dO * O) = rowsum(P * dP)
    kt_DS = k_SD.T

    def k_block(j, grads):
        dqt_DL, dk_SD, dv_SD = grads
        k_KD, v_KD = _slice(k_SD, j * bk, bk), _slice(v_SD, j * bk, bk)
        kt_DK = _slice(kt_DS, j * bk, bk, 1)

        def accumulate(i, carry, ok_KQ):
            dqt_DL, dk_KD, dv_KD = carry
            q_QD, do_QD = _slice(q_LD, i * bq, bq), _slice(do_LD, i * bq, bq)
            st_KQ = jnp.einsum("kd,qd->kq", k_KD, q_QD)
            if ok_KQ is not None:
                st_KQ = jnp.where(ok_KQ, st_KQ, -jnp.inf)
            pt_KQ = jnp.exp(st_KQ - _slice(lse_L, i * bq, bq)[None, :])
            dpt_KQ = jnp.einsum("kd,qd->kq", v_KD, do_QD)
            dst_KQ = pt_KQ * (dpt_KQ - _slice(delta_L, i * bq, bq)[None, :])
            dqt_DQ = _slice(dqt_DL, i * bq, bq, 1) + kt_DK @ dst_KQ
            return (jax.lax.dynamic_update_slice_in_dim(dqt_DL, dqt_DQ, i * bq, 1),
                    dk_KD + dst_KQ @ q_QD, dv_KD + pt_KQ @ do_QD)

        def plain(i, carry):
            return accumulate(i, carry, None)

        def diagonal(i, carry):
            return accumulate(i, carry, _causal_ok(i, j, bq, bk).T)

        def segmented(i, carry):
            ok_KQ = _block_ok(segs[0], segs[1], i, j, bq, bk, causal).T
            return jax.lax.cond(jnp.any(ok_KQ), lambda c: accumulate(i, c, ok_KQ), lambda c: c, carry)

        carry = (dqt_DL, jnp.zeros((bk, D), jnp.float32),
                 jnp.zeros((bk, v_SD.shape[1]), jnp.float32))
        if segs is not None:
            carry = jax.lax.fori_loop(q_lo(j) if causal else 0, nq, segmented, carry)
        elif causal:
            carry = jax.lax.fori_loop(q_lo(j), q_full(j), diagonal, carry)
            carry = jax.lax.fori_loop(q_full(j), nq, plain, carry)
        else:
            carry = jax.lax.fori_loop(0, nq, plain, carry)
        dqt_DL, dk_KD, dv_KD = carry
        return (dqt_DL, jax.lax.dynamic_update_slice_in_dim(dk_SD, dk_KD, j * bk, 0),
                jax.lax.dynamic_update_slice_in_dim(dv_SD, dv_KD, j * bk, 0))

    init = (jnp.zeros((D, L), jnp.float32), jnp.zeros_like(k_SD), jnp.zeros_like(v_SD))
    dqt_DL, dk_SD, dv_SD = jax.lax.fori_loop(0, nk, k_block, init)
    return dqt_DL.T, dk_SD, dv_SD


def _per_head(fn, segs, *arrays_BH):
    """Run `fn(*one_head_arrays, segs_of_its_row)` over every (batch, head) in turn: one head's
    [Q, K] tile stays in the L2 cache between the matmul that makes it and the ones that use
    it, which is faster on CPU than batching the heads into each matmul."""
    B, H = arrays_BH[0].shape[:2]
    flat = [x.reshape((B * H,) + x.shape[2:]) for x in arrays_BH]

    def one(xs):
        n, *head = xs
        row_segs = None if segs is None else tuple(s[n // H] for s in segs)
        return fn(*head, row_segs)

    outs = jax.lax.map(one, (jnp.arange(B * H), *flat))
    return tuple(o.reshape((B, H) + o.shape[1:]) for o in outs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _flash(q_BHLD, k_BHSD, v_BHSD, segs, causal, bq, bk):
    return _flash_fwd(q_BHLD, k_BHSD, v_BHSD, segs, causal, bq, bk)[0]


def _flash_fwd(q_BHLD, k_BHSD, v_BHSD, segs, causal, bq, bk):
    o_BHLD, lse_BHL = _per_head(
        lambda q, k, v, sg: _forward_head(q, k, v, sg, causal, bq, bk), segs, q_BHLD, k_BHSD, v_BHSD)
    return o_BHLD, (q_BHLD, k_BHSD, v_BHSD, segs, o_BHLD, lse_BHL)


def _flash_bwd(causal, bq, bk, res, do_BHLD):
    q_BHLD, k_BHSD, v_BHSD, segs, o_BHLD, lse_BHL = res
    dq, dk, dv = _per_head(
        lambda q, k, v, o, lse, do, sg: _backward_head(q, k, v, sg, o, lse, do, causal, bq, bk),
        segs, q_BHLD, k_BHSD, v_BHSD, o_BHLD, lse_BHL, do_BHLD)
    return dq, dk, dv, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def kernel_blocker(head_dim: int, value_dim: int, impl: str, block_q, block_k,
                   dtype=jnp.float32) -> str | None:
    """Why `impl` does not run a fused kernel (the CPU's, or on a GPU the GPU's) here; None
    if it does."""
    if impl not in IMPLS:
        raise ValueError(f"chunked attention: impl={impl!r} is not one of {IMPLS}")
    if impl == "xla":
        return "impl='xla'"
    if block_q is not None or block_k is not None:  # impl='kernel' refuses them (a bug hunt:
        # they were dropped silently); the kernels' own blocks are tuned per CPU
        return "explicit block sizes (they tune the XLA program)"
    if jax.default_backend() == "gpu":  # (`auto` also needs float32's blocks measured)
        return flash_gpu.blocker(head_dim, value_dim, dtype, impl=impl)
    return flash_cpu.blocker(head_dim, value_dim)


def chunked_attention(q_BLHD, k_BSHD, v_BSHD, mask_BL=None, *, causal=False,
                      block_q: int | None = None, block_k: int | None = None,
                      impl: str = "auto"):
    """Exact softmax attention in O(L) memory. `impl`: "auto" (the backend's fused kernel, CPU
    or GPU, where it can run, else XLA), "kernel" (that kernel or a clear error) or "xla".
    `block_q` / `block_k` (XLA path) None: chosen here, and lengths they do not divide are
    padded inside the call."""
    check_inputs(q_BLHD, k_BSHD, v_BSHD, mask_BL)
    B, L, H, D = q_BLHD.shape
    S = k_BSHD.shape[1]
    blocker = kernel_blocker(D, v_BSHD.shape[-1], impl, block_q, block_k,
                             jnp.result_type(q_BLHD, k_BSHD, v_BSHD))
    if not L or not S:  # no queries, or no key to see: zeros, as for a row that sees none
        return jnp.zeros((B, L, H, v_BSHD.shape[-1]), q_BLHD.dtype)
    if impl == "kernel" and blocker is not None:
        raise ValueError(f"chunked attention: impl='kernel' cannot run here: {blocker}. Use "
                         "impl='auto' (the kernel where it can run) or impl='xla'")
    if blocker is None and jax.default_backend() == "gpu":
        return flash_gpu.flash_attention(q_BLHD, k_BSHD, v_BSHD, mask_BL, causal=causal)
    if blocker is None:
        return flash_cpu.flash_attention(q_BLHD, k_BSHD, v_BSHD, mask_BL, mask_BL, causal=causal)
    for name, block, n in (("block_q", block_q, L), ("block_k", block_k, S)):
        # an integer, NumPy's too (a review, session 118: 8.0 passed, then failed in jnp.pad
        # naming neither; True ran as a block of 1)
        if block is not None and (not is_integer(block) or block <= 0 or n % block):
            raise ValueError(f"chunked attention: {name}={block!r} must be an integer dividing "
                             f"the sequence length {n}; pick a divisor, or leave {name}=None "
                             "to pad automatically")
    bq = auto_block(L, DEFAULT_BLOCK_Q) if block_q is None else operator.index(block_q)
    bk = auto_block(S, DEFAULT_BLOCK_K) if block_k is None else operator.index(block_k)
    Lp, Sp = -(-L // bq) * bq, -(-S // bk) * bk

    segs = None
    if mask_BL is not None or Sp != S:
        # Padded keys get id 0 (never attended); padded queries are sliced off below.
        qseg_BL = jnp.ones((B, L), jnp.int32) if mask_BL is None else mask_BL.astype(jnp.int32)
        kseg_BS = jnp.ones((B, S), jnp.int32) if mask_BL is None else mask_BL.astype(jnp.int32)
        segs = (jnp.pad(qseg_BL, ((0, 0), (0, Lp - L))), jnp.pad(kseg_BS, ((0, 0), (0, Sp - S))))

    def heads_major(x_BLHD, n, n_pad):
        x_BHLD = x_BLHD.astype(jnp.float32).transpose(0, 2, 1, 3)
        return jnp.pad(x_BHLD, ((0, 0), (0, 0), (0, n_pad - n), (0, 0)))

    # The 1/sqrt(D) scale goes on q once (O(L D) work) instead of on every score block.
    q_BHLD = heads_major(q_BLHD, L, Lp) * (1.0 / jnp.sqrt(jnp.float32(D)))
    out_BHLD = _flash(q_BHLD, heads_major(k_BSHD, S, Sp), heads_major(v_BSHD, S, Sp), segs,
                      causal, bq, bk)
    return out_BHLD[:, :, :L].transpose(0, 2, 1, 3).astype(q_BLHD.dtype)


@register("chunked")
class ChunkedAttention(Attention):
    """Exact softmax attention, O(L) memory in forward and backward: online softmax over key
    blocks (Rabe & Staats 2021) with a recomputing custom VJP (FlashAttention-2); on a CPU
    one fused kernel per pass (`flash_cpu`), on a GPU Pallas kernels (`flash_gpu`)."""

    heads_independent = True

    block_q: int | None = None  # XLA path; None: about DEFAULT_BLOCK_Q, any length (padded)
    block_k: int | None = None  # XLA path; None: about DEFAULT_BLOCK_K, any length (padded)
    impl: str = "auto"  # "auto": CPU/GPU kernel where it can run, else XLA; "kernel"; "xla"

    def cache_impl(self) -> str:
        """`impl='kernel'` asks for the training kernels; decoding's cache kernel (the CPU's,
        `cache_cpu`) is another, with its own dtypes (float32, bfloat16: not float16, which the
        training kernel widens to float32), so such a run decodes by "auto" (that kernel where
        it can run, else its XLA twin, the same function), and on a GPU by XLA (review r1,
        session 105: a float16 run trained on the CPU kernel, then every decode failed, naming
        no config field). `impl='xla'` decodes by XLA."""
        return "xla" if self.impl == "xla" else "auto"

    @classmethod
    def check_config(cls, options, *, seq_len, causal, field="attention.options"):
        super().check_config(options, seq_len=seq_len, causal=causal, field=field)
        impl = options.get("impl", cls.impl)
        if impl not in IMPLS:
            raise ConfigError(f"config field `{field}.impl` = {impl!r} is not allowed: choose one "
                              f"of {list(IMPLS)} (auto: the CPU or GPU kernel where it can run)")
        for name in ("block_q", "block_k"):
            block = options.get(name, getattr(cls, name))
            if block is None:
                continue
            if impl == "kernel":  # a bug hunt: taken, and dropped
                raise ConfigError(f"config field `{field}.{name}` = {block!r} is not allowed "
                                  f"with {field}.impl='kernel': block sizes tune the XLA "
                                  "program (the kernel's are tuned per CPU); drop it, or use "
                                  "impl='xla'")
            if not isinstance(block, int) or isinstance(block, bool) or block <= 0:
                raise ConfigError(f"config field `{field}.{name}` = {block!r} is not allowed: "
                                  "must be a positive integer, or None to choose automatically")
            if seq_len % min(block, seq_len):  # a block past the length is the length (`fit`)
                divisors = ([d for d in (16, 32, 64, 128, 256, 512) if seq_len % d == 0]
                            or [d for d in range(1, seq_len + 1) if seq_len % d == 0][-4:])
                raise ConfigError(
                    f"config field `{field}.{name}` = {block} is not allowed: it must divide "
                    f"data.seq_len={seq_len}; divisors of {seq_len} include {divisors}, or "
                    "leave it unset (None) to pad automatically")

    @classmethod
    def cannot_run_here(cls, options, *, head_dim, num_devices, dtype):
        """(option, portable value, why, fix) where `options` ask for the fused kernel
        (`impl='kernel'`) and it cannot run on `num_devices` devices here at head dim
        `head_dim` in the compute `dtype`, else None: `validate` refuses it for a run it trains,
        and a run read here takes `impl='auto'` (the same function, by XLA where the kernel
        cannot run). On a GPU the reasons are `flash_gpu.blocker`'s for impl='kernel', which
        the layer's trace asks with the same dtype and head dim (a review, r14: a float32 head
        dim over 64 passed validate and failed at the model's init, after the data was built);
        `auto`'s float32 rule of measured blocks is a choice of speed, not refused here."""
        if options.get("impl", cls.impl) != "kernel":
            return None
        use = "use impl='auto' (the kernel where it can run) or impl='xla'"
        if num_devices > 1:  # a bug hunt (session 100): the layer's error, naming no field
            return ("impl", "auto", f"the fused kernel cannot run on a mesh of {num_devices} "
                    "devices (XLA cannot partition the kernel's call; the XLA path shards like "
                    "any XLA program)", use)
        if jax.default_backend() == "gpu":
            why = flash_gpu.blocker(head_dim, head_dim, dtype, impl="kernel")
            if why:
                return ("impl", "auto", f"the GPU kernel cannot run here: {why}", use)
        if jax.default_backend() == "cpu":
            why = flash_cpu.shape_blocker(head_dim)
            if why:
                return ("impl", "auto", f"the CPU kernel cannot run {why}", "set "
                        "model.head_dim (or model.width / model.num_heads) to a multiple of 16, "
                        "or " + use)
            why = flash_cpu.KERNEL.unavailable_reason()
            if why:
                return ("impl", "auto", f"the CPU kernel cannot run here: {why}", use)
        if jax.default_backend() not in ("cpu", "gpu"):  # a review (session 115): a TPU's
            # run was taken, then failed at its first trace, naming no field
            return ("impl", "auto", f"the fused kernels run on a CPU or a GPU, and JAX runs "
                    f"on the {jax.default_backend()}", use)
        return None

    def __call__(self, q, k, v, mask=None, *, causal: bool = False, deterministic: bool = True):
        def fit(block, n):
            return None if block is None else min(block, n)
        return chunked_attention(q, k, v, mask, causal=causal, block_q=fit(self.block_q, q.shape[1]),
                                 block_k=fit(self.block_k, k.shape[1]), impl=self.impl)
