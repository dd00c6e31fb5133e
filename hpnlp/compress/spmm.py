"""A pruned weight's product on the CPU (`spmm.cc`), beside its exact XLA twin.

    w = prepare_sparse_weight(w_KxN)              # once: the nonzeros by column (CSC)
    y_MxN = sparse_matmul(x_MxK, w)               # float32, no work for a zero weight

Unstructured pruning leaves a weight of the same shape with zeros in it, and XLA's dense
product spends the same time on it whatever the sparsity. This kernel stores only the
nonzeros (column pointers, row indices and values: 8 bytes a nonzero against 4 a
weight, so it is smaller from 50% sparsity on) and multiplies only them, with the rows
of x as its vector lanes (see the top of `spmm.cc`). `python -m hpnlp.bench sparse`
measures where it beats the dense product of the masked weight, against PyTorch's and
SciPy's CSR products in the same run: at high sparsity only, since the kernel moves each
activation twice (a transpose in, one out) whatever the weight holds.

The kernel skips what is not stored, so a NaN or infinity in x reaches only the outputs
of the weights it meets (the dense twin spreads it to every output through 0 * inf).

Written for inference: a sparse weight is what a pruned run serves, not what trains
(training keeps the dense weight and its mask: `hpnlp.compress.prune`). Its derivatives
are the dense twin's (`hpnlp.kernels.with_twin_gradient`): x's and the stored values', so
`impl="auto"` has one gradient whether or not the kernel runs. The wrapper takes
`impl="auto"|"kernel"|"xla"` like `hpnlp.compress.kernels`: "auto" runs the kernel where
it can and the twin (`sparse_matmul_xla`: the dense product of the weight the arrays
describe) elsewhere. The kernel's rows-per-block is chosen per CPU on first use
(`TUNING`); `vectors=` overrides it.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

from hpnlp import kernels
from hpnlp.kernels import tuning

KERNEL = kernels.CpuKernel(
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "spmm.cc"),
    {"hpnlp_csc_matmul": "HpnlpCscMatmul"}, what="the sparse product")

IMPLS = ("auto", "kernel", "xla")
VECTORS = (1, 2, 4, 8)  # a row block's vectors: MB = vectors * floats per vector rows
DEFAULT_VECTORS = 4
# Below this many multiply-adds one thread runs the product.
_MIN_PARALLEL_MACS = 1 << 17
# The probe: the byte LM's largest block product at 95% sparsity (26 of 512 per column).
PROBE = dict(M=1024, K=512, N=512, per_col=26)


def _probe(lib, cfg):
    args = [PROBE["M"], PROBE["K"], PROBE["N"], PROBE["per_col"], cfg["vectors"], kernels.cores()]
    return tuning.run_probe(lib, "hpnlp_spmm_probe", args, "the sparse product's tuning probe",
                            cfg)


TUNING = tuning.Tuning(KERNEL, "csc", default={"vectors": DEFAULT_VECTORS}, probe=_probe,
                       candidates=[{"vectors": v} for v in VECTORS],
                       shape=" ".join(f"{k}={v}" for k, v in PROBE.items()))


def available() -> bool:
    """Whether the kernel can run here (compiles it on the first call)."""
    return KERNEL.available()


@functools.partial(jax.tree_util.register_dataclass, data_fields=["col_ptr", "row", "val"],
                   meta_fields=["k"])
@dataclasses.dataclass(frozen=True)
class SparseWeight:
    """A weight W [k, N] by its nonzeros, column by column (CSC): column n's are entries
    col_ptr[n] to col_ptr[n + 1] of `row` (their k, ascending) and `val`. A row listed
    twice in a column (a non-canonical CSC, as SciPy's before `sum_duplicates`) adds its
    values, in the kernel and in `dense()` alike."""

    col_ptr: jax.Array  # int32 [N + 1]
    row: jax.Array  # int32 [nnz]
    val: jax.Array  # float32 [nnz]
    k: int

    @property
    def shape(self) -> tuple[int, int]:
        return (self.k, self.col_ptr.shape[0] - 1)

    @property
    def nnz(self) -> int:
        return self.row.shape[0]

    @property
    def density(self) -> float:
        return self.nnz / max(1, self.k * self.shape[1])

    @property
    def nbytes(self) -> int:
        arrays = (self.col_ptr, self.row, self.val)
        return int(sum(np.dtype(a.dtype).itemsize * a.size for a in arrays))

    def dense(self):
        """The float32 [k, N] weight the arrays describe, repeated (row, column) entries
        summed as the kernel sums them."""
        K, N = self.shape
        col = jnp.repeat(jnp.arange(N, dtype=jnp.int32), jnp.diff(self.col_ptr),
                         total_repeat_length=self.nnz)
        # add, not set (review r5): set kept one of a repeated entry's values, by scatter
        # order, where the kernel sums them; refusing repeats instead could not reach the
        # arrays traced under jit, vmap or grad (the values are a data field), only concrete
        # ones, so the twin (and the gradient, taken from it) describes what the kernel does
        return jnp.zeros((K, N), jnp.float32).at[self.row, col].add(self.val)


def prepare_sparse_weight(w_KxN) -> SparseWeight:
    """The nonzeros of a float weight [K, N] (a pruned weight: its mask applied) as a
    SparseWeight. Runs on the host, once, at load time."""
    w = np.asarray(w_KxN)
    if w.ndim != 2:
        raise ValueError(f"prepare_sparse_weight: the weight must be [K, N]; got shape {w.shape}")
    # jnp.issubdtype: NumPy's does not count ml_dtypes' bfloat16 as floating
    if not jnp.issubdtype(w.dtype, jnp.floating):
        raise ValueError(f"prepare_sparse_weight: the weight must be float; got {w.dtype}")
    if w.size >= 2 ** 31:
        raise ValueError(f"prepare_sparse_weight: {w.size} weights; int32 indices hold < 2^31")
    cols, rows = np.nonzero(w.T)  # column-major order: by column, rows ascending
    counts = np.bincount(cols, minlength=w.shape[1])
    col_ptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    return SparseWeight(jnp.asarray(col_ptr), jnp.asarray(rows.astype(np.int32)),
                        jnp.asarray(w[rows, cols].astype(np.float32)), k=w.shape[0])


def _check_x(what: str, x_MxK, w: SparseWeight):
    if not isinstance(w, SparseWeight):
        raise ValueError(f"{what}: the weight must be a SparseWeight (prepare_sparse_weight); "
                         f"got {type(w).__name__}")
    if getattr(x_MxK, "ndim", None) != 2 or jnp.dtype(x_MxK.dtype) != jnp.float32:
        raise ValueError(f"{what}: x_MxK must be a float32 [M, K] array; got "
                         f"{getattr(x_MxK, 'dtype', type(x_MxK).__name__)} "
                         f"{tuple(getattr(x_MxK, 'shape', ()))}")
    if x_MxK.shape[1] != w.k:
        raise ValueError(f"{what}: x_MxK has K = {x_MxK.shape[1]} but the weight has K = {w.k}")


def sparse_matmul_xla(x_MxK, w: SparseWeight):
    """The XLA twin: x times the dense weight the arrays describe (what the pruned model
    computes with its mask applied)."""
    _check_x("sparse_matmul_xla", x_MxK, w)
    return jnp.dot(x_MxK, w.dense(), precision=jax.lax.Precision.HIGHEST)


def _vectors(given: int | None) -> np.int64:
    v = TUNING.config()["vectors"] if given is None else given
    # an integer, as the threads and blocks of every kernel here (review r5: True, == 1, and
    # 4.0 ran as 1 and 4 without a word)
    if not kernels.is_integer(v) or v not in VECTORS:
        raise ValueError(f"sparse_matmul: vectors must be one of {VECTORS}; got {given!r}")
    return np.int64(v)


def sparse_matmul(x_MxK, w: SparseWeight, *, impl: str = "auto", threads: int | None = None,
                  vectors: int | None = None):
    """float32 x_MxK @ the sparse weight [K, N] -> float32 [M, N]. `threads` None: every
    core (one for small products); `vectors`: the row block (tuned per CPU if None)."""
    _check_x("sparse_matmul", x_MxK, w)
    if impl not in IMPLS:
        raise ValueError(f"sparse_matmul: impl must be one of {IMPLS}; got {impl!r}")
    # checked whichever path runs (as the quantized products do): threads=0 or a bad
    # `vectors` passed with impl="xla", or "auto" where the kernel cannot run
    if threads is not None and (not kernels.is_integer(threads) or threads < 1):
        raise ValueError(f"sparse_matmul: threads must be an integer >= 1; got {threads!r}")
    # the given row block now; the tuned one only on the kernel's path (below), not to tune
    # for the XLA path
    n_vectors = None if vectors is None else _vectors(vectors)
    if impl == "xla":
        return sparse_matmul_xla(x_MxK, w)
    reason = KERNEL.blocker()
    if reason is not None:
        if impl == "kernel":
            raise RuntimeError(f"sparse_matmul: the sparse kernel cannot run here: {reason}. "
                               "Use impl='xla' (the XLA twin) instead.")
        return sparse_matmul_xla(x_MxK, w)
    M, N = x_MxK.shape[0], w.shape[1]
    if threads is None:
        threads = 1 if M * w.nnz < _MIN_PARALLEL_MACS else kernels.cores()
    if n_vectors is None:
        n_vectors = _vectors(None)

    def kernel(x, w):
        return jax.ffi.ffi_call("hpnlp_csc_matmul", jax.ShapeDtypeStruct((M, N), jnp.float32),
                                vmap_method="sequential")(
            x, w.col_ptr.astype(jnp.int32), w.row.astype(jnp.int32),
            w.val.astype(jnp.float32), threads=np.int64(threads), vectors=n_vectors)

    # its derivatives (x's and the nonzeros' values') are the dense twin's
    return kernels.with_twin_gradient(kernel, sparse_matmul_xla, x_MxK, w)
