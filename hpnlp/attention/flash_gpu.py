"""`chunked` attention's GPU kernel: FlashAttention-2 (Dao 2023) as three Pallas kernels
lowered through Triton, one forward and two backward (dK and dV over key blocks, dQ over
query blocks), so neither pass holds an [L, S] matrix or needs an atomic add.

Why: on a GPU the XLA program in `chunked.py` maps over the B*H heads one at a time and each
step is a few products of one head's blocks, too little work to fill the device (an H100
ran it at 17% of its float32 product rate, 3.1x PyTorch's SDPA; `docs/benchmarks/
attention_h100`). Here each program instance owns one block of one head and the grid covers
every (block, batch, head) at once.

The math is `chunked.py`'s and so are the semantics: segment ids (0 = padding, never
attended; a query sees keys of its own segment), causal masking by position, and a query
that sees no key outputs zeros, not NaN (its logsumexp is +inf, so P = 0 in the backward).
Scores are scaled into base 2 (exp2) inside the kernels, and softmax statistics and every
accumulator are float32 whatever the inputs. Products of float32 inputs follow JAX's
matmul precision (`jax_default_matmul_precision`: "highest" is full float32, the default
lets Triton use TF32); bfloat16 and float16 inputs run on the tensor cores with float32
accumulation, P and dS rounded to the input type for their products, as FlashAttention does.

Shapes the blocks do not fit are padded inside the call: head dims up to a power of two
(at least 16, Triton's smallest product), lengths up to a multiple of the block with keys
of segment 0. `interpret=True` runs the same kernels in Pallas's interpreter on any backend;
the tests check them there against `dense`, and compiled on a GPU against the XLA program,
outputs and gradients.
"""

from __future__ import annotations

import functools
import json
import math
import operator
import os

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from hpnlp import kernels
from hpnlp.attention.base import check_inputs

LOG2E = math.log2(math.e)
DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
# The widest head dim `auto` gives the kernels, per product width: compiled, checked against the
# twin and timed on one GPU, an H200 (`tools/flash_gpu_blocks.py`, L = 4096), and on no other.
# At head dim 128 the 16-bit kernels ran forward+backward 11-17x faster than the XLA program,
# but the float32 ones, their products on the CUDA cores, 4.7x slower at the rule's blocks (and
# the fastest forward alone about as long as XLA's forward+backward), so float32 stops at 64.
# Even at 64 float32 wins only at the H200's measured blocks, and only at L = 4096 (11.2
# against 12.0 ms; the rule's blocks took 14.2, and at L = 16384 the kernels took 168.4 ms
# against 165.4): `blocker` has `auto` leave float32 to XLA on a GPU model with no measured
# entry for its head dim; an explicit impl='kernel' runs the rule's blocks there (slower, and
# as correct: a run saved so resumes on any GPU the kernels take).
# `flash_attention` itself takes any head dim (the interpreter tests run other widths).
MAX_HEAD_DIM = {4: 64, 2: 128}
# The oldest GPUs the kernels are offered to: they were compiled only on Hopper (9.0); below
# Ampere (8.0) bfloat16 tensor-core products and the rule's shared memory (about 64 KB for a
# float32 backward tile, 99 KB for a 16-bit one at head dim 128) are untried.
MIN_CAPABILITY = (8, 0)

_CompilerParams = getattr(plgpu, "CompilerParams", None) or getattr(plgpu, "TritonCompilerParams")


