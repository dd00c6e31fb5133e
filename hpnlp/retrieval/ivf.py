"""hpnlp's own approximate MIPS: an inverted file (IVF) over k-means cells, scanned by a
CPU kernel or by its jittable XLA twin.

Jégou et al. 2011 (the IVF of faiss): k-means (in JAX) splits the database into `lists`
cells; a query finds its L2-nearest cell centroids (whatever the metric: the cells are
k-means' L2 cells, so those hold its nearest vectors; `IVFIndex.probe_rows`), scans only
the vectors of those cells, and returns their top k exactly scored. The one idea that
makes it fast: a query touches `nprobe x chunk` vectors instead of N.

To stay jittable with static shapes, every cell is cut into **chunks** of at most `chunk`
vectors (default twice the mean cell size), each padded and stored as one contiguous
[chunk, D] slab; a long cell simply spans several chunks with the same centroid, which
`top_k` over centroid scores probes side by side (ties: the lower chunk first). `nprobe`
counts chunks, so the work per query is fixed whatever k-means' balance.

The scan, two ways (`impl`). On a CPU backend with float32 vectors ("auto") it is the
`hpnlp_ivf_scan` kernel of `mips_cpu.cc` (`ivf_scan`; one build with the exact search's
kernel, `exact.KERNEL`): the chunks are packed once per rebuild into that kernel's panels
[M, T, D, NP] (c padded to T panels of NP rows, id -1), the probes are the exact kernel's
top `nprobe` of the chunk centroids, and the probes are inverted so that every probed chunk
is read once, in place, for all the queries that probe it (up to `QUERY_BLOCK` queries at
a time, the chunks split over the cores), with the exact kernel's register tile and sorted
top-k lists. It ranks by (score desc, id asc) over the probed rows, as its numpy twin
`scan_reference` does, and a query's scores do not depend on the other queries beside it.
Elsewhere (`impl="xla"`, another backend, bfloat16) the scan is `search_chunks`, the pure
function the index jits (usable inside a larger jitted program): it gathers each query's
probed chunks into a [Q, P, c, D] copy and takes `lax.top_k` of the scores, then of a key
that keeps the lower id among the scores tied with the k-th, so it too ranks by (score
desc, id asc): the two give the same ids where their scores are bitwise equal, exact ties
included (they sum the products in different orders, and the XLA scan may store bfloat16).
`main()` times both against the exact kernel (`python -c "from hpnlp.retrieval import ivf;
ivf.main()" --n 1000000 --nprobe 2 4 8`).

`metric="l2"` (the kNN-LM's): the cells are k-means' own L2 cells of the raw vectors, and
the scan reads them as [x, |x|^2] against queries [2q, -1] (|q|^2 - |q - x|^2), centroids
likewise, so that probes and results are the nearest by L2; before, the kNN-LM added keys
already so augmented, and k-means clustered them mostly by their norms (a bug hunt,
session 101).

Shape letters: N database, Q queries, D dimension, C cells, M chunks, c chunk rows,
P probes, K results; the kernel's T panels of NP rows a chunk, r = T x NP padded rows.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from hpnlp import kernels
from hpnlp.retrieval import exact
from hpnlp.retrieval.base import HostIndex, RetrievalError, check_metric_option, register

# Queries per block of the kernel's scan: a chunk probed by several queries of a block is
# read once for all of them, and fewer blocks than threads split the chunks instead, so up
# to this many queries read every probed chunk once in all; more are cut into blocks, each
# thread scanning its own, so that the queries a block gathers from (2 MB at D = 128) and
# its lists stay in cache.
QUERY_BLOCK = 4096


def _nearest(x_ND, c_CD, block: int = 0):
    """Index of the nearest centroid (L2) of every row, in blocks of rows (`block`; 0: as
    many as keep a block's scores [rows, C] and its rows [rows, D] to about 16 MB, at most
    16,384)."""
    n = x_ND.shape[0]
    if n == 0:  # cells trained before any add (`IVFIndex.train(x)`)
        return jnp.zeros((0,), jnp.int32)
    # A README walk's kNN-LM datastore (3.5M keys, C = 7,500 cells) had 16,384-row blocks:
    # 490 MB of scores, which XLA kept twice in k-means and twice in the assignment; and the
    # rows padded to whole blocks were a copy of them all
    # (A floor of 256 rows let the scores pass 16 MB from C = 16,384 cells on: 64 MB at
    # 65,536, found in review; and the rows [block, D] were not counted.)
    block = min(n, block or int(min(16384, max(1, (4 << 20) // (c_CD.shape[0] + x_ND.shape[1])))))
    return _nearest_blocks(x_ND, c_CD, block)


@functools.partial(jax.jit, static_argnames=("block",))
def _nearest_blocks(x_ND, c_CD, block: int):
    """`_nearest` block by block; the last block ends at the last row (overlapping the one
    before it, whose rows it recomputes to the same answers), so nothing is padded."""
    n, half_norm_C = x_ND.shape[0], 0.5 * jnp.sum(c_CD * c_CD, axis=1)

    def one(i, out_N):
        start = jnp.minimum(i * block, n - block)
        x = jax.lax.dynamic_slice_in_dim(x_ND, start, block)
        # HIGHEST: the default is TF32 on GPU and bfloat16 on TPU, whose cells were not the
        # L2-nearest (review, session 109)
        x_C = jnp.matmul(x, c_CD.T, precision=jax.lax.Precision.HIGHEST)
        near = jnp.argmax(x_C - half_norm_C[None, :], axis=1).astype(jnp.int32)
        return jax.lax.dynamic_update_slice_in_dim(out_N, near, start, 0)
    return jax.lax.fori_loop(0, -(-n // block), one, jnp.zeros((n,), jnp.int32))


ADD_PIECE = 4096  # rows a compile of `_assign_added` takes at most


def _assign_added(x_ND: np.ndarray, c_CD) -> np.ndarray:
    """`_nearest` of vectors added after training (host arrays), in pieces of ADD_PIECE rows,
    the last padded to a power of two: a compile for each of at most 13 piece sizes, not one
    for every size an add has (a datastore built batch by batch, its last batch shorter)."""
    c_CD, out = jnp.asarray(c_CD), []
    for start in range(0, len(x_ND), ADD_PIECE):
        piece = x_ND[start:start + ADD_PIECE]
        rows = exact._pad_rows(len(piece), ADD_PIECE)
        padded = np.pad(piece, ((0, rows - len(piece)), (0, 0)))
        out.append(np.asarray(_nearest(jnp.asarray(padded), c_CD))[:len(piece)])
    return np.concatenate(out).astype(np.int32) if out else np.zeros((0,), np.int32)


@functools.partial(jax.jit, static_argnames=("iters",))
def _lloyd(x_ND, c_CD, key, *, iters: int):
    """`iters` Lloyd steps; an empty cell restarts at a random training vector."""
    def step(c_CD, key):
        a_N = _nearest(x_ND, c_CD)
        sums = jax.ops.segment_sum(x_ND, a_N, num_segments=c_CD.shape[0])
        counts = jax.ops.segment_sum(jnp.ones_like(a_N, jnp.float32), a_N, num_segments=c_CD.shape[0])
        fresh = x_ND[jax.random.randint(key, (c_CD.shape[0],), 0, x_ND.shape[0])]
        return jnp.where(counts[:, None] > 0, sums / jnp.maximum(counts, 1.0)[:, None], fresh), None

    c_CD, _ = jax.lax.scan(step, c_CD, jax.random.split(key, iters))
    return c_CD


def kmeans(x_ND: np.ndarray, cells: int, *, iters: int = 15, sample: int = 64, seed: int = 0):
    """k-means centroids [cells, D] from at most `sample` x `cells` training vectors."""
    rng = np.random.default_rng(seed)
    if len(x_ND) > sample * cells:
        x_ND = x_ND[np.sort(rng.choice(len(x_ND), sample * cells, replace=False))]
    init = x_ND[rng.choice(len(x_ND), cells, replace=False)]
    return np.asarray(_lloyd(jnp.asarray(x_ND), jnp.asarray(init), jax.random.key(seed), iters=iters))


def search_chunks(q_QD, centroid_MD, x_McD, id_Mc, k: int, nprobe: int, probe_QD=None):
    """Approximate top-k: each query scans the `nprobe` chunks whose centroids score best
    against `probe_QD` (default the query itself). An index's own centroids are its
    `IVFIndex.probe_rows`, one column wider than the vectors: with them, pass probe_QD =
    [q, 1] for metric "ip" (for "l2" the scan's query [2q, -1] is the probe's too).
    `centroid_MD` is each chunk's cell centroid; `id_Mc` -1 marks padding. Returns
    (scores [Q, K], ids [Q, K]) by (score desc, id asc); an id of -1 (score -inf) only
    where fewer than k real vectors were scanned."""
    # HIGHEST, as the scan: at the default (TF32 on GPU, bfloat16 on TPU) the |c|^2 ~ 300 of
    # an L2 centroid rounded by up to 1, and the probes were not the nearest cells (review,
    # session 109)
    probe_QD = q_QD if probe_QD is None else probe_QD
    probe_QP = jax.lax.top_k(jnp.matmul(probe_QD, centroid_MD.T,
                                        precision=jax.lax.Precision.HIGHEST), nprobe)[1]
    x_QPcD = x_McD[probe_QP]
    s_QPc = jnp.einsum("qd,qpcd->qpc", q_QD, x_QPcD.astype(jnp.float32),
                       precision=jax.lax.Precision.HIGHEST)
    id_QPc = id_Mc[probe_QP]
    s_QPc = jnp.where(id_QPc >= 0, s_QPc, -jnp.inf)
    q = q_QD.shape[0]
    s_QR, id_QR = s_QPc.reshape(q, -1), id_QPc.reshape(q, -1)
    # a bug hunt (session 101): top_k alone kept tied scores in probe order, not the lower
    # id first (ids equal to exact search's 0.22 of the time on {-1, 0, 1} vectors): the
    # scores above the k-th all, then the lowest ids of those equal to it. Both top_k take
    # float32 and the k-th score is the least of the top k, so that XLA:CPU runs each as its
    # TopK call (review, session 101: an int32 key, or a slice of the values, made each a
    # sort of every probed row, the selection 50x slower; one sort of (-score, id) was no
    # faster). A tied id's key is the float32 whose bits are 0x7F7FFFFF - id: finite, normal
    # and decreasing in the id for ids under 2.13 billion
    kth_Q1 = jnp.min(jax.lax.top_k(s_QR, k)[0], axis=1, keepdims=True)
    tie_QR = jax.lax.bitcast_convert_type(jnp.int32(0x7F7FFFFF) - id_QR, jnp.float32)
    key_QR = jnp.where(s_QR > kth_Q1, jnp.inf,
                       jnp.where((s_QR == kth_Q1) & (id_QR >= 0), tie_QR, -jnp.inf))
    pos = jax.lax.top_k(key_QR, k)[1]
    top_s, top_i = jnp.take_along_axis(s_QR, pos, axis=1), jnp.take_along_axis(id_QR, pos, axis=1)
    # (0 - s: -0.0 and 0.0 are one score, as they are to the kernel)
    _, top_i, top_s = jax.lax.sort((0.0 - top_s, top_i, top_s), dimension=1, num_keys=2)
    return top_s, top_i


@functools.lru_cache(maxsize=None)
def _search_fn(k: int, nprobe: int, query_block: int):
    def run(q_QD, probe_QD, centroid_MD, x_McD, id_Mc):
        def one(qp):
            return search_chunks(qp[0], centroid_MD, x_McD, id_Mc, k, nprobe, qp[1])
        s, i = jax.lax.map(one, (q_QD.reshape(-1, query_block, q_QD.shape[1]),
                                 probe_QD.reshape(-1, query_block, probe_QD.shape[1])))
        return s.reshape(-1, k), i.reshape(-1, k)
    return jax.jit(run)


def pack_chunks(x_McD, id_Mc):
    """The scan kernel's layout: each chunk padded with zero rows (id -1) to T panels of NP
    rows, each panel transposed. Returns (vectors [M, T, D, NP] float32, ids [M, r] int32)."""
    x_McD, id_Mc = np.asarray(x_McD, np.float32), np.asarray(id_Mc)
    nr = exact.layout()["np"]
    m, c, d = x_McD.shape
    t = max(1, -(-c // nr))
    if t * nr != c:
        x = np.zeros((m, t * nr, d), np.float32)
        x[:, :c] = x_McD
        ids = np.full((m, t * nr), -1, np.int32)
        ids[:, :c] = id_Mc
        x_McD, id_Mc = x, ids
    return (np.ascontiguousarray(x_McD.reshape(m, t, nr, d).transpose(0, 1, 3, 2)),
            np.ascontiguousarray(id_Mc, np.int32))


@functools.partial(jax.jit, static_argnames=("nr", "dtype", "l2"))
def _gather_chunks(x_ND, id_Mc, nr: int, dtype: str, l2: bool = False):
    """The rows of `x_ND` that `id_Mc` names (-1: a zero row) as chunks [M, c, D] of `dtype`,
    or (`nr` > 0) in `pack_chunks`'s layout [M, c / nr, D, nr]: one gather into the output,
    where building it on the host had taken it three times over and a copy of every vector
    besides (a README walk: the kNN-LM's ivf index peaked at 2.5x the exact one's memory).
    `l2`: each row [x, |x|^2] (D + 1 wide), for queries [2q, -1]."""
    rows = x_ND[jnp.maximum(id_Mc, 0)]
    if l2:
        rows = jnp.concatenate([rows, jnp.sum(rows * rows, axis=-1, keepdims=True)], axis=-1)
    rows = rows.astype(dtype)
    rows = jnp.where((id_Mc >= 0)[..., None], rows, jnp.zeros((), dtype))
    if not nr:
        return rows
    m, c, d = rows.shape
    return rows.reshape(m, c // nr, nr, d).transpose(0, 1, 3, 2)


def ivf_scan(q_QD, probe_QP, chunk_MTDN, id_Mr, k: int, *, threads: int | None = None,
             query_block: int | None = None):
    """The kernel: top-k inner products of each query [Q, D] over the real rows (id >= 0)
    of the chunks it probes ([Q, P] indices into chunks packed by `pack_chunks`). Returns
    (scores [Q, K] float32, ids [Q, K] int32) by (score desc, id asc); id -1 and score -inf
    only where a query's probes hold fewer than k real rows. A chunk probed twice by a
    query counts once. `threads` None: every core (one for tiny scans); `query_block`
    None: `QUERY_BLOCK`."""
    exact.KERNEL.library()  # built and its targets registered (raises, saying why, if not)
    q_QD = jnp.asarray(q_QD, jnp.float32)
    probe_QP = jnp.asarray(probe_QP, jnp.int32)
    if threads is None:
        (nq, p), (_, t, d, nr) = probe_QP.shape, chunk_MTDN.shape
        macs = nq * p * t * nr * d
        threads = 1 if macs < exact._MIN_PARALLEL_MACS else kernels.cores()
    qb = QUERY_BLOCK if query_block is None else int(query_block)
    if int(threads) < 1 or qb < 1:
        raise RetrievalError(f"threads={threads} and query_block={qb} must be >= 1")
    qb = min(qb, max(q_QD.shape[0], 1))  # one block of them all (as in `exact.mips_top_k`)
    return _scan_fn(int(k), int(threads), qb)(q_QD, probe_QP, jnp.asarray(chunk_MTDN), jnp.asarray(id_Mr))


@functools.lru_cache(maxsize=None)
def _scan_fn(k: int, threads: int, qb: int):
    def call(q_QD, probe_QP, chunk_MTDN, id_Mr):
        nq = q_QD.shape[0]
        out = (jax.ShapeDtypeStruct((nq, k), jnp.float32), jax.ShapeDtypeStruct((nq, k), jnp.int32))
        return jax.ffi.ffi_call("hpnlp_ivf_scan", out, vmap_method="sequential")(
            q_QD, probe_QP, chunk_MTDN, id_Mr, threads=np.int64(threads), qb=np.int64(qb))
    return jax.jit(call)


def scan_reference(q_QD, probe_QP, x_McD, id_Mc, k: int):
    """numpy twin of `ivf_scan`: per query, the top k by (score desc, id asc) over the
    real rows of the (distinct) chunks it probes; -inf and -1 past them."""
    q_QD, x_McD, id_Mc = np.asarray(q_QD, np.float64), np.asarray(x_McD), np.asarray(id_Mc)
    s_QK = np.full((len(q_QD), k), -np.inf, np.float32)
    i_QK = np.full((len(q_QD), k), -1, np.int64)
    for j, chunks in enumerate(np.asarray(probe_QP)):
        chunks = np.unique(chunks)
        ids, x = id_Mc[chunks].reshape(-1), x_McD[chunks].reshape(-1, x_McD.shape[2])
        ids, x = ids[ids >= 0], x[ids >= 0].astype(np.float64)
        s = x @ q_QD[j]
        top = np.lexsort((ids, -s))[:k]
        s_QK[j, :len(top)], i_QK[j, :len(top)] = s[top], ids[top]
    return s_QK, i_QK


def _check_lists(lists: int, n: int) -> None:
    """One line where `lists` k-means cells are more than the `n` vectors they train on."""
    if lists > n:
        raise RetrievalError(f"ivf index: lists={lists} cells but only {n} training vectors; "
                             f"use lists <= {n} or add more vectors first")


def _rows(chunk: int) -> int:
    """A chunk's rows: `chunk` rounded up to a multiple of 8."""
    return -(-chunk // 8) * 8


@register("ivf")
class IVFIndex(HostIndex):
    """Inverted file over k-means cells (see the module docstring).

    Options: `lists` k-means cells (default: min(N // 8, round(4 sqrt(N))), at least 1, for
    the N training vectors, set on the first search),
    `nprobe` chunks scanned per query (16), `chunk` rows per chunk (0: twice the mean cell
    size), `iters` k-means steps (15), `dtype` of the stored vectors ("float32" |
    "bfloat16" | "float16"), `seed`; `impl` "auto" (the scan kernel where it can run: a CPU backend
    with a compiler, float32; the XLA scan elsewhere), "kernel" (an error where it cannot
    run) or "xla"; `threads` of the kernel (None: every core); `query_block` queries per
    pass of the XLA scan (32); `metric` "ip" or "l2" (float32 only: `searches_l2`). The
    cells are trained on the vectors present at the first search (or `train`); later adds
    join the nearest cell.
    """

    METRICS = ("ip", "l2")

    def __init__(self, dim: int, *, lists: int = 0, nprobe: int = 16, chunk: int = 0,
                 iters: int = 15, query_block: int = 32, dtype: str = "float32", seed: int = 0,
                 impl: str = "auto", threads: int | None = None, metric: str = "ip"):
        super().__init__(dim, lists=lists, nprobe=nprobe, chunk=chunk, iters=iters,
                         query_block=query_block, dtype=dtype, seed=seed, impl=impl,
                         threads=threads, metric=metric)
        if impl not in exact.IMPLS:
            raise RetrievalError(f"impl={impl!r}; use one of {exact.IMPLS}")
        exact.check_options(self, at_least={"lists": 0, "nprobe": 1, "chunk": 0, "iters": 1,
                                            "query_block": 1, "seed": 0})
        check_metric_option(self)
        if metric == "l2" and dtype != "float32":
            raise RetrievalError(f"ivf index: metric='l2' with dtype={dtype!r}: the squared norms "
                                 "it scans by lose their precision (or overflow) below float32; "
                                 "use dtype='float32'")
        self.centroids = None  # [C, D]
        self._cell = np.zeros((0,), np.int32)  # [N] cell of every vector
        self._stale(None)

    @classmethod
    def searches_l2(cls, options: dict) -> bool:
        """float32 storage only (see `__init__`): bfloat16 and float16 would take the kNN-LM's
        L2 through inner product, which `knnlm.check_augmented_dtype` refuses before the
        datastore is built (a bug hunt (session 101): `__init__` refused them only after it;
        session 107: through the augmentation they lost the same precision, silently)."""
        return options.get("dtype", "float32") == "float32"

    def _stale(self, x_ND):
        if self.centroids is not None and x_ND is not None:
            self._cell = np.concatenate([self._cell, _assign_added(x_ND, self.centroids)])
        self._layout = None  # (chunk of each cell [M], ids [M, c]) on the host
        self._device = None  # the XLA scan's device arrays, built on the first search
        self._panels = None  # the kernel's packed chunks, likewise

    def train(self, x_ND=None) -> None:
        """Fit the cells (to `x_ND`, default the vectors added so far) and assign every vector."""
        x = self.vectors() if x_ND is None else self._vectors(x_ND, "training vectors")
        if not len(x):
            raise RetrievalError("ivf index: no vectors to train the cells on; add vectors first, "
                                 "or pass training vectors to train(x)")
        lists = self.options["lists"] or int(max(1, min(len(x) // 8, round(4 * np.sqrt(len(x))))))
        _check_lists(lists, len(x))
        self.options["lists"] = lists
        self.centroids = kmeans(x, lists, iters=self.options["iters"], seed=self.options["seed"])
        self._cell = np.asarray(_nearest(jnp.asarray(self.vectors()), jnp.asarray(self.centroids)),
                                np.int32)
        self._stale(None)

    def check_build(self, n: int, *, first: int | None = None) -> None:
        """`Index.check_build`: `lists` cells past the n vectors they are trained on (all
        those added before the first search), or impl="kernel" where the kernel cannot run."""
        if self.options["lists"]:
            _check_lists(self.options["lists"], n)
        if self.options["impl"] == "kernel":
            self.uses_kernel()  # raises, saying why

    def kernel_blocker(self) -> str | None:
        """Why this index's searches cannot run the scan kernel (None: they can)."""
        if self.options["dtype"] != "float32":
            return f"dtype={self.options['dtype']!r} (the kernel stores float32)"
        return exact.KERNEL.blocker()

    def uses_kernel(self) -> bool:
        """Whether searches run the scan kernel (`impl` and `kernel_blocker`)."""
        return exact.uses_kernel(self, "the IVF scan kernel")

    def prepare(self) -> None:
        """Train if need be and build what searches read (the packed chunks or the XLA
        arrays) now, not on the first search."""
        if self.uses_kernel():
            self._packed()
        else:
            self._chunks()

    def _chunk_layout(self):
        """(chunk_of_cell [M], ids [M, c] int64, -1 padding): every cell's ids in order, cut
        into chunks of c rows."""
        if self._layout is None:
            if self.centroids is None:
                self.train()
            cell = self._cell
            sizes = np.bincount(cell, minlength=len(self.centroids))
            c = _rows(self.options["chunk"]
                      or int(max(8, -(-2 * len(cell) // len(self.centroids)))))
            per_cell = -(-sizes // c)  # chunks of each cell (0 for an empty one)
            order = np.argsort(cell, kind="stable")  # ids grouped by cell, ascending within
            chunk_of_cell = np.repeat(np.arange(len(sizes)), per_cell)
            ids = np.full((len(chunk_of_cell), c), -1, np.int64)
            first_chunk = np.cumsum(per_cell) - per_cell
            starts = np.cumsum(sizes) - sizes
            rank = np.arange(len(cell)) - starts[cell[order]]  # position within its cell
            ids[first_chunk[cell[order]] + rank // c, rank % c] = order
            self._layout = (chunk_of_cell, ids)
        return self._layout

    def _chunks(self):
        """The XLA scan's device arrays (chunk centroids [M, D], vectors [M, c, D], ids [M, c])."""
        if self._device is None:
            chunk_of_cell, ids = self._chunk_layout()
            id_Mc = jnp.asarray(ids, jnp.int32)
            self._device = (jnp.asarray(self.probe_rows(self.centroids[chunk_of_cell])),
                            _gather_chunks(jnp.asarray(self.vectors()), id_Mc, 0,
                                           self.options["dtype"], self._l2()), id_Mc)
        return self._device

    def _packed(self):
        """The kernel's arrays: chunk centroids packed for `exact.mips_top_k` [P, D, NP],
        chunks in `pack_chunks`'s layout [M, T, D, NP] and their ids [M, r]."""
        if self._panels is None:
            chunk_of_cell, ids = self._chunk_layout()
            nr = exact.layout()["np"]
            id_Mr = jnp.asarray(np.pad(ids, ((0, 0), (0, (-ids.shape[1]) % nr)),
                                       constant_values=-1), jnp.int32)
            self._panels = (jnp.asarray(exact.pack_database(
                                self.probe_rows(self.centroids[chunk_of_cell]))),
                            _gather_chunks(jnp.asarray(self.vectors()), id_Mr, nr, "float32",
                                           self._l2()),
                            id_Mr)
        return self._panels

    def _l2(self) -> bool:
        return self.options.get("metric") == "l2"

    def probe_rows(self, c_ND):
        """Centroids as the probes read them, so that a query probes its L2-nearest cells,
        those its nearest vectors are filed in (k-means' L2 cells): [c, |c|^2] against
        queries [2q, -1] for metric l2, [c, -|c|^2 / 2] against [q, 1] for ip. A review
        (session 116): ip probed by q . c alone, so a unit vector filed in the cell nearest
        it was not found for itself at nprobe=1 where another cell's centroid was longer
        (recall@10 at one probe 0.88 against 0.94 on the bench's clustered data)."""
        c_ND = np.asarray(c_ND, np.float32)
        sq_N1 = np.einsum("nd,nd->n", c_ND, c_ND)[:, None]
        return np.concatenate([c_ND, sq_N1 if self._l2() else -0.5 * sq_N1], axis=1)

    def check_k(self, k: int, *, fix: str = "raise nprobe or chunk, or lower k") -> None:
        """RetrievalError where a query cannot be given k neighbours: k is more than the
        nprobe x chunk vectors it scans. Before the cells are trained that is known only
        where `chunk` is given (a bug hunt (session 98): the kNN-LM refused nprobe=1, chunk=8
        only after its datastore was built and the cells trained); `fix` is the caller's."""
        o = self.options
        if self.centroids is None:
            if not o["chunk"]:
                return
            nprobe, c = o["nprobe"], _rows(o["chunk"])
        else:
            m, c = self._chunk_layout()[1].shape
            nprobe = min(o["nprobe"], m)
        if k > nprobe * c:
            raise RetrievalError(f"ivf index: k={k} is more than the {nprobe} x {c} "
                                 f"vectors one query scans; {fix}")

    def _search(self, q_QD, k):
        o = self.options
        m, c = self._chunk_layout()[1].shape  # trained here if need be
        self.check_k(k)
        nprobe = min(o["nprobe"], m)
        nq = len(q_QD)
        if self._l2():  # [2q, -1] . [x, |x|^2] = |q|^2 - |q - x|^2; minus |q|^2 below
            sq_Q1 = np.einsum("qd,qd->q", q_QD, q_QD)[:, None]
            q_QD = np.concatenate([2.0 * q_QD, -np.ones((nq, 1), np.float32)], axis=1)
        # the probes' queries (`probe_rows`): the scan's for l2, [q, 1] for ip
        p_QD = q_QD if self._l2() else np.concatenate([q_QD, np.ones((nq, 1), np.float32)], 1)
        if self.uses_kernel():
            centroid_PDN, chunk_MTDN, id_Mr = self._packed()
            rows = exact._pad_rows(nq, exact._QUERY_CHUNK)
            q, p = (jnp.asarray(np.pad(a, ((0, rows - nq), (0, 0)))) for a in (q_QD, p_QD))
            _, probe_QP = exact.mips_top_k(p, centroid_PDN, m, nprobe, threads=o.get("threads"))
            s, i = ivf_scan(q, probe_QP, chunk_MTDN, id_Mr, k, threads=o.get("threads"))
        else:
            centroid_MD, x_McD, id_Mc = self._chunks()
            qb = o["query_block"]
            # as the exact index's: few query counts, so few compiles (each multiple of the
            # query block had been one: a kNN-LM's batches, of varying real tokens, up to 128)
            rows = -(-exact._pad_rows(nq, exact._QUERY_CHUNK) // qb) * qb
            q, p = (jnp.asarray(np.pad(a, ((0, rows - nq), (0, 0)))) for a in (q_QD, p_QD))
            s, i = _search_fn(k, nprobe, qb)(q, p, centroid_MD, x_McD, id_Mc)
        s, i = np.asarray(s)[:nq], np.asarray(i)[:nq]
        return (s - sq_Q1 if self._l2() else s), i

    def _ready_to_save(self) -> None:
        if self.centroids is None and self.count:
            self.train()

    def _arrays(self):
        self._ready_to_save()
        if self.centroids is None:  # empty: saved and reloaded as the others (a bug hunt:
            return super()._arrays()  # "no vectors to train the cells on")
        return {**super()._arrays(), "centroids": self.centroids, "cell": self._cell}

    @classmethod
    def options_here(cls, options: dict, folder: str) -> dict:
        """`impl="kernel"` as "auto" where the kernel cannot run here (`exact.impl_here`)."""
        return exact.impl_here(options, folder)

    def _restored(self, npz):
        if "centroids" in npz.files:
            self.centroids, self._cell = npz["centroids"], npz["cell"]
        self._stale(None)

    def _restore(self, folder: str, header: dict) -> None:
        """`HostIndex._restore`, and the cells checked against the vectors: a `cell` short of
        them left the rest in no chunk, never found, and a longer one named ids past the
        count (review, session 109: searched wrong, no error)."""
        super()._restore(folder, header)
        if self.centroids is None:
            return
        c, cell, n = self.centroids, self._cell, header["count"]
        if c.ndim != 2 or c.shape[1] != self.dim or not len(c):
            raise RetrievalError(f"{folder}: arrays.npz holds centroids of shape {c.shape}, "
                                 f"the header dimension {self.dim}; save the index again")
        if (cell.shape != (n,) or cell.dtype.kind not in "iu"
                or (n and not 0 <= cell.min() <= cell.max() < len(c))):
            seen = f" in [{cell.min()}, {cell.max()}]" if cell.size and cell.ndim == 1 else ""
            raise RetrievalError(f"{folder}: arrays.npz holds cell of shape {cell.shape} "
                                 f"{cell.dtype}{seen}, not one of the {len(c)} cells for each "
                                 f"of the header's {n} vectors; save the index again")


def _data(n: int, queries: int, dim: int, kind: str, seed: int = 0):
    """(database [n, D], queries [Q, D]) float32: "gaussian" (no structure: an IVF's worst
    case) or "clustered" (sqrt(n) Gaussian centers, each vector a center plus N(0, 0.5^2)
    noise per coordinate; the queries drawn alike)."""
    rng = np.random.default_rng(seed)
    if kind == "gaussian":
        return (rng.standard_normal((n, dim), np.float32), rng.standard_normal((queries, dim), np.float32))
    centers = rng.standard_normal((max(1, int(np.sqrt(n))), dim), np.float32)

    def draw(m):
        return centers[rng.integers(0, len(centers), m)] + 0.5 * rng.standard_normal((m, dim), np.float32)
    return draw(n), draw(queries)


def time_search(n: int = 100_000, queries: int = 2000, dim: int = 128, k: int = 10, *,
                nprobes=(2, 4, 8, 16), impls=("kernel", "xla"), kernel_blocks=(QUERY_BLOCK,),
                repeats: int = 3, data: str = "clustered") -> dict:
    """Times one search of `queries` queries (best of `repeats`, after a warm call) against
    `n` vectors (`_data(kind=data)`): the exact index's default, and one trained IVF per
    impl, nprobe (and, for the kernel, query block). Returns {"exact_s", "lists", "chunks",
    "build_s", "rows": [{impl, nprobe, query_block, seconds, recall}]}, recall@k against
    the exact ids."""
    x, q = _data(n, queries, dim, data)

    def best_of(index):
        out = index.search(q, k)
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            index.search(q, k)
            best = min(best, time.perf_counter() - t0)
        return out[1], best

    truth = exact.ExactIndex(dim)
    truth.add(x)
    truth.prepare()
    truth, exact_s = best_of(truth)
    t0 = time.perf_counter()
    index = IVFIndex(dim)
    index.add(x)
    index.train()
    build_s = time.perf_counter() - t0
    out = {"exact_s": exact_s, "lists": index.options["lists"], "chunks": index._chunk_layout()[1].shape,
           "build_s": build_s, "rows": []}
    global QUERY_BLOCK
    default_block = QUERY_BLOCK
    try:
        for impl in impls:
            index.options["impl"] = impl
            index.prepare()
            for qb in kernel_blocks if impl == "kernel" else (None,):
                QUERY_BLOCK = qb or default_block
                for nprobe in nprobes:
                    index.options["nprobe"] = nprobe
                    ids, secs = best_of(index)
                    recall = float(np.mean([len(set(a) & set(b)) / k for a, b in zip(ids, truth)]))
                    out["rows"].append({"impl": impl, "nprobe": nprobe, "query_block": qb,
                                        "seconds": secs, "recall": recall})
            index._device = index._panels = None  # one impl's arrays in memory at a time
    finally:
        QUERY_BLOCK = default_block
    return out


def main(argv=None) -> None:
    """The IVF's queries/s per impl and nprobe beside the exact kernel's, with recall@k.
    Run it as `python -c "from hpnlp.retrieval import ivf; ivf.main()" --n 1000000
    --nprobe 2 4 8` (`-m` would define IVFIndex twice: the package imports this module
    first)."""
    import argparse

    p = argparse.ArgumentParser(prog="hpnlp.retrieval.ivf.main")
    p.add_argument("--n", type=int, default=100_000)
    p.add_argument("--queries", type=int, default=2000)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--nprobe", type=int, nargs="+", default=[2, 4, 8, 16])
    p.add_argument("--kernel-block", type=int, nargs="+", default=[QUERY_BLOCK],
                   help="the kernel's queries per block (QUERY_BLOCK), one row each")
    p.add_argument("--impl", nargs="+", default=["kernel", "xla"], choices=["kernel", "xla"])
    p.add_argument("--data", choices=["clustered", "gaussian"], default="clustered")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    impls = [i for i in args.impl if i == "xla" or exact.KERNEL.blocker() is None]
    what = {"gaussian": "N(0, 1)", "clustered": "sqrt(n) centers + N(0, 0.5^2)"}[args.data]
    print(f"kernel: {exact.layout() if 'kernel' in impls else exact.KERNEL.blocker()}; "
          f"cores {kernels.cores()}; data {args.data} ({what}), n {args.n}, dim {args.dim}, "
          f"queries {args.queries}, k {args.k}")
    r = time_search(args.n, args.queries, args.dim, args.k, nprobes=args.nprobe, impls=impls,
                    kernel_blocks=args.kernel_block, repeats=args.repeats, data=args.data)
    exact_qps = args.queries / r["exact_s"]
    print(f"exact (default impl): {exact_qps:10.0f} q/s; ivf: {r['lists']} lists, chunks "
          f"{r['chunks'][0]} x {r['chunks'][1]} rows, trained in {r['build_s']:.1f} s")
    recall = f"recall@{args.k}"
    print(f"{'impl':6s} {'nprobe':>6s} {'block':>5s} {'q/s':>10s} {'x exact':>8s} {recall:>9s}")
    for row in r["rows"]:
        qps = args.queries / row["seconds"]
        print(f"{row['impl']:6s} {row['nprobe']:6d} {row['query_block'] or '-':>5} {qps:10.0f} "
              f"{qps / exact_qps:8.2f} {row['recall']:9.3f}")
