"""Exact maximum inner product search: blocked products and a two-stage top-k, in bounded
memory, optionally sharded over devices.

The product Q x N is never materialized: a scan walks the database in blocks of `block`
rows, keeping each query's best K. Selecting the best K of a block is where a plain
`lax.top_k` loses (on XLA:CPU it costs about as much per score as the product itself), so
each block first takes the maximum of every `group` consecutive scores, picks the K best
groups, and selects the K best scores among only those K x group candidates. That is exact,
ties included: a group holding one of the block's K best scores (by score, then lower id)
has a maximum that ranks among the K best groups (by maximum, then lower group), because
the groups ahead of it each hold a score ahead of that one; the candidates are laid out in
id order so that the last `top_k` (stable) keeps the lower id on ties.

`shards` > 1 splits the database over that many devices (a 1-D mesh): each searches its
part, and the per-device results, gathered in device (= id) order, are merged by one more
top-k. `exact_reference` is the numpy twin the tests hold this to.

Shape letters: N database, Q queries, D dimension, K results, S shards, G groups per block.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from hpnlp.retrieval.base import HostIndex, RetrievalError, register


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
        top_s, pos = jax.lax.top_k(s_QB, k)
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


@register("exact")
class ExactIndex(HostIndex):
    """Exact MIPS by blocked products (see the module docstring).

    Options: `block` database rows per step (default 16384), `group` scores per group of the
    two-stage top-k (32), `query_block` queries per pass (1024), `shards` devices the
    database is split over (1), `dtype` of the stored vectors ("float32" | "bfloat16" |
    "float16"; the products accumulate in float32).
    """

    def __init__(self, dim: int, *, block: int = 16384, group: int = 32, query_block: int = 1024,
                 shards: int = 1, dtype: str = "float32"):
        super().__init__(dim, block=block, group=group, query_block=query_block, shards=shards,
                         dtype=dtype)
        if shards > len(jax.devices()):
            raise RetrievalError(f"shards={shards} but only {len(jax.devices())} devices are visible; "
                                 "use shards <= jax.device_count()")
        self._device = None  # [n, B, D] padded blocks, built on the first search after an add

    def _stale(self, x_ND):
        self._device = None

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
        x_nBD = self._blocks()
        nq = len(q_QD)
        qb = min(o["query_block"], _pad_rows(nq, o["query_block"]))
        rows = _pad_rows(nq, qb)
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