def blocker(head_dim: int, value_dim: int, dtype, *, impl: str = "auto") -> str | None:
    """Why the GPU kernel cannot run this attention in the current trace, or, for
    `impl="auto"`, why `auto` leaves it to XLA (float32 with no measured blocks, the one
    reason of speed, not of what runs); None if it runs it."""
    if jax.default_backend() != "gpu":
        return f"the GPU kernel needs the GPU backend; it is {jax.default_backend()!r}"
    if jnp.dtype(dtype) not in [jnp.dtype(d) for d in DTYPES]:
        return f"dtype {jnp.dtype(dtype).name} (the GPU kernel takes float32, bfloat16, float16)"
    capability = compute_capability()
    if capability is None:  # a review (session 115): a ROCm GPU passed the check below
        return ("no CUDA compute capability (the GPU kernels are Triton programs compiled and "
                "tuned for NVIDIA GPUs only); impl='xla' runs there")
    if capability < MIN_CAPABILITY:
        return (f"compute capability {'.'.join(map(str, capability))} (the GPU kernels need "
                f"{'.'.join(map(str, MIN_CAPABILITY))} or newer: they were compiled only on "
                "Hopper, and older GPUs' bfloat16 products and shared memory are untried); "
                "impl='xla' runs there")
    widest = MAX_HEAD_DIM[jnp.dtype(dtype).itemsize]
    if max(head_dim, value_dim) > widest:
        return (f"head dim {max(head_dim, value_dim)} (the GPU kernels in "
                f"{jnp.dtype(dtype).name} are checked and faster than XLA up to {widest}; call "
                "flash_gpu.flash_attention directly to try a wider one)")
    key = tuned_key(dtype, max(head_dim, value_dim))
    if (impl == "auto" and jnp.dtype(dtype).itemsize == 4
            and key not in tuned_table().get(_device_kind(), {})):
        # a review (r14): without measured blocks float32 was measured slower than XLA. Only
        # `auto`'s choice (a diff review, d2: it refused impl='kernel', so a float32 run saved
        # on the H200 could not resume on an H100)
        return (f"float32 at head dim {max(head_dim, value_dim)} on {_device_kind()!r}, which "
                f"has no measured blocks ({key} in flash_gpu_blocks.json; on an H200 the "
                "rule's blocks ran 1.21x slower than the XLA program, which `auto` runs here); "
                "`python tools/flash_gpu_blocks.py --write` on this GPU measures them, and "
                "impl='kernel' runs the rule's")
    return kernels.single_device_reason()


def compute_capability() -> tuple[int, ...] | None:
    """The first device's CUDA compute capability, (9, 0) for Hopper; None where it has none
    that reads as numbers (a CPU, a ROCm GPU)."""
    try:  # a device of this process (in a run of several, devices()[0] is process 0's)
        return tuple(int(x) for x in str(jax.local_devices()[0].compute_capability).split("."))
    except (AttributeError, ValueError):
        return None


def _pow2(n: int, least: int = 16) -> int:
    return max(least, 1 << (n - 1).bit_length())


# Block sizes measured per GPU model by `python tools/flash_gpu_blocks.py --write`, keyed by
# the device kind, then "<float32|16bit>_d<padded head dim>"; other GPUs and shapes take the
# rule in `default_blocks`.
TUNED_PATH = os.path.join(os.path.dirname(__file__), "flash_gpu_blocks.json")


def tuned_table(path: str | None = None) -> dict:
    """The measured block sizes (`TUNED_PATH` unless `path`), read once per path."""
    return _read_table(path or TUNED_PATH)


@functools.lru_cache(maxsize=None)
def _read_table(path: str) -> dict:
    try:
        with open(path) as f:
            table = json.load(f)
    except FileNotFoundError:
        return {}
    except ValueError as e:
        raise ValueError(f"flash_gpu: {path} is not valid JSON ({e}); rewrite it with `python "
                         "tools/flash_gpu_blocks.py --write` on the GPU, or restore it from "
                         "git") from e
    return table


def tuned_key(dtype, head_dim: int) -> str:
    return f"{'float32' if jnp.dtype(dtype).itemsize == 4 else '16bit'}_d{_pow2(head_dim)}"


def _device_kind() -> str:
    return jax.local_devices()[0].device_kind  # this process's, as `compute_capability`


