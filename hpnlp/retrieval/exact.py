"""Exact maximum inner product search: a fused CPU kernel, and its XLA twin of blocked
products and a two-stage top-k, in bounded memory, optionally sharded over devices.

On a CPU backend (`impl="auto"`, one shard, float32) the search is one C++ kernel
(`mips_cpu.cc`): the database is packed once, after each add, into panels of NP rows
transposed to [P, D, NP]; a register tile of MR queries x NP rows (8 x 32 with AVX-512,
6 x 16 with AVX2) accumulates the products, and its epilogue compares each query's scores
with its current k-th best and inserts the rare winner into a sorted list of k, so the
[Q, block] scores never reach memory. Query blocks (held in L2, `qb` tuned per CPU by
`hpnlp.kernels.tuning`) are spread over the cores; each walks the panels in id order, and
a candidate enters only if it beats the k-th score strictly, after equal scores: ties keep
the lower id, as below. `main()` times it against the twin and the machine's matrix-product
rate (pinned to one core: `taskset -c 0 python -c "from hpnlp.retrieval import exact;
exact.main()" --n 100000`).

The XLA path (`impl="xla"`, and wherever the kernel cannot run) never materializes the
product Q x N either: a scan walks the database in blocks of `block` rows, keeping each
query's best K. Selecting the best K of a block is where a plain `lax.top_k` loses (on
XLA:CPU it costs about as much per score as the product itself), so each block first takes
the maximum of every `group` consecutive scores, picks the K best groups, and selects the K
best scores among only those K x group candidates. That is exact, ties included: a group
holding one of the block's K best scores (by score, then lower id) has a maximum that ranks
among the K best groups (by maximum, then lower group), because the groups ahead of it each
hold a score ahead of that one; the candidates are laid out in id order so that the last
`top_k` (stable) keeps the lower id on ties.

The same source holds the IVF's scan of probed chunks (`hpnlp.retrieval.ivf`), which
reads the same panels with the same tile and lists; one build serves both (`KERNEL`).

`shards` > 1 splits the database over that many devices (a 1-D mesh): each searches its
part, and the per-device results, gathered in device (= id) order, are merged by one more
top-k. `exact_reference` is the numpy twin the tests hold this to.

Shape letters: N database, Q queries, D dimension, K results, S shards, G groups per block,
P panels of NP rows (the kernel's packed database).
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from hpnlp import kernels
from hpnlp.kernels import tuning
from hpnlp.retrieval.base import HostIndex, RetrievalError, check_at_least, register

# One build of mips_cpu.cc serves both its targets: this module's search and the IVF's
# scan of probed chunks (`hpnlp.retrieval.ivf`), which shares its tile and epilogue.
KERNEL = kernels.CpuKernel(
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "mips_cpu.cc"),
    {"hpnlp_mips_top_k": "HpnlpMipsTopK", "hpnlp_ivf_scan": "HpnlpIvfScan"},
    what="the MIPS kernels (exact, IVF scan)")
IMPLS = ("auto", "kernel", "xla")
DTYPES = ("float32", "bfloat16", "float16")  # what an index may store its vectors as


def check_options(index, *, at_least: dict[str, int]) -> None:
    """One line for an option out of range (`at_least`: name -> its least value, each an
    integer) or a `dtype` an index cannot store vectors as (an integer dtype would round
    every vector silently), before anything is built."""
    # threads: None (every core) or a count (a bug hunt: 0 failed at the first search, after
    # the kNN-LM's datastore was built, naming query_block; "two" was a traceback)
    check_at_least(index, {**at_least, **({"threads": 1} if index.options.get("threads")
                                          is not None else {})})
    if index.options["dtype"] not in DTYPES:
        raise RetrievalError(f"{index.registry_name} index: dtype={index.options['dtype']!r}; "
                             f"use one of {DTYPES}")
# Below this many multiply-adds one thread beats starting more (a thread start costs
# 0.1-3 ms on a busy 2-core machine; 2^21 multiply-adds take about 0.1 ms).
_MIN_PARALLEL_MACS = 1 << 21
_QUERY_CHUNK = 256  # kernel queries are padded as `_pad_rows(Q, 256)`: few compiles


def _probe(lib, cfg):
    args = [PROBE["n"], PROBE["D"], PROBE["Q"], PROBE["k"], cfg["qb"], kernels.cores()]
    return tuning.run_probe(lib, "hpnlp_mips_probe", args, "the exact MIPS tuning probe", cfg)


# Queries per block: the block is packed and held in L2 (qb x D x 4 bytes: 128 KB at 256 x
# 128, of a 1 MB L2 on Zen 4) while the database streams past it once; larger blocks
# stream the database fewer times, smaller ones leave more of L2 to the panels.
PROBE = dict(n=16384, D=128, Q=1024, k=10)
TUNING = tuning.Tuning(KERNEL, "search", default={"qb": 256},
                       candidates=[{"qb": qb} for qb in (64, 128, 256, 512, 1024)],
                       probe=_probe, shape=" ".join(f"{k}={v}" for k, v in PROBE.items()))


@functools.lru_cache(maxsize=None)
def layout() -> dict[str, int | str]:
    """The kernel build's path and tiles: {"path", "np" rows per panel, "mr" queries per
    register tile}."""
    lib = KERNEL.library()
    lib.hpnlp_mips_layout.restype = ctypes.c_int64
    v = [lib.hpnlp_mips_layout(ctypes.c_int64(i)) for i in range(3)]
    return {"path": ("portable", "avx2", "avx512")[v[0]], "np": v[1], "mr": v[2]}


def pack_database(x_ND) -> np.ndarray:
    """The kernel's database layout: rows padded with zeros to panels of NP, each panel
    transposed, [P, D, NP] float32 (a step d of a panel: NP rows' d-th coordinates)."""
    x_ND = np.asarray(x_ND, np.float32)
    nr = layout()["np"]
    p = max(1, -(-len(x_ND) // nr))
    x = np.zeros((p * nr, x_ND.shape[1]), np.float32)
    x[:len(x_ND)] = x_ND
    return np.ascontiguousarray(x.reshape(p, nr, -1).transpose(0, 2, 1))


def mips_top_k(q_QD, db_PDN, count: int, k: int, *, threads: int | None = None,
               query_block: int | None = None):
    """The kernel: top-k inner products of queries [Q, D] against the first `count` rows
    of a database packed by `pack_database`. Returns (scores [Q, K] float32, ids [Q, K]
    int32), ties to the lower id. `threads` None: every core (one for tiny searches);
    `query_block` None: the tuned one."""
    KERNEL.library()  # built and its target registered (raises, saying why, if it cannot be)
    q_QD = jnp.asarray(q_QD, jnp.float32)
    nq, d = q_QD.shape
    if threads is None:
        threads = 1 if nq * int(count) * d < _MIN_PARALLEL_MACS else kernels.cores()
    qb = TUNING.config()["qb"] if query_block is None else int(query_block)
    if int(threads) < 1 or qb < 1:
        raise RetrievalError(f"threads={threads} and query_block={qb} must be >= 1")
    # a block past the Q queries is one block of them all; unclamped, the kernel's C int
    # overflowed (2^31 - 1, sys.maxsize) and it divided by zero (SIGFPE: review r5)
    qb = min(qb, max(nq, 1))
    return _kernel_fn(int(k), int(count), int(threads), qb)(q_QD, db_PDN)


@functools.lru_cache(maxsize=None)
def _kernel_fn(k: int, count: int, threads: int, qb: int):
    def call(q_QD, db_PDN):
        nq = q_QD.shape[0]
        out = (jax.ShapeDtypeStruct((nq, k), jnp.float32), jax.ShapeDtypeStruct((nq, k), jnp.int32))
        return jax.ffi.ffi_call("hpnlp_mips_top_k", out, vmap_method="sequential")(
            q_QD, db_PDN, count=np.int64(count), threads=np.int64(threads), qb=np.int64(qb))
    return jax.jit(call)


def exact_reference(q_QD, x_ND, k: int):
    """numpy brute force: scores, ids of the top k by (score desc, id asc)."""
    s_QN = np.asarray(q_QD, np.float64) @ np.asarray(x_ND, np.float64).T
    order = np.argsort(-s_QN, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(s_QN, order, 1).astype(np.float32), order.astype(np.int64)


def _merge(best_s, best_i, s, i, k):
    """Best k of two candidate lists laid out in id order (ties keep the earlier)."""
    all_s = jnp.concatenate([best_s, s], axis=1)
    all_i = jnp.concatenate([best_i, i], axis=1)
    top_s, pos = jax.lax.top_k(all_s, k)
    return top_s, jnp.take_along_axis(all_i, pos, axis=1)


def _block_top_k(s_QB, ids_B, k: int, group: int):
    """Best k of one block of scores [Q, B] (two-stage where the block holds > k groups)."""
    q, b = s_QB.shape
    if group <= 1 or b % group or b // group <= k:
        # a block of fewer than k rows gives them all (found in review: top_k refused it);
        # `_merge` keeps the best k of the running list and these
        top_s, pos = jax.lax.top_k(s_QB, min(k, b))
        return top_s, ids_B[pos]
    s_QGg = s_QB.reshape(q, b // group, group)
    _, g_QK = jax.lax.top_k(s_QGg.max(axis=2), k)
    g_QK = jnp.sort(g_QK, axis=1)  # candidates in id order: the final top_k breaks ties by id
    cand_s = jnp.take_along_axis(s_QGg, g_QK[:, :, None], axis=1).reshape(q, k * group)
    cand_pos = (g_QK[:, :, None] * group + jnp.arange(group)[None, None, :]).reshape(q, k * group)
    top_s, pos = jax.lax.top_k(cand_s, k)
    return top_s, ids_B[jnp.take_along_axis(cand_pos, pos, axis=1)]


def blocked_top_k(q_QD, x_nBD, count, k: int, *, group: int = 32, first_id=0):
    """Top-k inner products of queries [Q, D] against a database stored as blocks
    [n, B, D] (rows past `count` are padding and never returned). Jittable; memory
    O(Q x B). Returns (scores [Q, K] float32, ids [Q, K] int32)."""
    q_QD = q_QD.astype(jnp.float32)
    nq, nb = q_QD.shape[0], x_nBD.shape[1]

    def body(carry, blk):
        j, x_BD = blk
        ids_B = first_id + j * nb + jnp.arange(nb, dtype=jnp.int32)
        s_QB = jnp.dot(q_QD, x_BD.astype(jnp.float32).T, precision=jax.lax.Precision.HIGHEST)
        s_QB = jnp.where(ids_B[None, :] < count, s_QB, -jnp.inf)
        s, i = _block_top_k(s_QB, ids_B, k, group)
        return _merge(*carry, s, i, k), None

    init = (jnp.full((nq, k), -jnp.inf, jnp.float32), jnp.zeros((nq, k), jnp.int32))
    (s, i), _ = jax.lax.scan(body, init, (jnp.arange(x_nBD.shape[0], dtype=jnp.int32), x_nBD))
    return s, i


def _padded_dim(d: int) -> int:
    """Dimensions padded to a multiple of 16 with zeros (the kNN-LM's 129-wide keys
    [k, |k|^2]): XLA:CPU's product is faster on aligned rows, and zeros change no score."""
    return d if d % 16 == 0 or d < 16 else -(-d // 16) * 16


def _pad_rows(n: int, chunk: int) -> int:
    """Queries padded to a power of two below `chunk`, to a multiple of it above: few compiles."""
    if n >= chunk:
        return -(-n // chunk) * chunk
    return 1 << max(0, (n - 1).bit_length())


def impl_here(options, folder: str) -> dict:
    """`impl="kernel"` loaded where the kernel cannot run (`KERNEL.blocker()`) as "auto",
    said in one line: a search layout, not data, as `shards` (review, session 109: an index
    saved with it on a CPU could not be searched on a GPU host, and `load` takes no
    options)."""
    if not isinstance(options, dict) or options.get("impl") != "kernel":
        return options
    reason = KERNEL.blocker()
    if reason is None:
        return options
    print(f"hpnlp.retrieval: {folder}: saved with impl='kernel', searched here with "
          f"impl='auto' (the kernel cannot run here: {reason})", file=sys.stderr, flush=True)
    return {**options, "impl": "auto"}


def uses_kernel(index: HostIndex, what: str) -> bool:
    """Whether `index`'s searches run its CPU kernel: its `impl` option ("xla": never;
    "kernel": always, else an error naming `index.kernel_blocker()`; "auto": where that is
    None)."""
    impl = index.options.get("impl", "auto")
    if impl == "xla":
        return False
    reason = index.kernel_blocker()
    if reason is not None and impl == "kernel":
        raise RetrievalError(f"impl='kernel': {what} cannot run here: {reason}; "
                             "use impl='auto' or 'xla'")
    return reason is None


@register("exact")
class ExactIndex(HostIndex):
    """Exact MIPS: the fused CPU kernel, or blocked XLA products (see the module docstring).

    Options: `impl` "auto" (the fused kernel where it can run: a CPU backend with a
    compiler, one shard, float32; the XLA path elsewhere), "kernel" (an error where it
    cannot run) or "xla"; `threads` of the kernel (None: every core). The XLA path's:
    `block` database rows per step (default 16384), `group` scores per group of the
    two-stage top-k (32), `query_block` queries per pass (1024), `shards` devices the
    database is split over (1), `dtype` of the stored vectors ("float32" | "bfloat16" |
    "float16"; the products accumulate in float32).
    """

    def __init__(self, dim: int, *, block: int = 16384, group: int = 32, query_block: int = 1024,
                 shards: int = 1, dtype: str = "float32", impl: str = "auto",
                 threads: int | None = None):
        super().__init__(dim, block=block, group=group, query_block=query_block, shards=shards,
                         dtype=dtype, impl=impl, threads=threads)
        check_options(self, at_least={"block": 1, "group": 1, "query_block": 1, "shards": 1})
        if shards > len(jax.devices()):
            raise RetrievalError(f"shards={shards} but only {len(jax.devices())} devices are visible; "
                                 "use shards <= jax.device_count()")
        if impl not in IMPLS:
            raise RetrievalError(f"impl={impl!r}; use one of {IMPLS}")
        self._device = None  # [n, B, D] padded blocks, built on the first search after an add
        self._panels = None  # the kernel's [P, D, NP] packed database, likewise

    @classmethod
    def options_here(cls, options: dict, folder: str) -> dict:
        """`shards` at most the devices here, said in one line: a search layout, not data (a
        bug hunt (session 101): an index saved on 4 devices was refused on 1, naming no
        folder, and `load` takes no options); `impl_here` likewise."""
        shards = options.get("shards", 1) if isinstance(options, dict) else 1
        n = jax.device_count()
        if isinstance(shards, (int, np.integer)) and not isinstance(shards, bool) and shards > n:
            print(f"hpnlp.retrieval: {folder}: saved with shards={shards}, searched here over "
                  f"the {n} device(s) there are (shards={n})", file=sys.stderr, flush=True)
            options = {**options, "shards": n}
        return impl_here(options, folder)

    def _stale(self, x_ND):
        self._device = self._panels = None

    def check_build(self, n: int, *, first: int | None = None) -> None:
        """`Index.check_build`: impl="kernel" where the kernel cannot run here."""
        if self.options["impl"] == "kernel":
            self.uses_kernel()  # raises, saying why

    def kernel_blocker(self) -> str | None:
        """Why this index's searches cannot run the fused kernel (None: they can)."""
        o = self.options
        if o["shards"] != 1:
            return f"shards={o['shards']} (the kernel searches one device's memory)"
        if o["dtype"] != "float32":
            return f"dtype={o['dtype']!r} (the kernel stores float32)"
        return KERNEL.blocker()

    def uses_kernel(self) -> bool:
        """Whether searches run the fused kernel (`impl` and `kernel_blocker`)."""
        return uses_kernel(self, "the exact MIPS kernel")

    def prepare(self) -> None:
        """Build what searches read (the packed panels or the XLA blocks) now, not on the
        first search; nothing where nothing was added."""
        if not self.count:  # a review (session 114): the XLA blocks of none failed to reshape
            return
        if self.uses_kernel():
            self._packed()
        else:
            self._blocks()

    def _packed(self):
        if self._panels is None:
            self._panels = jnp.asarray(pack_database(self.vectors()))
        return self._panels

    def _blocks(self):
        if self._device is None:
            o = self.options
            x = self.vectors()
            shards = o["shards"]
            block = min(o["block"], max(8, _pad_rows(-(-len(x) // shards), o["block"])))
            n = -(-len(x) // (block * shards)) * shards
            x_nBD = np.zeros((n * block, _padded_dim(self.dim)), np.float32)
            x_nBD[:len(x), :self.dim] = x  # zero rows and columns: the products are unchanged
            x_nBD = jnp.asarray(x_nBD.reshape(n, block, -1), dtype=jnp.dtype(o["dtype"]))
            if shards > 1:
                mesh = Mesh(np.array(jax.devices()[:shards]), ("db",))
                x_nBD = jax.device_put(x_nBD, NamedSharding(mesh, P("db")))
            self._device = x_nBD
        return self._device

    def _search(self, q_QD, k):
        o = self.options
        if self.uses_kernel():
            nq = len(q_QD)
            q = np.zeros((_pad_rows(nq, _QUERY_CHUNK), self.dim), np.float32)
            q[:nq] = q_QD
            s, i = mips_top_k(q, self._packed(), self.count, k, threads=o.get("threads"))
            return np.asarray(s)[:nq], np.asarray(i)[:nq]
        x_nBD = self._blocks()
        nq = len(q_QD)
        qb = min(o["query_block"], _pad_rows(nq, o["query_block"]))
        # a whole number of passes of qb rows: _pad_rows alone gave 1024 rows for 600 queries
        # and query_block=1000, which the reshape into passes refused (a bug hunt, session 107)
        rows = -(-nq // qb) * qb
        q = np.zeros((rows, x_nBD.shape[2]), np.float32)
        q[:nq, :self.dim] = q_QD
        # Large k: smaller groups, so the second stage stays a small fraction of the block.
        group = max(1, min(o["group"], x_nBD.shape[1] // (8 * k)))
        s, i = _search_fn(k, group, qb, o["shards"])(jnp.asarray(q), x_nBD, self.count)
        return np.asarray(s)[:nq], np.asarray(i)[:nq]


@functools.lru_cache(maxsize=None)
def _search_fn(k: int, group: int, query_block: int, shards: int):
    """The jitted search for one (k, group, query_block, shards); queries in passes of
    `query_block` rows, the database sharded over `shards` devices."""

    def local(q_QD, x_nBD, count, first_id):
        one = lambda q: blocked_top_k(q, x_nBD, count, k, group=group, first_id=first_id)  # noqa: E731
        s, i = jax.lax.map(one, q_QD.reshape(-1, query_block, q_QD.shape[1]))
        return s.reshape(-1, k), i.reshape(-1, k)

    if shards == 1:
        return jax.jit(lambda q, x, count: local(q, x, count, 0))
    mesh = Mesh(np.array(jax.devices()[:shards]), ("db",))

    def sharded(q_QD, x_nBD, count):
        first = jax.lax.axis_index("db") * x_nBD.shape[0] * x_nBD.shape[1]
        s, i = local(q_QD, x_nBD, count, first)
        s_SQK = jax.lax.all_gather(s, "db")
        i_SQK = jax.lax.all_gather(i, "db")
        # device order is id order, so a stable top-k over [shard 0's K, shard 1's K, ...]
        # keeps the lower id on ties
        all_s = jnp.moveaxis(s_SQK, 0, 1).reshape(s.shape[0], -1)
        all_i = jnp.moveaxis(i_SQK, 0, 1).reshape(s.shape[0], -1)
        top_s, pos = jax.lax.top_k(all_s, k)
        return top_s, jnp.take_along_axis(all_i, pos, axis=1)

    fn = jax.shard_map(sharded, mesh=mesh, in_specs=(P(), P("db"), P()), out_specs=(P(), P()),
                       check_vma=False)
    return jax.jit(fn)


def time_search(n: int = 100_000, queries: int = 2000, dim: int = 128, k: int = 10, *,
                repeats: int = 3, impls=("kernel", "xla")) -> dict[str, float]:
    """Seconds (best of `repeats`, after a warm call) of one search of `queries` Gaussian
    queries against `n` Gaussian vectors, per `impl`; the ids of every impl must agree."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, dim), np.float32)
    q = rng.standard_normal((queries, dim), np.float32)
    out, ids = {}, {}
    for impl in impls:
        index = ExactIndex(dim, impl=impl)
        index.add(x)
        index.prepare()
        _, ids[impl] = index.search(q, k)
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            index.search(q, k)
            best = min(best, time.perf_counter() - t0)
        out[impl] = best
    first = ids[impls[0]]
    for impl in impls[1:]:
        agree = float(np.mean(ids[impl] == first))
        if agree < 0.999:  # Gaussian data: products may round differently, ties are rare
            raise AssertionError(f"{impl} ids agree with {impls[0]}'s on only {agree:.4f}")
    return out


def main(argv=None) -> None:
    """The kernel and the XLA twin in GFLOP/s (2 n D Q
    flops a search) beside the f32 matrix-product rate (`hpnlp.bench.harness`). Run it as
    `python -c "from hpnlp.retrieval import exact; exact.main()" [--n N ...]` (`-m` would
    define ExactIndex twice: the package imports this module first)."""
    import argparse

    from hpnlp.bench import harness
    p = argparse.ArgumentParser(prog="hpnlp.retrieval.exact.main")
    p.add_argument("--n", type=int, default=100_000)
    p.add_argument("--queries", type=int, default=2000)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    impls = ("kernel", "xla") if KERNEL.blocker() is None else ("xla",)
    print(f"kernel: {layout() if 'kernel' in impls else KERNEL.blocker()}; "
          f"qb {TUNING.config() if 'kernel' in impls else '-'}; cores {kernels.cores()}")
    rate = harness.matmul_rate(min_time_s=0.5)
    secs = time_search(args.n, args.queries, args.dim, args.k, repeats=args.repeats, impls=impls)
    rate = max(rate, harness.matmul_rate(min_time_s=0.5))
    flops = 2.0 * args.n * args.dim * args.queries
    print(f"f32 matmul (2048^3): {rate:.1f} GFLOP/s")
    for impl, t in secs.items():
        print(f"{impl:6s} {t * 1e3:9.1f} ms {flops / t / 1e9:7.1f} GFLOP/s "
              f"{flops / t / 1e9 / rate:5.2f} of matmul")
