"""hpnlp's own approximate MIPS: an inverted file (IVF) over k-means cells, jittable.

Jégou et al. 2011 (the IVF of faiss): k-means (in JAX) splits the database into `lists`
cells; a query scores the cell centroids, scans only the vectors of its best cells, and
returns their top k exactly scored. The one idea that makes it fast: a query touches
`nprobe x chunk` vectors instead of N.

To stay jittable with static shapes, every cell is cut into **chunks** of at most `chunk`
vectors (default twice the mean cell size), each padded and stored as one contiguous
[chunk, D] slab; a long cell simply spans several chunks with the same centroid, which
`top_k` over centroid scores probes side by side. `nprobe` counts chunks, so the work per
query is fixed whatever k-means' balance. `search_chunks` is the pure function the
index jits (usable inside a larger jitted program).

Shape letters: N database, Q queries, D dimension, C cells, M chunks, c chunk rows,
P probes, K results.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from hpnlp.retrieval.base import HostIndex, RetrievalError, register


def _nearest(x_ND, c_CD, block: int = 16384):
    """Index of the nearest centroid (L2) of every row, in blocks of rows."""
    half_norm_C = 0.5 * jnp.sum(c_CD * c_CD, axis=1)
    n = x_ND.shape[0]
    pad = (-n) % block if n > block else 0
    xs = jnp.pad(x_ND, ((0, pad), (0, 0))).reshape(-1, min(block, n), x_ND.shape[1])
    near = jax.lax.map(lambda x: jnp.argmax(x @ c_CD.T - half_norm_C[None, :], axis=1), xs)
    return near.reshape(-1)[:n]


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


def search_chunks(q_QD, centroid_MD, x_McD, id_Mc, k: int, nprobe: int):
    """Approximate top-k: each query scans the `nprobe` chunks whose centroids score best.
    `centroid_MD` is each chunk's cell centroid; `id_Mc` -1 marks padding. Returns
    (scores [Q, K], ids [Q, K]); an id of -1 (score -inf) only where fewer than k real
    vectors were scanned."""
    probe_QP = jax.lax.top_k(q_QD @ centroid_MD.T, nprobe)[1]
    x_QPcD = x_McD[probe_QP]
    s_QPc = jnp.einsum("qd,qpcd->qpc", q_QD, x_QPcD.astype(jnp.float32),
                       precision=jax.lax.Precision.HIGHEST)
    id_QPc = id_Mc[probe_QP]
    s_QPc = jnp.where(id_QPc >= 0, s_QPc, -jnp.inf)
    q = q_QD.shape[0]
    top_s, pos = jax.lax.top_k(s_QPc.reshape(q, -1), k)
    return top_s, jnp.take_along_axis(id_QPc.reshape(q, -1), pos, axis=1)


@functools.lru_cache(maxsize=None)
def _search_fn(k: int, nprobe: int, query_block: int):
    def run(q_QD, centroid_MD, x_McD, id_Mc):
        one = lambda q: search_chunks(q, centroid_MD, x_McD, id_Mc, k, nprobe)  # noqa: E731
        s, i = jax.lax.map(one, q_QD.reshape(-1, query_block, q_QD.shape[1]))
        return s.reshape(-1, k), i.reshape(-1, k)
    return jax.jit(run)


@register("ivf")
class IVFIndex(HostIndex):
    """Inverted file over k-means cells (see the module docstring).

    Options: `lists` k-means cells (default: about 4 sqrt(N), set on the first search),
    `nprobe` chunks scanned per query (16), `chunk` rows per chunk (0: twice the mean cell
    size), `iters` k-means steps (15), `query_block` queries per pass (32), `dtype` of the
    stored vectors ("float32" | "bfloat16"), `seed`. The cells are trained on the vectors
    present at the first search (or `train`); later adds join the nearest cell.
    """

    def __init__(self, dim: int, *, lists: int = 0, nprobe: int = 16, chunk: int = 0,
                 iters: int = 15, query_block: int = 32, dtype: str = "float32", seed: int = 0):
        super().__init__(dim, lists=lists, nprobe=nprobe, chunk=chunk, iters=iters,
                         query_block=query_block, dtype=dtype, seed=seed)
        self.centroids = None  # [C, D]
        self._cell = np.zeros((0,), np.int32)  # [N] cell of every vector
        self._device = None

    def _stale(self, x_ND):
        if self.centroids is not None:
            self._cell = np.concatenate([self._cell, np.asarray(
                _nearest(jnp.asarray(x_ND), jnp.asarray(self.centroids)), np.int32)])
        self._device = None

    def train(self, x_ND=None) -> None:
        """Fit the cells (to `x_ND`, default the vectors added so far) and assign every vector."""
        x = self.vectors() if x_ND is None else self._vectors(x_ND, "training vectors")
        lists = self.options["lists"] or int(max(1, min(len(x) // 8, round(4 * np.sqrt(len(x))))))
        if lists > len(x):
            raise RetrievalError(f"ivf index: lists={lists} cells but only {len(x)} training vectors; "
                                 f"use lists <= {len(x)} or add more vectors first")
        self.options["lists"] = lists
        self.centroids = kmeans(x, lists, iters=self.options["iters"], seed=self.options["seed"])
        self._cell = np.asarray(_nearest(jnp.asarray(self.vectors()), jnp.asarray(self.centroids)),
                                np.int32)
        self._device = None

    def _chunks(self):
        """Device arrays (chunk centroids [M, D], vectors [M, c, D], ids [M, c])."""
        if self._device is None:
            if self.centroids is None:
                self.train()
            x, cell = self.vectors(), self._cell
            sizes = np.bincount(cell, minlength=len(self.centroids))
            c = self.options["chunk"] or int(max(8, -(-2 * len(x) // len(self.centroids))))
            c = -(-c // 8) * 8
            per_cell = -(-sizes // c)  # chunks of each cell (0 for an empty one)
            order = np.argsort(cell, kind="stable")  # ids grouped by cell, ascending within
            chunk_of_cell = np.repeat(np.arange(len(sizes)), per_cell)
            m = len(chunk_of_cell)
            ids = np.full((m, c), -1, np.int64)
            first_chunk = np.cumsum(per_cell) - per_cell
            starts = np.cumsum(sizes) - sizes
            rank = np.arange(len(x)) - starts[cell[order]]  # position within its cell
            ids[first_chunk[cell[order]] + rank // c, rank % c] = order
            vecs = np.zeros((m, c, self.dim), np.float32)
            real = ids >= 0
            vecs[real] = x[ids[real]]
            dt = jnp.dtype(self.options["dtype"])
            self._device = (jnp.asarray(self.centroids[chunk_of_cell]), jnp.asarray(vecs, dt),
                            jnp.asarray(ids, jnp.int32))
        return self._device

    def _search(self, q_QD, k):
        centroid_MD, x_McD, id_Mc = self._chunks()
        nprobe = min(self.options["nprobe"], len(centroid_MD))
        if k > nprobe * x_McD.shape[1]:
            raise RetrievalError(f"ivf index: k={k} is more than the {nprobe} x {x_McD.shape[1]} "
                                 "vectors one query scans; raise nprobe or chunk, or lower k")
        qb = self.options["query_block"]
        rows = -(-len(q_QD) // qb) * qb
        q = np.zeros((rows, self.dim), np.float32)
        q[:len(q_QD)] = q_QD
        s, i = _search_fn(k, nprobe, qb)(jnp.asarray(q), centroid_MD, x_McD, id_Mc)
        return np.asarray(s)[:len(q_QD)], np.asarray(i)[:len(q_QD)]

    def _arrays(self):
        if self.centroids is None:
            self.train()
        return {**super()._arrays(), "centroids": self.centroids, "cell": self._cell}

    def _restored(self, npz):
        self.centroids, self._cell = npz["centroids"], npz["cell"]