def default_blocks(dtype, head_dim: int) -> dict:
    """Block sizes and warps per program: this GPU model's measured entry in `TUNED_PATH`
    where it has one, else a rule: 16-bit tiles are half the bytes of float32 ones, so they
    can be twice as long for the same registers and shared memory."""
    wide = jnp.dtype(dtype).itemsize <= 2 and head_dim <= 128
    warps = 4 if head_dim <= 64 else 8
    cfg = dict(fwd_q=128 if wide else 64, fwd_k=64, fwd_warps=warps, fwd_stages=2,
               bwd_outer=128 if wide else 64, bwd_inner=32, bwd_warps=warps, bwd_stages=2)
    entry = tuned_table().get(_device_kind(), {}).get(tuned_key(dtype, head_dim), {})
    return cfg | {k: int(v) for k, v in entry.items() if k in cfg}


def _visible(a_ids, b_ids, a_pos, b_pos, segments: bool, causal: bool, keys_first=False):
    """Bool tile of the (query, key) pairs that may attend, [Q, K] from (query, key)
    arguments, or [K, Q] from (key, query) ones with `keys_first`; None when all may."""
    ok = None
    if segments:
        keys = a_ids[:, None] if keys_first else b_ids[None, :]
        ok = (a_ids[:, None] == b_ids[None, :]) & (keys != 0)
    if causal:
        c = (a_pos[:, None] <= b_pos[None, :]) if keys_first else (a_pos[:, None] >= b_pos[None, :])
        ok = c if ok is None else ok & c
    return ok


def _key_blocks_for(i, bq, bk, nk, causal):
    """Key blocks query block `i` needs: all, or (causal) those at or left of its diagonal."""
    if not causal:
        return nk
    # lax.div, not //: the indices are non-negative, and floor division's sign fix-up is
    # more than the Triton lowering needs.
    return jnp.minimum(jax.lax.div((i + 1) * bq - 1, bk) + 1, nk)


def _fwd_kernel(q_ref, k_ref, v_ref, qs_ref, ks_ref, o_ref, lse_ref, *, c, causal, segments,
                bk, nk):
    bq = q_ref.shape[0]
    i = pl.program_id(0)
    q = q_ref[...]
    qs = qs_ref[...] if segments else None
    qpos = i * bq + jnp.arange(bq)

    def body(j, carry):
        m_Q, l_Q, acc_QD = carry
        k_KD = k_ref[pl.ds(j * bk, bk), :]
        s_QK = plgpu.dot(q, k_KD, trans_b=True) * c
        ks = ks_ref[pl.ds(j * bk, bk)] if segments else None
        ok = _visible(qs, ks, qpos, j * bk + jnp.arange(bk), segments, causal)
        if ok is not None:
            s_QK = jnp.where(ok, s_QK, -jnp.inf)
        m_new = jnp.maximum(m_Q, jnp.max(s_QK, axis=1))
        # A row that has seen nothing yet has max -inf: shift by 0 so exp2 gives 0, not NaN.
        m_use = m_new if ok is None else jnp.where(m_new == -jnp.inf, 0.0, m_new)
        p_QK = jnp.exp2(s_QK - m_use[:, None])
        corr_Q = jnp.exp2(m_Q - m_use)
        v_KD = v_ref[pl.ds(j * bk, bk), :]
        acc_QD = acc_QD * corr_Q[:, None] + plgpu.dot(p_QK.astype(v_KD.dtype), v_KD)
        return m_new, l_Q * corr_Q + jnp.sum(p_QK, axis=1), acc_QD

    init = (jnp.full((bq,), -jnp.inf, jnp.float32), jnp.zeros((bq,), jnp.float32),
            jnp.zeros((bq, o_ref.shape[-1]), jnp.float32))
    m_Q, l_Q, acc_QD = jax.lax.fori_loop(0, _key_blocks_for(i, bq, bk, nk, causal), body, init)
    seen = l_Q > 0
    l_safe = jnp.where(seen, l_Q, 1.0)
    o_ref[...] = (acc_QD * jnp.where(seen, 1.0 / l_safe, 0.0)[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(seen, m_Q + jnp.log2(l_safe), jnp.inf)  # base 2; +inf: P = 0


def _dkdv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qs_ref, ks_ref, dk_ref, dv_ref,
                 *, c, scale, causal, segments, bq, nq):
    """Key-major tiles ([K, Q], the transpose of the forward's): P^T and dS^T are made in the
    layout their products with dO and Q take, so no computed tile is transposed (a
    transposed register tile is a round trip through shared memory)."""
    bk = k_ref.shape[0]
    j = pl.program_id(0)
    k_KD, v_KD = k_ref[...], v_ref[...]
    ks = ks_ref[...] if segments else None
    kpos = j * bk + jnp.arange(bk)

    def body(i, carry):
        dk_KD, dv_KD = carry
        rows = pl.ds(i * bq, bq)
        q_QD, do_QD = q_ref[rows, :], do_ref[rows, :]
        qs = qs_ref[rows] if segments else None
        ok_KQ = _visible(ks, qs, kpos, i * bq + jnp.arange(bq), segments, causal, keys_first=True)
        st_KQ = plgpu.dot(k_KD, q_QD, trans_b=True) * c
        if ok_KQ is not None:
            st_KQ = jnp.where(ok_KQ, st_KQ, -jnp.inf)
        pt_KQ = jnp.exp2(st_KQ - lse_ref[rows][None, :])
        dpt_KQ = plgpu.dot(v_KD, do_QD, trans_b=True)
        dst_KQ = pt_KQ * (dpt_KQ - delta_ref[rows][None, :])
        dv_KD += plgpu.dot(pt_KQ.astype(do_QD.dtype), do_QD)
        dk_KD += plgpu.dot(dst_KQ.astype(q_QD.dtype), q_QD)
        return dk_KD, dv_KD

    first = jax.lax.div(j * bk, bq) if causal else 0  # causal: earlier query blocks see none
    init = (jnp.zeros(dk_ref.shape, jnp.float32), jnp.zeros(dv_ref.shape, jnp.float32))
    dk_KD, dv_KD = jax.lax.fori_loop(first, nq, body, init)
    dk_ref[...] = (dk_KD * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv_KD.astype(dv_ref.dtype)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qs_ref, ks_ref, dq_ref,
               *, c, scale, causal, segments, bk, nk):
    bq = q_ref.shape[0]
    i = pl.program_id(0)
    q_QD, do_QD, lse_Q, delta_Q = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...]
    qs = qs_ref[...] if segments else None
    qpos = i * bq + jnp.arange(bq)

    def body(j, dq_QD):
        cols = pl.ds(j * bk, bk)
        k_KD = k_ref[cols, :]
        ks = ks_ref[cols] if segments else None
        ok = _visible(qs, ks, qpos, j * bk + jnp.arange(bk), segments, causal)
        s_QK = plgpu.dot(q_QD, k_KD, trans_b=True) * c
        if ok is not None:
            s_QK = jnp.where(ok, s_QK, -jnp.inf)
        p_QK = jnp.exp2(s_QK - lse_Q[:, None])  # P from the forward's logsumexp
        dp_QK = plgpu.dot(do_QD, v_ref[cols, :], trans_b=True)
        ds_QK = p_QK * (dp_QK - delta_Q[:, None])  # dS = P (dP - rowsum(dO O))
        return dq_QD + plgpu.dot(ds_QK.astype(k_KD.dtype), k_KD)

    dq_QD = jax.lax.fori_loop(0, _key_blocks_for(i, bq, bk, nk, causal), body,
                              jnp.zeros(dq_ref.shape, jnp.float32))
    dq_ref[...] = (dq_QD * scale).astype(dq_ref.dtype)


def _row_spec(block, dim):  # [B, N, H, dim] -> one block of one head, grid (n, b, h)
    return pl.BlockSpec((None, block, None, dim), lambda n, b, h: (b, n, h, 0))


def _head_spec(length, dim):  # [B, N, H, dim] -> one whole head
    return pl.BlockSpec((None, length, None, dim), lambda n, b, h: (b, 0, h, 0))


def _stat_spec(block):  # [B, H, N] -> one block of one head's row statistics
    return pl.BlockSpec((None, None, block), lambda n, b, h: (b, h, n))


def _stat_head_spec(length):
    return pl.BlockSpec((None, None, length), lambda n, b, h: (b, h, 0))


def _seg_specs(segments, q_block, q_len, k_block, k_len):
    """Specs of the query and key ids; each None means the whole row (else one block)."""
    if not segments:
        return [None, None]
    return [pl.BlockSpec((None, q_block or q_len), (lambda n, b, h: (b, n)) if q_block
                         else (lambda n, b, h: (b, 0))),
            pl.BlockSpec((None, k_block or k_len), (lambda n, b, h: (b, n)) if k_block
                         else (lambda n, b, h: (b, 0)))]


def _params(cfg, pass_):
    return _CompilerParams(num_warps=cfg[f"{pass_}_warps"], num_stages=cfg[f"{pass_}_stages"])


def _forward(q, k, v, segs, causal, scale, cfg, interpret):
    B, L, H, D = q.shape
    S, Dv = k.shape[1], v.shape[-1]
    bq, bk = cfg["fwd_q"], cfg["fwd_k"]
    segments = segs is not None
    kernel = functools.partial(_fwd_kernel, c=scale * LOG2E, causal=causal, segments=segments,
                               bk=bk, nk=S // bk)
    return pl.pallas_call(
        kernel, grid=(L // bq, B, H),
        in_specs=[_row_spec(bq, D), _head_spec(S, D), _head_spec(S, Dv),
                  *_seg_specs(segments, bq, L, None, S)],
        out_specs=[_row_spec(bq, Dv), _stat_spec(bq)],
        out_shape=[jax.ShapeDtypeStruct((B, L, H, Dv), q.dtype),
                   jax.ShapeDtypeStruct((B, H, L), jnp.float32)],
        compiler_params=_params(cfg, "fwd"), interpret=interpret, name="hpnlp_flash_fwd",
    )(q, k, v, *(segs or (None, None)))


def _backward(q, k, v, segs, o, lse, do, causal, scale, cfg, interpret):
    B, L, H, D = q.shape
    S, Dv = k.shape[1], v.shape[-1]
    outer, inner = cfg["bwd_outer"], cfg["bwd_inner"]
    segments = segs is not None
    delta = jnp.einsum("blhd,blhd->bhl", o.astype(jnp.float32), do.astype(jnp.float32))
    args = (q, k, v, do, lse, delta, *(segs or (None, None)))
    common = dict(c=scale * LOG2E, scale=scale, causal=causal, segments=segments)
    dk, dv = pl.pallas_call(
        functools.partial(_dkdv_kernel, bq=inner, nq=L // inner, **common),
        grid=(S // outer, B, H),
        in_specs=[_head_spec(L, D), _row_spec(outer, D), _row_spec(outer, Dv), _head_spec(L, Dv),
                  _stat_head_spec(L), _stat_head_spec(L), *_seg_specs(segments, None, L, outer, S)],
        out_specs=[_row_spec(outer, D), _row_spec(outer, Dv)],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        compiler_params=_params(cfg, "bwd"), interpret=interpret,
        name="hpnlp_flash_bwd_dkdv",
    )(*args)
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, bk=inner, nk=S // inner, **common),
        grid=(L // outer, B, H),
        in_specs=[_row_spec(outer, D), _head_spec(S, D), _head_spec(S, Dv), _row_spec(outer, Dv),
                  _stat_spec(outer), _stat_spec(outer), *_seg_specs(segments, outer, L, None, S)],
        out_specs=_row_spec(outer, D),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=_params(cfg, "bwd"), interpret=interpret, name="hpnlp_flash_bwd_dq",
    )(*args)
    return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _flash(q, k, v, segs, causal, scale, cfg, interpret):
    return _forward(q, k, v, segs, causal, scale, dict(cfg), interpret)[0]


def _flash_fwd(q, k, v, segs, causal, scale, cfg, interpret):
    o, lse = _forward(q, k, v, segs, causal, scale, dict(cfg), interpret)
    return o, (q, k, v, segs, o, lse)


def _flash_bwd(causal, scale, cfg, interpret, res, do):
    q, k, v, segs, o, lse = res
    return (*_backward(q, k, v, segs, o, lse, do, causal, scale, dict(cfg), interpret), None)


_flash.defvjp(_flash_fwd, _flash_bwd)


def flash_attention(q_BLHD, k_BSHD, v_BSHD, mask_BL=None, *, causal: bool = False,
                    blocks: dict | None = None, interpret: bool = False):
    """Exact softmax attention by the GPU kernels; `chunked_attention`'s arguments and
    result. `blocks` overrides `default_blocks` entries (powers of two); `interpret` runs the
    kernels in Pallas's interpreter (any backend, slowly: for tests)."""
    check_inputs(q_BLHD, k_BSHD, v_BSHD, mask_BL)
    B, L, H, D = q_BLHD.shape
    S, Dv = k_BSHD.shape[1], v_BSHD.shape[-1]
    if not L or not S:  # no queries, or no key to see: zeros, as for a row that sees none
        return jnp.zeros((B, L, H, Dv), q_BLHD.dtype)
    dtype = jnp.result_type(q_BLHD, k_BSHD, v_BSHD)
    cfg = default_blocks(dtype, max(D, Dv))
    unknown = set(blocks or {}) - set(cfg)
    if unknown:
        raise ValueError(f"flash_gpu: blocks has unknown keys {sorted(unknown)}; the keys are "
                         f"{sorted(cfg)}")
    cfg |= dict(blocks or {})
    for name, value in cfg.items():  # integers, NumPy's too (a review, session 118: 32.0
        # failed in `&` naming nothing, and warps or stages of 0 inside Triton's compile)
        whole = operator.index(value) if kernels.is_integer(value) else None
        tile = name in ("fwd_q", "fwd_k", "bwd_outer", "bwd_inner")
        if whole is None or (whole < 16 or whole & (whole - 1) if tile else whole < 1):
            raise ValueError(f"flash_gpu: blocks[{name!r}] = {value!r} must be "
                             + ("a power of two >= 16 (Triton's tile sizes)" if tile else
                                "a positive integer"))
        cfg[name] = whole
    # Short sequences take the smallest blocks that cover them.
    cfg["fwd_q"] = min(cfg["fwd_q"], _pow2(L))
    cfg["fwd_k"] = min(cfg["fwd_k"], _pow2(S))
    cfg["bwd_outer"] = min(cfg["bwd_outer"], _pow2(min(L, S)))
    cfg["bwd_inner"] = min(cfg["bwd_inner"], cfg["bwd_outer"])
    step = max(cfg["fwd_q"], cfg["fwd_k"], cfg["bwd_outer"])  # powers of two: all divide it
    Lp, Sp = -(-L // step) * step, -(-S // step) * step
    Dp, Dvp = _pow2(D), _pow2(Dv)

    segs = None
    if mask_BL is not None or Sp != S:
        qs = jnp.ones((B, L), jnp.int32) if mask_BL is None else mask_BL.astype(jnp.int32)
        ks = jnp.ones((B, S), jnp.int32) if mask_BL is None else mask_BL.astype(jnp.int32)
        segs = (jnp.pad(qs, ((0, 0), (0, Lp - L))), jnp.pad(ks, ((0, 0), (0, Sp - S))))

    def pad(x, n, n_pad, d_pad):
        x = x.astype(dtype)
        return jnp.pad(x, ((0, 0), (0, n_pad - n), (0, 0), (0, d_pad - x.shape[-1])))

    out = _flash(pad(q_BLHD, L, Lp, Dp), pad(k_BSHD, S, Sp, Dp), pad(v_BSHD, S, Sp, Dvp), segs,
                 bool(causal), 1.0 / math.sqrt(D), tuple(sorted(cfg.items())), interpret)
    return out[:, :L, :, :Dv].astype(q_BLHD.dtype)
